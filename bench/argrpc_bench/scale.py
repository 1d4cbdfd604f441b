"""What many channels cost: ``argrpc-bench scale``.

    argrpc-bench scale [--channels 1000] [--reps 2] [--json PATH]

One server process per stack; one client process per run makes one warm channel, then N
more to the server, one unary call on each, and reports how long that took, what it
added to the client's RSS and open descriptors and to the server's, how many connections
the server holds then, and the RPC/s of one call on each channel in turn. argrpc's channels share one fast connection (as grpc's share a subchannel); the
`argrpc-local` row gives each its own (`grpc.use_local_subchannel_pool=1`), which is what
every argrpc channel cost before sharing. Runs interleave, so the machine's drift hits all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Optional, Sequence

from argrpc_bench.server import make_server
from argrpc_bench.server_client import run_server_and_client

__all__ = ["main"]

SERVICE = "bench.Scale"
METHOD = f"/{SERVICE}/Echo"
CONFIGS = ("grpc", "argrpc", "argrpc-local")
_CHILD_TIMEOUT_S = 600.0
_LOCAL_POOL = [("grpc.use_local_subchannel_pool", 1)]
_MEASURES = ("seconds", "rss_mib", "fds", "server_rss_mib", "server_fds", "rpc_per_s")


def _serve(stack: str) -> int:
    import grpc

    server = make_server(stack, 8)

    def stats(request: bytes, context: Any) -> bytes:
        return json.dumps({"connections": _server_connections(server), "rss_mib": _rss_mib(),
                           "fds": _fds()}).encode()

    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
        "Who": grpc.unary_unary_rpc_method_handler(
            lambda request, context: str(os.getpid()).encode()),
        "Stats": grpc.unary_unary_rpc_method_handler(stats)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"PORT {port}", flush=True)
    sys.stdin.read()  # until the parent closes it
    server.stop(None)
    return 0


def _server_connections(server: Any) -> int:
    """Fast connections an argrpc server holds (grpc's: its subchannels are not counted)."""
    listener = getattr(server, "_listener", None)
    return len(listener.connections()) if listener is not None else -1


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _client(config: str, target: str, n: int) -> int:
    import grpc

    import argrpc

    factory: Any = grpc.insecure_channel if config == "grpc" else argrpc.insecure_channel
    options = _LOCAL_POOL if config == "argrpc-local" else []
    warm = factory(target, options=options)
    warm.unary_unary(METHOD)(b"x", timeout=60)
    server_stats = warm.unary_unary(f"/{SERVICE}/Stats")
    before = json.loads(server_stats(b"", timeout=60))
    rss, fds, t0 = _rss_mib(), _fds(), time.perf_counter()
    channels = [factory(target, options=options) for _ in range(n)]
    for channel in channels:
        channel.unary_unary(METHOD)(b"x", timeout=60)
    seconds = time.perf_counter() - t0
    calls = [channel.unary_unary(METHOD) for channel in channels]
    t1 = time.perf_counter()
    for call in calls:
        call(b"x", timeout=60)
    rpc_per_s = n / (time.perf_counter() - t1)
    transports = sorted({str(getattr(c, "transport", "grpc")) for c in channels})
    after = json.loads(server_stats(b"", timeout=60))
    result = {"seconds": seconds, "rss_mib": _rss_mib() - rss, "fds": _fds() - fds,
              "transports": transports, "server_connections": after["connections"],
              "server_rss_mib": after["rss_mib"] - before["rss_mib"],
              "server_fds": after["fds"] - before["fds"], "rpc_per_s": rpc_per_s}
    for channel in channels:
        channel.close()
    warm.close()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def _run_once(config: str, n: int) -> dict[str, Any]:
    stack = "grpc" if config == "grpc" else "argrpc"
    return run_server_and_client("argrpc_bench.scale", ["--serve", stack],
                                 ["--client", config, "--channels", str(n)],
                                 _CHILD_TIMEOUT_S, f"scale bench ({config})")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="argrpc-bench scale", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--channels", type=int, default=1000, help="channels per run")
    parser.add_argument("--reps", type=int, default=2, help="runs of each configuration")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--serve", choices=("grpc", "argrpc"), help=argparse.SUPPRESS)
    parser.add_argument("--client", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.serve:
        return _serve(a.serve)
    if a.client:
        return _client(a.client, a.target, a.channels)

    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    for rep in range(a.reps):
        for config in CONFIGS:
            print(f"[{rep + 1}/{a.reps}] {config}: {a.channels} channels", file=sys.stderr,
                  flush=True)
            runs[config].append(_run_once(config, a.channels))
    rows = {c: {"transports": rs[-1]["transports"],
                "server_connections": rs[-1]["server_connections"],
                **{k: statistics.median(r[k] for r in rs) for k in _MEASURES}}
            for c, rs in runs.items()}
    base = rows["grpc"]
    print(f"{a.channels} channels to one server, one call each, then one more on each "
          f"(median of {a.reps}):")
    print(f"{'':14} {'set-up s':>9} {'vs grpc':>8} {'RPC/s':>8} {'vs grpc':>8} "
          f"{'client +MiB':>12} {'+fds':>6} {'server +MiB':>12} {'+fds':>6} {'conns':>6}"
          f"  transports")
    for c, r in rows.items():
        conns = r["server_connections"]
        print(f"{c:14} {r['seconds']:9.2f} {r['seconds'] / base['seconds']:7.1f}x "
              f"{r['rpc_per_s']:8.0f} {r['rpc_per_s'] / base['rpc_per_s']:7.1f}x "
              f"{r['rss_mib']:12.1f} {r['fds']:6.0f} {r['server_rss_mib']:12.1f} "
              f"{r['server_fds']:6.0f} {conns if conns >= 0 else '-':>6}  "
              f"{','.join(r['transports'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"channels": a.channels, "reps": a.reps, "rows": rows, "runs": runs},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
