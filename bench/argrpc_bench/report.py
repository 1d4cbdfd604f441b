"""Turns Measurements into the terminal table, the Markdown report and the target checks.

Every ratio is against plain grpcio measured in the same run, with the same API, mode,
scheme, size, buffer count, calls in flight, worker count and sweep environment, so a
noisy machine moves both sides of a ratio together: under the asyncio API the baseline
"grpc" is grpc.aio's client and server. Ratios are all "speedup" (higher is better):
grpc/transport for latency, transport/grpc for GB/s, RPC/s and steps/s. The one
exception is the asyncio-vs-threaded table, which divides the same transport's numbers
under the two APIs.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any, Iterable, Sequence

from argrpc_bench import APIS, BENCHMARKS, MODES, SCHEMES, TRANSPORTS
from argrpc_bench.results import Measurement, to_json

BASELINE = "grpc"
TARGET_TRANSPORT = "shm"  # the speed targets compare argrpc-shm with plain grpcio
FLOOR = "floor"           # the latency floor's row (argrpc_bench.floor)
MEMCPY_PREFIX = "memcpy-"  # the memory-copy rate rows: memcpy-1t, memcpy-2t

MiB = 1 << 20

# Column set per benchmark: (header, Measurement attribute or special key, kind).
# Kinds: us (latency), gbps, rate, ratio:<metric> (speedup of that metric vs grpc).
_COLUMNS: dict[str, list[tuple[str, str, str]]] = {
    "latency": [("p50 µs", "p50_us", "us"), ("p99 µs", "p99_us", "us"),
                ("mean µs", "mean_us", "us"), ("RPC/s", "rpcs_per_s", "rate"),
                ("p50 vs grpc", "p50_us", "ratio"), ("p99 vs grpc", "p99_us", "ratio")],
    "bandwidth": [("GB/s", "gbps", "gbps"), ("RPC/s", "rpcs_per_s", "rate"),
                  ("mean µs", "mean_us", "us"), ("p99 µs", "p99_us", "us"),
                  ("GB/s vs grpc", "gbps", "ratio")],
    "ps": [("steps/s", "steps_per_s", "rate"), ("GB/s", "gbps", "gbps"),
           ("RPC/s", "rpcs_per_s", "rate"), ("steps/s vs grpc", "steps_per_s", "ratio")],
}
# Under the asyncio API a latency row may have many calls in flight, whose figure of merit
# is RPC/s rather than the per-call latency.
_AIO_COLUMNS: dict[str, list[tuple[str, str, str]]] = {
    **_COLUMNS,
    "latency": [*_COLUMNS["latency"], ("RPC/s vs grpc", "rpcs_per_s", "ratio")],
}

# Shown when the run measured the reference rows: each row's cost in floors.
_FLOOR_COLUMNS: dict[str, list[tuple[str, str, str]]] = {
    "latency": [("p50 / floor", "p50_us", "floor"), ("p99 / floor", "p99_us", "floor")],
    "bandwidth": [("memcpy / GB/s", "gbps", "floor")],
}

# The one number a sweep table shows per cell.
PRIMARY: dict[str, str] = {"latency": "p50_us", "bandwidth": "gbps", "ps": "steps_per_s"}
LOWER_IS_BETTER = {"p50_us", "p99_us", "mean_us"}

_DESCRIPTION = {
    "latency": "ping-pong echo of one message; speedup = grpc latency / transport latency",
    "bandwidth": "one-way throughput (client sends, server acks 1 B); "
                 "speedup = transport GB/s / grpc GB/s",
    "ps": "parameter server: each worker pulls every variable and pushes a gradient of each "
          "per step; size = bytes per step per worker (pull + push); "
          "speedup = transport steps/s / grpc steps/s",
}
_FLOOR_DESCRIPTION = {
    "latency": "; floor = argrpc's shm ring and wait ping-ponged from Python with nothing on "
               "top (no connection, call, facade or protobuf), x / floor = the row's latency "
               "over the floor's",
    "bandwidth": "; memcpy-1t/-2t = one and two threads copying the message between "
                 "pre-faulted buffers, memcpy / GB/s = the faster copy rate over the row's",
}
_AIO_DESCRIPTION = ("grpc = grpc.aio's client and server, shm/verbs = argrpc.aio's, one event "
                    "loop per process; in flight = calls kept going by as many tasks on one "
                    "channel; speedups vs grpc.aio")


# --------------------------------------------------------------------------- formatting

def fmt_size(n: int) -> str:
    """64 -> '64 B', 4096 -> '4 KiB', 67108864 -> '64 MiB'; non-round sizes keep 3 digits."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.3g} {unit}"
    return f"{n} B"


def fmt_num(v: float | None) -> str:
    """Three significant digits, thousands separators for large values, '–' for none."""
    if v is None:
        return "–"
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 0.01:
        return f"{v:.2f}"
    return f"{v:.3g}"


def fmt_ratio(r: float | None) -> str:
    if r is None:
        return "–"
    return f"{r:.1f}×" if r >= 10 else f"{r:.2f}×"


def env_label(env: dict[str, str]) -> str:
    """'ACC_SIZE=4K, SPIN_US=0' (TF_RDMA_ dropped for width); '(default)' when empty."""
    if not env:
        return "(default)"
    return ", ".join(f"{k.removeprefix('TF_RDMA_')}={v}" for k, v in sorted(env.items()))


# --------------------------------------------------------------------------- grouping

def _env_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(env.items()))


def cell_key(m: Measurement, with_env: bool = True) -> tuple[Any, ...]:
    """Everything but the transport: measurements with equal keys are comparable."""
    key: tuple[Any, ...] = (m.benchmark, m.api, m.loop, m.concurrency, m.clients, m.mode,
                            m.scheme, m.size, m.buffers, m.workers)
    return key + (_env_key(m.env),) if with_env else key


def baseline_of(m: Measurement, ms: Sequence[Measurement]) -> Measurement | None:
    key = cell_key(m)
    for b in ms:
        if b.transport == BASELINE and not b.skipped and cell_key(b) == key:
            return b
    return None


def is_reference(m: Measurement) -> bool:
    """The floor and memcpy rows: what the machine allows, not a transport."""
    return m.transport == FLOOR or m.transport.startswith(MEMCPY_PREFIX)


def floor_of(m: Measurement, ms: Sequence[Measurement]) -> Measurement | None:
    """The reference row of ``m``'s cell: the floor (latency), or the faster memory-copy
    rate (bandwidth)."""
    key = cell_key(m)
    refs = [r for r in ms if is_reference(r) and not r.skipped and cell_key(r) == key]
    if not refs:
        return None
    return max(refs, key=lambda r: r.gbps or 0.0)


def over_floor(m: Measurement, ref: Measurement | None, metric: str) -> float | None:
    """How many times the floor's cost ``m`` pays (>= 1 unless noise): the transport's
    latency over the floor's, or the copy rate over the transport's GB/s."""
    r = speedup(m, ref, metric)
    return None if r is None else 1 / r


def speedup(m: Measurement, base: Measurement | None, metric: str) -> float | None:
    """>1 means the transport is better than grpc on ``metric``."""
    if base is None or m.skipped:
        return None
    a: float | None = getattr(m, metric)
    b: float | None = getattr(base, metric)
    if a is None or b is None or a <= 0 or b <= 0:
        return None
    return b / a if metric in LOWER_IS_BETTER else a / b


def _order(ms: Iterable[Measurement]) -> list[Measurement]:
    def rank(seq: Sequence[str], v: str) -> int:
        return seq.index(v) if v in seq else len(seq)

    ms = list(ms)
    # sweep values keep the order they ran in (the user's order: 4K before 16K)
    env_rank: dict[tuple[tuple[str, str], ...], int] = {}
    for m in ms:
        env_rank.setdefault(_env_key(m.env), len(env_rank))
    return sorted(ms, key=lambda m: (
        rank(BENCHMARKS, m.benchmark), rank(APIS, m.api), rank(MODES, m.mode),
        rank(SCHEMES, m.scheme), m.concurrency, m.clients, m.size, m.buffers, m.workers or 0,
        env_rank[_env_key(m.env)], rank(TRANSPORTS, m.transport)))


# --------------------------------------------------------------------------- tables

@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]
    numeric: list[bool]  # right-align these columns
    # A row shorter than the headers ends in a cell spanning the remaining columns (a
    # skipped transport's reason): it does not widen the columns it runs across.

    def text(self) -> str:
        n = len(self.headers)
        widths = [len(h) for h in self.headers]
        for r in self.rows:
            cells = r if len(r) == n else r[:-1]
            widths = [max(w, len(c)) for w, c in zip(widths, cells)] + widths[len(cells):]

        def line(cells: Sequence[str]) -> str:
            if len(cells) < n:
                head = "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in
                                 zip(cells[:-1], widths, self.numeric))
                return (head + "  " + cells[-1]).rstrip()
            return "  ".join(c.rjust(w) if num else c.ljust(w)
                             for c, w, num in zip(cells, widths, self.numeric)).rstrip()

        sep = "  ".join("-" * w for w in widths)
        return "\n".join([line(self.headers), sep, *(line(r) for r in self.rows)])

    def markdown(self) -> str:
        def esc(c: str) -> str:
            return c.replace("|", "\\|")

        head = "| " + " | ".join(esc(h) for h in self.headers) + " |"
        align = "|" + "|".join("---:" if n else ":---" for n in self.numeric) + "|"
        n = len(self.headers)
        body = ["| " + " | ".join(esc(c) for c in [*r, *[""] * (n - len(r))]) + " |"
                for r in self.rows]
        return "\n".join([head, align, *body])


def _has_sweep(ms: Sequence[Measurement]) -> bool:
    return len({_env_key(m.env) for m in ms}) > 1 or any(m.env for m in ms)


def ran(ms: Sequence[Measurement], benchmark: str, api: str) -> bool:
    return any(m.benchmark == benchmark and m.api == api for m in ms)


def benchmark_table(ms: Sequence[Measurement], benchmark: str, api: str = "threaded") -> Table:
    """One row per (cell, transport) for one benchmark under one API, with its speedups
    vs grpc under the same API."""
    rows_ms = _order(m for m in ms if m.benchmark == benchmark and m.api == api)
    sweep = _has_sweep(rows_ms)
    in_flight = benchmark == "latency" and (api != "threaded"
                                            or any(m.concurrency > 1 or m.clients > 1
                                                   for m in rows_ms))
    size_head = "bytes/step/worker" if benchmark == "ps" else "size"
    bufs_head = "vars" if benchmark == "ps" else "bufs"
    lead = ["mode", "scheme", size_head, bufs_head]
    if benchmark == "ps":
        lead.append("workers")
    many = any(m.clients > 1 for m in rows_ms)
    if in_flight:
        lead.append("in flight")
    if many:
        lead.append("clients")
    if sweep:
        lead.append("env")
    lead.append("transport")
    cols = (_AIO_COLUMNS if in_flight else _COLUMNS)[benchmark]
    if any(is_reference(m) and not m.skipped for m in rows_ms):
        cols = cols + _FLOOR_COLUMNS.get(benchmark, [])
    headers = lead + [c[0] for c in cols]
    numeric = [False, False, True, True] + ([True] if benchmark == "ps" else []) \
        + ([True] if in_flight else []) + ([True] if many else []) \
        + ([False] if sweep else []) + [False] \
        + [True] * len(cols)
    rows: list[list[str]] = []
    for m in rows_ms:
        r = [m.mode, m.scheme, fmt_size(m.size), str(m.buffers)]
        if benchmark == "ps":
            r.append(str(m.workers if m.workers is not None else "–"))
        if in_flight:
            r.append(str(m.concurrency))
        if many:
            r.append(str(m.clients))
        if sweep:
            r.append(env_label(m.env))
        r.append(m.transport)
        if m.skipped:
            # the reason goes in the first value column; the rest stay empty
            r.append(f"skipped: {m.note}" if m.note else "skipped")
        else:
            base = baseline_of(m, rows_ms)
            ref = floor_of(m, rows_ms)
            for _, attr, kind in cols:
                if kind == "ratio":
                    r.append("base" if m.transport == BASELINE
                             else fmt_ratio(speedup(m, base, attr)))
                elif kind == "floor":
                    r.append("–" if is_reference(m) else fmt_ratio(over_floor(m, ref, attr)))
                else:
                    r.append(fmt_num(getattr(m, attr)))
        rows.append(r)
    return Table(headers, rows, numeric)


def sweep_table(ms: Sequence[Measurement], benchmark: str,
                api: str = "threaded") -> Table | None:
    """The primary metric per sweep value side by side (None when nothing was swept)."""
    rows_ms = [m for m in _order(ms) if m.benchmark == benchmark and m.api == api]
    envs: list[tuple[tuple[str, str], ...]] = []
    for m in rows_ms:
        if _env_key(m.env) not in envs:
            envs.append(_env_key(m.env))
    if len(envs) < 2:
        return None
    metric = PRIMARY[benchmark]
    cells: dict[tuple[Any, ...], dict[tuple[tuple[str, str], ...], Measurement]] = {}
    for m in rows_ms:
        cells.setdefault(cell_key(m, with_env=False) + (m.transport,), {})[_env_key(m.env)] = m
    headers = ["mode", "scheme", "size", "bufs", "transport"] + \
        [env_label(dict(e)) for e in envs] + ["best"]
    rows = []
    for key, by_env in cells.items():
        _, _, _, concurrency, clients, mode, scheme, size, bufs, _, transport = key
        if concurrency > 1:
            transport = f"{transport}, {concurrency} in flight"
        if clients > 1:
            transport = f"{transport}, {clients} clients"
        vals: list[str] = []
        best: tuple[float, str] | None = None
        for e in envs:
            cell = by_env.get(e)
            v = None if cell is None or cell.skipped else getattr(cell, metric)
            vals.append(fmt_num(v) if cell is None or not cell.skipped else "skipped")
            if v is not None:
                score = -v if metric in LOWER_IS_BETTER else v
                if best is None or score > best[0]:
                    best = (score, env_label(dict(e)))
        rows.append([mode, scheme, fmt_size(size), str(bufs), transport, *vals,
                     best[1] if best else "–"])
    unit = {"p50_us": "p50 µs (lower is better)", "gbps": "GB/s",
            "steps_per_s": "steps/s"}[metric]
    headers[4] = f"transport [{unit}]"
    return Table(headers, rows, [False, False, True, True, False]
                 + [True] * len(envs) + [False])


# --------------------------------------------------------------------------- asyncio

_UNITS = {"p50_us": "p50 µs", "p99_us": "p99 µs", "gbps": "GB/s", "rpcs_per_s": "RPC/s",
          "steps_per_s": "steps/s"}


def api_table(ms: Sequence[Measurement], benchmark: str) -> Table | None:
    """Each transport under both APIs, one call in flight: the primary metric under each
    and aio / threaded (a plain quotient: above 1 means a higher latency or more GB/s
    under asyncio). None unless both APIs measured a common cell."""
    metric = PRIMARY[benchmark]
    threaded = {cell_key(m) + (m.transport,): m for m in ms
                if m.benchmark == benchmark and m.api == "threaded" and not m.skipped}
    aio_ms = [m for m in _order(ms) if m.benchmark == benchmark and m.api == "aio"
              and m.concurrency == 1 and not m.skipped]
    pairs = [(m, threaded.get(cell_key(replace(m, api="threaded", loop="asyncio"))
                              + (m.transport,)))
             for m in aio_ms]
    pairs = [(a, t) for a, t in pairs if t is not None]
    if not pairs:
        return None
    sweep = _has_sweep([a for a, _ in pairs])
    unit = _UNITS[metric]
    headers = ["mode", "scheme", "size", "bufs", *(["env"] if sweep else []), "transport",
               f"threaded {unit}", f"aio {unit}", "aio / threaded"]
    rows = []
    for a, t in pairs:
        va, vt = getattr(a, metric), getattr(t, metric)
        ratio = va / vt if va and vt else None
        rows.append([a.mode, a.scheme, fmt_size(a.size), str(a.buffers),
                     *([env_label(a.env)] if sweep else []), a.transport, fmt_num(vt),
                     fmt_num(va), fmt_ratio(ratio)])
    numeric = [False, False, True, True, *([False] if sweep else []), False, True, True, True]
    return Table(headers, rows, numeric)


# --------------------------------------------------------------------------- targets

AIO_TARGET_CONCURRENCY = 64  # the asyncio throughput target's calls in flight
THREADS_TARGET_CONCURRENCY = 16  # the threaded one's: client threads on one channel
CLIENTS_TARGET = 64  # client processes on one server


@dataclass(frozen=True)
class Target:
    """A speed target: TARGET_TRANSPORT at least ``min_ratio``× better than ``versus``:
    grpc under the same API, or (``versus="threaded"``) itself under the threaded API."""
    benchmark: str
    metric: str
    min_ratio: float
    mode: str | None = None      # None: checked in every mode that was measured
    scheme: str | None = None    # None: any scheme
    size: int | None = None      # None: any size (ps)
    text: str = ""
    flags: str = ""              # how to cover it when it was not measured
    api: str = "threaded"
    concurrency: int = 1         # calls in flight of the cell checked
    clients: int = 1             # client processes of the cell checked
    versus: str = BASELINE       # "grpc" or "threaded"
    # Non-empty: shown as information (INFO, with this reason), never PASS or MISS: a
    # ratio shown to be bound by something other than the transport, kept in view.
    info: str = ""


TARGETS: tuple[Target, ...] = (
    Target("latency", "p50_us", 20.0, size=64, text="latency p50 at 64 B ≥ 20× lower",
           flags="argrpc-bench latency --sizes 64"),
    Target("latency", "p99_us", 10.0, size=64, text="latency p99 at 64 B ≥ 10× lower",
           flags="argrpc-bench latency --sizes 64"),
    Target("latency", "rpcs_per_s", 15.0, size=64, concurrency=THREADS_TARGET_CONCURRENCY,
           text=f"{THREADS_TARGET_CONCURRENCY} threads calling on one channel at 64 B ≥ "
                "15× grpcio's RPC/s",
           flags=f"argrpc-bench latency --sizes 64 --concurrency "
                 f"{THREADS_TARGET_CONCURRENCY}"),
    Target("latency", "rpcs_per_s", 15.0, size=64, clients=CLIENTS_TARGET,
           text=f"{CLIENTS_TARGET} client processes on one server at 64 B vs 15× grpcio's "
                "RPC/s",
           flags=f"argrpc-bench latency --sizes 64 --clients {CLIENTS_TARGET}",
           info="bound by each client process's interpreter, not by the transport"),
    Target("bandwidth", "gbps", 30.0, mode="raw", size=64 * MiB,
           text="raw bandwidth at 64 MiB ≥ 30× higher",
           flags="argrpc-bench bandwidth --mode raw --sizes 64M"),
    Target("bandwidth", "gbps", 10.0, mode="serialized", size=4 * MiB,
           text="serialized bandwidth at 4 MiB vs 10× higher",
           flags="argrpc-bench bandwidth --mode serialized --sizes 4M",
           info="bound by protobuf's copies of the message, not by the transport"),
    Target("bandwidth", "gbps", 4.0, mode="serialized", size=64 * MiB,
           text="serialized bandwidth at 64 MiB ≥ 4× higher",
           flags="argrpc-bench bandwidth --mode serialized --sizes 64M"),
    Target("ps", "steps_per_s", 5.0, scheme="skew",
           text="PS throughput, skew scheme ≥ 5× higher",
           flags="argrpc-bench ps --scheme skew"),
    Target("latency", "p50_us", 30.0, size=64, api="aio",
           text="asyncio: p50 at 64 B ≥ 30× lower than grpc.aio",
           flags="argrpc-bench latency --api aio --sizes 64"),
    Target("latency", "p99_us", 15.0, size=64, api="aio",
           text="asyncio: p99 at 64 B ≥ 15× lower than grpc.aio",
           flags="argrpc-bench latency --api aio --sizes 64"),
    Target("latency", "rpcs_per_s", 10.0, size=64, api="aio",
           concurrency=AIO_TARGET_CONCURRENCY,
           text=f"asyncio: {AIO_TARGET_CONCURRENCY} calls in flight at 64 B ≥ 10× "
                "grpc.aio's RPC/s",
           flags=f"argrpc-bench latency --api aio --sizes 64 "
                 f"--concurrency {AIO_TARGET_CONCURRENCY}"),
    Target("bandwidth", "gbps", 30.0, mode="raw", size=64 * MiB, api="aio",
           text="asyncio: raw bandwidth at 64 MiB ≥ 30× grpc.aio's",
           flags="argrpc-bench bandwidth --api aio --mode raw --sizes 64M"),
    # "within 1.5×": threaded p50 / aio p50 ≥ 1/1.5, shown as aio / threaded
    Target("latency", "p50_us", 1 / 1.5, size=64, api="aio", versus="threaded",
           text="asyncio: argrpc.aio p50 at 64 B within 1.5× of threaded argrpc's",
           flags="argrpc-bench latency --api both --sizes 64"),
    # the floor: the bare shm ring ping-ponged from Python, same run, same sizes
    Target("latency", "p50_us", 1 / 1.5, size=64, versus=FLOOR,
           text="latency p50 at 64 B vs 1.5× the floor's",
           flags="argrpc-bench latency --sizes 64",
           info="the floor has no gRPC call around it: the gap is the Python call path"),
    Target("latency", "p99_us", 1 / 3, size=64, versus=FLOOR,
           text="latency p99 at 64 B within 3× of the floor's",
           flags="argrpc-bench latency --sizes 64"),
)

_TARGET_HEADINGS = {
    "threaded": "speed targets (argrpc-shm vs plain grpcio and vs the floor, same run)",
    "aio": "asyncio targets (argrpc.aio over shm vs grpc.aio, and vs threaded argrpc; "
           "same run)",
}


@dataclass
class TargetResult:
    target: Target
    status: str                  # PASS | MISS | INFO | not measured | no data
    ratio: float | None = None   # the speedup over ``versus`` (higher is better)
    where: str = ""              # mode / scheme / buffers / env of the cell checked
    detail: str = ""

    def line(self) -> str:
        head = f"{self.status:<12} {self.target.text}"
        if self.where:
            head += f" [{self.where}]"
        return head + (f": {self.detail}" if self.detail else "")

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target.text, "status": self.status, "ratio": self.ratio,
                "min_ratio": self.target.min_ratio, "where": self.where,
                "detail": self.detail, "api": self.target.api,
                "versus": self.target.versus}


def _applies(t: Target, ms: Sequence[Measurement]) -> bool:
    """Targets of a benchmark (and API) that did not run are left out, and so are the
    floor's when the run measured no reference rows (remote servers, --no-floor)."""
    if not ran(ms, t.benchmark, t.api):
        return False
    if t.versus == FLOOR:
        return any(is_reference(m) and m.benchmark == t.benchmark for m in ms)
    return t.versus != "threaded" or ran(ms, t.benchmark, "threaded")


def _reference(t: Target, m: Measurement, ms: Sequence[Measurement]) -> Measurement | None:
    if t.versus == FLOOR:
        return floor_of(m, ms)
    if t.versus != "threaded":
        return baseline_of(m, ms)
    key = cell_key(replace(m, api="threaded", concurrency=1))
    return next((b for b in ms if b.transport == m.transport and not b.skipped
                 and cell_key(b) == key), None)


def _shown(t: Target, r: float) -> str:
    """The ratio as the target reads: for a bound below 1 (aio / threaded, shm / floor,
    argrpc / grpcio) the slowdown, at most 1 / min_ratio; else the speedup."""
    if t.min_ratio >= 1:
        return fmt_ratio(r)
    slower = fmt_ratio(1 / r)
    metric = _UNITS[t.metric].split()[0]
    return {"threaded": f"aio {metric} = {slower} threaded",
            FLOOR: f"{metric} = {slower} the floor's"}.get(t.versus,
                                                          f"{metric} = {slower} grpcio's")


def _verdict(t: Target, r: float) -> tuple[str, str]:
    shown = _shown(t, r)
    if t.info:
        goal = f"at most {1 / t.min_ratio:g}×" if t.min_ratio < 1 else f"{t.min_ratio:g}×"
        return "INFO", f"{shown} (once a goal of {goal}; {t.info})"
    if t.min_ratio < 1:
        slower, allowed = 1 / r, 1 / t.min_ratio
        if r >= t.min_ratio:
            return "PASS", f"{shown} (allowed {allowed:g}×)"
        return "MISS", f"{shown}, allowed {allowed:g}×: over by {slower / allowed:.2f}×"
    if r >= t.min_ratio:
        return "PASS", f"{shown} (needs {t.min_ratio:g}×)"
    return "MISS", (f"{shown}, needs {t.min_ratio:g}×: short by "
                    f"{t.min_ratio / r:.2f}× ({(1 - r / t.min_ratio) * 100:.0f}% below)")


def _where(m: Measurement) -> str:
    if m.benchmark == "ps":
        where = f"{m.mode}, {m.scheme}, {m.buffers} vars, {m.workers} workers"
    else:
        where = f"{m.mode}, {m.scheme}, {m.buffers} buf" + ("s" if m.buffers != 1 else "")
    if m.concurrency != 1:
        where += f", {m.concurrency} in flight"
    if m.clients != 1:
        where += f", {m.clients} client processes"
    return where + (f", {env_label(m.env)}" if m.env else "")


def evaluate_targets(ms: Sequence[Measurement]) -> list[TargetResult]:
    """Checks each target of a benchmark that ran, once per matching cell.

    A miss says by how much (the factor still needed). Targets of benchmarks that did not
    run are left out; a benchmark that ran without the target's cell says how to get it.
    """
    out: list[TargetResult] = []
    for t in TARGETS:
        if not _applies(t, ms):
            continue
        cands = [m for m in _order(ms) if m.benchmark == t.benchmark
                 and m.transport == TARGET_TRANSPORT and m.api == t.api
                 and m.loop == "asyncio" and m.concurrency == t.concurrency and m.clients == t.clients
                 and (t.mode is None or m.mode == t.mode)
                 and (t.scheme is None or m.scheme == t.scheme)
                 and (t.size is None or m.size == t.size)]
        if not cands:
            out.append(TargetResult(t, "not measured", detail=f"run `{t.flags}`"))
            continue
        for m in cands:
            where = _where(m)
            if m.skipped:
                out.append(TargetResult(t, "no data", where=where,
                                        detail=f"shm skipped: {m.note}"))
                continue
            ref = _reference(t, m, ms)
            r = speedup(m, ref, t.metric)
            if r is None:
                missing = {"threaded": "threaded shm row missing or skipped",
                           FLOOR: "floor row missing or skipped"}.get(
                               t.versus, "grpc baseline missing or skipped")
                out.append(TargetResult(t, "no data", where=where,
                                        detail=missing if ref is None else "no value"))
                continue
            status, detail = _verdict(t, r)
            out.append(TargetResult(t, status, r, where, detail))
    return out


# --------------------------------------------------------------------------- set-up

CONNECT_GOAL = 2.0  # argrpc's first call on a new channel: at most this many grpcio's (p50)
_CONNECT_TRANSPORT = {"grpc": "grpc", "argrpc": "shm"}  # a stack's first call ends there


def connect_table(doc: dict[str, Any]) -> Table:
    """``argrpc_bench.connect.measure``'s result: one row per stack and mode."""
    headers = ["clients", "transport", "ok / n", "p50 ms", "p99 ms", "slowest ms",
               "p50 vs grpc"]
    rows = []
    for mode in ("sequential", "burst"):
        grpc_p50 = doc[mode]["grpc"]["p50_ms"]
        for stack, transport in _CONNECT_TRANSPORT.items():
            r = doc[mode][stack]
            if not r["n"]:
                continue
            who = ("one at a time" if mode == "sequential"
                   else f"{doc['burst_size']} at once")
            ratio = ("base" if stack == "grpc" else
                     fmt_ratio(grpc_p50 / r["p50_ms"]) if r["ok"] and grpc_p50 == grpc_p50
                     else "–")
            rows.append([who, transport, f"{r['ok']} / {r['n']}", fmt_num(r["p50_ms"]),
                         fmt_num(r["p99_ms"]), fmt_num(r["max_ms"]), ratio])
    return Table(headers, rows, [False, False, True, True, True, True, True])


_CONNECT_TARGETS = (
    Target("connect", "p50_us", 1 / CONNECT_GOAL,
           text=f"first call on a new channel within {CONNECT_GOAL:g}× grpcio's first call "
                "(p50 over fresh processes, negotiation included)",
           flags="argrpc-bench connect"),
    Target("connect", "ok", 1.0, text="processes connecting to one server at once all "
                                      "succeed", flags="argrpc-bench connect --burst 64"),
)


def connect_targets(doc: dict[str, Any] | None) -> list[TargetResult]:
    """PASS/MISS of the set-up goals; none when set-up was not measured."""
    if not doc:
        return []
    first, burst = _CONNECT_TARGETS
    out = []
    seq = doc["sequential"]
    where = f"{seq['argrpc']['n']} processes each"
    if seq["argrpc"]["ok"] and seq["grpc"]["ok"]:
        r = seq["grpc"]["p50_ms"] / seq["argrpc"]["p50_ms"]
        status, detail = _verdict(first, r)
        out.append(TargetResult(first, status, r, where, detail))
    elif seq["argrpc"]["n"]:
        errors = "; ".join(seq["argrpc"]["errors"] or seq["grpc"]["errors"])
        out.append(TargetResult(first, "no data", where=where, detail=errors or "no result"))
    b = doc["burst"]
    if b["argrpc"]["n"]:
        a, g = b["argrpc"], b["grpc"]
        ok = a["ok"] == a["n"]
        detail = (f"{a['ok']} / {a['n']} on shm, slowest first call {fmt_num(a['max_ms'])} ms "
                  f"(grpcio: {g['ok']} / {g['n']}, slowest {fmt_num(g['max_ms'])} ms)")
        if a["errors"]:
            detail += "; " + "; ".join(a["errors"])
        out.append(TargetResult(burst, "PASS" if ok else "MISS", a["ok"] / a["n"],
                                f"{a['n']} at once", detail))
    return out


# --------------------------------------------------------------------------- documents

def _on_loops(ms: Sequence[Measurement], benchmark: str, api: str) -> str:
    """' on uvloop' when a table's rows ran on other loops than asyncio's own."""
    used = sorted({m.loop for m in ms if m.benchmark == benchmark and m.api == api})
    return "" if used == ["asyncio"] else f" on {', '.join(used)}"


def _sections(ms: Sequence[Measurement]) -> list[tuple[str, str, str, Table]]:
    """(kind, title, description, table) of every table to show, in report order."""
    out: list[tuple[str, str, str, Table]] = []
    for b in BENCHMARKS:
        for api in APIS:
            if not ran(ms, b, api):
                continue
            if api == "threaded":
                desc = _DESCRIPTION[b]
                if any(is_reference(m) and m.benchmark == b for m in ms):
                    desc += _FLOOR_DESCRIPTION[b]
                out.append(("main", b, desc, benchmark_table(ms, b, api)))
            else:
                out.append(("main", f"{b}, asyncio API{_on_loops(ms, b, api)}",
                            f"{_DESCRIPTION[b]}; {_AIO_DESCRIPTION}",
                            benchmark_table(ms, b, api)))
            sw = sweep_table(ms, b, api)
            if sw is not None:
                label = b if api == "threaded" else f"{b}, asyncio API{_on_loops(ms, b, api)}"
                out.append(("sweep", label, f"{PRIMARY[b]} per environment", sw))
        at = api_table(ms, b)
        if at is not None:
            out.append(("main", f"{b}: asyncio vs threaded API",
                        f"the same transport under both APIs, same run, one call in flight; "
                        f"aio / threaded of {_UNITS[PRIMARY[b]]}", at))
    return out


_CONNECT_DESCRIPTION = ("connection set-up: a fresh process's first call on a new channel, "
                        "from creating the channel to the answer of a 64 B protobuf Echo "
                        "(argrpc: negotiation, engine and shm attach included)")


def terminal_report(ms: Sequence[Measurement], connect: dict[str, Any] | None = None) -> str:
    parts: list[str] = []
    for kind, title, desc, table in _sections(ms):
        if kind == "sweep":
            parts[-1:] = [f"-- {title}: sweep, {desc}", table.text(), ""]
        else:
            parts += [f"== {title}: {desc}", table.text(), ""]
    if connect:
        parts += [f"== {_CONNECT_DESCRIPTION}", connect_table(connect).text(), ""]
    results = evaluate_targets(ms) + connect_targets(connect)
    for api in APIS:
        lines = [r.line() for r in results if r.target.api == api]
        if lines:
            parts += [f"== {_TARGET_HEADINGS[api]}", *lines, ""]
    return "\n".join(parts).rstrip() + "\n"


def markdown_report(ms: Sequence[Measurement], meta: dict[str, Any],
                    plots: Sequence[str] = (), md_path: str | None = None) -> str:
    """A self-contained Markdown page: machine, command, tables, targets, plots.

    Plot links are made relative to ``md_path``'s directory so the page renders where it
    is written (and in a repository browser).
    """
    lines = ["# argrpc-bench results", ""]
    g = meta.get
    info = [("date", g("date")),
            ("command", g("command") and f"`{g('command')}`"),
            ("machine", g("kernel") and f"{g('cpus')} vCPU {g('cpu', '')}, {g('kernel')} "
                                        f"({g('machine', '')})"),
            ("software", g("python") and f"Python {g('python')}, grpcio {g('grpcio')}, "
                                         f"protobuf {g('protobuf')}, numpy {g('numpy')}, "
                                         f"argrpc {g('argrpc')}"),
            ("duration", g("elapsed_s") is not None and f"{g('elapsed_s')} s")]
    lines += [f"- **{k}**: {v}" for k, v in info if v]
    lines.append("")
    errors = [str(e) for e in meta.get("errors") or []]
    if errors:
        # first lines only: the JSON's meta.errors keeps the whole of each
        lines += ["## Errors", "", "What failed is listed here and missing (or skipped, "
                  "saying why) below; everything else was measured.", ""]
        lines += [f"- {(e.splitlines() or [''])[0]}" for e in errors]
        lines.append("")
    for kind, title, desc, table in _sections(ms):
        if kind == "sweep":
            lines += [f"Sweep ({desc}):", "", table.markdown(), ""]
        else:
            lines += [f"## {title}", "", desc[0].upper() + desc[1:] + ".", "",
                      table.markdown(), ""]
    connect = meta.get("connect")
    if connect:
        title, _, desc = _CONNECT_DESCRIPTION.partition(": ")
        lines += [f"## {title[0].upper() + title[1:]}", "", desc[0].upper() + desc[1:] + ".",
                  "", connect_table(connect).markdown(), ""]
    results = evaluate_targets(ms) + connect_targets(connect)
    for api in APIS:
        rs = [r for r in results if r.target.api == api]
        if rs:
            heading = _TARGET_HEADINGS[api]
            lines += [f"## {heading[0].upper() + heading[1:]}", "",
                      "| status | target | where | result |", "|:---|:---|:---|:---|"]
            lines += [f"| {r.status} | {r.target.text} | {r.where} | {r.detail} |"
                      for r in rs]
            lines.append("")
    if plots:
        lines += ["## Plots", ""]
        base = os.path.dirname(os.path.abspath(md_path)) if md_path else None
        for p in plots:
            rel = os.path.relpath(os.path.abspath(p), base) if base else p
            name = os.path.splitext(os.path.basename(p))[0]
            lines += [f"![{name}]({rel})", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_json(path: str, ms: Sequence[Measurement], meta: dict[str, Any]) -> None:
    doc = to_json(ms, meta)
    _ensure_dir(path)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, ensure_ascii=False)
        f.write("\n")


def write_text(path: str, text: str) -> None:
    _ensure_dir(path)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _ensure_dir(path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
