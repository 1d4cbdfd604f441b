"""`argrpc.server()`: a real grpc server on its port, plus the fast-path (shm) server.

Threading (DESIGN.md, last section): every thread of the user's pool runs a long-lived
loop that waits inside the C++ engine for the next call (GIL released) and runs the
handler right there: no Python queue, no `executor.submit`, on the fast path. Because
those loops occupy the user's pool, the real grpc server gets a funnel executor instead:
its work goes into a deque and one loop is woken (`core_server.wakeup()`) to run it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import concurrent.futures.thread as _futures_thread
import contextvars
import enum
import logging
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence

import grpc

from . import _bootstrap, _buffers, _config, _engine, _handlers
from ._context import _CallState, _ServicerContext

_LOGGER = logging.getLogger(__name__)

_DEFAULT_LOOPS = 8
# How long a loop waits in the engine before it re-checks for stop / interpreter exit.
_ACCEPT_TIMEOUT = 0.25
_UNKNOWN = grpc.StatusCode.UNKNOWN.value[0]
_UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED.value[0]
_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
# What grpc's own server gives the client for calls still running when stop()'s grace
# ends; on the server side those calls are cancelled (is_active() false, callbacks run).
_STOP_CODE = grpc.StatusCode.UNAVAILABLE.value[0]
_STOP_DETAILS = "Cancelling all calls"


class _HandlerCallDetails(
    collections.namedtuple("_HandlerCallDetails", ("method", "invocation_metadata")),
    grpc.HandlerCallDetails,
):
    pass


class _Stage(enum.Enum):
    NEW = "new"
    STARTED = "started"
    GRACE = "grace"
    STOPPED = "stopped"


# --- interpreter exit ------------------------------------------------------------------
# concurrent.futures joins every pool thread at exit; our loops would never return and
# the process would hang. threading runs these hooks in reverse registration order, so
# ours (registered after concurrent.futures') releases the loops before that join.
_live_servers: "weakref.WeakSet[_Server]" = weakref.WeakSet()
_exiting = False


def _release_loops_at_exit() -> None:
    global _exiting
    _exiting = True
    servers = list(_live_servers)
    for srv in servers:
        srv._release_loops()
    # The watcher is a daemon thread inside the engine: let it leave before the
    # interpreter (and then the engine) is torn down under it.
    for srv in servers:
        watcher = srv._watcher
        if watcher is not None and watcher.is_alive():
            watcher.join(0.5)


try:
    threading._register_atexit(_release_loops_at_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # not available, or already shutting down
    pass


def _interpreter_exiting() -> bool:
    return _exiting or bool(getattr(_futures_thread, "_shutdown", False))


# --- the funnel executor given to the real grpc server ---------------------------------
class _Funnel(concurrent.futures.Executor):
    """Executor whose work is run by the server's loops in the user's pool."""

    def __init__(self, wake: Callable[[], None], fallback: concurrent.futures.Executor):
        self._queue: collections.deque = collections.deque()
        self._wake = wake
        # Once the loops are gone (server stopped), late work goes to the user's pool,
        # which is free again.
        self._fallback = fallback
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:  # against close_and_drain(): no work may be stranded
            if self._closed:
                return self._fallback.submit(fn, *args, **kwargs)
            self._queue.append((future, fn, args, kwargs))
        self._wake()
        return future

    def pending(self) -> bool:
        return bool(self._queue)

    def run_one(self) -> bool:
        try:
            future, fn, args, kwargs = self._queue.popleft()
        except IndexError:
            return False
        if not future.set_running_or_notify_cancel():
            return True
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # handed to whoever waits on the future
            future.set_exception(exc)
        else:
            future.set_result(result)
        return True

    def close_and_drain(self) -> None:
        with self._lock:
            self._closed = True
        while True:
            try:
                future, fn, args, kwargs = self._queue.popleft()
            except IndexError:
                return
            _chain(self._fallback.submit(fn, *args, **kwargs), future)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        # The loops belong to the server; grpc never shuts its executor down anyway.
        pass


def _chain(inner: concurrent.futures.Future, outer: concurrent.futures.Future) -> None:
    if not outer.set_running_or_notify_cancel():
        inner.cancel()
        return

    def copy(done: concurrent.futures.Future) -> None:
        exc = done.exception()
        if exc is not None:
            outer.set_exception(exc)
        else:
            outer.set_result(done.result())

    inner.add_done_callback(copy)


def _validate_generic_handlers(handlers: Iterable[Any]) -> None:
    for handler in handlers:
        if getattr(handler, "service", None) is None:
            raise AttributeError(
                f'"{handler}" must conform to grpc.GenericRpcHandler type but does not '
                'have "service" method!')


class _Server(grpc.Server):
    def __init__(
        self,
        thread_pool: concurrent.futures.Executor,
        handlers: Optional[Sequence[grpc.GenericRpcHandler]],
        interceptors: Optional[Sequence[grpc.ServerInterceptor]],
        options: Any,
        maximum_concurrent_rpcs: Optional[int],
        compression: Optional[grpc.Compression],
    ) -> None:
        grpc_options, _ = _config.split_options(options)
        cfg = _config.load(options)
        max_recv = _config.max_receive_length(grpc_options)
        self._max_send = _config.max_send_length(grpc_options)
        self._pool = thread_pool
        self._interceptors = tuple(interceptors or ())
        self._max_concurrent = maximum_concurrent_rpcs
        self._generic: list[grpc.GenericRpcHandler] = []
        self._registered: dict[str, grpc.RpcMethodHandler] = {}
        self._lock = threading.RLock()
        self._stage = _Stage.NEW
        # In-flight fast-path calls, keyed by ServerCall.key; the dict length is the
        # active count (dict ops are atomic under the GIL: no lock on the hot path).
        self._calls: dict[int, _CallState] = {}
        self._accepting = False
        self._exit_loops = False
        self._idle = threading.Condition(threading.Lock())
        self._stop_deadline: Optional[float] = None
        self._stop_events: list[threading.Event] = []
        self._terminated = threading.Event()
        self._grpc_stopped: Optional[threading.Event] = None
        self._live_loops = 0
        self._watcher: Optional[threading.Thread] = None

        self._core = self._make_core_server(cfg, max_recv, maximum_concurrent_rpcs)
        self._funnel: Optional[_Funnel] = None
        executor: concurrent.futures.Executor = thread_pool
        if self._core is not None:
            self._funnel = _Funnel(self._wake_one, thread_pool)
            executor = self._funnel
        self._grpc = grpc.server(
            executor,
            interceptors=self._interceptors or None,
            options=grpc_options,
            maximum_concurrent_rpcs=maximum_concurrent_rpcs,
            compression=compression,
        )
        # Served on the grpc port even when the fast path is off, so a client learns why.
        self._listener = _bootstrap.FastPathListener(self._core, cfg, max_recv)
        # First, so no catch-all generic handler of the user's can shadow it.
        self._grpc.add_generic_rpc_handlers((self._listener.handler(),))
        if handlers:
            self.add_generic_rpc_handlers(handlers)

    @staticmethod
    def _make_core_server(cfg: _config.Config, max_recv: int,
                          max_concurrent: Optional[int]) -> Any:
        if not cfg.enabled or cfg.transport == "grpc":
            return None
        try:
            core = _engine.core_module()
            engine = _engine.get_engine(cfg)
            return core.Server(engine, {
                "max_recv": max_recv,
                "max_concurrent": -1 if max_concurrent is None else int(max_concurrent),
            })
        except Exception as exc:
            if cfg.transport != "auto":
                # The user demanded a fast transport: failing loudly beats a silent
                # plain-gRPC server.
                raise
            _LOGGER.warning("argrpc server: fast path unavailable, serving plain gRPC "
                            "only: %s", exc)
            return None

    # --- handlers ---------------------------------------------------------------------
    def add_generic_rpc_handlers(self, generic_rpc_handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        generic_rpc_handlers = tuple(generic_rpc_handlers)
        _validate_generic_handlers(generic_rpc_handlers)
        self._grpc.add_generic_rpc_handlers(
            tuple(_buffers.GrpcGenericHandler(h) for h in generic_rpc_handlers))
        with self._lock:
            self._generic.extend(generic_rpc_handlers)

    def add_registered_method_handlers(self, service_name: str,
                                       method_handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        with self._lock:
            started = self._stage is not _Stage.NEW
        # grpc warns and ignores once started; forwarding keeps its exact behaviour.
        self._grpc.add_registered_method_handlers(service_name, {
            name: _buffers.grpc_method_handler(h) for name, h in method_handlers.items()})
        if started:
            return
        with self._lock:
            for method, handler in method_handlers.items():
                self._registered["/{}/{}".format(service_name, method)] = handler

    # --- ports --------------------------------------------------------------------------
    def add_insecure_port(self, address: str) -> int:
        return self._grpc.add_insecure_port(address)

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        return self._grpc.add_secure_port(address, server_credentials)

    # --- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._stage is not _Stage.NEW:
                raise ValueError("Cannot start already-started server!")
            self._stage = _Stage.STARTED
            if self._core is not None:
                self._accepting = True
                _live_servers.add(self)
                n = self._loop_count()
                self._live_loops = n
                for _ in range(n):
                    self._pool.submit(self._worker_loop)
                self._watcher = threading.Thread(target=self._watch_cancelled,
                                                 name="argrpc-server-cancel", daemon=True)
                self._watcher.start()
            self._grpc.start()

    def __del__(self) -> None:
        # grpc's server defines __del__ and code calls it to stop a server: start the
        # stop, without waiting (a finalizer must not block), as grpc does.
        if getattr(self, "_stage", _Stage.NEW) is _Stage.STARTED:
            try:
                self.stop(0)
            except Exception:  # noqa: BLE001 - interpreter teardown: best effort
                pass

    def _loop_count(self) -> int:
        n = getattr(self._pool, "_max_workers", None)
        return n if isinstance(n, int) and n > 0 else _DEFAULT_LOOPS

    def stop(self, grace: Optional[float]) -> threading.Event:
        event = threading.Event()
        with self._lock:
            if self._stage is _Stage.STOPPED or self._stage is _Stage.NEW:
                # grpc: stopping a server that is not running is a no-op.
                event.set()
                return event
            self._stop_events.append(event)
            now = time.monotonic()
            deadline = now if grace is None else now + grace
            # A later stop() may shorten the grace, never lengthen it (as grpc).
            if self._stop_deadline is None or deadline < self._stop_deadline:
                self._stop_deadline = deadline
            first = self._stage is _Stage.STARTED
            self._stage = _Stage.GRACE
            if first:
                self._accepting = False
                self._listener.close()
                if self._core is not None:
                    self._core.shutdown()
                    self._core.wakeup(self._loop_count())
        with self._idle:
            self._idle.notify_all()
        grpc_event = self._grpc.stop(grace)
        if first:
            self._grpc_stopped = grpc_event
            threading.Thread(target=self._finish_stop, name="argrpc-server-stop",
                             daemon=True).start()
        if grace is None:
            event.wait()
        return event

    def _finish_stop(self) -> None:
        # Let in-flight fast-path calls run until the (possibly shortened) grace ends.
        while self._calls:
            with self._lock:
                remaining = self._stop_deadline - time.monotonic()  # type: ignore[operator]
            if remaining <= 0:
                break
            time.sleep(min(remaining, 0.005))
        if self._core is not None:
            self._core.cancel_all(_STOP_CODE, _STOP_DETAILS)
            # cancel_all is ours, not the peer's: the watcher does not see these calls.
            for state in list(self._calls.values()):
                state.run_callbacks()
        # After cancel_all, so in-flight calls end CANCELLED rather than "connection
        # closed"; frees the connections' rings and fds now, not when clients go away.
        self._listener.close_connections()
        if self._grpc_stopped is not None:
            self._grpc_stopped.wait()
        with self._lock:
            self._stage = _Stage.STOPPED
            events = list(self._stop_events)
        self._release_loops()
        if self._watcher is not None:
            # So "no thread left behind" holds the moment stop()'s event is set.
            self._watcher.join(2.0)
        for event in events:
            event.set()
        self._terminated.set()

    def _release_loops(self) -> None:
        self._exit_loops = True
        self._accepting = False
        core = self._core
        if core is not None:
            try:
                core.shutdown()
                core.wakeup(self._loop_count())
            except Exception:  # interpreter teardown: best effort
                pass
        with self._idle:
            self._idle.notify_all()

    def wait_for_termination(self, timeout: Optional[float] = None) -> bool:
        # Short waits keep Ctrl+C working; returns True on timeout (grpc's convention).
        end = None if timeout is None else time.monotonic() + timeout
        while not self._terminated.is_set():
            if end is None:
                self._terminated.wait(0.1)
                continue
            remaining = end - time.monotonic()
            if remaining < 0:
                return True
            self._terminated.wait(min(remaining, 0.1))
        return False

    # --- the loops ------------------------------------------------------------------
    def _wake_one(self) -> None:
        if self._accepting:
            self._core.wakeup(1)
        else:
            with self._idle:
                self._idle.notify()

    def _worker_loop(self) -> None:
        core = self._core
        funnel = self._funnel
        assert core is not None and funnel is not None
        try:
            while True:
                if funnel.run_one():
                    continue
                if self._exit_loops or _interpreter_exiting():
                    break
                if self._accepting:
                    try:
                        sc = core.accept(_ACCEPT_TIMEOUT)
                    except Exception:
                        # Not in the engine's contract; losing a loop silently would
                        # shrink the server, so log and keep the thread serving.
                        _LOGGER.exception("argrpc: accept() failed")
                        time.sleep(0.1)
                        continue
                    if sc is not None:
                        self._serve(sc)
                        sc = None  # not kept alive while the next accept() waits
                else:
                    # Engine shut down (stop grace): only grpc work can still arrive.
                    with self._idle:
                        if not funnel.pending() and not self._exit_loops:
                            self._idle.wait(0.05)
        finally:
            self._on_loop_exit()

    def _on_loop_exit(self) -> None:
        with self._lock:
            self._live_loops -= 1
            last = self._live_loops == 0
        if last and self._funnel is not None:
            # grpc work that raced with the exit: the user's pool is free now.
            self._funnel.close_and_drain()

    def _watch_cancelled(self) -> None:
        core = self._core
        while not self._exit_loops and not _interpreter_exiting():
            began = time.monotonic()
            sc = core.next_cancelled(_ACCEPT_TIMEOUT)
            if sc is None:
                if self._stage is not _Stage.STARTED and time.monotonic() - began < 0.01:
                    time.sleep(0.05)  # engine shut down returns at once: don't spin
                continue
            # A second handle on the call: `key` (not object identity) names the call.
            # Looked up in a helper so that no local keeps the last call (and with it its
            # connection) alive while this loop waits for the next one.
            self._run_cancel_callbacks(sc.key)
            sc = None

    def _run_cancel_callbacks(self, key: Any) -> None:
        state = self._calls.get(key)
        if state is not None:
            state.run_callbacks()

    # --- one fast-path call ----------------------------------------------------------
    def _serve(self, sc: Any) -> None:
        key = sc.key
        state = _CallState(sc, sc.method)
        self._calls[key] = state
        try:
            # A fresh contextvars.Context per call, as grpc does.
            contextvars.Context().run(self._dispatch, state)
        except Exception:  # a bug of ours must not kill the loop
            _LOGGER.exception("argrpc: unexpected error serving %s", state.method)
            if not state.finished:
                state.finished = True
                sc.finish(_UNKNOWN, "Unexpected server error", [], None)
        finally:
            self._calls.pop(key, None)
            state.run_callbacks()

    def _dispatch(self, state: _CallState) -> None:
        try:
            handler = self._lookup(state)
        except Exception as exc:
            _LOGGER.exception("Exception servicing handler: %s", exc)
            self._reject(state, _UNKNOWN, "Error in service handler!")
            return
        if handler is None:
            self._reject(state, _UNIMPLEMENTED, "Method not found!")
            return
        limit = self._max_concurrent
        if limit is not None and len(self._calls) > limit:  # this call is counted already
            self._reject(state, _RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!")
            return
        _handlers.run(state, _ServicerContext(state), handler, self._max_send)

    @staticmethod
    def _reject(state: _CallState, code: int, details: str) -> None:
        state.finished = True
        state.sc.finish(code, details, [], None)

    def _lookup(self, state: _CallState) -> Optional[grpc.RpcMethodHandler]:
        method = state.method
        if not self._interceptors:
            handler = self._registered.get(method)
            if handler is not None:
                return handler
            return self._query_generic(
                _HandlerCallDetails(method, state.invocation_metadata()))

        def query(details: grpc.HandlerCallDetails) -> Optional[grpc.RpcMethodHandler]:
            # grpc resolves a registered method by the call's own name, generic ones
            # through the (possibly interceptor-rewritten) details.
            handler = self._registered.get(method)
            return handler if handler is not None else self._query_generic(details)

        return self._intercept(0, query,
                               _HandlerCallDetails(method, state.invocation_metadata()))

    def _intercept(self, index: int, query: Callable, details: grpc.HandlerCallDetails) -> Any:
        if index == len(self._interceptors):
            return query(details)
        return self._interceptors[index].intercept_service(
            lambda d: self._intercept(index + 1, query, d), details)

    def _query_generic(self, details: grpc.HandlerCallDetails) -> Optional[grpc.RpcMethodHandler]:
        for generic in self._generic:
            handler = generic.service(details)
            if handler is not None:
                return handler
        return None

    @property
    def transport_enabled(self) -> bool:
        """True when this server also serves the fast path."""
        return self._core is not None


def server(
    thread_pool: concurrent.futures.Executor,
    handlers: Optional[Sequence[grpc.GenericRpcHandler]] = None,
    interceptors: Optional[Sequence[grpc.ServerInterceptor]] = None,
    options: Any = None,
    maximum_concurrent_rpcs: Optional[int] = None,
    compression: Optional[grpc.Compression] = None,
) -> _Server:
    """Drop-in for `grpc.server`; see the module docstring for the threading model."""
    return _Server(thread_pool, handlers, interceptors, options, maximum_concurrent_rpcs,
                   compression)
