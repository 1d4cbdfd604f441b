"""fork() and argrpc.aio, as multiprocessing's fork start method does it after a parent
used asyncio channels: a child's own event loop and channel negotiate a connection of
their own (the parent's engine objects are inert there), and the parent's next loop
still gets the fast path. grpc.aio channels do not survive fork(), so each process uses
channels made in it; the parent is a fresh process, so no gRPC state of other tests is
forked with it."""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys
from typing import Any

from argrpc import aio
from tests.aio.aio_service import UNLIMITED, method

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = (10, 300_000, 3000, 4 << 20)


async def _echo(target: str) -> str:
    async with aio.insecure_channel(target, options=UNLIMITED) as channel:
        echo = channel.unary_unary(method("echo"))
        for i, size in enumerate(SIZES):
            body = bytes([i + 1]) * size
            assert await echo(body, timeout=60) == body
        return channel.transport


def _child(target: str, results: Any) -> None:
    try:
        results.put(("ok", asyncio.run(_echo(target))))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.put(("error", f"{type(e).__name__}: {e}"))


def parent(target: str) -> None:
    first = asyncio.run(_echo(target))
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(target, results)) for _ in range(2)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    codes = [p.exitcode for p in procs]
    print(f"RESULT {first} {outcomes} {codes} {asyncio.run(_echo(target))}", flush=True)


def test_forked_children_use_their_own_loop_and_connection() -> None:
    server = subprocess.Popen([sys.executable, "-m", "tests.aio.aio_service", "--stack",
                               "argrpc"], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        port = server.stdout.readline().split()[1] if server.stdout else ""
        proc = subprocess.run(
            [sys.executable, "-c", "import sys; from tests.aio.test_aio_fork import parent; "
             f"parent('127.0.0.1:{port}')"],
            cwd=REPO, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
        assert line == "RESULT shm [('ok', 'shm'), ('ok', 'shm')] [0, 0] shm", line
    finally:
        server.kill()
        server.wait()
