"""The bridge between an asyncio event loop and the engine: one per loop.

The loop never waits inside the engine. Each fast-path call (and each asyncio server)
registers a callback under a token; the engine posts the token to this loop's
``_core.Notifier`` whenever the call's state changes, and the first post after a drain
makes the notifier's eventfd readable. The loop watches that fd (``add_reader``), drains
the tokens in one batch and runs their callbacks, which ask the calls without blocking.

Waking a sleeping loop through the fd costs a thread hand-off (the engine's progress
thread reads the peer, then wakes the loop), which the measurements in docs/design.md
price at tens of microseconds. So on loops built on a selector (asyncio's default loop)
the loop's own thread drives the engine for up to ``TF_RDMA_SPIN_US`` before it would
sleep, while it has calls in flight: an answer that arrives within that time is seen
without a hand-off, and a loop that found something goes on counting as polling until it
polls again or would sleep (``Notifier::poll``), so what its peers write meanwhile rings
no doorbell. On such loops a post made by the loop's own thread (its engine calls
ending a call, say) writes no eventfd either: the selector drains pending tokens before
every sleep. Loops without a selector (uvloop) get every completion through the fd.
"""

from __future__ import annotations

import asyncio
import selectors
import threading
import time
import weakref
from typing import Any, Callable, Optional

from .._engine import core_module

try:
    # The fields its calls read and count on every call, in C (aio_loop_state.cc).
    from .._core import LoopBridgeState
except ImportError:  # no engine: no fast-path call, and no bridge is made
    class LoopBridgeState:  # type: ignore[no-redef]
        pass

__all__ = ["LoopBridge", "bridge"]

_BRIDGES: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopBridge]" = \
    weakref.WeakKeyDictionary()
_BRIDGES_LOCK = threading.Lock()
# How long a loop busy with fast-path answers may go without asking its other file
# descriptors (sockets, pipes, the notifier's own fd) whether they are ready.
_LOOK_S = 50e-6


class LoopBridge(LoopBridgeState):
    """A loop's notifier and the callbacks of the calls it owns."""

    engine: Any
    notifier: Any
    ready: Any
    _callbacks: dict[int, Callable[[], None]]
    _next: int
    _inflight: int

    def __init__(self, loop: asyncio.AbstractEventLoop, engine: Any) -> None:
        core = core_module()
        # Weak: the loop holds this bridge (its reader callback), and _BRIDGES is keyed
        # by the loop weakly; a strong reference back would keep every loop ever used
        # (and its notifier's eventfd) alive.
        self._loop = weakref.ref(loop)
        self.engine = engine
        self.notifier = core.Notifier()
        self._callbacks = {}
        self._next = 1
        self._inflight = 0  # calls not ended, servers taking calls
        self._closed = False
        # asyncio's own loop keeps its ready callbacks in this one deque for its life;
        # other loops do not say (poll_if_idle).
        self.ready = getattr(loop, "_ready", None)
        loop.add_reader(self.notifier.fd, self.dispatch)
        self.polling = _install_poll(loop, self)
        if self.polling:
            # Made on the loop's thread (bridge() runs there); _PollingSelector looks at
            # `pending` before every sleep.
            self.notifier.look_before_sleeping()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop()
        if loop is None:
            raise RuntimeError("argrpc.aio: the event loop is gone")
        return loop

    def register(self, callback: Callable[[], None]) -> int:
        """A token for a call or server: `callback` runs on this loop after each change."""
        token = self._next
        self._next += 1
        self._callbacks[token] = callback
        return token

    def unregister(self, token: int) -> None:
        self._callbacks.pop(token, None)

    def started(self) -> None:
        """A call (or a server) whose answers this loop waits for."""
        self._inflight += 1

    def finished(self, token: int) -> None:
        """The call (or server) under `token` ended: its callback goes too."""
        self._callbacks.pop(token, None)
        self._inflight -= 1

    @property
    def busy(self) -> bool:
        """A call is in flight or a server takes calls: worth polling for."""
        return self._inflight > 0

    def dispatch(self) -> None:
        """The notifier's fd is readable: run the callbacks of what changed."""
        self.run(self.notifier.drain())

    def run(self, tokens: list[Any]) -> None:
        """The callbacks of the calls under `tokens`, which changed."""
        callbacks = self._callbacks
        for token in tokens:
            callback = callbacks.get(token)
            if callback is not None:
                callback()

    # poll(limit_s=None) is LoopBridgeState's (csrc/bindings/aio_loop_state.cc): drive the
    # engine briefly on the loop's thread and run the callbacks of what changed meanwhile;
    # True if anything did.

    def poll_if_idle(self) -> bool:
        """poll() if the loop has nothing ready to run: a coroutine about to wait for a
        call then polls for it right here instead of going round the loop (asyncio's
        own loop only: others do not say). True if anything changed."""
        ready = self.ready
        if ready is None or ready:
            return False
        return self.poll()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.notifier.end_lease()
        try:
            self.loop.remove_reader(self.notifier.fd)
        except Exception:  # noqa: BLE001 - the loop is already closed
            pass


def bridge(engine: Any) -> LoopBridge:
    """The running loop's bridge, made on first use."""
    loop = asyncio.get_running_loop()
    b = _BRIDGES.get(loop)
    if b is None or b._closed:
        with _BRIDGES_LOCK:
            b = _BRIDGES.get(loop)
            if b is None or b._closed:
                _forget_closed_loops()
                b = LoopBridge(loop, engine)
                _BRIDGES[loop] = b
    return b


def _forget_closed_loops() -> None:
    """Drops the bridges of closed loops. A loop that is gone takes its bridge along,
    but grpc.aio keeps every loop it ran on, closed or not; a closed loop's bridge
    would keep its notifier's eventfd open for good."""
    for loop, b in list(_BRIDGES.items()):
        if loop.is_closed():
            b.close()
            _BRIDGES.pop(loop, None)


class _PollingSelector(selectors.BaseSelector):
    """The loop's own selector, which first drives the engine when the loop would sleep
    with calls in flight (see the module docstring)."""

    def __init__(self, inner: selectors.BaseSelector, owner: LoopBridge) -> None:
        self._inner = inner
        self._owner = weakref.ref(owner)
        self._looked_at = 0.0  # when the inner selector was last asked (monotonic s)

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.modify(fileobj, events, data)

    def select(self, timeout: Optional[float] = None) -> list[Any]:
        owner = self._owner()
        if owner is not None:
            if owner.busy and (timeout is None or timeout > 0):
                if owner.poll(timeout):
                    # Callbacks ran. While they readied nothing (a handler answered at
                    # once, say) and no timer is due, the loop would only come back here:
                    # poll on instead. Otherwise what they readied runs first. The loop's
                    # other file descriptors are asked at most every _LOOK_S meanwhile,
                    # not on every round: a call's round trip is shorter than the system
                    # call.
                    ready = owner.ready
                    now = time.monotonic()
                    until = None if timeout is None else now + timeout
                    while True:
                        while not ready and now - self._looked_at < _LOOK_S and \
                                (until is None or now < until) and \
                                owner.poll(None if until is None else until - now):
                            now = time.monotonic()
                        if now - self._looked_at < _LOOK_S:
                            return []
                        self._looked_at = now
                        events = self._inner.select(0)
                        # A look that found nothing, with nothing ready and no timer
                        # due: a round of the loop would only come back here, at the
                        # cost of a round (its timers, its ready queue, this select).
                        # Poll on: a poll that finds nothing ends the stretch above.
                        if events or ready or (until is not None and now >= until):
                            return events
            elif owner.notifier.pending:
                # Posted by this thread's own engine calls, which write no eventfd
                # (Notifier::set_looker): drained here, before any sleep.
                owner.dispatch()
                timeout = 0
            if timeout is None or timeout > 0:
                # About to sleep: no longer on its way back to poll (Notifier::poll).
                owner.notifier.end_lease()
        self._looked_at = time.monotonic()
        return self._inner.select(timeout)

    def close(self) -> None:
        owner = self._owner()
        if owner is not None:
            owner.notifier.end_lease()
        self._inner.close()

    def get_key(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.get_key(fileobj)

    def get_map(self) -> Any:
        return self._inner.get_map()


def _install_poll(loop: asyncio.AbstractEventLoop, owner: LoopBridge) -> bool:
    """Put _PollingSelector in front of a selector loop's selector; False when the loop
    has none (uvloop, a proactor), which then relies on the fd alone."""
    inner = getattr(loop, "_selector", None)
    if not isinstance(loop, asyncio.selector_events.BaseSelectorEventLoop) or \
            not isinstance(inner, selectors.BaseSelector):
        return False
    if isinstance(inner, _PollingSelector):
        inner._owner = weakref.ref(owner)
        return True
    loop._selector = _PollingSelector(inner, owner)  # type: ignore[attr-defined]
    return True
