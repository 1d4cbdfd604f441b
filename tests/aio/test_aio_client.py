"""argrpc.aio's client against grpc.aio's: the same calls, the same outcomes.

Behaviour tests run over the four pairs of the threaded suite (ids
client_<stack>-server_<stack>): argrpc.aio ↔ argrpc.aio (shared memory), grpc.aio ↔
argrpc.aio, argrpc.aio ↔ grpc.aio (fallback) and grpc.aio ↔ grpc.aio, the reference: one
set of assertions must hold for all four. Servers are tests.aio.aio_service processes;
the threaded argrpc echo server of the conformance suite serves the argrpc.aio client
too. Each test body is a coroutine run with asyncio.run.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import threading
import time
import uuid
from types import SimpleNamespace
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import grpc
import pytest
from grpc import aio

import argrpc.aio
from tests.aio.aio_service import TRAILING, UNLIMITED, method
from tests.aio.servers import AioServer
from tests.support.clients import SHM_AND_REFERENCE, UNLIMITED_SERVER_ARGS, pair_id

LOCAL_CANCEL = "Locally cancelled by application!"
HANG_S = 20  # a bound on a hang, for a loaded machine
# A deadline the test lets pass: long enough that the call reaches its handler first
# on a machine that stalls for a while.
DEADLINE_S = 1.5
DEAD_PEER_BOUND_S = 2.0
MiB = 1 << 20


# --- servers ---------------------------------------------------------------------------
class AioServers:
    """The shared servers, one per stack, restarted if one died."""

    def __init__(self) -> None:
        self._servers: dict[str, AioServer] = {}

    def target(self, stack: str) -> str:
        server = self._servers.get(stack)
        if server is None or not server.alive():
            server = self._servers[stack] = AioServer(stack)
        return server.target

    def close(self) -> None:
        for server in self._servers.values():
            server.kill()


@pytest.fixture(scope="module")
def aio_servers() -> Iterator[AioServers]:
    servers = AioServers()
    yield servers
    servers.close()


@pytest.fixture
def own_servers() -> Iterator[Callable[..., AioServer]]:
    """Servers owned by one test (killed at teardown)."""
    started: list[AioServer] = []

    def start(stack: str, port: int = 0) -> AioServer:
        server = AioServer(stack, port)
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()


# --- clients ---------------------------------------------------------------------------
def make_channel(stack: str, target: str, options: Any = UNLIMITED,
                 interceptors: Any = None) -> aio.Channel:
    module: Any = argrpc.aio if stack == "argrpc" else aio
    return module.insecure_channel(target, options=options, interceptors=interceptors)


def check_transport(channel: Any, pair: tuple[str, str]) -> None:
    """An argrpc.aio channel uses shm against an argrpc server and says why it fell back
    against a plain one. Call after a call (negotiation is lazy)."""
    client_stack, server_stack = pair
    if client_stack != "argrpc":
        return
    if server_stack == "argrpc":
        assert channel.transport == "shm", channel.fallback_reason
        assert channel.fallback_reason == ""
    else:
        assert channel.transport == "grpc"
        assert "server is plain gRPC" in channel.fallback_reason, channel.fallback_reason


def run(coro: Awaitable[Any], timeout: float = 20) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def run_pair(pair: tuple[str, str], servers: AioServers,
             body: Callable[[Any, str], Awaitable[Any]], interceptors: Any = None,
             warm: bool = True, timeout: float = 20) -> Any:
    """body(channel, target) on a channel of the pair's client stack to its server,
    after one call that checked the transport (`warm`)."""
    target = servers.target(pair[1])

    async def main() -> Any:
        channel = make_channel(pair[0], target, interceptors=interceptors)
        try:
            if warm:
                assert await channel.unary_unary(method("echo"))(
                    b"warm-up", timeout=10, wait_for_ready=True) == b"warm-up"
                check_transport(channel, pair)
            return await body(channel, target)
        finally:
            await channel.close()

    return run(main(), timeout)


async def outcome(awaitable: Awaitable[Any], timeout: float = 5) -> Any:
    """What awaiting gives, as a comparable value: the result, or the exception's type
    (and for AioRpcError its code and details)."""
    try:
        return await asyncio.wait_for(_await(awaitable), timeout)
    except aio.AioRpcError as e:
        return ("AioRpcError", e.code(), e.details())
    except BaseException as e:  # noqa: BLE001 - the outcome is the point
        return type(e)


async def _await(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


async def server_saw(target: str, tag: str, event: str, timeout: float = HANG_S) -> list:
    """The events the server recorded for `tag`, once `event` is among them."""
    end = time.monotonic() + timeout
    async with aio.insecure_channel(target) as ch:
        query = ch.unary_unary(method("obs"))
        while True:
            events = json.loads(await query(tag.encode(), timeout=5))
            if event in [e[0] for e in events] or time.monotonic() > end:
                return events
            await asyncio.sleep(0.02)


async def server_ended_it(target: str, tag: bytes) -> list:
    """The server's events for `tag` once the call ended there, long before its
    handler would have (the server saw the cancellation or the deadline)."""
    events = await server_saw(target, tag.decode(), "done")
    names = [e[0] for e in events]
    assert "done" in names and "woke" not in names, events
    return events


def new_tag() -> bytes:
    return uuid.uuid4().hex.encode()


def fail_request(code: str, details: str) -> bytes:
    return json.dumps({"code": code, "details": details}).encode()


# --- transport ---------------------------------------------------------------------------
def test_transport_pending_then_negotiated(pair: tuple[str, str],
                                           aio_servers: AioServers) -> None:
    async def body(channel: Any, target: str) -> None:
        if pair[0] == "argrpc":
            assert channel.transport == "pending"
            assert channel.fallback_reason == ""
        assert await channel.unary_unary(method("echo"))(b"x", timeout=10) == b"x"
        check_transport(channel, pair)
        # The channel stays on its transport.
        for _ in range(3):
            assert await channel.unary_unary(method("echo"))(b"y", timeout=10) == b"y"
        check_transport(channel, pair)

    run_pair(pair, aio_servers, body, warm=False)


def test_calls_made_while_the_channel_negotiates(pair: tuple[str, str],
                                                 aio_servers: AioServers) -> None:
    """The first calls of an argrpc.aio channel wait for its negotiation; they are
    grpc.aio calls all the same."""

    async def body(channel: Any, target: str) -> None:
        unary = channel.unary_unary(method("echo"))(b"u", timeout=10)
        stream = channel.unary_stream(method("count"))(b"2", timeout=10)
        written = channel.stream_unary(method("join"))(timeout=10)
        bidi = channel.stream_stream(method("bidi"))(iter([b"b"]), timeout=10)
        cancelled = channel.unary_unary(method("hang"))(new_tag(), timeout=10)
        seen: list[Any] = []
        unary.add_done_callback(seen.append)
        assert cancelled.cancel() is True
        assert isinstance(unary, aio.UnaryUnaryCall)
        assert isinstance(stream, aio.UnaryStreamCall)
        assert isinstance(written, aio.StreamUnaryCall)
        assert isinstance(bidi, aio.StreamStreamCall)
        await written.write(b"w")
        await written.done_writing()
        assert await unary == b"u"
        assert await stream.read() == b"0"
        assert [m async for m in bidi] == [b"b"]
        assert await written == b"w"
        assert await outcome(cancelled) is asyncio.CancelledError
        assert await cancelled.code() == grpc.StatusCode.CANCELLED
        assert cancelled.cancelled() and cancelled.done()
        await asyncio.sleep(0.01)
        assert seen == [unary]
        check_transport(channel, pair)
        with pytest.raises(aio.UsageError):
            async for _ in stream:
                pass
        stream.cancel()

    run_pair(pair, aio_servers, body, warm=False)


def test_close_while_the_channel_negotiates(pair: tuple[str, str],
                                            aio_servers: AioServers) -> None:
    async def body(channel: Any, target: str) -> None:
        call = channel.unary_unary(method("echo"))(b"x", timeout=10)
        await channel.close()
        assert await outcome(call) is asyncio.CancelledError
        assert call.cancelled()
        assert await call.code() == grpc.StatusCode.CANCELLED

    run_pair(pair, aio_servers, body, warm=False)


def test_channel_ready_and_state(pair: tuple[str, str], aio_servers: AioServers) -> None:
    async def body(channel: Any, target: str) -> None:
        assert channel.get_state() == grpc.ChannelConnectivity.IDLE
        await asyncio.wait_for(channel.channel_ready(), 10)
        assert channel.get_state() == grpc.ChannelConnectivity.READY
        # channel_ready() negotiated: the transport is known before any call.
        check_transport(channel, pair)
        changed = asyncio.ensure_future(
            channel.wait_for_state_change(grpc.ChannelConnectivity.READY))
        await asyncio.sleep(0.05)
        assert not changed.done()
        await channel.close()
        await asyncio.wait_for(changed, 5)
        assert channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN

    run_pair(pair, aio_servers, body, warm=False)


def test_async_with(pair: tuple[str, str], aio_servers: AioServers) -> None:
    target = aio_servers.target(pair[1])

    async def body() -> None:
        async with make_channel(pair[0], target) as channel:
            assert await channel.unary_unary(method("echo"))(b"w", timeout=10) == b"w"
            check_transport(channel, pair)
        assert channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN
        with pytest.raises(aio.UsageError):
            channel.unary_unary(method("echo"))(b"late", timeout=10)

    run(body())


# --- the four arities --------------------------------------------------------------------
def test_unary_unary(pair: tuple[str, str], aio_servers: AioServers) -> None:
    async def body(channel: Any, target: str) -> None:
        call = channel.unary_unary(method("echo"))(b"hello", timeout=10)
        assert isinstance(call, aio.UnaryUnaryCall)
        assert 9 < call.time_remaining() <= 10
        seen: list[Any] = []
        call.add_done_callback(seen.append)
        assert await call == b"hello"
        assert await call == b"hello"  # awaiting again gives the same response
        assert await call.code() == grpc.StatusCode.OK
        assert await call.details() == ""
        assert await call.initial_metadata() == aio.Metadata()
        assert await call.trailing_metadata() == aio.Metadata()
        assert await call.debug_error_string() == ""
        await call.wait_for_connection()
        assert call.done() and not call.cancelled()
        assert call.cancel() is False
        await asyncio.sleep(0.01)
        assert seen == [call]
        late: list[Any] = []
        call.add_done_callback(late.append)  # a finished call runs it now
        await asyncio.sleep(0.01)
        assert late == [call]
        no_deadline = channel.unary_unary(method("echo"))(b"")
        assert no_deadline.time_remaining() is None
        assert await no_deadline == b""

    run_pair(pair, aio_servers, body)


def test_unary_unary_awaited_beside_its_status(pair: tuple[str, str],
                                              aio_servers: AioServers) -> None:
    """Tasks waiting for a unary call's status and metadata while another awaits its
    response all wake when it ends (the awaiting task ends the call itself when nobody
    else waits on it, and must not leave those who do asleep)."""
    async def body(channel: Any, target: str) -> None:
        delayed = channel.unary_unary(method("delay"))
        for ms in (0, 30) * 5:
            call = delayed(str(ms).encode(), timeout=10)
            code = asyncio.ensure_future(call.code())
            imd = asyncio.ensure_future(call.initial_metadata())
            seen: list[Any] = []
            call.add_done_callback(seen.append)
            await asyncio.sleep(0)  # both wait on the call before it is awaited
            assert await call == str(ms).encode()
            assert await asyncio.wait_for(code, HANG_S) == grpc.StatusCode.OK
            assert await asyncio.wait_for(imd, HANG_S) == aio.Metadata()
            await asyncio.sleep(0.01)
            assert seen == [call]

    run_pair(pair, aio_servers, body)


def test_every_way_to_await_a_unary_call(pair: tuple[str, str],
                                        aio_servers: AioServers) -> None:
    """A unary call is awaited the ways asyncio and its users await things: by two tasks
    at once, through gather, through a generator-based coroutine's `yield from`, under
    a tracer (a debugger's or a coverage tool's), and seen as awaitable; each gets the
    response, and a call that failed raises the same error to every awaiter."""
    import collections.abc
    import inspect
    import sys
    import types

    @types.coroutine
    def delegated(call: Any) -> Any:
        return (yield from call.__await__())

    async def body(channel: Any, target: str) -> None:
        delayed = channel.unary_unary(method("delay"))
        call = delayed(b"30", timeout=HANG_S)
        assert inspect.isawaitable(call)
        assert not isinstance(call, collections.abc.Iterable)  # as grpc.aio's
        first, second = asyncio.ensure_future(call), asyncio.ensure_future(call)
        assert await asyncio.wait_for(asyncio.gather(first, second), HANG_S) == [b"30", b"30"]
        assert await asyncio.wait_for(delegated(delayed(b"20", timeout=HANG_S)), HANG_S) == b"20"
        traced: list[str] = []

        def tracer(frame: Any, event: str, arg: Any) -> Any:
            traced.append(event)
            return tracer

        sys.settrace(tracer)
        try:
            assert await delayed(b"10", timeout=HANG_S) == b"10"
            assert await channel.unary_unary(method("echo"))(b"x", timeout=HANG_S) == b"x"
        finally:
            sys.settrace(None)
        assert traced
        failing = channel.unary_unary(method("fail"))(
            fail_request("NOT_FOUND", "gone"), timeout=HANG_S)
        outcomes = await asyncio.gather(outcome(failing), outcome(failing),
                                        outcome(delegated(failing)))
        assert outcomes == [("AioRpcError", grpc.StatusCode.NOT_FOUND, "gone")] * 3

    run_pair(pair, aio_servers, body)


def test_an_awaiter_that_takes_the_end_wakes_the_others(pair: tuple[str, str],
                                                         aio_servers: AioServers) -> None:
    """A call awaited by one task that waits for it, then by another that finds it ended
    before the loop read the end's post: the second takes the outcome itself, and the
    first still wakes to it (it once waited for a post that came to nobody)."""

    async def body(channel: Any, target: str) -> None:
        for request, want in ((b"100", b"100"),
                              (fail_request("NOT_FOUND", "gone"),
                               ("AioRpcError", grpc.StatusCode.NOT_FOUND, "gone"))):
            name = "delay" if request == b"100" else "fail"
            call = channel.unary_unary(method(name))(request, timeout=HANG_S)
            first = asyncio.ensure_future(outcome(call))
            for _ in range(3):  # the first awaiter asks, finds nothing yet and waits
                await asyncio.sleep(0)
            # The loop held up: the engine reads the end and posts it, nobody drains it.
            ends_by = time.monotonic() + HANG_S
            core = getattr(call, "_core", None)  # a fast-path call's (else grpc.aio's)
            if core is not None:
                while not core.settled() and time.monotonic() < ends_by:
                    time.sleep(0.01)
            else:
                time.sleep(0.5)
            try:  # awaited in this step, before the loop looks at its posts again
                got: Any = await call
            except aio.AioRpcError as e:
                got = ("AioRpcError", e.code(), e.details())
            assert got == want
            assert await first == want

    run_pair(pair, aio_servers, body)


def test_a_call_object_not_made_by_a_channel_says_so() -> None:
    """The engine's base types of the call classes, made bare, raise a clear error where
    a channel's call would run, not crash the interpreter."""
    from argrpc import _core

    bare = _core.UnaryCallState()
    assert bare.max_send == -1 and bare._waiters is None and not bare._ended
    with pytest.raises(RuntimeError, match="not made by an argrpc.aio channel"):
        bare._on_end()

    async def awaited() -> None:
        await _core.UnaryCallState()

    with pytest.raises(RuntimeError, match="not made by an argrpc.aio channel"):
        asyncio.run(awaited())


def test_unary_stream_iterate_and_read(pair: tuple[str, str],
                                       aio_servers: AioServers) -> None:
    async def body(channel: Any, target: str) -> None:
        count = channel.unary_stream(method("count"))
        call = count(b"3", timeout=10)
        assert isinstance(call, aio.UnaryStreamCall)
        assert [m async for m in call] == [b"0", b"1", b"2"]
        assert await call.code() == grpc.StatusCode.OK
        # grpc.aio: a finished call reads EOF whichever way it was read.
        assert await call.read() is aio.EOF

        call = count(b"2", timeout=10)
        assert [await call.read() for _ in range(4)] == [b"0", b"1", aio.EOF, aio.EOF]
        assert await call.code() == grpc.StatusCode.OK

        call = count(b"3", timeout=10)
        assert await call.read() == b"0"
        with pytest.raises(aio.UsageError):
            async for _ in call:
                pass
        call.cancel()

        call = count(b"3", timeout=10)
        responses = call.__aiter__()
        assert await responses.__anext__() == b"0"
        with pytest.raises(aio.UsageError):
            await call.read()
        call.cancel()

        empty = count(b"0", timeout=10)
        assert [m async for m in empty] == []
        assert await empty.code() == grpc.StatusCode.OK

    run_pair(pair, aio_servers, body)


def test_stream_unary(pair: tuple[str, str], aio_servers: AioServers) -> None:
    async def body(channel: Any, target: str) -> None:
        join = channel.stream_unary(method("join"))

        async def agen() -> AsyncIterator[bytes]:
            for r in (b"x", b"y", b"z"):
                await asyncio.sleep(0)
                yield r

        assert await join(iter([b"a", b"b"]), timeout=10) == b"a|b"
        assert await join(agen(), timeout=10) == b"x|y|z"
        assert await join(iter([]), timeout=10) == b""

        call = join(timeout=10)
        assert isinstance(call, aio.StreamUnaryCall)
        await call.write(b"1")
        await call.write(b"2")
        await call.done_writing()
        await call.done_writing()  # idempotent
        assert await call == b"1|2"
        with pytest.raises(asyncio.InvalidStateError, match="already finished"):
            await call.write(b"4")
        await call.done_writing()  # on a finished call: nothing to do

        # A server still running: the call is only half closed.
        held = channel.stream_unary(method("hang_client_stream"))(timeout=10)
        await held.write(new_tag())
        await held.done_writing()
        with pytest.raises(asyncio.InvalidStateError, match="half closed"):
            await held.write(b"3")
        held.cancel()

        call = join(iter([b"q"]), timeout=10)
        with pytest.raises(aio.UsageError):
            await call.write(b"w")
        with pytest.raises(aio.UsageError):
            await call.done_writing()
        assert await call == b"q"

        def broken() -> Any:
            yield b"1"
            raise ValueError("the iterator broke")

        call = join(broken(), timeout=10)
        with pytest.raises(asyncio.CancelledError):
            await call
        assert call.cancelled()
        assert await call.code() == grpc.StatusCode.CANCELLED
        assert await call.details() == LOCAL_CANCEL

    run_pair(pair, aio_servers, body)


def test_stream_stream(pair: tuple[str, str], aio_servers: AioServers) -> None:
    async def body(channel: Any, target: str) -> None:
        bidi = channel.stream_stream(method("bidi"))
        assert [m async for m in bidi(iter([b"a", b"b"]), timeout=10)] == [b"a", b"b"]

        call = bidi(timeout=10)
        assert isinstance(call, aio.StreamStreamCall)
        await call.wait_for_connection()
        for message in (b"ping", b"pong", b"x" * 100_000):
            await call.write(message)
            assert await call.read() == message
        await call.done_writing()
        assert await call.read() is aio.EOF
        assert await call.read() is aio.EOF
        assert await call.code() == grpc.StatusCode.OK
        with pytest.raises(asyncio.InvalidStateError):
            await call.write(b"late")

        async def requests() -> AsyncIterator[bytes]:
            for i in range(50):
                yield b"%d" % i

        got = [m async for m in bidi(requests(), timeout=10)]
        assert got == [b"%d" % i for i in range(50)]

    run_pair(pair, aio_servers, body)


# --- metadata and status -------------------------------------------------------------------
def test_metadata_both_ways(pair: tuple[str, str], aio_servers: AioServers) -> None:
    sent = (("x-text", "v1"), ("x-text", "v2"), ("x-data-bin", b"\x00\x01\xff"))

    async def body(channel: Any, target: str) -> None:
        call = channel.unary_unary(method("meta"))(b"", metadata=sent, timeout=10)
        initial = await call.initial_metadata()
        assert isinstance(initial, aio.Metadata)
        assert tuple(initial) == sent
        assert json.loads(await call) == [["x-text", "v1"], ["x-text", "v2"],
                                          ["x-data-bin", "0001ff"]]
        trailing = await call.trailing_metadata()
        assert tuple(trailing) == sent + TRAILING
        assert trailing["t-bin"] == b"\x00\xff"
        assert trailing.get_all("x-text") == ["v1", "v2"]
        # aio.Metadata, a list and a tuple all go.
        for md in (aio.Metadata(("x-a", "1")), [("x-a", "1")]):
            again = channel.unary_unary(method("meta"))(b"", metadata=md, timeout=10)
            await again
            assert tuple(await again.initial_metadata()) == (("x-a", "1"),)

    run_pair(pair, aio_servers, body)


@pytest.mark.parametrize("code", ["NOT_FOUND", "PERMISSION_DENIED", "INTERNAL", "UNAVAILABLE",
                                  "RESOURCE_EXHAUSTED"])
def test_status_from_the_server(code: str, pair: tuple[str, str],
                                aio_servers: AioServers) -> None:
    async def body(channel: Any, target: str) -> None:
        call = channel.unary_unary(method("fail"))(fail_request(code, "why: é"), timeout=10)
        with pytest.raises(aio.AioRpcError) as info:
            await call
        e = info.value
        assert isinstance(e, grpc.RpcError)
        assert (e.code(), e.details()) == (grpc.StatusCode[code], "why: é")
        assert e.initial_metadata() == aio.Metadata()
        assert tuple(e.trailing_metadata()) == TRAILING
        assert e.debug_error_string() == f"{code}:why: é"
        assert await call.code() == grpc.StatusCode[code]
        assert await call.details() == "why: é"
        assert tuple(await call.trailing_metadata()) == TRAILING
        assert call.done() and not call.cancelled()
        with pytest.raises(aio.AioRpcError):
            await call.wait_for_connection()

    run_pair(pair, aio_servers, body)


def test_errors_of_every_arity(pair: tuple[str, str], aio_servers: AioServers) -> None:
    async def body(channel: Any, target: str) -> None:
        unknown = await outcome(channel.unary_unary(method("nope"))(b"", timeout=10))
        assert unknown == ("AioRpcError", grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        got: list = []
        call = channel.unary_stream(method("fail_stream"))(b"", timeout=10)
        with pytest.raises(aio.AioRpcError) as info:
            async for message in call:
                got.append(message)
        assert got == [b"a", b"b"]
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.OUT_OF_RANGE,
                                                             "enough")
        assert tuple(info.value.trailing_metadata()) == TRAILING
        call = channel.unary_stream(method("fail_stream"))(b"", timeout=10)
        reads = [await outcome(call.read()) for _ in range(4)]
        error = ("AioRpcError", grpc.StatusCode.OUT_OF_RANGE, "enough")
        assert reads == [b"a", b"b", error, error]
        # Nothing written: a write racing the server's answer ends grpc.aio's call
        # INTERNAL instead.
        unknown_stream = channel.stream_stream(method("nope"))(timeout=10)
        assert await outcome(unknown_stream.read()) == (
            "AioRpcError", grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    run_pair(pair, aio_servers, body)


# --- deadlines and cancellation ------------------------------------------------------------
def test_deadline_exceeded_and_seen_by_the_server(pair: tuple[str, str],
                                                  aio_servers: AioServers) -> None:
    async def body(channel: Any, target: str) -> None:
        tag = new_tag()
        start = time.monotonic()
        call = channel.unary_unary(method("hang"))(tag, timeout=DEADLINE_S)
        with pytest.raises(aio.AioRpcError) as info:
            await call
        assert time.monotonic() - start < DEADLINE_S + HANG_S
        assert (info.value.code(), info.value.details()) == (
            grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        assert call.done() and not call.cancelled()
        assert call.time_remaining() == 0
        events = await server_saw(target, tag.decode(), "done")
        assert [e[0] for e in events] == ["start", "cancelled", "done"], events
        assert 0 < events[0][1] <= DEADLINE_S + 0.1

        tag = new_tag()
        stream = channel.unary_stream(method("hang_stream"))(tag, timeout=DEADLINE_S)
        assert await stream.read() == b"first"
        with pytest.raises(aio.AioRpcError) as info:
            await stream.read()
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await server_ended_it(target, tag)

        tag = new_tag()
        call = channel.stream_unary(method("hang_client_stream"))(timeout=DEADLINE_S)
        await call.write(tag)
        assert await outcome(call, HANG_S) == ("AioRpcError", grpc.StatusCode.DEADLINE_EXCEEDED,
                                       "Deadline Exceeded")

    run_pair(pair, aio_servers, body)


def test_an_expired_or_nan_timeout_ends_the_call_at_once(pair: tuple[str, str],
                                                        aio_servers: AioServers) -> None:
    """A negative or NaN timeout has expired, on every arity (grpc.aio's outcome); the
    call never waits for the server, whose handler would hang."""
    async def body(channel: Any, target: str) -> None:
        expired = ("AioRpcError", grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        for timeout in (-1, -0.5, float("nan")):
            for _ in range(2):  # a multicallable's later calls take the short way
                hang = channel.unary_unary(method("hang"))
                assert await outcome(hang(new_tag(), timeout=timeout), HANG_S) == expired
            stream = channel.unary_stream(method("hang_stream"))(new_tag(), timeout=timeout)
            assert await outcome(stream.read(), HANG_S) == expired
            call = channel.stream_unary(method("hang_client_stream"))(timeout=timeout)
            assert await outcome(call, HANG_S) == expired

    run_pair(pair, aio_servers, body)


def test_cancel(pair: tuple[str, str], aio_servers: AioServers) -> None:
    async def body(channel: Any, target: str) -> None:
        tag = new_tag()
        call = channel.unary_unary(method("hang"))(tag, timeout=10)
        await server_saw(target, tag.decode(), "start")
        seen: list[Any] = []
        call.add_done_callback(seen.append)
        assert call.cancel() is True
        assert call.cancel() is False
        assert call.cancelled() and call.done()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert await call.code() == grpc.StatusCode.CANCELLED
        assert await call.details() == LOCAL_CANCEL
        assert await call.trailing_metadata() == aio.Metadata()
        with pytest.raises(asyncio.CancelledError):
            await call.wait_for_connection()
        await asyncio.sleep(0.05)
        assert seen == [call]
        events = await server_saw(target, tag.decode(), "done")
        assert [e[0] for e in events] == ["start", "cancelled", "done"], events

        # Before anything went out.
        call = channel.unary_unary(method("hang"))(b"never", timeout=10)
        assert call.cancel() is True
        with pytest.raises(asyncio.CancelledError):
            await call

        for name, request in (("hang_stream", "us"), ("hang_client_stream", "su")):
            tag = new_tag()
            if request == "us":
                stream = channel.unary_stream(method(name))(tag, timeout=10)
                assert await stream.read() == b"first"
            else:
                stream = channel.stream_unary(method(name))(timeout=10)
                await stream.write(tag)
                await server_saw(target, tag.decode(), "start")
            assert stream.cancel() is True
            assert await outcome(stream.read() if request == "us" else stream) is \
                asyncio.CancelledError
            await server_ended_it(target, tag)

    run_pair(pair, aio_servers, body)


def test_unary_call_nobody_holds_still_runs(pair: tuple[str, str],
                                            aio_servers: AioServers) -> None:
    """grpc.aio's task keeps a call with one response going to its end (fire and
    forget); argrpc.aio's loop bridge does the same."""
    import gc

    async def body(channel: Any, target: str) -> None:
        tags = [new_tag(), new_tag()]
        channel.unary_unary(method("hang"))(tags[0], timeout=DEADLINE_S)
        channel.stream_unary(method("hang_client_stream"))(iter([tags[1]]), timeout=DEADLINE_S)
        gc.collect()
        for tag in tags:
            events = await server_saw(target, tag.decode(), "done")
            assert [e[0] for e in events] == ["start", "cancelled", "done"], events
            assert events[0][1] > 0.2  # it came before the deadline, which ended it

    run_pair(pair, aio_servers, body)


def test_cancelling_the_awaiting_task_cancels_the_rpc(pair: tuple[str, str],
                                                      aio_servers: AioServers) -> None:
    async def body(channel: Any, target: str) -> None:
        tag = new_tag()
        call = channel.unary_unary(method("hang"))(tag, timeout=10)
        task = asyncio.ensure_future(call)
        await server_saw(target, tag.decode(), "start")
        task.cancel()
        assert await outcome(task) is asyncio.CancelledError
        assert call.cancelled()
        assert await call.code() == grpc.StatusCode.CANCELLED
        await server_ended_it(target, tag)

        tag = new_tag()
        call = channel.unary_unary(method("hang"))(tag, timeout=HANG_S)
        await server_saw(target, tag.decode(), "start")
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(call, 0.3)
        await server_ended_it(target, tag)

        tag = new_tag()
        stream = channel.unary_stream(method("hang_stream"))(tag, timeout=10)

        async def consume() -> None:
            async for _ in stream:
                pass

        task = asyncio.ensure_future(consume())
        await server_saw(target, tag.decode(), "start")
        await asyncio.sleep(0.05)
        task.cancel()
        assert await outcome(task) is asyncio.CancelledError
        assert stream.cancelled()
        await server_ended_it(target, tag)

        # A task waiting for the status or the metadata is not the RPC's: cancelling
        # it leaves the call running (grpc.aio).
        tag = new_tag()
        call = channel.unary_unary(method("hang"))(tag, timeout=10)
        for waiting in (call.code(), call.initial_metadata(), call.trailing_metadata()):
            task = asyncio.ensure_future(waiting)
            await asyncio.sleep(0.05)
            task.cancel()
            assert await outcome(task) is asyncio.CancelledError
        assert not call.done()
        call.cancel()

    run_pair(pair, aio_servers, body)


# --- closing the channel --------------------------------------------------------------------
def test_close_with_calls_in_flight(pair: tuple[str, str], aio_servers: AioServers) -> None:
    async def body(channel: Any, target: str) -> None:
        tags = [new_tag() for _ in range(2)]
        unary = channel.unary_unary(method("hang"))(tags[0], timeout=10)
        stream = channel.unary_stream(method("hang_stream"))(tags[1], timeout=10)
        assert await stream.read() == b"first"
        await server_saw(target, tags[0].decode(), "start")
        start = time.monotonic()
        await channel.close()
        assert time.monotonic() - start < 1
        for call in (unary, stream):
            assert call.done() and call.cancelled()
            assert await call.code() == grpc.StatusCode.CANCELLED
            assert await call.details() == LOCAL_CANCEL
        assert await outcome(unary) is asyncio.CancelledError
        assert await outcome(stream.read()) is asyncio.CancelledError
        assert channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN
        with pytest.raises(aio.UsageError, match="Channel is closed"):
            channel.unary_unary(method("echo"))(b"late", timeout=10)
        with pytest.raises(aio.UsageError):
            channel.unary_stream(method("count"))(b"1", timeout=10)
        await channel.close()  # again: nothing to do
        for tag in tags:
            await server_ended_it(target, tag)

    run_pair(pair, aio_servers, body)


def test_close_with_grace(pair: tuple[str, str], aio_servers: AioServers) -> None:
    async def body(channel: Any, target: str) -> None:
        short = channel.unary_unary(method("delay"))(b"200", timeout=10)
        long = channel.unary_unary(method("hang"))(new_tag(), timeout=10)
        await asyncio.sleep(0.05)
        start = time.monotonic()
        await channel.close(2)  # the short call's 200 ms, with room for a stalled machine
        assert 1.9 < time.monotonic() - start < 2 + HANG_S
        assert await short == b"200"
        assert await outcome(long) is asyncio.CancelledError
        assert await long.details() == LOCAL_CANCEL
        with pytest.raises(ValueError, match="grace must be non-negative"):
            await make_channel(pair[0], target).close(-1)

    run_pair(pair, aio_servers, body)


def test_close_with_nothing_in_flight_returns_at_once(pair: tuple[str, str],
                                                      aio_servers: AioServers) -> None:
    async def body(channel: Any, target: str) -> None:
        start = time.monotonic()
        await channel.close(5)
        assert time.monotonic() - start < 1

    run_pair(pair, aio_servers, body)


# --- interceptors --------------------------------------------------------------------------
class Recorder:
    """What the interceptors saw, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []


class AddsMetadata(aio.UnaryUnaryClientInterceptor):
    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self.rec.seen.append(("uu", details.method, type(details.metadata), details.timeout))
        if request == b"short-circuit":
            return b"from the interceptor"
        details.metadata.add("x-added", "yes")
        call = await continuation(details, request)
        self.rec.seen.append(("uu-call", isinstance(call, aio.UnaryUnaryCall)))
        return call


class WrapsResponses(aio.UnaryStreamClientInterceptor):
    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    async def intercept_unary_stream(self, continuation: Any, details: Any,
                                     request: Any) -> Any:
        self.rec.seen.append(("us", details.method))
        call = await continuation(details, request)

        async def marked() -> AsyncIterator[bytes]:
            async for response in call:
                yield response + b"!"

        return marked()


class UpperRequests(aio.StreamUnaryClientInterceptor):
    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    async def intercept_stream_unary(self, continuation: Any, details: Any,
                                     requests: Any) -> Any:
        self.rec.seen.append(("su", details.method, requests is None))

        async def upper() -> AsyncIterator[bytes]:
            if hasattr(requests, "__aiter__"):
                async for r in requests:
                    yield r.upper()
            else:
                for r in requests:
                    yield r.upper()

        return await continuation(details, upper())


class SeesBidi(aio.StreamStreamClientInterceptor):
    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    async def intercept_stream_stream(self, continuation: Any, details: Any,
                                      requests: Any) -> Any:
        self.rec.seen.append(("ss", details.method, requests is None))
        call = await continuation(details, requests)
        self.rec.seen.append(("ss-call", isinstance(call, aio.StreamStreamCall)))
        return call


def test_interceptors_of_all_four_kinds(pair: tuple[str, str],
                                        aio_servers: AioServers) -> None:
    rec = Recorder()
    interceptors = [AddsMetadata(rec), WrapsResponses(rec), UpperRequests(rec), SeesBidi(rec)]

    async def body(channel: Any, target: str) -> None:
        call = channel.unary_unary(method("meta"))(b"", timeout=10)
        assert json.loads(await call) == [["x-added", "yes"]]
        assert tuple(await call.initial_metadata()) == (("x-added", "yes"),)

        short = channel.unary_unary(method("meta"))(b"short-circuit", timeout=10)
        assert await short == b"from the interceptor"
        assert await short.code() == grpc.StatusCode.OK
        assert await short.initial_metadata() is None
        assert await short.trailing_metadata() is None
        assert short.done() and short.cancel() is False

        stream = channel.unary_stream(method("count"))(b"3", timeout=10)
        assert [m async for m in stream] == [b"0!", b"1!", b"2!"]
        assert await stream.code() == grpc.StatusCode.OK
        failing = channel.unary_stream(method("fail_stream"))(b"", timeout=10)
        got: list = []
        with pytest.raises(aio.AioRpcError):
            async for message in failing:
                got.append(message)
        assert got == [b"a!", b"b!"]
        # The wrapped iterator's call is the real one below it.
        assert await failing.code() == grpc.StatusCode.OUT_OF_RANGE
        assert tuple(await failing.trailing_metadata()) == TRAILING
        # An intercepted call reads through its one iterator: read() after iterating.
        mixed = channel.unary_stream(method("count"))(b"2", timeout=10)
        assert await mixed.read() == b"0!"
        assert [m async for m in mixed] == [b"1!"]

        assert await channel.stream_unary(method("join"))(iter([b"a", b"b"]),
                                                          timeout=10) == b"A|B"
        # write()-style calls give the interceptors an iterator of the writes.
        written = channel.stream_unary(method("join"))(timeout=10)
        await written.write(b"w1")
        await written.write(b"w2")
        await written.done_writing()
        assert await written == b"W1|W2"

        bidi = channel.stream_stream(method("bidi"))(timeout=10)
        await bidi.write(b"p")
        assert await bidi.read() == b"p"
        await bidi.done_writing()
        assert await bidi.read() is aio.EOF
        assert await bidi.code() == grpc.StatusCode.OK

        cancelled = channel.unary_unary(method("hang"))(new_tag(), timeout=10)
        assert cancelled.cancel() is True
        assert await outcome(cancelled) is asyncio.CancelledError
        assert await cancelled.code() == grpc.StatusCode.CANCELLED
        assert await cancelled.details() == LOCAL_CANCEL

    run_pair(pair, aio_servers, body, interceptors=interceptors)
    uu = method("meta").encode()
    # The warm-up call is theirs; the bootstrap RPC of the argrpc client is not, nor is
    # the call cancelled before the interceptors ran.
    assert rec.seen == [
        ("uu", method("echo").encode(), aio.Metadata, 10), ("uu-call", True),
        ("uu", uu, aio.Metadata, 10), ("uu-call", True),
        ("uu", uu, aio.Metadata, 10),
        ("us", method("count").encode()), ("us", method("fail_stream").encode()),
        ("us", method("count").encode()),
        ("su", method("join").encode(), False), ("su", method("join").encode(), False),
        ("ss", method("bidi").encode(), False), ("ss-call", True),
    ]


def test_interceptors_reject_other_objects() -> None:
    async def body() -> None:
        for stack in ("argrpc", "grpc"):
            with pytest.raises(ValueError, match="Interceptor"):
                make_channel(stack, "127.0.0.1:1", interceptors=[object()])

    run(body())


# --- invalid input -------------------------------------------------------------------------
def test_invalid_metadata(pair: tuple[str, str], aio_servers: AioServers) -> None:
    invalid = ((("Upper", "v"),), (("x-k", "line\nbreak"),), ((":path", "/x"),),
               (("x-k", "é"),))

    async def body(channel: Any, target: str) -> None:
        for md in invalid:
            for kind, name, request in (("unary_stream", "count", b"1"),
                                        ("stream_unary", "join", None),
                                        ("stream_stream", "bidi", None)):
                call = getattr(channel, kind)(method(name))(
                    request if request is not None else iter([b"r"]), metadata=md,
                    timeout=10)
                reading = call if kind == "stream_unary" else call.read()
                assert await outcome(reading) == (
                    "AioRpcError", grpc.StatusCode.INTERNAL, "Invalid metadata"), (kind, md)
                assert await call.code() == grpc.StatusCode.INTERNAL
            call = channel.unary_unary(method("echo"))(b"", metadata=md, timeout=10)
            got = await outcome(call)
            if pair == ("argrpc", "argrpc"):
                assert got == ("AioRpcError", grpc.StatusCode.INTERNAL, "Invalid metadata")
            else:
                # grpc.aio raises an internal ExecuteBatchError here and the call never
                # ends; argrpc's fast path ends it as grpc.aio's streaming calls do.
                assert got != b"", md
            call.cancel()
        # Wrong types are Python errors, raised where the call is awaited.
        wrong_types: tuple[Any, ...] = ((("x-k-bin", "text"),), (("x-k", 5),))
        for wrong in wrong_types:
            call = channel.unary_unary(method("echo"))(b"", metadata=wrong, timeout=10)
            assert await outcome(call) is TypeError, wrong
            call.cancel()
        # A -bin key takes bytes; other keys take bytes too (sent as text).
        call = channel.unary_unary(method("meta"))(b"", metadata=(("x-k", b"raw"),),
                                                   timeout=10)
        assert json.loads(await call) == [["x-k", "raw"]]

    run_pair(pair, aio_servers, body)


def test_a_unary_call_is_made_in_one_crossing(aio_servers: AioServers,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The multicallable makes a fast-path unary call with _core.make_unary_call, without
    UnaryUnaryCall's Python constructors; the call behaves as one they made: its
    deadline, its done callbacks, its end seen by its channel."""
    from argrpc import _core
    from argrpc.aio import _call

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("UnaryUnaryCall's constructor ran")

    async def body(channel: Any, target: str) -> None:
        echo = channel.unary_unary(method("echo"))
        assert await echo(b"w", timeout=30) == b"w"  # its first call may take the long way
        monkeypatch.setattr(_call.UnaryUnaryCall, "__init__", refuse)
        call = echo(b"x", timeout=30)
        assert isinstance(call, _call.UnaryUnaryCall)
        assert 20 < call.time_remaining() <= 30
        done: list[Any] = []
        call.add_done_callback(done.append)
        assert await call == b"x"
        assert await call.code() == grpc.StatusCode.OK and call.done()
        await asyncio.sleep(0)
        assert done == [call]
        assert channel.inflight == 0
        untimed = echo(b"y")
        assert untimed.time_remaining() is None and await untimed == b"y"
        with pytest.raises(TypeError, match="UnaryCallState"):
            _core.make_unary_call(object, channel, None, None, "/m", None, b"", None, False)

    run_pair(("argrpc", "argrpc"), aio_servers, body)


def test_a_unary_multicallable_takes_grpc_aios_arguments(pair: tuple[str, str],
                                                         aio_servers: AioServers) -> None:
    """A unary-unary multicallable is called in C (argrpc); what a caller may pass it, and
    the errors of what it may not, are grpc.aio's, on every call (the second and later
    calls of a multicallable take argrpc's short way)."""

    async def body(channel: Any, target: str) -> None:
        echo = channel.unary_unary(method("echo"))
        meta = channel.unary_unary(method("meta"))
        for _ in range(2):
            assert await echo(request=b"k", timeout=10) == b"k"
            assert await echo(b"p", timeout=10, wait_for_ready=True) == b"p"
            assert await echo(b"n", timeout=None, metadata=None, credentials=None,
                              compression=None) == b"n"
            assert await echo(b"e", metadata=()) == b"e"
            assert json.loads(await meta(b"", timeout=10, metadata=(("x-k", "v"),))) == \
                [["x-k", "v"]]
            with pytest.raises(TypeError):
                echo(b"a", b"b")
            with pytest.raises(TypeError):
                echo(b"a", deadline=3)
            with pytest.raises(TypeError):
                echo(b"a", request=b"b")
            with pytest.raises(TypeError):
                echo(b"t", timeout="soon")

    run_pair(pair, aio_servers, body)


def test_the_common_unary_call_takes_no_python_frame(aio_servers: AioServers,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The multicallable's common call is made in C (its class's _call_general, the
    Python way, is not asked); a call the short way cannot make (metadata) takes the
    Python way; a request serializer that raises is logged and an empty message goes
    out, as grpc.aio does, the short way too."""
    from argrpc.aio import _channel

    general = _channel.UnaryUnaryMultiCallable._call_general
    asked: list[Any] = []

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(args)
        return general(self, *args, **kwargs)

    def broken(request: Any) -> bytes:
        raise ValueError("cannot serialize")

    async def body(channel: Any, target: str) -> None:
        echo = channel.unary_unary(method("echo"))
        faulty = channel.unary_unary(method("echo"), request_serializer=broken)
        assert await echo(b"w", timeout=30) == b"w"  # its first call may take the long way
        assert await faulty(b"w", timeout=30) == b""
        monkeypatch.setattr(_channel.UnaryUnaryMultiCallable, "_call_general", counted)
        for i in range(3):
            assert await echo(b"%d" % i, timeout=30) == b"%d" % i
        assert await echo(b"x") == b"x"
        assert asked == []
        caplog.clear()
        assert await faulty(b"y", timeout=30) == b""
        assert "Exception serializing message!" in caplog.text
        assert "cannot serialize" in caplog.text
        assert asked == []
        assert await echo(b"m", timeout=30, metadata=(("x-k", "v"),)) == b"m"
        assert asked == [(b"m",)]
        assert channel.inflight == 0

    run_pair(("argrpc", "argrpc"), aio_servers, body)


def test_request_serializer_failure(pair: tuple[str, str], aio_servers: AioServers,
                                    caplog: pytest.LogCaptureFixture) -> None:
    """grpc.aio logs a serializer's exception and sends an empty message instead."""

    def broken(request: Any) -> bytes:
        raise ValueError("cannot serialize")

    async def body(channel: Any, target: str) -> None:
        for serializer in (broken, lambda r: None):
            echo = channel.unary_unary(method("echo"), request_serializer=serializer)
            assert await echo(b"x", timeout=10) == b""
            join = channel.stream_unary(method("join"), request_serializer=serializer)
            assert await join(iter([b"a", b"b"]), timeout=10) == b"|"
            written = join(timeout=10)
            await written.write(b"a")
            await written.done_writing()
            assert await written == b""
            bidi = channel.stream_stream(method("bidi"), request_serializer=serializer)
            assert [m async for m in bidi(iter([b"q"]), timeout=10)] == [b""]
        # No serializer and not bytes: a TypeError where the call is awaited or read.
        assert await outcome(channel.unary_unary(method("echo"))("text", timeout=10)) is \
            TypeError
        stream = channel.unary_stream(method("count"))(12, timeout=10)
        assert await outcome(stream.read()) is TypeError

    run_pair(pair, aio_servers, body)
    assert "Exception serializing message!" in caplog.text


def test_response_deserializer_failure(pair: tuple[str, str], aio_servers: AioServers) -> None:
    """grpc.aio logs it and hands the application None."""

    def broken(raw: bytes) -> Any:
        raise ValueError("cannot deserialize")

    async def body(channel: Any, target: str) -> None:
        assert await channel.unary_unary(method("echo"), response_deserializer=broken)(
            b"x", timeout=10) is None
        stream = channel.unary_stream(method("count"), response_deserializer=broken)(
            b"2", timeout=10)
        assert [m async for m in stream] == [None, None]
        assert await stream.code() == grpc.StatusCode.OK

    run_pair(pair, aio_servers, body)


# --- sizes and load ------------------------------------------------------------------------
@pytest.mark.parametrize("size", [
    pytest.param(0, id="0B"), pytest.param(1, id="1B"), pytest.param(64 << 10, id="64KiB"),
    pytest.param(MiB, id="1MiB"), pytest.param(64 * MiB, id="64MiB", marks=pytest.mark.slow),
    pytest.param(256 * MiB, id="256MiB", marks=pytest.mark.slow)])
def test_sizes_byte_exact(size: int, pair: tuple[str, str], aio_servers: AioServers) -> None:
    payload = (bytes(range(251)) * (size // 251 + 1))[:size]
    digest = hashlib.sha256(payload).digest()

    async def body(channel: Any, target: str) -> None:
        reply = await channel.unary_unary(method("echo"))(payload, timeout=60)
        assert len(reply) == size and hashlib.sha256(reply).digest() == digest
        if size <= 64 * MiB:
            bidi = channel.stream_stream(method("bidi"))(iter([payload, payload]), timeout=60)
            replies = [m async for m in bidi]
            assert [hashlib.sha256(m).digest() for m in replies] == [digest, digest]

    run_pair(pair, aio_servers, body, timeout=90)


def test_1000_concurrent_unary_calls_on_one_channel(pair: tuple[str, str],
                                                    aio_servers: AioServers) -> None:
    async def body(channel: Any, target: str) -> None:
        echo = channel.unary_unary(method("echo"))
        requests = [b"%d-" % i + b"x" * (i % 300) for i in range(1000)]
        replies = await asyncio.gather(*(echo(r, timeout=30) for r in requests))
        assert replies == requests
        check_transport(channel, pair)

    run_pair(pair, aio_servers, body, timeout=60)


def test_second_loop_in_another_thread(pair: tuple[str, str],
                                       aio_servers: AioServers) -> None:
    target = aio_servers.target(pair[1])

    async def calls(label: bytes) -> tuple[list, str]:
        async with make_channel(pair[0], target) as channel:
            echo = channel.unary_unary(method("echo"))
            replies = [await echo(label + b"%d" % i, timeout=10) for i in range(200)]
            replies += await asyncio.gather(*(echo(label, timeout=10) for _ in range(50)))
            return replies, getattr(channel, "transport", "")

    other: dict[str, Any] = {}

    def in_thread() -> None:
        try:
            other["result"] = asyncio.run(calls(b"B"))
        except BaseException as e:  # noqa: BLE001 - reported below
            other["error"] = e

    thread = threading.Thread(target=in_thread)
    thread.start()
    mine = run(calls(b"A"))
    thread.join(30)
    assert "error" not in other, other.get("error")
    for label, (replies, transport) in ((b"A", mine), (b"B", other["result"])):
        assert replies == [label + b"%d" % i for i in range(200)] + [label] * 50
        if pair[0] == "argrpc":
            assert transport == ("shm" if pair[1] == "argrpc" else "grpc")


def test_channel_and_call_from_another_loop(pair: tuple[str, str],
                                            aio_servers: AioServers) -> None:
    """A grpc.aio channel belongs to the loop it was made on: its calls from another
    loop fail with RuntimeError (an asyncio error), never hang; argrpc.aio's fast path
    too."""
    target = aio_servers.target(pair[1])
    made: dict[str, Any] = {}

    async def make() -> None:
        channel = make_channel(pair[0], target)
        assert await channel.unary_unary(method("echo"))(b"a", timeout=10) == b"a"
        check_transport(channel, pair)
        made.update(channel=channel, call=channel.unary_unary(method("hang"))(new_tag(),
                                                                              timeout=10))

    async def elsewhere() -> list:
        channel = made["channel"]
        return [await outcome(channel.unary_unary(method("echo"))(b"b", timeout=2), 3),
                await outcome(made["call"], 3),
                await outcome(channel.unary_stream(method("count"))(b"1", timeout=2).read(),
                              3)]

    async def close() -> None:
        made["call"].cancel()
        await made["channel"].close()

    home = asyncio.new_event_loop()
    try:
        home.run_until_complete(make())
        got: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: got.update(r=asyncio.run(elsewhere())))
        thread.start()
        thread.join(20)
        assert got.get("r") == [RuntimeError] * 3
        home.run_until_complete(close())
    finally:
        home.close()


# --- the threaded argrpc server --------------------------------------------------------------
def test_threaded_argrpc_server(servers: Any, pb: SimpleNamespace) -> None:
    """argrpc.aio's client on the fast path to the threaded argrpc server, through the
    generated stubs."""
    target = servers.get("argrpc", UNLIMITED_SERVER_ARGS).target
    pb2 = pb.pb2

    async def body() -> None:
        async with argrpc.aio.insecure_channel(target, options=UNLIMITED) as channel:
            stub = pb.pb2_grpc.EchoStub(channel)
            reply = await stub.Unary(pb2.EchoRequest(payload=b"abc"), timeout=10,
                                     wait_for_ready=True)
            assert reply.payload == b"abc"
            assert channel.transport == "shm", channel.fallback_reason
            responses = [r.index async for r in stub.ServerStream(
                pb2.EchoRequest(response_count=4), timeout=10)]
            assert responses == [0, 1, 2, 3]
            total = await stub.ClientStream(
                iter([pb2.EchoRequest(payload=b"x")] * 3), timeout=10)
            assert total.size == 3 or total.payload == b"xxx"
            bidi = stub.Bidi(timeout=10)
            await bidi.write(pb2.EchoRequest(payload=b"p"))
            first = await bidi.read()
            assert first.payload == b"p"
            await bidi.done_writing()
            assert await bidi.read() is aio.EOF
            call = stub.Unary(pb2.EchoRequest(echo_metadata=True), timeout=10,
                              metadata=(("x-k", "v"), ("x-b-bin", b"\x00")))
            await call
            assert (("x-k", "v"), ("x-b-bin", b"\x00")) == tuple(
                (k, v) for k, v in await call.initial_metadata() if k.startswith("x-"))
            with pytest.raises(aio.AioRpcError) as info:
                await stub.Unary(pb2.EchoRequest(abort_code=grpc.StatusCode.NOT_FOUND.value[0],
                                                 abort_details="gone"), timeout=10)
            assert (info.value.code(), info.value.details()) == (grpc.StatusCode.NOT_FOUND,
                                                                 "gone")
            with pytest.raises(aio.AioRpcError) as info:
                await stub.Unary(pb2.EchoRequest(sleep_ms=5000), timeout=0.3)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            big = os.urandom(3 * MiB)
            assert (await stub.Unary(pb2.EchoRequest(payload=big), timeout=30)).payload == big

    run(body(), 60)


# --- faults and configuration ------------------------------------------------------------------
@pytest.mark.parametrize("pair", SHM_AND_REFERENCE, ids=pair_id)
def test_server_killed_mid_call(pair: tuple[str, str], own_servers: Any) -> None:
    """kill -9 of the server: every call in flight ends UNAVAILABLE within
    DEAD_PEER_BOUND_S, and once a server is back on the port the channel works again
    (renegotiated: shm again)."""
    server = own_servers(pair[1])

    async def body() -> None:
        channel = make_channel(pair[0], server.target)
        try:
            assert await channel.unary_unary(method("echo"))(b"w", timeout=10) == b"w"
            check_transport(channel, pair)
            tags = [new_tag() for _ in range(3)]
            unary = channel.unary_unary(method("hang"))(tags[0], timeout=30)
            stream = channel.unary_stream(method("hang_stream"))(tags[1], timeout=30)
            assert await stream.read() == b"first"
            upload = channel.stream_unary(method("hang_client_stream"))(timeout=30)
            await upload.write(tags[2])
            bidi = channel.stream_stream(method("bidi"))(timeout=30)
            await bidi.write(b"b")
            assert await bidi.read() == b"b"
            big = channel.unary_unary(method("echo"))(b"z" * (64 * MiB), timeout=30)
            await server_saw(server.target, tags[2].decode(), "start")
            ends: dict[str, float] = {}

            async def end_of(name: str, awaitable: Awaitable[Any]) -> Any:
                got = await outcome(awaitable, 10)
                ends[name] = time.monotonic()
                return got

            waits = [end_of("unary", unary), end_of("stream", stream.read()),
                     end_of("upload", upload), end_of("bidi", bidi.read())]
            waiting = asyncio.gather(*waits)
            await asyncio.sleep(0.05)
            server.proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            results = await waiting
            await outcome(big, 10)  # done or failed, but done
            for name, got in zip(("unary", "stream", "upload", "bidi"), results):
                assert got[:2] == ("AioRpcError", grpc.StatusCode.UNAVAILABLE), (name, got)
                assert ends[name] - killed <= DEAD_PEER_BOUND_S, (name, ends[name] - killed)
            server.proc.wait(10)

            own_servers(pair[1], server.port)
            reply = await channel.unary_unary(method("echo"))(b"back", timeout=20,
                                                             wait_for_ready=True)
            assert reply == b"back"
            check_transport(channel, pair)
        finally:
            await channel.close()

    run(body(), 60)


@pytest.mark.parametrize("how", ["environment", "option"])
def test_fast_path_disabled(how: str, aio_servers: AioServers,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    target = aio_servers.target("argrpc")
    options: list[tuple[str, Any]] = list(UNLIMITED)
    if how == "environment":
        monkeypatch.setenv("TF_RDMA_ENABLED", "false")
    else:
        options.append(("TF_RDMA_ENABLED", "false"))

    async def body() -> None:
        async with argrpc.aio.insecure_channel(target, options=options) as channel:
            assert await channel.unary_unary(method("echo"))(b"p", timeout=10) == b"p"
            assert channel.transport == "grpc"
            assert "TF_RDMA_ENABLED=false" in channel.fallback_reason

    run(body())


def test_no_resources_kept_per_event_loop(aio_servers: AioServers) -> None:
    """Each event loop a fast-path call ran on gets a notifier (an eventfd). grpc.aio
    keeps every loop it ran on, so a closed loop's notifier is let go of when the next
    loop gets its own, not when the loop is collected."""
    import gc
    target = aio_servers.target("argrpc")

    async def once() -> None:
        async with argrpc.aio.insecure_channel(target) as channel:
            assert await channel.unary_unary(method("echo"))(b"1", timeout=10) == b"1"
            assert channel.transport == "shm"

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    asyncio.run(once())
    gc.collect()
    before = fds()
    for _ in range(20):
        asyncio.run(once())
    gc.collect()
    assert fds() <= before + 2


def test_uvloop(aio_servers: AioServers) -> None:
    """A loop without a selector gets every completion through the notifier's fd."""
    uvloop = pytest.importorskip("uvloop")
    target = aio_servers.target("argrpc")

    async def body() -> None:
        async with argrpc.aio.insecure_channel(target, options=UNLIMITED) as channel:
            echo = channel.unary_unary(method("echo"))
            assert await echo(b"u", timeout=10) == b"u"
            assert channel.transport == "shm"
            assert await asyncio.gather(*(echo(b"%d" % i, timeout=10) for i in range(200))) \
                == [b"%d" % i for i in range(200)]
            stream = channel.unary_stream(method("count"))(b"5,70000", timeout=10)
            assert [len(m) async for m in stream] == [70000] * 5
            with pytest.raises(aio.AioRpcError):
                await channel.unary_unary(method("hang"))(new_tag(), timeout=0.2)
            # Nothing left to do: the loop sleeps (it would spin on a readable notifier).
            cpu = time.process_time()
            await asyncio.sleep(0.5)
            assert time.process_time() - cpu < 0.2

    runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    try:
        runner.run(asyncio.wait_for(body(), 20))
    finally:
        runner.close()


def test_every_grpc_aio_name_is_there() -> None:
    """`from argrpc import aio` stands in for `from grpc import aio` in a whole module:
    every public name of grpc.aio is argrpc.aio's too (the same object, but for the
    channel and server factories and the Channel class, which are argrpc's)."""
    own = {"insecure_channel", "secure_channel", "server", "Channel"}
    missing = sorted(set(aio.__all__) - set(argrpc.aio.__all__))
    assert not missing, missing
    for name in set(aio.__all__) - own:
        assert getattr(argrpc.aio, name) is getattr(aio, name), name
    assert issubclass(argrpc.aio.Channel, aio.Channel)
