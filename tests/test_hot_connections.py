"""Only the busy connections are polled: a process with many fast connections reads the
ones heard from or called on within `cool_ms`; a quiet one is armed and left to its
doorbell. Calls on connections that cool and heat again at random moments, from several
threads, on a machine whose cores are busy, all end as they should: a connection that left
the hot set is never left unread."""
from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import threading
import time
from typing import Any

import grpc
import pytest

import argrpc
import argrpc.aio
from argrpc import _config, _engine

from tests.support.load import busy_cores
from tests.test_connection_cost import _echo_server

HANG_S = 60.0  # a bound on a hang, for a loaded machine
OWN = [("grpc.use_local_subchannel_pool", 1)]


def _engine_now() -> Any:
    engine = _engine.peek_engine()
    assert engine is not None
    return engine


def _until(pred: Any, bound: float = HANG_S) -> bool:
    end = time.monotonic() + bound
    while not pred() and time.monotonic() < end:
        time.sleep(0.01)
    return bool(pred())


@pytest.fixture
def server_port() -> Any:
    server, port = _echo_server()
    yield port
    server.stop(None)


@pytest.fixture
def many(server_port: int) -> Any:
    port = server_port
    channels = [argrpc.insecure_channel(f"127.0.0.1:{port}", options=OWN) for _ in range(40)]
    for ch in channels:
        assert ch.unary_unary("/c/Echo")(b"hi", timeout=HANG_S) == b"hi"
        assert ch.transport == "shm", ch.fallback_reason
    yield channels
    for ch in channels:
        ch.close()


def test_quiet_connections_leave_the_hot_set(many: list[Any]) -> None:
    engine = _engine_now()
    # Both ends of 40 connections live in this process.
    assert engine.connection_count >= 80
    assert _until(lambda: engine.hot_connection_count == 0), engine.hot_connection_count
    # One channel kept busy heats its own connection and the server's end of it only.
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            many[0].unary_unary("/c/Echo")(b"x", timeout=HANG_S)

    t = threading.Thread(target=busy)
    t.start()
    try:
        seen: list[int] = []

        def few() -> bool:
            seen.append(engine.hot_connection_count)
            return 1 <= seen[-1] <= 2

        assert _until(few), seen[-20:]
    finally:
        stop.set()
        t.join(HANG_S)
    assert _until(lambda: engine.hot_connection_count == 0), engine.hot_connection_count


@pytest.mark.parametrize("loaded", [False, True], ids=["quiet", "busy-cores"])
def test_calls_at_random_moments_around_the_cooling(many: list[Any], loaded: bool) -> None:
    """Each thread calls a random channel after a random pause of up to twice cool_ms, so
    connections cool and heat again while other threads poll, arm and disarm."""
    cool_s = _config.LIMITS.cool_ms / 1000
    failures: list[str] = []
    done = [0]
    lock = threading.Lock()

    def caller(seed: int) -> None:
        rng = random.Random(seed)
        for i in range(60):
            time.sleep(rng.uniform(0, 2 * cool_s))
            ch = rng.choice(many)
            body = b"%d-%d" % (seed, i)
            try:
                if ch.unary_unary("/c/Echo")(body, timeout=HANG_S) != body:
                    failures.append("wrong answer")
            except grpc.RpcError as e:
                failures.append(f"{e.code()}: {e.details()}")
            with lock:
                done[0] += 1

    with busy_cores(2 if loaded else 0):
        threads = [threading.Thread(target=caller, args=(s,)) for s in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG_S * 2)
    assert not any(t.is_alive() for t in threads), "a call hung"
    assert failures == [] and done[0] == 360, (failures[:5], done[0])
    assert all(ch.transport == "shm" for ch in many)


def test_asyncio_calls_on_cold_connections(many: list[Any], server_port: int) -> None:
    engine = _engine_now()
    port = server_port

    async def main() -> None:
        channels = [argrpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OWN)
                    for _ in range(10)]
        try:
            for ch in channels:
                assert await ch.unary_unary("/c/Echo")(b"a", timeout=HANG_S) == b"a"
            for _ in range(3):
                await asyncio.sleep(0)
                deadline = time.monotonic() + HANG_S
                while engine.hot_connection_count and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert engine.hot_connection_count == 0
                answers = await asyncio.gather(*(
                    ch.unary_unary("/c/Echo")(b"%d" % i, timeout=HANG_S)
                    for i, ch in enumerate(channels)))
                assert answers == [b"%d" % i for i in range(10)]
            assert all(ch.transport == "shm" for ch in channels)
        finally:
            for ch in channels:
                await ch.close()

    asyncio.run(main())


BIG_SERVER = r"""
import sys
from concurrent import futures
import grpc, argrpc
server = argrpc.server(futures.ThreadPoolExecutor(4), options=[
    ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
def echo(requests, context):
    for r in requests:
        yield r
server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
    "h", {"Bidi": grpc.stream_stream_rpc_method_handler(echo)})])
print(server.add_insecure_port("127.0.0.1:0"), flush=True)
server.start()
sys.stdin.read()
server.stop(None)
"""
# Messages too big to read in place (a quarter of a 512 MiB pool), read in one copy
# each: long enough for the connection to go quiet for cool_ms while the copy runs.
BIG_ENV = {"TF_RDMA_BUF_SIZE": "512M", "TF_RDMA_CHUNK_SIZE": "256M"}


@pytest.mark.parametrize("loaded", [False, True], ids=["quiet", "busy-cores"])
def test_long_copies_and_late_releases_on_a_quiet_connection(loaded: bool) -> None:
    """A message pulled by a copy that lasts longer than cool_ms, and one whose view is
    released by a reader that took its time: the copy's end and the release's FIN are
    announced through the engine's own doorbell, which names no connection, so the
    connection must still be read then. The calls end, byte-exact."""
    env = {**os.environ, **BIG_ENV}
    server = subprocess.Popen([sys.executable, "-c", BIG_SERVER], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    saved = {k: os.environ.get(k) for k in BIG_ENV}
    os.environ.update(BIG_ENV)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        with busy_cores(2 if loaded else 0):
            with argrpc.insecure_channel(f"127.0.0.1:{port}", options=OWN + [
                    ("grpc.max_receive_message_length", -1),
                    ("grpc.max_send_message_length", -1)]) as ch:
                messages = [bytes([i]) * (160 << 20) for i in range(2)]
                got = []
                for message in ch.stream_stream("/h/Bidi")(iter(messages), timeout=HANG_S * 3):
                    time.sleep(0.05)  # holds what it read (a view or a block) a while
                    got.append(bytes(message[:1]) + bytes(message[-1:]))
                    del message
                assert got == [m[:1] + m[-1:] for m in messages]
                assert ch.transport == "shm", ch.fallback_reason
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        assert server.stdin is not None
        server.stdin.close()
        server.wait(HANG_S)
