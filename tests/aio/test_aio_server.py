"""argrpc.aio's server against grpc.aio's: the same handlers, the same outcomes.

Fast-path calls come from a threaded argrpc client (run off the loop, in a thread) that
negotiates shared memory with the server in this process; plain grpc.aio clients use the
server's gRPC port. Where behaviour is grpc.aio's to define, a test runs the same
scenario against a plain `grpc.aio.server` and compares.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import hashlib
import socket
import threading
import time
import weakref
from typing import Any, AsyncIterator, Callable, Optional

import grpc
import pytest
from grpc import aio

import argrpc
from argrpc import aio as argrpc_aio
from argrpc.aio import _server as aio_server
from tests.support.procs import script_result

SERVICE = "t.Aio"
LONG = 10.0
OVER_LIMIT = "Concurrent RPC limit exceeded!"
UNLIMITED = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


# Runs a test against both servers: grpc.aio's outcome is the reference.
STACKS = pytest.mark.parametrize("stack", ["argrpc", "grpc"])


def expected_transport(stack: str) -> str:
    """An argrpc client gets shared memory from argrpc.aio, plain gRPC from grpc.aio."""
    return "shm" if stack == "argrpc" else "grpc"


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def method(name: str) -> str:
    return f"/{SERVICE}/{name}"


@contextlib.asynccontextmanager
async def serving(handlers: dict[str, grpc.RpcMethodHandler], stack: str = "argrpc",
                  registered: bool = False, **kwargs: Any) -> AsyncIterator[tuple[Any, str]]:
    """A started server of `stack` ("argrpc": argrpc.aio, "grpc": grpc.aio) on a free port,
    with `handlers` as a generic handler, or as registered method handlers (as generated
    code adds them; argrpc.aio serves a registered unary `async def` method from a plan)."""
    factory = aio_server.server if stack == "argrpc" else aio.server
    srv = factory(**kwargs)
    if registered:
        srv.add_registered_method_handlers(SERVICE, handlers)
    else:
        srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    try:
        yield srv, f"127.0.0.1:{port}"
    finally:
        await srv.stop(None)


def sync_outcome(channel: grpc.Channel, name: str, request: Any = b"req", kind: str = "uu",
                 timeout: Optional[float] = 5, metadata: Any = None) -> tuple:
    """One call from a threaded (argrpc or grpc) channel, as a comparable tuple."""
    try:
        if kind == "uu":
            response, call = channel.unary_unary(method(name)).with_call(
                request, timeout=timeout, metadata=metadata)
            return ("OK", response, tuple(call.initial_metadata()),
                    tuple(call.trailing_metadata()))
        if kind == "su":
            response, call = channel.stream_unary(method(name)).with_call(
                iter(request), timeout=timeout, metadata=metadata)
            return ("OK", response, tuple(call.trailing_metadata()))
        stream = (channel.unary_stream(method(name))(request, timeout=timeout, metadata=metadata)
                  if kind == "us" else
                  channel.stream_stream(method(name))(iter(request), timeout=timeout,
                                                      metadata=metadata))
        got: list = []
        try:
            for response in stream:
                got.append(response)
        except grpc.RpcError as e:
            return ("ERR", got, e.code(), e.details(), tuple(e.trailing_metadata() or ()))
        return ("OK", got, tuple(stream.trailing_metadata()))
    except grpc.RpcError as e:
        return ("ERR", e.code(), e.details(), tuple(e.trailing_metadata() or ()))


async def aio_outcome(channel: aio.Channel, name: str, request: Any = b"req", kind: str = "uu",
                      timeout: Optional[float] = 5, metadata: Any = None) -> tuple:
    """The same for a grpc.aio client (the gRPC port)."""
    try:
        if kind == "uu":
            call = channel.unary_unary(method(name))(request, timeout=timeout, metadata=metadata)
            response = await call
            return ("OK", response, tuple(await call.initial_metadata()),
                    tuple(await call.trailing_metadata()))
        if kind == "su":
            call = channel.stream_unary(method(name))(iter(request), timeout=timeout,
                                                      metadata=metadata)
            response = await call
            return ("OK", response, tuple(await call.trailing_metadata()))
        call = (channel.unary_stream(method(name))(request, timeout=timeout, metadata=metadata)
                if kind == "us" else
                channel.stream_stream(method(name))(iter(request), timeout=timeout,
                                                    metadata=metadata))
        got: list = []
        try:
            async for response in call:
                got.append(response)
        except grpc.RpcError as e:
            return ("ERR", got, e.code(), e.details(), tuple(e.trailing_metadata() or ()))
        return ("OK", got, tuple(await call.trailing_metadata()))
    except grpc.RpcError as e:
        return ("ERR", e.code(), e.details(), tuple(e.trailing_metadata() or ()))


def fast_channel(target: str, options: Any = None) -> argrpc.Channel:
    return argrpc.insecure_channel(target, options=options)


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


def transport_of(ch: argrpc.Channel) -> str:
    """The channel's transport; with the reason when it fell back (for assertions)."""
    return ch.transport if ch.transport != "grpc" else f"grpc ({ch.fallback_reason})"


def fast_calls(target: str, calls: list[tuple], options: Any = None) -> tuple[str, list]:
    """Runs `calls` (sync_outcome arguments) on one argrpc channel; (transport, outcomes).
    The transport is the one the first call used: a server's stop() closes the connection
    and the channel then renegotiates."""
    with fast_channel(target, options) as ch:
        out = [sync_outcome(ch, *calls[0])]
        transport = transport_of(ch)
        out.extend(sync_outcome(ch, *c) for c in calls[1:])
        return transport, out


# --- handlers shared by the parity tests ----------------------------------------------
async def echo(request: bytes, context: aio.ServicerContext) -> bytes:
    return request


async def set_code(request: bytes, context: aio.ServicerContext) -> bytes:
    context.set_code(grpc.StatusCode.NOT_FOUND)
    context.set_details("no such thing")
    context.set_trailing_metadata((("k", "v"),))
    return b"dropped"


async def set_details_ok(request: bytes, context: aio.ServicerContext) -> bytes:
    context.set_details("fine")
    return b"resp"


async def abort(request: bytes, context: aio.ServicerContext) -> bytes:
    context.set_trailing_metadata((("t1", "v"), ("t-bin", b"\x00\xff")))
    await context.abort(grpc.StatusCode.PERMISSION_DENIED, "nope")
    raise AssertionError("abort returned")


async def abort_keeps_details(request: bytes, context: aio.ServicerContext) -> bytes:
    context.set_details("earlier")
    await context.abort(grpc.StatusCode.NOT_FOUND, trailing_metadata=(("k", "v"),))
    return b""


async def abort_swallowed(request: bytes, context: aio.ServicerContext) -> bytes:
    try:
        await context.abort(grpc.StatusCode.INTERNAL, "first")
    except aio.AbortError:
        pass
    return b"after"


async def abort_with_status(request: bytes, context: aio.ServicerContext) -> bytes:
    status = type("S", (grpc.Status,), {})()
    status.code, status.details = grpc.StatusCode.UNAVAILABLE, "try later"
    status.trailing_metadata = (("r", "1"),)
    await context.abort_with_status(status)
    return b""


async def raises(request: bytes, context: aio.ServicerContext) -> bytes:
    raise ValueError("boom")


async def raises_with_code(request: bytes, context: aio.ServicerContext) -> bytes:
    context.set_code(grpc.StatusCode.FAILED_PRECONDITION)
    raise KeyError("k")


async def metadata_both(request: bytes, context: aio.ServicerContext) -> bytes:
    await context.send_initial_metadata((("i1", "a"), ("i-bin", b"\x00\x01")))
    context.set_trailing_metadata((("t1", "b"), ("t-bin", b"\xff\x00")))
    return b"md"


async def invalid_trailing(request: bytes, context: aio.ServicerContext) -> bytes:
    context.set_trailing_metadata((("Upper", "v"),))
    return b"x"


async def waits(request: bytes, context: aio.ServicerContext) -> bytes:
    await asyncio.sleep(0)
    return request


async def waits_then_raises(request: bytes, context: aio.ServicerContext) -> bytes:
    await asyncio.sleep(0)
    raise ValueError("late")


async def returns_str(request: bytes, context: aio.ServicerContext) -> str:
    return "text"


def sync_echo(request: bytes, context: Any) -> bytes:
    return b"sync:" + request + threading.current_thread().name.encode()


def sync_abort(request: bytes, context: Any) -> bytes:
    context.abort(grpc.StatusCode.NOT_FOUND, "sync abort")
    return b"not reached"


async def stream_agen(request: bytes, context: aio.ServicerContext) -> AsyncIterator[bytes]:
    for i in range(3):
        yield request + b"%d" % i


async def stream_write(request: bytes, context: aio.ServicerContext) -> None:
    await context.write(b"w1")
    await context.write(b"w2")
    context.set_trailing_metadata((("end", "yes"),))


async def stream_fails(request: bytes, context: aio.ServicerContext) -> AsyncIterator[bytes]:
    yield b"first"
    raise RuntimeError("mid-stream")


async def stream_aborts(request: bytes, context: aio.ServicerContext) -> AsyncIterator[bytes]:
    yield b"first"
    await context.abort(grpc.StatusCode.OUT_OF_RANGE, "enough")


def sync_stream(request: bytes, context: Any) -> Any:
    yield b"s1"
    yield b"s2"


async def client_stream(requests: Any, context: aio.ServicerContext) -> bytes:
    return b"|".join([r async for r in requests])


async def client_stream_read(requests: Any, context: aio.ServicerContext) -> bytes:
    got = []
    while True:
        message = await context.read()
        if message is aio.EOF:
            break
        got.append(message)
    assert await context.read() is aio.EOF
    return b"|".join(got)


def sync_client_stream(requests: Any, context: Any) -> bytes:
    return b"+".join(requests)


async def bidi(requests: Any, context: aio.ServicerContext) -> AsyncIterator[bytes]:
    async for r in requests:
        yield r + b"!"


async def bidi_write(requests: Any, context: aio.ServicerContext) -> None:
    async for r in requests:
        await context.write(r.upper())


def sync_bidi(requests: Any, context: Any) -> Any:
    for r in requests:
        yield r * 2


PARITY_HANDLERS = {
    "echo": grpc.unary_unary_rpc_method_handler(echo),
    "set_code": grpc.unary_unary_rpc_method_handler(set_code),
    "set_details_ok": grpc.unary_unary_rpc_method_handler(set_details_ok),
    "abort": grpc.unary_unary_rpc_method_handler(abort),
    "abort_keeps_details": grpc.unary_unary_rpc_method_handler(abort_keeps_details),
    "abort_swallowed": grpc.unary_unary_rpc_method_handler(abort_swallowed),
    "abort_with_status": grpc.unary_unary_rpc_method_handler(abort_with_status),
    "raises": grpc.unary_unary_rpc_method_handler(raises),
    "raises_with_code": grpc.unary_unary_rpc_method_handler(raises_with_code),
    "metadata_both": grpc.unary_unary_rpc_method_handler(metadata_both),
    "invalid_trailing": grpc.unary_unary_rpc_method_handler(invalid_trailing),
    "returns_str": grpc.unary_unary_rpc_method_handler(returns_str),
    "waits": grpc.unary_unary_rpc_method_handler(waits),
    "waits_then_raises": grpc.unary_unary_rpc_method_handler(waits_then_raises),
    "sync_abort": grpc.unary_unary_rpc_method_handler(sync_abort),
    "bad_request": grpc.unary_unary_rpc_method_handler(
        echo, request_deserializer=lambda b: b.decode("ascii")),
    "bad_response": grpc.unary_unary_rpc_method_handler(
        echo, response_serializer=lambda m: m.SerializeToString()),
    "serializer_none": grpc.unary_unary_rpc_method_handler(
        echo, response_serializer=lambda m: None),
    "serializer_str": grpc.unary_unary_rpc_method_handler(
        echo, response_serializer=lambda m: "text"),
    "stream_serializer_none": grpc.unary_stream_rpc_method_handler(
        stream_agen, response_serializer=lambda m: None),
    "stream_serializer_str": grpc.unary_stream_rpc_method_handler(
        stream_agen, response_serializer=lambda m: "text"),
    "stream_agen": grpc.unary_stream_rpc_method_handler(stream_agen),
    "stream_write": grpc.unary_stream_rpc_method_handler(stream_write),
    "stream_fails": grpc.unary_stream_rpc_method_handler(stream_fails),
    "stream_aborts": grpc.unary_stream_rpc_method_handler(stream_aborts),
    "sync_stream": grpc.unary_stream_rpc_method_handler(sync_stream),
    "client_stream": grpc.stream_unary_rpc_method_handler(client_stream),
    "client_stream_read": grpc.stream_unary_rpc_method_handler(client_stream_read),
    "sync_client_stream": grpc.stream_unary_rpc_method_handler(sync_client_stream),
    "bidi": grpc.stream_stream_rpc_method_handler(bidi),
    "bidi_write": grpc.stream_stream_rpc_method_handler(bidi_write),
    "sync_bidi": grpc.stream_stream_rpc_method_handler(sync_bidi),
}

PARITY_CALLS: list[tuple] = [
    ("echo", b"hello"),
    ("set_code",),
    ("set_details_ok",),
    ("abort",),
    ("abort_keeps_details",),
    ("abort_swallowed",),
    ("abort_with_status",),
    ("raises",),
    ("raises_with_code",),
    ("metadata_both",),
    ("invalid_trailing",),
    ("returns_str",),
    ("waits", b"w"),
    ("waits_then_raises",),
    ("sync_abort",),
    ("bad_request", b"\xff\xfe"),
    ("bad_response",),
    ("serializer_none", b"n"),
    ("serializer_str", b"s"),
    ("stream_serializer_none", b"r", "us"),
    ("stream_serializer_str", b"r", "us"),
    ("no_such_method",),
    ("stream_agen", b"r", "us"),
    ("stream_write", b"r", "us"),
    ("stream_fails", b"r", "us"),
    ("stream_aborts", b"r", "us"),
    ("sync_stream", b"r", "us"),
    ("client_stream", [b"a", b"b", b"c"], "su"),
    ("client_stream_read", [b"a", b"b"], "su"),
    ("sync_client_stream", [b"x", b"y"], "su"),
    ("client_stream", [], "su"),
    ("bidi", [b"a", b"b"], "ss"),
    ("bidi_write", [b"a", b"b"], "ss"),
    ("sync_bidi", [b"q"], "ss"),
]


@pytest.mark.parametrize("registered", [False, True], ids=["generic", "registered"])
def test_outcomes_match_grpc_aio(registered: bool) -> None:
    """Every arity, statuses, details, aborts, exceptions, metadata: an argrpc client over
    shared memory and a grpc.aio client on the port see what grpc.aio's server gives,
    whether the handlers come as a generic handler or registered."""

    async def outcomes(stack: str) -> tuple[list, list, list, str, str]:
        async with serving(PARITY_HANDLERS, stack, registered) as (_, target):
            async with aio.insecure_channel(target) as ch:
                via_port = [await aio_outcome(ch, *c) for c in PARITY_CALLS]
            # argrpc.aio's client on the server's own loop.
            async with argrpc_aio.insecure_channel(target) as ach:
                via_loop = [await aio_outcome(ach, *c) for c in PARITY_CALLS]
                loop_transport = ach.transport
            transport, via_fast = await in_thread(fast_calls, target, PARITY_CALLS)
        return via_port, via_loop, via_fast, loop_transport, transport

    reference, reference_loop, reference_sync, *plain = run(outcomes("grpc"))
    assert [t.split()[0] for t in plain] == ["grpc", "grpc"]
    via_port, via_loop, via_fast, *fast = run(outcomes("argrpc"))
    assert fast == ["shm", "shm"]
    for want, got in ((reference, via_port), (reference_loop, via_loop),
                      (reference_sync, via_fast)):
        for call, expected, outcome in zip(PARITY_CALLS, want, got):
            assert outcome == expected, call
    # The texts grpc.aio picks, spelled out once.
    by_name = dict(zip([c[0] for c in PARITY_CALLS], via_fast))
    assert by_name["raises"][1:3] == (grpc.StatusCode.UNKNOWN,
                                      "Unexpected <class 'ValueError'>: boom")
    assert by_name["raises_with_code"][1] == grpc.StatusCode.FAILED_PRECONDITION
    assert by_name["serializer_none"][:2] == ("OK", b"")
    assert by_name["serializer_str"][1:3] == (grpc.StatusCode.UNKNOWN,
                                              "Unexpected <class 'TypeError'>: Expected bytes, "
                                              "got str")
    assert by_name["no_such_method"][1:3] == (grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
    assert by_name["abort"] == ("ERR", grpc.StatusCode.PERMISSION_DENIED, "nope",
                                (("t1", "v"), ("t-bin", b"\x00\xff")))
    assert by_name["metadata_both"][2][-2:] == (("i1", "a"), ("i-bin", b"\x00\x01"))
    assert by_name["invalid_trailing"][1:3] == (grpc.StatusCode.INTERNAL, "Invalid metadata")


def test_a_planned_call_answered_at_once_takes_one_crossing(monkeypatch: Any) -> None:
    """A registered unary `async def` method whose handler answers at once is answered
    by the engine's answer_unary, with no coroutine of the server's; any other outcome
    is handed to serve() from where it got (the outcomes themselves are grpc.aio's:
    test_outcomes_match_grpc_aio)."""
    from argrpc.aio import _server_handlers as handlers

    served: list[tuple[str, Optional[int]]] = []
    real = aio_server.serve

    def counted(server: Any, state: Any, refused: bool = False, plan: Any = None,
                started: Any = None) -> Any:
        served.append((state.method.rsplit("/", 1)[1], None if started is None else started[0]))
        return real(server, state, refused, plan, started)

    monkeypatch.setattr(aio_server, "serve", counted)
    rest_calls = [("set_details_ok",), ("waits", b"w"), ("raises",), ("metadata_both",),
                  ("bad_request", b"\xff"), ("returns_str",)]
    calls = [("echo", b"e%d" % i) for i in range(20)] + rest_calls
    expected = {"waits": handlers._WAITS, "raises": handlers._RAISED,
                "metadata_both": handlers._RETURNED, "bad_request": handlers._RAISED,
                "returns_str": handlers._RETURNED}

    def staged() -> dict[str, set]:
        seen: dict[str, set] = {}
        for name, started in served:
            if name != "echo" and started is not None:
                seen.setdefault(name, set()).add(started)
        return seen

    async def body() -> tuple[str, list]:
        async with serving(PARITY_HANDLERS, "argrpc", registered=True) as (_, target):
            first = await in_thread(fast_calls, target, calls)
            # Any call reaches serve() with nothing started when its request was not
            # there yet (a busy machine); the others are asked again until each has
            # been seen where it got, so that stage is what the test checks.
            for _ in range(20):
                if set(staged()) == set(expected):
                    break
                await in_thread(fast_calls, target, rest_calls)
            return first

    transport, outcomes = run(body())
    assert transport == "shm"
    assert [o[:2] for o in outcomes[:20]] == [("OK", b"e%d" % i) for i in range(20)]
    assert outcomes[20][0] == "OK" and outcomes[21][:2] == ("OK", b"w")
    assert outcomes[22][1] == grpc.StatusCode.UNKNOWN
    # An echo reaches serve() only if its request was not there yet (nothing started).
    echoes = [started for name, started in served if name == "echo"]
    assert echoes.count(None) == len(echoes) and len(echoes) <= 10, served
    assert staged() == {name: {stage} for name, stage in expected.items()}, served


def test_a_pass_ends_in_c_only_the_calls_nothing_else_holds(monkeypatch: Any) -> None:
    """The server's pass ends a planned call answered at once by itself only when nothing
    else refers to it; a handler that kept its context or added a done callback has its
    call handed to the Python server's _carry_on, which lets go of the engine handle
    and runs the callback, as grpc.aio does once the call is over."""
    kept: list[aio.ServicerContext] = []
    called: list[str] = []

    async def keeps_context(request: bytes, context: aio.ServicerContext) -> bytes:
        kept.append(context)
        return request

    async def adds_callback(request: bytes, context: aio.ServicerContext) -> bytes:
        context.add_done_callback(lambda ctx: called.append(ctx.peer()))
        return request

    carried: list[tuple[str, bool]] = []
    real = aio_server.Server._carry_on

    def counted(self: Any, state: Any, plan: Any, context: Any, started: Any,
                refused: bool) -> None:
        carried.append((state.method.rsplit("/", 1)[1], started is True))
        real(self, state, plan, context, started, refused)

    monkeypatch.setattr(aio_server.Server, "_carry_on", counted)
    handlers = {"echo": grpc.unary_unary_rpc_method_handler(echo),
                "keeps_context": grpc.unary_unary_rpc_method_handler(keeps_context),
                "adds_callback": grpc.unary_unary_rpc_method_handler(adds_callback)}
    calls = [("echo", b"a"), ("keeps_context", b"b"), ("adds_callback", b"c")] * 3

    async def body() -> tuple[str, list]:
        async with serving(handlers, "argrpc", registered=True) as (_, target):
            return await in_thread(fast_calls, target, calls)

    transport, outcomes = run(body())
    assert transport == "shm"
    assert [o[:2] for o in outcomes] == [("OK", b"a"), ("OK", b"b"), ("OK", b"c")] * 3
    # An echo reaches _carry_on only if its request was not there yet (not answered).
    assert ("echo", True) not in carried, carried
    assert carried.count(("keeps_context", True)) + carried.count(("keeps_context", False)) == 3
    assert carried.count(("adds_callback", True)) + carried.count(("adds_callback", False)) == 3
    assert len(called) == 3 and all(p.startswith("ipv4:127.0.0.1:") for p in called), called
    # Each kept context's call let go of its engine handle, and still answers.
    assert len(kept) == 3
    for context in kept:
        assert type(context._state.sc).__name__ == "_EndedCall"
        assert context.peer().startswith("ipv4:127.0.0.1:") and context.done()


def test_a_started_server_nobody_holds_is_collected() -> None:
    """The loop's bridge keeps the server's pass, which holds the server weakly: a
    started server that served fast-path calls and that nobody refers to any more is
    collected (its engine half then stops taking calls), and its pass does nothing."""
    import gc

    async def body() -> tuple[str, list, bool]:
        srv = aio_server.server()
        srv.add_registered_method_handlers(
            SERVICE, {"echo": grpc.unary_unary_rpc_method_handler(echo)})
        port = srv.add_insecure_port("127.0.0.1:0")
        await srv.start()
        transport, outcomes = await in_thread(fast_calls, f"127.0.0.1:{port}",
                                              [("echo", b"a"), ("echo", b"b")])
        ref = weakref.ref(srv)
        callbacks = list(srv._bridge._callbacks.values())
        del srv
        gc.collect()
        for callback in callbacks:
            callback()  # the bridge may still call the gone server's pass: it does nothing
        return transport, outcomes, ref() is None

    transport, outcomes, collected = run(body())
    assert transport == "shm"
    assert [o[:2] for o in outcomes] == [("OK", b"a"), ("OK", b"b")]
    assert collected, "a started server nobody holds stayed alive"


# What grpc's auth_context() gives on an insecure connection.
INSECURE = {"transport_security_type": [b"insecure"], "security_level": [b"TSI_SECURITY_NONE"]}


def test_context_inside_a_fast_path_call() -> None:
    seen: dict[str, Any] = {}

    async def inspect_context(request: bytes, context: aio.ServicerContext) -> bytes:
        md = context.invocation_metadata()
        seen.update(
            md_type=type(md), first=md[0].key, x=[(m.key, m.value) for m in md
                                                    if m.key.startswith("x-")],
            time_remaining=context.time_remaining(), peer=context.peer(),
            transport=getattr(context, "transport", "grpc"),
            code=context.code(), details=context.details(), done=context.done(),
            cancelled=context.cancelled(), auth=context.auth_context(),
            identities=context.peer_identities(), identity_key=context.peer_identity_key())
        context.set_compression(grpc.Compression.Gzip)
        context.disable_next_message_compression()
        context.set_code(grpc.StatusCode.CANCELLED)
        seen["cancelled_after_set"] = context.cancelled()
        context.set_code(grpc.StatusCode.OK)
        return b"ok"

    async def twice(request: bytes, context: aio.ServicerContext) -> bytes:
        await context.send_initial_metadata((("a", "1"),))
        with pytest.raises(aio.UsageError):
            await context.send_initial_metadata((("a", "2"),))
        with pytest.raises(RuntimeError):
            context.set_compression(grpc.Compression.Gzip)
        with pytest.raises(TypeError):
            context.set_trailing_metadata([["list", "not tuple"]])
        return b"ok"

    async def abort_twice(request: bytes, context: aio.ServicerContext) -> bytes:
        with pytest.raises(aio.AbortError):
            await context.abort(grpc.StatusCode.NOT_FOUND, "one")
        with pytest.raises(aio.AbortError):
            await context.write(b"late")  # the abort comes back, as in grpc.aio
        try:
            await context.abort(grpc.StatusCode.INTERNAL, "two")
        except aio.UsageError as e:
            seen["abort_twice"] = str(e)
        seen["done_after_abort"] = context.done()
        return b""

    async def no_deadline(request: bytes, context: aio.ServicerContext) -> bytes:
        seen["no_deadline"] = context.time_remaining()
        return b""

    handlers = {
        "inspect": grpc.unary_unary_rpc_method_handler(inspect_context),
        "twice": grpc.unary_unary_rpc_method_handler(twice),
        "abort_twice": grpc.unary_unary_rpc_method_handler(abort_twice),
        "no_deadline": grpc.unary_unary_rpc_method_handler(no_deadline),
    }

    async def body() -> None:
        async with serving(handlers) as (_, target):
            md = (("x-text", "v"), ("x-data-bin", b"\x00\x01\xff"))
            transport, out = await in_thread(fast_calls, target, [
                ("inspect", b"", "uu", 3.0, md), ("twice",), ("abort_twice",),
                ("no_deadline", b"", "uu", None)])
        assert transport == "shm"
        assert out[0][0] == "OK" and out[1][0] == "OK", out
        assert out[2][1:3] == (grpc.StatusCode.NOT_FOUND, "one")

    run(body())
    assert seen["md_type"] is tuple
    assert seen["first"] == "user-agent"
    assert seen["x"] == [("x-text", "v"), ("x-data-bin", b"\x00\x01\xff")]
    assert 2.0 < seen["time_remaining"] <= 3.0
    assert seen["no_deadline"] is None
    assert seen["peer"].startswith(("ipv4:", "ipv6:")), seen  # as grpc.aio, over shm
    assert seen["transport"] == "shm"
    assert (seen["code"], seen["details"], seen["done"], seen["cancelled"]) == (None, "", False,
                                                                                False)
    assert seen["cancelled_after_set"] is True
    assert (seen["auth"], seen["identities"], seen["identity_key"]) == (INSECURE, None, None)
    assert seen["abort_twice"] == "Abort already called!"
    assert seen["done_after_abort"] is True


def test_generated_stubs_and_async_servicer(pb: Any) -> None:
    """Generated *_pb2_grpc code registers an async servicer unchanged (registered
    method handlers), over both ports."""
    pb2, pb2_grpc = pb.pb2, pb.pb2_grpc

    class Servicer(pb2_grpc.EchoServicer):
        async def Unary(self, request: Any, context: aio.ServicerContext) -> Any:
            return pb2.EchoResponse(payload=request.payload, size=len(request.payload))

        async def ServerStream(self, request: Any, context: aio.ServicerContext) -> Any:
            for i in range(request.response_count):
                yield pb2.EchoResponse(index=i)

        async def ClientStream(self, request_iterator: Any, context: aio.ServicerContext) -> Any:
            total = b"".join([r.payload async for r in request_iterator])
            return pb2.EchoResponse(payload=total)

        async def Bidi(self, request_iterator: Any, context: aio.ServicerContext) -> Any:
            async for r in request_iterator:
                yield pb2.EchoResponse(payload=r.payload[::-1])

    def client(target: str) -> tuple:
        with argrpc.insecure_channel(target) as ch:
            stub = pb2_grpc.EchoStub(ch)
            a = stub.Unary(pb2.EchoRequest(payload=b"abc"), timeout=5)
            b = [r.index for r in stub.ServerStream(pb2.EchoRequest(response_count=3), timeout=5)]
            c = stub.ClientStream(iter([pb2.EchoRequest(payload=b"x")] * 3), timeout=5)
            d = [r.payload for r in stub.Bidi(iter([pb2.EchoRequest(payload=b"ab")]), timeout=5)]
            return transport_of(ch), (a.payload, a.size, b, c.payload, d)

    async def body() -> None:
        srv = aio_server.server()
        pb2_grpc.add_EchoServicer_to_server(Servicer(), srv)
        port = srv.add_insecure_port("127.0.0.1:0")
        await srv.start()
        target = f"127.0.0.1:{port}"
        try:
            transport, got = await in_thread(client, target)
            assert transport == "shm"
            assert got == (b"abc", 3, [0, 1, 2], b"xxx", [b"ba"])
            async with aio.insecure_channel(target) as ch:
                reply = await pb2_grpc.EchoStub(ch).Unary(pb2.EchoRequest(payload=b"p"))
                assert reply.payload == b"p"
        finally:
            await srv.stop(None)

    run(body())


def test_sync_handlers_run_in_the_migration_pool() -> None:
    handlers = {
        "sync_echo": grpc.unary_unary_rpc_method_handler(sync_echo),
        "sync_stream": grpc.unary_stream_rpc_method_handler(sync_stream),
        "sync_client_stream": grpc.stream_unary_rpc_method_handler(sync_client_stream),
        "sync_bidi": grpc.stream_stream_rpc_method_handler(sync_bidi),
    }
    calls = [("sync_echo", b"a"), ("sync_stream", b"", "us"),
             ("sync_client_stream", [b"1", b"2"], "su"), ("sync_bidi", [b"z", b"y"], "ss")]

    async def body(pool: Optional[cf.Executor]) -> list:
        async with serving(handlers, migration_thread_pool=pool) as (_, target):
            transport, out = await in_thread(fast_calls, target, calls)
        assert transport == "shm"
        return out

    with cf.ThreadPoolExecutor(2, thread_name_prefix="migration") as pool:
        out = run(body(pool))
    assert out[0][1].startswith(b"sync:amigration")
    assert out[1][1] == [b"s1", b"s2"]
    assert out[2][1] == b"1+2"
    assert out[3][1] == [b"zz", b"yy"]
    # Without a pool grpc.aio uses the loop's default executor: so does argrpc.aio.
    out = run(body(None))
    assert out[0][1].startswith(b"sync:aasyncio_")


@STACKS
def test_deadline_seen_by_handler_and_enforced(stack: str) -> None:
    seen: dict[str, Any] = {}
    done = threading.Event()

    async def slow(request: bytes, context: aio.ServicerContext) -> bytes:
        seen["remaining"] = context.time_remaining()
        context.add_done_callback(lambda ctx: (seen.update(cb=ctx is context), done.set()))
        try:
            await asyncio.sleep(LONG)
        except asyncio.CancelledError:
            seen["cancelled"] = True
            raise
        return b"late"

    async def body() -> None:
        async with serving({"slow": grpc.unary_unary_rpc_method_handler(slow)},
                           stack) as (_, target):
            start = time.monotonic()
            # A fresh channel's first call: its deadline leaves room to connect on a
            # machine that stalls.
            transport, out = await in_thread(fast_calls, target, [("slow", b"", "uu", 1.5)])
            elapsed = time.monotonic() - start
            assert transport.startswith(expected_transport(stack))
            assert out[0][1] == grpc.StatusCode.DEADLINE_EXCEEDED
            assert elapsed < LONG
            for _ in range(100):
                if done.is_set():
                    break
                await asyncio.sleep(0.02)

    run(body())
    assert 0 < seen["remaining"] <= 1.6  # grpc.aio may read a hair over the timeout
    assert seen.get("cancelled") is True
    assert seen.get("cb") is True


@STACKS
def test_client_cancel_reaches_the_handler(stack: str) -> None:
    events: list[str] = []
    started = threading.Event()

    async def slow(request: bytes, context: aio.ServicerContext) -> bytes:
        context.add_done_callback(lambda ctx: events.append("callback"))
        started.set()
        try:
            await asyncio.sleep(LONG)
        except asyncio.CancelledError:
            # grpc.aio's context says neither (no status was sent or set).
            assert (context.cancelled(), context.done()) == (False, False)
            events.append("cancelled")
            raise
        return b""

    async def slow_stream(request: bytes, context: aio.ServicerContext) -> AsyncIterator[bytes]:
        context.add_done_callback(lambda ctx: events.append("stream-callback"))
        try:
            while True:
                yield b"tick"
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            events.append("stream-cancelled")
            raise

    def client(target: str) -> tuple:
        with argrpc.insecure_channel(target) as ch:
            future = ch.unary_unary(method("slow")).future(b"", timeout=LONG)
            assert started.wait(5)
            future.cancel()
            stream = ch.unary_stream(method("slow_stream"))(b"", timeout=LONG)
            first = next(stream)
            stream.cancel()
            return transport_of(ch), future.cancelled(), first

    handlers = {"slow": grpc.unary_unary_rpc_method_handler(slow),
                "slow_stream": grpc.unary_stream_rpc_method_handler(slow_stream)}

    async def body() -> None:
        async with serving(handlers, stack) as (_, target):
            transport, cancelled, first = await in_thread(client, target)
            assert transport.startswith(expected_transport(stack))
            assert (cancelled, first) == (True, b"tick")
            for _ in range(500):  # a busy machine can take seconds
                if len(events) == 4:
                    break
                await asyncio.sleep(0.02)

    run(body())
    assert sorted(events) == ["callback", "cancelled", "stream-callback", "stream-cancelled"]


def test_interceptors_see_fast_path_calls_but_not_negotiation() -> None:
    seen: list[tuple[str, str]] = []

    class Recorder(aio.ServerInterceptor):
        async def intercept_service(self, continuation: Any, details: Any) -> Any:
            agent = next((v for k, v in details.invocation_metadata if k == "user-agent"), "")
            seen.append((details.method, "argrpc" if "argrpc" in agent else "other"))
            if details.method.endswith("/hidden"):
                return None
            return await continuation(details)

    async def body() -> None:
        handlers = {"echo": grpc.unary_unary_rpc_method_handler(echo),
                    "hidden": grpc.unary_unary_rpc_method_handler(echo)}
        async with serving(handlers, interceptors=[Recorder()]) as (_, target):
            transport, out = await in_thread(fast_calls, target, [("echo", b"1"), ("hidden",)])
            assert transport == "shm"
            assert out[0][1] == b"1"
            assert out[1][1:3] == (grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            async with aio.insecure_channel(target) as ch:
                assert (await aio_outcome(ch, "echo", b"2"))[1] == b"2"

    run(body())
    methods = [m for m, _ in seen]
    assert methods == [method("echo"), method("hidden"), method("echo")]
    assert not any("Bootstrap" in m for m in methods)
    with pytest.raises(ValueError):
        aio_server.server(interceptors=[object()])


def test_maximum_concurrent_rpcs_one_count_for_both_ports() -> None:
    gate: dict[str, asyncio.Event] = {}

    async def hold(request: bytes, context: aio.ServicerContext) -> bytes:
        gate["entered"].set()
        await gate["release"].wait()
        return b"held"

    def fast_hold(target: str) -> tuple:
        with argrpc.insecure_channel(target) as ch:
            out = sync_outcome(ch, "hold", b"", "uu", LONG)
            return transport_of(ch), out

    def fast_one(target: str) -> tuple:
        # A new channel negotiates while the limit is reached: negotiation is not counted.
        with argrpc.insecure_channel(target) as ch:
            out = sync_outcome(ch, "echo", b"x")
            return transport_of(ch), out

    async def body() -> None:
        gate["entered"], gate["release"] = asyncio.Event(), asyncio.Event()
        handlers = {"hold": grpc.unary_unary_rpc_method_handler(hold),
                    "echo": grpc.unary_unary_rpc_method_handler(echo)}
        async with serving(handlers, maximum_concurrent_rpcs=1) as (srv, target):
            holder = asyncio.ensure_future(in_thread(fast_hold, target))
            await asyncio.wait_for(gate["entered"].wait(), 5)
            transport, refused = await in_thread(fast_one, target)
            assert transport == "shm"
            assert refused[1:3] == (grpc.StatusCode.RESOURCE_EXHAUSTED, OVER_LIMIT)
            async with aio.insecure_channel(target) as ch:
                via_port = await aio_outcome(ch, "echo", b"y")
                assert via_port[1:3] == (grpc.StatusCode.RESOURCE_EXHAUSTED, OVER_LIMIT)
                unknown = await aio_outcome(ch, "nope", b"y")
                assert unknown[1] == grpc.StatusCode.UNIMPLEMENTED
                gate["release"].set()
                assert (await holder) == ("shm", ("OK", b"held", (), ()))
                assert (await aio_outcome(ch, "echo", b"z"))[1] == b"z"
                # A gRPC-port call holds the place now: the fast path is refused.
                gate["entered"].clear()
                gate["release"].clear()
                held = asyncio.ensure_future(aio_outcome(ch, "hold", b"", timeout=LONG))
                await asyncio.wait_for(gate["entered"].wait(), 5)
                _, refused = await in_thread(fast_one, target)
                assert refused[1:3] == (grpc.StatusCode.RESOURCE_EXHAUSTED, OVER_LIMIT)
                gate["release"].set()
                assert (await held)[1] == b"held"
            _, again = await in_thread(fast_one, target)
            assert again[1] == b"x"

    run(body())
    with pytest.raises(ValueError):
        aio_server.server(maximum_concurrent_rpcs=0)


def test_graceful_stop() -> None:
    events: list[str] = []

    async def sleeper(request: bytes, context: aio.ServicerContext) -> bytes:
        events.append("start:" + request.decode())
        context.add_done_callback(lambda ctx: events.append("cb:" + request.decode()))
        try:
            await asyncio.sleep(float(request))
        except asyncio.CancelledError:
            events.append("cancelled:" + request.decode())
            raise
        return b"done:" + request

    def client(target: str, delay: str) -> tuple:
        with argrpc.insecure_channel(target) as ch:
            ch.unary_unary(method("sleeper"))(b"0", timeout=5)  # negotiated before stop
            return transport_of(ch), sync_outcome(ch, "sleeper", delay.encode(), "uu", LONG)

    async def body() -> None:
        srv = aio_server.server()
        srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            SERVICE, {"sleeper": grpc.unary_unary_rpc_method_handler(sleeper)}),))
        target = f"127.0.0.1:{srv.add_insecure_port('127.0.0.1:0')}"
        await srv.stop(None)  # not started: nothing to do
        await srv.start()
        await srv.start()  # already running: nothing to do, as grpc.aio
        short = asyncio.ensure_future(in_thread(client, target, "0.2"))
        long = asyncio.ensure_future(in_thread(client, target, "5"))
        for _ in range(200):
            if "start:0.2" in events and "start:5" in events:
                break
            await asyncio.sleep(0.01)
        assert len(srv._calls) == 2
        assert await srv.wait_for_termination(0.01) is True
        late = fast_channel(target)
        await in_thread(late.unary_unary(method("sleeper")), b"0", 5)
        start = time.monotonic()
        stopping = asyncio.ensure_future(srv.stop(2))  # the short call's 0.2 s, and room
        await asyncio.sleep(0.05)
        refused = await in_thread(sync_outcome, late, "sleeper", b"0")
        late.close()
        assert refused[1] == grpc.StatusCode.UNAVAILABLE
        await stopping
        elapsed = time.monotonic() - start
        assert 1.9 < elapsed < 2 + LONG
        assert await short == ("shm", ("OK", b"done:0.2", (), ()))
        transport, outcome = await long
        assert transport == "shm"
        assert outcome[1:3] == (grpc.StatusCode.UNAVAILABLE, "Cancelling all calls")
        assert await srv.wait_for_termination(0.01) is False
        await srv.stop(None)  # stopped: nothing to do

    run(body())
    assert "cb:0.2" in events and "cancelled:5" in events and "cb:5" in events
    assert "cancelled:0.2" not in events


def test_stop_without_grace_cancels_at_once() -> None:
    cancelled = []
    entered = threading.Event()

    async def forever(request: bytes, context: aio.ServicerContext) -> bytes:
        entered.set()
        try:
            await asyncio.sleep(LONG)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return b""

    async def body() -> None:
        srv = aio_server.server()
        srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            SERVICE, {"forever": grpc.unary_unary_rpc_method_handler(forever),
                      "echo": grpc.unary_unary_rpc_method_handler(echo)}),))
        target = f"127.0.0.1:{srv.add_insecure_port('127.0.0.1:0')}"
        await srv.start()
        pending = asyncio.ensure_future(in_thread(fast_calls, target, [
            ("echo", b"warm-up"), ("forever", b"", "uu", LONG)]))
        waited = time.monotonic() + LONG
        while not entered.is_set() and time.monotonic() < waited:
            await asyncio.sleep(0.01)
        assert entered.is_set()
        start = time.monotonic()
        await srv.stop(None)
        assert time.monotonic() - start < LONG
        transport, out = await pending
        assert transport == "shm"
        assert out[1][1] == grpc.StatusCode.UNAVAILABLE
        assert cancelled == [True]

    run(body())


def test_large_messages_byte_exact_over_shm() -> None:
    size = 64 << 20
    payload = bytes(range(256)) * (size // 256)
    digest = hashlib.sha256(payload).digest()

    async def echo_digest(request: Any, context: aio.ServicerContext) -> bytes:
        return hashlib.sha256(request).digest() + bytes(request)

    async def big_stream(request: bytes, context: aio.ServicerContext) -> AsyncIterator[bytes]:
        for i in range(4):
            yield bytes([i]) * (16 << 20)

    def client(target: str) -> tuple:
        with argrpc.insecure_channel(target, options=UNLIMITED) as ch:
            reply = ch.unary_unary(method("echo_digest"))(payload, timeout=30)
            chunks = list(ch.unary_stream(method("big_stream"))(b"", timeout=30))
            return transport_of(ch), reply, chunks

    handlers = {"echo_digest": grpc.unary_unary_rpc_method_handler(echo_digest),
                "big_stream": grpc.unary_stream_rpc_method_handler(big_stream)}

    async def body() -> None:
        async with serving(handlers, options=UNLIMITED) as (_, target):
            transport, reply, chunks = await in_thread(client, target)
        assert transport == "shm"
        assert reply[:32] == digest
        assert len(reply) == 32 + size and reply[32:] == payload
        assert [len(c) for c in chunks] == [16 << 20] * 4
        assert all(bytes(c) == bytes([i]) * (16 << 20) for i, c in enumerate(chunks))

    run(body())


def test_streams_wait_for_a_slow_reader() -> None:
    """More eager responses than the stream window holds, to a slow reader: the
    handler's writes wait on the loop, nothing is lost or reordered."""
    count, size = 1200, 4 << 10  # 4.7 MiB through a 1 MiB window

    async def flood(request: bytes, context: aio.ServicerContext) -> AsyncIterator[bytes]:
        for i in range(count):
            yield i.to_bytes(4, "big") * (size // 4)

    def client(target: str) -> tuple:
        with argrpc.insecure_channel(target) as ch:
            got = []
            for i, message in enumerate(ch.unary_stream(method("flood"))(b"", timeout=20)):
                if i % 200 == 0:
                    time.sleep(0.05)
                got.append(int.from_bytes(bytes(message[:4]), "big"))
            return transport_of(ch), got

    async def body() -> None:
        beats = 0

        async def heartbeat() -> None:
            nonlocal beats
            while True:
                await asyncio.sleep(0.005)
                beats += 1

        ticker = asyncio.ensure_future(heartbeat())
        async with serving({"flood": grpc.unary_stream_rpc_method_handler(flood)}) as (_, target):
            transport, got = await in_thread(client, target)
        ticker.cancel()
        assert transport == "shm"
        assert got == list(range(count))
        assert beats > 5  # the loop kept running while the handler waited

    run(body())


def test_oversized_response_refused_like_grpc() -> None:
    async def big(request: bytes, context: aio.ServicerContext) -> bytes:
        return b"x" * 200

    async def big_stream(request: bytes, context: aio.ServicerContext) -> AsyncIterator[bytes]:
        yield b"small"
        yield b"x" * 200

    handlers = {"big": grpc.unary_unary_rpc_method_handler(big),
                "big_stream": grpc.unary_stream_rpc_method_handler(big_stream)}
    calls = [("big",), ("big_stream", b"", "us")]

    async def outcomes(stack: str) -> list:
        async with serving(handlers, stack,
                           options=[("grpc.max_send_message_length", 100)]) as (_, target):
            transport, out = await in_thread(fast_calls, target, calls)
            assert transport.startswith("shm" if stack == "argrpc" else "grpc")
            return out

    assert run(outcomes("argrpc")) == run(outcomes("grpc"))


def test_fast_path_disabled_serves_plain_grpc() -> None:
    async def body() -> None:
        async with serving({"echo": grpc.unary_unary_rpc_method_handler(echo)},
                           options=[("TF_RDMA_ENABLED", "false")]) as (srv, target):
            assert srv.transport_enabled is False

            def client() -> tuple:
                with argrpc.insecure_channel(target) as ch:
                    return ch.unary_unary(method("echo"))(b"p", timeout=5), transport_of(ch), \
                        ch.fallback_reason

            reply, transport, reason = await in_thread(client)
            assert reply == b"p"
            assert transport.startswith("grpc") and "TF_RDMA_ENABLED=false" in reason

    run(body())


def test_bidi_handler_reads_and_writes_from_separate_tasks() -> None:
    """grpc.aio lets one task read while another writes: both wait on the call at once."""

    async def relay(requests: Any, context: aio.ServicerContext) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def reader() -> None:
            while True:
                message = await context.read()
                await queue.put(message)
                if message is aio.EOF:
                    return

        task = asyncio.ensure_future(reader())
        while True:
            message = await queue.get()
            if message is aio.EOF:
                break
            await context.write(message + b"<")
        await task

    def client(target: str) -> tuple:
        with argrpc.insecure_channel(target) as ch:
            replies = []

            def requests() -> Any:
                for i in range(20):
                    time.sleep(0.002)
                    yield b"%d" % i

            for reply in ch.stream_stream(method("relay"))(requests(), timeout=10):
                replies.append(reply)
            return transport_of(ch), replies

    async def body() -> None:
        async with serving({"relay": grpc.stream_stream_rpc_method_handler(relay)}) as (_, target):
            transport, replies = await in_thread(client, target)
        assert transport == "shm"
        assert replies == [b"%d<" % i for i in range(20)]

    run(body())


def test_server_api_edges() -> None:
    async def body() -> None:
        srv = aio_server.server()
        assert srv.transport_enabled is True
        waiter = asyncio.ensure_future(srv.wait_for_termination())
        srv.add_registered_method_handlers(SERVICE, {
            "echo": grpc.unary_unary_rpc_method_handler(echo)})
        target = f"127.0.0.1:{srv.add_insecure_port('127.0.0.1:0')}"
        await srv.start()
        # Registered after the start: ignored, as grpc.aio ignores it.
        srv.add_registered_method_handlers(SERVICE, {
            "late": grpc.unary_unary_rpc_method_handler(echo)})
        transport, out = await in_thread(fast_calls, target, [("echo", b"r"), ("late", b"r")])
        assert transport == "shm"
        assert out[0][1] == b"r"
        assert out[1][1] == grpc.StatusCode.UNIMPLEMENTED
        assert not waiter.done()
        await srv.stop(0)
        assert await asyncio.wait_for(waiter, 5) is False
        with pytest.raises(aio.UsageError):
            await srv.start()

    run(body())


def _open_fds() -> int:
    import os
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("registered", [False, True], ids=["generic", "registered"])
def test_a_kept_context_keeps_no_connection(registered: bool) -> None:
    """A handler may keep its context after the call (a log, a cache of recent calls).
    The call's engine handle must still go when the call ends, whether the handler
    answered at once or waited first, aborted or raised, so a client's connection
    (socket, rings, segments) closes when the client goes, not when the kept context
    (or the exception its state keeps) does."""
    kept: list = []

    async def keep_and_abort(request: bytes, context: aio.ServicerContext) -> bytes:
        kept.append(context)
        await context.abort(grpc.StatusCode.NOT_FOUND, "gone")
        return request

    async def keep_and_raise(request: bytes, context: aio.ServicerContext) -> bytes:
        kept.append(context)
        raise ValueError("kept")

    async def keep_now(request: bytes, context: aio.ServicerContext) -> bytes:
        kept.append(context)
        return request

    async def keep_later(request: bytes, context: aio.ServicerContext) -> bytes:
        await asyncio.sleep(0.001)
        kept.append(context)
        return request

    def client(target: str, name: str) -> str:
        with argrpc.insecure_channel(target) as ch:
            try:
                assert ch.unary_unary(method(name))(b"x", timeout=10) == b"x"
            except grpc.RpcError as e:
                assert e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNKNOWN), e
            return transport_of(ch)

    handlers = {"keep_now": grpc.unary_unary_rpc_method_handler(keep_now),
                "keep_later": grpc.unary_unary_rpc_method_handler(keep_later),
                "keep_and_abort": grpc.unary_unary_rpc_method_handler(keep_and_abort),
                "keep_and_raise": grpc.unary_unary_rpc_method_handler(keep_and_raise)}

    async def body() -> None:
        async with serving(handlers, registered=registered) as (_, target):
            assert await in_thread(client, target, "keep_now") == "shm"
            await asyncio.sleep(0.2)
            baseline = _open_fds()
            for name in ("keep_now", "keep_later", "keep_and_abort", "keep_and_raise") * 2:
                assert await in_thread(client, target, name) == "shm"
            deadline = time.monotonic() + 10
            while _open_fds() > baseline and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert _open_fds() <= baseline, (baseline, _open_fds())
            assert len(kept) == 9
            assert all(not c.cancelled() for c in kept)

    run(body())


async def busy_echo(request: bytes, context: aio.ServicerContext) -> bytes:
    await asyncio.sleep(0.002)
    return request


@STACKS
def test_the_grpc_port_is_served_while_fast_path_calls_keep_coming(stack: str) -> None:
    """Calls that come without a pause (fast-path ones on argrpc.aio) must not starve
    the gRPC port: a grpc.aio client's call and a new argrpc channel's negotiation
    still get their turn, as on grpc.aio."""
    async def scenario() -> None:
        async with serving({"E": grpc.unary_unary_rpc_method_handler(busy_echo)},
                           stack) as (_, target):
            stop = threading.Event()

            def load() -> list[str]:
                with fast_channel(target) as ch:
                    stub = ch.unary_unary(method("E"))
                    n = 0
                    while not stop.is_set():
                        assert stub(b"x", timeout=20) == b"x"
                        n += 1
                    return [transport_of(ch), str(n)]

            # Four: asyncio.to_thread's pool has min(32, CPUs + 4) threads, and the
            # fresh channel below needs one of them too.
            loaders = [asyncio.ensure_future(in_thread(load)) for _ in range(4)]
            try:
                await asyncio.sleep(0.3)
                async with aio.insecure_channel(target) as plain:
                    got = await plain.unary_unary(method("E"))(b"plain", timeout=20)
                    assert got == b"plain"
                transport, outcomes = await in_thread(
                    fast_calls, target, [("E", b"fresh", "uu", 20)])
                assert outcomes[0][:2] == ("OK", b"fresh"), outcomes
                assert transport.split(" ")[0] == expected_transport(stack), transport
            finally:
                stop.set()
            for done in await asyncio.gather(*loaders):
                assert done[0].split(" ")[0] == expected_transport(stack), done

    asyncio.run(asyncio.wait_for(scenario(), 60))


# Far below the client's seconds of calls, far above a loaded machine's delays.
SOON = 2.5
_CALLS_FOR_A_WHILE = """
import json, time
import argrpc
ch = argrpc.insecure_channel(TARGET)
echo = ch.unary_unary(METHOD)
assert echo(b"x", timeout=60, wait_for_ready=True) == b"x"
n, end = 0, time.monotonic() + SECONDS
while time.monotonic() < end:
    assert echo(b"x", timeout=60) == b"x"
    n += 1
print("RESULT " + json.dumps({"transport": ch.transport, "calls": n}))
ch.close()
"""


@STACKS
def test_timers_sockets_and_tasks_run_while_answers_need_no_round(stack: str) -> None:
    """A handler that answers at once readies nothing, so a loop serving a stream of
    such calls polls on without going round (argrpc.aio._loop): its timers, its other
    sockets and what other threads hand it must still run, as on grpc.aio, while calls
    from another process keep coming back to back (a loop that never went round would
    run them only once the calls stop, seconds later)."""
    async def scenario() -> None:
        async with serving({"E": grpc.unary_unary_rpc_method_handler(echo)},
                           stack) as (_, target):
            loop = asyncio.get_running_loop()
            code = f"TARGET = {target!r}\nMETHOD = {method('E')!r}\nSECONDS = 6.0\n" + \
                _CALLS_FOR_A_WHILE
            loader = asyncio.ensure_future(in_thread(script_result, code, {}, 120))
            near, far = socket.socketpair()
            try:
                await asyncio.sleep(1.5)  # the clients are calling
                for _ in range(20):
                    began = time.monotonic()
                    await asyncio.sleep(0.01)
                    late = time.monotonic() - began
                    assert late < SOON, f"a 10 ms timer fired after {late:.1f} s"
                near.setblocking(False)
                far.send(b"ping")
                got = await asyncio.wait_for(loop.sock_recv(near, 4), SOON)
                assert got == b"ping"
                handed = loop.create_future()
                threading.Thread(
                    target=lambda: loop.call_soon_threadsafe(handed.set_result, "here")
                ).start()
                assert await asyncio.wait_for(handed, SOON) == "here"
            finally:
                near.close()
                far.close()
            seen = await loader
            assert seen["transport"].split(" ")[0] == expected_transport(stack), seen
            assert seen["calls"] > 0, seen

    asyncio.run(asyncio.wait_for(scenario(), 90))


_PING_PONG = """
import sys, threading
import argrpc
target, name = sys.argv[1], sys.argv[2]
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
with argrpc.insecure_channel(target) as ch:
    call = ch.unary_unary(name)
    for _ in range(2000):
        call(b"x" * 64, timeout=10)
    print("polling", flush=True)
    n = 0
    while not done.is_set():
        call(b"x" * 64, timeout=10)
        n += 1
    print(ch.transport if n else "no calls", flush=True)
"""

_BUSY_SERVER = """
import asyncio, json, subprocess, sys, threading
import grpc
from grpc import aio
import argrpc.aio

async def echo(request, context):
    return request

async def tcp_echo(reader, writer):
    writer.write(await reader.readexactly(5))
    await writer.drain()
    writer.close()

async def main():
    loop = asyncio.get_running_loop()
    server = argrpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.Busy", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
    target = "127.0.0.1:%d" % server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pinger = subprocess.Popen([sys.executable, "-c", PING_PONG, target, "/t.Busy/Echo"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    seen = []
    try:
        line = await loop.run_in_executor(None, pinger.stdout.readline)
        seen.append(line.strip())  # "polling": 2000 calls made
        for _ in range(5):  # timers
            await asyncio.sleep(0.02)
        seen.append("timers")
        tcp = await asyncio.start_server(tcp_echo, "127.0.0.1", 0)  # a socket of its own
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", tcp.sockets[0].getsockname()[1])
        writer.write(b"hello")
        seen.append((await reader.readexactly(5)).decode())
        writer.close()
        tcp.close()
        woke = asyncio.Event()  # a callback from another thread: the self-pipe
        threading.Thread(target=loop.call_soon_threadsafe, args=(woke.set,)).start()
        await woke.wait()
        seen.append("woken")
        async with aio.insecure_channel(target) as plain:  # the gRPC port
            seen.append((await plain.unary_unary("/t.Busy/Echo")(b"grpc", timeout=10)).decode())
    finally:
        out, _ = await loop.run_in_executor(None, pinger.communicate, None, 10)
        seen.append(out.strip().splitlines()[-1] if out.strip() else "")
        await server.stop(None)
    return seen

try:
    print("RESULT " + json.dumps({"seen": asyncio.run(asyncio.wait_for(main(), 60))}))
except BaseException as exc:
    print("RESULT " + json.dumps({"error": repr(exc)}))
"""


def test_the_loop_serves_its_other_work_while_fast_path_calls_keep_it_polling() -> None:
    """A server answering a steady ping-pong (a client process) polls the engine instead
    of going round its loop; its timers, sockets, threadsafe callbacks and gRPC port must
    still be served. The engine's spin is long here, so that a pause in the ping-pong
    (which ends a poll with nothing found) is not what lets the loop go round."""
    result = script_result(f"PING_PONG = {_PING_PONG!r}\n" + _BUSY_SERVER,
                           env={"TF_RDMA_SPIN_US": "20000"}, timeout=120)
    assert result["seen"] == ["polling", "timers", "hello", "woken", "grpc", "shm"]


def test_the_server_call_state_is_made_with_grpc_aio_defaults() -> None:
    """The C fields of a server-side call state: the five given, the rest grpc.aio's
    RPCState defaults; made any other way, a TypeError that says how."""
    from argrpc import _core
    from argrpc.aio._context import RpcState

    a = RpcState("sc", "/s/m", 7, "server", "loop")
    b = RpcState("sc", "/s/m", 8, "server", "loop")
    assert (a.sc, a.method, a.key, a.server, a.loop) == ("sc", "/s/m", 7, "server", "loop")
    assert (a.status_code, a.status_details, a.trailing_metadata) == (0, "", ())
    assert not (a.client_closed or a.metadata_sent or a.status_sent or a.disable_next_compression)
    assert (a.task, a.token, a.abort_exception, a.py_status_code) == (None, 0, None, None)
    assert a._waiters == [] and a.callbacks == [] and a._waiters is not b._waiters
    assert a.callbacks is not b.callbacks
    a.callbacks.append(1)
    assert b.callbacks == []
    with pytest.raises(TypeError, match="five positional arguments"):
        _core.ServerCallState("sc", "/s/m", 7, "server")
    with pytest.raises(TypeError, match="five positional arguments"):
        RpcState("sc", "/s/m", 7, "server", loop="loop")
    with pytest.raises(AttributeError):
        a.something_else = 1  # type: ignore[attr-defined]
    # A handler's context: its fields as given, its loop the state's; three positional.
    from argrpc.aio._context import ServicerContext
    ctx = ServicerContext(a, str, bytes)
    assert (ctx._state, ctx._request_deserializer, ctx._response_serializer, ctx._loop) == \
        (a, str, bytes, "loop")
    with pytest.raises(TypeError, match="three positional arguments"):
        ServicerContext(a, str)  # type: ignore[call-arg]
    import contextvars
    with pytest.raises(TypeError, match="ServerCallState"):  # its first argument is one
        _core.answer_unary(object(), (None, None, None), contextvars.copy_context(), None, -1)
    with pytest.raises(TypeError, match="ServerCall"):  # nor a state whose sc is no call
        _core.answer_unary(a, (None, None, None), contextvars.copy_context(), None, -1)
    # A pass whose server is gone does nothing; one given another object refuses it.
    class Gone:
        pass
    with pytest.raises(TypeError, match="ServerCallState type"):
        _core.ServerPass(weakref.ref(Gone()), object, None, None)
    with pytest.raises(TypeError, match="weak reference"):  # it holds the server weakly
        _core.ServerPass(a, RpcState, ServicerContext, None)
    gone = Gone()
    dead = _core.ServerPass(weakref.ref(gone), RpcState, ServicerContext, None)
    del gone
    assert dead() is None
    with pytest.raises(TypeError, match="no arguments"):
        dead(1)
    other = Gone()
    with pytest.raises(TypeError, match="AioServerState"):
        _core.ServerPass(weakref.ref(other), RpcState, ServicerContext, None)()
    with pytest.raises(TypeError):  # only the engine's server makes calls
        _core.ServerCall()
