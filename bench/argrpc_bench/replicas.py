"""One channel over several replicas: ``argrpc-bench replicas``.

    argrpc-bench replicas [--replicas 3] [--sizes 64,1048576] [--calls 3000] [--reps 2]
                          [--json PATH]

Three server processes per stack (the scale bench's server); one client process per run
opens one channel to ``ipv4:a,b,c`` with ``round_robin``, warms it, then makes unary calls
of each size one after another and reports RPC/s and how the calls spread over the
replicas. grpc balances its channel itself; argrpc picks a replica per call and calls it
over the fast connection that replica negotiated. Runs interleave, so the machine's drift
hits both stacks.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

__all__ = ["main"]

STACKS = ("grpc", "argrpc")
_CHILD_TIMEOUT_S = 600.0
_SERVER = "argrpc_bench.scale"


def _client(stack: str, target: str, sizes: list[int], calls: int) -> int:
    import grpc

    import argrpc

    factory: Any = grpc.insecure_channel if stack == "grpc" else argrpc.insecure_channel
    channel = factory(target, options=[("grpc.lb_policy_name", "round_robin")])
    who = channel.unary_unary("/bench.Scale/Who")
    echo = channel.unary_unary("/bench.Scale/Echo")
    for _ in range(30):
        who(b"", timeout=60)
    spread = collections.Counter(who(b"", timeout=60).decode() for _ in range(300))
    rows = {}
    for size in sizes:
        payload = b"x" * size
        for _ in range(min(100, calls)):
            echo(payload, timeout=60)
        t0 = time.perf_counter()
        for _ in range(calls):
            echo(payload, timeout=60)
        rows[str(size)] = calls / (time.perf_counter() - t0)
    result = {"rpc_per_s": rows, "spread": sorted(spread.values()),
              "transport": str(getattr(channel, "transport", "grpc"))}
    channel.close()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def _run_once(stack: str, replicas: int, sizes: list[int], calls: int) -> dict[str, Any]:
    me = [sys.executable, "-m"]
    servers = [subprocess.Popen(me + [_SERVER, "--serve", stack], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for _ in range(replicas)]
    try:
        ports = []
        for s in servers:
            assert s.stdout is not None
            line = s.stdout.readline()
            if not line.startswith("PORT "):
                raise RuntimeError(f"replicas bench ({stack}): a server did not start: {line!r}")
            ports.append(line.split()[1])
        target = "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports)
        out = subprocess.run(me + ["argrpc_bench.replicas", "--client", stack, "--target",
                                   target, "--sizes", ",".join(map(str, sizes)),
                                   "--calls", str(calls)],
                             capture_output=True, text=True, timeout=_CHILD_TIMEOUT_S)
        lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            raise RuntimeError(f"replicas bench ({stack}): the client failed: "
                               f"{out.stderr[-2000:]}")
        result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
        return result
    finally:
        for s in servers:
            if s.stdin is not None:
                s.stdin.close()
        for s in servers:
            try:
                s.wait(timeout=_CHILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                s.kill()
                s.wait()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="argrpc-bench replicas",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3, help="server processes per stack")
    parser.add_argument("--sizes", default="64,1048576", help="message sizes in bytes")
    parser.add_argument("--calls", type=int, default=3000, help="calls per size")
    parser.add_argument("--reps", type=int, default=2, help="runs of each stack")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--client", choices=STACKS, help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",") if s]
    if a.client:
        return _client(a.client, a.target, sizes, a.calls)

    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in STACKS}
    for rep in range(a.reps):
        for stack in STACKS:
            print(f"[{rep + 1}/{a.reps}] {stack}: {a.replicas} replicas", file=sys.stderr,
                  flush=True)
            runs[stack].append(_run_once(stack, a.replicas, sizes, a.calls))
    print(f"one round_robin channel over {a.replicas} replicas, unary calls one after "
          f"another (median RPC/s of {a.reps} runs):")
    print(f"{'':8} {'size':>9} {'RPC/s':>9} {'vs grpc':>8}  spread of 300 calls  transport")
    for size in sizes:
        base = statistics.median(r["rpc_per_s"][str(size)] for r in runs["grpc"])
        for stack in STACKS:
            rate = statistics.median(r["rpc_per_s"][str(size)] for r in runs[stack])
            last = runs[stack][-1]
            print(f"{stack:8} {size:>9} {rate:9.0f} {rate / base:7.1f}x  "
                  f"{'/'.join(map(str, last['spread'])):>19}  {last['transport']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"replicas": a.replicas, "sizes": sizes, "calls": a.calls,
                       "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
