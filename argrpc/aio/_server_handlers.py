"""Run one fast-path call's handler on the server's loop, as grpc.aio runs one.

The flow, the statuses and their details follow grpc.aio's server
(grpc/_cython/_cygrpc/aio/server.pyx.pxi): `async def` handlers run in the call's task,
plain functions and generators in the migration thread pool (`None`: the loop's default
executor), an exception becomes UNKNOWN "Unexpected <class ...>: ...", and a call the
peer ends under its handler has its task cancelled.
"""

from __future__ import annotations

import asyncio
import inspect
import traceback
from concurrent.futures import Executor
from typing import (Any, AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Optional,
                    Sequence)

import grpc
from grpc import aio

from .. import _grpc_log, _handlers, _serving, _status
from .._handlers import UnaryPlan
from ._inline_start import resume
from ._context import (ExecuteBatchError, RpcState, ServerSide, ServerStoppedError, ServicerContext,
                       SyncServicerContext, deserialize, serialize)

_LOGGER = _grpc_log.AIO



_ASYNC_SEEN: dict[Any, bool] = {}
_NO_METADATA: tuple[Any, ...] = ()

# How far answer_unary got with a planned call when it handed the call back (the first
# item of its tuple; csrc/bindings/aio_serve.cc, Started).
_RAISED, _WAITS, _AWAIT, _RETURNED, _SEND = range(5)

try:
    from .._core import ServerPass as ServerPass
    from .._core import answer_unary as answer_unary
except ImportError:  # no engine: no fast-path calls, so no call is ever answered here
    ServerPass = None  # type: ignore[assignment,misc]
    answer_unary = None  # type: ignore[assignment]


def is_async_handler(handler: Any) -> bool:
    """grpc.aio's test: what is not async runs in the thread pool. Remembered per
    behaviour (three inspect calls cost about a microsecond, every call)."""
    try:
        return _ASYNC_SEEN[handler]
    except (KeyError, TypeError):  # TypeError: an unhashable behaviour
        pass
    verdict = (inspect.isawaitable(handler) or inspect.iscoroutinefunction(handler)
               or inspect.isasyncgenfunction(handler))
    try:
        if len(_ASYNC_SEEN) < 4096:  # behaviours are a service's methods: few, long-lived
            _ASYNC_SEEN[handler] = verdict
    except TypeError:
        pass
    return verdict


async def intercept(interceptors: Sequence[aio.ServerInterceptor], index: int,
                    continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                    details: grpc.HandlerCallDetails) -> Any:
    """The handler through `interceptors[index:]`, then `continuation`."""
    if index == len(interceptors):
        return await continuation(details)
    return await interceptors[index].intercept_service(
        lambda d: intercept(interceptors, index + 1, continuation, d), details)


# --- sync code in the thread pool --------------------------------------------------------
def _blocking_iterator(agen: Any, loop: asyncio.AbstractEventLoop) -> Iterator[Any]:
    """The request stream for a sync handler: each message fetched on the loop."""
    try:
        while True:
            yield asyncio.run_coroutine_threadsafe(agen.__anext__(), loop).result()
    except StopAsyncIteration:
        pass


async def _async_responses(gen: Iterator[Any], loop: asyncio.AbstractEventLoop,
                           pool: Optional[Executor]) -> AsyncIterator[Any]:
    """A sync handler's response generator, iterated in the pool."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    end = object()

    def produce() -> None:
        try:
            for item in gen:
                loop.call_soon_threadsafe(queue.put_nowait, item)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, end)

    future = loop.run_in_executor(pool, produce)
    while True:
        item = await queue.get()
        if item is end:
            break
        yield item
    await future  # the generator's exception, if any


class _MessageReceiver:
    """The request iterator of an async request-streaming handler. An iterator object,
    not an async generator: a generator suspended at its yield keeps the message it
    yielded, and one a cancelled handler left behind keeps it (a large message: a view
    of the peer's pool, and with it the connection) until the garbage collector runs."""

    __slots__ = ("_context",)

    def __init__(self, context: ServicerContext) -> None:
        self._context = context

    def __aiter__(self) -> "_MessageReceiver":
        return self

    async def __anext__(self) -> Any:
        message = await self._context.read()
        if message is aio.EOF:
            raise StopAsyncIteration
        return message


def _request_iterator(context: ServicerContext, behavior: Any) -> Any:
    receiver = _MessageReceiver(context)
    if is_async_handler(behavior):
        return receiver
    return _blocking_iterator(receiver, context._loop)


# --- the arities ------------------------------------------------------------------------
async def _unary_response(state: RpcState, behavior: Any, request: Any,
                          context: ServicerContext, serializer: Optional[Callable[..., Any]]) -> None:
    if is_async_handler(behavior):
        response = await behavior(request, context)
    else:
        sync_context = SyncServicerContext(context)
        response = await state.loop.run_in_executor(state.server._thread_pool, behavior,
                                                    request, sync_context)
        for callback in sync_context._callbacks:
            callback()
    await _unary_status(state, response, serializer)


async def _unary_status(state: RpcState, response: Any,
                        serializer: Optional[Callable[..., Any]]) -> None:
    """A unary response's end: the response (unless the status is an error) and the
    status, in one batch."""
    rest = _end_unary(state, response, serializer)
    if rest is not None:
        await rest


def _end_unary(state: RpcState, response: Any, serializer: Optional[Callable[..., Any]]
               ) -> Optional[Coroutine[Any, Any, None]]:
    """_unary_status's work, done at once when nothing need wait (the common end: no
    coroutine for it); else what is left to await."""
    state.raise_for_termination()
    code = state.status_code
    raw = None
    if code == _status.OK:
        raw = response if serializer is None and type(response) is bytes else \
            serialize(serializer, response)
        if state.server._max_send >= 0:
            too_big = state.check_size(raw)
            if too_big is not None:
                state.status_sent = True
                return state.send_status(_status.RESOURCE_EXHAUSTED, too_big, ())
    # A response beside an error status is dropped by every client: not sent.
    state.metadata_sent = True
    state.status_sent = True
    details = state.status_details
    trailing = state.trailing_metadata
    # At once when it can go out now (the common case: no coroutine for it); trailing
    # metadata and details that are not text take send_status's checks.
    # quiet: the call's end is not posted to the loop (nobody waits for it).
    if not trailing and type(details) is str and \
            state.sc.try_finish(code, details, _NO_METADATA, raw, True) >= 0:
        return None
    return state.send_status(code, details, trailing, raw)


async def _stream_responses(state: RpcState, behavior: Any, request: Any,
                            context: ServicerContext) -> None:
    if inspect.iscoroutinefunction(behavior):
        await behavior(request, context)  # writes with context.write()
    else:
        if inspect.isasyncgenfunction(behavior):
            responses = behavior(request, context)
        else:
            responses = _async_responses(behavior(request, SyncServicerContext(context)),
                                         state.loop, state.server._thread_pool)
        try:
            async for response in responses:
                state.raise_for_termination()
                await context.write(response)
        finally:
            # Cancelled while writing: the generator is suspended at its yield, and
            # its own cleanup (finally, except CancelledError) runs now, not whenever
            # the garbage collector gets to it.
            # (Not one still running: its own frame is unwinding the cancellation.)
            close = getattr(responses, "aclose", None)
            if close is not None and not getattr(responses, "ag_running", False):
                try:
                    await close()
                except RuntimeError:  # closed meanwhile by its own unwinding
                    pass
    state.raise_for_termination()
    state.metadata_sent = True
    state.status_sent = True
    await state.send_status(state.status_code, state.status_details, state.trailing_metadata)


async def _handle(state: RpcState, handler: grpc.RpcMethodHandler[Any, Any]) -> None:
    deserializer = handler.request_deserializer
    serializer = handler.response_serializer
    if not handler.request_streaming:
        raw = state.sc.try_recv()  # a unary request is usually there already
        if raw is None or raw is False:
            raw = await state.recv()
        if raw is None:
            return  # ended before its request came (grpc.aio: no status either)
        request = deserialize(deserializer, raw)
        if handler.response_streaming:
            await _stream_responses(state, handler.unary_stream, request,
                                    ServicerContext(state, deserializer, serializer))
        else:
            await _unary_response(state, handler.unary_unary, request,
                                  ServicerContext(state, None, None), serializer)
    elif handler.response_streaming:
        context = ServicerContext(state, deserializer, serializer)
        await _stream_responses(state, handler.stream_stream,
                                _request_iterator(context, handler.stream_stream), context)
    else:
        context = ServicerContext(state, deserializer, None)
        await _unary_response(state, handler.stream_unary,
                              _request_iterator(context, handler.stream_unary), context,
                              serializer)


async def _handle_rpc(server: ServerSide, state: RpcState, refused: bool) -> None:
    handler = server._find_handler_now(state) if not server._interceptors \
        else await server._intercepted_handler(state)
    if handler is None:
        state.status_sent = True
        await state.send_status(_status.UNIMPLEMENTED, "Method not found!", ())
        return
    if refused:
        # Over maximum_concurrent_rpcs: the interceptors saw it, then grpc's status.
        state.status_sent = True
        await state.send_status(_status.RESOURCE_EXHAUSTED, _status.OVER_LIMIT, ())
        return
    await _handle(state, handler)


def unary_plan(handler: grpc.RpcMethodHandler[Any, Any]) -> Optional[UnaryPlan]:
    """The plan of a unary-unary `async def` method; None for every other kind and for
    a plain function (it runs in the migration pool)."""
    plan = _handlers.unary_plan(handler)
    return plan if plan is not None and is_async_handler(plan.behavior) else None


async def serve(server: ServerSide, state: RpcState, refused: bool = False,
                plan: Optional[UnaryPlan] = None, started: Optional[tuple[Any, ...]] = None
                ) -> None:
    """The call's task: its handler (`plan`: a registered unary-unary method's, found
    already), and grpc.aio's answer to whatever it raises. `started`: how far
    answer_unary took the planned call before it handed it back."""
    method = state.method
    try:
        try:
            if started is not None:
                assert plan is not None
                kind = started[0]
                if kind == _RAISED:
                    raise started[1]
                if kind == _SEND:  # marked sent; the end waits for room
                    await state.send_status(state.status_code, state.status_details,
                                            state.trailing_metadata, started[1])
                else:
                    response = (await resume(started[1], started[2]) if kind == _WAITS else
                                await started[1] if kind == _AWAIT else started[1])
                    rest = _end_unary(state, response, plan.serializer)
                    if rest is not None:
                        await rest
            elif plan is None:
                await _handle_rpc(server, state, refused)
            else:
                # A registered unary-unary `async def` method, from its plan: the steps
                # of _handle_rpc, _handle and _unary_response in this frame.
                raw = state.sc.try_recv()  # a unary request is usually there already
                if raw is None or raw is False:
                    raw = await state.recv()
                # None: ended before its request came (grpc.aio: no status either)
                if raw is not None:
                    deserializer = plan.deserializer
                    response = await plan.behavior(raw if deserializer is None else
                                                   deserialize(deserializer, raw),
                                                   ServicerContext(state, None, None))
                    rest = _end_unary(state, response, plan.serializer)
                    if rest is not None:
                        await rest
        except aio.AbortError as exc:
            if state.abort_exception is not exc:
                _LOGGER.error("Abort error has been replaced in method [%s]", method)
            return
        else:
            if state.abort_exception is not None:
                _LOGGER.error("Abort error unexpectedly suppressed: %s",
                              traceback.format_exception(state.abort_exception))
    except (KeyboardInterrupt, SystemExit):
        raise
    except asyncio.CancelledError:
        _LOGGER.debug("RPC cancelled for servicer method [%s]", method)
    except ServerStoppedError:
        _LOGGER.warning("Aborting method [%s] due to server stop.", method)
    except ExecuteBatchError:
        if not state.client_closed:
            _LOGGER.exception("ExecuteBatchError raised in core by servicer method [%s]",
                              method)
    except Exception as exc:  # noqa: BLE001 - the application's: a status, as grpc.aio
        _LOGGER.exception("Unexpected [%s] raised by servicer method [%s]",
                          type(exc).__name__, method)
        if not state.status_sent and not state.client_closed and \
                server._stage is not _serving.STOPPED:
            # A code the handler set wins over UNKNOWN.
            code = _status.UNKNOWN if state.status_code == _status.OK else state.status_code
            state.status_sent = True
            try:
                details = "Unexpected %s: %s" % (type(exc), exc)
            except Exception:  # noqa: BLE001 - an exception whose __str__ raises
                details = "Unexpected %s" % (type(exc),)
            await state.send_status(code, details, state.trailing_metadata)
