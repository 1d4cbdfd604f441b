#!/usr/bin/env python3
"""A 64 B bytes echo over argrpc (shared memory) for every pairing of how the two ends
wait: a threaded client or server, argrpc.aio on asyncio's own loop, argrpc.aio on
uvloop.

    python3 bench/loop_pairs.py [--calls N] [--rounds R] [--pairs client/server,...]

`argrpc-bench latency --api aio --loop uvloop` measures both ends on one kind of loop;
a service usually mixes them (a uvloop front end calling a threaded model server, say),
and each end waits differently: a threaded waiter and asyncio's own loop poll the engine
on their own thread, uvloop gets every answer through the notifier's eventfd, woken by
the progress thread. Rounds interleave the pairs, so drift of a shared machine hits all
alike; printed per pair: the median over rounds of each round's p50 and p99 (µs).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path
from typing import Any, Callable

# The checkout this file is in wins over an installed argrpc.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

import argrpc  # noqa: E402
import argrpc.aio  # noqa: E402
from argrpc_bench import loops  # noqa: E402  (bench/, this file's folder)
from argrpc_bench.client import stats_us  # noqa: E402

KINDS = ("threaded", "asyncio", "uvloop")
METHOD = "/loop_pairs.Echo/Call"
PAYLOAD = b"x" * 64


def serve(kind: str) -> None:
    """Prints the port, serves until stdin closes."""
    if kind == "threaded":
        server = argrpc.server(futures.ThreadPoolExecutor(4))
        server.add_registered_method_handlers("loop_pairs.Echo", {
            "Call": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)})
        print(server.add_insecure_port("127.0.0.1:0"), flush=True)
        server.start()
        sys.stdin.read()
        server.stop(0)
        return

    async def echo(req: bytes, ctx: Any) -> bytes:
        return req

    async def main() -> None:
        server = argrpc.aio.server()
        server.add_registered_method_handlers("loop_pairs.Echo", {
            "Call": grpc.unary_unary_rpc_method_handler(echo)})
        print(server.add_insecure_port("127.0.0.1:0"), flush=True)
        await server.start()
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await server.stop(0)

    loops.run(main(), kind)


def _quantiles(lat: list[int]) -> tuple[float, float]:
    st = stats_us(lat)
    return st["p50_us"], st["p99_us"]


def measure(kind: str, target: str, calls: int) -> tuple[float, float]:
    """p50 and p99 (µs) of `calls` timed round trips after a warm-up."""
    clock = time.perf_counter_ns
    if kind == "threaded":
        with argrpc.insecure_channel(target) as ch:
            call: Callable[..., bytes] = ch.unary_unary(METHOD, _registered_method=True)
            for _ in range(2000):
                call(PAYLOAD, timeout=60)
            assert ch.transport == "shm", ch.fallback_reason  # type: ignore[attr-defined]
            lat = []
            for _ in range(calls):
                t = clock()
                call(PAYLOAD, timeout=60)
                lat.append(clock() - t)
        return _quantiles(lat)

    async def main() -> tuple[float, float]:
        async with argrpc.aio.insecure_channel(target) as ch:
            call = ch.unary_unary(METHOD, _registered_method=True)
            for _ in range(2000):
                await call(PAYLOAD, timeout=60)
            assert ch.transport == "shm", ch.fallback_reason  # type: ignore[attr-defined]
            lat = []
            for _ in range(calls):
                t = clock()
                await call(PAYLOAD, timeout=60)
                lat.append(clock() - t)
        return _quantiles(lat)

    result: tuple[float, float] = loops.run(main(), kind)
    return result


def one_pair(client: str, server: str, calls: int) -> tuple[float, float]:
    """A fresh client process against a fresh server process."""
    srv = subprocess.Popen([sys.executable, __file__, "--serve", server],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout is not None and srv.stdin is not None
        port = int(srv.stdout.readline())
        out = subprocess.run([sys.executable, __file__, "--client", client,
                              "--target", f"127.0.0.1:{port}", "--calls", str(calls)],
                             capture_output=True, text=True, timeout=600, check=True)
        p50, p99 = (float(x) for x in out.stdout.split())
        return p50, p99
    finally:
        if srv.stdin is not None:
            srv.stdin.close()
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=50_000, help="timed calls per pair and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pairs", default="",
                   help="client/server kinds, comma-separated (default: all nine)")
    p.add_argument("--serve", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--client", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        serve(a.serve)
        return 0
    if a.client:
        print(*measure(a.client, a.target, a.calls))
        return 0
    missing = loops.unavailable("uvloop")
    kinds = KINDS if missing is None else tuple(k for k in KINDS if k != "uvloop")
    pairs = [tuple(x.split("/")) for x in a.pairs.split(",") if x]
    if not pairs:
        pairs = [(c, s) for c in kinds for s in kinds]
        if kinds != KINDS:
            print(f"{missing}: its pairings left out")
    for c, s in pairs:
        if c not in KINDS or s not in KINDS:
            p.error(f"--pairs: {c}/{s}: kinds are {', '.join(KINDS)}")
        if c not in kinds or s not in kinds:
            p.error(f"--pairs: {c}/{s}: {missing}")
    seen: dict[tuple[str, ...], list[tuple[float, float]]] = {pair: [] for pair in pairs}
    for _ in range(a.rounds):
        for pair in pairs:
            seen[pair].append(one_pair(pair[0], pair[1], a.calls))
    print(f"{'client':>9} {'server':>9} {'p50 µs':>8} {'p99 µs':>8}   "
          f"(median of {a.rounds} rounds of {a.calls} calls; {os.cpu_count()} CPUs)")
    for (c, s), got in seen.items():
        print(f"{c:>9} {s:>9} {statistics.median(x[0] for x in got):8.1f} "
              f"{statistics.median(x[1] for x in got):8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
