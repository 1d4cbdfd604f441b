"""The order in which a server's stop and its waiters end, side by side with grpc: when
`wait_for_termination()` returns, `stop()` has returned, so what a service does after
`await server.stop()` (log, clean up) is not cancelled when the main task leaves
`asyncio.run`; on the threaded API, the event `stop()` returned is set. Each ordering 100
times, with a client connected (so argrpc has a fast connection to close). grpc.aio does
not order them (its stop() may return after wait_for_termination(), or be cancelled by
asyncio.run first): its rounds are reported, argrpc's must all be in order."""
from __future__ import annotations

import asyncio
import threading
from concurrent import futures
from typing import Any

import grpc
import pytest

from tests.support import inproc

ROUNDS = 100


async def _echo(request: bytes, context: Any) -> bytes:
    return request


HANDLERS = grpc.method_handlers_generic_handler(
    "t", {"U": grpc.unary_unary_rpc_method_handler(_echo)})


async def _service_lifetime(stack: str, grace: float | None) -> list[str]:
    """An asyncio service as commonly written: the main task waits for termination, a
    signal handler's task stops the server and then cleans up."""
    aio = inproc.stack_module(stack).aio
    server = aio.server()
    server.add_generic_rpc_handlers((HANDLERS,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await channel.unary_unary("/t/U")(b"x", timeout=20)
    done: list[str] = []

    async def on_signal() -> None:
        await server.stop(grace)
        done.append("stop returned")

    stopper = asyncio.get_running_loop().create_task(on_signal())
    await server.wait_for_termination()
    done.append("terminated")
    del stopper  # asyncio.run cancels it if it is still running
    return done


@pytest.mark.parametrize("grace", [None, 0.5], ids=["no-grace", "grace"])
@pytest.mark.parametrize("stack", ["grpc", "argrpc"])
def test_asyncio_stop_returns_before_wait_for_termination(stack: str, grace: float | None) -> None:
    outcomes = [asyncio.run(_service_lifetime(stack, grace)) for _ in range(ROUNDS)]
    late = [o for o in outcomes if o != ["stop returned", "terminated"]]
    if stack == "grpc" and late:
        # grpc.aio wakes wait_for_termination() first: its stop() returns a turn later
        # or, when asyncio.run cancels it first, never (argrpc orders them; README).
        pytest.xfail(f"grpc.aio: {len(late)} of {ROUNDS} stops had not returned")
    assert not late, f"{len(late)} of {ROUNDS} stops had not returned: {late[0]}"


def _served_once(mod: Any) -> Any:
    """A started threaded server that has served one call (argrpc's over shm)."""
    server = mod.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t", {"U": grpc.unary_unary_rpc_method_handler(lambda r, c: r)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with mod.insecure_channel(f"127.0.0.1:{port}") as channel:
        channel.unary_unary("/t/U")(b"x", timeout=20)
    return server


@pytest.mark.parametrize("stack", ["grpc", "argrpc"])
def test_threaded_stop_event_is_set_when_wait_for_termination_returns(stack: str) -> None:
    mod = inproc.stack_module(stack)
    for round_ in range(ROUNDS // 2):
        server = _served_once(mod)
        events: list[threading.Event] = []
        stopper = threading.Thread(target=lambda: events.append(server.stop(0.2 if round_ % 2
                                                                            else None)))
        stopper.start()
        assert server.wait_for_termination(timeout=30) is False
        stopper.join(30)
        assert events and events[0].is_set(), round_


@pytest.mark.parametrize("stack", ["grpc", "argrpc"])
def test_threaded_del_ends_wait_for_termination(stack: str) -> None:
    """grpc's server stops in __del__ (code calls it to stop a server): a thread waiting
    for termination then returns, every round."""
    mod = inproc.stack_module(stack)
    # grpc's waiter notices a stop within a second: a few of its rounds are enough.
    for round_ in range(ROUNDS // 2 if stack == "argrpc" else 5):
        server = _served_once(mod)
        returned: list[bool] = []
        waiter = threading.Thread(target=lambda: returned.append(
            server.wait_for_termination(timeout=30)))
        waiter.start()
        server.__del__()
        waiter.join(30)
        assert returned == [False], round_
