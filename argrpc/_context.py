"""ServicerContext for calls that arrive over the fast path (a `_core.ServerCall`).

Mirrors `grpc._server._Context`: same methods, same exceptions, same final-status rules.
The state of one call lives in `_CallState`, shared by the context (user code), the
handler runner (`_handlers.py`) and the server (cancellation watcher, stop()).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, NoReturn, Optional, Sequence

import grpc

from . import _grpc_log, _metadata, _status

if TYPE_CHECKING:
    from ._core import ServerCall

_LOGGER = _grpc_log.SERVER

MetadataType = Sequence[tuple[str, Any]]

# Guards every call's callbacks (see _CallState).
_CALLBACKS = threading.Lock()

# grpc reports INT64_MAX seconds as the deadline of a call that has none.
_INFINITE_DEADLINE = float(2**63 - 1)


class AbortError(Exception):
    """Raised by `context.abort()`; grpc raises a bare `Exception` there, so user code
    that catches `Exception` behaves the same with both servers."""


try:
    # The fields in C (csrc/bindings/server_serve.cc): made without a Python frame, and
    # read and set there by the planned call's one crossing.
    from ._core import ThreadedCallState
except ImportError:  # no engine: no fast-path call, and no call state is made
    class ThreadedCallState:  # type: ignore[no-redef]
        def __init__(self, sc: Any, method: str) -> None:
            self.sc, self.method = sc, method
            self.code = self.details = self.trailing_metadata = None
            self.aborted = self.initial_metadata_sent = self.finished = False
            self.rpc_errors = ()
            self.callbacks: Optional[Sequence[Callable[[], None]]] = ()
            self.detached = False
            self._invocation_metadata = None

        def add_callback(self, callback: Callable[[], None]) -> bool:
            with _CALLBACKS:
                if self.callbacks is None:
                    return False
                self.callbacks = (*self.callbacks, callback)
                return True

        def take_callbacks(self) -> Optional[Sequence[Callable[[], None]]]:
            with _CALLBACKS:
                callbacks, self.callbacks = self.callbacks, None
            return callbacks


class _CallState(ThreadedCallState):
    """Everything the handler may change about the outcome of one call.

    Made once per call on the hot path, so it holds no lock and no list of its own until
    a call needs one: the callbacks of every call share one lock (they are rare and run
    briefly under it), and the lists start as empty tuples. Made as
    `_CallState(sc, method)`; every other field starts as below."""

    __slots__ = ()

    sc: ServerCall
    method: str
    code: Optional[grpc.StatusCode]  # None
    details: Optional[str]  # None
    trailing_metadata: Optional[MetadataType]  # None
    aborted: bool  # False
    initial_metadata_sent: bool  # False
    # True once a status went out (or the call was given up): nothing else is sent.
    finished: bool  # False
    # RpcErrors we raised into user code because the call died; a handler that lets one
    # escape must not be reported as an application exception. ()
    rpc_errors: Sequence[BaseException]
    # None once the callbacks have been taken (run): add_callback then returns False.
    # The worker (normal finish), the cancellation watcher and stop() may all try to run
    # them; _CALLBACKS makes that happen exactly once. ()
    callbacks: Optional[Sequence[Callable[[], None]]]
    # The call goes on after its handler returned (a non-blocking handler). False
    detached: bool
    _invocation_metadata: Optional[tuple[Any, ...]]  # None

    def invocation_metadata(self) -> tuple[Any, ...]:
        # Converted lazily: the registered-method hot path never looks at it.
        md = self._invocation_metadata
        if md is None:
            md = self._invocation_metadata = _metadata.from_core(self.sc.metadata)
        return md

    def raise_rpc_error(self) -> None:
        error = grpc.RpcError()
        self.rpc_errors = (*self.rpc_errors, error)
        raise error

    def run_callbacks(self) -> None:
        callbacks = self.take_callbacks()
        if not callbacks:
            return
        for callback in callbacks:
            try:
                callback()
            except Exception:  # user callback: report, keep going (as grpc does)
                _LOGGER.exception("Exception calling callback!")


class FastPathPeer:
    """What a fast-path call's context says of its peer, for both APIs: what grpc said of
    the gRPC call that negotiated the connection (its address, its auth context), since
    the connection belongs to that very client."""

    _state: Any

    def peer(self) -> str:
        peer: str = self._state.sc.peer  # each API's call state has its ServerCall as sc
        return peer

    @property
    def transport(self) -> str:
        """argrpc's own: the fast transport serving the call ("shm", "verbs"). A call
        served by plain gRPC has grpc's context, without it:
        `getattr(context, "transport", "grpc")` reads every call."""
        transport: str = self._state.sc.transport
        return transport

    @property
    def transport_peer(self) -> str:
        """argrpc's own: the fabric's name of the client's end, as argrpc's logs give it
        ("shm:pid=1234", "verbs:rxe0:1 ::ffff:10.0.0.2 (RoCEv2) pid 1234")."""
        name: str = self._state.sc.peer_name
        return name

    def peer_identities(self) -> Optional[Sequence[bytes]]:
        key = self._state.sc.identity_key
        identities: Optional[Sequence[bytes]] = self._state.sc.auth.get(key) if key else None
        return identities

    def peer_identity_key(self) -> Optional[str]:
        key: Optional[str] = self._state.sc.identity_key
        return key

    def auth_context(self) -> Mapping[str, Sequence[bytes]]:
        auth: Mapping[str, Sequence[bytes]] = self._state.sc.auth
        return auth


# ignore: grpc's stubs type auth_context's values as bytes; grpc (and FastPathPeer) give
# sequences of bytes
class _ServicerContext(FastPathPeer, grpc.ServicerContext):  # type: ignore[misc]
    __slots__ = ("_state",)
    _state: _CallState

    def __init__(self, state: _CallState) -> None:
        self._state = state

    # --- RpcContext -----------------------------------------------------------------
    def is_active(self) -> bool:
        return self._state.sc.is_active()

    def time_remaining(self) -> float:
        remaining = self._state.sc.time_remaining()
        if remaining is None:
            # grpc's "no deadline" is an infinite-future deadline, not None: user code
            # that compares the result must keep working.
            return _INFINITE_DEADLINE - time.time()
        return max(remaining, 0.0)

    # None, as grpc's servicer context returns (its stubs say bool)
    def cancel(self) -> None:  # type: ignore[override]
        self._state.sc.cancel()

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return self._state.add_callback(callback)

    # --- ServicerContext ------------------------------------------------------------
    def invocation_metadata(self) -> tuple[Any, ...]:
        return self._state.invocation_metadata()

    def set_compression(self, compression: grpc.Compression) -> None:
        # Shared memory is not compressed; accepted so servicers written for grpc run.
        pass

    def disable_next_message_compression(self) -> None:
        pass

    def send_initial_metadata(self, initial_metadata: MetadataType) -> None:
        state = self._state
        if state.sc.cancelled:
            state.raise_rpc_error()
        if state.initial_metadata_sent or state.finished:
            raise ValueError("Initial metadata no longer allowed!")
        state.initial_metadata_sent = True
        try:
            md = _metadata.to_core(initial_metadata)
        except (ValueError, TypeError) as exc:
            # grpc does not raise here: its core fails the call with INTERNAL.
            _LOGGER.error("invalid initial metadata: %s", exc)
            state.finished = True
            state.sc.finish(_status.INTERNAL, _status.INVALID_METADATA, [], None)
            return
        state.sc.send_initial_metadata(md)

    def set_trailing_metadata(self, trailing_metadata: MetadataType) -> None:
        self._state.trailing_metadata = trailing_metadata

    # what was set, None before, as grpc's context answers (its stubs say a tuple)
    def trailing_metadata(self) -> Optional[MetadataType]:  # type: ignore[override]
        return self._state.trailing_metadata

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        # grpc treats abort(OK) as an application error: the call fails with UNKNOWN.
        if code == grpc.StatusCode.OK:
            _LOGGER.error("abort() called with StatusCode.OK; returning UNKNOWN")
            code = grpc.StatusCode.UNKNOWN
            details = ""
        state = self._state
        state.code = code
        state.details = _text(details)
        state.aborted = True
        raise AbortError()

    def abort_with_status(self, status: grpc.Status) -> NoReturn:
        self._state.trailing_metadata = status.trailing_metadata
        self.abort(status.code, status.details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._state.code = code

    def code(self) -> Optional[grpc.StatusCode]:
        return self._state.code

    def set_details(self, details: str) -> None:
        self._state.details = _text(details)

    def details(self) -> Optional[bytes]:
        # grpc hands back the encoded form.
        details = self._state.details
        return None if details is None else details.encode("utf-8")


def _text(details: Any) -> str:
    if details is None:
        return ""
    if isinstance(details, bytes):
        return details.decode("utf-8", "replace")
    return str(details)
