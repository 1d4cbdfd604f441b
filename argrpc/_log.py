"""Engine messages through Python's logging.

The C++ engine queues its messages (it never takes the GIL on its own threads); a
daemon thread of this process takes them and logs each on the ``argrpc.engine`` logger
at the level the engine gave it, so the standard logging configuration decides where
they go: with none, Python's last-resort handler prints warnings and errors to stderr,
as the engine did before. A forked child starts its own thread with its own engine.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from types import ModuleType

__all__ = ["ENGINE_LOGGER", "start"]

ENGINE_LOGGER = logging.getLogger("argrpc.engine")
_TAKE_MS = 200  # how long one take waits: bounds the thread's reaction to exit

_lock = threading.Lock()
_started_pid: int | None = None


def _emit(core: ModuleType, timeout_ms: int) -> None:
    entries, dropped = core._take_log(timeout_ms)
    if dropped:
        ENGINE_LOGGER.warning("%d engine messages were dropped (nobody took them in time)",
                              dropped)
    for level, text in entries:
        ENGINE_LOGGER.log(level, "%s", text)


def _run(core: ModuleType) -> None:
    while True:
        try:
            _emit(core, _TAKE_MS)
        except Exception:  # noqa: BLE001 - a handler's failure must not end the thread
            logging.getLogger("argrpc").exception("logging an engine message failed")


def start(core: ModuleType) -> None:
    """Take the engine's messages in this process from now on (idempotent per process)."""
    global _started_pid
    pid = os.getpid()
    if _started_pid == pid:
        return
    with _lock:
        if _started_pid == pid:
            return
        core._take_log(0)  # from here on the engine queues instead of printing
        threading.Thread(target=_run, args=(core,), name="argrpc-log", daemon=True).start()
        # What the last moments queued still reaches the handlers at a normal exit.
        atexit.register(_emit, core, 0)
        _started_pid = pid


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
