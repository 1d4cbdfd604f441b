"""The part of malloc tuning (`TF_RDMA_MALLOC_TUNING`) that must happen at import.

glibc gives a thread its heap (arena) at the thread's first allocation and keeps it for
the thread's life. Only the main heap can hand out a block of tens of MiB without a
fresh mapping (a per-thread heap is at most 64 MiB, and glibc maps anything that does
not fit), so a thread on a heap of its own page-faults through every large protobuf
buffer it builds or parses, whatever the thresholds the engine sets when the fast path
starts. Capping the number of heaps at one here, before the application starts the
threads that will call and serve (its caller threads, the server's thread pool), puts
those threads on the main heap. Threads that already allocated keep their heaps.
"""
from __future__ import annotations

import ctypes
import os
from typing import Mapping

from argrpc import _config

_M_ARENA_MAX = -8  # glibc's <malloc.h>


def _wanted(environ: Mapping[str, str]) -> bool:
    """Whether the environment asks for malloc tuning in a process that may use a fast
    path (a process told never to use one keeps glibc's defaults)."""
    def value(name: str, default: str) -> object:
        return _config.knob(name).parse(environ.get(name, default))
    try:
        return bool(value("TF_RDMA_MALLOC_TUNING", "true") and value("TF_RDMA_ENABLED", "true")
                    and value("TF_RDMA_TRANSPORT", "auto") != "grpc")
    except ValueError:
        return False  # the channel or server reports the bad value when it reads it


def cap_arenas() -> bool:
    """Cap glibc's heaps at one (`malloc_arena_max`) unless malloc tuning or argrpc is
    off; False where there is no glibc `mallopt` or it refused."""
    if not _wanted(os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_ARENA_MAX, _config.LIMITS.malloc_arena_max))
