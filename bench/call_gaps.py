#!/usr/bin/env python3
"""A 64 B call's round trip when calls are spaced out: argrpc (threaded, shared memory),
argrpc with a server that spins longer, grpcio, and a pipe between two processes (the
kernel's own wake-up, nothing else).

    python3 bench/call_gaps.py [--gaps 0,50,300,1000] [--calls N] [--rounds R]
                               [--stacks argrpc,argrpc-spin,grpc,pipe] [--server-spin-us US]

A latency benchmark calls back to back, so the server is still awake when the next call
comes; a service's calls come when its users send them. Between two calls the client
here waits `gap` µs, in one of two ways: `spin` keeps its CPU busy (a client with work of
its own between calls), `sleep` gives it up (a client waiting for its next request).
Printed per stack, gap and way: the median over rounds of each round's p50 and p99 (µs),
and the CPU the server process used meanwhile, as a share of one CPU (`srv cpu`): what a
longer spin costs (`argrpc-spin`: the server alone has TF_RDMA_SPIN_US=--server-spin-us,
the client keeps the default). Rounds interleave the stacks, so drift of a shared machine
hits all alike.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
# The checkout this file is in wins over an installed argrpc.
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import grpc  # noqa: E402

import argrpc  # noqa: E402
from argrpc_bench import messages as msg  # noqa: E402
from argrpc_bench.client import stats_us  # noqa: E402
from argrpc_bench.runner import start_server  # noqa: E402

STACKS = ("argrpc", "argrpc-spin", "grpc", "pipe")
WAYS = ("spin", "sleep")
PAYLOAD = b"x" * 64
# The pipe's far end: echoes each read until EOF.
PIPE_ECHO = """import os
while data := os.read(0, 64):
    os.write(1, data)
"""


def cpu_s(pid: int) -> float:
    """CPU seconds process `pid`'s live threads have used so far (the scheduler's own
    count in nanoseconds: the tick-based utime and stime say nothing of a short run)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # the thread ended meanwhile
    return total / 1e9


def timed(call: Callable[[], object], gap_us: int, way: str, calls: int,
          server_pid: int) -> tuple[float, float, float]:
    clock = time.perf_counter_ns
    gap_ns = gap_us * 1000
    lat = []
    cpu0, wall0 = cpu_s(server_pid), clock()
    for _ in range(calls):
        t = clock()
        call()
        end = clock()
        lat.append(end - t)
        if way == "sleep":
            time.sleep(gap_ns / 1e9)
        else:
            while clock() - end < gap_ns:
                pass
    share = (cpu_s(server_pid) - cpu0) / ((clock() - wall0) / 1e9)
    st = stats_us(lat)
    return st["p50_us"], st["p99_us"], share


class Peer:
    """The far end of one stack, in its own process (stopped with `procs`): the bench's
    echo server (argrpc or grpcio) or a process that echoes what a pipe brings."""

    def __init__(self, stack: str, procs: ExitStack, server_spin_us: int) -> None:
        self.stack = stack
        if stack == "pipe":
            # A process of its own (not a fork of this one, whose engine has threads and
            # whose other children's pipes it would hold open).
            echo = subprocess.Popen([sys.executable, "-c", PIPE_ECHO],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            procs.callback(echo.wait, 30)
            procs.callback(echo.kill)
            self.pid = echo.pid  # the process whose CPU is measured
            assert echo.stdin is not None and echo.stdout is not None
            to_child, from_child = echo.stdin.fileno(), echo.stdout.fileno()

            def pipe_call() -> bytes:
                os.write(to_child, PAYLOAD)
                return os.read(from_child, 64)
            self.call: Callable[[], object] = pipe_call
            return
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path[:2])}
        if stack == "argrpc-spin":
            env["TF_RDMA_SPIN_US"] = str(server_spin_us)
        kind = "grpc" if stack == "grpc" else "argrpc"
        server, port = start_server(procs, f"{stack} server", "argrpc_bench.server",
                                    ["--stack", kind], env)
        self.pid = server.proc.pid
        factory = argrpc.insecure_channel if kind == "argrpc" else grpc.insecure_channel
        channel = procs.enter_context(factory(f"127.0.0.1:{port}"))
        method = channel.unary_unary(msg.path(msg.SERVICE, msg.ECHO_RAW),
                                     _registered_method=True)
        self.call = lambda: method(PAYLOAD, timeout=60)
        for _ in range(2000):
            self.call()
        if kind == "argrpc" and channel.transport != "shm":  # type: ignore[attr-defined]
            raise SystemExit(f"argrpc is on {channel.transport}, not shm: "  # type: ignore[attr-defined]
                             f"{channel.fallback_reason}")  # type: ignore[attr-defined]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gaps", default="0,50,300,1000",
                   help="µs the client waits between two calls, comma-separated")
    p.add_argument("--calls", type=int, default=1000,
                   help="timed calls per stack, gap, way and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stacks", default=",".join(STACKS))
    p.add_argument("--server-spin-us", type=int, default=2000,
                   help="the argrpc-spin server's TF_RDMA_SPIN_US (the client keeps its own)")
    a = p.parse_args()
    gaps = [int(g) for g in a.gaps.split(",")]
    stacks = [s for s in a.stacks.split(",") if s]
    if bad := [s for s in stacks if s not in STACKS]:
        p.error(f"unknown stack(s) {', '.join(bad)}; choose from {', '.join(STACKS)}")
    if any(g < 0 for g in gaps) or a.calls < 1 or a.rounds < 1:
        p.error("gaps must be >= 0, --calls and --rounds >= 1")
    got: dict[tuple[str, int, str], list[tuple[float, float, float]]] = {}
    with ExitStack() as procs:
        peers = [Peer(s, procs, a.server_spin_us) for s in stacks]
        for r in range(a.rounds):
            print(f"round {r + 1} of {a.rounds}", file=sys.stderr, flush=True)
            for peer in peers:
                for gap in gaps:
                    for way in WAYS:
                        got.setdefault((peer.stack, gap, way), []).append(
                            timed(peer.call, gap, way, a.calls, peer.pid))
    print(f"64 B round trip, p50 / p99 µs, and the server's CPU (median of {a.rounds} "
          "rounds)")
    print(f"{'stack':11s} {'gap µs':>7s} "
          + " ".join(f"{w:>17s} {'srv cpu':>7s}" for w in WAYS))
    for s in stacks:
        for gap in gaps:
            cells = []
            for way in WAYS:
                rows = got[(s, gap, way)]
                cells.append(f"{statistics.median(x for x, _, _ in rows):7.1f} / "
                             f"{statistics.median(y for _, y, _ in rows):7.1f} "
                             f"{statistics.median(c for _, _, c in rows):6.0%}")
            print(f"{s:11s} {gap:7d} " + " ".join(f"{c:>25s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
