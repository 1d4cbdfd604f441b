"""`argrpc.server()`: a real grpc server on its port, plus the fast-path (shm, verbs) server.

Threading (README, "How it works"; docs/core-api.md, "Server side"): a fast-path call
is run by a worker, a long-lived loop in a thread of the user's pool that waits inside
the C++ engine for the next call (GIL released) and runs the handler right there: no
Python queue, no `executor.submit` per call. Workers are started on demand by the
server's dispatcher thread (the engine tells it when calls wait and no worker is idle),
so the user's pool is untouched until the first call and used as far as it lets itself
be used: a pool of 25 runs 25 handlers at once, any `concurrent.futures.Executor` works,
and an idle worker gives its thread back. Because workers occupy pool threads while they
wait, the real grpc server gets an executor of ours: while any worker runs, its work goes
to the workers (an idle one is woken with `core_server.wakeup()`; a busy one takes it
before its next call), else to the user's pool as grpc would send it.

`maximum_concurrent_rpcs` is one count for both ports, kept by the engine: a fast-path
call is counted when it arrives, a gRPC-port call when grpc hands it to the executor,
and calls beyond the limit are refused with grpc's status by the dispatcher (the
server's interceptors still see them, as grpc's do), never queued.
"""

from __future__ import annotations

import collections
import concurrent.futures
import concurrent.futures.thread as _futures_thread
import contextvars
import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import grpc

from . import (_bootstrap, _config, _engine, _grpc_log, _grpc_originals, _grpc_payloads, _handlers,
               _metrics_hooks, _serving, _status)
from ._context import _CallState, _ServicerContext

try:
    from ._core import serve_planned as _serve_planned
    from ._core import serve_taken as _serve_taken
except ImportError:  # no engine: no fast-path call is served
    def _serve_planned(state: Any, plan: tuple[Any, Any, Any], context_type: Any,  # type: ignore[misc]
                       max_send: int, /) -> Union[bool, tuple[int, Any, Any]]:
        return False

    def _serve_taken(sc: Any, calls: dict[Any, Any], plans: dict[str, Any],  # type: ignore[misc]
                     state_type: Any, context_type: Any, max_send: int,
                     carry_on: Any, /) -> Optional[bool]:
        return None

_LOGGER = logging.getLogger(__name__)

# A burst's extra workers give their threads back to the pool at once, while steady
# traffic keeps one worker waiting in the engine (no hand-off per call).
_ACCEPT_TIMEOUT = _config.LIMITS.server_poll_s
_SPARE_WORKER_IDLE = _config.LIMITS.spare_worker_idle_s
_LAST_WORKER_IDLE = _config.LIMITS.last_worker_idle_s


# --- interpreter exit ------------------------------------------------------------------
# concurrent.futures joins every pool thread at exit; our workers would never return and
# the process would hang. threading runs these hooks in reverse registration order, so
# ours (registered after concurrent.futures') releases the workers before that join.
_live_servers: "weakref.WeakSet[_Server]" = weakref.WeakSet()
_exiting = False


def _release_workers_at_exit() -> None:
    global _exiting
    _exiting = True
    servers = [srv for srv in _live_servers if not srv._inherited()]
    for srv in servers:
        srv._release_workers()
    # The dispatcher waits inside the engine: let it leave before the interpreter (and
    # then the engine) is torn down under it.
    for srv in servers:
        dispatcher = srv._dispatcher
        if dispatcher is not None and dispatcher.is_alive():
            dispatcher.join(0.5)


try:
    threading._register_atexit(_release_workers_at_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # not available, or already shutting down
    pass


def _interpreter_exiting() -> bool:
    return _exiting or bool(getattr(_futures_thread, "_shutdown", False))


# What the gate decided for the call grpc hands to the executor next. grpc looks a
# call's handler up (running the interceptors, where the gate is) and submits it to the
# executor right after, in the same thread, before it looks at another call.
_ticket = threading.local()
_COUNTED = "counted"
_REFUSED = "refused"


def _refuse_over_limit(request_iterator: Any, context: grpc.ServicerContext) -> None:
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, _status.OVER_LIMIT)


# Request-streaming, so grpc runs it without waiting for a request message: the gate's
# executor runs it on the spot, as grpc refuses a call without its thread pool.
_REFUSE_HANDLER: grpc.RpcMethodHandler[Any, Any] = grpc.stream_unary_rpc_method_handler(
    _refuse_over_limit)


class _Gate(grpc.ServerInterceptor):
    """The one interceptor the grpc server beside the fast path is given.

    argrpc's negotiation passes by the user's interceptors and the concurrency limit
    (it is not a call of the user's service); every other call meets the user's
    interceptors in their order and takes a place under the limit, as with grpc.
    """

    def __init__(self, interceptors: Sequence[grpc.ServerInterceptor],
                 admission: Optional[_serving.Admission]) -> None:
        self._interceptors = tuple(interceptors)
        self._admission = admission

    def intercept_service(self, continuation: Callable[..., Any],
                          details: grpc.HandlerCallDetails) -> Any:
        if details.method == _bootstrap.BOOTSTRAP_METHOD:
            return continuation(details)
        admission = self._admission
        if admission is None:
            return _intercept(self._interceptors, 0, continuation, details)
        if getattr(_ticket, "kind", None) == _COUNTED:
            # The last call counted never reached the executor (grpc ran it elsewhere).
            admission.release()
        _ticket.kind = None
        # grpc decides on the limit when the call arrives, then runs the interceptors.
        admitted = admission.admit()
        try:
            handler = _intercept(self._interceptors, 0, continuation, details)
        except BaseException:
            if admitted:
                admission.release()
            raise
        if handler is None or not admitted:
            if admitted:
                admission.release()
            if handler is None:
                return None  # grpc: UNIMPLEMENTED comes before RESOURCE_EXHAUSTED
            _ticket.kind = _REFUSED
            return _REFUSE_HANDLER
        pool = getattr(_serving.behavior(handler), "experimental_thread_pool", None)
        if isinstance(pool, concurrent.futures.ThreadPoolExecutor):
            admission.release()  # grpc submits it to that pool, which we do not see
            return handler
        _ticket.kind = _COUNTED
        return handler


if TYPE_CHECKING:  # grpc.RpcMethodHandler is not subscriptable at run time
    _Query = Callable[[grpc.HandlerCallDetails], Optional[grpc.RpcMethodHandler[Any, Any]]]


def _intercept(interceptors: Sequence[grpc.ServerInterceptor], index: int, query: _Query,
               details: grpc.HandlerCallDetails) -> Optional[grpc.RpcMethodHandler[Any, Any]]:
    if index == len(interceptors):
        return query(details)
    return interceptors[index].intercept_service(
        lambda d: _intercept(interceptors, index + 1, query, d), details)


# --- the executor given to the real grpc server ---------------------------------------
class _GrpcExecutor(concurrent.futures.Executor):
    """Where the grpc server's work goes: to the workers while any is running (their
    threads are taken from the user's pool already), else to the user's pool.

    Not to the pool while workers run: they hold its threads as long as fast-path calls
    keep coming, so work queued behind them there would wait for the traffic to stop (a
    plain gRPC client's calls, a new channel's negotiation). A worker looks at this
    queue before every accept(), so under load the work runs after a call's time, and
    the wake-up brings an idle worker or, when none is, asks for one more."""

    def __init__(self, pool: concurrent.futures.Executor, wake: Callable[[], None],
                 admission: Optional[_serving.Admission]) -> None:
        # Work for a worker; workers look at it (truthiness) before every accept().
        self.queue: collections.deque[Any] = collections.deque()
        self._pool = pool
        self._wake = wake
        self._admission = admission
        self._closed = False
        self._workers = 0  # worker loops running; changed under the lock
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any,
               **kwargs: Any) -> concurrent.futures.Future[Any]:
        kind = getattr(_ticket, "kind", None)
        if kind is not None:
            _ticket.kind = None
            if kind == _REFUSED:
                return _run_now(fn, args, kwargs)
        future = self._hand_over(fn, args, kwargs)
        if kind == _COUNTED:
            admission = self._admission
            assert admission is not None
            future.add_done_callback(lambda _f: admission.release())
        return future

    def _hand_over(self, fn: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> concurrent.futures.Future[Any]:
        with self._lock:  # against retire() and close_and_drain(): nothing stranded
            queued = not self._closed and self._workers > 0
            if queued:
                future: concurrent.futures.Future[Any] = concurrent.futures.Future()
                self.queue.append((future, fn, args, kwargs))
        if queued:
            self._wake()
            return future
        return self._pool.submit(fn, *args, **kwargs)

    def run_one(self) -> bool:
        try:
            future, fn, args, kwargs = self.queue.popleft()
        except IndexError:
            return False
        if future.set_running_or_notify_cancel():
            _run_into(future, fn, args, kwargs)
        return True

    def worker_began(self) -> None:
        with self._lock:
            self._workers += 1

    def worker_ended(self) -> None:
        with self._lock:
            self._workers -= 1

    def retire(self) -> bool:
        """True when a worker may leave (and is no longer counted): no work of ours is
        queued for it."""
        with self._lock:
            if self.queue:
                return False
            self._workers -= 1
            return True

    def close_and_drain(self) -> None:
        with self._lock:
            self._closed = True
        while True:
            try:
                future, fn, args, kwargs = self.queue.popleft()
            except IndexError:
                return
            _chain(self._pool.submit(fn, *args, **kwargs), future)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        # The pool is the user's; grpc never shuts its executor down anyway.
        pass


def _run_into(future: concurrent.futures.Future[Any], fn: Callable[..., Any],
              args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # handed to whoever waits on the future
        future.set_exception(exc)
    else:
        future.set_result(result)


def _run_now(fn: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> concurrent.futures.Future[Any]:
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    _run_into(future, fn, args, kwargs)
    return future


def _chain(inner: concurrent.futures.Future[Any], outer: concurrent.futures.Future[Any]) -> None:
    if not outer.set_running_or_notify_cancel():
        inner.cancel()
        return

    def copy(done: concurrent.futures.Future[Any]) -> None:
        exc = done.exception()
        if exc is not None:
            outer.set_exception(exc)
        else:
            outer.set_result(done.result())

    inner.add_done_callback(copy)


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
        self._lock = threading.RLock()
        self._stage = _serving.NEW
        self._pid = os.getpid()
        # In-flight fast-path calls, keyed by ServerCall.key; the dict length is the
        # active count (dict ops are atomic under the GIL: no lock on the hot path).
        self._calls: dict[int, _CallState] = {}
        # The registered unary-unary methods a worker serves on the spot (no interceptors,
        # no pool of their own), read off their handlers when the server starts.
        self._plans: dict[str, _handlers.UnaryPlan] = {}
        self._accepting = False
        self._exit_workers = False
        self._stop_deadline: Optional[float] = None
        self._stop_events: list[threading.Event] = []
        self._terminated = threading.Event()
        self._grpc_stopped: Optional[threading.Event] = None
        self._dispatcher: Optional[threading.Thread] = None
        self._dispatcher_ident: Optional[int] = None

        self._core = _serving.core_server(cfg, max_recv, maximum_concurrent_rpcs)
        core = self._core
        admission = (None if maximum_concurrent_rpcs is None
                     else _serving.Admission(maximum_concurrent_rpcs, core))
        self._executor = _GrpcExecutor(thread_pool, self._wake_one, admission)
        # The limit is ours to count (one count for both ports, argrpc's negotiation
        # left out), so grpc is not given it; the gate applies it and the user's
        # interceptors.
        gate = None
        if self._interceptors or admission is not None:
            gate = _Gate(self._interceptors, admission)
        # ignores: grpc takes any Executor and any sequence of interceptors; its stubs
        # say ThreadPoolExecutor and list
        self._grpc = _grpc_originals.server(
            self._executor,  # type: ignore[arg-type]
            interceptors=(gate,) if gate is not None else None,  # type: ignore[arg-type]
            options=grpc_options,
            compression=compression,
        )
        self._handlers = _serving.Handlers(self._grpc)
        # Served on the grpc port even when the fast path is off, so a client learns why.
        self._listener = _bootstrap.FastPathListener(
            self._core, cfg, max_recv,
            compression_disabled=_config.compression_disabled(grpc_options))
        self._grpc.add_registered_method_handlers(_bootstrap.BOOTSTRAP_SERVICE,
                                                  self._listener.method_handlers())
        if handlers:
            self.add_generic_rpc_handlers(handlers)

    # --- handlers ---------------------------------------------------------------------
    def add_generic_rpc_handlers(self, generic_rpc_handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        generic_rpc_handlers = tuple(generic_rpc_handlers)
        _serving.validate_generic_handlers(generic_rpc_handlers)
        with self._lock:
            self._handlers.add_generic(generic_rpc_handlers)

    def add_registered_method_handlers(self, service_name: str,
                                       method_handlers: Mapping[str, grpc.RpcMethodHandler[Any, Any]]
                                       ) -> None:
        with self._lock:
            self._handlers.add_registered(service_name, method_handlers,
                                          started=self._stage is not _serving.NEW)

    # --- ports --------------------------------------------------------------------------
    def add_insecure_port(self, address: str) -> int:
        return self._grpc.add_insecure_port(address)

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        return self._grpc.add_secure_port(address, server_credentials)

    # --- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._stage is not _serving.NEW:
                raise ValueError("Cannot start already-started server!")
            self._stage = _serving.STARTED
            if self._core is not None:
                if not self._interceptors:
                    self._plans = {
                        method: plan for method, handler in
                        self._handlers.all_registered().items()
                        if (plan := _handlers.unary_plan(handler)) is not None}
                # No pool thread is taken here: workers start with the first call.
                self._accepting = True
                _live_servers.add(self)
                self._dispatcher = threading.Thread(target=self._dispatch_events,
                                                    name="argrpc-server", daemon=True)
                self._dispatcher.start()
            self._grpc.start()

    def _inherited(self) -> bool:
        """A forked child's copy of the parent's server: its threads are the parent's, and
        its locks may have been held by one of them at fork(), so the child leaves it alone
        (stopping it here would hang, and the parent keeps serving)."""
        return os.getpid() != self._pid

    def __del__(self) -> None:
        # grpc's server defines __del__ and code calls it to stop a server: start the
        # stop, without waiting (a finalizer must not block), as grpc does.
        if getattr(self, "_stage", _serving.NEW) is _serving.STARTED and not self._inherited():
            try:
                self.stop(0)
            except Exception:  # noqa: BLE001 - interpreter teardown: best effort
                pass

    def stop(self, grace: Optional[float]) -> threading.Event:
        event = threading.Event()
        if self._inherited():
            event.set()
            return event
        with self._lock:
            if self._stage is _serving.STOPPED or self._stage is _serving.NEW:
                # grpc: stopping a server that is not running is a no-op.
                event.set()
                return event
            self._stop_events.append(event)
            now = time.monotonic()
            deadline = now if grace is None else now + grace
            # A later stop() may shorten the grace, never lengthen it (as grpc).
            if self._stop_deadline is None or deadline < self._stop_deadline:
                self._stop_deadline = deadline
            first = self._stage is _serving.STARTED
            self._stage = _serving.STOPPING
            if first:
                self._accepting = False
                # From now on grpc's work goes to the user's pool: workers leave as soon
                # as they are not running a call.
                self._executor.close_and_drain()
                self._listener.close()
                if self._core is not None:
                    self._core.shutdown()
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
            self._core.cancel_all(_status.STOP_CODE, _status.STOPPED)
            # cancel_all is ours, not the peer's: the dispatcher does not see these calls.
            for state in list(self._calls.values()):
                state.run_callbacks()
        # After cancel_all, so in-flight calls end CANCELLED rather than "connection
        # closed"; frees the connections' rings and fds now, not when clients go away.
        self._listener.close_connections()
        if self._grpc_stopped is not None:
            self._grpc_stopped.wait()
        with self._lock:
            self._stage = _serving.STOPPED
            events = list(self._stop_events)
        self._release_workers()
        if self._dispatcher is not None:
            # So "no thread left behind" holds the moment stop()'s event is set.
            self._dispatcher.join(2.0)
        for event in events:
            event.set()
        self._terminated.set()

    def _release_workers(self) -> None:
        self._exit_workers = True
        self._accepting = False
        self._executor.close_and_drain()
        core = self._core
        if core is not None:
            try:
                core.shutdown()
            except Exception:  # interpreter teardown: best effort
                pass

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

    # --- workers and the dispatcher ----------------------------------------------------
    def _wake_one(self) -> None:
        self._core.wakeup(1)

    def _dispatch_events(self) -> None:
        core = self._core
        self._dispatcher_ident = threading.get_ident()
        while not self._exit_workers and not _interpreter_exiting():
            began = time.monotonic()
            kind, sc, n = core.next_event(_ACCEPT_TIMEOUT)
            if kind == "cancelled":
                # A second handle on the call: `key` (not object identity) names it.
                # Looked up in a helper so that no local keeps the call (and with it its
                # connection) alive while this loop waits for the next event.
                self._run_cancel_callbacks(sc.key)
            elif kind == "over_limit":
                self._refuse(sc)
            elif kind == "starved":
                self._start_workers(n)
            elif self._stage is not _serving.STARTED and time.monotonic() - began < 0.01:
                time.sleep(0.05)  # engine shut down returns at once: don't spin
            sc = None

    def _start_workers(self, n: int) -> None:
        core = self._core
        for started in range(n):
            try:
                self._pool.submit(self._worker)
            except Exception as exc:  # the pool was shut down, or refuses work
                for _ in range(n - started):
                    core.worker_started()
                if self._accepting:
                    _LOGGER.error("argrpc server: the thread pool refused to run a call: %s",
                                  exc)
                core.cancel_pending(_status.UNAVAILABLE,
                                    f"server's thread pool refused to run the call: {exc}")
                return

    def _worker(self) -> None:
        core = self._core
        core.worker_started()
        if threading.get_ident() == self._dispatcher_ident:
            # An executor that runs work in the caller's thread: serve what waits, and
            # give the dispatcher back.
            while True:
                sc = core.accept(0)
                if sc is None:
                    return
                self._serve(sc)
                sc = None
        executor = self._executor
        queue = executor.queue
        # What serving a call reads, fixed once the server started (as are its plans).
        calls, plans, max_send, carry_on = self._calls, self._plans, self._max_send, \
            self._carry_on
        executor.worker_began()
        retired = False
        try:
            # When this worker ran out of work; None right after work, so the path from one
            # call to the next reads no clock and asks the engine nothing more.
            idle_since: Optional[float] = None
            while True:
                if queue:
                    # Other work first: this worker is no longer on its way back to accept().
                    core.drop_polling_lease()
                    if executor.run_one():
                        idle_since = None
                        continue
                if not self._accepting or self._exit_workers or _interpreter_exiting():
                    core.drop_polling_lease()
                    return
                if idle_since is None:
                    timeout = _SPARE_WORKER_IDLE
                else:
                    limit = _SPARE_WORKER_IDLE if core.idle_workers > 0 else _LAST_WORKER_IDLE
                    remaining = idle_since + limit - time.monotonic()
                    if remaining <= 0:
                        if executor.retire():
                            retired = True
                            return
                        idle_since = None
                        continue
                    timeout = min(remaining, _ACCEPT_TIMEOUT)
                try:
                    sc = core.accept(timeout)
                except Exception:
                    # Not in the engine's contract; losing a worker silently would shrink
                    # the server, so log and keep the thread serving.
                    _LOGGER.exception("argrpc: accept() failed")
                    time.sleep(0.1)
                    continue
                if sc is not None:
                    # A planned method's call in one crossing, registered and ended;
                    # None: the Python way.
                    if _serve_taken(sc, calls, plans, _CallState, _ServicerContext,
                                    max_send, carry_on) is None:
                        self._serve(sc)
                    sc = None  # not kept alive while the next accept() waits
                    idle_since = None
                elif idle_since is None:
                    # Timed out (a wake-up brings work, which resets this anyway).
                    idle_since = time.monotonic() - timeout
        finally:
            if not retired:
                executor.worker_ended()

    def _run_cancel_callbacks(self, key: Any) -> None:
        state = self._calls.get(key)
        if state is not None:
            state.run_callbacks()
            if state.detached:  # its handler returned already: nobody else ends it
                self._calls.pop(key, None)

    def _refuse(self, sc: Any) -> None:
        """A call over the limit: the interceptors see it, then grpc's status ends it."""
        state = _CallState(sc, sc.method)
        if contextvars.Context().run(self._find_handler, state) is not None:
            self._reject(state, _status.RESOURCE_EXHAUSTED, _status.OVER_LIMIT)

    # --- one fast-path call ----------------------------------------------------------
    def _serve(self, sc: Any) -> None:
        """A call that serve_taken left to Python (no plan for its method), or one taken
        by an executor that runs work in the caller's thread."""
        method = sc.method
        state = _CallState(sc, method)
        self._calls[sc.key] = state
        plan = self._plans.get(method)
        # A fresh contextvars.Context per call, as grpc does.
        if plan is None:
            contextvars.Context().run(self._serve_state, state, None)
            return
        try:
            # In one crossing when the request is there; else the Python way.
            served: Any = _serve_planned(state, plan, _ServicerContext, self._max_send)
        except Exception as exc:  # as in _serve_state
            served = exc
        self._carry_on(state, plan, served)

    def _carry_on(self, state: _CallState, plan: _handlers.UnaryPlan, outcome: Any) -> None:
        """A planned call from where serving it in one crossing stopped (`outcome`:
        serve_planned's, or the Exception it raised), then its end."""
        try:
            if outcome is False:  # its request was not there yet
                contextvars.Context().run(_handlers.serve_unary, state, plan, self._max_send)
            elif isinstance(outcome, tuple):
                stage, value, context = outcome
                context.run(_handlers.carry_on_unary, state, plan, self._max_send, stage, value)
            elif isinstance(outcome, BaseException):
                self._end_after_bug(state, outcome)
        except Exception as exc:  # as in _serve_state
            self._end_after_bug(state, exc)
        self._end_call(state)

    @staticmethod
    def _end_after_bug(state: _CallState, exc: Optional[BaseException] = None) -> None:
        """A bug of ours raised while serving the call: logged (`exc`, or the exception
        being handled), and the call ended with UNKNOWN unless its status went out."""
        _LOGGER.error("argrpc: unexpected error serving %s", state.method,
                      exc_info=exc if exc is not None else True)
        if not state.finished:
            state.finished = True
            state.sc.finish(_status.UNKNOWN, "Unexpected server error", [], None)

    def _serve_state(self, state: _CallState, handler: Optional[grpc.RpcMethodHandler[Any, Any]]) -> None:
        goes_on = False
        try:
            goes_on = self._dispatch(state, handler)
        except Exception:  # a bug of ours must not kill the worker or leave the call open
            self._end_after_bug(state)
        finally:
            if not goes_on:
                self._end_call(state)

    def _end_call(self, state: _CallState) -> None:
        self._calls.pop(state.sc.key, None)
        if state.callbacks:
            self._core.drop_polling_lease()  # the application's code runs next
        state.run_callbacks()

    def _dispatch(self, state: _CallState, handler: Optional[grpc.RpcMethodHandler[Any, Any]]) -> bool:
        """Runs the call (`handler`: already looked up); True when it goes on after this
        returns: in a method's own pool, or a non-blocking handler's call."""
        if handler is None:
            # A registered method without interceptors is one lookup: the common call
            # skips the general path's frames.
            handler = None if self._interceptors else self._handlers.registered(state.method)
            if handler is None:
                handler = self._find_handler(state)
            if handler is None:
                return False
            pool = getattr(_serving.behavior(handler), "experimental_thread_pool", None)
            if isinstance(pool, concurrent.futures.ThreadPoolExecutor):
                # grpc runs such a method in its own pool: so do we (this worker goes on).
                pool.submit(contextvars.copy_context().run, self._serve_state, state, handler)
                return True
        goes_on = _handlers.run(state, _ServicerContext(state), handler, self._max_send,
                                self._end_call)
        if goes_on:
            state.detached = True  # its handler returned: a cancel ends it now
        return goes_on

    def _find_handler(self, state: _CallState) -> Optional[grpc.RpcMethodHandler[Any, Any]]:
        """The call's handler through the interceptors; None once the call was ended
        with grpc's status for a failing lookup or an unknown method."""
        try:
            handler = self._lookup(state)
        except Exception as exc:  # noqa: BLE001 - grpc's answer to a failing lookup
            _grpc_log.SERVER.exception("Exception servicing handler: %s", exc)
            self._reject(state, _status.UNKNOWN, "Error in service handler!")
            return None
        if handler is None:
            self._reject(state, _status.UNIMPLEMENTED, "Method not found!")
        return handler

    @staticmethod
    def _reject(state: _CallState, code: int, details: str) -> None:
        state.finished = True
        state.sc.finish(code, details, [], None)

    def _lookup(self, state: _CallState) -> Optional[grpc.RpcMethodHandler[Any, Any]]:
        method = state.method
        if not self._interceptors:
            handler = self._handlers.registered(method)
            if handler is not None:
                return handler
            return self._handlers.generic(_serving.HandlerCallDetails(method, state))

        def query(details: grpc.HandlerCallDetails) -> Optional[grpc.RpcMethodHandler[Any, Any]]:
            # grpc resolves a registered method by the call's own name, generic ones
            # through the (possibly interceptor-rewritten) details.
            handler = self._handlers.registered(method)
            return handler if handler is not None else self._handlers.generic(details)

        return _intercept(self._interceptors, 0, query,
                          _serving.HandlerCallDetails(method, state))

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
