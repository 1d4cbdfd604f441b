"""The reference rows argrpc-bench measures beside the transports, in the same run.

    python -m argrpc_bench.floor serve
    python -m argrpc_bench.floor client --target floor:PID --sizes 64,4096 \
        (--iterations N | --duration S) --warmup 300 --repeats 1
    python -m argrpc_bench.floor copy --sizes 1048576,67108864 \
        (--iterations N | --duration S) --repeats 1

* ``floor`` (latency): the cheapest round trip this machine allows from Python. Two
  processes hold one shm fabric of argrpc's engine (the same ring, completion queue,
  doorbell and spin-then-block wait, ``TF_RDMA_SPIN_US``) and ping-pong whole messages
  through it, one ``_core`` call to send and one to receive on each side: no
  connection, stream, frame, call object, facade or protobuf. A transport's time over
  the floor's is what argrpc (or gRPC) adds.
* ``memcpy-1t`` / ``memcpy-2t`` (bandwidth): how fast one and two threads copy a
  message between two pre-faulted buffers; a transport that copies a message once
  cannot move it faster.

The server listens on the abstract Unix socket ``argrpc-bench-floor-<pid>`` and prints
``PORT <pid>`` (the runner's start-up line); the two sides exchange the fabric's memfds
over it with SCM_RIGHTS and keep it open as the doorbell and the liveness signal. Every
process prints one JSON result line like the other measured processes
(``argrpc_bench.client``), exits when its stdin closes, and bounds every wait.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import Any, Callable

from argrpc import _config
from argrpc._engine import core_module, get_engine
from argrpc_bench import schemes
from argrpc_bench.client import (Plan, emit_outcome, exit_on_stdin_eof, parse_args,
                                     progress, round_trip_row, timed_phases)
from argrpc_bench.server import tf_rdma_env

FLOOR = "floor"
COPY_THREADS = (1, 2)
REFERENCES: dict[str, tuple[str, ...]] = {
    "latency": (FLOOR,),
    "bandwidth": tuple(f"memcpy-{n}t" for n in COPY_THREADS),
}
HANDSHAKE_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 60.0
# How long the server waits for a client's next message (between sizes a client builds
# its buffers); it also ends when the client's socket hangs up.
IDLE_TIMEOUT_S = 3600.0
_FDS = 2  # ring segment, pool memfd (the socket is the doorbell)


def socket_name(pid: int) -> str:
    return f"\0argrpc-bench-floor-{pid}"


# ------------------------------------------------------------------------ handshake

def _hello(engine: Any, endpoint: Any) -> tuple[bytes, list[int]]:
    doc = {"ring_size": endpoint.ring_size, "pool_size": engine.pool_size,
           "pid": os.getpid(), "env": tf_rdma_env()}
    return json.dumps(doc).encode(), [endpoint.ring_fd, engine.pool_fd]


def _link(sock: socket.socket) -> tuple[Any, dict[str, Any]]:
    """Exchanges both sides' fabric halves over ``sock`` (sent first, then received) and
    returns the floor link (which then owns the socket) and the peer's hello."""
    cfg = _config.load()
    engine = get_engine(cfg)
    endpoint = engine.new_shm_endpoint(_config.conn_config(cfg, -1))
    data, fds = _hello(engine, endpoint)
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    socket.send_fds(sock, [data], fds)
    msg, got, _, _ = socket.recv_fds(sock, 1 << 16, _FDS)
    try:
        if len(got) != _FDS:
            raise RuntimeError(f"floor handshake: the peer sent {len(got)} fds, not {_FDS}")
        peer = json.loads(msg)
        fabric_peer = {"ring_fd": got[0], "pool_fd": got[1],
                       "ring_size": int(peer["ring_size"]), "pool_size": int(peer["pool_size"])}
    except BaseException:
        for fd in got:
            os.close(fd)
        raise
    sock.settimeout(None)
    # _attach_floor owns the fds from here, also when it fails.
    link = engine._attach_floor(endpoint, fabric_peer, sock.detach(), cfg.spin_us)
    return link, peer


# --------------------------------------------------------------------------- server

def serve() -> int:
    exit_on_stdin_eof()
    core = core_module()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_name(os.getpid()))
    listener.listen(4)
    print(f"PORT {os.getpid()}", flush=True)
    while True:
        conn, _ = listener.accept()
        try:
            link, _peer = _link(conn)
        except (OSError, ValueError, RuntimeError) as exc:
            print(f"floor server: handshake failed: {exc}", file=sys.stderr, flush=True)
            continue
        buf = bytearray(link.max_message)
        view = memoryview(buf)
        try:
            while True:
                n = link.recv_into(buf, IDLE_TIMEOUT_S)
                link.send(view[:n], CALL_TIMEOUT_S)
        except core.CoreError:
            pass  # the client is done (or gone): take the next one
        finally:
            view.release()
            del link


# --------------------------------------------------------------------------- client

def _connect(target: str) -> socket.socket:
    kind, _, pid = target.partition(":")
    if kind != FLOOR or not pid.isdigit():
        raise ValueError(f"floor client: target {target!r} is not floor:PID")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    sock.connect(socket_name(int(pid)))
    return sock


def _round_trip(link: Any, size: int, seed: int) -> Callable[[], None]:
    payload = schemes.make_buffers([size], seed)[0].tobytes()
    back = bytearray(size)
    link.send(payload, CALL_TIMEOUT_S)
    n = link.recv_into(back, CALL_TIMEOUT_S)
    if n != size or bytes(back) != payload:
        raise RuntimeError(f"the floor server echoed {n} B that differ from the {size} B sent")

    def call() -> None:
        link.send(payload, CALL_TIMEOUT_S)
        link.recv_into(back, CALL_TIMEOUT_S)
    return call


def measure_floor(args: argparse.Namespace) -> dict[str, Any]:
    link, peer = _link(_connect(args.target))
    plan = Plan(args.warmup, args.iterations, args.duration, args.repeats)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    results = []
    for i, size in enumerate(sizes):
        if size > link.max_message:
            # One ring write each way is what the floor is: a bigger message has no floor
            # row, and the run keeps every other row.
            results.append({"size": size, "skipped": (
                f"the floor moves one ring write, up to {link.max_message} B "
                f"(TF_RDMA_RING_SIZE), not {size} B")})
            progress(i + 1, len(sizes))
            continue
        call = _round_trip(link, size, args.seed)
        for _ in range(max(0, args.warmup - 1)):
            call()
        results.append(round_trip_row(size, *timed_phases(call, plan)))
        progress(i + 1, len(sizes))
    return {"ok": True, "pid": os.getpid(), "env": tf_rdma_env(), "transport": FLOOR,
            "server_env": peer["env"], "server_pid": peer["pid"], "results": results}


def measure_copies(args: argparse.Namespace) -> dict[str, Any]:
    core = core_module()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    seconds = 0.0 if args.duration is None else args.duration
    copies = max(3, args.iterations or 0) * args.repeats
    results = []
    for i, size in enumerate(sizes):
        for threads in COPY_THREADS:
            r = core._copy_rate(size, threads, seconds, copies)
            results.append({"size": size, "threads": threads, "iterations": r["copies"],
                            "gbps": r["gbps"], "mean_us": r["mean_us"],
                            "p99_us": r["p99_us"], "rpcs_per_s": 1e6 / r["mean_us"]})
        progress(i + 1, len(sizes))
    return {"ok": True, "pid": os.getpid(), "env": tf_rdma_env(), "results": results}


# ---------------------------------------------------------------------------- entry

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve()
    p = argparse.ArgumentParser(prog="python -m argrpc_bench.floor client|copy")
    p.add_argument("what", choices=("client", "copy"))
    p.add_argument("--target", default="")
    p.add_argument("--sizes", required=True, help="comma-separated payload bytes")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iterations", type=int)
    p.add_argument("--duration", type=float)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = parse_args(argv, p)
    exit_on_stdin_eof()
    return emit_outcome(lambda: measure_floor(args) if args.what == "client"
                        else measure_copies(args))


if __name__ == "__main__":
    sys.exit(main())
