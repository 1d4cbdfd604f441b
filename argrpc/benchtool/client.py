"""Benchmark client process: the point-to-point latency and bandwidth loops.

    python -m argrpc.benchtool.client --target HOST:PORT --stack grpc|argrpc \
        --transport grpc|shm|verbs --benchmark latency|bandwidth --mode raw|serialized \
        --scheme uniform --sizes 64,1048576 --buffers 1 --warmup 10 \
        (--iterations N | --duration S) --repeats 1 --seed 0

* latency: ping-pong — the message goes to ``Echo`` and comes back; one call at a time;
  every call is timed (p50/p99/mean µs); RPCs/s and GB/s (request + reply payload) from
  the timed total.
* bandwidth: the message goes one way to ``Sink``, which acks with a few bytes; calls
  back to back, one at a time; GB/s of request payload = bytes / timed total.

Per size: ``warmup`` untimed calls, then ``repeats`` timed phases of ``iterations`` calls
(or ``duration / repeats`` seconds each, at least one call). The garbage collector is
off during timed phases so its pauses do not land at random in either stack's p99.

The channel's transport is checked after the first call and again at the end: a client
asked for ``shm`` that finds itself on plain gRPC (or one that fell back mid-run) fails
with the fallback reason instead of reporting gRPC's numbers under argrpc's name.

Prints exactly one JSON line on stdout (``{"ok": true, ...}`` or ``{"ok": false,
"error": ...}``); progress goes to stderr as ``PROGRESS <done> <total>`` lines. Exits when
its stdin reaches EOF (the orchestrator is gone), so it can never be orphaned.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import grpc

from argrpc.benchtool import TRANSPORTS
from argrpc.benchtool import messages as msg
from argrpc.benchtool import schemes
from argrpc.benchtool.server import BIG_OPTIONS, parse_raw_ack, tf_rdma_env

CALL_TIMEOUT_S = 120.0
EXIT_TRANSPORT = 3   # not on the transport we were asked to measure
EXIT_ERROR = 2


class TransportMismatch(RuntimeError):
    """The channel is not on the transport the run measures."""


# ----------------------------------------------------------------------- process glue

def exit_on_stdin_eof() -> None:
    """Daemon thread: when the orchestrator closes our stdin (or dies), exit at once.

    ``on_line`` consumers (ps workers) read stdin themselves; this is for processes that
    never read it otherwise."""
    def watch() -> None:
        try:
            while sys.stdin.readline():
                pass
        except (OSError, ValueError):
            pass
        os._exit(EXIT_ERROR)

    threading.Thread(target=watch, name="stdin-eof", daemon=True).start()


def emit(result: dict[str, Any]) -> None:
    """The one JSON result line."""
    sys.stdout.write(json.dumps(result, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def progress(done: int, total: int) -> None:
    sys.stderr.write(f"PROGRESS {done} {total}\n")
    sys.stderr.flush()


def make_channel(stack: str, target: str) -> grpc.Channel:
    """grpc.insecure_channel or argrpc.insecure_channel, unlimited message sizes."""
    if stack == "argrpc":
        import argrpc  # only on this stack: a grpc client never loads argrpc's engine

        return argrpc.insecure_channel(target, options=BIG_OPTIONS)
    if stack == "grpc":
        return grpc.insecure_channel(target, options=BIG_OPTIONS)
    raise ValueError(f"unknown stack {stack!r} (grpc or argrpc)")


def channel_transport(channel: grpc.Channel) -> tuple[str, str]:
    """(transport, fallback reason); a plain grpc channel is always "grpc"."""
    transport = getattr(channel, "transport", None)
    if transport is None:
        return "grpc", ""
    return str(transport), str(getattr(channel, "fallback_reason", "") or "")


def check_transport(channel: grpc.Channel, expected: str) -> str:
    transport, reason = channel_transport(channel)
    if transport != expected:
        raise TransportMismatch(
            f"channel transport is {transport!r}, not {expected!r}"
            + (f"; fallback reason: {reason}" if reason else ""))
    return transport


def fetch_env(channel: grpc.Channel, service: str, method: str) -> dict[str, Any]:
    """The peer's own report ({pid, env, ...}); also the call that settles negotiation."""
    call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
        msg.path(service, method), request_serializer=None, response_deserializer=None)
    report: dict[str, Any] = json.loads(call(b"", timeout=60, wait_for_ready=True))
    return report


def percentile(sorted_ns: Sequence[int], q: float) -> float:
    """Nearest-rank percentile of nanosecond samples, in µs."""
    idx = min(len(sorted_ns) - 1, max(0, math.ceil(q * len(sorted_ns)) - 1))
    return sorted_ns[idx] / 1e3


def stats_us(samples_ns: list[int]) -> dict[str, float]:
    s = sorted(samples_ns)
    return {"p50_us": percentile(s, 0.50), "p99_us": percentile(s, 0.99),
            "mean_us": statistics.fmean(s) / 1e3}


# ------------------------------------------------------------------------ measurement

@dataclass
class Plan:
    warmup: int
    iterations: int | None
    duration: float | None
    repeats: int

    def phase_done(self, calls: int, started: float) -> bool:
        if self.iterations is not None:
            return calls >= self.iterations
        assert self.duration is not None
        return calls >= 1 and time.perf_counter() - started >= self.duration / self.repeats


def timed_phases(call: Callable[[], None], plan: Plan) -> tuple[list[int], float, list[int]]:
    """All per-call samples (ns), total timed seconds, calls per repeat."""
    samples: list[int] = []
    total_s = 0.0
    per_repeat: list[int] = []
    for _ in range(plan.repeats):
        gc.collect()
        gc.disable()
        try:
            calls = 0
            started = time.perf_counter()
            while not plan.phase_done(calls, started):
                t0 = time.perf_counter_ns()
                call()
                samples.append(time.perf_counter_ns() - t0)
                calls += 1
            total_s += time.perf_counter() - started
        finally:
            gc.enable()
        per_repeat.append(calls)
    return samples, total_s, per_repeat


@dataclass
class P2PCall:
    """One point-to-point RPC ready to be made, for either API: the multicallable, its
    request, and the check of an answer (raises on a wrong one). The blocking and the
    asyncio clients build it the same way and differ only in how they invoke it."""
    method: Any
    request: Any
    check: Callable[[Any], None]
    check_each: bool  # bandwidth checks every ack; latency only the first echo


def _latency_call(channel: Any, stack: str, mode: str, bufs: list[Any]) -> P2PCall:
    if mode == "serialized":
        req = msg.Payload(buffers=[b.tobytes() for b in bufs])
        echo = channel.unary_unary(msg.path(msg.SERVICE, msg.ECHO),
                                   request_serializer=msg.Payload.SerializeToString,
                                   response_deserializer=msg.Payload.FromString)

        def check(reply: Any) -> None:
            if list(reply.buffers) != list(req.buffers):
                raise RuntimeError("Echo returned a different payload")
        return P2PCall(echo, req, check, check_each=False)
    frame = msg.RawFrame([b.nbytes for b in bufs])
    framed = not frame.single
    pack = msg.bytes_only(frame.pack) if stack == "grpc" else frame.pack
    echo = channel.unary_unary(msg.path(msg.SERVICE, msg.ECHO_FRAMED if framed else msg.ECHO_RAW),
                               request_serializer=pack,
                               response_deserializer=lambda d: msg.unpack(d, framed))

    def check_raw(views: Any) -> None:
        if len(views) != len(bufs) or any(not (v == b).all() for v, b in zip(views, bufs)):
            raise RuntimeError("EchoRaw returned a different payload")
    return P2PCall(echo, bufs, check_raw, check_each=False)


def _bandwidth_call(channel: Any, stack: str, mode: str, bufs: list[Any]) -> P2PCall:
    size, count = sum(b.nbytes for b in bufs), len(bufs)
    if mode == "serialized":
        req = msg.Payload(buffers=[b.tobytes() for b in bufs])
        sink = channel.unary_unary(msg.path(msg.SERVICE, msg.SINK),
                                   request_serializer=msg.Payload.SerializeToString,
                                   response_deserializer=msg.Ack.FromString)

        def check(ack: Any) -> None:
            if ack.size != size or ack.count != count:
                raise RuntimeError(f"Sink acked {ack.size} B in {ack.count} buffers, "
                                   f"sent {size} B in {count}")
        return P2PCall(sink, req, check, check_each=True)
    frame = msg.RawFrame([b.nbytes for b in bufs])
    framed = not frame.single
    pack = msg.bytes_only(frame.pack) if stack == "grpc" else frame.pack
    sink = channel.unary_unary(msg.path(msg.SERVICE, msg.SINK_FRAMED if framed else msg.SINK_RAW),
                               request_serializer=pack, response_deserializer=parse_raw_ack)

    def check_raw(got: tuple[int, int]) -> None:
        if got != (size, count):
            raise RuntimeError(f"SinkRaw acked {got}, sent {(size, count)}")
    return P2PCall(sink, bufs, check_raw, check_each=True)


def p2p_call(channel: Any, benchmark: str, stack: str, mode: str,
             bufs: list[Any]) -> P2PCall:
    make = _latency_call if benchmark == "latency" else _bandwidth_call
    return make(channel, stack, mode, bufs)


def blocking_call(rpc: P2PCall) -> Callable[[], None]:
    """Makes the first call, checked, and returns the timed loop's call."""
    method, request, check = rpc.method, rpc.request, rpc.check
    check(method(request, timeout=CALL_TIMEOUT_S))  # not kept: a raw answer's views may
    # pin a pool block of the server's
    if rpc.check_each:
        return lambda: check(method(request, timeout=CALL_TIMEOUT_S))
    return lambda: method(request, timeout=CALL_TIMEOUT_S)


def measure(channel: grpc.Channel, args: argparse.Namespace) -> list[dict[str, Any]]:
    plan = Plan(args.warmup, args.iterations, args.duration, args.repeats)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    # Bytes moved per call: latency counts the request and the reply.
    per_call = 2 if args.benchmark == "latency" else 1
    out: list[dict[str, Any]] = []
    for i, size in enumerate(sizes):
        bufs = schemes.make_buffers(schemes.buffer_sizes(args.scheme, size, args.buffers,
                                                         args.seed), args.seed)
        call = blocking_call(p2p_call(channel, args.benchmark, args.stack, args.mode, bufs))
        for _ in range(max(0, args.warmup - 1)):
            call()
        samples, total_s, per_repeat = timed_phases(call, plan)
        n = len(samples)
        out.append({"size": size, "buffers": args.buffers, "calls": n,
                    "iterations": min(per_repeat), "seconds": total_s,
                    "rpcs_per_s": n / total_s, "gbps": per_call * size * n / total_s / 1e9,
                    **stats_us(samples)})
        del call, bufs
        progress(i + 1, len(sizes))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"ok": False, "pid": os.getpid(), "env": tf_rdma_env(),
                              "benchmark": args.benchmark, "transport": None}
    channel = make_channel(args.stack, args.target)
    try:
        server = fetch_env(channel, msg.SERVICE, msg.ENV)
        result["server_env"] = server["env"]
        result["server_pid"] = server["pid"]
        result["transport"] = check_transport(channel, args.transport)
        result["results"] = measure(channel, args)
        # A connection that died mid-run would have carried the rest over plain gRPC.
        check_transport(channel, args.transport)
        result["ok"] = True
    finally:
        channel.close()
    return result


def arg_parser(prog: str = "python -m argrpc.benchtool.client") -> argparse.ArgumentParser:
    """The options both point-to-point clients (blocking and asyncio) take."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--target", required=True)
    p.add_argument("--stack", choices=("grpc", "argrpc"), required=True)
    p.add_argument("--transport", choices=TRANSPORTS, required=True,
                   help="the transport the channel must be on")
    p.add_argument("--benchmark", choices=("latency", "bandwidth"), required=True)
    p.add_argument("--mode", choices=("raw", "serialized"), default="raw")
    p.add_argument("--scheme", default="uniform")
    p.add_argument("--sizes", required=True, help="comma-separated payload bytes")
    p.add_argument("--buffers", type=int, default=1)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iterations", type=int)
    p.add_argument("--duration", type=float)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p


def parse_args(argv: list[str] | None,
               parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    p = parser or arg_parser()
    args = p.parse_args(argv)
    if (args.iterations is None) == (args.duration is None):
        p.error("give exactly one of --iterations and --duration")
    return args


def emit_outcome(work: Callable[[], dict[str, Any]]) -> int:
    """Runs a measured process's work and emits its one result line, or the failure as
    one (the orchestrator reads exactly one line); returns the exit code."""
    try:
        emit(work())
        return 0
    except TransportMismatch as exc:
        emit({"ok": False, "error": str(exc), "kind": "transport", "pid": os.getpid()})
        return EXIT_TRANSPORT
    except Exception as exc:  # noqa: BLE001 - reported to the orchestrator, then exit
        traceback.print_exc()
        emit({"ok": False, "error": f"{type(exc).__name__}: {exc}", "kind": "error",
              "pid": os.getpid()})
        return EXIT_ERROR


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_stdin_eof()
    return emit_outcome(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
