"""fork() and argrpc.aio, as multiprocessing's fork start method does it after a parent
used asyncio channels: a child's own event loop and channel negotiate a connection of
their own (the parent's engine objects are inert there), and the parent's next loop
still gets the fast path. grpc.aio channels do not survive fork(), so each process uses
channels made in it."""
from __future__ import annotations

import asyncio
import multiprocessing
from types import SimpleNamespace
from typing import Any

from argrpc import aio
from tests.support import payload
from tests.support.clients import UNLIMITED, UNLIMITED_SERVER_ARGS


async def _echo(target: str, pb: Any, sizes: list[int]) -> str:
    async with aio.insecure_channel(target, options=UNLIMITED) as channel:
        stub = pb.pb2_grpc.EchoStub(channel)
        for i, size in enumerate(sizes):
            body = payload.make(i, size)
            resp = await stub.Unary(pb.pb2.EchoRequest(payload=body), timeout=60)
            assert payload.sha256(resp.payload) == payload.sha256(body)
        return channel.transport


def _child(target: str, pb: Any, results: Any) -> None:
    try:
        results.put(("ok", asyncio.run(_echo(target, pb, [10, payload.CHUNK_SIZE + 5, 3000]))))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.put(("error", f"{type(e).__name__}: {e}"))


def test_forked_children_use_their_own_loop_and_connection(servers: Any,
                                                            pb: SimpleNamespace) -> None:
    server = servers.get("argrpc", UNLIMITED_SERVER_ARGS)
    assert asyncio.run(_echo(server.target, pb, [64, payload.CHUNK_SIZE + 1])) == "shm"
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(server.target, pb, results)) for _ in range(2)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, f"child exit code {p.exitcode}"
    assert outcomes == [("ok", "shm")] * 2, outcomes
    assert asyncio.run(_echo(server.target, pb, [100, 2 * payload.CHUNK_SIZE])) == "shm"
