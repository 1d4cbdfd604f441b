"""Fast connections shared by the channels of a process, as grpc shares subchannels:
channels to the same target with the same settings (options, credentials, knobs) use one
connection, counted by reference. Each channel calls through a handle of its own
(`Connection.share()`): its calls form a group that its close ends, leaving the
connection and the other channels' calls alone; the last channel to go closes the
connection. `grpc.use_local_subchannel_pool=1` keeps a channel's connection its own.

Both front ends take their connections here (the threaded and the asyncio channel)."""

from __future__ import annotations

import os
import threading
from typing import Any, Hashable, Optional

__all__ = ["Shared", "SUBCHANNELS", "pool_key"]

_LOCAL_POOL_KEY = "grpc.use_local_subchannel_pool"


class Shared:
    """One fast connection and the channels that use it."""

    __slots__ = ("conn", "transport", "compression_disabled", "users", "key")

    def __init__(self, conn: Any, transport: str, compression_disabled: int,
                 key: Optional[Hashable]) -> None:
        self.conn = conn  # the engine's handle that no channel calls through
        self.transport = transport
        self.compression_disabled = compression_disabled
        self.users = 0
        self.key = key


def pool_key(target: str, credentials: Any, grpc_options: Any, cfg: Any,
             max_recv: int) -> Optional[Hashable]:
    """What channels must agree on to share a connection; None when the channel opts out
    (grpc's local subchannel pool). Options are compared as given (grpc compares channel
    args); credentials by identity."""
    options = tuple(grpc_options or ())
    if any(k == _LOCAL_POOL_KEY and v for k, v in options):
        return None
    return (target, id(credentials) if credentials is not None else None,
            repr(sorted(options, key=repr)), repr(cfg), max_recv)


class Subchannels:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shared: dict[Hashable, Shared] = {}

    def take(self, key: Optional[Hashable]) -> Optional[tuple[Any, Shared]]:
        """A handle on the live connection shared under `key`, or None."""
        if key is None:
            return None
        with self._lock:
            shared = self._shared.get(key)
            if shared is None:
                return None
            if not shared.conn.alive:
                del self._shared[key]  # its users let go of it when they notice
                return None
            shared.users += 1
        return shared.conn.share(), shared

    def add(self, key: Optional[Hashable], conn: Any, transport: str,
            compression_disabled: int) -> tuple[Any, Shared]:
        """A handle on a connection a channel has just negotiated, shared under `key`
        from now on. If another channel has meanwhile shared a live one, that one is
        taken and the new one closed: one connection per key."""
        with self._lock:
            shared = self._shared.get(key) if key is not None else None
            if shared is not None and shared.conn.alive:
                shared.users += 1
                spare: Any = conn
            else:
                shared = Shared(conn, transport, compression_disabled, key)
                shared.users = 1
                if key is not None:
                    self._shared[key] = shared
                spare = None
        if spare is not None:
            spare.close()
        return shared.conn.share(), shared

    def release(self, shared: Shared, handle: Any, why: str) -> None:
        """A channel is done with its handle: its calls end (CANCELLED `why`), and the
        connection closes with its last user."""
        handle.end_own(why)
        with self._lock:
            shared.users -= 1
            last = shared.users <= 0
            if last and shared.key is not None and self._shared.get(shared.key) is shared:
                del self._shared[shared.key]
        if last:
            shared.conn.close()

    def count(self) -> int:
        """Connections shared now (for tests and metrics)."""
        with self._lock:
            return len(self._shared)

    def _after_fork_in_child(self) -> None:
        # The parent's connections are not the child's, and a parent thread may have
        # held the lock: the child starts empty.
        self._lock = threading.Lock()
        self._shared = {}


SUBCHANNELS = Subchannels()
os.register_at_fork(after_in_child=SUBCHANNELS._after_fork_in_child)
