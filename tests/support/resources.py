"""Process resource snapshots used by the leak tests (client and server side)."""
from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any, Callable


def _fd_targets() -> list[str]:
    targets = []
    for name in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{name}"))
        except OSError:
            pass  # the fd used by listdir itself is already closed
    return sorted(targets)


# The test server's thread pool. It grows up to its size as calls need workers and
# keeps its threads (ThreadPoolExecutor never ends an idle one), so its threads are
# counted apart: they are the pool's, bounded by it, not a leak.
SERVER_POOL_PREFIX = "server-pool"
# argrpc's engine is process-wide and lives until exit; so does the thread that hands
# its messages to logging (argrpc/_log.py), started with it: not a leak either.
PROCESS_WIDE = {"argrpc-log"}


def snapshot() -> dict[str, Any]:
    gc.collect()
    targets = _fd_targets()
    threads = [t for t in threading.enumerate()
               if not t.name.startswith(SERVER_POOL_PREFIX) and t.name not in PROCESS_WIDE]
    return {
        "fds": len(targets),
        "fd_targets": targets,
        "threads": len(threads),
        "thread_names": sorted(t.name for t in threads),
        "pool_threads": threading.active_count() - len(threads),
        "os_threads": len(os.listdir("/proc/self/task")),
        "dev_shm": sorted(os.listdir("/dev/shm")),
    }


def new_shm_entries(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    return sorted(set(after["dev_shm"]) - set(before["dev_shm"]))


def leaked(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Human-readable list of what grew between two snapshots (empty: nothing leaked)."""
    problems = []
    if after["fds"] > before["fds"]:
        extra = sorted(set(after["fd_targets"]) - set(before["fd_targets"]))
        problems.append(f"fds {before['fds']} -> {after['fds']} (new targets: {extra})")
    if after["threads"] > before["threads"]:
        extra = sorted(set(after["thread_names"]) - set(before["thread_names"]))
        problems.append(f"threads {before['threads']} -> {after['threads']} (new: {extra})")
    shm = new_shm_entries(before, after)
    if shm:
        problems.append(f"new /dev/shm entries: {shm}")
    return problems


def settle(before: dict[str, Any], take: Callable[[], dict[str, Any]],
           timeout: float = 15.0) -> tuple[dict[str, Any], list[str]]:
    """Poll `take` until nothing leaked relative to `before` or `timeout` passes.

    Teardown is asynchronous in both stacks (threads notice a closed socket a little
    later), so a leak is only a leak if it is still there after a generous wait.
    """
    end = time.monotonic() + timeout
    while True:
        after = take()
        problems = leaked(before, after)
        if not problems or time.monotonic() > end:
            return after, problems
        time.sleep(0.2)
