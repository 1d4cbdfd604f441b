"""``argrpc-bench`` command line: parses options, plans the runs, hands them to the
runner, then writes the table, JSON, Markdown and plots.

The plan is a list of ``RunSpec``s: one per (benchmark, mode, sweep combination, API),
each comparing all requested transports in the same run; the APIs of one cell run back
to back so that asyncio and threaded numbers come from the same moment. This process
never changes its own environment: sweep values reach only the measured processes,
through ``RunSpec.env``.

Nothing measured is lost to a failure: a transport (or reference) whose processes fail
is a skipped row saying ``not measured: ...`` (``Measurement.failed``), a run that fails
as a whole is left out, and either way everything else is written. The failures are
listed under ``errors:`` on stdout and in the JSON's ``meta.errors``, and make the exit
status 1; rows skipped for a reason that is not a failure (a transport this machine
does not offer, a floor size beyond the shm ring) leave it 0. Bad options exit 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from argrpc._config import KNOBS, ConfigError, load as load_config, parse_size
from argrpc_bench._version import __version__
from argrpc_bench import APIS, BENCHMARKS, LOOPS, MODES, SCHEMES, TRANSPORTS, loops
from argrpc_bench.progress import Progress
from argrpc_bench.report import (AIO_TARGET_CONCURRENCY, CLIENTS_TARGET,
                                     THREADS_TARGET_CONCURRENCY, connect_targets,
                                     evaluate_targets, fmt_size,
                                     markdown_report, terminal_report, write_json,
                                     write_text)
from argrpc_bench.results import Measurement, collect_meta

if TYPE_CHECKING:
    from argrpc_bench.runner import RunSpec

DEFAULT_OUT = "bench-results"
DEFAULT_CONCURRENCY = AIO_TARGET_CONCURRENCY
DEFAULT_THREADS_IN_FLIGHT = THREADS_TARGET_CONCURRENCY
DEFAULT_CLIENTS = CLIENTS_TARGET
CONNECT = "connect"
CONNECT_PROCESSES, CONNECT_PROCESSES_QUICK, CONNECT_BURST = 50, 20, 64
KNOB_NAMES = tuple(k[0] for k in KNOBS)


@dataclass(frozen=True)
class Defaults:
    """Per-benchmark defaults; ``QUICK`` keeps ``all --quick`` around three minutes on
    2 vCPUs while still covering every speed target (64 B latency, raw 64 MiB
    and serialized 4 MiB bandwidth, PS with the skew scheme)."""
    sizes: tuple[int, ...]
    scheme: str
    duration: float   # timed seconds per (size, transport), split over the repeats
    warmup: int
    repeats: int


K, M = 1 << 10, 1 << 20
FULL: dict[str, Defaults] = {
    "latency": Defaults((64, K, 64 * K, M), "uniform", 2.0, 500, 3),
    "bandwidth": Defaults((64 * K, M, 4 * M, 16 * M, 64 * M), "uniform", 3.0, 3, 3),
    "ps": Defaults((), "skew", 6.0, 1, 3),
}
QUICK: dict[str, Defaults] = {
    # warm-up: enough calls that first-touch page faults and lazy setup on either stack
    # are over before timing (50 left the first cell of a run visibly slower)
    "latency": Defaults((64, 4 * K, 64 * K), "uniform", 1.0, 300, 1),
    "bandwidth": Defaults((M, 4 * M, 64 * M), "uniform", 1.5, 3, 1),
    "ps": Defaults((), "skew", 3.0, 1, 1),
}


# --------------------------------------------------------------------------- parsing

def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def parse_sizes(text: str) -> list[int]:
    """'64,1K,64K' -> [64, 1024, 65536]; K/M/G are binary, as everywhere in argrpc."""
    sizes = []
    for part in _csv(text):
        try:
            sizes.append(parse_size(part))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not a size: {part!r} (bytes, or a number with K/M/G)") from None
    if not sizes:
        raise argparse.ArgumentTypeError("no sizes given")
    return sizes


def parse_transports(text: str) -> list[str]:
    ts = _csv(text)
    bad = [t for t in ts if t not in TRANSPORTS]
    if bad or not ts:
        raise argparse.ArgumentTypeError(
            f"unknown transport(s) {', '.join(bad) or '(none)'}; "
            f"choose from {', '.join(TRANSPORTS)}")
    return list(dict.fromkeys(ts))  # keep order, drop repeats


def parse_apis(text: str) -> list[str]:
    """'threaded', 'aio', 'both' or a comma list; returned in APIS order."""
    got = set(APIS) if text.strip() == "both" else set(_csv(text))
    bad = sorted(got - set(APIS))
    if bad or not got:
        raise argparse.ArgumentTypeError(
            f"unknown api(s) {', '.join(bad) or '(none)'}; choose from "
            f"{', '.join(APIS)} or both")
    return [a for a in APIS if a in got]


def parse_sweep(text: str) -> tuple[str, list[str]]:
    """'TF_RDMA_ACC_SIZE=4K,8K,16K' -> ('TF_RDMA_ACC_SIZE', ['4K', '8K', '16K'])."""
    name, sep, values = text.partition("=")
    name = name.strip().upper()
    if not sep:
        raise argparse.ArgumentTypeError(f"expected VAR=v1,v2,... got {text!r}")
    if name not in KNOB_NAMES:
        raise argparse.ArgumentTypeError(
            f"{name!r} is not an argrpc knob; sweepable: {', '.join(KNOB_NAMES)}")
    vals = _csv(values)
    if not vals:
        raise argparse.ArgumentTypeError(f"no values to sweep for {name}")
    return name, list(dict.fromkeys(vals))


def parse_remote(text: str) -> tuple[str | None, str]:
    """'verbs=192.0.2.2:50052' -> ('verbs', '192.0.2.2:50052'); a bare HOST:PORT is
    (None, target): the server of every measured transport without its own."""
    from argrpc_bench.runner import split_target  # no engine import: runner is light

    transport, sep, target = text.partition("=")
    if not sep:
        transport, target = "", text
    transport = transport.strip()
    if sep and transport not in TRANSPORTS:
        raise argparse.ArgumentTypeError(
            f"unknown transport {transport!r} in {text!r}; choose from {', '.join(TRANSPORTS)}")
    try:
        split_target(target)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return (transport or None), target.strip()


def remote_targets(given: Sequence[tuple[str | None, str]],
                   transports: Sequence[str]) -> dict[str, str]:
    """transport -> target from the --remote options: named ones first, a bare target for
    every other measured transport. ValueError for a transport named twice, two bare
    targets, or a measured transport left without a server."""
    named: dict[str, str] = {}
    bare: list[str] = []
    for t, target in given:
        if t is None:
            bare.append(target)
        elif t in named:
            raise ValueError(f"two servers for {t}: {named[t]} and {target}")
        else:
            named[t] = target
    if len(bare) > 1:
        raise ValueError(f"two servers without a transport: {', '.join(bare)}; name them "
                         "(grpc=HOST:PORT, verbs=HOST:PORT)")
    out = {t: named.get(t) or (bare[0] if bare else "") for t in transports}
    missing = [t for t, target in out.items() if not target]
    if missing:
        raise ValueError(f"no server for {', '.join(missing)} (measured: "
                         f"{', '.join(transports)}); add --remote {missing[0]}=HOST:PORT "
                         "or leave it out of --transports")
    unused = sorted(set(named) - set(transports))
    if unused:
        raise ValueError(f"server given for {', '.join(unused)}, which --transports leaves "
                         "out")
    return out


def sweep_envs(sweeps: Sequence[tuple[str, list[str]]]) -> list[dict[str, str]]:
    """Cartesian product of all sweeps; ``[{}]`` (one run, unchanged env) without any."""
    names = [n for n, _ in sweeps]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"--sweep given twice for {', '.join(sorted(dup))}")
    if not sweeps:
        return [{}]
    return [dict(zip(names, combo)) for combo in itertools.product(*(v for _, v in sweeps))]


def validate_env(env: dict[str, str]) -> None:
    """Rejects a sweep value argrpc itself would reject, before any process starts.

    Checked together with the TF_RDMA_* already in this environment, since the measured
    processes inherit those (and cross-knob limits such as ACC_SIZE ≤ RING_SIZE/4 apply).
    """
    inherited = {k: v for k, v in os.environ.items() if k.startswith("TF_RDMA_")}
    load_config(environ={**inherited, **env})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="argrpc-bench",
        description="TF-gRPC-Bench-style microbenchmarks: plain grpcio vs argrpc-shm "
                    "(and argrpc-verbs where a device exists), measured side by side in "
                    "one run. Progress goes to stderr; tables, targets and written file "
                    "paths to stdout.\n\n"
                    "exit status:\n"
                    "  0  every row measured, or skipped for a reason that is no failure (a\n"
                    "     transport this machine does not offer, a floor size beyond the shm "
                    "ring)\n"
                    "  1  a run or a row failed: its rows say 'not measured: ...', the "
                    "failures\n"
                    "     are listed under errors: and in the JSON's meta.errors, and "
                    "everything\n"
                    "     else is still measured and written\n"
                    "  2  bad options",
        epilog="examples:\n"
               "  argrpc-bench all --quick\n"
               "  argrpc-bench latency --sizes 64,1K,64K --mode serialized\n"
               "  argrpc-bench bandwidth --scheme skew --buffers 16 --sizes 16M,64M\n"
               "  argrpc-bench ps --workers 2 --duration 5\n"
               "  argrpc-bench bandwidth --sizes 4M --sweep TF_RDMA_ACC_SIZE=4K,8K,16K\n"
               "  argrpc-bench latency --api both --sizes 64   (grpc.aio vs argrpc.aio, and\n"
               "                                              against the threaded API)\n"
               "  two hosts: on B, argrpc-bench serve --stack grpc --port 50061 and\n"
               "             argrpc-bench serve --stack argrpc --port 50062; on A,\n"
               "  argrpc-bench bandwidth --mode raw --sizes 4M --transports grpc,verbs \\\n"
               "      --remote grpc=B:50061 --remote verbs=B:50062\n"
               "                                   (see argrpc-bench serve --help)\n"
               "  argrpc-bench soak --duration 600   (long mixed workload with checksums;\n"
               "                                      see argrpc-bench soak --help)\n"
               "  argrpc-bench chaos --trials 40     (peers killed at random moments;\n"
               "                                      see argrpc-bench chaos --help)\n"
               "  argrpc-bench metrics               (64 B round trip with the OpenTelemetry\n"
               "                                      plugin off and on, argrpc's and grpc's)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"argrpc-bench {__version__}")
    p.add_argument("benchmark", nargs="?", default="all",
                   choices=[*BENCHMARKS, CONNECT, "all"],
                   help="latency: ping-pong echo; bandwidth: one-way large messages; "
                        "ps: parameter server + N workers; connect: the first call of a "
                        "new channel in fresh processes; all: the four (default)")
    p.add_argument("--transports", type=parse_transports, default=None,
                   help="comma list of grpc,shm,verbs (default: all, or with --remote the "
                        "transports it names; unavailable ones are reported as skipped "
                        "with the reason)")
    p.add_argument("--remote", type=parse_remote, action="append", default=[],
                   metavar="[TRANSPORT=]HOST:PORT",
                   help="measure against a server already running there (argrpc-bench "
                        "serve on the other host) instead of starting one here; latency "
                        "and bandwidth, threaded API. Repeatable: TRANSPORT= names the "
                        "transport it serves (a grpc server for grpc, an argrpc server for "
                        "verbs or shm), a bare HOST:PORT serves every measured transport "
                        "not named. The client gets no TF_RDMA_TRANSPORT: argrpc must "
                        "choose the measured transport by itself, and its rows fail (see the "
                        "exit status) if it did not")
    p.add_argument("--mode", choices=[*MODES, "both"], default="both",
                   help="raw: buffers via buffer serializers, no protobuf; serialized: "
                        "protobuf message with repeated bytes (default: both)")
    p.add_argument("--scheme", choices=SCHEMES, default=None,
                   help="how a message splits into buffers (default: uniform; ps: skew)")
    p.add_argument("--sizes", type=parse_sizes, default=None,
                   help="message sizes, e.g. 64,1K,64K,1M,16M,64M (K/M/G = KiB/MiB/GiB)")
    p.add_argument("--buffers", type=int, default=1,
                   help="buffers (iovecs) per message for latency/bandwidth (default 1)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--iterations", type=int, default=None,
                   help="timed iterations per (size, transport) in each repeat")
    g.add_argument("--duration", type=float, default=None,
                   help="timed seconds per (size, transport), split over the repeats "
                        "(default: per benchmark, see --quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations first")
    p.add_argument("--repeats", type=int, default=None,
                   help="repeats per cell (default 3, --quick 1)")
    p.add_argument("--workers", type=int, default=2, help="ps worker processes (default 2)")
    p.add_argument("--api", type=parse_apis, default=["threaded"],
                   help="threaded (grpc.server / channels, default), aio (grpc.aio vs "
                        "argrpc.aio, one event loop per process; latency and bandwidth), "
                        "or both / threaded,aio: each cell under both APIs in the same run")
    p.add_argument("--loop", choices=LOOPS, default="asyncio",
                   help="--api aio: the event loop of both processes, asyncio's own "
                        "(default) or uvloop (pip install uvloop); argrpc.aio polls the "
                        "engine only on asyncio's own")
    p.add_argument("--concurrency", type=int, default=None,
                   help="latency: besides the ping-pong, this many calls kept in flight on "
                        "one channel (RPC/s): client threads under the threaded API "
                        f"(default {DEFAULT_THREADS_IN_FLIGHT}), tasks of one event loop "
                        f"under asyncio (default {DEFAULT_CONCURRENCY}); 1: ping-pong only")
    p.add_argument("--clients", type=int, default=DEFAULT_CLIENTS,
                   help="latency, threaded API: also this many client processes on one "
                        "server at the smallest size, each calling one at a time, their "
                        "timed phases started together (aggregate RPC/s); 1: none "
                        f"(default {DEFAULT_CLIENTS})")
    p.add_argument("--seed", type=int, default=0, help="payload/scheme seed (default 0)")
    p.add_argument("--sweep", type=parse_sweep, action="append", default=[],
                   metavar="TF_RDMA_*=v1,v2,...",
                   help="rerun per value, the value given only to the measured processes; "
                        "repeatable (cartesian product)")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help=f"output directory for JSON, Markdown and PNGs (default "
                        f"{DEFAULT_OUT}/)")
    p.add_argument("--json", default=None, help="JSON path (default OUT/results.json)")
    p.add_argument("--markdown", default=None, help="Markdown path (default OUT/results.md)")
    p.add_argument("--no-plots", action="store_true", help="do not write PNGs")
    p.add_argument("--quick", action="store_true",
                   help="short run (about three minutes on 2 vCPUs, much of it starting "
                        "processes) that still covers every speed target")
    p.add_argument("--processes", type=int, default=None,
                   help="connect: fresh processes per stack making their first call one "
                        f"at a time (default {CONNECT_PROCESSES}, --quick "
                        f"{CONNECT_PROCESSES_QUICK})")
    p.add_argument("--burst", type=int, default=CONNECT_BURST,
                   help="connect: then this many processes per stack connecting to one "
                        f"server at once (default {CONNECT_BURST}; 0: none)")
    p.add_argument("--no-floor", action="store_true",
                   help="leave out the reference rows measured after the transports under "
                        "the threaded API: the latency floor (argrpc's shm ring ping-ponged "
                        "from Python with nothing on top) and the memory-copy rates "
                        "(memcpy-1t/-2t)")
    return p


def _check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    for name in ("buffers", "iterations", "repeats", "workers", "concurrency", "clients",
                 "processes"):
        v = getattr(a, name)
        if v is not None and v < 1:
            p.error(f"--{name} must be >= 1")
    if a.warmup is not None and a.warmup < 0:
        p.error("--warmup must be >= 0")
    if a.duration is not None and a.duration <= 0:
        p.error("--duration must be > 0")
    if a.burst < 0:
        p.error("--burst must be >= 0")
    if a.benchmark == "ps" and "threaded" not in a.api:
        p.error("--api: the ps benchmark has no asyncio variant; use --api threaded or both")
    if a.loop != "asyncio":
        if "aio" not in a.api:
            p.error(f"--loop {a.loop}: for the asyncio API (--api aio or both)")
        why = loops.unavailable(a.loop)
        if why is not None:
            p.error(f"--loop: {why}")
    try:
        a.envs = sweep_envs(a.sweep)
        for env in a.envs:
            validate_env(env)
    except (ValueError, ConfigError) as e:
        p.error(f"--sweep: {e}")
    _check_remote(p, a)


def _check_remote(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Resolves --transports' default and --remote into ``a.remote`` (transport ->
    target; empty without --remote)."""
    given = a.remote
    a.remote = {}
    if not given:
        a.transports = a.transports or list(TRANSPORTS)
        return
    if a.benchmark not in ("latency", "bandwidth"):
        p.error(f"--remote: latency or bandwidth only, not {a.benchmark} (the ps "
                "benchmark starts its own parameter server and workers)")
    if a.api != ["threaded"]:
        p.error("--remote: the threaded API only (argrpc-bench serve runs the threaded "
                "server)")
    if a.sweep:
        p.error("--remote with --sweep: a sweep value reaches only processes started here, "
                "not the remote server; start one server per value and run once per value")
    if a.transports is None:
        a.transports = [t for t in TRANSPORTS if any(n == t for n, _ in given)]
        if not a.transports:
            p.error("--remote HOST:PORT: say which transport(s) that server is measured "
                    "on with --transports (grpc for a grpc server, verbs or shm for an "
                    "argrpc one)")
    try:
        a.remote = remote_targets(given, a.transports)
    except ValueError as e:
        p.error(f"--remote: {e}")


# --------------------------------------------------------------------------- soak

def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def build_soak_parser() -> argparse.ArgumentParser:
    from argrpc_bench import soak

    p = argparse.ArgumentParser(
        prog="argrpc-bench soak",
        description="Soak: one argrpc echo server process and CALLERS threads of\n"
                    "this process on one shared-memory channel; every arity, sizes 0 B..64 "
                    "MiB,\ncancels, deadlines and handler errors mixed in, every payload "
                    "checked by\nsha256. Progress and the start/end resource lines go to "
                    "stderr, the summary\nto stdout. Exit status 0: no unprovoked error, "
                    "fds, pool use and live heap\nflat, private RSS within the tolerance; "
                    f"{soak.EXIT_FAILED}: not so; {soak.EXIT_SETUP}: could not start;\n"
                    f"{soak.EXIT_TRANSPORT}: the channel was not on shm (nothing reported).",
        epilog="examples:\n"
               "  argrpc-bench soak                       # 10 minutes, 16 callers\n"
               "  argrpc-bench soak --duration 30 --json bench-results/soak.json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=_positive(float), default=600.0,
                   help="seconds of soak after the warm-up (default 600)")
    p.add_argument("--callers", type=_positive(int), default=16,
                   help="concurrent caller threads on the one channel (default 16)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the payload corpus and of every caller's plan (default 0)")
    p.add_argument("--warmup", type=_positive(float), default=5.0,
                   help="minimum warm-up seconds before the start snapshot (default 5; "
                        "the warm-up also lasts until every caller has sent every size "
                        "class over every arity)")
    p.add_argument("--rss-tolerance", type=_positive(float), default=soak.RSS_TOLERANCE_MIB,
                   metavar="MIB",
                   help="allowed growth of each process's private RSS beyond glibc's "
                        "kept free heap between the start and end snapshots (default "
                        f"{soak.RSS_TOLERANCE_MIB:g})")
    p.add_argument("--heap-tolerance", type=_positive(float), default=soak.HEAP_TOLERANCE_MIB,
                   metavar="MIB",
                   help="allowed growth of each process's live heap (glibc bytes in use) "
                        f"between the snapshots (default {soak.HEAP_TOLERANCE_MIB:g})")
    p.add_argument("--json", default=None, help="also write the full result as JSON here")
    return p


def soak_main(argv: Sequence[str]) -> int:
    from argrpc_bench import soak
    from argrpc_bench.runner import BenchError

    a = build_soak_parser().parse_args(list(argv))
    cfg = soak.SoakConfig(duration=a.duration, callers=a.callers, seed=a.seed,
                          warmup=a.warmup, rss_tolerance_mib=a.rss_tolerance,
                          heap_tolerance_mib=a.heap_tolerance)
    try:
        doc = soak.run(cfg)
    except soak.TransportRefused as e:
        print(f"soak refused: the channel is not on shm: {e}", file=sys.stderr)
        return soak.EXIT_TRANSPORT
    except BenchError as e:
        print(f"soak could not start: {e}", file=sys.stderr)
        return soak.EXIT_SETUP
    doc["argv"] = ["soak", *argv]
    sys.stdout.write(soak.report(doc))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"written: {a.json}")
    return 0 if doc["ok"] else soak.EXIT_FAILED


# -------------------------------------------------------------------------- chaos

def _choices(allowed: Sequence[str]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"{','.join(bad) or 'nothing'}: choose from {','.join(allowed)}")
        return items
    return parse


def build_chaos_parser() -> argparse.ArgumentParser:
    from argrpc_bench import chaos

    p = argparse.ArgumentParser(
        prog="argrpc-bench chaos",
        description="A peer process killed (or stopped, or hanging up its socket) at a "
                    "random moment of a\nloop of calls, trial after trial: every call on "
                    "the survivor must end UNAVAILABLE\nwithin the bound and its fds, "
                    "threads, pool blocks and connections come back;\na killed client "
                    "must not disturb the server's other client. Progress to stderr,\nthe "
                    "table to stdout; exit status 0 when every trial passed.",
        epilog="examples:\n"
               "  argrpc-bench chaos --trials 500 --load half --json bench-results/chaos.json\n"
               "  argrpc-bench chaos --faults stop,hangup --trials 16\n"
               "  argrpc-bench chaos --seed 3 --trials 40 --only 17      # replay trial 17",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=_positive(int), default=40,
                   help="trials, cycling through every scenario in the seed's order "
                        "(default 40: each scenario of one fault once)")
    p.add_argument("--seed", type=int, default=0, help="scenario order and fault moments")
    p.add_argument("--load", nargs="?", const="all", default="none",
                   choices=("none", "half", "all"),
                   help="keep both cores busy with two spinning processes: during every "
                        "trial (--load), every other round of scenarios (--load half)")
    p.add_argument("--faults", type=_choices(chaos.FAULTS), default=("kill",),
                   help="kill (SIGKILL), stop (SIGSTOP: the keepalive bound), hangup "
                        "(shuts its argrpc sockets, stays alive); default kill")
    p.add_argument("--victims", type=_choices(chaos.VICTIMS), default=chaos.VICTIMS)
    p.add_argument("--arities", type=_choices(chaos.ARITIES), default=chaos.ARITIES)
    p.add_argument("--sizes", type=_choices(chaos.SIZE_NAMES), default=chaos.SIZE_NAMES,
                   help="0B, eager (1000 B), over_acc (TF_RDMA_ACC_SIZE+1), chunks "
                        "(3 x TF_RDMA_CHUNK_SIZE + 1), 256M")
    p.add_argument("--only", type=int, default=None, help="run only the trial of this index")
    p.add_argument("--transport", choices=("auto", *TRANSPORTS), default="auto",
                   help="TF_RDMA_TRANSPORT for the peers (default auto: shm here; grpc: the "
                        "same trials over plain gRPC, the reference)")
    p.add_argument("--bound", type=_positive(float), default=None,
                   help=f"seconds from the fault to the survivor's calls' end (default "
                        f"{chaos.SHM_BOUND_S:g} on shm, {chaos.VERBS_BOUND_S:.1f} over "
                        f"verbs, {chaos.KEEPALIVE_BOUND_S:g} for stop)")
    p.add_argument("--json", default=None, help="also write every trial as JSON here")
    return p


def chaos_main(argv: Sequence[str]) -> int:
    import tempfile

    from argrpc_bench import chaos

    a = build_chaos_parser().parse_args(list(argv))
    with tempfile.TemporaryDirectory(prefix="argrpc-chaos-") as work:
        cfg = chaos.ChaosConfig(trials=a.trials, seed=a.seed, load=a.load, faults=a.faults,
                                victims=a.victims, arities=a.arities, sizes=a.sizes,
                                only=a.only, transport=a.transport, bound=a.bound,
                                workdir=work)
        doc = chaos.run(cfg, say=lambda line: print(line, file=sys.stderr, flush=True))
    doc["argv"] = ["chaos", *argv]
    sys.stdout.write(chaos.report(doc))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"written: {a.json}")
    return 0 if doc["ok"] else 1


# -------------------------------------------------------------------------- serve

DEFAULT_SERVE_PORT = 50051


def build_serve_parser() -> argparse.ArgumentParser:
    from argrpc_bench.server import DEFAULT_THREADS, add_listen_args

    p = argparse.ArgumentParser(
        prog="argrpc-bench serve",
        description="Only the point-to-point benchmark server (Echo and Sink methods, raw "
                    "and\nserialized), for a client on another host: argrpc-bench latency "
                    "or bandwidth\n--remote [TRANSPORT=]HOST:PORT. One stack per server: "
                    "run a grpc one for the\ngrpc transport and an argrpc one for verbs "
                    "(or shm). The argrpc server picks\nits transport per connection by "
                    "itself. Set the same TF_RDMA_* knobs (e.g.\nTF_RDMA_BUF_SIZE) in both "
                    "hosts' environments. Prints PORT n once listening, serves\nuntil "
                    "SIGINT or SIGTERM. The server is unauthenticated plain TCP: listen "
                    "only\non a network you trust.",
        epilog="examples:\n"
               "  B$ argrpc-bench serve --stack grpc --port 50061 &\n"
               "  B$ argrpc-bench serve --stack argrpc --port 50062 &\n"
               "  A$ argrpc-bench latency --mode raw --sizes 64 --transports grpc,verbs \\\n"
               "         --remote grpc=B:50061 --remote verbs=B:50062",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stack", choices=("grpc", "argrpc"), required=True,
                   help="grpc.server (for --remote grpc=...) or argrpc.server (verbs, shm)")
    p.add_argument("--threads", type=_positive(int), default=DEFAULT_THREADS,
                   help=f"server thread-pool size (default {DEFAULT_THREADS}, as in local "
                        "runs)")
    add_listen_args(p, host="0.0.0.0", port=DEFAULT_SERVE_PORT, until="signal")
    return p


def serve_main(argv: Sequence[str]) -> int:
    from argrpc_bench import server

    a = build_serve_parser().parse_args(list(argv))
    print(f"argrpc-bench serve: {a.stack} server on {server.listen_address(a.host, a.port)}"
          f" (pid {os.getpid()}), TF_RDMA_*: {server.tf_rdma_env() or 'none'}; serving "
          f"until {'SIGINT/SIGTERM' if a.until == 'signal' else 'stdin EOF'}",
          file=sys.stderr, flush=True)
    return server.main(["--stack", a.stack, "--threads", str(a.threads), "--host", a.host,
                        "--port", str(a.port), "--until", a.until])


# --------------------------------------------------------------------------- planning

def plan(a: argparse.Namespace) -> list["RunSpec"]:
    """One RunSpec per (benchmark, mode, sweep env, API), in that nesting order. ps runs
    under the threaded API only (``all --api aio`` leaves it out)."""
    from argrpc_bench.runner import RunSpec

    benches = BENCHMARKS if a.benchmark == "all" else \
        () if a.benchmark == CONNECT else (a.benchmark,)
    modes = MODES if a.mode == "both" else (a.mode,)
    table = QUICK if a.quick else FULL
    specs = []
    for b in benches:
        d = table[b]
        iterations = a.iterations
        duration = None if iterations is not None else (a.duration or d.duration)
        apis = [api for api in a.api
                if api == "threaded" or b != "ps"]
        for mode in modes:
            for env in getattr(a, "envs", [{}]):
                for api in apis:
                    kw: dict[str, Any] = dict(
                        benchmark=b, transports=list(a.transports or TRANSPORTS),
                        mode=mode,
                        scheme=a.scheme or d.scheme, buffers=a.buffers,
                        warmup=d.warmup if a.warmup is None else a.warmup,
                        iterations=iterations, duration=duration,
                        repeats=a.repeats or d.repeats, workers=a.workers, seed=a.seed,
                        env=dict(env))
                    if b != "ps":
                        kw["sizes"] = list(a.sizes or d.sizes)
                    if api != "threaded":
                        kw.update(api=api, concurrency=a.concurrency or DEFAULT_CONCURRENCY,
                                  loop=a.loop)
                    elif b == "latency":
                        kw["concurrency"] = a.concurrency or DEFAULT_THREADS_IN_FLIGHT
                    if getattr(a, "remote", None):
                        kw["remote"] = dict(a.remote)
                    elif api == "threaded" and not getattr(a, "no_floor", False):
                        kw["references"] = True
                    specs.append(RunSpec(**kw))
                    clients = getattr(a, "clients", 1)
                    # 64 processes start on two cores in about 20 s per transport:
                    # --quick measures them in the first mode only
                    if b == "latency" and api == "threaded" and clients > 1 \
                            and not getattr(a, "remote", None) \
                            and not (a.quick and mode != modes[0]):
                        specs.append(RunSpec(**{**kw, "sizes": [min(kw["sizes"])],
                                                "concurrency": 1, "references": False,
                                                "clients": clients}))
    return specs


def _title(spec: "RunSpec") -> str:
    what = spec.benchmark
    if spec.benchmark != "ps":
        what += " " + ",".join(fmt_size(s) for s in spec.sizes)
    env = " ".join(f"{k}={v}" for k, v in sorted(spec.env.items()))
    what = what if spec.api == "threaded" else f"{what} ({spec.api})"
    return f"{what} [{spec.mode}, {spec.scheme}]" + (f" {env}" if env else "")


def _connect_processes(a: argparse.Namespace) -> int:
    return a.processes or (CONNECT_PROCESSES_QUICK if a.quick else CONNECT_PROCESSES)


def _connect_skipped(a: argparse.Namespace, available: dict[str, str]) -> str:
    """"" or why this run cannot measure connection set-up (grpc against argrpc over
    shm, threaded API, on this host)."""
    if a.remote:
        return "--remote (set-up is measured on this host)"
    if "threaded" not in a.api:
        return "the threaded API is not measured"
    if not {"grpc", "shm"} <= set(a.transports):
        return "it compares grpc with shm, and --transports leaves one out"
    if available.get("shm"):
        return f"shm unavailable here ({available['shm']})"
    return ""


def failed_rows(title: str, ms: Sequence[Measurement]) -> list[str]:
    """One error line per transport (and cause) of ``ms`` whose rows failed, for the
    run's ``errors``: a transport's rows share their note when its processes failed."""
    by_cause: dict[tuple[str, str], None] = {}
    for m in ms:
        if m.failed:
            by_cause[(m.transport, m.note)] = None
    return [f"{title}: {transport} {note}" for transport, note in by_cause]


# --------------------------------------------------------------------------- main

def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["soak"]:  # its own options: a subcommand, not a benchmark to plan
        return soak_main(argv[1:])
    if argv[:1] == ["serve"]:
        return serve_main(argv[1:])
    if argv[:1] == ["chaos"]:
        return chaos_main(argv[1:])
    if argv[:1] == ["metrics"]:
        from argrpc_bench.metrics_cost import main as metrics_main
        return metrics_main(argv[1:])
    if argv[:1] == ["scale"]:
        from argrpc_bench.scale import main as scale_main
        return scale_main(argv[1:])
    if argv[:1] == ["replicas"]:
        from argrpc_bench.replicas import main as replicas_main
        return replicas_main(argv[1:])
    if argv[:1] == ["peers"]:
        from argrpc_bench.peers import main as peers_main
        return peers_main(argv[1:])
    parser = build_parser()
    a = parser.parse_args(argv)
    _check_args(parser, a)

    from argrpc_bench import runner  # imported late so --help works without the engine

    specs = plan(a)
    available = runner.available_transports()
    skip_connect = _connect_skipped(a, available)
    with_connect = a.benchmark in (CONNECT, "all") and not skip_connect
    prog = Progress(len(specs) + with_connect)
    for t in a.transports:
        if available.get(t, "unknown transport"):
            prog.message(f"note: {t} unavailable here ({available.get(t)}); reported as "
                         "skipped")
    for t, target in a.remote.items():
        prog.message(f"note: {t} measured against the server at {target} (none started "
                     "here)")
    measurements: list[Measurement] = []
    errors: list[str] = []
    started = time.monotonic()
    started_at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    for spec in specs:
        title = _title(spec)

        def log(text: str, title: str = title) -> None:
            prog.message(f"error: {title}: {text}")

        try:
            got = runner.run(spec, progress=prog.step(title), log=log)
        except KeyboardInterrupt:
            prog.close()
            errors.append(f"{title}: interrupted")
            break
        except Exception as e:  # one failed run must not lose the others' results
            prog.message(f"error: {title}: {type(e).__name__}: {e}")
            errors.append(f"{title}: {type(e).__name__}: {e}")
            continue
        for m in got:
            if not m.env and spec.env:  # the report groups by it; never lose the sweep
                m.env = dict(spec.env)
        measurements.extend(got)
        errors.extend(failed_rows(title, got))
    connect = None
    if a.benchmark in (CONNECT, "all") and skip_connect:
        prog.message(f"note: connection set-up not measured: {skip_connect}")
    elif with_connect:
        from argrpc_bench.connect import measure as measure_connect

        step = prog.step(f"connect: {_connect_processes(a)} fresh processes per stack, "
                         f"then {a.burst} at once")
        step("grpc and shm", 0.0)
        try:
            connect = measure_connect(_connect_processes(a), a.burst)
        except KeyboardInterrupt:
            errors.append("connect: interrupted")
        except Exception as e:  # the other results are kept
            prog.message(f"error: connect: {type(e).__name__}: {e}")
            errors.append(f"connect: {type(e).__name__}: {e}")
        step("done", 1.0)
    prog.close()
    elapsed = time.monotonic() - started

    targets = evaluate_targets(measurements) + connect_targets(connect)
    meta = collect_meta(argv, date=started_at, quick=a.quick, elapsed_s=round(elapsed, 1),
                        transports_available=available,
                        specs=[dataclasses.asdict(s) for s in specs],
                        targets=[t.to_dict() for t in targets], errors=errors,
                        **({"connect": connect} if connect else {}))
    out = a.out
    json_path = a.json or os.path.join(out, "results.json")
    md_path = a.markdown or os.path.join(out, "results.md")
    plots: list[str] = []
    plot_note = ""
    if not a.no_plots:
        from argrpc_bench.plots import PlotsUnavailable, write_plots
        try:
            plots = write_plots(measurements, out)
        except PlotsUnavailable as e:
            plot_note = f"plots skipped: {e}"
    write_json(json_path, measurements, meta)
    write_text(md_path, markdown_report(measurements, meta, plots, md_path))

    sys.stdout.write(terminal_report(measurements, connect))
    print()
    if errors:
        print("errors:")
        for err in errors:
            print(f"  {err}")
    print(f"finished in {elapsed:.0f} s; written:")
    print(f"  JSON      {json_path}")
    print(f"  Markdown  {md_path}")
    for p in plots:
        print(f"  plot      {p}")
    if plot_note:
        print(f"  ({plot_note})")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
