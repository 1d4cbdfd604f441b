"""Small corners where a drop-in must answer exactly as grpc does, on every pair (the
grpc<->grpc reference included): the user-agent a handler sees, an OK call's details and
debug string, and a server's ``__del__``."""
from __future__ import annotations

import asyncio
import json
import random
import re
import time
from concurrent import futures
from typing import Any, Callable, Optional

import grpc
import pytest

from tests.support import inproc
from tests.support.clients import UNLIMITED_SERVER_ARGS, Client
from tests.support.procs import ServerProcess

# grpc's own part, as grpc-python composes it ("grpc-python/1.85.1 grpc-c/58.0.0 (linux;
# chttp2)"); the user's primary part goes before it and the secondary one after.
GRPC_UA = re.escape(f"grpc-python/{grpc.__version__} ") + r"grpc-c/[0-9.]+ \([a-z]+; chttp2\)"
UA_CASES = {
    "default": ([], rf"^{GRPC_UA}$"),
    "primary": ([("grpc.primary_user_agent", "prim/1")], rf"^prim/1 {GRPC_UA}$"),
    "secondary": ([("grpc.secondary_user_agent", "sec/2")], rf"^{GRPC_UA} sec/2$"),
    "both": ([("grpc.primary_user_agent", "prim/1"), ("grpc.secondary_user_agent", "sec/2")],
             rf"^prim/1 {GRPC_UA} sec/2$"),
}


@pytest.mark.parametrize("case", list(UA_CASES))
def test_handler_sees_grpcs_user_agent_first(case: str, pair: tuple[str, str], servers: Any,
                                             connect: Callable[..., Client]) -> None:
    options, pattern = UA_CASES[case]
    server: ServerProcess = servers.get(pair[1], UNLIMITED_SERVER_ARGS)
    client = connect(pair[0], server, options)
    for _ in range(2):  # the first call may have negotiated; the second is on the fast path
        # grpc drops a call's own user-agent: the channel's is the one the handler sees.
        resp = client.stub.Unary(client.req(payload=b"u"), timeout=20,
                                 metadata=[("x-a", "1"), ("user-agent", "mine/3")])
        seen = json.loads(resp.info)["metadata"]
        assert seen[0][0] == "user-agent", seen
        assert re.match(pattern, seen[0][1]), (seen[0][1], pattern)
        assert seen[1:] == [["x-a", "1"]], seen


def _ok_calls(client: Client) -> dict[str, Any]:
    """grpc.Call objects of OK calls whose handler set details (every arity)."""
    req = client.req(payload=b"x", set_details="the handler's own words")
    stub = client.stub
    _, unary = stub.Unary.with_call(req, timeout=20)
    future = stub.Unary.future(req, timeout=20)
    future.result()
    stream = stub.ServerStream(req, timeout=20)
    list(stream)
    _, client_stream = stub.ClientStream.with_call(iter([req]), timeout=20)
    bidi = stub.Bidi(iter([req]), timeout=20)
    list(bidi)
    return {"unary": unary, "future": future, "server_stream": stream,
            "client_stream": client_stream, "bidi": bidi}


def test_ok_call_has_empty_details_and_debug_string(client: Client) -> None:
    for kind, call in _ok_calls(client).items():
        assert call.code() == grpc.StatusCode.OK, kind
        assert call.details() == "", (kind, call.details())
        assert call.debug_error_string() == "", (kind, call.debug_error_string())


@pytest.mark.parametrize("stack", ["argrpc", "grpc"])
def test_server_del_stops_it(stack: str) -> None:
    """grpc's server defines __del__, and code calls it to stop a server."""
    import argrpc

    mod: Any = argrpc if stack == "argrpc" else grpc
    server = mod.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t", {"U": grpc.unary_unary_rpc_method_handler(lambda r, c: b"ok")}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = mod.insecure_channel(f"127.0.0.1:{port}")
    try:
        assert channel.unary_unary("/t/U")(b"", timeout=20) == b"ok"
        server.__del__()
        assert server.wait_for_termination(timeout=10) is False, "still serving after __del__"
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/t/U")(b"", timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        channel.close()
        server.stop(None)


def test_unstarted_server_del_is_harmless() -> None:
    import argrpc

    server = argrpc.server(futures.ThreadPoolExecutor(max_workers=1))
    server.__del__()
    server.__del__()


def _echo_server(mod: Any, port: int) -> tuple[Any, int]:
    server = mod.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t", {"U": grpc.unary_unary_rpc_method_handler(lambda r, c: b"ok")}),))
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, port


@pytest.mark.parametrize("stack", ["argrpc", "grpc"])
def test_channel_reconnects_to_a_server_restarted_in_process(stack: str) -> None:
    """server.stop() closes its fast-path connections (the client sees them go, as it
    sees grpc's GOAWAY), so a channel's next call reaches the new server on the port."""
    import argrpc

    mod: Any = argrpc if stack == "argrpc" else grpc
    first, port = _echo_server(mod, 0)
    channel = mod.insecure_channel(f"127.0.0.1:{port}")
    second = None
    try:
        assert channel.unary_unary("/t/U")(b"", timeout=20) == b"ok"
        first.stop(None)
        second, _ = _echo_server(mod, port)
        assert channel.unary_unary("/t/U")(b"", timeout=20, wait_for_ready=True) == b"ok"
        assert channel.unary_unary("/t/U")(b"", timeout=20) == b"ok"
        if stack == "argrpc":
            assert channel.transport == "shm", channel.fallback_reason
    finally:
        channel.close()
        first.stop(None)
        if second is not None:
            second.stop(None)


# What grpc refuses as channel or server options, each with a ValueError when the object is
# made (grpc unpacks every item as a (key, value) pair); an empty mapping it takes.
BAD_OPTIONS = {"mapping": {"foo": "bar"}, "one-item": (("key",),), "string": "str",
               "triple": [("a", 1, 2)]}


@pytest.mark.parametrize("case", list(BAD_OPTIONS))
@pytest.mark.parametrize("stack", ["grpc", "argrpc"])
def test_bad_options_are_refused_as_grpc_refuses_them(stack: str, case: str) -> None:
    import asyncio

    import argrpc
    import argrpc.aio  # noqa: F401 - a submodule, as grpc.aio is

    mod: Any = grpc if stack == "grpc" else argrpc
    options = BAD_OPTIONS[case]
    with pytest.raises(ValueError):
        mod.insecure_channel("localhost:1", options=options)
    with pytest.raises(ValueError):
        mod.server(futures.ThreadPoolExecutor(1), options=options)

    async def aio() -> None:
        with pytest.raises(ValueError):
            mod.aio.insecure_channel("localhost:1", options=options)
        with pytest.raises(ValueError):
            mod.aio.server(options=options)
        channel = mod.aio.insecure_channel("localhost:1", options={})
        await channel.close()

    asyncio.run(aio())
    mod.insecure_channel("localhost:1", options={}).close()


class _ServerStreamingHandler:
    """A method handler the user writes: only the attributes its arity needs, as grpc
    reads them (no unary_unary, unary_stream's siblings absent too)."""

    request_streaming = False
    response_streaming = True
    request_deserializer = None
    response_serializer = None

    @staticmethod
    def unary_stream(request: bytes, context: grpc.ServicerContext) -> Any:
        yield request
        yield request[::-1]


class _OwnHandlers(grpc.GenericRpcHandler):
    def service(self, details: grpc.HandlerCallDetails) -> Any:
        return _ServerStreamingHandler() if details.method == "/t/S" else None


@pytest.mark.parametrize("stack", ["argrpc", "grpc"])
def test_a_handler_object_is_read_only_for_its_arity(stack: str) -> None:
    import argrpc

    mod: Any = argrpc if stack == "argrpc" else grpc
    server = mod.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((_OwnHandlers(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = mod.insecure_channel(f"127.0.0.1:{port}")
    try:
        assert list(channel.unary_stream("/t/S")(b"ab", timeout=20)) == [b"ab", b"ba"]
        if stack == "argrpc":
            assert channel.transport == "shm", channel.fallback_reason
            assert list(channel.unary_stream("/t/S")(b"ab", timeout=20)) == [b"ab", b"ba"]
    finally:
        channel.close()
        server.stop(None)


# What grpc's auth_context() gives for each kind of connection; the fast path answers for
# the gRPC call that negotiated it.
AUTH = {
    "insecure": {"transport_security_type": [b"insecure"], "security_level": [b"TSI_SECURITY_NONE"]},
    "local": {"transport_security_type": [b"local"], "security_level": [b"TSI_PRIVACY_AND_INTEGRITY"]},
}
PEER = {"tcp": r"^ipv4:127\.0\.0\.1:\d+$", "unix": r"^unix:"}


def _who(request: bytes, context: Any) -> tuple[str, Any, Any, Any, str]:
    return (context.peer(), context.auth_context(), context.peer_identities(),
            context.peer_identity_key(), getattr(context, "transport", "grpc"))


def _credentials(creds: str, where: str, tmp: str) -> dict[str, Any]:
    """Where to listen, and the two ends' credentials."""
    address = "127.0.0.1:0" if where == "tcp" else f"unix:{tmp}/s.sock"
    if creds == "insecure":
        return {"address": address}
    kind = (grpc.LocalConnectionType.LOCAL_TCP if where == "tcp"
            else grpc.LocalConnectionType.UDS)
    return {"address": address, "server_credentials": grpc.local_server_credentials(kind),
            "channel_credentials": grpc.local_channel_credentials(kind)}


@pytest.mark.parametrize("where", list(PEER))
@pytest.mark.parametrize("creds", list(AUTH))
@pytest.mark.parametrize("api", ["threaded", "aio"])
@pytest.mark.parametrize("stack", ["grpc", "argrpc"])
def test_a_handler_sees_grpcs_peer_and_auth_context(stack: str, api: str, creds: str, where: str,
                                                    tmp_path: Any) -> None:
    """peer() is the address the client negotiated from, in grpc's form, and the auth
    context is the negotiating connection's: services log, rate-limit and authorize by
    them, on the fast path as on gRPC."""
    ends = _credentials(creds, where, str(tmp_path))
    # Local credentials encrypt nothing: the fast path needs no TF_RDMA_OVER_TLS over them.
    options: list[Any] = []
    seen: list[Any] = []

    def handler(request: bytes, context: Any) -> bytes:
        seen.append(_who(request, context))
        return request

    async def async_handler(request: bytes, context: Any) -> bytes:
        return handler(request, context)

    if api == "threaded":
        with inproc.threaded(stack, grpc.method_handlers_generic_handler(
                "t", {"W": grpc.unary_unary_rpc_method_handler(handler)}),
                channel_options=options, **ends) as channel:
            for _ in range(2):  # the first call may have negotiated; the second is fast
                assert channel.unary_unary("/t/W")(b"w", timeout=20) == b"w"
            transport = inproc.transport_of(channel)
    else:
        async def body() -> str:
            async with inproc.asyncio_pair(stack, grpc.method_handlers_generic_handler(
                    "t", {"W": grpc.unary_unary_rpc_method_handler(async_handler)}),
                    channel_options=options, **ends) as channel:
                for _ in range(2):
                    assert await channel.unary_unary("/t/W")(b"w", timeout=20) == b"w"
                return inproc.transport_of(channel)

        transport = asyncio.run(body())
    assert transport == ("shm" if stack == "argrpc" else "grpc")
    peer, auth, identities, key, served_by = seen[-1]
    assert served_by == transport
    assert re.match(PEER[where], peer), peer
    assert auth == AUTH[creds]
    # grpc names the transport security type as the identity of a local connection.
    assert (key, identities) == ((None, None) if creds == "insecure"
                                 else ("transport_security_type", [b"local"]))


_ALGORITHMS = {None: "none", grpc.Compression.NoCompression: "none",
               grpc.Compression.Deflate: "deflate", grpc.Compression.Gzip: "gzip"}


def _compression_outcome(bitset: int, channel_default: Any, call: Any) -> str:
    """grpc's answer: a call's NoCompression means the channel's algorithm; a server
    answers UNIMPLEMENTED for an algorithm its bitset leaves out."""
    effective = _ALGORITHMS[call] if _ALGORITHMS[call] != "none" else _ALGORITHMS[channel_default]
    bit = {"none": 0, "deflate": 1, "gzip": 2}[effective]
    if effective == "none" or bitset & (1 << bit):
        return "OK"
    return f"UNIMPLEMENTED: Compression algorithm '{effective}' is disabled."


@pytest.mark.parametrize("channel_default", [None, grpc.Compression.Gzip], ids=["none", "gzip"])
@pytest.mark.parametrize("bitset", [0b001, 0b101])
@pytest.mark.parametrize("api", ["threaded", "aio"])
@pytest.mark.parametrize("stack", ["grpc", "argrpc"])
def test_a_server_refuses_the_compression_it_disabled(stack: str, api: str, bitset: int,
                                                     channel_default: Any) -> None:
    """Compression is not applied on the fast path, but a server that disabled an
    algorithm refuses a call that asks for it, as on gRPC (a channel whose own algorithm
    is refused never negotiates: its every call fails on gRPC)."""
    options = [("grpc.compression_enabled_algorithms_bitset", bitset)]
    handlers = grpc.method_handlers_generic_handler("t", {
        "U": grpc.unary_unary_rpc_method_handler(lambda r, c: r),
        "S": grpc.unary_stream_rpc_method_handler(lambda r, c: iter([r, r]))})
    choices = list(_ALGORITHMS)
    expected = {str(c): [_compression_outcome(bitset, channel_default, c)] * 2 for c in choices}
    got: dict[str, list[str]] = {str(c): [] for c in choices}

    def note(choice: Any, error: Optional[grpc.RpcError]) -> None:
        got[str(choice)].append("OK" if error is None else f"{error.code().name}: {error.details()}")

    if api == "threaded":
        with inproc.threaded(stack, handlers, server_options=options,
                             compression=channel_default) as channel:
            for choice in choices:
                for call in (lambda: channel.unary_unary("/t/U")(b"x", timeout=20,
                                                                 compression=choice),
                             lambda: list(channel.unary_stream("/t/S")(b"x", timeout=20,
                                                                       compression=choice))):
                    try:
                        call()
                        note(choice, None)
                    except grpc.RpcError as e:
                        note(choice, e)
            transport = inproc.transport_of(channel)
    else:
        async def body() -> str:
            async with inproc.asyncio_pair(stack, handlers, server_options=options,
                                           compression=channel_default) as channel:
                for choice in choices:
                    try:
                        await channel.unary_unary("/t/U")(b"x", timeout=20, compression=choice)
                        note(choice, None)
                    except grpc.RpcError as e:
                        note(choice, e)
                    try:
                        [r async for r in channel.unary_stream("/t/S")(b"x", timeout=20,
                                                                       compression=choice)]
                        note(choice, None)
                    except grpc.RpcError as e:
                        note(choice, e)
                return inproc.transport_of(channel)

        transport = asyncio.run(body())
    assert got == expected
    channel_refused = channel_default is not None and not bitset & 0b100
    assert transport == ("shm" if stack == "argrpc" and not channel_refused else "grpc")


def _slow_echo(request: bytes, context: Any) -> bytes:
    time.sleep(0.01)
    return b"r"


def _slow_pair(request: bytes, context: Any) -> Any:
    time.sleep(0.01)
    yield b"a"
    yield b"b"


@pytest.mark.parametrize("stack", ["grpc", "argrpc"])
def test_a_cancel_at_a_random_moment_ends_the_call_one_way(stack: str) -> None:
    """cancel() at any moment of a threaded call's life: True and the call is cancelled
    (FutureCancelledError, or CANCELLED while iterating), or False and it ends as the
    server ended it; a second cancel() is False."""
    rng = random.Random(34)
    handlers = grpc.method_handlers_generic_handler("t", {
        "U": grpc.unary_unary_rpc_method_handler(_slow_echo),
        "S": grpc.unary_stream_rpc_method_handler(_slow_pair)})
    with inproc.threaded(stack, handlers) as channel:
        channel.unary_unary("/t/U")(b"", timeout=20)
        for _ in range(60):
            streaming = rng.random() < 0.5
            call = (channel.unary_stream("/t/S")(b"", timeout=20) if streaming
                    else channel.unary_unary("/t/U").future(b"", timeout=20))
            time.sleep(rng.uniform(0, 0.03))
            cancelled = call.cancel()
            try:
                ended: Any = list(call) if streaming else call.result()
            except grpc.FutureCancelledError:
                ended = "FutureCancelledError"
            except grpc.RpcError as e:
                ended = e.code()
            assert call.cancelled() is cancelled, ended
            assert call.cancel() is False
            if cancelled:
                assert ended == (grpc.StatusCode.CANCELLED if streaming else "FutureCancelledError")
            else:
                assert ended == ([b"a", b"b"] if streaming else b"r")
