"""The attempts of an ``argrpc.aio`` fast-path call whose method has a retry or hedging
policy (gRFC A6, the rules in ``_client.service_config``), and the request feed of such a
call with a request stream.

An attempt is an ordinary fast-path call; the attempt that decides the call is the call,
handed to a ``PendingCall`` that stood in for it meanwhile. An attempt decides the call
when it ends in a way that is not retried, or when its response begins: for a response
stream its first message, for a hedged attempt also response headers with metadata.

A call with a request stream writes through a ``RequestFeed``: each request goes to the
attempts running and into the call's ``RequestBuffer`` (the threaded front end's), which
a later attempt gets first, in order, before anything newer. Requests beyond
``grpc.per_rpc_retry_buffer_size`` commit the call to the attempts running.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import AsyncIterable
from typing import Any, Awaitable, Callable, Optional

from grpc import aio

from .. import _status
from .._grpc_payloads import nbytes
from .._client.service_config import (Attempts, Hedge, HedgingPolicy, RetryPolicy,
                                      response_began)
from .._policy_call import RequestBuffer
from . import _call
from ._pending import PendingCall, _StreamResponse, _UnaryResponse

__all__ = ["Launch", "RequestFeed", "fed_call", "hedged", "retried"]

# One attempt: launch(connection, metadata, timeout) -> the attempt's call object, or None
# when no attempt may start any more (its request stream outgrew the retry buffer).
Launch = Callable[[Any, list[Any], Optional[float]], Awaitable[Optional[Any]]]

_LOGGER = logging.getLogger("argrpc")
_POLL_S = 0.002  # how often running hedged response streams are looked at
_HALF_CLOSED = 'RPC is half closed after calling "done_writing".'


async def retried(channel: Any, fast: Any, md: list[Any], timeout: Optional[float],
                  policy: RetryPolicy, launch: Launch, streaming: bool,
                  feed: Optional["RequestFeed"] = None) -> Any:
    """The call under its retry policy: attempts where the channel routes each, until
    one's status ends the call or, for a response stream, its first message commits it."""
    deadline = None if timeout is None else time.monotonic() + timeout
    attempts = Attempts(policy, channel._throttle, deadline)
    call = None
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        nxt = await launch(fast, attempts.metadata(md), left)
        if nxt is None:
            return call
        call = nxt
        try:
            if streaming:
                first = await call._read_raw()
                if first is not aio.EOF:
                    call._peeked = first  # read again by the caller, first
                    return call
            code = (await call.code()).value[0]
            committed = bool(await call.initial_metadata()) or (
                feed is not None and feed.buffer.overflowed)
            delay = attempts.after(code, committed, await call.trailing_metadata(),
                                   time.monotonic())
            if delay is None:
                return call
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            call.cancel()
            raise
        fast, _ = channel.pick()
        if fast is None or channel.closing:  # off the fast path: that end stands
            return call


async def hedged(channel: Any, fast: Any, md: list[Any], timeout: Optional[float],
                 policy: HedgingPolicy, launch: Launch, streaming: bool) -> Any:
    """The call under its hedging policy (``Hedge``), as the threaded channel hedges:
    the attempt whose response begins first, or whose end is the call's, is the call."""
    hedge = Hedge(policy, channel._throttle,
                  None if timeout is None else time.monotonic() + timeout)
    ended = asyncio.Event()
    try:
        while True:
            now = time.monotonic()
            if hedge.start_now(now):
                if hedge.previous():  # a later attempt goes where the channel routes now
                    fast = channel.pick()[0] or fast
                header = hedge.previous()
                call = await launch(fast, md + [header] if header else md, hedge.left(now))
                if call is None:
                    if hedge.not_started():
                        return hedge.last
                else:
                    call.add_done_callback(lambda _call: ended.set())
                    hedge.add(call)
            ended.clear()
            for call in hedge.running():
                if _began(call, streaming):
                    hedge.commit(call)
                    return call
            for call in hedge.newly_ended():
                if hedge.ended_with((await call.code()).value[0],
                                    await call.trailing_metadata()):
                    return call
            wait = hedge.wait_s(time.monotonic())
            if streaming:
                wait = _POLL_S if wait is None else min(wait, _POLL_S)
            try:
                await asyncio.wait_for(ended.wait(), wait)
            except asyncio.TimeoutError:
                pass
    finally:
        hedge.cancel_rest()


def _began(call: Any, streaming: bool) -> bool:
    """Whether an attempt's response began (`response_began`); a message read to tell
    is kept for the attempt's reader."""
    if call._peeked is not None:
        return True
    began, first = response_began(call._core, streaming)
    if first is not None:
        call._peeked = first
    return began


class RequestFeed:
    """The requests of a call with a request stream under a policy: to the attempts
    running, to the buffer a later attempt replays, and, once the call is decided, to
    its attempt alone."""

    def __init__(self, limit: int, serializer: Optional[Callable[..., Any]],
                 max_send: int) -> None:
        self.buffer = RequestBuffer(limit)
        self._serializer = serializer
        self._max_send = max_send
        # Writes and a new attempt's replay take turns under it: every attempt gets the
        # requests in order.
        self._lock = asyncio.Lock()
        self._live: list[Any] = []
        self._final: Any = None
        self.iterating = False
        self.consumer: Optional[asyncio.Task[Any]] = None

    def launcher(self, start: Callable[[Any, list[Any], Optional[float]], Any]) -> Launch:
        """`launch` for the drivers above: `start` makes an attempt without requests."""
        async def launch(conn: Any, md: list[Any], left: Optional[float]) -> Optional[Any]:
            async with self._lock:
                if self.buffer.overflowed and self._live:
                    return None  # what the call sent is not kept: no attempt after these
                call = start(conn, md, left)
                self._live.append(call)
                for payload in self.buffer.messages:
                    if not await _quietly(call.write(payload)):
                        return call
                if self.buffer.closed:
                    await _quietly(call.done_writing())
                return call
        return launch

    def decided(self, call: Any) -> None:
        self._final = call
        self._live = []

    async def put(self, request: Any) -> None:
        payload = _call.serialize(self._serializer, request)
        async with self._lock:
            final = self._final
            if final is None:
                live = [call for call in self._live if not call.done()]
                if self._max_send >= 0 and _size(payload) > self._max_send:
                    # Fails as one attempt's write fails, and ends the call: commit.
                    self.buffer.overflowed = True
                    for call in live:
                        await call.write(payload)
                    return
                self.buffer.add(payload)
                for call in live:
                    await _quietly(call.write(payload))
                return
        await final.write(payload)

    async def close(self) -> None:
        async with self._lock:
            self.buffer.closed = True
            final = self._final
            if final is None:
                for call in [call for call in self._live if not call.done()]:
                    await _quietly(call.done_writing())
                return
        await final.done_writing()

    def cancel_attempts(self) -> None:
        for call in self._live:
            call.cancel()


def _size(payload: Any) -> int:
    try:
        return nbytes(payload)
    except TypeError:
        return -1  # not a buffer: the attempt's write reports it


async def _quietly(write: Awaitable[Any]) -> bool:
    """A write to an attempt; False if the attempt had ended (the policy decides what
    follows, not the writer)."""
    try:
        await write
        return True
    except (aio.AioRpcError, asyncio.InvalidStateError):
        return False


class _Fed(PendingCall):
    """A request-stream call under a policy: writes go to its feed."""

    _feed: RequestFeed

    async def write(self, request: Any) -> None:
        feed = self._feed
        if feed.iterating:
            raise aio.UsageError(_status.MIXED_APIS)
        if self.done():
            raise asyncio.InvalidStateError(_status.RPC_FINISHED)
        if feed.buffer.closed:
            raise asyncio.InvalidStateError(_HALF_CLOSED)
        await feed.put(request)
        if self.done():
            raise asyncio.InvalidStateError(_status.RPC_FINISHED)

    async def done_writing(self) -> None:
        feed = self._feed
        if feed.iterating:
            raise aio.UsageError(_status.MIXED_APIS)
        if self.done() or feed.buffer.closed:
            return
        await feed.close()

    def cancel(self) -> bool:
        consumer = self._feed.consumer
        if consumer is not None and not consumer.done():
            consumer.cancel()
        return super().cancel()


class FedStreamUnary(_Fed, _UnaryResponse, aio.StreamUnaryCall[Any, Any]):  # type: ignore[misc]
    pass


class FedStreamStream(_Fed, _StreamResponse, aio.StreamStreamCall[Any, Any]):  # type: ignore[misc]
    pass


def fed_call(kind: str, feed: RequestFeed, drive: Callable[[], Awaitable[Any]],
             request_iterator: Any) -> Any:
    """The call object of a request-stream call under a policy: `drive()` makes its
    attempts; `request_iterator` (or the caller's writes) feeds them."""
    loop = asyncio.get_running_loop()

    async def decide() -> Any:
        try:
            call = await drive()
        except asyncio.CancelledError:
            feed.cancel_attempts()
            raise
        feed.decided(call)
        return call

    cls = FedStreamUnary if kind == "stream_unary" else FedStreamStream
    call = cls(decide(), loop)
    call._feed = feed
    if request_iterator is not None:
        feed.iterating = True
        feed.consumer = loop.create_task(_consume(call, request_iterator))
    return call


async def _consume(call: _Fed, request_iterator: Any) -> None:
    feed = call._feed
    try:
        if isinstance(request_iterator, AsyncIterable):
            async for request in request_iterator:
                if not await _fed(call, request):
                    return
        else:
            for request in request_iterator:
                if not await _fed(call, request):
                    return
        if not call.done():
            await feed.close()
    except (aio.AioRpcError, asyncio.InvalidStateError) as e:
        _LOGGER.debug("Exception while consuming the request_iterator: %s", e)
    except BaseException:  # noqa: BLE001 - the user's iterator: cancel the RPC, as grpc.aio
        _LOGGER.debug("Client request_iterator raised exception:\n%s", traceback.format_exc())
        feed.consumer = None  # not this task: it is ending
        call.cancel()


async def _fed(call: _Fed, request: Any) -> bool:
    if call.done():
        return False
    await call._feed.put(request)
    return True
