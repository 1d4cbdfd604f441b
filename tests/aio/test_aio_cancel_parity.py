"""How asyncio calls end when they are cancelled or their channel closes, side by side with
grpc.aio: every arity, with and without an interceptor, cancelled while running or before
it started, a second cancel(), what the awaiting or iterating task sees, closing a channel
with calls in flight (another channel's call untouched) and with a grace period. The same
scenario runs on grpc.aio and on argrpc.aio (shared memory) and the two records must be
equal, apart from the one difference the README lists."""
from __future__ import annotations

import asyncio
import random
from typing import Any

import grpc
import pytest
from grpc import aio

from tests.support import inproc

KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


async def _unary_unary(request: bytes, context: Any) -> bytes:
    await asyncio.sleep(float(request or b"0"))
    return b"r"


async def _unary_stream(request: bytes, context: Any) -> Any:
    yield b"a"
    await asyncio.sleep(float(request or b"0"))
    yield b"b"


async def _stream_unary(requests: Any, context: Any) -> bytes:
    async for request in requests:
        await asyncio.sleep(float(request or b"0"))
    return b"r"


async def _stream_stream(requests: Any, context: Any) -> Any:
    async for request in requests:
        yield b"a"
        await asyncio.sleep(float(request or b"0"))


HANDLERS = grpc.method_handlers_generic_handler("t", {
    "unary_unary": grpc.unary_unary_rpc_method_handler(_unary_unary),
    "unary_stream": grpc.unary_stream_rpc_method_handler(_unary_stream),
    "stream_unary": grpc.stream_unary_rpc_method_handler(_stream_unary),
    "stream_stream": grpc.stream_stream_rpc_method_handler(_stream_stream)})


class PassThrough(aio.UnaryUnaryClientInterceptor, aio.UnaryStreamClientInterceptor,
                  aio.StreamUnaryClientInterceptor, aio.StreamStreamClientInterceptor):
    async def intercept_unary_unary(self, cont: Any, details: Any, request: Any) -> Any:
        return await cont(details, request)

    async def intercept_unary_stream(self, cont: Any, details: Any, request: Any) -> Any:
        return await cont(details, request)

    async def intercept_stream_unary(self, cont: Any, details: Any, request: Any) -> Any:
        return await cont(details, request)

    async def intercept_stream_stream(self, cont: Any, details: Any, request: Any) -> Any:
        return await cont(details, request)


def _start(channel: Any, kind: str, delay: bytes) -> Any:
    multi = getattr(channel, kind)(f"/t/{kind}")
    if kind.startswith("unary"):
        return multi(delay, timeout=30)

    async def requests() -> Any:
        yield delay

    return multi(requests(), timeout=30)


async def _outcome(call: Any, kind: str) -> Any:
    try:
        if kind.endswith("unary"):
            await call
            return "OK"
        return [r async for r in call]
    except asyncio.CancelledError:
        return "CancelledError"
    except grpc.RpcError as e:
        return f"{e.code().name}: {e.details()}"


async def _record(stack: str, intercepted: bool) -> dict[str, Any]:
    """What the scenario's calls said, in order."""
    out: dict[str, Any] = {}
    options = {"interceptors": [PassThrough()]} if intercepted else {}
    mod = inproc.stack_module(stack).aio
    async with inproc.asyncio_server(stack, HANDLERS) as port_target:
        channel = mod.insecure_channel(port_target)
        await channel.unary_unary("/t/unary_unary")(b"", timeout=30)  # negotiates
        out["transport"] = inproc.transport_of(channel)
        calls_channel = mod.insecure_channel(port_target, **options)
        try:
            await calls_channel.unary_unary("/t/unary_unary")(b"", timeout=30)
            for kind in KINDS:
                for when, delay in (("running", b"2"), ("unstarted", b"0")):
                    call = _start(calls_channel, kind, delay)
                    if when == "running":
                        await asyncio.sleep(0.2)
                    first = call.cancel()
                    at_once = call.cancelled()
                    second = call.cancel()
                    done = call.done()
                    ended = await _outcome(call, kind)
                    out[f"{kind} {when}"] = (first, at_once, second, done, ended,
                                             call.cancelled(), await call.code())
            # A task iterating a response stream sees the cancel as CancelledError.
            call = _start(calls_channel, "unary_stream", b"2")
            task = asyncio.ensure_future(_outcome(call, "unary_stream"))
            await asyncio.sleep(0.2)
            call.cancel()
            out["iterating task"] = await task
        finally:
            await calls_channel.close()
        # Closing a channel cancels its calls in flight and leaves another channel's alone.
        closing = mod.insecure_channel(port_target, **options)
        await closing.unary_unary("/t/unary_unary")(b"", timeout=30)
        calls = {kind: _start(closing, kind, b"2") for kind in KINDS}
        other = _start(channel, "unary_unary", b"0.5")
        await asyncio.sleep(0.2)
        await closing.close()
        for kind, call in calls.items():
            out[f"close {kind}"] = (call.cancelled(), call.done(), await _outcome(call, kind),
                                    await call.code())
        out["other channel"] = (await _outcome(other, "unary_unary"), other.cancelled())
        # A grace period lets a call that ends within it end as it would have.
        graceful = mod.insecure_channel(port_target, **options)
        await graceful.unary_unary("/t/unary_unary")(b"", timeout=30)
        calls = {kind: _start(graceful, kind, b"0.3") for kind in KINDS}
        await asyncio.sleep(0.05)
        await graceful.close(grace=5)
        for kind, call in calls.items():
            out[f"grace {kind}"] = (call.cancelled(), await _outcome(call, kind))
        await channel.close()
    return out


@pytest.mark.parametrize("intercepted", [False, True], ids=["plain", "intercepted"])
def test_cancel_and_close_end_calls_as_grpc_aio_does(intercepted: bool) -> None:
    reference = asyncio.run(_record("grpc", intercepted))
    got = asyncio.run(_record("argrpc", intercepted))
    assert (reference.pop("transport"), got.pop("transport")) == ("grpc", "shm")
    # On purpose (README): a response-streaming call is over when its server ended it, so
    # a grace period that outlasts the handler lets its responses be read; grpc.aio's
    # call is over only once read, and a close that nobody reads during cancels it.
    for kind in ("unary_stream", "stream_stream"):
        assert reference.pop(f"grace {kind}") == (True, "CancelledError")
        assert got.pop(f"grace {kind}") == (False, [b"a", b"b"] if kind == "unary_stream"
                                            else [b"a"])
    assert got == reference


@pytest.mark.parametrize("stack", ["grpc", "argrpc"])
def test_a_cancel_at_a_random_moment_ends_the_call_one_way(stack: str) -> None:
    """cancel() at any moment of a call's life: True and the call ends CANCELLED
    (CancelledError where awaited), or False and it ends as the server ended it."""
    rng = random.Random(34)

    async def body() -> None:
        async with inproc.asyncio_pair(stack, HANDLERS) as channel:
            await channel.unary_unary("/t/unary_unary")(b"", timeout=30)
            for _ in range(60):
                kind = rng.choice(KINDS)
                call = _start(channel, kind, b"0.01")
                await asyncio.sleep(rng.uniform(0, 0.03))
                cancelled = call.cancel()
                ended = await _outcome(call, kind)
                assert call.done()
                assert call.cancelled() is cancelled, (kind, ended)
                assert call.cancel() is False
                if cancelled:
                    assert ended == "CancelledError", kind
                    assert await call.code() == grpc.StatusCode.CANCELLED
                else:
                    assert ended in ("OK", [b"a", b"b"], [b"a"]), (kind, ended)
                    assert await call.code() == grpc.StatusCode.OK

    asyncio.run(body())
