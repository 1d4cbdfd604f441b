"""kill -9 of either peer at random moments, with argrpc.aio on both sides of the fast
path. A killed server: every call in flight ends UNAVAILABLE (or had finished OK) within
2 s, the client's pool gets its blocks back and no file descriptor stays behind. A
killed client: the server goes on serving others byte-exact, and its descriptors and
shared segments return to what they were. The moments are drawn from a seeded generator
(printed on failure, ARGRPC_KILL_SEED replays it), and every trial runs also with both
cores kept busy by other processes."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from typing import Any, Iterator

import grpc
import pytest

from argrpc import aio
from argrpc._engine import peek_engine
from tests.aio.aio_service import UNLIMITED, method

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRIALS = 4
END_WITHIN_S = 2.0
SEED = int(os.environ.get("ARGRPC_KILL_SEED", str(random.randrange(1 << 30))))


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _first_line(proc: subprocess.Popen, prefix: str, timeout: float = 30.0) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline() if proc.stdout else ""
        if line.startswith(prefix):
            return line[len(prefix):].strip()
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"no {prefix!r} line from {proc.args}")


def _start_server() -> tuple[subprocess.Popen, str]:
    proc = _spawn("tests.aio.aio_service", "--stack", "argrpc")
    return proc, f"127.0.0.1:{_first_line(proc, 'PORT ')}"


def _fds(pid: int) -> tuple[int, int]:
    """(open descriptors, of them shared-memory segments) of process `pid`."""
    n = memfds = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        n += 1
        memfds += target.startswith("/memfd:")
    return n, memfds


@pytest.fixture(params=["quiet", "busy"])
def load(request: Any) -> Iterator[str]:
    hogs = []
    if request.param == "busy":
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield request.param
    for h in hogs:
        h.kill()
        h.wait()


async def _traffic(channel: aio.Channel, seed: int, outcomes: list) -> None:
    echo = channel.unary_unary(method("echo"))
    count = channel.unary_stream(method("count"))
    bidi = channel.stream_stream(method("bidi"))
    i = seed
    while True:
        i += 1
        size = (0, 100, 70_000, 2 << 20)[i % 4]
        try:
            if i % 3 == 0:
                body = bytes([i % 251]) * size
                got = await echo(body, timeout=20)
                assert got == body, "echo returned other bytes"
            elif i % 3 == 1:
                got = [m async for m in count(b"3,%d" % size, timeout=20)]
                assert got == [bytes([k]) * size for k in range(3)]
            else:
                got = [m async for m in bidi(iter([b"x" * size]), timeout=20)]
                assert got == [b"x" * size]
        except aio.AioRpcError as e:
            outcomes.append((e.code(), e.details(), time.monotonic()))
            return


async def _server_killed_trial(rng: random.Random) -> None:
    server, target = _start_server()
    try:
        async with aio.insecure_channel(target, options=UNLIMITED) as channel:
            assert await channel.unary_unary(method("echo"))(b"hi", timeout=30) == b"hi"
            assert channel.transport == "shm", channel.fallback_reason
            before = _fds(os.getpid())
            # What other calls of this process hold is theirs: only this trial's blocks
            # must come back.
            pool_before = peek_engine().pool_stats()["in_use"]
            outcomes: list = []
            tasks = [asyncio.create_task(_traffic(channel, s * 7, outcomes)) for s in range(6)]
            await asyncio.sleep(rng.uniform(0.0, 0.4))
            server.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            done, pending = await asyncio.wait(tasks, timeout=END_WITHIN_S + 1.0)
            assert not pending, f"{len(pending)} calls still running after the server died"
            for t in done:
                t.result()  # a wrong byte would have raised here
            assert len(outcomes) == len(tasks)
            for code, details, at in outcomes:
                assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
                assert at - killed <= END_WITHIN_S, f"ended {at - killed:.2f} s after the kill"
            del tasks, done
        engine = peek_engine()
        deadline = time.monotonic() + 5
        while engine.pool_stats()["in_use"] > pool_before and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert engine.pool_stats()["in_use"] <= pool_before, (pool_before, engine.pool_stats())
        assert _fds(os.getpid())[0] <= before[0], (before, _fds(os.getpid()))
    finally:
        server.kill()
        server.wait()


def test_server_killed_at_random_moments(load: str) -> None:
    rng = random.Random(SEED)
    for trial in range(TRIALS):
        try:
            asyncio.run(_server_killed_trial(rng))
        except BaseException as e:
            raise AssertionError(f"trial {trial} (ARGRPC_KILL_SEED={SEED}, {load}): {e}") from e


async def _echo_ok(target: str) -> None:
    async with aio.insecure_channel(target, options=UNLIMITED) as channel:
        echo = channel.unary_unary(method("echo"))
        for size in (10, 4 << 20):
            body = os.urandom(size)
            assert await echo(body, timeout=30) == body
        assert channel.transport == "shm", channel.fallback_reason


def test_client_killed_at_random_moments(load: str) -> None:
    rng = random.Random(SEED + 1)
    server, target = _start_server()
    try:
        asyncio.run(_echo_ok(target))
        baseline = _fds(server.pid)
        for trial in range(TRIALS):
            client = _spawn("tests.aio.aio_load", target)
            assert _first_line(client, "READY ") == "shm"
            time.sleep(rng.uniform(0.0, 0.4))
            client.send_signal(signal.SIGKILL)
            client.wait()
            asyncio.run(_echo_ok(target))  # others are served meanwhile, byte-exact
        deadline = time.monotonic() + 10
        while _fds(server.pid) > baseline and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _fds(server.pid) <= baseline, (
            f"server kept descriptors/segments (ARGRPC_KILL_SEED={SEED}, {load}): "
            f"{baseline} -> {_fds(server.pid)}")
        assert server.poll() is None
    finally:
        server.kill()
        server.wait()
