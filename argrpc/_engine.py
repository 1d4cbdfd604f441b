"""The process-wide C++ engine (`argrpc._core.Engine`), created on first use."""

from __future__ import annotations

import os
import threading
from types import ModuleType
from typing import TYPE_CHECKING, Optional

from argrpc import _log
from argrpc._config import Config, engine_config

if TYPE_CHECKING:
    from argrpc._core import Engine

__all__ = ["EngineUnavailable", "core_module", "get_engine", "peek_engine"]


class EngineUnavailable(RuntimeError):
    """`argrpc._core` (the compiled engine) cannot be imported."""


try:
    # Loaded with argrpc, not by the first call that needs it: loading the extension
    # (about a millisecond) would hold the GIL on that call's critical path. Without it
    # argrpc still works (plain gRPC); core_module() then says why.
    from argrpc import _core as _  # noqa: F401
except ImportError:
    pass

_lock = threading.Lock()
_engine: Optional[Engine] = None
_engine_pid: int | None = None
# Engines inherited through fork(). The child must neither use nor destroy them: their
# progress threads do not exist in the child, so a destructor that joins them would hang,
# and freeing shared mappings/fds could disturb the parent's view of the peers. Keeping a
# reference forever is the only safe thing to do with them.
_inherited: list[Engine] = []


def _after_fork_in_child() -> None:
    global _lock, _engine, _engine_pid
    # A thread of the parent may have held the lock at fork time; it never releases it here.
    _lock = threading.Lock()
    if _engine is not None:
        _inherited.append(_engine)
    _engine = None
    _engine_pid = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def core_module() -> ModuleType:
    """Import `argrpc._core` or raise EngineUnavailable saying why."""
    try:
        from argrpc import _core
    except ImportError as e:
        raise EngineUnavailable(
            "argrpc's C++ engine (argrpc._core) is not importable, so the shared-memory "
            f"fast path is unavailable: {e}. Build it with `pip install .` from the argrpc "
            "source tree") from e
    return _core


def get_engine(cfg: Config) -> Engine:
    """Return this process's `_core.Engine`, creating it from `cfg` on first use.

    Only the process-wide knobs of the first caller's cfg matter (they come from the
    environment, so every caller agrees). After fork() the child gets its own engine.
    """
    global _engine, _engine_pid
    eng, pid = _engine, os.getpid()
    if eng is not None and _engine_pid == pid:
        return eng
    core = core_module()
    with _lock:
        if _engine is not None and _engine_pid == pid:
            return _engine
        if _engine is not None:  # fork without register_at_fork having run (e.g. os.fork in C)
            _inherited.append(_engine)
        _log.start(core)
        _engine = core.Engine(engine_config(cfg))
        _engine_pid = pid
        return _engine


def peek_engine() -> Optional[Engine]:
    """This process's engine if one was created, else None (never creates one)."""
    return _engine if _engine_pid == os.getpid() else None
