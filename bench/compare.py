#!/usr/bin/env python3
"""Side-by-side of argrpc (shared-memory fast path) and plain grpcio on this machine.

One run measures both stacks with the same client code and the same generated stubs:

* unary round trip of a 64 B protobuf message (p50 / p99 / mean);
* 64 MiB in one unary request: argrpc sends a numpy array through a buffer serializer
  (no protobuf), grpcio sends the same bytes in a protobuf ``bytes`` field;
* 4 MiB protobuf ``bytes`` echo (request and reply both 4 MiB).

Each stack's server runs in its own process (this script re-executed with ``--serve``),
and the stacks run one after the other so they never share the two cores. argrpc numbers
are only reported when the channel really uses shared memory: a fallback to plain gRPC is
named, with its reason, and not measured.

Usage: python bench/compare.py [--quick] [--iterations N] [--json PATH] [--stack S]
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import grpc

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
# Appended, not prepended: an installed argrpc wins; the checkout is only the fallback
# for running straight from a source tree that was built in place.
if REPO_ROOT not in sys.path:
    sys.path.append(REPO_ROOT)
PROTO_DIR = os.path.join(HERE, "protos")
PROTO_FILE = "bench.proto"
SERVICE = "argrpc.bench.Bench"
RAW_METHOD = f"/{SERVICE}/UploadRaw"

# Unlimited both ways on both ends: the default 4 MiB receive cap would reject the bulk
# cases, and the point is to compare transports, not limits.
BIG_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
]

SMALL_WIRE_SIZE = 64
BIG_SIZE = 64 << 20
ECHO_SIZE = 4 << 20
CALL_TIMEOUT_S = 120.0
SERVER_START_TIMEOUT_S = 60.0

# (metric key, target ratio) from issue 2's "Speed" section.
TARGETS = {
    "unary_64B_p50_us": 20.0,
    "unary_64B_p99_us": 10.0,
    "upload_64MiB_gbps": 30.0,
    "echo_4MiB_gbps": 3.0,
}


# --------------------------------------------------------------------------- stubs

def generate_stubs(out_dir: str) -> None:
    """Runs protoc on bench.proto; stubs are never committed, so they match the installed
    grpcio-tools / protobuf runtime."""
    from grpc_tools import protoc

    rc = protoc.main([
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        PROTO_FILE,
    ])
    if rc != 0:
        raise RuntimeError(f"protoc failed on {os.path.join(PROTO_DIR, PROTO_FILE)} (exit {rc})")


def load_stubs(stubs_dir: str) -> tuple[types.ModuleType, types.ModuleType]:
    if stubs_dir not in sys.path:
        sys.path.insert(0, stubs_dir)
    import bench_pb2  # type: ignore[import-not-found]
    import bench_pb2_grpc  # type: ignore[import-not-found]

    return bench_pb2, bench_pb2_grpc


# -------------------------------------------------------------------------- server

def _make_servicer(pb2: types.ModuleType, pb2_grpc: types.ModuleType) -> Any:
    class Bench(pb2_grpc.BenchServicer):  # type: ignore[misc, name-defined]
        def Ping(self, request: Any, context: grpc.ServicerContext) -> Any:
            return request

        def Upload(self, request: Any, context: grpc.ServicerContext) -> Any:
            data = request.data
            return pb2.Ack(size=len(data), head=data[0] if data else 0,
                           tail=data[-1] if data else 0)

        def Echo(self, request: Any, context: grpc.ServicerContext) -> Any:
            return request

    return Bench()


def _raw_handler(pb2: types.ModuleType) -> grpc.GenericRpcHandler:
    import numpy as np

    def upload_raw(arr: "np.ndarray", context: grpc.ServicerContext) -> Any:
        n = int(arr.nbytes)
        return pb2.Ack(size=n, head=int(arr[0]) if n else 0, tail=int(arr[-1]) if n else 0)

    handler = grpc.unary_unary_rpc_method_handler(
        upload_raw,
        # A view over the received buffer: no copy, no protobuf.
        request_deserializer=lambda buf: np.frombuffer(buf, dtype=np.uint8),
        response_serializer=pb2.Ack.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(SERVICE, {"UploadRaw": handler})


def serve(stack: str, stubs_dir: str, workers: int) -> int:
    """Server process: prints 'PORT n', serves until the parent closes our stdin."""
    from concurrent import futures

    pb2, pb2_grpc = load_stubs(stubs_dir)
    if stack == "argrpc":
        import argrpc  # type: ignore[import-not-found]

        make_server: Callable[..., grpc.Server] = argrpc.server
    else:
        make_server = grpc.server
    server = make_server(futures.ThreadPoolExecutor(max_workers=workers), options=BIG_OPTIONS)
    pb2_grpc.add_BenchServicer_to_server(_make_servicer(pb2, pb2_grpc), server)
    server.add_generic_rpc_handlers((_raw_handler(pb2),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"PORT {port}", flush=True)
    # EOF on stdin = the parent is done (or died): no orphaned servers.
    sys.stdin.read()
    server.stop(0).wait(10)
    return 0


class ServerProcess:
    def __init__(self, stack: str, stubs_dir: str, workers: int) -> None:
        self.stack = stack
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", stack,
             "--stubs", stubs_dir, "--server-workers", str(workers)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self.port = self._read_port()

    def _read_port(self) -> int:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise RuntimeError(f"{self.stack} server did not start within "
                                   f"{SERVER_START_TIMEOUT_S:.0f} s")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if not ready:
                continue
            line = self.proc.stdout.readline()
            if not line:
                rc = self.proc.wait(10)
                raise RuntimeError(f"{self.stack} server exited with code {rc} before "
                                   "listening (its error is printed above)")
            if line.startswith("PORT "):
                return int(line.split()[1])

    def close(self) -> None:
        if self.proc.poll() is not None:
            return
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(15)
        except (subprocess.TimeoutExpired, OSError):
            self.proc.kill()
            self.proc.wait(5)


# ------------------------------------------------------------------- measurements

@dataclass
class Plan:
    iterations: int
    warmup: int
    big_calls: int
    echo_calls: int
    phase_budget_s: float


def _percentile(sorted_ns: list[int], q: float) -> float:
    """Nearest-rank percentile, in µs."""
    idx = min(len(sorted_ns) - 1, max(0, math.ceil(q * len(sorted_ns)) - 1))
    return sorted_ns[idx] / 1e3


def measure_latency(call: Callable[[], None], plan: Plan) -> dict[str, float]:
    for _ in range(plan.warmup):
        call()
    samples: list[int] = []
    gc.collect()
    # The collector would add the same random pauses to both stacks' p99; keep it out.
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(plan.iterations):
            t0 = time.perf_counter_ns()
            call()
            samples.append(time.perf_counter_ns() - t0)
            if time.perf_counter() - start > plan.phase_budget_s:
                break
    finally:
        gc.enable()
    samples.sort()
    return {
        "p50_us": _percentile(samples, 0.50),
        "p99_us": _percentile(samples, 0.99),
        "mean_us": statistics.fmean(samples) / 1e3,
        "n": len(samples),
    }


def measure_bulk(call: Callable[[], None], payload_bytes: int, calls: int,
                 plan: Plan) -> dict[str, float]:
    """GB/s (1e9 bytes/s) of payload, from the median call time: one slow call on a busy
    2-core machine should not decide the figure."""
    call()  # warm-up: first-use costs (pool growth, connection windows)
    gc.collect()
    times: list[int] = []
    start = time.perf_counter()
    while len(times) < calls:
        t0 = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - t0)
        if len(times) >= 2 and time.perf_counter() - start > plan.phase_budget_s:
            break
    med_s = statistics.median(times) / 1e9
    best_s = min(times) / 1e9
    return {
        "gbps": payload_bytes / med_s / 1e9,
        "best_gbps": payload_bytes / best_s / 1e9,
        "median_ms": med_s * 1e3,
        "n": len(times),
    }


@dataclass
class StackResult:
    stack: str
    transport: str
    fallback_reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    detail: dict[str, dict[str, float]] = field(default_factory=dict)
    error: str = ""


class Refused(Exception):
    """argrpc is not on its fast path: its numbers would be grpc's, mislabelled."""


def _transport_of(channel: Any, stack: str) -> tuple[str, str]:
    if stack == "grpc":
        return "grpc", ""
    return (str(getattr(channel, "transport", "unknown")),
            str(getattr(channel, "fallback_reason", "") or ""))


def _check_fast(channel: Any, stack: str) -> None:
    transport, reason = _transport_of(channel, stack)
    if stack == "argrpc" and transport != "shm":
        raise Refused(f"argrpc channel transport is {transport!r}, not 'shm'"
                      + (f"; fallback reason: {reason}" if reason else ""))


def run_stack(stack: str, pb2: types.ModuleType, pb2_grpc: types.ModuleType,
              stubs_dir: str, plan: Plan, workers: int) -> StackResult:
    import numpy as np

    result = StackResult(stack=stack, transport="?")
    if stack == "argrpc":
        try:
            import argrpc  # type: ignore[import-not-found]  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure means "not measurable"
            raise Refused(f"argrpc is not importable: {type(exc).__name__}: {exc}") from exc
    server = ServerProcess(stack, stubs_dir, workers)
    channel: Any = None
    try:
        target = f"127.0.0.1:{server.port}"
        if stack == "argrpc":
            import argrpc  # type: ignore[import-not-found]

            channel = argrpc.insecure_channel(target, options=BIG_OPTIONS)
        else:
            channel = grpc.insecure_channel(target, options=BIG_OPTIONS)
        stub = pb2_grpc.BenchStub(channel)

        small = pb2.Small(payload=b"\x5a" * (SMALL_WIRE_SIZE - 2))
        assert small.ByteSize() == SMALL_WIRE_SIZE
        # The first call settles negotiation; decide before measuring anything.
        reply = stub.Ping(small, timeout=30, wait_for_ready=True)
        if reply.payload != small.payload:
            raise RuntimeError("Ping echoed a different payload")
        result.transport, result.fallback_reason = _transport_of(channel, stack)
        print(f"[{stack}] server pid {server.proc.pid} on {target}; "
              f"channel transport: {result.transport}"
              + (f" (fallback reason: {result.fallback_reason})"
                 if result.fallback_reason else ""), flush=True)
        _check_fast(channel, stack)

        lat = measure_latency(lambda: stub.Ping(small, timeout=10), plan)
        result.detail["unary_64B"] = lat
        print(f"[{stack}] unary 64 B: p50 {lat['p50_us']:.1f} µs, p99 {lat['p99_us']:.1f} µs, "
              f"mean {lat['mean_us']:.1f} µs (n={lat['n']})", flush=True)

        big = np.frombuffer(np.random.default_rng(1).bytes(BIG_SIZE), dtype=np.uint8)
        head, tail = int(big[0]), int(big[-1])

        def expect_ack(ack: Any) -> None:
            if (ack.size, ack.head, ack.tail) != (BIG_SIZE, head, tail):
                raise RuntimeError(f"bad ack {ack.size}/{ack.head}/{ack.tail} "
                                   f"for {BIG_SIZE}/{head}/{tail}")

        big_blob = pb2.Blob(data=big.tobytes())
        # Protobuf bytes field on both stacks: informational, shows protobuf's own cost.
        up_pb = measure_bulk(lambda: expect_ack(stub.Upload(big_blob, timeout=CALL_TIMEOUT_S)),
                             BIG_SIZE, plan.big_calls, plan)
        result.detail["upload_64MiB_protobuf"] = up_pb
        print(f"[{stack}] 64 MiB upload, protobuf bytes: {up_pb['gbps']:.2f} GB/s "
              f"(median {up_pb['median_ms']:.1f} ms, n={up_pb['n']})", flush=True)
        del big_blob

        if stack == "argrpc":
            raw = channel.unary_unary(
                RAW_METHOD,
                request_serializer=lambda a: memoryview(a),
                response_deserializer=pb2.Ack.FromString,
            )
            up_raw = measure_bulk(lambda: expect_ack(raw(big, timeout=CALL_TIMEOUT_S)),
                                  BIG_SIZE, plan.big_calls, plan)
            result.detail["upload_64MiB_numpy"] = up_raw
            print(f"[{stack}] 64 MiB upload, numpy buffer: {up_raw['gbps']:.2f} GB/s "
                  f"(median {up_raw['median_ms']:.1f} ms, n={up_raw['n']})", flush=True)
            upload_main = up_raw
        else:
            upload_main = up_pb
        del big

        echo_blob = pb2.Blob(data=np.random.default_rng(2).bytes(ECHO_SIZE))
        back = stub.Echo(echo_blob, timeout=CALL_TIMEOUT_S)
        if back.data != echo_blob.data:
            raise RuntimeError("4 MiB echo came back different")

        def echo() -> None:
            if len(stub.Echo(echo_blob, timeout=CALL_TIMEOUT_S).data) != ECHO_SIZE:
                raise RuntimeError("4 MiB echo came back with a different size")

        # Payload moved per call: the request and the reply.
        ech = measure_bulk(echo, 2 * ECHO_SIZE, plan.echo_calls, plan)
        result.detail["echo_4MiB"] = ech
        print(f"[{stack}] 4 MiB protobuf echo: {ech['gbps']:.2f} GB/s "
              f"(median {ech['median_ms']:.1f} ms, n={ech['n']})", flush=True)

        # A connection that died mid-run would have made later calls plain gRPC.
        _check_fast(channel, stack)
        result.metrics = {
            "unary_64B_p50_us": lat["p50_us"],
            "unary_64B_p99_us": lat["p99_us"],
            "unary_64B_mean_us": lat["mean_us"],
            "upload_64MiB_gbps": upload_main["gbps"],
            "upload_64MiB_protobuf_gbps": up_pb["gbps"],
            "echo_4MiB_gbps": ech["gbps"],
        }
        return result
    finally:
        if channel is not None:
            channel.close()
        server.close()


# -------------------------------------------------------------------------- report

# key, label, lower is better
ROWS: list[tuple[str, str, bool]] = [
    ("unary_64B_p50_us", "unary 64 B p50 (µs)", True),
    ("unary_64B_p99_us", "unary 64 B p99 (µs)", True),
    ("unary_64B_mean_us", "unary 64 B mean (µs)", True),
    ("upload_64MiB_gbps", "64 MiB upload GB/s (grpc: pb bytes, argrpc: numpy)", False),
    ("upload_64MiB_protobuf_gbps", "64 MiB upload GB/s (pb bytes on both)", False),
    ("echo_4MiB_gbps", "4 MiB pb echo GB/s (req+reply)", False),
]


def ratios(g: dict[str, float], a: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, _, lower_better in ROWS:
        if key in g and key in a and g[key] > 0 and a[key] > 0:
            out[key] = g[key] / a[key] if lower_better else a[key] / g[key]
    return out


def render(g: Optional[StackResult], a: Optional[StackResult],
           ratio: dict[str, float]) -> str:
    gm = g.metrics if g else {}
    am = a.metrics if a else {}

    def num(m: dict[str, float], key: str) -> str:
        return f"{m[key]:.2f}" if key in m else "—"

    header = ("metric", "grpc", "argrpc", "argrpc better by", "target")
    rows = [header]
    for key, label, _ in ROWS:
        target = TARGETS.get(key)
        verdict = ""
        if target is not None:
            verdict = f"≥{target:g}× " + (("PASS" if ratio[key] >= target else "MISS")
                                          if key in ratio else "n/a")
        rows.append((label, num(gm, key), num(am, key),
                     f"×{ratio[key]:.1f}" if key in ratio else "—", verdict))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "grpcio": grpc.__version__,
        "env": {k: v for k, v in os.environ.items() if k.startswith("TF_RDMA_")},
    }
    try:
        import argrpc  # type: ignore[import-not-found]

        info["argrpc"] = getattr(argrpc, "__version__", "unknown")
    except Exception as exc:  # noqa: BLE001 - reported, not fatal for the baseline
        info["argrpc"] = f"not importable: {exc!r}"
    return info


# ---------------------------------------------------------------------------- main

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="fewer iterations (a few seconds in all)")
    p.add_argument("--iterations", type=int, default=None,
                   help="64 B round trips measured per stack (default 2000, quick 300)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--stack", choices=("both", "grpc", "argrpc"), default="both")
    p.add_argument("--server-workers", type=int, default=4,
                   help="server thread-pool size, same for both stacks (default 4)")
    p.add_argument("--serve", choices=("grpc", "argrpc"), help=argparse.SUPPRESS)
    p.add_argument("--stubs", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.iterations is not None and args.iterations < 10:
        p.error("--iterations must be at least 10")
    return args


def make_plan(args: argparse.Namespace) -> Plan:
    if args.quick:
        plan = Plan(iterations=300, warmup=100, big_calls=3, echo_calls=8, phase_budget_s=5.0)
    else:
        plan = Plan(iterations=2000, warmup=300, big_calls=10, echo_calls=30,
                    phase_budget_s=15.0)
    if args.iterations is not None:
        plan.iterations = args.iterations
    return plan


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.serve:
        return serve(args.serve, args.stubs, args.server_workers)

    plan = make_plan(args)
    info = machine_info()
    print(f"python {info['python']}, grpcio {info['grpcio']}, argrpc {info['argrpc']}, "
          f"{info['cpus']} CPUs; TF_RDMA_* = {info['env'] or '{}'}", flush=True)

    stubs_dir = tempfile.mkdtemp(prefix="argrpc-bench-stubs-")
    results: dict[str, Optional[StackResult]] = {"grpc": None, "argrpc": None}
    failures: list[str] = []
    try:
        generate_stubs(stubs_dir)
        pb2, pb2_grpc = load_stubs(stubs_dir)
        # grpc first: argrpc's engine changes process-wide state when it starts (malloc
        # tuning, its pool), which must not flatter the baseline measured in this process.
        stacks = ["grpc", "argrpc"] if args.stack == "both" else [args.stack]
        for stack in stacks:
            try:
                results[stack] = run_stack(stack, pb2, pb2_grpc, stubs_dir, plan,
                                           args.server_workers)
            except Refused as exc:
                msg = f"REFUSED to report argrpc numbers: {exc}"
                print(f"[{stack}] {msg}", flush=True)
                failures.append(msg)
                results[stack] = StackResult(stack=stack, transport="refused", error=str(exc))
            except Exception as exc:  # noqa: BLE001 - one stack failing still reports the other
                msg = f"{stack} failed: {type(exc).__name__}: {exc}"
                print(f"[{stack}] {msg}", flush=True)
                failures.append(msg)
                results[stack] = StackResult(stack=stack, transport="error", error=msg)
    finally:
        shutil.rmtree(stubs_dir, ignore_errors=True)

    g, a = results["grpc"], results["argrpc"]
    ratio = ratios(g.metrics if g else {}, a.metrics if a else {})
    print()
    print(render(g, a, ratio))
    target_verdicts = {k: (ratio[k] >= t) if k in ratio else None for k, t in TARGETS.items()}
    if ratio:
        passed = sum(1 for v in target_verdicts.values() if v)
        print(f"\ntargets met: {passed}/{len(TARGETS)}")
    for f in failures:
        print(f"NOTE: {f}")

    if args.json:
        doc = {
            "machine": info,
            "plan": asdict(plan),
            "results": {k: asdict(v) if v else None for k, v in results.items()},
            "ratios": ratio,
            "targets": {k: {"target": t, "ratio": ratio.get(k), "pass": target_verdicts[k]}
                        for k, t in TARGETS.items()},
            "failures": failures,
        }
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2)
        print(f"results written to {args.json}")
    # Missed targets are a finding, not an error; a stack that could not be measured is.
    return 3 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
