"""How close the process is to its open-file limit (RLIMIT_NOFILE).

A fast connection takes descriptors beyond what grpc's own connection takes (one socket
per shm connection; on verbs, the device's). Near the limit argrpc leaves new channels to
plain gRPC rather than take the descriptors grpc's own connections would then lack: a
process that works under grpc keeps working under argrpc, with the reason visible."""

from __future__ import annotations

import errno
import os
import resource

__all__ = ["exhausted_text", "near_limit_reason"]

_RESERVE_MIN = 32  # descriptors left to gRPC, or a quarter of the limit if more


def _soft_limit() -> int:
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        return -1
    return -1 if soft == resource.RLIM_INFINITY else int(soft)


def near_limit_reason() -> str:
    """Why the process should open no more fast connections now ("" when it may)."""
    soft = _soft_limit()
    if soft < 0:
        return ""
    try:
        used = len(os.listdir("/proc/self/fd")) - 1  # less listdir's own descriptor
    except OSError:
        return ""
    reserve = max(_RESERVE_MIN, soft // 4)
    if used + reserve < soft:
        return ""
    return (f"the process is near its open-file limit ({used} open, RLIMIT_NOFILE {soft}; "
            f"argrpc leaves the last {reserve} to gRPC)")


def exhausted_text(error: BaseException) -> str:
    """An error's text, naming the limit when it is the open-file limit."""
    text = str(error)
    if getattr(error, "errno", None) in (errno.EMFILE, errno.ENFILE) or \
            "Too many open files" in text:
        text += f" (RLIMIT_NOFILE {_soft_limit()})"
    return text
