"""The asyncio ServicerContext for calls that arrive over the fast path.

Mirrors grpc.aio's `_ServicerContext` (grpc/_cython/_cygrpc/aio/server.pyx.pxi): same
methods, exceptions and final-status rules. The state of one call lives in `RpcState`,
shared by the context (user code), the handler runner (`_server_handlers.py`) and the
server (cancellation, stop()). Everything here runs on the server's loop and talks to
the `_core.ServerCall` only through its non-blocking methods: when one says "not now",
the coroutine waits for the call's watch to fire (the loop's bridge runs `on_change`).
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Executor
from typing import Any, Callable, Mapping, NoReturn, Optional, Protocol, Sequence

import grpc
from grpc import aio

from .. import _grpc_log, _metadata, _serving, _status
from .._context import FastPathPeer
from .._grpc_payloads import is_buffer

__all__ = ["ExecuteBatchError", "RpcState", "ServerSide", "ServerStoppedError", "ServicerContext",
           "SyncServicerContext", "status_code_int"]

_LOGGER = _grpc_log.AIO


class ServerSide(Protocol):
    """What a call and the task running its handler use of their server: its send limit,
    whether it stopped, the executor for sync handlers, and the handler a call runs
    (found at once without interceptors, through them otherwise). The server is written
    against nothing here, so it can import the calls."""

    _max_send: int
    _thread_pool: Optional[Executor]
    _interceptors: tuple[Any, ...]
    _stage: _serving.Stage

    def _find_handler_now(self, state: "RpcState") -> Optional[grpc.RpcMethodHandler[Any, Any]]: ...

    async def _intercepted_handler(self, state: "RpcState"
                                   ) -> Optional[grpc.RpcMethodHandler[Any, Any]]: ...


_TYPE_METADATA_STRING = "Tuple[Tuple[str, Union[str, bytes]]...]"

# A send the engine cannot take yet is retried when the call's watch fires (stream
# window); pool room frees without telling the call, so a timer retries too.
_RETRY_FIRST_S = 0.001
_RETRY_MAX_S = 0.01


def _grpc_batch_error() -> type[Exception]:
    # grpc.aio raises this (an InternalError) into a handler whose send batch failed;
    # the same class lets user code written against grpc.aio catch ours.
    try:
        from grpc._cython import cygrpc  # type: ignore[attr-defined]  # not in grpc's stubs
        error: type[Exception] = cygrpc.ExecuteBatchError
        return error
    except (ImportError, AttributeError):
        return type("ExecuteBatchError", (aio.InternalError,), {})


ExecuteBatchError: type[Exception] = _grpc_batch_error()


class ServerStoppedError(aio.BaseError):
    """Raised into a handler that goes on after its server stopped (as grpc.aio does)."""


def status_code_int(code: Any) -> int:
    """grpc.aio's get_status_code: a StatusCode or an int in range; else UNKNOWN."""
    if isinstance(code, int):
        return code if _status.OK <= code <= _status.DATA_LOSS else _status.UNKNOWN
    try:
        value: int = code.value[0]
        return value
    except (KeyError, AttributeError, TypeError, IndexError):
        return _status.UNKNOWN


def check_trailing_metadata(metadata: Any) -> None:
    """grpc.aio's raise_if_not_valid_trailing_metadata: a TypeError, same words."""
    bad = not hasattr(metadata, "__iter__") or isinstance(metadata, dict)
    if not bad:
        for item in metadata:
            if (not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str)
                    or not isinstance(item[1], (str, bytes))):
                bad = True
                break
    if bad:
        raise TypeError(
            f"Invalid trailing metadata type, expected {_TYPE_METADATA_STRING}: {metadata}")


def serialize(serializer: Optional[Callable[[Any], Any]], message: Any) -> Any:
    # grpc.aio encodes a str message before the serializer sees it. The result may be
    # any buffer: the fast path sends it without a bytes copy.
    if isinstance(message, str):
        message = message.encode("utf-8")
    if serializer is not None:
        message = serializer(message)
    if message is None:
        return b""  # as grpc.aio sends it
    if type(message) is not bytes and not is_buffer(message):
        # grpc.aio's words; raised before the status is marked sent, so the call ends as
        # the handler's error (UNKNOWN) rather than cancelled.
        raise TypeError(f"Expected bytes, got {type(message).__name__}")
    return message


def deserialize(deserializer: Optional[Callable[[Any], Any]], raw: Any) -> Any:
    return raw if deserializer is None else deserializer(raw)


def _wake(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_result(None)


class _EndedCall:
    """What stands for a call's engine handle once its task is done. The handle holds
    the call's connection (and so its ring, socket and segments); the state, reachable
    from the task's traceback cycles until the garbage collector happens to run, must not
    keep them. Answers as a call that is over."""

    __slots__ = ("key", "method", "metadata", "peer", "peer_name", "auth", "identity_key",
                 "transport", "cancelled")

    def __init__(self, sc: Any) -> None:
        self.key = sc.key
        self.method = sc.method
        self.metadata = sc.metadata
        self.peer = sc.peer
        self.peer_name = sc.peer_name
        self.auth = sc.auth
        self.identity_key = sc.identity_key
        self.transport = sc.transport
        self.cancelled = sc.cancelled

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float:
        return 0.0

    def cancel(self) -> None:
        return None

    def watch(self, notifier: Any, token: int) -> None:
        return None

    def try_recv(self) -> bool:
        return False

    def try_send(self, message: Any) -> int:
        return 0

    def try_finish(self, code: int, details: str, trailing_md: Any, message: Any = None) -> int:
        return 0

    def send_initial_metadata(self, md: Any) -> bool:
        return False


try:
    from .._core import ServerCallState, ServicerContextFields
except ImportError:  # no engine: no fast-path calls, and so neither is ever made
    class ServerCallState:  # type: ignore[no-redef]
        pass

    class ServicerContextFields:  # type: ignore[no-redef]
        pass


class RpcState(ServerCallState):
    """One fast-path call on the server's loop: grpc.aio's RPCState plus the engine I/O.

    Its fields are ServerCallState's, in the engine's module (C members: no instance
    dict, and no Python frame to set them up): `sc`, `method`, `key` (the call's
    identity across its handles, sc.key), `server` and `loop` as given; `task` None,
    `token` 0, `_waiters` and `callbacks` empty lists, `client_closed` (the call ended
    without our status: peer cancel, deadline, lost connection, stop(); its task was
    cancelled and nothing more is sent), `metadata_sent`, `status_sent` and
    `disable_next_compression` False, `status_code` OK, `status_details` "",
    `trailing_metadata` (), and None for `abort_exception`, `py_status_code`,
    `compression_algorithm` and `_invocation_metadata`."""

    __slots__ = ()

    sc: Any
    method: str
    key: int
    server: "ServerSide"
    loop: asyncio.AbstractEventLoop
    task: Optional[asyncio.Task[Any]]
    token: int
    _waiters: list[asyncio.Future[Any]]
    client_closed: bool
    abort_exception: Optional[BaseException]
    metadata_sent: bool
    status_sent: bool
    status_code: int
    py_status_code: Any
    status_details: str
    trailing_metadata: tuple[Any, ...]
    compression_algorithm: Any
    disable_next_compression: bool
    callbacks: list[Callable[[], None]]
    _invocation_metadata: Optional[tuple[Any, ...]]

    def release(self) -> None:
        """The call's task is done: let go of the engine's handle (see _EndedCall)."""
        if not isinstance(self.sc, _EndedCall):
            self.sc = _EndedCall(self.sc)
        self.task = None

    # --- what the engine tells us ---------------------------------------------------
    def on_change(self) -> None:
        """The call's watch fired (the bridge runs this on the loop): wake whoever waits,
        and stop the handler if the call ended under it."""
        self.wake_all()
        if not self.status_sent and not self.client_closed and not self.sc.is_active():
            self.close_from_peer()

    def wake_all(self) -> None:
        waiters = self._waiters
        if waiters:
            self._waiters = []
            for future in waiters:
                if not future.done():
                    future.set_result(None)

    def close_from_peer(self) -> None:
        # grpc.aio cancels the handler's task when the call is cancelled under it.
        self.client_closed = True
        task = self.task
        if task is not None and not task.done():
            task.cancel()

    async def wait_change(self, timeout: Optional[float] = None) -> None:
        future = self.loop.create_future()
        self._waiters.append(future)
        if timeout is None:
            await future
            return
        timer = self.loop.call_later(timeout, _wake, future)
        try:
            await future
        finally:
            timer.cancel()

    async def _ended(self) -> None:
        """A send found the call over: the handler's task is cancelled (raised at this
        await when we run in it); elsewhere the send failed, as grpc.aio's batch does."""
        if not self.client_closed:
            self.close_from_peer()
            await asyncio.sleep(0)
        raise ExecuteBatchError("the call ended before this batch could be sent")

    # --- I/O: non-blocking engine calls, waiting on the loop --------------------------
    async def recv(self) -> Any:
        """The next request message (bytes or memoryview), or None when none will come."""
        sc = self.sc
        while True:
            message = sc.try_recv()
            if message is None:
                await self.wait_change()
                continue
            if message is False:
                if not self.status_sent and not self.client_closed and not sc.is_active():
                    self.close_from_peer()
                    await asyncio.sleep(0)
                return None
            return message

    async def send_message(self, raw: Any) -> None:
        sc = self.sc
        delay = _RETRY_FIRST_S
        while True:
            sent = sc.try_send(raw)
            if sent > 0:
                return
            if sent == 0:
                await self._ended()
            await self.wait_change(delay)
            delay = min(delay * 2, _RETRY_MAX_S)

    async def send_initial_metadata(self, metadata: Any) -> None:
        try:
            md = _metadata.to_core(metadata)
        except _metadata.InvalidMetadataError as exc:
            # grpc's core refuses the batch: the call ends INTERNAL, the handler gets
            # the failed batch.
            _LOGGER.error("invalid initial metadata: %s", exc)
            self.status_sent = True
            await self._finish(_status.INTERNAL, _status.INVALID_METADATA, [], None)
            raise ExecuteBatchError(_status.INVALID_METADATA) from None
        if not self.sc.send_initial_metadata(md):
            await self._ended()

    async def send_status(self, code: int, details: str, trailing: Any,
                          message: Any = None) -> None:
        """The final batch (initial metadata if not sent, optional message, status). The
        caller has set status_sent."""
        try:
            md = _metadata.to_core(trailing)
        except (ValueError, TypeError) as exc:  # InvalidMetadataError is a ValueError
            _LOGGER.error("invalid trailing metadata: %s", exc)
            code, details, md, message = _status.INTERNAL, _status.INVALID_METADATA, [], None
        await self._finish(code, details, md, message)

    async def _finish(self, code: int, details: Any, md: list[Any], message: Any) -> None:
        sc = self.sc
        details = details if isinstance(details, str) else str(details or "")
        delay = _RETRY_FIRST_S
        # 0: the call ended already (cancelled by the peer): nobody to tell.
        while sc.try_finish(code, details, md, message) < 0:
            await self.wait_change(delay)
            delay = min(delay * 2, _RETRY_MAX_S)

    def check_size(self, raw: Any) -> Optional[str]:
        """grpc's words when `raw` is over grpc.max_send_message_length, else None."""
        limit = self.server._max_send
        if limit < 0:
            return None
        size = len(raw) if type(raw) is bytes else memoryview(raw).nbytes
        if size <= limit:
            return None
        return f"SERVER: Sent message larger than max ({size} vs. {limit})"

    async def refuse_oversized(self, why: str) -> None:
        """grpc's core fails an oversized send with RESOURCE_EXHAUSTED; the handler sees
        its batch fail."""
        self.status_sent = True
        await self._finish(_status.RESOURCE_EXHAUSTED, why, [], None)
        raise ExecuteBatchError(why)

    # --- grpc.aio's RPCState ----------------------------------------------------------
    def raise_for_termination(self) -> None:
        if self.abort_exception is not None:
            raise self.abort_exception
        if self.status_sent:
            raise aio.UsageError(_status.RPC_FINISHED)
        if self.server._stage is _serving.STOPPED:
            raise ServerStoppedError(_status.SERVER_STOPPED)

    def invocation_metadata(self) -> tuple[Any, ...]:
        # Converted lazily: a registered method without interceptors never looks at it.
        md = self._invocation_metadata
        if md is None:
            md = self._invocation_metadata = _metadata.from_core(self.sc.metadata)
        return md

    def run_callbacks(self) -> None:
        callbacks, self.callbacks = self.callbacks, []
        try:
            for callback in callbacks:
                callback()
        except Exception:  # noqa: BLE001 - user code; grpc.aio logs and stops there
            _LOGGER.exception("Error in callback for method [%s]", self.method)


class ServicerContext(ServicerContextFields, FastPathPeer, aio.ServicerContext[Any, Any]):
    """What an `async def` handler of a fast-path call is given. Made as
    `ServicerContext(state, request_deserializer, response_serializer)`: the fields are
    ServicerContextFields' C members (no Python frame to set them on every call), its
    `_loop` the state's."""

    _state: RpcState
    _request_deserializer: Optional[Callable[..., Any]]
    _response_serializer: Optional[Callable[..., Any]]
    _loop: asyncio.AbstractEventLoop

    async def read(self) -> Any:
        state = self._state
        state.raise_for_termination()
        raw = await state.recv()
        state.raise_for_termination()
        if raw is None:
            return aio.EOF
        return deserialize(self._request_deserializer, raw)

    async def write(self, message: Any) -> None:
        state = self._state
        state.raise_for_termination()
        raw = serialize(self._response_serializer, message)
        too_big = state.check_size(raw)
        if too_big is not None:
            await state.refuse_oversized(too_big)
        state.disable_next_compression = False  # no compression on the fast path
        await state.send_message(raw)
        state.metadata_sent = True

    async def send_initial_metadata(self, initial_metadata: Any) -> None:
        state = self._state
        state.raise_for_termination()
        if state.metadata_sent:
            raise aio.UsageError("Send initial metadata failed: already sent")
        await state.send_initial_metadata(tuple(initial_metadata))
        state.metadata_sent = True

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Any = ()) -> NoReturn:
        state = self._state
        if state.abort_exception is not None:
            raise aio.UsageError("Abort already called!")
        # Kept so that the server sees the same object come back (a handler may catch
        # and swallow it; the call stops anyway).
        state.abort_exception = aio.AbortError("Locally aborted.")
        if not trailing_metadata and state.trailing_metadata:
            trailing_metadata = state.trailing_metadata
        else:
            check_trailing_metadata(trailing_metadata)
            state.trailing_metadata = tuple(trailing_metadata)
        if details == "" and state.status_details:
            details = state.status_details
        else:
            state.status_details = details
        state.py_status_code = code
        state.status_code = status_code_int(code)
        state.status_sent = True
        await state.send_status(state.status_code, details, trailing_metadata)
        raise state.abort_exception

    async def abort_with_status(self, status: grpc.Status) -> NoReturn:
        await self.abort(status.code, status.details, status.trailing_metadata)

    def set_trailing_metadata(self, trailing_metadata: Any) -> None:
        check_trailing_metadata(trailing_metadata)
        self._state.trailing_metadata = tuple(trailing_metadata)

    # ignore[override]: tuples of (key, value) pairs; grpc's stubs say Metadata
    def trailing_metadata(self) -> tuple[Any, ...]:  # type: ignore[override]
        return self._state.trailing_metadata

    def invocation_metadata(self) -> tuple[Any, ...]:  # type: ignore[override]
        return self._state.invocation_metadata()

    def set_code(self, code: grpc.StatusCode) -> None:
        self._state.status_code = status_code_int(code)
        self._state.py_status_code = code

    def code(self) -> Any:
        return self._state.py_status_code

    def set_details(self, details: str) -> None:
        self._state.status_details = details

    def details(self) -> str:
        return self._state.status_details

    def set_compression(self, compression: grpc.Compression) -> None:
        # Accepted so servicers written for grpc.aio run; shared memory is not compressed.
        if self._state.metadata_sent:
            raise RuntimeError(
                "Compression setting must be specified before sending initial metadata")
        self._state.compression_algorithm = compression

    def disable_next_message_compression(self) -> None:
        self._state.disable_next_compression = True

    # None without a deadline; grpc's stubs say float
    def time_remaining(self) -> Optional[float]:  # type: ignore[override]
        remaining = self._state.sc.time_remaining()
        return None if remaining is None else max(remaining, 0.0)

    def add_done_callback(self, callback: Callable[["ServicerContext"], None]) -> None:
        self._state.callbacks.append(functools.partial(callback, self))

    def done(self) -> bool:
        return self._state.status_sent

    def cancelled(self) -> bool:
        # grpc.aio's answer: the status this call is to end with is CANCELLED.
        return self._state.status_code == _status.CANCELLED


class SyncServicerContext:
    """What a plain (non-async) handler gets, as grpc.aio's `_SyncServicerContext`: it runs
    in the migration thread pool and reaches the loop for what must happen there."""

    def __init__(self, context: ServicerContext) -> None:
        self._context = context
        self._callbacks: list[Callable[[], None]] = []
        self._loop = context._loop

    def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        future = asyncio.run_coroutine_threadsafe(
            self._context.abort(code, details, trailing_metadata), self._loop)
        future.result()  # raises the AbortError, as grpc.aio's does

    def abort_with_status(self, status: grpc.Status) -> None:
        self.abort(status.code, status.details, status.trailing_metadata)

    def send_initial_metadata(self, metadata: Any) -> None:
        future = asyncio.run_coroutine_threadsafe(
            self._context.send_initial_metadata(metadata), self._loop)
        future.result()

    def set_trailing_metadata(self, metadata: Any) -> None:
        self._context.set_trailing_metadata(metadata)

    def invocation_metadata(self) -> tuple[Any, ...]:
        return self._context.invocation_metadata()

    def set_code(self, code: grpc.StatusCode) -> None:
        self._context.set_code(code)

    def set_details(self, details: str) -> None:
        self._context.set_details(details)

    def set_compression(self, compression: grpc.Compression) -> None:
        self._context.set_compression(compression)

    def disable_next_message_compression(self) -> None:
        self._context.disable_next_message_compression()

    def add_callback(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def peer(self) -> str:
        return self._context.peer()

    @property
    def transport(self) -> str:
        transport: str = getattr(self._context, "transport", "grpc")
        return transport

    @property
    def transport_peer(self) -> str:
        name: str = getattr(self._context, "transport_peer", "")
        return name

    def peer_identities(self) -> Optional[Sequence[bytes]]:
        return self._context.peer_identities()

    def peer_identity_key(self) -> Optional[str]:
        return self._context.peer_identity_key()

    def auth_context(self) -> Mapping[str, Sequence[bytes]]:
        return self._context.auth_context()

    def time_remaining(self) -> Optional[float]:
        return self._context.time_remaining()
