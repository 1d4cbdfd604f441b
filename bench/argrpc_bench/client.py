"""Benchmark client process: the point-to-point latency and bandwidth loops.

    python -m argrpc_bench.client --target HOST:PORT --stack grpc|argrpc \
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
off during timed phases so its pauses do not land at random in either stack's p99; with
``--synchronized`` each process collects before it reports READY, so the collections of
many processes do not run inside each other's timed windows.

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
import itertools
import json
import math
import os
import queue
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import grpc

from argrpc_bench import TRANSPORTS
from argrpc_bench import messages as msg
from argrpc_bench import schemes
from argrpc_bench.server import BIG_OPTIONS, parse_raw_ack, tf_rdma_env

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


class StdinControl:
    """Reads the orchestrator's commands (``GO`` lines) on a daemon thread; EOF on stdin
    means the orchestrator is done or dead, and the worker exits at once, mid-step if need
    be, so it is never orphaned."""

    def __init__(self) -> None:
        self._go: "queue.SimpleQueue[None]" = queue.SimpleQueue()
        threading.Thread(target=self._read, name="stdin-control", daemon=True).start()

    def _read(self) -> None:
        try:
            for line in sys.stdin:
                if line.strip() == "GO":
                    self._go.put(None)
        except (OSError, ValueError):
            pass
        os._exit(EXIT_ERROR)

    def wait_go(self) -> None:
        """READY on stdout, then block until GO."""
        sys.stdout.write("READY\n")
        sys.stdout.flush()
        self._go.get()


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


def round_trip_row(size: int, samples: list[int], total_s: float,
                   per_repeat: list[int]) -> dict[str, Any]:
    """One size's result of a ping-pong of ``size`` bytes each way (the floor, a peer)."""
    n = len(samples)
    return {"size": size, "buffers": 1, "calls": n, "iterations": min(per_repeat),
            "seconds": total_s, "rpcs_per_s": n / total_s,
            "gbps": 2 * size * n / total_s / 1e9, **stats_us(samples)}


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


def timed_phases(call: Callable[[], None], plan: Plan, collect: bool = True
                 ) -> tuple[list[int], float, list[int]]:
    """All per-call samples (ns), total timed seconds, calls per repeat."""
    return threaded_phases([call], plan, collect)


def threaded_phases(calls: Sequence[Callable[[], None]], plan: Plan, collect: bool = True
                    ) -> tuple[list[int], float, list[int]]:
    """``timed_phases`` with one thread per call, all on one channel, started together;
    the plan counts calls over all threads. One call runs on this thread, as a ping-pong
    client's would. ``collect``: a full collection before each repeat (the caller made
    one just before otherwise)."""
    samples: list[int] = []
    total_s = 0.0
    per_repeat: list[int] = []
    for _ in range(plan.repeats):
        if collect:
            gc.collect()
        gc.disable()
        try:
            start = threading.Barrier(len(calls) + 1) if len(calls) > 1 else None
            counter = itertools.count()
            started = 0.0
            mine: list[list[int]] = [[] for _ in calls]
            errors: list[BaseException] = []

            def keep_calling(call: Callable[[], None], out: list[int]) -> None:
                try:
                    if start is not None:
                        start.wait()
                    while not plan.phase_done(next(counter), started):
                        t0 = time.perf_counter_ns()
                        call()
                        out.append(time.perf_counter_ns() - t0)
                except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
                    errors.append(exc)

            threads = [threading.Thread(target=keep_calling, args=(c, o), daemon=True)
                       for c, o in zip(calls, mine)] if start is not None else []
            for t in threads:
                t.start()
            started = time.perf_counter()
            if start is None:
                keep_calling(calls[0], mine[0])
            else:
                start.wait()
            for t in threads:
                t.join()
            total_s += time.perf_counter() - started
            if errors:
                raise errors[0]
        finally:
            gc.enable()
        per_repeat.append(sum(len(o) for o in mine))
        samples += [x for o in mine for x in o]
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


def synchronized_phases(call: Callable[[], None], plan: Plan, control: StdinControl
                        ) -> list[dict[str, Any]]:
    """One client among many processes: each repeat starts at the orchestrator's GO and
    reports its calls, its start and end on the system-wide monotonic clock (the
    orchestrator takes the aggregate rate over the window from the first start to the
    last end) and every call's time."""
    phases = []
    for _ in range(plan.repeats):
        # Before READY: after GO, 64 processes collecting at once (10-20 ms of CPU each)
        # would take a share of every other process's timed window.
        gc.collect()
        control.wait_go()
        samples, seconds, per_repeat = timed_phases(
            call, Plan(plan.warmup, plan.iterations, plan.duration, 1), collect=False)
        end_ns = time.monotonic_ns()
        phases.append({"steps": per_repeat[0], "start_ns": end_ns - int(seconds * 1e9),
                       "end_ns": end_ns, "step_ns": samples})
    return phases


def measure(channel: grpc.Channel, args: argparse.Namespace,
            control: StdinControl | None = None) -> list[dict[str, Any]]:
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
        if control is not None:
            out.append({"size": size, "buffers": args.buffers,
                        "phases": synchronized_phases(call, plan, control)})
            del call, bufs
            progress(i + 1, len(sizes))
            continue
        out.append(result_row(size, args.buffers, 1, per_call * size, timed_phases(call, plan)))
        if args.concurrency > 1 and args.benchmark == "latency":
            calls = [call] + [blocking_call(p2p_call(channel, args.benchmark, args.stack,
                                                     args.mode, bufs))
                              for _ in range(args.concurrency - 1)]
            out.append(result_row(size, args.buffers, args.concurrency, per_call * size,
                            threaded_phases(calls, plan)))
            del calls
        del call, bufs
        progress(i + 1, len(sizes))
    return out


def result_row(size: int, buffers: int, concurrency: int, bytes_per_call: int,
         phases: tuple[list[int], float, list[int]]) -> dict[str, Any]:
    """One result row: a phase's samples (ns), timed seconds and calls per repeat."""
    samples, total_s, per_repeat = phases
    n = len(samples)
    return {"size": size, "buffers": buffers, "concurrency": concurrency, "calls": n,
            "iterations": min(per_repeat), "seconds": total_s, "rpcs_per_s": n / total_s,
            "gbps": bytes_per_call * n / total_s / 1e9, **stats_us(samples)}


def run(args: argparse.Namespace, control: StdinControl | None = None) -> dict[str, Any]:
    result: dict[str, Any] = {"ok": False, "pid": os.getpid(), "env": tf_rdma_env(),
                              "benchmark": args.benchmark, "transport": None}
    channel = make_channel(args.stack, args.target)
    try:
        server = fetch_env(channel, msg.SERVICE, msg.ENV)
        result["server_env"] = server["env"]
        result["server_pid"] = server["pid"]
        result["transport"] = check_transport(channel, args.transport)
        result["results"] = measure(channel, args, control)
        # A connection that died mid-run would have carried the rest over plain gRPC.
        check_transport(channel, args.transport)
        result["ok"] = True
    finally:
        channel.close()
    return result


def arg_parser(prog: str = "python -m argrpc_bench.client") -> argparse.ArgumentParser:
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
    p.add_argument("--concurrency", type=_at_least_one, default=1,
                   help="latency: also measure this many calls in flight on the one channel "
                        "(threads, or tasks of one loop under asyncio); 1: ping-pong only")
    p.add_argument("--synchronized", action="store_true",
                   help="one of many client processes: print READY before each timed "
                        "phase and start it at GO on stdin, report the phases' clock "
                        "window (threaded client only)")
    return p


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def parse_args(argv: list[str] | None,
               parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    p = parser or arg_parser()
    args = p.parse_args(argv)
    if (args.iterations is None) == (args.duration is None):
        p.error("give exactly one of --iterations and --duration")
    return args


def error_text(exc: BaseException) -> str:
    """``exc`` for the orchestrator's row note: a failed call as its type, status code and
    details (an RpcError's str() is a repr over several lines that repeats the details)."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if isinstance(exc, grpc.RpcError) and callable(code) and callable(details):
        status = code()
        return f"{type(exc).__name__}: {getattr(status, 'name', status)}: {details()}"
    return f"{type(exc).__name__}: {exc}"


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
        emit({"ok": False, "error": error_text(exc), "kind": "error",
              "pid": os.getpid()})
        return EXIT_ERROR


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.synchronized:
        control = StdinControl()
        return emit_outcome(lambda: run(args, control))
    exit_on_stdin_eof()
    return emit_outcome(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
