"""``argrpc-bench peers``: the libraries a Python user would pick to move a tensor between
two processes, measured in the same run, and the same table, as argrpc's raw unary call.

One round trip, for every row: process A sends N bytes to process B; B, once it holds
all N, sends N bytes back; A's clock runs from just before its send until it holds B's N
bytes. Both ends keep their buffers (allocated, and registered where the library needs
it, once per size), the warm-up round trips are not timed, and the plan (iterations or
duration, repeats) is argrpc-bench's, as for every other row. argrpc's rows are its raw
unary call (``latency --mode raw``), over shared memory and over plain grpcio.

Peers, each optional: one that is not installed, or cannot start here, is a skipped row
that says why.

- ``nixl-none``: NIXL with its UCX backend and UCX's error handling off (a one-sided
  write with a notification); ``nixl-peer``: the same with NIXL's default error mode.
  Both ends poll for the notification, as NIXL's users do, without NIXL's progress
  thread (the polling thread drives UCX).
- ``ucxx`` and ``torch-rpc`` (PyTorch RPC over TensorPipe) have no adapter yet: when
  installed, their rows say so.

Each peer's pair of processes (``python -m argrpc_bench.peers side ...``) exchanges its
set-up (agent metadata, buffer addresses) through this process: a side prints one JSON
line, reads the other's from stdin, measures, and A prints the result line.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import selectors
import subprocess
import sys
import time
from typing import IO, Any, Callable, Sequence

from argrpc_bench.client import Plan, round_trip_row, timed_phases
from argrpc_bench.results import Measurement

# name -> (module that must import, how to get it)
PEERS: dict[str, tuple[str, str]] = {
    "nixl-none": ("nixl_cu12", "pip install --no-deps nixl-cu12 (its torch is not needed)"),
    "nixl-peer": ("nixl_cu12", "pip install --no-deps nixl-cu12 (its torch is not needed)"),
    "ucxx": ("ucxx", "pip install ucxx-cu12"),
    "torch-rpc": ("torch", "pip install torch"),
}
_MEASURED = ("nixl-none", "nixl-peer")
# How long a side may take to start and exchange its set-up, and how long past its plan
# a measurement may run before it is a failure, not a result.
_SETUP_S = 60.0
_SLACK_S = 120.0


def unavailable(peer: str) -> str:
    """Why a peer has no row here ("" when it can be measured)."""
    module, how = PEERS[peer]
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed ({how})"
    if peer not in _MEASURED:
        return f"{module} is installed, but argrpc-bench has no {peer} adapter yet"
    return ""


# ------------------------------------------------------------------------- NIXL side

def _nixl_side(role: str, size: int, mode: str, plan: Plan, proto: IO[str]) -> dict[str, Any]:
    import numpy as np
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    # No progress thread: the polling thread drives UCX itself. With one, each side has
    # two busy threads, and on a machine with few cores they take turns by the scheduler's
    # time slice (round trips of milliseconds instead of microseconds).
    agent = nixl_agent(role, nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": mode})
    send = np.full(max(size, 1), 0x5A if role == "a" else 0xA5, dtype=np.uint8)
    recv = np.zeros(max(size, 1), dtype=np.uint8)
    agent.register_memory([(send.ctypes.data, send.nbytes, 0, "send"),
                           (recv.ctypes.data, recv.nbytes, 0, "recv")], "DRAM")
    proto.write(json.dumps({"metadata": agent.get_agent_metadata().hex(),
                            "recv": recv.ctypes.data}) + "\n")
    proto.flush()
    peer = json.loads(sys.stdin.readline())
    other = agent.add_remote_agent(bytes.fromhex(peer["metadata"]))
    other_name = other.decode() if isinstance(other, bytes) else str(other)
    write = agent.initialize_xfer(
        "WRITE", agent.get_xfer_descs([(send.ctypes.data, send.nbytes, 0)], "DRAM"),
        agent.get_xfer_descs([(int(peer["recv"]), send.nbytes, 0)], "DRAM"), other, b"rt")

    def post() -> None:
        state = agent.transfer(write)
        while state == "PROC":
            state = agent.check_xfer_state(write)
        if state != "DONE":
            raise RuntimeError(f"NIXL write ended {state}")

    def arrived() -> bool:
        """Polls until the peer's write is here (True) or it said it is done (False)."""
        while True:
            notes = agent.get_new_notifs().get(other_name)
            if notes:
                return b"end" not in notes

    if role == "b":
        while arrived():
            post()
        return {}

    def round_trip() -> None:
        post()
        arrived()

    for _ in range(plan.warmup):
        round_trip()
    if size and recv[0] != 0xA5:
        raise RuntimeError("B's bytes did not arrive")
    row = round_trip_row(size, *timed_phases(round_trip, plan))
    agent.send_notif(other, b"end")
    return row


def side(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m argrpc_bench.peers side")
    p.add_argument("peer", choices=_MEASURED)
    p.add_argument("role", choices=("a", "b"))
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iterations", type=int)
    p.add_argument("--duration", type=float)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args(argv)
    # stdout carries this side's two JSON lines only: whatever the library prints goes
    # to stderr.
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    plan = Plan(args.warmup, args.iterations, args.duration, args.repeats)
    try:
        result = _nixl_side(args.role, args.size, args.peer.split("-", 1)[1], plan, proto)
        out = {"ok": True, **result}
    except Exception as exc:  # noqa: BLE001 - reported to the orchestrator as the row's reason
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    proto.write(json.dumps(out) + "\n")
    proto.flush()
    return 0 if out["ok"] else 1


# ------------------------------------------------------------------ the orchestrator

def _line(proc: subprocess.Popen[str], name: str, deadline: float) -> dict[str, Any]:
    """The next JSON line a side printed, within the deadline."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"{name} said nothing in time")
    text = proc.stdout.readline()
    if not text:
        raise RuntimeError(f"{name} ended without a result")
    doc: dict[str, Any] = json.loads(text)
    return doc


def measure_pair(peer: str, size: int, plan_args: Sequence[str], budget_s: float,
                 env: dict[str, str]) -> dict[str, Any]:
    """One size of one peer: its two sides, set-up exchanged, A's result (or why not)."""
    cmd = [sys.executable, "-m", "argrpc_bench.peers", "side", peer]
    procs: list[subprocess.Popen[str]] = []
    try:
        for role in ("b", "a"):
            procs.append(subprocess.Popen([*cmd, role, "--size", str(size), *plan_args],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True, env=env))
        b, a = procs
        setup = time.monotonic() + _SETUP_S
        hello_b, hello_a = _line(b, f"{peer} B", setup), _line(a, f"{peer} A", setup)
        for proc, hello in ((a, hello_b), (b, hello_a)):
            if "ok" in hello:  # a side that failed before its set-up says why
                return hello
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(hello) + "\n")
            proc.stdin.flush()
        return _line(a, f"{peer} A", time.monotonic() + budget_s)
    except (OSError, ValueError, RuntimeError, TimeoutError) as exc:
        return {"ok": False, "error": str(exc)}
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def run_peers(peers: Sequence[str], sizes: Sequence[int], plan_args: Sequence[str],
              budget_s: float, base: Callable[..., Measurement],
              progress: Callable[[str, float], None] | None = None) -> list[Measurement]:
    """A row per (peer, size): measured, or skipped with the reason."""
    env = dict(os.environ)
    out: list[Measurement] = []
    for i, peer in enumerate(peers):
        reason = unavailable(peer)
        for j, size in enumerate(sizes):
            if progress is not None:
                progress(f"{peer} {size} B", (i * len(sizes) + j) / (len(peers) * len(sizes)))
            if reason:
                out.append(base(peer, size, note=reason, skipped=True))
                continue
            r = measure_pair(peer, size, plan_args, budget_s + _SLACK_S, env)
            if not r.get("ok"):
                out.append(base(peer, size, note=f"not measured: {r.get('error')}",
                                skipped=True))
                continue
            out.append(base(peer, size, iterations=int(r["iterations"]), p50_us=r["p50_us"],
                            p99_us=r["p99_us"], mean_us=r["mean_us"], gbps=r["gbps"],
                            rpcs_per_s=r["rpcs_per_s"]))
    return out


def _ratio(m: Measurement, ref: Measurement | None, metric: str) -> str:
    mine, theirs = getattr(m, metric), getattr(ref, metric) if ref is not None else None
    if m.skipped or not mine or not theirs:
        return "–"
    return f"{mine / theirs:.2f}×"


def table(ms: Sequence[Measurement]) -> str:
    """One row per (transport, size), each peer's p50 and p99 as a multiple of argrpc's
    over shared memory at that size (above 1: argrpc is faster)."""
    shm = {m.size: m for m in ms if m.transport == "shm" and not m.skipped}
    lines = [f"{'transport':<10} {'size':>10} {'p50 µs':>10} {'p99 µs':>10} "
             f"{'p50/shm':>8} {'p99/shm':>8}  note"]
    for m in sorted(ms, key=lambda m: (m.size, m.transport != "shm", m.transport)):
        if m.skipped:
            lines.append(f"{m.transport:<10} {m.size:>10} {'–':>10} {'–':>10} {'–':>8} "
                         f"{'–':>8}  skipped: {m.note}")
            continue
        lines.append(f"{m.transport:<10} {m.size:>10} {m.p50_us:>10.1f} {m.p99_us:>10.1f} "
                     f"{_ratio(m, shm.get(m.size), 'p50_us'):>8} "
                     f"{_ratio(m, shm.get(m.size), 'p99_us'):>8}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["side"]:
        return side(argv[1:])
    from argrpc_bench import runner
    from argrpc_bench.cli import parse_sizes

    p = argparse.ArgumentParser(prog="argrpc-bench peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=parse_sizes, default=[64, 4 << 20, 64 << 20],
                   help="message sizes (default 64,4M,64M)")
    p.add_argument("--peers", default=",".join(PEERS),
                   help=f"comma-separated, of {', '.join(PEERS)} (default: all)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--iterations", type=int, help="timed round trips per repeat")
    how.add_argument("--duration", type=float, default=None,
                     help="seconds per (row, size), split over the repeats (default 2)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--json", help="write the rows here too")
    a = p.parse_args(argv)
    peers = [s for s in a.peers.split(",") if s]
    unknown = [s for s in peers if s not in PEERS]
    if unknown:
        p.error(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(PEERS)}")
    duration = None if a.iterations is not None else (a.duration or 2.0)
    spec = runner.RunSpec(benchmark="latency", transports=["grpc", "shm"], mode="raw",
                          sizes=a.sizes, warmup=a.warmup, iterations=a.iterations,
                          duration=duration, repeats=a.repeats)
    print("argrpc: raw unary calls over grpcio and shared memory", file=sys.stderr, flush=True)
    ms = runner.run(spec)
    plan_args = ["--warmup", str(a.warmup), "--repeats", str(a.repeats),
                 *(["--iterations", str(a.iterations)] if a.iterations is not None
                   else ["--duration", str(duration)])]
    budget = (duration or 0.0) + (a.iterations or 0) * 0.01 * a.repeats

    def base(peer: str, size: int, **kw: Any) -> Measurement:
        return runner._base(spec, peer, size, 1, **kw)

    def progress(what: str, done: float) -> None:
        print(f"peers: {what}", file=sys.stderr, flush=True)

    ms += run_peers(peers, a.sizes, plan_args, budget, base, progress)
    print("round trip: A sends N bytes, B answers N bytes; p50/p99 of A's clock")
    print(table(ms))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([m.__dict__ for m in ms], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
