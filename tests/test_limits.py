"""Message size limits behave as in grpc: 4 MiB default receive, max_send/max_receive options."""
from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace
from typing import Any, Callable

import grpc
import pytest

from tests.support import inproc, payload
from tests.support.clients import UNLIMITED, Client
from tests.support.payload import MiB

DEFAULT_MAX = 4 * MiB


def _too_large(fn: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    return info.value


@pytest.fixture
def default_server(pair: tuple[str, str], servers: Any) -> Any:
    """A server with grpc's default limits (4 MiB receive, unlimited send)."""
    return servers.get(pair[1])


def test_server_default_receive_limit(pair: tuple[str, str], default_server: Any,
                                      connect: Callable[..., Client]) -> None:
    client = connect(pair[0], default_server, UNLIMITED)
    body = b"\x01" * (DEFAULT_MAX + 16)
    req = client.req(payload=body)
    err = _too_large(lambda: client.stub.Unary(req, timeout=30))
    assert err.details() == (
        f"SERVER: Received message larger than max ({req.ByteSize()} vs. {DEFAULT_MAX})"), err.details()
    # exactly at the limit is fine
    at_limit = client.req(payload=b"\x02" * payload.payload_for_message_size(DEFAULT_MAX))
    assert at_limit.ByteSize() == DEFAULT_MAX
    assert client.stub.Unary(at_limit, timeout=30).size == len(at_limit.payload)
    # the connection survives the rejection
    assert client.stub.Unary(client.req(payload=b"ok"), timeout=20).payload == b"ok"


def test_server_receive_limit_streaming(pair: tuple[str, str], default_server: Any,
                                        connect: Callable[..., Client]) -> None:
    client = connect(pair[0], default_server, UNLIMITED)
    reqs = [client.req(payload=b"a"), client.req(payload=b"\x03" * (DEFAULT_MAX + 1))]
    _too_large(lambda: client.stub.ClientStream(iter(reqs), timeout=30))
    _too_large(lambda: list(client.stub.Bidi(iter(reqs), timeout=30)))


def test_client_default_receive_limit(client: Client, pair: tuple[str, str],
                                      servers: Any, connect: Callable[..., Client]) -> None:
    """A channel without options rejects a response over 4 MiB."""
    plain = connect(pair[0], client.server)  # default options, same unlimited server
    size = DEFAULT_MAX + 16
    err = _too_large(lambda: plain.stub.Unary(
        plain.req(response_size=size, response_seed=1), timeout=30))
    match = re.fullmatch(r"Stream removed \(CLIENT: Received message larger than max \((\d+) "
                         r"vs\. (\d+)\)\)", err.details())
    assert match, err.details()
    assert int(match.group(1)) > size and int(match.group(2)) == DEFAULT_MAX
    # below the limit still fine, and the channel still works
    ok = plain.stub.Unary(plain.req(response_size=MiB, response_seed=1), timeout=30)
    assert ok.payload == payload.make(1, MiB)
    err = _too_large(lambda: list(plain.stub.ServerStream(
        plain.req(response_count=2, response_size=size, response_seed=1), timeout=30)))


def test_client_max_receive_option(client: Client, pair: tuple[str, str],
                                   connect: Callable[..., Client]) -> None:
    limit = 100_000
    small = connect(pair[0], client.server, [("grpc.max_receive_message_length", limit)])
    assert len(small.stub.Unary(small.req(response_size=50_000), timeout=30).payload) == 50_000
    _too_large(lambda: small.stub.Unary(small.req(response_size=limit + 1), timeout=30))


def test_client_max_send_option(client: Client, pair: tuple[str, str],
                                connect: Callable[..., Client]) -> None:
    limit = 1024
    capped = connect(pair[0], client.server, [("grpc.max_send_message_length", limit)])
    req = capped.req(payload=b"\x04" * 2048)
    err = _too_large(lambda: capped.stub.Unary(req, timeout=30))
    assert err.details().endswith(
        f"Sent message larger than max ({req.ByteSize()} vs. {limit})"), err.details()
    _too_large(lambda: capped.stub.ClientStream(iter([req]), timeout=30))
    assert capped.stub.Unary(capped.req(payload=b"x" * 100), timeout=20).size == 100


def test_server_max_send_option(pair: tuple[str, str], servers: Any,
                                connect: Callable[..., Client]) -> None:
    limit = 1024
    server = servers.get(pair[1], ("--max-recv", "-1", "--max-send", str(limit)))
    client = connect(pair[0], server, UNLIMITED)
    _too_large(lambda: client.stub.Unary(client.req(response_size=4096), timeout=30))
    _too_large(lambda: list(client.stub.ServerStream(
        client.req(response_count=2, response_size=4096), timeout=30)))
    assert client.stub.Unary(client.req(response_size=100), timeout=20).payload == payload.make(0, 100)


def test_eager_size_above_the_peers_window(spawn: Any, pb: SimpleNamespace) -> None:
    """The peers' knobs may differ: a client whose TF_RDMA_ACC_SIZE allows a 100 KB eager
    message, against a server whose TF_RDMA_STREAM_WINDOW is 64K, sends it by rendezvous
    instead of waiting forever for window the server can never grant."""
    import argrpc

    server = spawn("argrpc", ("--max-recv", "-1", "--max-send", "-1"),
                   {"TF_RDMA_STREAM_WINDOW": "64K"})
    with argrpc.insecure_channel(server.target, options=[
            ("TF_RDMA_ACC_SIZE", "256K"), ("grpc.max_receive_message_length", -1),
            ("grpc.max_send_message_length", -1)]) as channel:
        stub = pb.pb2_grpc.EchoStub(channel)
        body = b"w" * 100_000
        resp = stub.Unary(pb.pb2.EchoRequest(payload=body), timeout=20, wait_for_ready=True)
        assert resp.payload == body and channel.transport == "shm"
        summary = stub.ClientStream(iter([pb.pb2.EchoRequest(payload=body)] * 3), timeout=20)
        assert summary.size == 3 * len(body)


# A limit fails the message that breaks it: what came before is read, in order, on both
# APIs, eager and rendezvous sizes alike (grpc's answer, checked on the reference pair).
STREAM_LIMIT_CASES = {"eager": (1024, 512, 2048), "rendezvous": (MiB, 512 * 1024, 2 * MiB)}


def _limit_service(asynchronous: bool, first: int, second: int) -> Any:
    def responses(request: bytes, context: Any) -> Any:
        yield b"a" * first
        yield b"b" * second
        yield b"c"

    async def async_responses(request: bytes, context: Any) -> Any:
        for message in responses(request, context):
            yield message

    handler = async_responses if asynchronous else responses
    return grpc.method_handlers_generic_handler("t", {
        "S": grpc.unary_stream_rpc_method_handler(handler),
        "U": grpc.unary_unary_rpc_method_handler(lambda r, c: r)})


@pytest.mark.parametrize("size", list(STREAM_LIMIT_CASES))
@pytest.mark.parametrize("api", ["threaded", "aio"])
@pytest.mark.parametrize("stack", ["grpc", "argrpc"])
def test_a_receive_limit_fails_the_message_that_breaks_it(stack: str, api: str, size: str) -> None:
    limit, first, second = STREAM_LIMIT_CASES[size]
    options = [("grpc.max_receive_message_length", limit)]
    expected = [first, f"RESOURCE_EXHAUSTED: Stream removed (CLIENT: Received message larger "
                       f"than max ({second} vs. {limit}))"]
    if api == "threaded":
        with inproc.threaded(stack, _limit_service(False, first, second),
                             channel_options=options) as channel:
            channel.unary_unary("/t/U")(b"", timeout=20)  # negotiates
            got: list[Any] = []
            try:
                for message in channel.unary_stream("/t/S")(b"", timeout=20):
                    got.append(len(message))
            except grpc.RpcError as e:
                got.append(f"{e.code().name}: {e.details()}")
            assert got == expected
            transport = inproc.transport_of(channel)
    else:
        async def body() -> str:
            async with inproc.asyncio_pair(stack, _limit_service(True, first, second),
                                           channel_options=options) as channel:
                await channel.unary_unary("/t/U")(b"", timeout=20)
                for style in ("read", "iterate"):
                    call = channel.unary_stream("/t/S")(b"", timeout=20)
                    got: list[Any] = []
                    try:
                        if style == "read":
                            while (message := await call.read()) is not grpc.aio.EOF:
                                got.append(len(message))
                        else:
                            async for message in call:
                                got.append(len(message))
                    except grpc.RpcError as e:
                        got.append(f"{e.code().name}: {e.details()}")
                    assert got == expected, style
                return inproc.transport_of(channel)

        transport = asyncio.run(body())
    assert transport == ("shm" if stack == "argrpc" else "grpc")
