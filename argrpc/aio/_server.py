"""`argrpc.aio.server()`: a real grpc.aio server on its port, plus the fast-path server.

The real `grpc.aio` server serves plain gRPC clients and argrpc's bootstrap RPC. Calls
that come over a fast path (shared memory, verbs) arrive through the engine's
`_core.Server`, which this server watches from its event loop (`argrpc.aio._loop`): the
engine posts the server's token when calls arrive or end, the loop takes them with
non-blocking calls and runs each as a task, as grpc.aio runs its calls. The loop never
waits inside the engine.

`maximum_concurrent_rpcs` is one count for both ports, kept by the engine: a fast-path
call is counted when it arrives, a gRPC-port call when the gate interceptor sees it; the
bootstrap RPC is counted on neither and passes by the user's interceptors.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sys
import weakref
from concurrent.futures import Executor
from typing import Any, Awaitable, Callable, Iterable, Mapping, Optional, Sequence

import grpc
from grpc import aio

from .. import (_bootstrap, _config, _engine, _grpc_originals, _grpc_payloads, _handlers,
                _metrics_hooks, _proto, _serving, _status)
from .._transports import Caller
from . import _inline_start
from ._context import RpcState, ServicerContext
from ._loop import LoopBridge, bridge
from ._server_handlers import ServerPass, answer_unary, intercept, serve, unary_plan

__all__ = ["Server", "server"]

_LOGGER = logging.getLogger(__name__)


def _refs_of_an_argument() -> int:
    """What sys.getrefcount says of an argument that only its caller's local refers to
    (3 on CPython 3.11: the caller's local, the parameter and getrefcount's argument),
    measured rather than assumed: interpreters differ in what a local costs."""
    def passed(arg: object) -> int:
        return sys.getrefcount(arg)
    obj = object()
    return passed(obj)


# References to a call's state answered at once, in _carry_on, when nothing but its
# caller (_start_call, or the server's pass, which passes it the same way) holds it.
_ONLY_OURS = _refs_of_an_argument()


# --- the gRPC port ----------------------------------------------------------------------
async def _refuse_over_limit(request_iterator: Any, context: aio.ServicerContext[Any, Any]) -> None:
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, _status.OVER_LIMIT)


# Request-streaming, so grpc.aio runs it without waiting for a request message.
_REFUSE_HANDLER: grpc.RpcMethodHandler[Any, Any] = grpc.stream_unary_rpc_method_handler(
    _refuse_over_limit)


class _Gate(aio.ServerInterceptor):
    """The one interceptor the real grpc.aio server is given: argrpc's negotiation passes
    by the user's interceptors and the limit; every other call meets the interceptors in
    their order and takes a place under the limit until its task ends, as in grpc.aio."""

    def __init__(self, interceptors: Sequence[aio.ServerInterceptor],
                 admission: Optional[_serving.Admission]) -> None:
        self._interceptors = tuple(interceptors)
        self._admission = admission

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        if details.method == _bootstrap.BOOTSTRAP_METHOD:
            return await continuation(details)
        admission = self._admission
        admitted = True
        if admission is not None:
            # grpc.aio decides on the limit when the call arrives, before the lookup,
            # and frees the place when the call's task ends (it runs this interceptor).
            admitted = admission.admit()
            task = asyncio.current_task()
            if admitted and task is not None:
                task.add_done_callback(lambda _t: admission.release())
        handler = await intercept(self._interceptors, 0, continuation, details)
        if handler is None or admitted:
            return handler  # UNIMPLEMENTED comes before RESOURCE_EXHAUSTED
        return _REFUSE_HANDLER


def _bootstrap_handlers(listener: _bootstrap.FastPathListener
                        ) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
    """The bootstrap RPC for grpc.aio. `decide` only issues a secret (shm) or attaches an
    endpoint (verbs): short enough to run on the loop."""

    async def negotiate(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        return listener.decide(request, Caller.of(context))

    return {
        "Negotiate": grpc.unary_unary_rpc_method_handler(
            negotiate,
            request_deserializer=_proto.NegotiateRequest.FromString,
            response_serializer=_proto.NegotiateResponse.SerializeToString,
        ),
    }


def _check_interceptors(interceptors: Sequence[Any]) -> None:
    invalid = [i for i in interceptors if not isinstance(i, aio.ServerInterceptor)]
    if invalid:
        raise ValueError(f"Interceptor must be ServerInterceptor, the following are "
                         f"invalid: {invalid}")


# --- the server -------------------------------------------------------------------------
try:
    # The fields its loop pass (ServerPass) reads on every pass with calls, in C
    # (aio_server_state.cc).
    from .._core import AioServerState
except ImportError:  # no engine: no fast-path calls, no pass
    class AioServerState:  # type: ignore[no-redef]
        pass


class Server(AioServerState, aio.Server):
    """Drop-in for the server `grpc.aio.server()` returns."""

    def __init__(
        self,
        thread_pool: Optional[Executor],
        generic_handlers: Optional[Sequence[grpc.GenericRpcHandler]],
        interceptors: Optional[Sequence[Any]],
        options: Any,
        maximum_concurrent_rpcs: Optional[int],
        compression: Optional[grpc.Compression],
    ) -> None:
        interceptors = tuple(interceptors or ())
        _check_interceptors(interceptors)
        if maximum_concurrent_rpcs is not None and maximum_concurrent_rpcs <= 0:
            raise ValueError("maximum_concurrent_rpcs should be a positive integer")
        grpc_options, _ = _config.split_options(options)
        cfg = _config.load(options)
        max_recv = _config.max_receive_length(grpc_options)
        self._max_send = _config.max_send_length(grpc_options)
        self._thread_pool = thread_pool
        self._interceptors = interceptors
        self._stage = _serving.NEW
        # In-flight fast-path calls by ServerCall.key.
        self._calls: dict[int, RpcState] = {}
        # The registered unary-unary `async def` methods served from a plan (no
        # interceptors), read off their handlers when the server starts.
        self._plans: dict[str, _handlers.UnaryPlan] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._bridge: Optional[LoopBridge] = None
        self._token = 0
        # Each call's task starts from a copy of the context start() ran in, as a
        # grpc.aio call's task copies its serving task's.
        self._context = contextvars.copy_context()
        self._stop_deadline: Optional[float] = None
        self._stop_task: Optional[asyncio.Task[Any]] = None
        self._changed: Optional[asyncio.Event] = None
        self._terminated: Optional[asyncio.Event] = None
        # stop() calls still to return: wait_for_termination() returns after them, so
        # what a service does after `await server.stop()` runs before its main task
        # (and asyncio.run, which cancels what is left) goes on.
        self._stoppers = 0
        self._stoppers_gone: Optional[asyncio.Event] = None

        self._core = _serving.core_server(cfg, max_recv, maximum_concurrent_rpcs)
        self._engine = _engine.get_engine(cfg) if self._core is not None else None
        admission = (None if maximum_concurrent_rpcs is None
                     else _serving.Admission(maximum_concurrent_rpcs, self._core))
        gate = _Gate(interceptors, admission) if interceptors or admission else None
        self._grpc = _grpc_originals.aio_server(
            thread_pool,
            interceptors=(gate,) if gate is not None else None,
            options=grpc_options,
            compression=compression,
        )
        self._handlers = _serving.Handlers(self._grpc)
        # Served on the gRPC port even when the fast path is off, so a client learns why.
        self._listener = _bootstrap.FastPathListener(
            self._core, cfg, max_recv,
            compression_disabled=_config.compression_disabled(grpc_options))
        # Registered: no catch-all generic handler of the user's can shadow it. Older
        # grpc.aio releases ignore registered handlers: there the same handlers, as the
        # first generic handler, come before any of the user's.
        bootstrap = _bootstrap_handlers(self._listener)
        self._grpc.add_registered_method_handlers(_bootstrap.BOOTSTRAP_SERVICE, bootstrap)
        self._grpc.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            _bootstrap.BOOTSTRAP_SERVICE, bootstrap),))
        if generic_handlers:
            self.add_generic_rpc_handlers(generic_handlers)

    @property
    def transport_enabled(self) -> bool:
        """True when this server also serves the fast path."""
        return self._core is not None

    # --- handlers -----------------------------------------------------------------------
    def add_generic_rpc_handlers(self, generic_rpc_handlers: Iterable[grpc.GenericRpcHandler]
                                 ) -> None:
        self._handlers.add_generic(tuple(generic_rpc_handlers))

    def add_registered_method_handlers(self, service_name: str,
                                       method_handlers: Mapping[str, grpc.RpcMethodHandler[Any, Any]]
                                       ) -> None:
        self._handlers.add_registered(service_name, method_handlers,
                                      started=self._stage is not _serving.NEW)

    # --- ports --------------------------------------------------------------------------
    def add_insecure_port(self, address: str) -> int:
        return self._grpc.add_insecure_port(address)

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        return self._grpc.add_secure_port(address, server_credentials)

    # --- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        if self._stage is _serving.STARTED:
            return
        if self._stage is not _serving.NEW:
            raise aio.UsageError("Server not in ready state")
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._context = contextvars.copy_context()
        self._changed = asyncio.Event()
        if self._terminated is None:  # wait_for_termination() may have made it
            self._terminated = asyncio.Event()
        core = self._core
        if core is not None:
            if not self._interceptors:
                self._plans = {method: plan for method, handler in
                               self._handlers.all_registered().items()
                               if (plan := unary_plan(handler)) is not None}
            b = bridge(self._engine)
            self._bridge = b
            # The engine server's watch fired: start every waiting call (a planned
            # method's, answered at once, all in C), then every event, as _start_call,
            # _carry_on and _on_event say. The pass holds the server weakly: a server
            # nobody holds may be collected (and stopped) while the loop's bridge lives on.
            self._token = b.register(ServerPass(weakref.ref(self), RpcState, ServicerContext,
                                                _serving.STARTED))
            b.started()  # a server taking calls: the loop polls the engine before sleeping
            core.watch(b.notifier, self._token)
        self._stage = _serving.STARTED
        await self._grpc.start()

    async def stop(self, grace: Optional[float]) -> None:
        if self._stage is _serving.NEW or self._stage is _serving.STOPPED:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() if grace is None else loop.time() + grace
        # A later stop() may shorten the grace, never lengthen it (as grpc).
        if self._stop_deadline is None or deadline < self._stop_deadline:
            self._stop_deadline = deadline
            assert self._changed is not None
            self._changed.set()
        if self._stage is _serving.STARTED:
            self._stage = _serving.STOPPING
            self._listener.close()
            if self._core is not None:
                self._core.shutdown()  # no new fast-path calls
            self._stop_task = loop.create_task(self._finish_stop())
        stopping = self._stop_task
        assert stopping is not None
        if self._stoppers_gone is None:
            self._stoppers_gone = asyncio.Event()
        self._stoppers += 1
        self._stoppers_gone.clear()
        try:
            await asyncio.gather(self._grpc.stop(grace), asyncio.shield(stopping))
        finally:
            self._stoppers -= 1
            if not self._stoppers:
                self._stoppers_gone.set()

    async def _finish_stop(self) -> None:
        loop = asyncio.get_running_loop()
        changed = self._changed
        assert changed is not None
        # In-flight fast-path calls run until the (possibly shortened) grace ends.
        while self._calls:
            remaining = self._stop_deadline - loop.time()  # type: ignore[operator]
            if remaining <= 0:
                break
            changed.clear()
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        try:
            core = self._core
            if core is not None:
                core.cancel_all(_status.STOP_CODE, _status.STOPPED)
            states = list(self._calls.values())
            for state in states:
                state.close_from_peer()
            tasks = [s.task for s in states if s.task is not None]
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            # After cancel_all, so in-flight calls end with its status rather than
            # "connection closed"; frees the connections' rings and fds now.
            self._listener.close_connections()
        finally:
            self._unwatch()
            try:
                await self._grpc.wait_for_termination()
            finally:
                self._stage = _serving.STOPPED
                assert self._terminated is not None
                self._terminated.set()

    def _unwatch(self) -> None:
        b = self._bridge
        if b is not None and self._token:
            b.finished(self._token)
            self._token = 0

    async def wait_for_termination(self, timeout: Optional[float] = None) -> bool:
        # Returns True on timeout (grpc's convention).
        if self._terminated is None:
            self._terminated = asyncio.Event()
        if timeout is None:
            await self._terminated_and_stopped()
            return False
        try:
            await asyncio.wait_for(self._terminated_and_stopped(), timeout)
        except asyncio.TimeoutError:
            return True
        return False

    async def _terminated_and_stopped(self) -> None:
        assert self._terminated is not None
        await self._terminated.wait()
        if self._stoppers_gone is not None:
            await self._stoppers_gone.wait()  # they return in the turns that follow

    def __del__(self) -> None:
        # grpc.aio schedules a stop of a server collected while running; the engine's
        # half at least stops taking calls here (a finalizer must not wait).
        if getattr(self, "_stage", _serving.NEW) is _serving.STARTED:
            core = self._core
            try:
                if core is not None:
                    core.shutdown()
                self._unwatch()
                self._listener.close()
            except Exception:  # noqa: BLE001 - interpreter teardown: best effort
                pass

    # --- fast-path calls ----------------------------------------------------------------
    def _on_event(self, kind: str, sc: Any) -> None:
        if kind == "cancelled":
            state = self._calls.get(sc.key)
            if state is not None:
                state.on_change()
        else:  # over_limit
            self._start_call(sc, sc.method, sc.key, True)

    def _start_call(self, sc: Any, method: str, key: int, refused: bool) -> None:
        """A call the engine gave that the server's pass did not answer itself: not a
        planned method's, or the server is not STARTED."""
        state = RpcState(sc, method, key, self, self._loop)
        plan = None if refused else self._plans.get(method)
        context = self._context.copy()
        # A planned method's call, answered in one crossing when nothing about it needs
        # more (csrc/bindings/aio_serve.cc); otherwise serve() goes on from where that
        # stopped. (A stopped server's calls take serve(), which says so.)
        started = answer_unary(state, plan, context, ServicerContext, self._max_send) \
            if plan is not None and self._stage is not _serving.STOPPED else False
        self._carry_on(state, plan, context, started, refused)

    def _carry_on(self, state: RpcState, plan: Any, context: contextvars.Context,
                  started: Any, refused: bool) -> None:
        """A call from where answer_unary left it (`started`): its handler run by
        serve(), or its end."""
        loop = self._loop
        b = self._bridge
        assert loop is not None and b is not None
        sc = state.sc
        if started is not True:
            # Run right here, in this loop callback (_inline_start, its first step in
            # this frame); the call is watched (and counted in flight) only if its
            # handler waits: one answered at once never needs either.
            coro = serve(self, state, refused, plan, started or None)
            try:
                yielded = context.run(coro.send, None)
            except StopIteration:
                pass
            else:
                task = _inline_start.carry_on(loop, coro, yielded, context)
                state.task = task
                state.token = b.register(state.on_change)
                self._calls[state.key] = state
                sc.watch(b.notifier, state.token)
                # What changed before the watch (a cancellation, room to send) was
                # posted to nobody: look once now.
                state.on_change()
                task.add_done_callback(lambda _t: self._end_call(state))
                return
        # Answered without waiting: _end_call's steps that apply (it has no task, token
        # or place in _calls).
        if not state.status_sent and not state.client_closed and sc.is_active():
            sc.cancel()  # as _end_call
        if state._waiters:
            state.wake_all()  # a task of the handler's own may wait on the call
        if state.callbacks:
            state.run_callbacks()
        # With no task, there is no traceback cycle that could keep its state: if
        # nothing but this frame refers to it (the handler kept no context), it goes,
        # engine handle and all, when this returns, and the release (five engine reads)
        # is not needed.
        if sys.getrefcount(state) > _ONLY_OURS:
            state.release()
        if self._stage is _serving.STOPPING and self._changed is not None:
            self._changed.set()

    def _end_call(self, state: RpcState) -> None:
        """The call's task is done."""
        if not state.status_sent and not state.client_closed and state.sc.is_active():
            # A task that ended without a status (no request came, a failed batch):
            # grpc.aio's core cancels such a call when it lets go of it.
            state.sc.cancel()
        b = self._bridge
        if b is not None and state.token:
            b.unregister(state.token)
        state.wake_all()  # a task of the handler's own may still wait on the call
        if self._calls.get(state.key) is state:
            del self._calls[state.key]
        if state.callbacks:
            state.run_callbacks()
        state.release()
        if self._stage is _serving.STOPPING and self._changed is not None:
            self._changed.set()

    def _find_handler_now(self, state: RpcState) -> Optional[grpc.RpcMethodHandler[Any, Any]]:
        """The call's handler when there are no interceptors (nothing to await)."""
        handler = self._handlers.registered(state.method)
        if handler is not None:
            return handler
        return self._resolve(_serving.HandlerCallDetails(state.method, state))

    async def _intercepted_handler(self, state: RpcState) -> Optional[grpc.RpcMethodHandler[Any, Any]]:
        """The call's handler through the interceptors (grpc.aio resolves registered
        methods first, both by the possibly rewritten details)."""
        handler: Optional[grpc.RpcMethodHandler[Any, Any]] = await intercept(
            self._interceptors, 0, self._resolve_async, _serving.HandlerCallDetails(state.method, state))
        return handler

    async def _resolve_async(self, details: grpc.HandlerCallDetails
                             ) -> Optional[grpc.RpcMethodHandler[Any, Any]]:
        return self._resolve(details)

    def _resolve(self, details: grpc.HandlerCallDetails) -> Optional[grpc.RpcMethodHandler[Any, Any]]:
        handler = self._handlers.registered(details.method)
        return handler if handler is not None else self._handlers.generic(details)


def server(
    migration_thread_pool: Optional[Executor] = None,
    handlers: Optional[Sequence[grpc.GenericRpcHandler]] = None,
    interceptors: Optional[Sequence[Any]] = None,
    options: Any = None,
    maximum_concurrent_rpcs: Optional[int] = None,
    compression: Optional[grpc.Compression] = None,
) -> Server:
    """Drop-in for `grpc.aio.server`; see the module docstring."""
    return Server(migration_thread_pool, handlers, interceptors, options,
                  maximum_concurrent_rpcs, compression)
