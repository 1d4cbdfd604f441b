"""Client multicallables and call objects.

Every multicallable decides per call (after the channel negotiated) whether the call
goes over the fast path's ``_core.Connection`` (shm or verbs) or to the real grpc
multicallable it wraps. On the fast path:

* blocking unary-unary is one ``conn.unary(...)``: no thread, queue or lock (every Python
  hand-off costs 15-100 us here: docs/design.md, "What measurements ... say");
* everything else uses a ``_core.ClientCall`` wrapped in ``_Call``, which is an iterator,
  a ``grpc.Call`` and a ``grpc.Future`` like grpc's ``_MultiThreadedRendezvous``. Waits
  happen inside the engine with the GIL released.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
import types
from typing import Any, Callable, Iterator, Optional, cast

import grpc

from . import _grpc_log, _metrics_hooks, _status
from ._grpc_payloads import nbytes as _nbytes
from ._bases import (FutureBase, StreamStreamBase, StreamUnaryBase, UnaryStreamBase,
                     UnaryUnaryBase)
from ._client.call_site import CallSite
from ._client.service_config import Attempts, Hedge
from ._policy_call import PolicyCore, RequestBuffer
from ._config import LIMITS
from ._errors import (USER_CODE_FAILED, DoneFuture, _RpcError, code_from_int, codec_failed,
                      local_error, received_too_large, rpc_state_string, status_error,
                      user_codec)
from ._metadata import InvalidMetadataError, from_core, to_core

__all__ = ["DoneWatcher", "RequestFeeder", "StreamStream", "StreamUnary", "UnaryStream", "UnaryUnary"]

_LOGGER = _grpc_log.CHANNEL

_OK = grpc.StatusCode.OK
_CANCELLED = grpc.StatusCode.CANCELLED
_UNKNOWN = grpc.StatusCode.UNKNOWN
_INTERNAL = grpc.StatusCode.INTERNAL
_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED

_SERIALIZE_FAILED = "Exception serializing request!"
_DESERIALIZE_FAILED = "Exception deserializing response!"
_ITERATE_FAILED = "Exception iterating requests!"
_GC_CANCEL = "Cancelled upon garbage collection!"


def _too_large(n: int, limit: int) -> _RpcError:
    details = f"CLIENT: Sent message larger than max ({n} vs. {limit})"
    return local_error(_RESOURCE_EXHAUSTED, details, f"RESOURCE_EXHAUSTED:{details}")


def _core_metadata(metadata: Any) -> list[Any]:
    try:
        md = to_core(metadata)
        # grpc drops a call's own user-agent: the server sees the channel's (on the fast
        # path, the one sent when the connection was negotiated).
        return [kv for kv in md if kv[0] != "user-agent"] if md else md
    except InvalidMetadataError as e:
        _LOGGER.error("%s", e)
        raise local_error(_INTERNAL, _status.INVALID_METADATA, "") from None


def _deadline(timeout: Optional[float]) -> Optional[float]:
    return None if timeout is None else time.time() + timeout


def _closed_by_us(channel: CallSite, code: int) -> bool:
    # conn.close() ends the calls of the connection (UNAVAILABLE per core-api.md, CANCELLED
    # in the current engine); when it was our close(), grpc's answer is CANCELLED.
    return (code == _status.UNAVAILABLE or code == _status.CANCELLED) and channel._closed


def _map_status(channel: CallSite, code: int, details: str) -> tuple[grpc.StatusCode, str]:
    if _closed_by_us(channel, code) and details != _status.LOCALLY_CANCELLED:
        return _CANCELLED, _status.CHANNEL_CLOSED
    return code_from_int(code, details)


def _status_exception(channel: CallSite, code: int, details: str, imd: Any, tmd: Any) -> _RpcError:
    if _closed_by_us(channel, code):
        return local_error(_CANCELLED, _status.CHANNEL_CLOSED,
                           f"CANCELLED:{_status.CHANNEL_CLOSED}")
    return status_error(code, details, imd, tmd)


class _CompletedCall(DoneFuture, grpc.Call):
    """The ``grpc.Call`` that ``with_call`` returns next to an OK response. Its details
    and debug string are empty whatever the handler set, as grpc's are for OK."""

    __slots__ = ("_imd", "_tmd", "_response", "_deadline")

    def __init__(self, imd: Any, tmd: Any, response: Any, deadline: Optional[float]) -> None:
        self._imd = imd  # engine form; converted on first access (usually never)
        self._tmd = tmd
        self._response = response
        self._deadline = deadline

    def initial_metadata(self) -> tuple[Any, ...]:
        if not isinstance(self._imd, tuple):
            self._imd = from_core(self._imd)
        return self._imd

    def trailing_metadata(self) -> tuple[Any, ...]:
        if not isinstance(self._tmd, tuple):
            self._tmd = from_core(self._tmd)
        return self._tmd

    def code(self) -> grpc.StatusCode:
        return _OK

    def details(self) -> str:
        return ""

    def debug_error_string(self) -> Optional[str]:
        return ""

    # None without a deadline, as grpc's calls answer (its stubs say float)
    def time_remaining(self) -> Optional[float]:  # type: ignore[override]
        if self._deadline is None:
            return None
        return max(self._deadline - time.time(), 0)

    def result(self, timeout: Optional[float] = None) -> Any:
        return self._response

    def exception(self, timeout: Optional[float] = None) -> None:
        return None

    def traceback(self, timeout: Optional[float] = None) -> None:
        return None

    def __repr__(self) -> str:
        return rpc_state_string("_MultiThreadedRendezvous", _OK, "", None)

    __str__ = __repr__


class DoneWatcher:
    """One lazily started daemon thread per channel that completes calls with callbacks.

    The engine has no completion callback and can wait on one call at a time, so the
    thread waits (GIL released) on the oldest watched call in short slices and polls the
    others with ``done()`` between slices. Only calls with pending callbacks are watched,
    so the hot paths never touch this.
    """

    _IDLE_EXIT_S = LIMITS.call_thread_idle_s

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._calls: list[_Call] = []
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def watch(self, call: "_Call") -> None:
        with self._cv:
            if call in self._calls:
                return
            self._calls.append(call)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="argrpc-callbacks",
                                                daemon=True)
                self._thread.start()
            self._cv.notify()

    def close(self, timeout: float = 2.0) -> None:
        with self._cv:
            self._closed = True
            thread = self._thread
            self._cv.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._calls:
                    if self._closed:
                        self._thread = None
                        return
                    if not self._cv.wait(self._IDLE_EXIT_S) and not self._calls:
                        self._thread = None
                        return
                calls = list(self._calls)
            finished = [c for c in calls if c._poll()]
            if finished:
                with self._cv:
                    self._calls = [c for c in self._calls if c not in finished]
                continue
            # Waiting in the engine on one call wakes us the moment it ends; the slice
            # bounds how late the others (and newly watched calls) are noticed.
            calls[0]._core.status(0.005 if len(calls) == 1 else 0.001)


class _Call(grpc.RpcError, grpc.Call, FutureBase):
    """A fast-path call in progress: iterator + ``grpc.Call`` + ``grpc.Future``."""

    max_response = -1  # the method's maxResponseMessageBytes (-1: the connection's limit)

    def __init__(self, channel: CallSite, core: Any, deserializer: Optional[Callable[..., Any]],
                 unary_response: bool, deadline: Optional[float]) -> None:
        super().__init__()
        self._channel = channel
        self._core = core
        self._deser = deserializer
        self._unary = unary_response
        self._deadline = deadline
        self._lock = threading.Lock()
        self._code: Optional[grpc.StatusCode] = None
        self._details: Optional[str] = None
        self._debug: Optional[str] = None
        self._imd: Optional[tuple[Any, ...]] = None
        self._tmd: Optional[tuple[Any, ...]] = None
        self._response: Any = None
        self._cancelled = False
        self._callbacks: Optional[list[Callable[[], None]]] = []
        # Set by the request-consumer thread when it ends the call itself, so the status
        # is grpc's even if the engine reports its cancel differently.
        self.override: list[Any] = [None]

    # ------------------------------------------------------------------ completion
    def _complete(self, status: tuple[Any, ...]) -> None:
        """Record the engine's final status (once) and run callbacks."""
        with self._lock:
            if self._code is not None:
                return
            code_int, details, tmd = status
            override = self.override[0]
            if override is not None:
                code, details = override
                self._debug = None
                self._tmd = ()
            else:
                code, details = _map_status(self._channel, code_int, details)
                # grpc reports no details and an empty debug string for OK, whatever
                # the handler set.
                if code is _OK:
                    details, self._debug = "", ""
                else:
                    self._debug = f"{code.name}:{details}"
                self._tmd = from_core(tmd)
            if code is _OK and self._unary:
                message = self._core.recv()  # buffered: the call has ended
                if message is not None and (too_large := self._too_large(message)):
                    code, details, self._debug, message = _RESOURCE_EXHAUSTED, too_large, \
                        None, None
                if message is not None and self._deser is not None:
                    message = user_codec(self._deser, message, "deserializing")
                    if message is USER_CODE_FAILED:
                        code, details, self._debug = _INTERNAL, _DESERIALIZE_FAILED, None
                        message = None
                self._response = message
            self._code = code
            self._details = details
            callbacks, self._callbacks = self._callbacks, None
        self._run_callbacks(callbacks)

    def _complete_locally(self, code: grpc.StatusCode, details: str, cancelled: bool,
                          force: bool = False) -> bool:
        """End the call here with our own status (engine call already cancelled).

        ``force`` replaces an OK status too: a response that cannot be deserialized is an
        error even when the stream had already ended well.
        """
        with self._lock:
            if self._code is not None:
                if force and self._code is _OK:
                    self._code, self._details, self._debug = code, details, None
                return False
            self._code, self._details, self._debug = code, details, None
            self._tmd = ()
            self._cancelled = cancelled
            callbacks, self._callbacks = self._callbacks, None
        self._run_callbacks(callbacks)
        return True

    @staticmethod
    def _run_callbacks(callbacks: Optional[list[Any]]) -> None:
        for callback in callbacks or ():
            try:
                callback()
            except Exception as e:  # noqa: BLE001 - grpc logs and goes on
                _LOGGER.error("Exception in callback %r: %r", callback, e)

    def _poll(self) -> bool:
        """True if the call ended (completing it if the engine says so)."""
        if self._code is not None:
            return True
        if self._core.done():
            status = self._core.status(0)
            if status is not None:
                self._complete(status)
                return True
        return False

    def _wait(self, timeout: Optional[float]) -> bool:
        if self._code is not None:
            return True
        status = self._core.status(timeout)
        if status is None:
            return self._code is not None
        self._complete(status)
        return True

    def _error(self) -> _RpcError:
        # only once the call ended: code and details are set
        return _RpcError(cast(grpc.StatusCode, self._code), cast(str, self._details),
                         self.initial_metadata(),
                         self._tmd or (), self._debug)

    # ------------------------------------------------------------------ grpc.Call
    def initial_metadata(self) -> tuple[Any, ...]:
        imd = self._imd
        if imd is None:
            raw = self._core.initial_metadata()  # waits for headers or the end
            imd = self._imd = from_core(raw) if raw is not None else ()
        return imd

    # _wait(None) returns once the call ended, which sets trailers, code and details
    def trailing_metadata(self) -> tuple[Any, ...]:
        self._wait(None)
        return cast("tuple[Any, ...]", self._tmd)

    def code(self) -> grpc.StatusCode:
        self._wait(None)
        return cast(grpc.StatusCode, self._code)

    def details(self) -> str:
        self._wait(None)
        return cast(str, self._details)

    def debug_error_string(self) -> Optional[str]:
        self._wait(None)
        return self._debug

    # ------------------------------------------------------------------ grpc.RpcContext
    def is_active(self) -> bool:
        return not self._poll()

    # None without a deadline, as grpc's calls answer (its stubs say float)
    def time_remaining(self) -> Optional[float]:  # type: ignore[override]
        if self._deadline is None:
            return None
        return max(self._deadline - time.time(), 0)

    def cancel(self) -> bool:
        if self._code is not None:
            return False
        # The engine cancel happens under our lock so the callback thread, which may see
        # the engine call end at once, cannot record it as an ordinary end first.
        with self._lock:
            if self._code is not None:
                return False
            if self._core.cancel(_CANCELLED.value[0], _status.LOCALLY_CANCELLED):
                self._code, self._details, self._debug = _CANCELLED, _status.LOCALLY_CANCELLED, None
                self._tmd = ()
                self._cancelled = True
                callbacks, self._callbacks = self._callbacks, None
            else:
                callbacks = None
        if callbacks is None:
            self._poll()  # it had ended on its own
            return False
        self._run_callbacks(callbacks)
        return True

    def _add(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self._callbacks is None:
                return False
            self._callbacks.append(callback)
        self._channel._watcher.watch(self)
        return True

    def add_callback(self, callback: Callable[[], None]) -> bool:
        self._poll()
        return self._add(callback)

    # ------------------------------------------------------------------ grpc.Future
    def cancelled(self) -> bool:
        return self._cancelled

    def running(self) -> bool:
        return not self._poll()

    def done(self) -> bool:
        return self._poll()

    def result(self, timeout: Optional[float] = None) -> Any:
        if not self._wait(timeout):
            raise grpc.FutureTimeoutError()
        if self._code is _OK:
            return self._response
        if self._cancelled:
            raise grpc.FutureCancelledError()
        raise self

    def exception(self, timeout: Optional[float] = None) -> Optional[Exception]:
        if not self._wait(timeout):
            raise grpc.FutureTimeoutError()
        if self._code is _OK:
            return None
        if self._cancelled:
            raise grpc.FutureCancelledError()
        return self

    def traceback(self, timeout: Optional[float] = None) -> Optional[types.TracebackType]:
        if not self._wait(timeout):
            raise grpc.FutureTimeoutError()
        if self._code is _OK:
            return None
        if self._cancelled:
            raise grpc.FutureCancelledError()
        try:
            raise self
        except grpc.RpcError:
            return sys.exc_info()[2]

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        if not self._poll() and self._add(functools.partial(fn, self)):
            return
        fn(self)

    # ------------------------------------------------------------------ iterator
    def __iter__(self) -> "_Call":
        return self

    def __next__(self) -> Any:
        return self._next()

    def next(self) -> Any:
        return self._next()

    def _next(self) -> Any:
        code = self._code
        if code is not None and code is not _OK:
            raise self
        message = self._core.recv()  # GIL released while waiting
        if message is None:
            self._wait(None)
            if self._code is _OK:
                raise StopIteration()
            raise self
        if too_large := self._too_large(message):
            self._core.cancel(_RESOURCE_EXHAUSTED.value[0], too_large)
            self._complete_locally(_RESOURCE_EXHAUSTED, too_large, cancelled=False, force=True)
            raise self
        if self._deser is None:
            return message
        message = user_codec(self._deser, message, "deserializing")
        if message is not USER_CODE_FAILED:
            return message
        self._core.cancel(_INTERNAL.value[0], _DESERIALIZE_FAILED)
        self._complete_locally(_INTERNAL, _DESERIALIZE_FAILED, cancelled=False, force=True)
        raise self

    def _too_large(self, message: Any) -> str:
        """grpc's words for a response over the method's limit ("" when within)."""
        limit = self.max_response
        if limit < 0 or (n := _nbytes(message)) <= limit:
            return ""
        return received_too_large(n, limit)

    # ------------------------------------------------------------------ misc
    def __repr__(self) -> str:
        return rpc_state_string("_MultiThreadedRendezvous", self._code, self._details,
                                self._debug)

    __str__ = __repr__

    def __del__(self) -> None:
        # grpc cancels an abandoned call so the server stops producing for nobody.
        try:
            if self._code is None and not self._core.done():
                self._core.cancel(_CANCELLED.value[0], _GC_CANCEL)
        except Exception:  # noqa: BLE001 - interpreter shutdown, engine gone...
            pass


class RequestFeeder:
    """The daemon thread that feeds a call's request iterator into it, and whether it is
    in the user's code (the iterator, the serializer) or in argrpc's right now: a closing
    channel waits for the second kind only, which end as soon as their call has."""

    __slots__ = ("thread", "in_user_code")

    def __init__(self, run: Callable[["RequestFeeder"], None]) -> None:
        self.in_user_code = False
        self.thread = threading.Thread(target=run, args=(self,), name="argrpc-requests",
                                       daemon=True)


def _consume_requests(core: Any, request_iterator: Any, serializer: Optional[Callable[..., Any]],
                      max_send: int, override: list[Any], feeders: set[RequestFeeder]) -> None:
    """Feed the request iterator into the call on a daemon thread, then half-close.

    The thread holds the engine call and the override slot, not the ``_Call``, so an
    abandoned ``_Call`` can still be garbage-collected (and cancelled).
    """

    def fail(code: grpc.StatusCode, details: str) -> None:
        override[0] = (code, details)
        if not core.cancel(code.value[0], details):
            override[0] = None  # the call had already ended: its own status stands

    def run(feeder: RequestFeeder) -> None:
        feeder.in_user_code = True
        try:
            iterator = iter(request_iterator)
        except Exception:  # noqa: BLE001
            feeder.in_user_code = False
            _LOGGER.exception(_ITERATE_FAILED)
            fail(_UNKNOWN, _ITERATE_FAILED)
            return
        while True:
            feeder.in_user_code = True
            try:
                request = next(iterator)
                payload = request if serializer is None else user_codec(serializer, request,
                                                                         "serializing")
            except StopIteration:
                break
            except Exception:  # noqa: BLE001 - user code
                feeder.in_user_code = False
                _LOGGER.exception(_ITERATE_FAILED)
                fail(_UNKNOWN, _ITERATE_FAILED)
                return
            feeder.in_user_code = False
            if core.done():
                return
            if payload is USER_CODE_FAILED:
                fail(_INTERNAL, _SERIALIZE_FAILED)
                return
            if max_send >= 0:
                n = _nbytes(payload)
                if n > max_send:
                    err = _too_large(n, max_send)
                    fail(err.code(), err.details())
                    return
            if not core.send(payload):
                return
        feeder.in_user_code = False
        core.half_close()

    def main(feeder: RequestFeeder) -> None:
        try:
            run(feeder)
        finally:
            feeders.discard(feeder)

    feeder = RequestFeeder(main)
    feeders.add(feeder)  # so Channel.close() can wait for those in argrpc's code
    feeder.thread.start()


try:
    from ._core import MultiCallableState
except ImportError:  # no engine: no fast path, every call is grpc's
    class MultiCallableState:  # type: ignore[no-redef]
        __slots__ = ("_channel", "_method", "_ser", "_deser", "_grpc", "_max_send",
                     "_raw_send", "_registered", "_mc")

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self._call_general(*args, **kwargs)  # type: ignore[attr-defined]


class _MultiCallable(MultiCallableState):
    """The fields every multicallable reads, in a C base (_core.MultiCallableState) whose
    __call__ makes a unary-unary call in C (UnaryUnary); the other kinds define their own."""

    __slots__ = ()
    _kind = ""

    def __init__(self, channel: CallSite, method: str, serializer: Optional[Callable[..., Any]],
                 deserializer: Optional[Callable[..., Any]], grpc_callable: Any,
                 registered: Any = False) -> None:
        self._channel = channel
        self._method = method.decode("ascii") if isinstance(method, bytes) else method
        self._ser = serializer
        self._deser = deserializer
        self._grpc = grpc_callable
        self._registered = registered
        # The method's service config; None when it has none (the common, fastest case).
        mc = channel._service_config.method(self._method)
        self._mc = mc or None
        self._max_send = channel._max_send
        if mc.max_request is not None:
            self._max_send = mc.max_request if self._max_send < 0 else \
                min(self._max_send, mc.max_request)
        # No serializer and no send limit: the request object goes to the engine as is.
        self._raw_send = serializer is None and self._max_send < 0

    def _serialize(self, request: Any) -> Any:
        payload = request if self._ser is None else user_codec(self._ser, request, "serializing")
        if payload is USER_CODE_FAILED:
            raise local_error(_INTERNAL, _SERIALIZE_FAILED)
        if self._max_send >= 0:
            n = _nbytes(payload)
            if n > self._max_send:
                raise _too_large(n, self._max_send)
        return payload

    def _routed(self, how: str, arg: Any, timeout: Optional[float],
                metadata: Any, credentials: Optional[grpc.CallCredentials],
                wait_for_ready: Optional[bool],
                compression: Optional[grpc.Compression]) -> tuple[Any, Optional[float], Any]:
        """Where a call goes: ``(conn, timeout, None)`` for the fast path, or
        ``(None, None, result)`` with what grpc's own multicallable returned for it
        (called as is when `how` is "", else its `how` method: "with_call", "future")."""
        channel = self._channel
        mc = self._mc
        if mc is not None:
            timeout, wait_for_ready = mc.call_options(timeout, wait_for_ready)
        conn, timeout, via = channel._route(timeout, wait_for_ready, credentials)
        if conn is not None:
            if compression is not None and (refused := via._refused_compression(compression)):
                raise local_error(grpc.StatusCode.UNIMPLEMENTED, refused)
            return conn, timeout, None
        multicallable = self._grpc if via is channel else via.multicallable(
            self._kind, self._method, self._ser, self._deser, self._registered)
        grpc_fn = getattr(multicallable, how) if how else multicallable
        observer = _metrics_hooks.sink()
        if observer is not None:
            return None, None, _metrics_hooks.timed_grpc_call(
                observer, self._method, self._channel._target, grpc_fn, arg, timeout=timeout,
                metadata=metadata, credentials=credentials, wait_for_ready=wait_for_ready,
                compression=compression)
        return None, None, grpc_fn(arg, timeout=timeout, metadata=metadata,
                                   credentials=credentials, wait_for_ready=wait_for_ready,
                                   compression=compression)

    def _call_object(self, how: str, arg: Any, unary_request: bool,
                     unary_response: bool, timeout: Optional[float], metadata: Any,
                     credentials: Optional[grpc.CallCredentials],
                     wait_for_ready: Optional[bool],
                     compression: Optional[grpc.Compression]) -> Any:
        """A call object (future or response iterator): grpc's own on a gRPC channel;
        a routing failure comes back as the finished call, as grpc returns it."""
        try:
            conn, timeout, result = self._routed(how, arg, timeout, metadata, credentials,
                                                 wait_for_ready, compression)
        except _RpcError as e:
            return e
        if conn is None:
            return result
        payload = self._serialize(arg) if unary_request else None
        try:
            call, result = self._started(how, conn, arg, timeout, metadata, credentials,
                                         wait_for_ready, compression, unary_response)
        except _RpcError as e:
            return e
        if call is None:
            return result
        if unary_request:
            call._core.send(payload)  # False means it already ended: the status says why
            call._core.half_close()
            return call
        return self._feed(call, arg)

    def _start(self, conn: Any, metadata: Any, timeout: Optional[float],
               unary_response: bool) -> _Call:
        call = self._try_start(conn, metadata, timeout, unary_response, False)
        assert call is not None
        return call

    def _try_start(self, conn: Any, metadata: Any, timeout: Optional[float],
                   unary_response: bool, retry_unsent: bool) -> Optional[_Call]:
        """The call started on `conn`; None if it never left the process and may start
        again elsewhere (`retry_unsent`)."""
        if timeout is not None and timeout < 0:
            timeout = 0.0  # grpc: already expired; the engine reads negative as "none"
        core = conn.start_call(self._method, _core_metadata(metadata), timeout, retry_unsent)
        if core is None:
            return None
        return self._limited(_Call(self._channel, core, self._deser, unary_response,
                                   _deadline(timeout)))

    def _started(self, how: str, conn: Any, arg: Any, timeout: Optional[float],
                 metadata: Any, credentials: Optional[grpc.CallCredentials],
                 wait_for_ready: Optional[bool], compression: Optional[grpc.Compression],
                 unary_response: bool) -> tuple[Optional[_Call], Any]:
        """The call started on the routed `conn`: ``(call, None)``. One that ended
        UNAVAILABLE without leaving the process (its connection failed after the channel
        chose it) starts again where the channel routes it now, as gRFC A6's transparent
        retries do; routed to grpc, it is ``(None, what grpc returned)``."""
        mc = self._mc
        if _has_policy(mc) and self._kind.startswith("stream"):
            core = self._policy_core(conn, None, metadata, timeout, mc, not unary_response)
            return self._limited(_Call(self._channel, core, self._deser, unary_response,
                                       _deadline(timeout))), None
        return self._sent(how, conn, arg, timeout, metadata, credentials, wait_for_ready,
                          compression, lambda c, t, retry: self._try_start(
                              c, metadata, t, unary_response, retry))

    def _sent(self, how: str, conn: Any, arg: Any, timeout: Optional[float], metadata: Any,
              credentials: Optional[grpc.CallCredentials], wait_for_ready: Optional[bool],
              compression: Optional[grpc.Compression],
              attempt: Callable[[Any, Optional[float], bool], Any],
              tries: Optional[int] = None) -> tuple[Any, Any]:
        """``(attempt(conn, timeout, retry_unsent), None)`` on the routed `conn`. An attempt
        that never left the process (None) starts again where the channel routes it now,
        as gRFC A6's transparent retries do, while the channel allows (`tries`: how many
        more; the channel's number by default); routed to grpc, it is ``(None, what grpc
        returned)``."""
        if tries is None:
            tries = self._channel._service_config.unsent_retries
        while True:
            done = attempt(conn, timeout, tries > 0)
            if done is not None:
                return done, None
            tries -= 1
            conn, timeout, result = self._routed(how, arg, timeout, metadata, credentials,
                                                 wait_for_ready, compression)
            if conn is None:
                return None, result

    def _limited(self, call: _Call) -> _Call:
        """The call with its method's response limit, if it has one."""
        mc = self._mc
        if mc is not None and mc.max_response is not None:
            call.max_response = mc.max_response
        return call

    def _with_policy(self, how: str, request: Any, timeout: Optional[float], metadata: Any,
                     credentials: Optional[grpc.CallCredentials],
                     wait_for_ready: Optional[bool], compression: Optional[grpc.Compression],
                     mc: Any, streaming: bool) -> Any:
        """A unary-request call object whose attempts follow the method's retry or
        hedging policy (a request too big to buffer makes one attempt)."""
        try:
            conn, timeout, result = self._routed(how, request, timeout, metadata,
                                                 credentials, wait_for_ready, compression)
        except _RpcError as e:
            return e
        if conn is None:
            return result
        return self._policy_call(conn, request, timeout, metadata, mc, streaming)

    def _policy_call(self, conn: Any, request: Any, timeout: Optional[float], metadata: Any,
                     mc: Any, streaming: bool) -> _Call:
        """The call object of a routed call under its method's retry or hedging policy."""
        payload = self._serialize(request)
        if not self._channel._service_config.buffers(payload):
            call = self._start(conn, metadata, timeout, not streaming)
            call._core.send(payload)
            call._core.half_close()
            return call
        core = self._policy_core(conn, payload, metadata, timeout, mc, streaming)
        return self._limited(_Call(self._channel, core, self._deser, not streaming,
                                   _deadline(timeout)))

    def _policy_core(self, conn: Any, payload: Any, metadata: Any, timeout: Optional[float],
                     mc: Any, streaming: bool) -> PolicyCore:
        """The stand-in engine call that makes the call's attempts under its policy; with
        `payload` None, a request stream's, fed as an engine call is."""
        channel = self._channel
        md = _core_metadata(metadata)
        deadline = None if timeout is None else time.monotonic() + timeout
        route = {"conn": conn, "attempts": 0}

        def start(extra: Optional[tuple[str, str]], left: Optional[float]) -> Any:
            if route["attempts"]:  # a later attempt goes where the channel routes now
                route["conn"] = channel._route(left, None)[0] or route["conn"]
            route["attempts"] += 1
            core = route["conn"].start_call(self._method, md + [extra] if extra else md, left)
            if payload is not None:
                core.send(payload)
                core.half_close()
            return core

        throttle = channel._throttle
        return PolicyCore(start, deadline,
                          Attempts(mc.retry, throttle, deadline) if mc.retry else None,
                          Hedge(mc.hedging, throttle, deadline) if mc.hedging else None,
                          streaming, None if payload is not None else
                          RequestBuffer(channel._service_config.buffer_limit))

    def _feed(self, call: _Call, request_iterator: Any) -> _Call:
        """Sends the requests of a started call from `request_iterator`."""
        _consume_requests(call._core, request_iterator, self._ser, self._max_send,
                          call.override, self._channel._feeders)
        return call


def _has_policy(mc: Any) -> bool:
    """Whether a method's config retries or hedges its calls."""
    return mc is not None and (mc.retry is not None or mc.hedging is not None)


def _ended(call: _Call) -> Any:
    """A blocking call's answer: the response, or the error grpc's blocking call raises."""
    if call.exception() is None:
        return call.result()
    raise call._error()


class UnaryUnary(_MultiCallable, UnaryUnaryBase):
    """Called in C (_core.MultiCallableState's __call__, first in the class's MRO): the
    common call (no metadata, credentials, compression or method config, no send limit,
    over a live fast connection) is made without a Python frame; every other goes to
    _call_general with the caller's arguments."""

    __slots__ = ()
    _kind = "unary_unary"
    # The C call's Python steps: a status or a codec failure made grpc's error.
    _status_error = staticmethod(_status_exception)

    @staticmethod
    def _codec_error(what: str, exc: Optional[BaseException]) -> _RpcError:
        """grpc's error for a codec that raised `exc` (logged) or gave None."""
        if exc is not None:
            codec_failed(what, exc)
        return local_error(_INTERNAL, _SERIALIZE_FAILED if what == "serializing"
                           else _DESERIALIZE_FAILED)

    def _call_general(self, request: Any, timeout: Optional[float] = None,
                      metadata: Any = None, credentials: Optional[grpc.CallCredentials] = None,
                      wait_for_ready: Optional[bool] = None,
                      compression: Optional[grpc.Compression] = None) -> Any:
        channel = self._channel
        conn = channel._fast
        if conn is not None and credentials is None and compression is None and \
                self._mc is None and conn.alive:
            # The common call with metadata or a send limit (the C call takes the rest).
            payload = request if self._raw_send else self._serialize(request)
            answer = self._blocking(conn, payload, timeout, metadata,
                                    channel._service_config.unsent_retries > 0)
            if answer is not None:
                return answer[0]
            return self._unsent_again(request, timeout, wait_for_ready, metadata)
        conn, timeout, result = self._routed("", request, timeout, metadata,
                                             credentials, wait_for_ready, compression)
        if conn is None:
            return result
        if _has_policy(self._mc):
            return _ended(self._policy_call(conn, request, timeout, metadata, self._mc,
                                             False))
        answer, result = self._answered("", conn, request, timeout, metadata, credentials,
                                        wait_for_ready, compression)
        return result if answer is None else answer[0]

    def _unsent_again(self, request: Any, timeout: Optional[float],
                      wait_for_ready: Optional[bool], metadata: Any = None) -> Any:
        """A common call its fast connection turned away unsent: it starts again where
        the channel routes now, with one unsent retry fewer."""
        tries = self._channel._service_config.unsent_retries - 1
        conn, timeout, result = self._routed("", request, timeout, metadata, None,
                                             wait_for_ready, None)
        if conn is None:
            return result
        answer, result = self._answered("", conn, request, timeout, metadata, None,
                                        wait_for_ready, None, tries)
        return result if answer is None else answer[0]

    def with_call(self, request: Any, timeout: Optional[float] = None, metadata: Any = None,
                  credentials: Optional[grpc.CallCredentials] = None,
                  wait_for_ready: Optional[bool] = None,
                  compression: Optional[grpc.Compression] = None) -> tuple[Any, grpc.Call]:
        conn, timeout, result = self._routed("with_call", request, timeout, metadata,
                                             credentials, wait_for_ready, compression)
        if conn is None:
            return cast("tuple[Any, grpc.Call]", result)
        if _has_policy(self._mc):
            call = self._policy_call(conn, request, timeout, metadata, self._mc, False)
            return _ended(call), call
        answer, result = self._answered("with_call", conn, request, timeout, metadata,
                                        credentials, wait_for_ready, compression)
        if answer is None:
            return cast("tuple[Any, grpc.Call]", result)
        response, imd, tmd, timeout = answer
        return response, _CompletedCall(imd, tmd, response, _deadline(timeout))

    def _answered(self, how: str, conn: Any, request: Any, timeout: Optional[float],
                  metadata: Any, credentials: Optional[grpc.CallCredentials],
                  wait_for_ready: Optional[bool], compression: Optional[grpc.Compression],
                  tries: Optional[int] = None
                  ) -> tuple[Optional[tuple[Any, Any, Any, Optional[float]]], Any]:
        """The blocking call on the routed `conn`: ``(answer, None)``; started again where
        the channel routes it now if it never left the process (as _started), and
        ``(None, what grpc returned)`` once that is grpc."""
        payload = request if self._raw_send else self._serialize(request)
        return self._sent(how, conn, request, timeout, metadata, credentials, wait_for_ready,
                          compression, lambda c, t, retry: self._blocking(
                              c, payload, t, metadata, retry), tries)

    def _blocking(self, conn: Any, payload: Any, timeout: Optional[float], metadata: Any,
                  retry_unsent: bool = False) -> Optional[tuple[Any, Any, Any, Optional[float]]]:
        """One blocking call in the engine: (response, initial md, trailing md, timeout);
        None if it never left the process and may start again elsewhere (`retry_unsent`)."""
        if timeout is not None and timeout < 0:
            timeout = 0.0  # grpc: already expired; the engine reads negative as "none"
        md = _core_metadata(metadata) if metadata else []
        ended = conn.unary(self._method, md, timeout, payload, retry_unsent)
        if ended is None:
            return None
        code, details, imd, tmd, response = ended
        mc = self._mc
        if code == 0 and mc is not None and mc.max_response is not None and \
                response is not None and (n := _nbytes(response)) > mc.max_response:
            code, details = _RESOURCE_EXHAUSTED.value[0], received_too_large(n, mc.max_response)
        if code != 0:
            raise _status_exception(self._channel, code, details, imd, tmd)
        if self._deser is not None and response is not None:
            response = user_codec(self._deser, response, "deserializing")
            if response is USER_CODE_FAILED:
                raise local_error(_INTERNAL, _DESERIALIZE_FAILED)
        return response, imd, tmd, timeout

    def future(self, request: Any, timeout: Optional[float] = None, metadata: Any = None,
               credentials: Optional[grpc.CallCredentials] = None,
               wait_for_ready: Optional[bool] = None,
               compression: Optional[grpc.Compression] = None) -> Any:
        mc = self._mc
        if not _has_policy(mc):
            return self._call_object("future", request, True, True, timeout, metadata,
                                     credentials, wait_for_ready, compression)
        return self._with_policy("future", request, timeout, metadata, credentials,
                                 wait_for_ready, compression, mc, streaming=False)

class UnaryStream(_MultiCallable, UnaryStreamBase):
    __slots__ = ()
    _kind = "unary_stream"

    def __call__(self, request: Any, timeout: Optional[float] = None, metadata: Any = None,
                 credentials: Optional[grpc.CallCredentials] = None,
                 wait_for_ready: Optional[bool] = None,
                 compression: Optional[grpc.Compression] = None) -> Any:
        mc = self._mc
        if not _has_policy(mc):
            return self._call_object("", request, True, False, timeout, metadata,
                                     credentials, wait_for_ready, compression)
        return self._with_policy("", request, timeout, metadata, credentials,
                                 wait_for_ready, compression, mc, streaming=True)


class StreamUnary(_MultiCallable, StreamUnaryBase):
    __slots__ = ()
    _kind = "stream_unary"

    def _blocking(self, how: str, request_iterator: Any, timeout: Optional[float],
                  metadata: Any, credentials: Optional[grpc.CallCredentials],
                  wait_for_ready: Optional[bool], compression: Optional[grpc.Compression]
                  ) -> tuple[Optional[tuple[Any, _Call]], Any]:
        """``((response, call), None)`` on the fast path, ``(None, what grpc returned)``."""
        conn, timeout, result = self._routed(how, request_iterator, timeout, metadata,
                                             credentials, wait_for_ready, compression)
        if conn is None:
            return None, result
        call, result = self._started(how, conn, request_iterator, timeout, metadata,
                                     credentials, wait_for_ready, compression, True)
        if call is None:
            return None, result
        self._feed(call, request_iterator)
        call._wait(None)
        if call._code is _OK:
            return (call._response, call), None
        raise call._error()

    def __call__(self, request_iterator: Iterator[Any], timeout: Optional[float] = None,
                 metadata: Any = None, credentials: Optional[grpc.CallCredentials] = None,
                 wait_for_ready: Optional[bool] = None,
                 compression: Optional[grpc.Compression] = None) -> Any:
        answer, result = self._blocking("", request_iterator, timeout, metadata, credentials,
                                        wait_for_ready, compression)
        return result if answer is None else answer[0]

    def with_call(self, request_iterator: Iterator[Any], timeout: Optional[float] = None,
                  metadata: Any = None, credentials: Optional[grpc.CallCredentials] = None,
                  wait_for_ready: Optional[bool] = None,
                  compression: Optional[grpc.Compression] = None) -> tuple[Any, grpc.Call]:
        answer, result = self._blocking("with_call", request_iterator, timeout, metadata,
                                        credentials, wait_for_ready, compression)
        return cast("tuple[Any, grpc.Call]", result) if answer is None else answer

    def future(self, request_iterator: Iterator[Any], timeout: Optional[float] = None,
               metadata: Any = None, credentials: Optional[grpc.CallCredentials] = None,
               wait_for_ready: Optional[bool] = None,
               compression: Optional[grpc.Compression] = None) -> Any:
        return self._call_object("future", request_iterator, False, True, timeout,
                                 metadata, credentials, wait_for_ready, compression)


class StreamStream(_MultiCallable, StreamStreamBase):
    __slots__ = ()
    _kind = "stream_stream"

    def __call__(self, request_iterator: Iterator[Any], timeout: Optional[float] = None,
                 metadata: Any = None, credentials: Optional[grpc.CallCredentials] = None,
                 wait_for_ready: Optional[bool] = None,
                 compression: Optional[grpc.Compression] = None) -> Any:
        return self._call_object("", request_iterator, False, False, timeout, metadata,
                                 credentials, wait_for_ready, compression)
