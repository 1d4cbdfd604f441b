"""The client interceptors of ``grpc.aio`` (the four ``*ClientInterceptor`` classes) run
above both of a channel's paths: each interceptor gets a continuation that makes the
next one's call, and the last one's continuation starts the real call (fast path or
grpc.aio). What an interceptor returns that is not a call (a response, or an async
iterator of responses) becomes a call carrying it, as in grpc.aio."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Generator, Optional

import grpc
from grpc import aio

from .. import _status
from ._pending import PendingCall, RequestProxy

__all__ = ["intercept", "split"]

_KINDS = (
    (aio.UnaryUnaryClientInterceptor, "unary_unary", "intercept_unary_unary"),
    (aio.UnaryStreamClientInterceptor, "unary_stream", "intercept_unary_stream"),
    (aio.StreamUnaryClientInterceptor, "stream_unary", "intercept_stream_unary"),
    (aio.StreamStreamClientInterceptor, "stream_stream", "intercept_stream_stream"),
)
_CALL_CLASS = {"unary_unary": aio.UnaryUnaryCall, "unary_stream": aio.UnaryStreamCall,
               "stream_unary": aio.StreamUnaryCall, "stream_stream": aio.StreamStreamCall}


def split(interceptors: Any) -> dict[str, list[Any]]:
    """Interceptors by the arity they intercept; ValueError for anything else, with
    grpc.aio's message."""
    out: dict[str, list[Any]] = {}
    for interceptor in interceptors or ():
        for cls, kind, _ in _KINDS:
            if isinstance(interceptor, cls):
                out.setdefault(kind, []).append(interceptor)
                break
        else:
            raise ValueError(
                f"Interceptor {interceptor} must be " + " or ".join(
                    cls.__name__ for cls, _, _ in _KINDS) + ". ")
    return out


def _call_metadata(metadata: Any) -> aio.Metadata:
    """What grpc.aio gives interceptors: always a Metadata, empty when there is none."""
    if isinstance(metadata, aio.Metadata):
        return metadata
    return aio.Metadata.from_tuple(tuple(metadata)) if metadata else aio.Metadata()


def intercept(multi: Any, request: Any, timeout: Optional[float], metadata: Any,
              credentials: Any, wait_for_ready: Optional[bool], compression: Any) -> Any:
    kind = multi._kind
    method_name = next(name for _, k, name in _KINDS if k == kind)
    chain = list(multi._intercepted)
    details = aio.ClientCallDetails(multi._method.encode(), timeout, _call_metadata(metadata),
                                    credentials, wait_for_ready)
    requests = None
    if kind.startswith("stream") and request is None:
        requests = RequestProxy()
        request = requests.iterate()
    # The call the level below returned: a response iterator an interceptor returns
    # instead of a call gets its status and metadata from it (grpc.aio).
    below: list[Any] = [None]

    async def run(index: int, call_details: Any, req: Any) -> Any:
        if index == len(chain):
            method = call_details.method
            if isinstance(method, bytes):
                method = method.decode()
            target = multi if method == multi._method else type(multi)(
                multi._channel, method, multi._serializer, multi._deserializer, False)
            call = target.invoke(req, call_details.timeout, call_details.metadata,
                                 call_details.credentials, call_details.wait_for_ready,
                                 compression)
            if isinstance(call, PendingCall):
                call = await call.real_call()
            below[0] = call
            return call

        async def continuation(next_details: Any, next_req: Any) -> Any:
            return await run(index + 1, next_details, next_req)

        outcome = await getattr(chain[index], method_name)(continuation, call_details, req)
        if not isinstance(outcome, _CALL_CLASS[kind]):
            outcome = _Outcome.make(kind, outcome, below[0])
        below[0] = outcome
        return outcome

    loop = multi._channel._loop or asyncio.get_running_loop()
    call = PendingCall.intercepted(kind, run(0, details, request), loop, requests)
    if requests is not None:
        requests.bind(call)
    return call


class _Outcome:
    """What an interceptor returned instead of a call: a response (a finished OK call,
    as grpc.aio's UnaryUnaryCallResponse), or a response iterator whose status and
    metadata are those of the call below it."""

    def __init__(self, value: Any, call: Any) -> None:
        self._value = value
        self._call = call

    @staticmethod
    def make(kind: str, value: Any, call: Any) -> Any:
        if kind.endswith("unary"):
            return _Response(value, None)
        return _Responses(value, call)

    def cancelled(self) -> bool:
        return self._call.cancelled() if self._call is not None else False

    def done(self) -> bool:
        return self._call.done() if self._call is not None else True

    def time_remaining(self) -> Optional[float]:
        return self._call.time_remaining() if self._call is not None else None

    def cancel(self) -> bool:
        return self._call.cancel() if self._call is not None else False

    def add_done_callback(self, callback: Any) -> None:
        if self._call is not None:
            self._call.add_done_callback(lambda _c: callback(self))
        else:
            callback(self)

    async def initial_metadata(self) -> Optional[aio.Metadata]:
        return await self._call.initial_metadata() if self._call is not None else None

    async def trailing_metadata(self) -> Optional[aio.Metadata]:
        return await self._call.trailing_metadata() if self._call is not None else None

    async def code(self) -> grpc.StatusCode:
        return await self._call.code() if self._call is not None else grpc.StatusCode.OK

    async def details(self) -> str:
        return await self._call.details() if self._call is not None else ""

    async def debug_error_string(self) -> Optional[str]:
        return await self._call.debug_error_string() if self._call is not None else None

    async def wait_for_connection(self) -> None:
        if self._call is not None:
            await self._call.wait_for_connection()

    @property
    def _done_writing_flag(self) -> bool:
        return bool(getattr(self._call, "_done_writing_flag", False))


# ignore[misc] below: no metadata is None, as for grpc.aio's intercepted calls; grpc's
# stubs say Metadata
class _Response(_Outcome, aio.UnaryUnaryCall[Any, Any],  # type: ignore[misc]
                aio.StreamUnaryCall[Any, Any]):
    def __await__(self) -> Generator[Any, None, Any]:
        return self._value
        yield  # noqa: unreachable - makes this a generator

    async def write(self, request: Any) -> None:
        raise asyncio.InvalidStateError(_status.RPC_FINISHED)

    async def done_writing(self) -> None:
        return None


class _Responses(_Outcome, aio.UnaryStreamCall[Any, Any],  # type: ignore[misc]
                 aio.StreamStreamCall[Any, Any]):
    def __aiter__(self) -> AsyncIterator[Any]:
        responses: AsyncIterator[Any] = self._value.__aiter__()
        return responses

    async def read(self) -> Any:
        try:
            return await self._value.__anext__()
        except StopAsyncIteration:
            return aio.EOF

    async def write(self, request: Any) -> None:
        await self._call.write(request)

    async def done_writing(self) -> None:
        await self._call.done_writing()
