"""``argrpc-bench peers``: the libraries a Python user would pick to move a tensor between
two processes, measured in the same run, and the same table, as argrpc's raw unary call.

One round trip, for every row: process A sends N bytes to process B; B, once it holds
all N, sends N bytes back; A's clock runs from just before its send until it holds B's N
bytes. Both ends keep their buffers (allocated, and registered where the library needs
it, once per size), the warm-up round trips are not timed, and the plan (iterations or
duration, repeats) is argrpc-bench's, as for every other row. argrpc's rows are its
unary calls (``latency``): the raw call over shared memory (``shm``, the row every ratio
is taken against) and over plain grpcio (``grpc``), the serialized (protobuf) call
(``shm ser``) and argrpc.aio's raw call (``shm aio``). The command exits 1 when a row
failed (every other row is still printed and written).

Peers, each optional: one that is not installed, or cannot start here, is a skipped row
that says why.

- ``nixl-none``: NIXL with its UCX backend and UCX's error handling off (a one-sided
  write with a notification); ``nixl-peer``: the same with NIXL's default error mode.
  Both ends poll for the notification, as NIXL's users do, without NIXL's progress
  thread (the polling thread drives UCX).
- ``ucxx-none`` and ``ucxx-peer``: ucxx, a tagged send of A's N bytes answered by a
  tagged send of B's, each end receiving into a preallocated NumPy array; endpoints
  made by a listener on loopback, with UCX's error handling off (``none``: UCX moves the
  bytes over shared memory and cross-memory attach) or on (``peer``: the default of
  ucxx's asyncio API, under which this UCX leaves out its shared-memory transports and
  sends over TCP on loopback). It uses ucxx's core API, not the asyncio one: the thread
  that waits drives the worker, with no progress thread and no event loop between a
  completion and the next send, the fastest of ucxx's ways to wait here and the way
  the NIXL rows run.
- ``torch-rpc``: PyTorch RPC over TensorPipe, as its users move a tensor: A calls
  ``rpc_sync("b", fn, args=(tensor,))`` with A's N bytes as a uint8 tensor, and B's
  ``fn``, which PyTorch runs only once the argument is all there, answers B's N-byte
  tensor. Both processes ``init_rpc`` (world size 2, A hosts the rendezvous on a free
  loopback port), and TensorPipe picks its own transports and channels. B's tensor
  and A's are made once per size; the tensors each end receives are PyTorch's to make,
  per call.

On a shared machine another tenant's load comes and goes within a run, and a row measured
in a quiet minute beats one measured in a loud one. ``--rounds R`` measures every row R
times, one round after another (each round: argrpc's rows, then the peers), and ends with
a table over the rounds: each row's median p50 and p99, the median of its per-round ratio
to the reference row (``--reference``, default ``shm``; one round's rows were measured
minutes apart at most), and in how many rounds it was at or below the reference.

Each peer's pair of processes (``python -m argrpc_bench.peers side ...``) exchanges its
set-up (NIXL's agent metadata and buffer address, ucxx's listening port, PyTorch's
rendezvous port) through this process: a side prints one JSON line, reads the other's
from stdin, measures, and A prints the result line.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import selectors
import socket
import subprocess
import statistics
import sys
import time
from typing import IO, Any, Callable, Sequence

from argrpc_bench.client import Plan, round_trip_row, timed_phases
from argrpc_bench.results import Measurement

_NIXL_HOW = "pip install --no-deps nixl-cu12 (its torch is not needed)"
_UCXX_HOW = "pip install ucxx-cu12 (no GPU needed: it runs on host memory)"
# name -> (module that must import, how to get it)
PEERS: dict[str, tuple[str, str]] = {
    "nixl-none": ("nixl_cu12", _NIXL_HOW),
    "nixl-peer": ("nixl_cu12", _NIXL_HOW),
    "ucxx-none": ("ucxx", _UCXX_HOW),
    "ucxx-peer": ("ucxx", _UCXX_HOW),
    "torch-rpc": ("torch", "pip install torch (its CPU build is enough)"),
}
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


# -------------------------------------------------------------------------- the sides

def _exchange(proto: IO[str], mine: dict[str, Any]) -> dict[str, Any]:
    """Prints this side's set-up line and reads the other side's, relayed by the
    orchestrator (which bounds the wait)."""
    proto.write(json.dumps(mine) + "\n")
    proto.flush()
    theirs: dict[str, Any] = json.loads(sys.stdin.readline())
    return theirs


def _timed(size: int, round_trip: Callable[[], None], plan: Plan,
           from_b: Callable[[], bool]) -> dict[str, Any]:
    """A's warm-up and timed round trips. At least one untimed round trip runs, so that
    ``from_b`` can tell B's bytes (not A's own, nor nothing) arrived before timing."""
    for _ in range(max(plan.warmup, 1)):
        round_trip()
    if not from_b():
        raise RuntimeError("B's bytes did not arrive")
    return round_trip_row(size, *timed_phases(round_trip, plan))


def _budget_s(plan: Plan) -> float:
    """About how long a plan's timed round trips take (its bound adds _SLACK_S)."""
    return (plan.duration or 0.0) + (plan.iterations or 0) * 0.01 * plan.repeats


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
    peer = _exchange(proto, {"metadata": agent.get_agent_metadata().hex(),
                             "recv": recv.ctypes.data})
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

    row = _timed(size, round_trip, plan, lambda: not size or bool(recv[0] == 0xA5))
    agent.send_notif(other, b"end")
    return row


def _ucxx_side(role: str, size: int, error_handling: bool, plan: Plan, proto: IO[str]
               ) -> dict[str, Any]:
    import numpy as np
    import ucxx._lib.libucxx as ucx
    from ucxx._lib.arr import Array

    # Set-up traffic (the listener's socket, UCX's own TCP lanes) stays on loopback.
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    worker = ucx.UCXWorker(ucx.UCXContext(feature_flags=(ucx.Feature.TAG,)))
    send = np.full(size, 0x5A if role == "a" else 0xA5, dtype=np.uint8)
    recv = np.zeros(size, dtype=np.uint8)
    send_buf, recv_buf = Array(send), Array(recv)
    data, reply, end = ucx.UCXXTag(1), ucx.UCXXTag(0), ucx.UCXXTag(2)

    def drive(done: Callable[[], bool], within_s: float = _SLACK_S) -> None:
        """Polls the worker (this thread is its only progress) until ``done``."""
        deadline = time.monotonic() + within_s
        while not done():
            worker.progress()
            if time.monotonic() > deadline:
                raise TimeoutError("UCX did not complete in time")

    def wait(*requests: Any) -> None:
        drive(lambda: all(r.completed for r in requests))
        for r in requests:
            r.check_error()

    if role == "b":
        accepted: list[Any] = []
        listener: Any = None
        listener = ucx.UCXListener.create(
            worker, 0, lambda conn: accepted.append(
                listener.create_endpoint_from_conn_request(conn, error_handling)))
        _exchange(proto, {"port": listener.port})
        drive(lambda: bool(accepted), _SETUP_S)
        ep = accepted[0]
        done = ep.tag_recv(Array(np.zeros(1, dtype=np.uint8)), end)
        while True:
            got = ep.tag_recv(recv_buf, data)
            drive(lambda: bool(got.completed or done.completed))
            if not got.completed:
                return {}
            got.check_error()
            wait(ep.tag_send(send_buf, reply))

    peer = _exchange(proto, {})
    ep = ucx.UCXEndpoint.create(worker, "127.0.0.1", int(peer["port"]), error_handling)

    def round_trip() -> None:
        got = ep.tag_recv(recv_buf, reply)
        wait(ep.tag_send(send_buf, data), got)

    row = _timed(size, round_trip, plan, lambda: not size or bool(recv[0] == 0xA5))
    wait(ep.tag_send(Array(np.zeros(1, dtype=np.uint8)), end))
    return row


# B's answer to every call, kept for the size: the function A calls runs on B, where
# PyTorch RPC finds it by name, so its state is this module's.
_torch_reply: Any = None


def _torch_echo(request: Any) -> Any:
    """What A calls on B: it runs once A's tensor is all here, and answers B's N bytes."""
    return _torch_reply


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _torch_side(role: str, size: int, plan: Plan, proto: IO[str]) -> dict[str, Any]:
    global _torch_reply
    import torch
    from torch.distributed import rpc

    # A hosts the rendezvous (rank 0) on a port it picks and hands B through the set-up.
    mine = {"port": _free_port()} if role == "a" else {}
    theirs = _exchange(proto, mine)
    port = mine["port"] if role == "a" else theirs["port"]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # TensorPipe's TCP listener binds this interface, not the host name's address.
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    # Before init_rpc: A may call as soon as both ends are up.
    _torch_reply = torch.full((size,), 0xA5, dtype=torch.uint8)
    send = torch.full((size,), 0x5A, dtype=torch.uint8)
    # rpc_timeout bounds every call and the agents' exchange through the rendezvous store
    # (reaching the store is bounded by the orchestrator, which ends a side that is late).
    rpc.init_rpc(role, rank=0 if role == "a" else 1, world_size=2,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(rpc_timeout=_SETUP_S))
    try:
        if role == "b":
            return {}
        got = [send]

        def round_trip() -> None:
            got[0] = rpc.rpc_sync("b", _torch_echo, args=(send,))

        return _timed(size, round_trip, plan, lambda: int(got[0].numel()) == size and (
            not size or int(got[0][0]) == 0xA5))
    finally:
        # Graceful: each end waits here for the other, so B serves A's calls until A is
        # done; B's wait is bounded by A's whole plan.
        rpc.shutdown(timeout=_SETUP_S + (_budget_s(plan) + _SLACK_S if role == "b" else 0))


_SIDES: dict[str, Callable[[str, int, Plan, IO[str]], dict[str, Any]]] = {
    "nixl-none": lambda role, size, plan, proto: _nixl_side(role, size, "none", plan, proto),
    "nixl-peer": lambda role, size, plan, proto: _nixl_side(role, size, "peer", plan, proto),
    "ucxx-none": lambda role, size, plan, proto: _ucxx_side(role, size, False, plan, proto),
    "ucxx-peer": lambda role, size, plan, proto: _ucxx_side(role, size, True, plan, proto),
    "torch-rpc": _torch_side,
}
# The peers with an adapter: one in PEERS without it says so when installed.
_MEASURED = tuple(_SIDES)


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
        out = {"ok": True, **_SIDES[args.peer](args.role, args.size, plan, proto)}
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


def label(m: Measurement) -> str:
    """A row's name: the peer's, or argrpc's transport with its mode and API when they
    are not the raw threaded call every ratio is taken against."""
    if m.transport not in ("grpc", "shm", "verbs"):
        return m.transport
    return m.transport + ("" if m.mode == "raw" else " ser") + \
        ("" if m.api == "threaded" else " aio")


def _ratio(m: Measurement, ref: Measurement | None, metric: str) -> str:
    mine, theirs = getattr(m, metric), getattr(ref, metric) if ref is not None else None
    if m.skipped or not mine or not theirs:
        return "–"
    return f"{mine / theirs:.2f}×"


def _order(m: Measurement) -> tuple[int, bool, str]:
    return (m.size, not label(m).startswith("shm"), label(m))


def table(ms: Sequence[Measurement], reference: str = "shm") -> str:
    """One row per (row, size), each row's p50 and p99 as a multiple of the reference
    row's at that size (argrpc's raw unary call over shared memory unless asked
    otherwise; above 1: the reference is faster)."""
    ref = {m.size: m for m in ms if label(m) == reference and not m.skipped}
    head = f"/{reference}"
    w = max(8, len(head) + 3)
    lines = [f"{'row':<10} {'size':>10} {'p50 µs':>10} {'p99 µs':>10} "
             f"{'p50' + head:>{w}} {'p99' + head:>{w}}  note"]
    for m in sorted(ms, key=_order):
        name = label(m)
        if m.skipped:
            lines.append(f"{name:<10} {m.size:>10} {'–':>10} {'–':>10} {'–':>{w}} "
                         f"{'–':>{w}}  skipped: {m.note}")
            continue
        lines.append(f"{name:<10} {m.size:>10} {m.p50_us:>10.1f} {m.p99_us:>10.1f} "
                     f"{_ratio(m, ref.get(m.size), 'p50_us'):>{w}} "
                     f"{_ratio(m, ref.get(m.size), 'p99_us'):>{w}}")
    return "\n".join(lines)


def rounds_table(rounds: Sequence[Sequence[Measurement]], reference: str = "shm") -> str:
    """Each (row, size) over the rounds: the median p50 and p99, the median of its
    per-round ratio to the reference row (a ratio taken within a round, whose rows ran
    close together), and the rounds in which it was at or below the reference. A round
    in which the row or the reference was skipped does not count."""
    cells: dict[tuple[str, int], list[tuple[Measurement, Measurement | None]]] = {}
    first: dict[tuple[str, int], Measurement] = {}
    for ms in rounds:
        ref = {m.size: m for m in ms if label(m) == reference and not m.skipped}
        for m in ms:
            key = (label(m), m.size)
            first.setdefault(key, m)
            if not m.skipped and m.p50_us and m.p99_us:
                cells.setdefault(key, []).append((m, ref.get(m.size)))
    lines = [f"over {len(rounds)} rounds; ratios and counts against {reference}, round by round",
             f"{'row':<10} {'size':>10} {'p50 µs':>10} {'p99 µs':>10} {'p50 ×':>7} "
             f"{'p99 ×':>7} {'p50 ≤':>6} {'p99 ≤':>6}"]
    for key, m0 in sorted(first.items(), key=lambda kv: _order(kv[1])):
        got = cells.get(key, [])
        if not got:
            lines.append(f"{key[0]:<10} {key[1]:>10} {'–':>10} {'–':>10}  skipped: {m0.note}")
            continue
        cols = [f"{key[0]:<10} {key[1]:>10}",
                f"{statistics.median([m.p50_us or 0.0 for m, _ in got]):>10.1f}",
                f"{statistics.median([m.p99_us or 0.0 for m, _ in got]):>10.1f}"]
        paired = [(m, r) for m, r in got if r is not None and r.p50_us and r.p99_us]
        for metric in ("p50_us", "p99_us"):
            ratios = [getattr(m, metric) / getattr(r, metric) for m, r in paired]
            cols.append(f"{statistics.median(ratios):>6.2f}×" if ratios else f"{'–':>7}")
        for metric in ("p50_us", "p99_us"):
            wins = sum(getattr(m, metric) <= getattr(r, metric) for m, r in paired)
            cols.append(f"{f'{wins}/{len(paired)}':>6}" if paired else f"{'–':>6}")
        lines.append(" ".join(cols))
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
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every row this many times, a round at a time, and end "
                        "with each row's medians and per-round ratios over the rounds "
                        "(default 1)")
    p.add_argument("--reference", default="shm",
                   help="the row the ratio columns are taken against, e.g. nixl-none "
                        "(default shm: argrpc's raw unary call over shared memory)")
    p.add_argument("--json", help="write the rows here too")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    peers = [s for s in a.peers.split(",") if s]
    unknown = [s for s in peers if s not in PEERS]
    if unknown:
        p.error(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(PEERS)}")
    rows = ["shm", "grpc", "shm ser", "shm aio", *peers]
    if a.reference not in rows:
        p.error(f"--reference {a.reference!r} is not a row of this run; choose from "
                f"{', '.join(rows)}")
    duration = None if a.iterations is not None else (a.duration or 2.0)
    spec = runner.RunSpec(benchmark="latency", transports=["grpc", "shm"], mode="raw",
                          sizes=a.sizes, warmup=a.warmup, iterations=a.iterations,
                          duration=duration, repeats=a.repeats)
    # argrpc's other unary calls over shared memory: the protobuf message of the
    # serialized mode, and the raw call from argrpc.aio.
    others = [dataclasses.replace(spec, transports=["shm"], mode="serialized"),
              dataclasses.replace(spec, transports=["shm"], api="aio")]
    plan_args = ["--warmup", str(a.warmup), "--repeats", str(a.repeats),
                 *(["--iterations", str(a.iterations)] if a.iterations is not None
                   else ["--duration", str(duration)])]
    budget = _budget_s(Plan(a.warmup, a.iterations, duration, a.repeats))

    def base(peer: str, size: int, **kw: Any) -> Measurement:
        return runner._base(spec, peer, size, 1, **kw)

    def progress(what: str, done: float) -> None:
        print(f"peers: {what}", file=sys.stderr, flush=True)

    rounds: list[list[Measurement]] = []
    for r in range(a.rounds):
        if a.rounds > 1:
            print(f"peers: round {r + 1} of {a.rounds}", file=sys.stderr, flush=True)
        print("argrpc: unary calls over grpcio and shared memory", file=sys.stderr, flush=True)
        ms = [m for s in (spec, *others) for m in runner.run(s)]
        ms += run_peers(peers, a.sizes, plan_args, budget, base, progress)
        rounds.append(ms)
        print("round trip: A sends N bytes, B answers N bytes; p50/p99 of A's clock"
              + (f" (round {r + 1} of {a.rounds})" if a.rounds > 1 else ""), flush=True)
        print(table(ms, a.reference), flush=True)
    if a.rounds > 1:
        print(rounds_table(rounds, a.reference))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{**m.__dict__, **({"round": i + 1} if a.rounds > 1 else {})}
                       for i, ms in enumerate(rounds) for m in ms], f, indent=1)
    failed = sorted({f"{label(m)} {m.size} B" for ms in rounds for m in ms if m.failed})
    if failed:
        # as argrpc-bench: every row is written, and the status says some failed
        print(f"failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
