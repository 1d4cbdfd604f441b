"""Call objects whose real call a task makes first: a call made while its channel
negotiates (the first calls of a channel), and every call that goes through client
interceptors. They behave as grpc.aio's intercepted calls do: an operation waits for the
real call (fast path or grpc.aio) and goes to it; cancel() before that cancels the task.

Intercepted calls also follow grpc.aio in how streams are read and written: responses
are read through one iterator (so read() and iteration may be mixed), and the
interceptors of a call written with write()/done_writing() get an iterator of those
writes as the request iterator.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable, Coroutine, Generator, Optional, cast

import grpc
from grpc import aio

from .. import _status

__all__ = ["PendingCall"]

_HALF_CLOSED = 'RPC is half closed after calling "done_writing".'
_FINISH = object()  # the end of a write-style request stream


class PendingCall:
    """The grpc.aio call interface over a task that makes the real call."""

    def __init__(self, start: Coroutine[Any, Any, Any], loop: asyncio.AbstractEventLoop,
                 requests: Optional["RequestProxy"] = None) -> None:
        self._task = loop.create_task(start)
        self._pending_callbacks: list[Callable[[Any], None]] = []
        self._requests = requests
        self._response_aiter: Optional[AsyncIterator[Any]] = None
        self._task.add_done_callback(self._started)

    @staticmethod
    def make(kind: str, start: Coroutine[Any, Any, Any],
             loop: Optional[asyncio.AbstractEventLoop] = None) -> "PendingCall":
        """A call routed once its channel negotiated."""
        return _PLAIN[kind](start, loop or asyncio.get_running_loop())

    @staticmethod
    def intercepted(kind: str, start: Coroutine[Any, Any, Any],
                    loop: asyncio.AbstractEventLoop,
                    requests: Optional["RequestProxy"] = None) -> "PendingCall":
        """A call whose interceptors run in `start`."""
        return _INTERCEPTED[kind](start, loop, requests)

    def _call_now(self) -> Optional[Any]:
        """The real call if it was made."""
        t = self._task
        if t.done() and not t.cancelled() and t.exception() is None:
            return t.result()
        return None

    def _started(self, task: asyncio.Task[Any]) -> None:
        callbacks, self._pending_callbacks = self._pending_callbacks, []
        call = self._call_now()
        for cb in callbacks:
            if call is None or call.done():
                cb(self)
            else:
                call.add_done_callback(lambda _c, cb=cb: cb(self))

    async def real_call(self) -> Any:
        """The real call, once made; a cancelled waiter cancels it (as for await)."""
        return await self._task

    async def _settled(self) -> tuple[Optional[aio.Call], Optional[aio.AioRpcError]]:
        """(real call, None), or (None, the error that ended the call before it was
        made), or (None, None) if it was cancelled before; a cancelled waiter does not
        cancel the call (as for code() or the metadata of grpc.aio's calls)."""
        try:
            return await asyncio.shield(self._task), None
        except aio.AioRpcError as e:
            return None, e
        except asyncio.CancelledError:
            if self._task.cancelled():
                return None, None
            raise

    # -- grpc.aio.RpcContext
    def cancelled(self) -> bool:
        t = self._task
        if t.cancelled():
            return True
        if not t.done():
            return False
        exc = t.exception()
        if exc is not None:
            return isinstance(exc, aio.AioRpcError) and exc.code() == grpc.StatusCode.CANCELLED
        cancelled: bool = t.result().cancelled()
        return cancelled

    def done(self) -> bool:
        t = self._task
        if not t.done():
            return False
        call = self._call_now()
        return call is None or call.done()

    def time_remaining(self) -> Optional[float]:
        call = self._call_now()
        return call.time_remaining() if call is not None else None

    def cancel(self) -> bool:
        t = self._task
        if t.cancelled():
            return False
        if not t.done():
            return t.cancel()
        call = self._call_now()
        return call.cancel() if call is not None else False

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if not self._task.done():
            self._pending_callbacks.append(callback)
            return
        call = self._call_now()
        if call is None or call.done():
            callback(self)
        else:
            call.add_done_callback(lambda _c: callback(self))

    # -- grpc.aio.Call
    async def initial_metadata(self) -> Optional[aio.Metadata]:
        call, error = await self._settled()
        if call is None:
            return error.initial_metadata() if error is not None else None
        return await call.initial_metadata()

    async def trailing_metadata(self) -> Optional[aio.Metadata]:
        call, error = await self._settled()
        if call is None:
            return error.trailing_metadata() if error is not None else None
        return await call.trailing_metadata()

    async def code(self) -> grpc.StatusCode:
        call, error = await self._settled()
        if call is None:
            return error.code() if error is not None else grpc.StatusCode.CANCELLED
        return await call.code()

    async def details(self) -> str:
        call, error = await self._settled()
        if call is None:
            # an error that ended a call carries its details (grpc's stubs allow None)
            return cast(str, error.details()) if error is not None else _status.LOCALLY_CANCELLED
        return await call.details()

    async def debug_error_string(self) -> Optional[str]:
        call, error = await self._settled()
        if call is None:
            return error.debug_error_string() if error is not None else ""
        # grpc.aio's calls (and argrpc's) have it; the Call ABC does not declare it
        debug: Optional[str] = await cast(Any, call).debug_error_string()
        return debug

    async def wait_for_connection(self) -> None:
        await (await self.real_call()).wait_for_connection()


class _UnaryResponse(PendingCall):
    def __await__(self) -> Generator[Any, None, Any]:
        call = yield from self._task.__await__()
        return (yield from call.__await__())


class _StreamResponse(PendingCall):
    """Responses as the real call gives them (routing only)."""

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[Any]:
        async for message in await self.real_call():
            yield message

    async def read(self) -> Any:
        return await (await self.real_call()).read()


class _InterceptedStreamResponse(PendingCall):
    """Responses through one iterator, which read() advances too (grpc.aio)."""

    async def _responses(self) -> AsyncIterator[Any]:
        async for message in await self.real_call():
            yield message

    def __aiter__(self) -> AsyncIterator[Any]:
        if self._response_aiter is None:
            self._response_aiter = self._responses()
        return self._response_aiter

    async def read(self) -> Any:
        responses = self.__aiter__()
        try:
            return await responses.__anext__()
        except StopAsyncIteration:
            return aio.EOF


class _StreamRequest(PendingCall):
    async def write(self, request: Any) -> None:
        await (await self.real_call()).write(request)

    async def done_writing(self) -> None:
        await (await self.real_call()).done_writing()


class _InterceptedStreamRequest(PendingCall):
    """write()/done_writing() feed the iterator the interceptors were given."""

    async def write(self, request: Any) -> None:
        requests = self._requests
        if requests is None:
            raise aio.UsageError(_status.MIXED_APIS)
        try:
            call = await self._task
        except (asyncio.CancelledError, aio.AioRpcError):
            raise asyncio.InvalidStateError(_status.RPC_FINISHED) from None
        if call.done():
            raise asyncio.InvalidStateError(_status.RPC_FINISHED)
        if getattr(call, "_done_writing_flag", False):
            raise asyncio.InvalidStateError(_HALF_CLOSED)
        await requests.put(request, call)
        if call.done():
            raise asyncio.InvalidStateError(_status.RPC_FINISHED)

    async def done_writing(self) -> None:
        requests = self._requests
        if requests is None:
            raise aio.UsageError(_status.MIXED_APIS)
        try:
            call = await self._task
        except asyncio.CancelledError:
            raise asyncio.InvalidStateError(_status.RPC_FINISHED) from None
        await requests.put(_FINISH, call)


class RequestProxy:
    """The request iterator of an intercepted call written with write(): one request
    at a time, each put waiting until the call takes it or ends."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=1)
        self._status: Optional[asyncio.Task[Any]] = None
        self._owner: Optional[PendingCall] = None

    def bind(self, owner: PendingCall) -> None:
        self._owner = owner

    async def iterate(self) -> AsyncIterator[Any]:
        # Nothing is sent before the interceptors made the call (as grpc.aio).
        assert self._owner is not None
        await self._owner._task
        while True:
            value = await self._queue.get()
            if value is _FINISH:
                return
            yield value

    async def put(self, value: Any, call: Any) -> None:
        loop = asyncio.get_running_loop()
        if self._status is None:
            self._status = loop.create_task(call.code())
        put = loop.create_task(self._queue.put(value))
        try:
            await asyncio.wait((put, self._status), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not put.done():  # the call ended first
                put.cancel()


# ignore[misc] below: the metadata of a call cancelled before it was made is None, as
# grpc.aio's intercepted calls answer; grpc's stubs say Metadata.
class UnaryUnary(_UnaryResponse, aio.UnaryUnaryCall[Any, Any]):  # type: ignore[misc]
    pass


class UnaryStream(_StreamResponse, aio.UnaryStreamCall[Any, Any]):  # type: ignore[misc]
    pass


class StreamUnary(_StreamRequest, _UnaryResponse,  # type: ignore[misc]
                  aio.StreamUnaryCall[Any, Any]):
    pass


class StreamStream(_StreamRequest, _StreamResponse,  # type: ignore[misc]
                   aio.StreamStreamCall[Any, Any]):
    pass


class InterceptedUnaryStream(_InterceptedStreamResponse,  # type: ignore[misc]
                             aio.UnaryStreamCall[Any, Any]):
    pass


class InterceptedStreamUnary(_InterceptedStreamRequest, _UnaryResponse,  # type: ignore[misc]
                             aio.StreamUnaryCall[Any, Any]):
    pass


class InterceptedStreamStream(_InterceptedStreamRequest,  # type: ignore[misc]
                              _InterceptedStreamResponse, aio.StreamStreamCall[Any, Any]):
    pass


_PLAIN: dict[str, type[PendingCall]] = {
    "unary_unary": UnaryUnary, "unary_stream": UnaryStream,
    "stream_unary": StreamUnary, "stream_stream": StreamStream}
_INTERCEPTED: dict[str, type[PendingCall]] = {
    "unary_unary": UnaryUnary, "unary_stream": InterceptedUnaryStream,
    "stream_unary": InterceptedStreamUnary, "stream_stream": InterceptedStreamStream}
