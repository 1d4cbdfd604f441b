"""argrpc-bench: TF-gRPC-Bench-style microbenchmarks.

Point-to-point latency, point-to-point bandwidth and parameter-server throughput over
plain grpcio, argrpc's shared-memory path and argrpc-verbs where a device exists, with
serialized (protobuf) and raw (buffer serializer) payloads, all measured in one run so
the ratios compare like with like. Run ``argrpc-bench --help`` or
``python -m argrpc_bench --help``.

Modules, one job each: ``schemes`` (payload sizes), ``models`` (ResNet-50 variable
shapes), ``results`` (Measurement + JSON schema), ``runner`` / ``server`` / ``client`` /
``ps`` / ``messages`` (the measured processes; ``aio_server`` / ``aio_client`` the same
point-to-point loops over the asyncio API), ``floor`` (the reference rows: the latency
floor and the memory-copy rates), ``connect`` (a new channel's first call, in fresh
processes), ``report`` (terminal table, Markdown, targets), ``plots`` (PNG), ``progress`` (stderr progress), ``cli`` (argument parsing).
"""
from __future__ import annotations

import os

# NumPy's import wakes OpenBLAS's worker threads, which then spin for about a tenth of a
# second: every measured process would start its first repeat with a CPU taken. The
# bench does no linear algebra, so every process it starts (they inherit this) keeps one
# BLAS thread, unless the caller chose otherwise. Set before anything imports NumPy.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from argrpc._transports import names  # noqa: E402

BENCHMARKS = ("latency", "bandwidth", "ps")
FAST_TRANSPORTS = names()
TRANSPORTS = ("grpc", *FAST_TRANSPORTS)
MODES = ("raw", "serialized")
SCHEMES = ("uniform", "random", "skew")
# threaded: grpc.server / grpc.insecure_channel and argrpc's drop-ins; aio: grpc.aio and
# argrpc.aio, one event loop per process.
APIS = ("threaded", "aio")
# The event loop of both aio processes: asyncio's own, or uvloop (installed separately).
LOOPS = ("asyncio", "uvloop")

__all__ = ["APIS", "BENCHMARKS", "FAST_TRANSPORTS", "LOOPS", "TRANSPORTS", "MODES", "SCHEMES"]
