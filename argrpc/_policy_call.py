"""The engine call a threaded call gets when its method has a retry or hedging policy
and the call is not a blocking unary one (a unary ``future()``, a response stream): a
stand-in with the engine call's interface (``status``, ``done``, ``recv``,
``initial_metadata``, ``cancel``) under the usual call object, whose attempts a thread of
argrpc's makes (gRFC A6, the rules in ``_client.service_config``). An attempt decides the
call when it ends in a way that is not retried, or, for a response stream, when its first
message arrives (the call is committed then, and that attempt's stream is the call's).
Cancelling the call cancels the attempts running and starts no more.

A call with a request stream under a retry or hedging policy is fed like an engine call
(``send``, ``half_close``): each request goes to the attempts running and into a buffer
that a later attempt gets first, in order, before anything newer. Requests beyond
``grpc.per_rpc_retry_buffer_size`` commit the call to the attempts running (gRFC A6).
A hedged attempt whose response begins (headers with metadata, or a message of a
response stream) is the call's; the others are cancelled."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

import grpc

from . import _status
from ._grpc_payloads import nbytes
from ._client.service_config import Attempts, Hedge, response_began

__all__ = ["PolicyCore", "RequestBuffer"]

_POLL_S = 0.002  # how often hedged attempts are looked at (no engine wake-up here)

# start(extra metadata or None, timeout) -> an engine call (for a unary request, with the
# request sent and the requests closed), or None when there is no fast connection to
# start it on.
Start = Callable[[Optional[tuple[str, str]], Optional[float]], Any]


class RequestBuffer:
    """The requests of a call with a request stream, kept for its next attempt while they
    fit `limit` bytes; past it, the call is committed and they are kept no more."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._messages: list[Any] = []
        self._size = 0
        self.closed = False
        self.overflowed = False

    def add(self, payload: Any) -> None:
        if self.overflowed:
            return
        self._size += nbytes(payload)
        if self._size > self._limit:
            self.overflowed = True
            self._messages = []
        else:
            self._messages.append(payload)

    @property
    def messages(self) -> list[Any]:
        """What the call sent so far, for a new attempt, in order."""
        return self._messages

    def replay(self, core: Any) -> None:
        """What the call sent so far, to a new attempt."""
        for payload in self._messages:
            if not core.send(payload):
                return
        if self.closed:
            core.half_close()


class PolicyCore:
    def __init__(self, start: Start, deadline: Optional[float],
                 attempts: Optional[Attempts], hedge: Optional[Hedge],
                 streaming: bool = False, requests: Optional[RequestBuffer] = None) -> None:
        self._start = start
        # A request stream's: sends and a new attempt's replay take turns under it, so
        # every attempt gets the requests in order; never held by cancel().
        self._requests = requests
        self._send_lock = threading.Lock()
        self._deadline = deadline
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self._wake = threading.Event()  # a cancel: stop waiting between attempts
        self._live: list[Any] = []
        self._final: Any = None  # the engine call whose end is this call's
        self._cancel: Optional[tuple[int, str]] = None
        self._error = ""
        self._streaming = streaming
        self._first: Any = None  # a response stream's first message, read to commit
        drive = (lambda: self._retry(attempts)) if attempts is not None else \
            (lambda: self._hedge(hedge))
        threading.Thread(target=self._run, args=(drive,), daemon=True,
                         name="argrpc-attempts").start()

    # ------------------------------------------------------------------ attempts
    def _left(self) -> Optional[float]:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def _launch(self, extra: Optional[tuple[str, str]]) -> Any:
        """The next attempt's engine call, or None (cancelled, or it cannot start: the
        attempt before it is then the call's end)."""
        with self._send_lock:
            with self._lock:
                if self._cancel is not None:
                    return None
                requests = self._requests
                if requests is not None and requests.overflowed and self._live:
                    return None  # committed while it waited: what it sent is not kept
                try:
                    core = self._start(extra, self._left())
                except Exception:  # noqa: BLE001 - e.g. a forced transport now impossible
                    return None
                if core is not None:
                    self._live.append(core)
            if core is not None and self._requests is not None:
                self._requests.replay(core)
            return core

    def _run(self, drive: Callable[[], Any]) -> None:
        final = None
        try:
            final = drive()
        except Exception as e:  # noqa: BLE001 - the call ends with it, not the thread
            self._error = f"argrpc: retrying the call failed: {e}"
        finally:
            self._final = final
            self._ended.set()

    def _retry(self, attempts: Any) -> Any:
        core = None
        while True:
            extra = attempts.metadata([])
            nxt = self._launch(extra[0] if extra else None)
            if nxt is None:
                return core
            core = nxt
            if self._streaming:
                first = core.recv()  # a message commits the call to this attempt
                if first is not None:
                    self._first = first
                    return core
            code, _, trailing = core.status(None)
            committed = bool(core.initial_metadata()) or (
                self._requests is not None and self._requests.overflowed)
            delay = attempts.after(code, committed, trailing, time.monotonic())
            if delay is None or self._wake.wait(delay):
                return core

    def _hedge(self, hedge: Any) -> Any:
        try:
            while True:
                if hedge.start_now(time.monotonic()):
                    core = self._launch(hedge.previous())
                    if core is None:
                        if self._cancel is not None or hedge.not_started():
                            return hedge.last
                    else:
                        hedge.add(core)
                committed = self._begun(hedge)
                if committed is not None:
                    hedge.commit(committed)
                    return committed
                for core in hedge.newly_ended():
                    code, _, trailing = core.status(0)
                    if hedge.ended_with(code, trailing):
                        return core
                wait = hedge.wait_s(time.monotonic())
                if self._wake.wait(_POLL_S if wait is None else min(wait, _POLL_S)):
                    return hedge.last
        finally:
            hedge.cancel_rest(lambda core: core.cancel(_status.CANCELLED, "attempt overtaken"))

    def _begun(self, hedge: Any) -> Any:
        """A running attempt whose response began, or None. Looked at before the ends:
        an attempt that sent a message is the call's, however it ends."""
        for core in hedge.running():
            began, first = response_began(core, self._streaming)
            if first is not None:
                self._first = first
            if began:
                return core
        return None

    # ------------------------------------------------------------------ the engine call's face
    # `_ended` says the call is decided: its final attempt is chosen (and, but for a
    # committed response stream, over).
    def done(self) -> bool:
        if not self._ended.is_set():
            return False
        final = self._final
        return self._cancel is not None or final is None or final.done()

    def status(self, timeout: Optional[float]) -> Optional[tuple[Any, ...]]:
        start = time.monotonic()
        if not self._ended.wait(timeout):
            return None
        if self._cancel is not None:  # the call object recorded this end already
            return (self._cancel[0], self._cancel[1], [])
        if self._final is None:
            return (_status.UNAVAILABLE, self._error or "argrpc: no attempt could start", [])
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
        status = self._final.status(left)
        return None if status is None else tuple(status)

    def send(self, payload: Any) -> bool:
        """A request of the stream, to the attempt running and to the next one's."""
        requests = self._requests
        assert requests is not None
        with self._send_lock:
            requests.add(payload)
            with self._lock:
                live = [core for core in self._live if not core.done()]
            for core in live:
                core.send(payload)
        return not self.done()

    def half_close(self) -> bool:
        requests = self._requests
        assert requests is not None
        with self._send_lock:
            requests.closed = True
            with self._lock:
                live = [core for core in self._live if not core.done()]
            for core in live:
                core.half_close()
        return not self.done()

    def recv(self) -> Any:
        self._ended.wait()
        first, self._first = self._first, None
        if first is not None:
            return first
        return self._final.recv() if self._final is not None else None

    def initial_metadata(self) -> Any:
        self._ended.wait()
        return self._final.initial_metadata() if self._final is not None else []

    def cancel(self, code: int, details: str) -> bool:
        with self._lock:
            if self.done() or self._cancel is not None:
                return False
            self._cancel = (code, details)
            live = list(self._live)
        self._wake.set()
        for core in live:
            if not core.done():
                core.cancel(code, details)
        return True
