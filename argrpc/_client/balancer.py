"""round_robin over a channel's addresses: one subchannel per address, every call to the
next one that is READY (a live fast connection, or plain gRPC to that address when its
server has none), as grpc's round_robin policy picks.

A subchannel that is not ready is negotiated again in the background (a thread, or a task
on the channel's loop) while calls go to the others; a replica that comes back is picked
again once its negotiation succeeds. When a connection to an address fails, a DNS target
is resolved again (rate-limited by the resolver). When no subchannel is ready, the call
goes to the channel's own gRPC channel, where grpc balances it (and waits for a ready
replica if the call asks to).

Both front ends use this class; only how a negotiation runs differs (``connect`` blocks,
``connect_async`` awaits).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
import weakref
from typing import Any, Callable, Optional

from .. import _config, _status
from .subchannel import Subchannel
from .target import Resolver

__all__ = ["Balancer"]


class Balancer:
    def __init__(self, resolver: Resolver, make_grpc: Callable[[str], Any],
                 retire_grpc: Callable[[Any], None], cfg: _config.Config, credentials: Any,
                 grpc_options: Any, max_recv: int, secure: bool) -> None:
        self.resolver = resolver
        self.make_grpc = make_grpc     # a gRPC channel (of the front end's kind) to one address
        self._retire_grpc = retire_grpc  # closes one that is no longer wanted
        self.cfg = cfg
        self.credentials = credentials
        self.grpc_options = grpc_options
        self.max_recv = max_recv
        self.secure = secure
        self.closed = False
        self._subs: list[Subchannel] = []
        self._resolved = False
        self._lock = threading.Lock()  # subchannel list changes; background starts
        self._counter = itertools.count()
        self._busy: set[Subchannel] = set()  # negotiating in a background thread
        _BALANCERS.add(self)

    # ------------------------------------------------------------------ addresses
    def subchannels(self) -> list[Subchannel]:
        return self._subs

    def _update(self, addresses: list[str]) -> None:
        """The subchannels for `addresses`: kept where the address stays, new where it is
        new, let go where it is gone."""
        retired: list[Any] = []
        with self._lock:
            if self.closed:
                return
            self._resolved = True
            if not addresses or addresses == [s.address for s in self._subs]:
                return  # no address now: keep what there is (grpc keeps its last list)
            old = {s.address: s for s in self._subs}
            self._subs = [old.pop(a) if a in old else Subchannel(self, a) for a in addresses]
            for gone in old.values():
                grpc_channel = gone.let_go(_status.CHANNEL_CLOSED)
                if grpc_channel is not None:
                    retired.append(grpc_channel)
        for grpc_channel in retired:
            self._retire_grpc(grpc_channel)

    def resolve(self) -> None:
        if not self._resolved:
            self._update(self.resolver.resolve())

    async def resolve_async(self) -> None:
        if not self._resolved:
            # A DNS lookup blocks: not on the loop.
            addresses = self.resolver.resolve() if self.resolver.resolution.scheme != "dns" \
                else await asyncio.get_running_loop().run_in_executor(None, self.resolver.resolve)
            self._update(addresses)

    # ------------------------------------------------------------------ picking
    def pick(self) -> Optional[Subchannel]:
        """The next ready subchannel, or None when none is."""
        ready = [s for s in self._subs if s.ready()]
        if not ready:
            return None
        return ready[next(self._counter) % len(ready)]

    def settled(self, wait_for_ready: Optional[bool]) -> bool:
        """A call can be routed without negotiating first."""
        if self.closed:
            return True
        if not self._resolved:
            return False
        subs = self._subs
        if any(s.ready() for s in subs):
            return True
        return not any(s.due() or (wait_for_ready and s._negotiation_due(True)) for s in subs)

    def forced_error(self) -> str:
        """When every subchannel failed a forced transport, what calls fail with."""
        subs = self._subs
        if not subs or any(s.ready() for s in subs):
            return ""
        errors = [s.forced() for s in subs]
        return errors[0] if all(errors) else ""

    def transport(self) -> str:
        names = {s.transport() for s in self._subs if s.ready()}
        names.discard("grpc")
        return sorted(names)[0] if names else "grpc"

    def tried(self) -> bool:
        """Resolved, and some subchannel's negotiation has ended."""
        return self._resolved and any(not s.due() or s.ready() for s in self._subs)

    def grpc_channels(self) -> list[Any]:
        """The subchannels' gRPC channels made so far (this process's)."""
        return [c for s in self._subs if (c := s.made_grpc_channel()) is not None]

    def fallback_reason(self) -> str:
        if self.transport() != "grpc":
            return ""
        for s in self._subs:
            if text := s._fallback_text():
                return f"{s.address}: {text}"
        return "no address of the target negotiated a fast path yet"

    # ------------------------------------------------------------------ blocking front end
    def connect(self, timeout: Optional[float], wait_for_ready: Optional[bool]) -> None:
        """Negotiate every subchannel that is due, in parallel, for at most `timeout`."""
        self.resolve()
        wfr = bool(wait_for_ready)
        due = [s for s in self._subs if s.due() or (wfr and s._negotiation_due(True))]
        if len(due) == 1:
            due[0].connect(timeout, wfr)
            return
        threads = [threading.Thread(target=s.connect, args=(timeout, wfr), daemon=True,
                                    name="argrpc-negotiate") for s in due]
        for t in threads:
            t.start()
        limit = _config.LIMITS.negotiation_timeout_s if timeout is None else timeout
        end = time.monotonic() + limit
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))

    def refresh(self) -> None:
        """Negotiates in the background every subchannel that is due and not yet being
        negotiated (a call's thread only starts them)."""
        subs = self._subs
        if all(s.ready() for s in subs):
            return
        with self._lock:
            if self.closed:
                return
            start = [s for s in subs if s not in self._busy and s.due()]
            self._busy.update(start)
        for s in start:
            threading.Thread(target=self._reconnect, args=(s,), daemon=True,
                             name="argrpc-negotiate").start()

    def _reconnect(self, sub: Subchannel) -> None:
        """A subchannel negotiated again off the calls' path; if it is still not ready,
        the target is resolved again there too (the lookup may block)."""
        try:
            sub.connect(None, False)
            if not sub.ready():
                addresses = self.resolver.again()
                if addresses is not None:
                    self._update(addresses)
        finally:
            with self._lock:
                self._busy.discard(sub)

    # ------------------------------------------------------------------ asyncio front end
    async def connect_async(self, timeout: Optional[float],
                            wait_for_ready: Optional[bool]) -> None:
        await self.resolve_async()
        wfr = bool(wait_for_ready)
        tasks = [s.connect_async(timeout, wfr) for s in self._subs
                 if s.due() or (wfr and s._negotiation_due(True))]
        if tasks:
            limit = _config.LIMITS.negotiation_timeout_s if timeout is None else timeout
            await asyncio.wait(tasks, timeout=limit)

    def refresh_async(self) -> None:
        subs = self._subs
        if self.closed or all(s.ready() for s in subs):
            return
        started = False
        for s in subs:
            if s.due() and (s._task is None or s._task.done()):
                s.connect_async(None, False)
                started = True
        if started and self.resolver.resolution.scheme == "dns":
            loop = asyncio.get_running_loop()
            loop.run_in_executor(None, self.resolver.again).add_done_callback(
                self._resolved_again)

    def _resolved_again(self, done: "asyncio.Future[Optional[list[str]]]") -> None:
        if not done.cancelled() and done.exception() is None:
            addresses = done.result()
            if addresses is not None:
                self._update(addresses)

    # ------------------------------------------------------------------ end
    def close(self, why: str) -> list[Any]:
        """Every subchannel lets go of its connection (this channel's calls on it end
        CANCELLED `why`); returns their gRPC channels for the caller to close."""
        with self._lock:
            self.closed = True
            subs, self._subs = self._subs, []
        channels = []
        for s in subs:
            grpc_channel = s.let_go(why)
            if grpc_channel is not None:
                channels.append(grpc_channel)
        return channels

    def _after_fork_in_child(self) -> None:
        # A parent thread may have held a lock at fork(), and the threads negotiating
        # did not come along: the child starts with free locks and nothing under way.
        self._lock = threading.Lock()
        self._busy = set()
        for sub in self._subs:
            sub._lock = threading.Lock()
            sub._task = None


_BALANCERS: "weakref.WeakSet[Balancer]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for balancer in list(_BALANCERS):
        balancer._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
