"""One address of a balanced channel: its own gRPC channel to exactly that address (the
bootstrap call and, when that server has no fast path, the calls picked to it), and the
fast connection that server negotiated, shared with the other channels of the process
that reach the same address with the same settings.

Its negotiation state is a channel's (``NegotiationState``): a subchannel that found its
server unreachable is tried again after the interval, one whose server speaks plain gRPC stays on
gRPC, and one whose fast connection died negotiates again. The blocking front end
negotiates under the subchannel's lock, the asyncio one in a task on the channel's loop.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, Callable, Optional, Protocol

from .. import _config, _grpc_payloads
from .._negotiation import FAST, FORCED, GRPC, NegotiationState
from .._subchannels import pool_key

__all__ = ["Subchannel"]

_NEGOTIATION_TIMEOUT_S = _config.LIMITS.negotiation_timeout_s


class Owner(Protocol):
    """What a subchannel reads of the balancer that holds it."""

    cfg: _config.Config
    credentials: Any
    grpc_options: Any
    max_recv: int
    secure: bool
    closed: bool

    def make_grpc(self, address: str) -> Any: ...


class Subchannel(NegotiationState):
    def __init__(self, owner: Owner, address: str) -> None:
        self._owner = owner
        self.address = address
        self._cfg = owner.cfg
        self._target = address
        self._pool_key = pool_key(address, owner.credentials, owner.grpc_options, owner.cfg,
                                  owner.max_recv)
        self._lock = threading.Lock()
        self._grpc_of: Optional[tuple[int, Any]] = None  # (pid, gRPC channel), made on use
        self._callables: dict[tuple[Any, ...], Any] = {}
        self._task: Optional[asyncio.Task[None]] = None  # the asyncio negotiation running
        self._init_negotiation(track=False)

    def _closing(self) -> bool:
        return self._owner.closed

    # ------------------------------------------------------------------ state
    def ready(self) -> bool:
        """A call picked now has somewhere to go: a live fast connection, or plain gRPC
        to this address (its server has no fast path)."""
        fast = self._fast
        return fast.alive if fast is not None else self._state == GRPC

    def due(self) -> bool:
        """Needs a negotiation now: never tried, its fast connection died, or its server
        was unreachable and the interval has passed."""
        fast = self._fast
        if fast is not None:
            return not fast.alive
        return self._negotiation_due(False)

    def forced(self) -> str:
        return self._forced_error if self._state == FORCED else ""

    def transport(self) -> str:
        fast = self._fast
        return self._fast_name if fast is not None and self._state == FAST else "grpc"

    # ------------------------------------------------------------------ gRPC to this address
    def grpc_channel(self) -> Any:
        """This address's gRPC channel (a forked child makes its own: grpcio's channels
        do not survive fork)."""
        pid = os.getpid()
        got = self._grpc_of
        if got is None or got[0] != pid:
            got = self._grpc_of = (pid, self._owner.make_grpc(self.address))
        return got[1]

    def made_grpc_channel(self) -> Any:
        got = self._grpc_of
        return got[1] if got is not None and got[0] == os.getpid() else None

    def multicallable(self, kind: str, method: str, serializer: Optional[Callable[..., Any]],
                      deserializer: Optional[Callable[..., Any]], registered: Any) -> Any:
        """grpc's multicallable for `method` on this address's channel (made once)."""
        key = (kind, method, serializer, deserializer)
        got = self._callables.get(key)
        if got is None:
            factory = getattr(self.grpc_channel(), kind)
            got = self._callables[key] = factory(
                method, _grpc_payloads.bytes_serializer(serializer), deserializer, registered)
        return got

    # ------------------------------------------------------------------ negotiation
    def _begin(self, wait_for_ready: bool) -> bool:
        """Drops a dead fast connection; True when a negotiation is to run."""
        fast = self._fast
        if fast is not None and not fast.alive:
            self._drop_lost(fast)
        if self._fast is not None or self._closing() or not self._negotiation_due(
                wait_for_ready):
            return False
        return not self._take_shared()

    def connect(self, timeout: Optional[float], wait_for_ready: bool = False) -> None:
        """Negotiate now if due (blocking front end)."""
        from .. import _bootstrap  # late: needs the proto and engine modules

        with self._lock:
            if not self._begin(wait_for_ready):
                return
            o = self._owner
            try:
                neg = _bootstrap.negotiate(
                    self.grpc_channel(), o.cfg, o.max_recv,
                    timeout=_NEGOTIATION_TIMEOUT_S if timeout is None else timeout,
                    wait_for_ready=wait_for_ready, secure=o.secure, target=self.address)
            except Exception as e:  # noqa: BLE001 - negotiation must never break a call
                self._settle(None, e)
                return
            self._settle(neg)

    def connect_async(self, timeout: Optional[float],
                      wait_for_ready: bool = False) -> "asyncio.Task[None]":
        """The task negotiating this subchannel (asyncio front end): the one running, or
        a new one."""
        task = self._task
        if task is None or task.done():
            task = self._task = asyncio.get_running_loop().create_task(
                self._negotiate_async(timeout, wait_for_ready))
        return task

    async def _negotiate_async(self, timeout: Optional[float], wait_for_ready: bool) -> None:
        from .. import _bootstrap

        if not self._begin(wait_for_ready):
            return
        o = self._owner
        try:
            neg = await _bootstrap.negotiate_async(
                self.grpc_channel(), o.cfg, o.max_recv,
                timeout=_NEGOTIATION_TIMEOUT_S if timeout is None else timeout,
                wait_for_ready=wait_for_ready, secure=o.secure, target=self.address)
        except Exception as e:  # noqa: BLE001
            self._settle(None, e)
            return
        self._settle(neg)

    # ------------------------------------------------------------------ end
    def let_go(self, why: str) -> Any:
        """Lets go of the fast connection (this channel's calls on it end CANCELLED
        `why`); returns the gRPC channel for the caller to close (None if never made)."""
        fast, self._fast = self._fast, None
        if fast is not None:
            self._let_go(fast, why)
        grpc_channel, self._grpc_of = self.made_grpc_channel(), None
        return grpc_channel
