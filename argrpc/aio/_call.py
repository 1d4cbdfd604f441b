"""Fast-path call objects of ``argrpc.aio``: what a ``grpc.aio`` multicallable returns,
over a ``_core.ClientCall`` that never makes the loop wait.

Each call is watched by its loop's notifier (``_loop.py``): the engine posts the call's
token on every change of its state, and the loop wakes the coroutines waiting on it,
which ask the call again with the engine's non-blocking ``try_*`` methods. A send that
would wait for stream window is retried when the watch fires; one that would wait for
pool room, after a short timer (the pool does not notify), within the call's deadline.
"""

from __future__ import annotations

import asyncio
import time
import traceback
import weakref
from typing import (TYPE_CHECKING, Any, AsyncIterable, AsyncIterator, Callable, Generator,
                    NoReturn, Optional)

import grpc
from grpc import aio

from .. import _grpc_log, _status
from .._grpc_payloads import nbytes
from .._errors import code_from_int, codec_failed, received_too_large
from .._metadata import from_core
from ._loop import LoopBridge

try:
    from .._core import CallState, UnaryCallState
    from .._core import make_unary_call as make_unary_call
except ImportError:  # no engine: every call is grpc.aio's, and these are never made
    class CallState:  # type: ignore[no-redef]
        pass

    class UnaryCallState(CallState):  # type: ignore[no-redef]
        pass

    make_unary_call = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from .._core import ClientCall

    # (code, details, trailing metadata in the engine's form)
    _Status = tuple[grpc.StatusCode, str, Any]

__all__ = ["FastCall", "StreamStreamCall", "StreamUnaryCall", "UnaryStreamCall",
           "UnaryUnaryCall", "aio_metadata", "rpc_error"]

_LOGGER = _grpc_log.AIO_CALL

_GC_CANCEL = "Cancelled upon garbage collection!"
_HALF_CLOSED = 'RPC is half closed after calling "done_writing".'
_CANCELLED = grpc.StatusCode.CANCELLED
_CORE_WRITE_FAILED = "Internal error from Core"  # what grpc.aio's write() raises then


def too_large_details(n: int, limit: int) -> str:
    """grpc's words for a request over grpc.max_send_message_length (or the method's
    maxRequestMessageBytes)."""
    return f"CLIENT: Sent message larger than max ({n} vs. {limit})"
_OK = grpc.StatusCode.OK
_POOL_RETRY_FIRST_S = 0.001
_POOL_RETRY_MAX_S = 0.010
_UNKNOWN_STYLE, _ITERATOR_STYLE, _READER_WRITER_STYLE = 0, 1, 2


def aio_metadata(core_md: Any) -> aio.Metadata:
    """Engine metadata -> ``grpc.aio.Metadata`` (only ``-bin`` values stay bytes)."""
    return aio.Metadata(*from_core(core_md)) if core_md else aio.Metadata()


def rpc_error(code: grpc.StatusCode, details: str, imd: Any = None, tmd: Any = None,
              debug: Optional[str] = None) -> aio.AioRpcError:
    return aio.AioRpcError(code, aio_metadata(imd), aio_metadata(tmd), details,
                           debug if debug is not None else f"{code.name}:{details}")


def _set_done(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_result(None)


def serialize(serializer: Optional[Callable[..., Any]], request: Any) -> Any:
    """The request's payload. As grpc.aio: a serializer that raises is logged and an
    empty message goes out instead, as for one that returns None."""
    if serializer is None:
        return request
    try:
        payload = serializer(request)
    except Exception as exc:  # noqa: BLE001 - user code
        codec_failed("serializing", exc)
        return b""
    return b"" if payload is None else payload


def _deserialize(raw: Any, deserializer: Optional[Callable[..., Any]]) -> Any:
    # grpc.aio logs a failing deserializer and hands the application None.
    if deserializer is None:
        return raw
    try:
        return deserializer(raw)
    except Exception:  # noqa: BLE001 - user code
        _grpc_log.CODEC.exception("Exception deserializing message!")
        return None


class Unsent(Exception):
    """A call that ended UNAVAILABLE without leaving the process (its connection failed
    after the channel chose it): the channel starts it again where it routes it now."""


def _watched(conn: Any, bridge: LoopBridge, token: int, retry_unsent: bool, method: str,
             metadata: list[Any], timeout: Optional[float], send_headers_now: bool) -> Any:
    """An engine call watched with `token`; raises Unsent as the constructors below do."""
    core = conn.start_watched(method, metadata, timeout, bridge.notifier, token,
                              send_headers_now, retry_unsent)
    if core is None:
        bridge.unregister(token)
        raise Unsent
    return core


class FastCall(CallState):
    """What every fast-path call shares: its engine call, its watch, its waiters, its
    status and done callbacks (``grpc.aio.Call``'s part). Its fields and its end
    (``_on_end``) are CallState's, in the engine's module: a call needs no instance
    dict, and an OK unary call ends without a Python frame."""

    _bridge: LoopBridge
    _core: ClientCall
    # A request the engine could not take (not a buffer): grpc.aio raises its TypeError
    # where the call is awaited or read, not where it is made.
    _send_error: Optional[BaseException]
    max_send: int  # the request size limit of the call's method (-1: none)
    max_response: int  # its maxResponseMessageBytes, beyond the channel's (-1: none)
    over_limit_ends_in_core_error = False
    # A response read ahead to tell whether a streaming call has any left (read()).
    _peeked: Any
    # What sends for the call after it was made: the request a unary call could not
    # send at once, the requests of an iterator.
    _sender: Optional[asyncio.Task[Any]]
    _request_poller: Optional[asyncio.Task[Any]]
    _waiters: Optional[list[asyncio.Future[Any]]]
    _done_callbacks: Optional[list[Callable[[Any], None]]]
    _status: Optional[_Status]
    _imd: Optional[aio.Metadata]
    _locally_cancelled: bool
    _ended: bool

    def __init__(self, channel: Any, bridge: LoopBridge, core_call: ClientCall, token: int,
                 timeout: Optional[float], response_deserializer: Optional[Callable[..., Any]]) -> None:
        self._channel = channel
        self._bridge = bridge
        self._core = core_call
        self._token = token
        if timeout is not None:
            self._deadline = time.time() + timeout
        self._deserializer = response_deserializer
        bridge.started()
        channel.inflight += 1

    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        return self._bridge.loop

    # -- the watch --------------------------------------------------------------
    # _on_change (CallState, in C) is the call's token callback: it wakes the tasks
    # waiting in _future, and ends a call whose engine side has settled.

    def _run_callback(self, cb: Callable[[Any], None]) -> None:
        try:
            cb(self)
        except Exception:  # noqa: BLE001 - user code must not break the loop's dispatch
            # grpc.aio raises it in the call's awaiter instead; logged where grpc.aio
            # logs its server's callbacks, so it is as quiet as grpc's own.
            _grpc_log.AIO.exception("Exception calling done callback of %r", self)

    def _future(self) -> asyncio.Future[Any]:
        """A future the next change of the call completes."""
        fut = self._loop.create_future()
        if self._waiters is None:
            self._waiters = [fut]
        else:
            self._waiters.append(fut)
        return fut

    async def _changed(self, cancel_call: bool = False) -> None:
        """Waits for the next change. A reader whose task is cancelled cancels the call
        (`cancel_call`); one waiting for metadata or the status does not (grpc.aio)."""
        fut = self._future()
        try:
            await fut
        except asyncio.CancelledError:
            if cancel_call and not self.done():
                self.cancel()
            raise

    def _detach(self) -> None:
        self._bridge.unregister(self._token)

    def _collected(self) -> None:
        """Collected before it ended (CallState's finalizer): cancelled, as grpc.aio's."""
        try:
            if not self._core.done():
                self._core.cancel(_status.CANCELLED, _GC_CANCEL)
            self._bridge.finished(self._token)
            self._channel.inflight -= 1
            if self._channel.closing:
                self._channel.call_ended()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    @staticmethod
    def _deserialize_error(exc: BaseException) -> None:
        """A response deserializer raised `exc` in CallState's await: logged as
        _deserialize logs it."""
        _grpc_log.CODEC.error("Exception deserializing message!", exc_info=exc)

    # -- grpc.aio.RpcContext ----------------------------------------------------
    def cancelled(self) -> bool:
        status = self._final_status()
        return status is not None and status[0] is _CANCELLED

    def done(self) -> bool:
        return self._ended or self._core.settled()

    def time_remaining(self) -> Optional[float]:
        if self._deadline is None:
            return None
        return max(self._deadline - time.time(), 0.0)

    def cancel(self) -> bool:
        if self.done():
            return False
        # The engine's answer decides: the server's status may have ended the call since
        # done() looked (the progress thread does not wait for the loop).
        if not self._core.cancel(_status.CANCELLED, _status.LOCALLY_CANCELLED):
            return False
        self._locally_cancelled = True
        for task in (self._request_poller, self._sender):
            if task is not None and not task.done():
                task.cancel()
        return True

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if self.done():
            if not self._ended:
                self._on_end()
            callback(self)  # raises what it raises, as grpc.aio's does for a done call
        else:
            if self._done_callbacks is None:
                self._done_callbacks = []
            self._done_callbacks.append(callback)

    # -- grpc.aio.Call ----------------------------------------------------------
    async def initial_metadata(self) -> aio.Metadata:
        while True:
            md = self._core.try_initial_metadata()
            if md is not None:
                if md is False:
                    return aio.Metadata()
                if self._imd is None:
                    self._imd = aio_metadata(md)
                return self._imd
            await self._changed()

    async def _wait_status(self) -> _Status:
        while True:
            status = self._final_status()
            if status is not None:
                return status
            await self._changed()

    def _final_status(self) -> Optional[_Status]:
        if self._status is None:
            raw = self._core.try_status()
            if raw is None:
                return None
            code, details, tmd = raw
            if (code == _status.CANCELLED and details == _status.CHANNEL_CLOSED
                    and self._channel.closing):
                # grpc.aio's close() cancels the calls in flight, as cancel() does: the
                # engine's close of the connection stands for that here.
                self._locally_cancelled = True
                status, details = _CANCELLED, _status.LOCALLY_CANCELLED
            else:
                status, details = code_from_int(code, details)
            self._status = (status, details, tmd)
        return self._status

    async def trailing_metadata(self) -> aio.Metadata:
        return aio_metadata((await self._wait_status())[2])

    async def code(self) -> grpc.StatusCode:
        return (await self._wait_status())[0]

    async def details(self) -> str:
        return (await self._wait_status())[1]

    async def debug_error_string(self) -> str:
        status = await self._wait_status()
        return "" if status[0] is _OK else f"{status[0].name}:{status[1]}"

    async def wait_for_connection(self) -> None:
        # The fast path is connected before a call starts; a call that already failed
        # says so, as grpc.aio's does.
        if self.done() or self._send_error is not None:
            await self._raise_for_status()

    async def _raise_for_status(self) -> None:
        if self._send_error is not None:
            raise self._send_error
        status = await self._wait_status()
        if self._locally_cancelled:
            raise asyncio.CancelledError()
        if status[0] is not _OK:
            raise await self._error(status)

    async def _error(self, status: tuple[Any, ...]) -> aio.AioRpcError:
        imd = self._core.try_initial_metadata()
        return rpc_error(status[0], status[1], imd or None, status[2])

    def __repr__(self) -> str:
        status = self._final_status()
        if status is None:
            return f"<{type(self).__name__} object>"
        code, details = status[0], status[1]
        if code is _OK:
            return (f'<{type(self).__name__} of RPC that terminated with:\n\tstatus = {code}\n'
                    f'\tdetails = "{details}"\n>')
        return (f'<{type(self).__name__} of RPC that terminated with:\n\tstatus = {code}\n'
                f'\tdetails = "{details}"\n\tdebug_error_string = "{code.name}:{details}"\n>')

    __str__ = __repr__

    # -- sending -----------------------------------------------------------------
    async def _send(self, payload: Any, half_close: bool = False) -> bool:
        """Sends one message; False if the call had ended."""
        delay = _POOL_RETRY_FIRST_S
        while True:
            r = self._core.try_send(payload, half_close)
            if r >= 0:
                return r == 1
            # No window (the watch fires when the reader makes room) or no pool room
            # (retry shortly). The deadline ends the call in the engine either way, except
            # before its headers went out, which only this side knows: there the last
            # try ends it as a thread's send would (no pool room names TF_RDMA_BUF_SIZE).
            if self._deadline is not None and time.time() >= self._deadline:
                if self._core.try_send(payload, half_close, True) == 1:
                    return True
                if not self._core.done():
                    self._core.cancel(_status.DEADLINE_EXCEEDED, "Deadline Exceeded")
                return False
            fut = self._future()
            timer = self._loop.call_later(delay, _set_done, fut)
            try:
                await fut
            except asyncio.CancelledError:
                if not self.done():
                    self.cancel()
                raise
            finally:
                timer.cancel()
            delay = min(delay * 2, _POOL_RETRY_MAX_S)

    # -- receiving ---------------------------------------------------------------
    async def _read_raw(self) -> Any:
        """The next message (raw), or aio.EOF."""
        if self._send_error is not None:
            raise self._send_error
        msg = self._peeked
        if msg is not None:
            self._peeked = None
            return msg
        while True:
            msg = self._core.try_recv()
            if msg is None and self._bridge.poll_if_idle():
                msg = self._core.try_recv()
            if msg is None:
                await self._changed(True)
                continue
            if msg is False:
                return aio.EOF
            if self.max_response >= 0 and (n := nbytes(msg)) > self.max_response:
                await self._refuse_response(n)
            return msg

    async def _refuse_response(self, n: int) -> None:
        """A response over the method's limit ends the call as grpc.aio's does, whatever
        the server said after it."""
        ended = self._core.try_status()
        status = (grpc.StatusCode.RESOURCE_EXHAUSTED, received_too_large(n, self.max_response),
                  ended[2] if ended is not None else [])
        self._status = status
        self._core.cancel(_status.RESOURCE_EXHAUSTED, status[1])
        await self._raise_for_status()

    def _drained(self) -> bool:
        """The call ended and every response was read: what grpc.aio's done() means for
        a streaming call, whose status waits for the reader there."""
        if self._peeked is not None or not self._core.done():
            return False
        msg = self._core.try_recv()
        if msg is False:
            return True
        if msg is not None:
            self._peeked = msg
        return False


class _UnaryResponse(UnaryCallState, FastCall):
    """A call with one response. Its loop's bridge holds it until it ends, as grpc.aio's
    task does: a call nobody awaits still runs to its end (fire and forget). A call
    with a response stream is the caller's alone: dropped, it is cancelled."""

    def _settle(self, outcome: tuple[int, str, Any, Any, Any]) -> Any:
        """The end of the await (UnaryCallState's) for what it does not finish itself:
        the result, or the call's error raised."""
        if not self._ended:
            self._on_end()
        if self._send_error is not None:
            raise self._send_error
        code, details, imd, tmd, response = outcome
        if not code and response is not None and self.max_response >= 0 and \
                (n := nbytes(response)) > self.max_response:
            self._status = (grpc.StatusCode.RESOURCE_EXHAUSTED,
                            received_too_large(n, self.max_response), tmd)
            raise rpc_error(*self._status[:2], imd, tmd)
        # OK needs no status object; initial metadata is made on demand.
        if code or self._locally_cancelled:
            status = self._final_status()  # may find the channel's close() did it
            if self._locally_cancelled:
                raise asyncio.CancelledError()
            if status is not None and status[0] is not _OK:
                raise rpc_error(status[0], status[1], imd, tmd)
        deserializer = self._deserializer
        self._result = response if response is None or deserializer is None else \
            _deserialize(response, deserializer)
        self._have_result = True
        return self._result


class UnaryUnaryCall(_UnaryResponse, aio.UnaryUnaryCall[Any, Any]):
    """``grpc.aio.UnaryUnaryCall``: request, headers and half-close in one batch."""

    async def wait_for_connection(self) -> None:
        # grpc.aio's waits for the whole unary call here (and cancels it if the waiting
        # task is cancelled), then raises its error if it failed.
        try:
            await self
        except aio.AioRpcError:
            pass
        await FastCall.wait_for_connection(self)

    def __init__(self, channel: Any, bridge: LoopBridge, conn: Any, method: str, metadata: list[Any],
                 timeout: Optional[float], request: Any,
                 response_deserializer: Optional[Callable[..., Any]],
                 retry_unsent: bool = False) -> None:
        token = bridge.register(self._on_change)  # alive until it ends: see _UnaryResponse
        try:
            started = conn.start_unary_watched(method, metadata, timeout, bridge.notifier,
                                               token, request, retry_unsent)
        except TypeError:  # not a buffer: _send_request reports it as grpc.aio does
            core = _watched(conn, bridge, token, retry_unsent, method, metadata, timeout, False)
            super().__init__(channel, bridge, core, token, timeout, response_deserializer)
            _send_request(self, core, request)
            return
        if started is None:
            bridge.unregister(token)
            raise Unsent
        core, sent = started
        FastCall.__init__(self, channel, bridge, core, token, timeout, response_deserializer)
        if sent < 0:
            self._send_later(request)

    def _send_later(self, request: Any) -> None:
        """The request the stream had no room for yet, sent by a task (also for
        make_unary_call, which makes a call without this constructor)."""
        self._sender = self._loop.create_task(self._send(request, True))


class StreamUnaryCall(_UnaryResponse, aio.StreamUnaryCall[Any, Any]):
    """``grpc.aio.StreamUnaryCall``."""

    def __init__(self, channel: Any, bridge: LoopBridge, conn: Any, method: str, metadata: list[Any],
                 timeout: Optional[float], request_iterator: Any,
                 request_serializer: Optional[Callable[..., Any]],
                 response_deserializer: Optional[Callable[..., Any]],
                 retry_unsent: bool = False) -> None:
        token = bridge.register(self._on_change)  # alive until it ends: see _UnaryResponse
        core = _watched(conn, bridge, token, retry_unsent, method, metadata, timeout, True)
        super().__init__(channel, bridge, core, token, timeout, response_deserializer)
        _init_requests(self, request_iterator, request_serializer)

    if TYPE_CHECKING:
        async def write(self, request: Any) -> None: ...
        async def done_writing(self) -> None: ...
    else:
        write = None  # replaced below
        done_writing = None


class UnaryStreamCall(FastCall, aio.UnaryStreamCall[Any, Any]):
    """``grpc.aio.UnaryStreamCall``."""

    def __init__(self, channel: Any, bridge: LoopBridge, conn: Any, method: str, metadata: list[Any],
                 timeout: Optional[float], request: Any,
                 response_deserializer: Optional[Callable[..., Any]],
                 retry_unsent: bool = False) -> None:
        token = bridge.register(_weak_callback(self))
        core = _watched(conn, bridge, token, retry_unsent, method, metadata, timeout, False)
        super().__init__(channel, bridge, core, token, timeout, response_deserializer)
        _init_responses(self)
        _send_request(self, core, request)

    if TYPE_CHECKING:
        def __aiter__(self) -> AsyncIterator[Any]: ...
        async def read(self) -> Any: ...
    else:
        __aiter__ = None  # replaced below
        read = None


class StreamStreamCall(FastCall, aio.StreamStreamCall[Any, Any]):
    """``grpc.aio.StreamStreamCall``."""

    over_limit_ends_in_core_error = True

    def __init__(self, channel: Any, bridge: LoopBridge, conn: Any, method: str, metadata: list[Any],
                 timeout: Optional[float], request_iterator: Any,
                 request_serializer: Optional[Callable[..., Any]],
                 response_deserializer: Optional[Callable[..., Any]],
                 retry_unsent: bool = False) -> None:
        token = bridge.register(_weak_callback(self))
        core = _watched(conn, bridge, token, retry_unsent, method, metadata, timeout, True)
        super().__init__(channel, bridge, core, token, timeout, response_deserializer)
        _init_responses(self)
        _init_requests(self, request_iterator, request_serializer)

    if TYPE_CHECKING:
        def __aiter__(self) -> AsyncIterator[Any]: ...
        async def read(self) -> Any: ...
        async def write(self, request: Any) -> None: ...
        async def done_writing(self) -> None: ...
    else:
        __aiter__ = None
        read = None
        write = None
        done_writing = None


def _send_request(call: FastCall, core: Any, request: Any) -> None:
    """Sends a unary call's request (with its headers and half-close) in one batch."""
    try:
        sent = core.try_send(request, True)
    except TypeError as e:  # not a buffer: the server never hears of the call
        call._send_error = e
        core.cancel(_status.INTERNAL, str(e))
        return
    if sent < 0:
        call._sender = call._loop.create_task(call._send(request, True))


def _weak_callback(call: FastCall) -> Callable[[], None]:
    """The bridge's callback for a streaming call, which must not keep the call alive
    (dropping an unfinished one cancels it, as grpc.aio's do)."""
    ref = weakref.ref(call)

    def callback() -> None:
        c = ref()
        if c is not None:
            c._on_change()

    return callback


# -- streaming responses ----------------------------------------------------------

def _init_responses(call: Any) -> None:
    call._response_style = _UNKNOWN_STYLE
    call._message_aiter = None


def _update_response_style(call: Any, style: int) -> None:
    if call._response_style == _UNKNOWN_STYLE:
        call._response_style = style
    elif call._response_style != style:
        raise aio.UsageError(_status.MIXED_APIS)


async def _read_message(call: Any) -> Any:
    raw = await call._read_raw()
    if raw is aio.EOF:
        return aio.EOF
    return _deserialize(raw, call._deserializer)


async def _fetch_responses(call: Any) -> AsyncIterator[Any]:
    while True:
        message = await _read_message(call)
        if message is aio.EOF:
            break
        yield message
    await call._raise_for_status()


def _response_aiter(self: Any) -> AsyncIterator[Any]:
    _update_response_style(self, _ITERATOR_STYLE)
    if self._message_aiter is None:
        self._message_aiter = _fetch_responses(self)
    responses: AsyncIterator[Any] = self._message_aiter
    return responses


async def _read(self: Any) -> Any:
    # Before the style check, as grpc.aio: a finished call reads EOF (or its error)
    # whichever way its responses were read.
    if self._drained():
        await self._raise_for_status()
        return aio.EOF
    _update_response_style(self, _READER_WRITER_STYLE)
    message = await _read_message(self)
    if message is aio.EOF:
        await self._raise_for_status()
    return message


for _reader_cls in (UnaryStreamCall, StreamStreamCall):
    setattr(_reader_cls, "__aiter__", _response_aiter)
    setattr(_reader_cls, "read", _read)


# -- streaming requests -----------------------------------------------------------

def _init_requests(call: Any, request_iterator: Any, serializer: Optional[Callable[..., Any]]) -> None:
    call._serializer = serializer
    call._done_writing_flag = False
    if request_iterator is not None:
        call._request_style = _ITERATOR_STYLE
        call._request_poller = call._loop.create_task(_consume_requests(call, request_iterator))
    else:
        call._request_style = _READER_WRITER_STYLE
        call._request_poller = None


async def _write_one(call: Any, request: Any) -> None:
    if call.done():
        raise asyncio.InvalidStateError(_status.RPC_FINISHED)
    if call._done_writing_flag:
        raise asyncio.InvalidStateError(_HALF_CLOSED)
    payload = serialize(call._serializer, request)
    if call.max_send >= 0:
        try:
            n = nbytes(payload)
        except TypeError:
            n = -1  # not a buffer: the send reports it
        if n > call.max_send:
            # As grpc.aio: the write fails with core's words; the call ends with grpc's
            # limit, except a stream-stream call, whose pending read gets core's words.
            if call.over_limit_ends_in_core_error:
                call._core.cancel(_status.INTERNAL, _CORE_WRITE_FAILED)
            else:
                call._core.cancel(_status.RESOURCE_EXHAUSTED, too_large_details(n, call.max_send))
            raise rpc_error(grpc.StatusCode.INTERNAL, _CORE_WRITE_FAILED)
    if not await call._send(payload):
        await call._raise_for_status()


async def _consume_requests(call: Any, request_iterator: Any) -> None:
    try:
        if isinstance(request_iterator, AsyncIterable):
            async for request in request_iterator:
                try:
                    await _write_one(call, request)
                except aio.AioRpcError as e:
                    _LOGGER.debug("Exception while consuming the request_iterator: %s", e)
                    return
        else:
            for request in request_iterator:
                try:
                    await _write_one(call, request)
                except aio.AioRpcError as e:
                    _LOGGER.debug("Exception while consuming the request_iterator: %s", e)
                    return
        await _done_writing(call)
    except BaseException:  # noqa: BLE001 - the user's iterator: cancel the RPC, as grpc.aio
        _LOGGER.debug("Client request_iterator raised exception:\n%s", traceback.format_exc())
        call.cancel()


async def _done_writing(call: Any) -> None:
    if call.done() or call._done_writing_flag:
        return
    call._done_writing_flag = True
    call._core.half_close()


async def _write(self: Any, request: Any) -> None:
    if self._request_style != _READER_WRITER_STYLE:
        raise aio.UsageError(_status.MIXED_APIS)
    await _write_one(self, request)


async def _public_done_writing(self: Any) -> None:
    if self._request_style != _READER_WRITER_STYLE:
        raise aio.UsageError(_status.MIXED_APIS)
    await _done_writing(self)


for _writer_cls in (StreamUnaryCall, StreamStreamCall):
    setattr(_writer_cls, "write", _write)
    setattr(_writer_cls, "done_writing", _public_done_writing)


class FailedCall:
    """A call that ended before it started (a forced transport that is impossible,
    invalid metadata, its channel closed while it waited for negotiation): every
    operation reports `error`, as grpc.aio's call would; a cancelled one raises
    asyncio.CancelledError where grpc.aio's does."""

    def __init__(self, error: aio.AioRpcError, cancelled: bool = False) -> None:
        self._error = error
        self._cancelled = cancelled

    @staticmethod
    def make(kind: str, error: aio.AioRpcError) -> Any:
        return _FAILED[kind](error)

    @staticmethod
    def cancelled_call(kind: str) -> Any:
        """A call cancelled before it started, as by close() of its channel."""
        return _FAILED[kind](rpc_error(_CANCELLED, _status.LOCALLY_CANCELLED), True)

    def _raise(self) -> NoReturn:
        if self._cancelled:
            raise asyncio.CancelledError()
        raise self._error

    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return True

    def time_remaining(self) -> Optional[float]:
        return None

    def cancel(self) -> bool:
        return False

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        callback(self)

    async def initial_metadata(self) -> aio.Metadata:
        return self._error.initial_metadata()

    async def trailing_metadata(self) -> aio.Metadata:
        return self._error.trailing_metadata()

    async def code(self) -> grpc.StatusCode:
        return self._error.code()

    async def details(self) -> str:
        return self._error.details() or ""

    async def debug_error_string(self) -> str:
        return self._error.debug_error_string() or ""

    async def wait_for_connection(self) -> None:
        self._raise()

    def __await__(self) -> Generator[Any, None, Any]:
        self._raise()
        yield  # noqa: unreachable - makes this a generator

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[Any]:
        self._raise()
        yield  # noqa: unreachable - makes this an async generator

    async def read(self) -> Any:
        self._raise()

    async def write(self, request: Any) -> None:
        raise asyncio.InvalidStateError(_status.RPC_FINISHED)

    async def done_writing(self) -> None:
        return None


class _FailedUnary(FailedCall, aio.UnaryUnaryCall[Any, Any], aio.StreamUnaryCall[Any, Any]):
    pass


class _FailedStream(FailedCall, aio.UnaryStreamCall[Any, Any], aio.StreamStreamCall[Any, Any]):
    pass


_FAILED: dict[str, type[FailedCall]] = {
    "unary_unary": _FailedUnary, "stream_unary": _FailedUnary,
    "unary_stream": _FailedStream, "stream_stream": _FailedStream}
