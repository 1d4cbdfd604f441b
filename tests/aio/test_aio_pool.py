"""Back-pressure of the sender's pool (TF_RDMA_BUF_SIZE) under argrpc.aio, as
tests/test_pool_pressure.py shows it for the threaded API.

A large request is copied into a block of the client's pool and pulled by the server;
one of at least TF_RDMA_ZERO_COPY_MIN reaches the handler as a view of that block (at
most a quarter of the pool per connection), so a handler that keeps it keeps the
client's block. With the pool full, a send waits on the event loop (never in the
engine) for room within the call's deadline, and other calls and tasks go on; a
message larger than the whole pool fails at once, naming the variable. Every request is
checked by the server's sha256. The client runs in its own interpreter with
TF_RDMA_BUF_SIZE=64M (the pool is process-wide and read once) and prints one RESULT line.
"""
from __future__ import annotations

from typing import Any, Iterator

import pytest

from tests.aio.servers import AioServer
from tests.support.procs import script_result

MiB = 1 << 20
POOL = 64 * MiB

CLIENT_SCRIPT = r"""
import asyncio, hashlib, json, os, time, traceback
from argrpc import aio
from argrpc._engine import peek_engine
from tests.aio.aio_service import UNLIMITED, method
from tests.support import payload

MiB = 1 << 20
TARGET, CASE = os.environ["POOL_TARGET"], os.environ["POOL_CASE"]


def stats():
    return peek_engine().pool_stats()


async def until(pred, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred(stats()):
            break
        await asyncio.sleep(0.01)
    return stats()


async def channel():
    # A connection of its own per channel: each lends the server its own share of the pool.
    ch = aio.insecure_channel(TARGET, options=UNLIMITED + [("grpc.use_local_subchannel_pool", 1)])
    assert await ch.unary_unary(method("echo"))(b"warm-up", timeout=60) == b"warm-up"
    return ch


async def hold(ch, seed, size, timeout, ms=0):
    data = payload.make(seed, size)
    try:
        reply = await ch.unary_unary(method("hold"))(
            data, timeout=timeout, metadata=(("x-hold-ms", str(ms)),))
    except aio.AioRpcError as e:
        return {"code": e.code().name, "details": e.details()}
    r = json.loads(reply)
    return {"code": "OK", "size": r["size"],
            "exact": r["sha256"] == hashlib.sha256(data).hexdigest() and r["size"] == size}


async def main(out):
    if CASE == "concurrent":
        # A send that found no room is retried by FastCall._send on the loop: count them,
        # to show the pool did push back (sampling its use can miss the moments).
        from argrpc.aio import _call
        retried = {"n": 0}
        send = _call.FastCall._send

        async def counted(self, *args, **kwargs):
            retried["n"] += 1
            return await send(self, *args, **kwargs)

        _call.FastCall._send = counted
        chans = [await channel() for _ in range(4)]
        out["capacity"] = stats()["capacity"]
        peak = {"in_use": 0, "waiters": 0}
        ticks = {"n": 0}

        async def monitor():
            while True:
                s = stats()
                peak["in_use"] = max(peak["in_use"], s["in_use"])
                peak["waiters"] = max(peak["waiters"], s["waiters"])
                ticks["n"] += 1
                await asyncio.sleep(0.002)

        mon = asyncio.create_task(monitor())
        # Each connection lends at most a quarter of the pool as views the server keeps
        # (300 ms here): four held 14 MiB views leave no room for the other four
        # requests, which wait on the loop until the holds end, whatever the speed.
        sizes = [14 * MiB + 4096 * i + i for i in range(8)]  # distinct, not page-aligned
        out["results"] = await asyncio.gather(*(hold(chans[i % 4], i, n, 120, 300)
                                                for i, n in enumerate(sizes)))
        mon.cancel()
        out["peak"], out["monitor_ticks"], out["retried"] = peak, ticks["n"], retried["n"]
        out["transport"] = [[c.transport, c.fallback_reason] for c in chans]
        out["after"] = await until(lambda s: s["in_use"] == 0)
    elif CASE == "deadline":
        # Four channels, each lending a quarter of the pool as a view the server keeps
        # for 3 s: the pool is full.
        chans = [await channel() for _ in range(4)]
        out["capacity"] = stats()["capacity"]
        holders = [asyncio.create_task(hold(c, 100 + i, 16 * MiB, 60, 3000))
                   for i, c in enumerate(chans)]
        out["full"] = await until(lambda s: s["in_use"] >= s["capacity"])
        late = await channel()
        started = time.monotonic()
        ticks = 0

        async def beat():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        heart = asyncio.create_task(beat())
        out["blocked"] = await hold(late, 7, 16 * MiB, 1.0)
        heart.cancel()
        out["blocked_s"] = time.monotonic() - started
        out["loop_ticks_while_blocked"] = ticks
        out["small_while_full"] = await hold(late, 8, 100, 5)
        out["holders_done_early"] = [h.done() for h in holders]
        out["holders"] = await asyncio.gather(*holders)
        out["freed"] = await until(lambda s: s["in_use"] == 0)
        out["later"] = [await hold(late, 9, 16 * MiB, 60), await hold(chans[0], 10, 30 * MiB, 60)]
        out["after"] = await until(lambda s: s["in_use"] == 0)
        out["transport"] = [[c.transport, c.fallback_reason] for c in chans + [late]]
    elif CASE == "too_big":
        ch = await channel()
        out["capacity"] = stats()["capacity"]
        started = time.monotonic()
        out["too_big"] = await hold(ch, 1, 80 * MiB, 60)
        out["too_big_s"] = time.monotonic() - started
        out["later"] = [await hold(ch, 3, 20 * MiB, 60), await hold(ch, 5, 100, 60)]
        out["after"] = await until(lambda s: s["in_use"] == 0)
        out["transport"] = [ch.transport, ch.fallback_reason]
    else:
        out["error"] = f"unknown case {CASE}"


out = {"case": CASE}
try:
    asyncio.run(main(out))
except Exception:
    out["error"] = traceback.format_exc()
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)  # every call has ended; skip the interpreter's slow teardown
"""


@pytest.fixture(scope="module")
def target() -> Iterator[str]:
    server = AioServer("argrpc")
    yield server.target
    server.kill()


def _run(case: str, target: str) -> dict[str, Any]:
    result = script_result(CLIENT_SCRIPT, {"POOL_CASE": case, "POOL_TARGET": target,
                                           "TF_RDMA_BUF_SIZE": "64M"})
    assert result["capacity"] == POOL, result
    return result


def _shm(transport: list) -> None:
    assert transport[0] == "shm", f"expected the shm fast path: {transport}"


def _exact(r: dict[str, Any], size: int) -> None:
    assert r["code"] == "OK", r
    assert r["exact"] and r["size"] == size, f"payload corrupted in transit: {r}"


def test_concurrent_large_calls_beyond_the_pool_all_complete(target: str) -> None:
    """Eight 14 MiB requests at once from one loop on four channels, 112 MiB through a
    64 MiB pool the server keeps half of: senders wait for room on the loop, every
    request arrives byte-exact, and the pool is empty afterwards."""
    r = _run("concurrent", target)
    for t in r["transport"]:
        _shm(t)
    for i, one in enumerate(r["results"]):
        _exact(one, 14 * MiB + 4096 * i + i)
    assert r["peak"]["in_use"] <= POOL, r["peak"]
    assert r["retried"] >= 1, "no send ever waited for pool room"
    assert r["after"]["in_use"] == 0, r["after"]
    assert r["monitor_ticks"] > 10, "the loop did not run while sends waited for room"


def test_full_pool_until_the_deadline_fails_then_recovers(target: str) -> None:
    """With the pool held full by the server, a 16 MiB send fails at its deadline with
    RESOURCE_EXHAUSTED naming TF_RDMA_BUF_SIZE (as a thread's would), the loop keeps
    running meanwhile, a small call still goes through, the held calls finish
    byte-exact, and once they do large calls work again."""
    r = _run("deadline", target)
    for t in r["transport"]:
        _shm(t)
    assert r["full"]["in_use"] >= POOL, r["full"]
    blocked = r["blocked"]
    assert blocked["code"] == "RESOURCE_EXHAUSTED", blocked
    assert "TF_RDMA_BUF_SIZE" in blocked["details"], blocked
    assert 0.8 <= r["blocked_s"] <= 2.5, r["blocked_s"]
    assert r["loop_ticks_while_blocked"] >= 20, "the loop stalled while a send waited"
    _exact(r["small_while_full"], 100)
    assert not any(r["holders_done_early"]), r["holders_done_early"]
    for i, h in enumerate(r["holders"]):
        _exact(h, 16 * MiB)
    assert r["freed"]["in_use"] == 0, r["freed"]
    _exact(r["later"][0], 16 * MiB)
    _exact(r["later"][1], 30 * MiB)
    assert r["after"]["in_use"] == 0, r["after"]


def test_message_larger_than_the_pool_fails_at_once(target: str) -> None:
    """80 MiB through a 64 MiB pool cannot ever fit: RESOURCE_EXHAUSTED naming
    TF_RDMA_BUF_SIZE at once, not at the deadline; the channel goes on."""
    r = _run("too_big", target)
    _shm(r["transport"])
    assert r["too_big"]["code"] == "RESOURCE_EXHAUSTED", r["too_big"]
    assert "TF_RDMA_BUF_SIZE" in r["too_big"]["details"], r["too_big"]
    assert r["too_big_s"] < 5, r["too_big_s"]
    _exact(r["later"][0], 20 * MiB)
    _exact(r["later"][1], 100)
    assert r["after"]["in_use"] == 0, r["after"]
