"""What the OpenTelemetry plugin costs: ``argrpc-bench metrics``.

    argrpc-bench metrics [--seconds 2] [--reps 3] [--size 64] [--json PATH]

A 64 B unary round trip, one client process and one server process per run, with the
plugin off and on in both (argrpc.observability's on argrpc, grpc_observability's on
grpc), runs interleaved and repeated; the medians and their ratios are reported. With the
plugin on, the SDK's MeterProvider records into an in-memory reader (no exporter: the
cost measured is the recording's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Optional, Sequence

from argrpc_bench.client import make_channel
from argrpc_bench.server import make_server
from argrpc_bench.server_client import run_server_and_client

__all__ = ["main"]

SERVICE = "bench.Metrics"
METHOD = f"/{SERVICE}/Echo"
CONFIGS = (("grpc", False), ("grpc", True), ("argrpc", False), ("argrpc", True))
_CHILD_TIMEOUT_S = 120.0


def _plugin(stack: str) -> Any:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    if stack == "argrpc":
        import argrpc.observability as observability
        plugin: Any = observability.OpenTelemetryPlugin(meter_provider=provider)
    else:
        import grpc_observability
        plugin = grpc_observability.OpenTelemetryPlugin(meter_provider=provider)
    plugin.register_global()
    return plugin


def _serve(stack: str, plugin_on: bool) -> int:
    import grpc

    plugin = _plugin(stack) if plugin_on else None
    server = make_server(stack, 4)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"PORT {port}", flush=True)
    sys.stdin.read()  # until the parent closes it
    server.stop(None)
    if plugin is not None:
        plugin.deregister_global()
    return 0


def _client(stack: str, plugin_on: bool, target: str, seconds: float, size: int) -> int:
    plugin = _plugin(stack) if plugin_on else None
    channel = make_channel(stack, target)
    echo: Any = channel.unary_unary(METHOD)
    payload = b"x" * size
    for _ in range(200):  # warm-up (and the negotiation)
        echo(payload, timeout=30)
    times: list[int] = []
    clock = time.perf_counter_ns
    end = clock() + int(seconds * 1e9)
    while True:
        t0 = clock()
        echo(payload, timeout=30)
        t1 = clock()
        times.append(t1 - t0)
        if t1 >= end:
            break
    times.sort()
    result = {"transport": getattr(channel, "transport", "grpc"),
              "p50_us": times[len(times) // 2] / 1e3,
              "p99_us": times[min(len(times) - 1, int(len(times) * 0.99))] / 1e3,
              "rps": len(times) / (sum(times) / 1e9)}
    channel.close()
    if plugin is not None:
        plugin.deregister_global()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def _run_once(stack: str, plugin_on: bool, seconds: float, size: int) -> dict[str, Any]:
    flag = ["--plugin"] if plugin_on else []
    return run_server_and_client(
        "argrpc_bench.metrics_cost", ["--serve", stack] + flag,
        ["--client", stack, "--seconds", str(seconds), "--size", str(size)] + flag,
        _CHILD_TIMEOUT_S, f"metrics bench ({stack})")


def _name(stack: str, plugin_on: bool) -> str:
    return f"{stack} plugin {'on' if plugin_on else 'off'}"


def _report(rows: dict[str, dict[str, float]]) -> str:
    lines = ["| run | transport | p50 µs | p99 µs | RPC/s |", "|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['transport']} | {r['p50_us']:.1f} | {r['p99_us']:.1f} "
                     f"| {r['rps']:.0f} |")
    lines.append("")
    for stack in ("argrpc", "grpc"):
        off, on = rows[_name(stack, False)], rows[_name(stack, True)]
        lines.append(f"{stack}: plugin on / off: p50 {on['p50_us'] / off['p50_us']:.2f}x, "
                     f"p99 {on['p99_us'] / off['p99_us']:.2f}x, RPC/s "
                     f"{on['rps'] / off['rps']:.2f}x")
    a_on, g_on = rows[_name("argrpc", True)], rows[_name("grpc", True)]
    lines.append(f"both plugins on: argrpc p50 {g_on['p50_us'] / a_on['p50_us']:.1f}x faster "
                 "than grpc's")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="argrpc-bench metrics", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="measured time per run")
    parser.add_argument("--reps", type=int, default=3, help="runs of each configuration")
    parser.add_argument("--size", type=int, default=64, help="message bytes")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--serve", choices=("grpc", "argrpc"), help=argparse.SUPPRESS)
    parser.add_argument("--client", choices=("grpc", "argrpc"), help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--plugin", action="store_true", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.serve:
        return _serve(a.serve, a.plugin)
    if a.client:
        return _client(a.client, a.plugin, a.target, a.seconds, a.size)

    runs: dict[str, list[dict[str, Any]]] = {_name(s, p): [] for s, p in CONFIGS}
    for rep in range(a.reps):
        for stack, plugin_on in CONFIGS:  # interleaved: the machine's drift hits all alike
            print(f"[{rep + 1}/{a.reps}] {_name(stack, plugin_on)}", file=sys.stderr,
                  flush=True)
            runs[_name(stack, plugin_on)].append(_run_once(stack, plugin_on, a.seconds,
                                                          a.size))
    rows = {name: {"transport": rs[-1]["transport"],
                   **{k: statistics.median(r[k] for r in rs) for k in ("p50_us", "p99_us",
                                                                         "rps")}}
            for name, rs in runs.items()}
    text = _report(rows)
    sys.stdout.write(text)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"size": a.size, "seconds": a.seconds, "reps": a.reps, "rows": rows,
                       "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
