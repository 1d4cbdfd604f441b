"""Measurement record and the JSON document the suite writes (schema ``argrpc-bench/1``).

The runner produces ``Measurement``s; report/plots/JSON only read them. The JSON is the
dataclass fields verbatim, so a saved file round-trips through ``from_json``.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable

SCHEMA = "argrpc-bench/1"


@dataclass
class Measurement:
    benchmark: str            # "latency" | "bandwidth" | "ps"
    transport: str            # "grpc" or a fast transport's name (argrpc._transports)
    mode: str                 # "serialized" | "raw"
    scheme: str               # "uniform" | "random" | "skew"
    size: int                 # payload bytes per message (ps: bytes per step per worker, pull+push)
    buffers: int              # iovecs per message (ps: variables)
    iterations: int           # timed iterations per repeat
    repeats: int
    p50_us: float | None = None
    p99_us: float | None = None
    mean_us: float | None = None
    gbps: float | None = None           # payload GB/s (1e9 B/s)
    rpcs_per_s: float | None = None
    steps_per_s: float | None = None    # ps
    workers: int | None = None          # ps
    env: dict[str, str] = field(default_factory=dict)   # TF_RDMA_* given to the measured processes
    note: str = ""                      # e.g. why a transport was skipped
    skipped: bool = False
    # Added after the first files were written; the defaults are what those measured.
    api: str = "threaded"               # "threaded" | "aio" (grpc.aio / argrpc.aio)
    concurrency: int = 1                # calls in flight at once on one channel
    clients: int = 1                    # client processes on one server, started together
    failed: bool = False                # skipped because its processes failed (note: how),
    #                                     not for a reason of the machine or the spec
    loop: str = "asyncio"               # aio: the event loop of both processes (LOOPS)


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Measurement))


def measurement_to_dict(m: Measurement) -> dict[str, Any]:
    d = dataclasses.asdict(m)
    d["env"] = dict(sorted(m.env.items()))  # stable output for diffs
    return d


def to_json(measurements: Iterable[Measurement], meta: dict[str, Any]) -> dict[str, Any]:
    """``{"schema": "argrpc-bench/1", "meta": {...}, "measurements": [...]}``."""
    return {
        "schema": SCHEMA,
        "meta": dict(meta),
        "measurements": [measurement_to_dict(m) for m in measurements],
    }


def from_json(doc: dict[str, Any]) -> tuple[list[Measurement], dict[str, Any]]:
    """Inverse of ``to_json``; unknown keys are ignored so newer files still load."""
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"not an {SCHEMA} document: schema={doc.get('schema')!r}")
    ms = []
    for raw in doc.get("measurements", []):
        ms.append(Measurement(**{k: v for k, v in raw.items() if k in FIELDS}))
    return ms, dict(doc.get("meta", {}))


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # not installed as a distribution: report what we can
        return "unknown"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def collect_meta(argv: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """Where and how the numbers were taken: enough to judge whether two files compare."""
    uname = platform.uname()
    meta: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),  # callers
        # that measure first pass date=<start time> (extra wins)
        "command": " ".join(["argrpc-bench", *(argv if argv is not None else sys.argv[1:])]),
        "host": uname.node,
        "kernel": f"{uname.system} {uname.release}",
        "machine": uname.machine,
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "grpcio": _version("grpcio"),
        "protobuf": _version("protobuf"),
        "numpy": _version("numpy"),
        "argrpc": _version("argrpc"),
    }
    meta.update(extra)
    return meta
