"""Fast connections shared by a process's channels, as grpc shares subchannels: channels
to one target with the same settings use one connection; closing one channel ends only
its own calls; the last one closes the connection; `grpc.use_local_subchannel_pool=1` and
different options keep connections apart; a shared connection that dies is negotiated
again once, by whichever channel calls next. Each scenario also runs on grpc, the oracle
of what a channel's close does to other channels' calls."""
from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
import time
from concurrent import futures
from typing import Any, Iterator

import grpc
import pytest

import argrpc
from argrpc._subchannels import SUBCHANNELS
from tests.support import inproc
from tests.support.hooks import needs_test_hooks

HANG_S = 30  # a bound on a hang, for a loaded machine


def _nap(request: bytes, context: Any) -> bytes:
    time.sleep(float(request or b"0"))
    return context.invocation_metadata()[0].value.encode()  # the user-agent it saw


async def _async_nap(request: bytes, context: Any) -> bytes:
    await asyncio.sleep(float(request or b"0"))
    return dict(context.invocation_metadata())["user-agent"].encode()


HANDLERS = grpc.method_handlers_generic_handler(
    "t", {"U": grpc.unary_unary_rpc_method_handler(_nap)})
ASYNC_HANDLERS = grpc.method_handlers_generic_handler(
    "t", {"U": grpc.unary_unary_rpc_method_handler(_async_nap)})


@contextlib.contextmanager
def _serving(stack: str) -> Iterator[tuple[Any, str]]:
    """A threaded server of `stack` and its target."""
    server = inproc.stack_module(stack).server(futures.ThreadPoolExecutor(16))
    server.add_generic_rpc_handlers((HANDLERS,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield server, f"127.0.0.1:{port}"
    finally:
        server.stop(None)


@pytest.fixture
def served() -> Iterator[tuple[Any, str]]:
    with _serving("argrpc") as got:
        yield got


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_channels_to_one_target_share_one_connection(served: tuple[Any, str]) -> None:
    server, target = served
    warm = argrpc.insecure_channel(target)
    warm.unary_unary("/t/U")(b"", timeout=HANG_S)
    fds = _fds()
    channels = [argrpc.insecure_channel(target) for _ in range(100)]
    try:
        for channel in channels:
            channel.unary_unary("/t/U")(b"", timeout=HANG_S)
        assert {c.transport for c in channels} == {"shm"}
        assert len(server._listener.connections()) == 1
        # grpc's channels cost descriptors of their own (and share their subchannel);
        # the fast connection adds none per channel.
        assert _fds() - fds < 64, _fds() - fds
    finally:
        for channel in channels:
            channel.close()
    warm.close()
    deadline = time.monotonic() + HANG_S
    while server._listener.connections() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server._listener.connections() == [], "the last channel left its connection open"
    assert SUBCHANNELS.count() == 0


def test_opting_out_or_other_options_keep_connections_apart(served: tuple[Any, str]) -> None:
    server, target = served
    own = [("grpc.use_local_subchannel_pool", 1)]
    channels = [argrpc.insecure_channel(target, options=own),
                argrpc.insecure_channel(target, options=own),
                argrpc.insecure_channel(target, options=[("grpc.primary_user_agent", "a/1")]),
                argrpc.insecure_channel(target, options=[("grpc.primary_user_agent", "b/2")]),
                argrpc.insecure_channel(target)]
    try:
        seen = [c.unary_unary("/t/U")(b"", timeout=HANG_S).decode() for c in channels]
        assert {c.transport for c in channels} == {"shm"}
        assert len(server._listener.connections()) == 5
        # Each channel's calls carry its own user-agent, as on grpc.
        assert seen[2].startswith("a/1 ") and seen[3].startswith("b/2 "), seen
    finally:
        for channel in channels:
            channel.close()


@pytest.mark.parametrize("stack", ["grpc", "argrpc"])
def test_closing_a_channel_ends_only_its_own_calls(stack: str) -> None:
    with _serving(stack) as (_, target):
        _close_one_of_two(stack, target)


def _close_one_of_two(stack: str, target: str) -> None:
    factory = inproc.stack_module(stack).insecure_channel
    a, b = factory(target), factory(target)
    try:
        for c in (a, b):
            c.unary_unary("/t/U")(b"", timeout=HANG_S)
        mine = [a.unary_unary("/t/U").future(b"2", timeout=HANG_S) for _ in range(3)]
        theirs = [b.unary_unary("/t/U").future(b"0.5", timeout=HANG_S) for _ in range(3)]
        time.sleep(0.2)
        a.close()
        for f in mine:
            assert f.exception(timeout=HANG_S).code() == grpc.StatusCode.CANCELLED
        assert [f.result(timeout=HANG_S)[:4] for f in theirs] == [b"grpc"] * 3
        assert b.unary_unary("/t/U")(b"", timeout=HANG_S)[:4] == b"grpc"
        if stack == "argrpc":
            assert b.transport == "shm"
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("stack", ["grpc", "argrpc"])
def test_channels_closed_at_random_moments_leave_the_others_calls_alone(stack: str) -> None:
    """Threads call on their own channels while others open and close channels to the
    same target at random moments: no call on a channel still open fails."""
    rng = random.Random(36)
    mod = inproc.stack_module(stack)
    with _serving(stack) as (_, target):
        failures = _churn(mod, target, rng)
    assert failures == []


def _churn(mod: Any, target: str, rng: random.Random) -> list[str]:
    failures: list[str] = []
    stop = threading.Event()

    def steady() -> None:
        with mod.insecure_channel(target) as channel:
            while not stop.is_set():
                try:
                    channel.unary_unary("/t/U")(b"0.001", timeout=HANG_S)
                except grpc.RpcError as e:
                    failures.append(f"{e.code()}: {e.details()}")

    def churn(seed: int) -> None:
        r = random.Random(seed)
        while not stop.is_set():
            channel = mod.insecure_channel(target)
            future = channel.unary_unary("/t/U").future(b"0.01", timeout=HANG_S)
            time.sleep(r.uniform(0, 0.02))
            channel.close()
            future.exception(timeout=HANG_S)  # ends, one way or the other

    threads = [threading.Thread(target=steady) for _ in range(2)]
    threads += [threading.Thread(target=churn, args=(rng.random(),)) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join(HANG_S)
        assert not t.is_alive(), "a call or close hung"
    return failures


@needs_test_hooks
def test_a_shared_connection_that_fails_is_negotiated_again(served: tuple[Any, str]) -> None:
    server, target = served
    channels = [argrpc.insecure_channel(target) for _ in range(5)]
    try:
        for c in channels:
            c.unary_unary("/t/U")(b"", timeout=HANG_S)
        channels[0]._fast._probe_fail_at("route")  # fails the connection they all share
        # That call never left: it starts again where the channel routes it now.
        channels[0].unary_unary("/t/U")(b"", timeout=HANG_S)
        for c in channels:  # the next calls negotiate once and share again
            assert c.unary_unary("/t/U")(b"", timeout=HANG_S)[:4] == b"grpc"
        assert {c.transport for c in channels} == {"shm"}
        assert len(server._listener.connections()) == 1
    finally:
        for c in channels:
            c.close()


@pytest.mark.parametrize("stack", ["grpc", "argrpc"])
def test_asyncio_channels_share_and_close_alone(stack: str) -> None:
    async def body() -> None:
        async with inproc.asyncio_server(stack, ASYNC_HANDLERS) as target:
            aio = inproc.stack_module(stack).aio
            channels = [aio.insecure_channel(target) for _ in range(10)]
            for c in channels:
                await c.unary_unary("/t/U")(b"", timeout=HANG_S)
            if stack == "argrpc":
                assert {c.transport for c in channels} == {"shm"}
                assert SUBCHANNELS.count() == 1
            mine = channels[0].unary_unary("/t/U")(b"2", timeout=HANG_S)
            theirs = channels[1].unary_unary("/t/U")(b"0.3", timeout=HANG_S)
            await asyncio.sleep(0.1)
            await channels[0].close()
            assert mine.cancelled()
            assert (await theirs)[:4] == b"grpc"
            for c in channels[1:]:
                await c.close()
            if stack == "argrpc":
                assert SUBCHANNELS.count() == 0

    asyncio.run(body())
