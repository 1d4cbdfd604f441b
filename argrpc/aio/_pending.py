"""Call objects for a call that cannot start yet: its channel is negotiating (the
first calls of a channel). Each is the ``grpc.aio`` call class of its arity and hands
every operation to the real call (fast path or grpc.aio) once routing made it."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable, Coroutine, Generator, Optional

from grpc import aio

__all__ = ["PendingCall"]


class PendingCall:
    def __init__(self, start: Coroutine[Any, Any, Any]) -> None:
        self._task = asyncio.get_running_loop().create_task(start)
        self._callbacks: list[Callable[[Any], None]] = []
        self._cancelled_early = False
        self._task.add_done_callback(self._started)

    @staticmethod
    def make(kind: str, start: Coroutine[Any, Any, Any]) -> "PendingCall":
        return _CLASSES[kind](start)

    def _started(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        inner = task.result()
        for cb in self._callbacks:
            inner.add_done_callback(lambda _c, cb=cb: cb(self))
        self._callbacks.clear()

    async def _inner(self) -> Any:
        try:
            return await asyncio.shield(self._task)
        except asyncio.CancelledError:
            if not self._task.done():
                self.cancel()
            raise

    def _inner_now(self) -> Optional[Any]:
        t = self._task
        if t.done() and not t.cancelled() and t.exception() is None:
            return t.result()
        return None

    # -- grpc.aio.RpcContext
    def cancelled(self) -> bool:
        inner = self._inner_now()
        return inner.cancelled() if inner is not None else self._cancelled_early

    def done(self) -> bool:
        inner = self._inner_now()
        return inner.done() if inner is not None else self._task.done()

    def time_remaining(self) -> Optional[float]:
        inner = self._inner_now()
        return inner.time_remaining() if inner is not None else None

    def cancel(self) -> bool:
        inner = self._inner_now()
        if inner is not None:
            return inner.cancel()
        if self._task.done():
            return False
        self._cancelled_early = True
        self._task.cancel()
        return True

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        inner = self._inner_now()
        if inner is not None:
            inner.add_done_callback(lambda _c: callback(self))
        elif self._task.done():
            callback(self)
        else:
            self._callbacks.append(callback)

    # -- grpc.aio.Call
    async def initial_metadata(self) -> aio.Metadata:
        return await (await self._inner()).initial_metadata()

    async def trailing_metadata(self) -> aio.Metadata:
        return await (await self._inner()).trailing_metadata()

    async def code(self) -> Any:
        return await (await self._inner()).code()

    async def details(self) -> str:
        return await (await self._inner()).details()

    async def wait_for_connection(self) -> None:
        await (await self._inner()).wait_for_connection()

    async def debug_error_string(self) -> str:
        return await (await self._inner()).debug_error_string()


class _UnaryResponse(PendingCall):
    def __await__(self) -> Generator[Any, None, Any]:
        inner = yield from self._inner().__await__()
        return (yield from inner.__await__())


class _StreamResponse(PendingCall):
    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        async for message in await self._inner():
            yield message

    async def read(self) -> Any:
        return await (await self._inner()).read()


class _StreamRequest:
    async def write(self, request: Any) -> None:
        await (await self._inner()).write(request)  # type: ignore[attr-defined]

    async def done_writing(self) -> None:
        await (await self._inner()).done_writing()  # type: ignore[attr-defined]


class UnaryUnary(_UnaryResponse, aio.UnaryUnaryCall):
    pass


class UnaryStream(_StreamResponse, aio.UnaryStreamCall):
    pass


class StreamUnary(_StreamRequest, _UnaryResponse, aio.StreamUnaryCall):
    pass


class StreamStream(_StreamRequest, _StreamResponse, aio.StreamStreamCall):
    pass


_CLASSES = {"unary_unary": UnaryUnary, "unary_stream": UnaryStream,
            "stream_unary": StreamUnary, "stream_stream": StreamStream}
