"""The client interceptors of ``grpc.aio`` (the four ``*ClientInterceptor`` classes) run
above both of a channel's paths: each interceptor gets a continuation that makes the
next one's call, and the last one's continuation starts the real call (fast path or
grpc.aio). What an interceptor returns that is not a call (a response, or an async
iterator of responses) becomes a finished call carrying it, as in grpc.aio."""

from __future__ import annotations

from typing import Any, AsyncIterator, Generator, Optional

import grpc
from grpc import aio

from ._pending import PendingCall

__all__ = ["intercept", "split"]

_KINDS = (
    (aio.UnaryUnaryClientInterceptor, "unary_unary", "intercept_unary_unary"),
    (aio.UnaryStreamClientInterceptor, "unary_stream", "intercept_unary_stream"),
    (aio.StreamUnaryClientInterceptor, "stream_unary", "intercept_stream_unary"),
    (aio.StreamStreamClientInterceptor, "stream_stream", "intercept_stream_stream"),
)
_CALL_CLASS = {"unary_unary": aio.UnaryUnaryCall, "unary_stream": aio.UnaryStreamCall,
               "stream_unary": aio.StreamUnaryCall, "stream_stream": aio.StreamStreamCall}


def split(interceptors: Any) -> dict[str, list]:
    """Interceptors by the arity they intercept; ValueError for anything else, with
    grpc.aio's message."""
    out: dict[str, list] = {}
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


def intercept(multi: Any, request: Any, timeout: Optional[float], metadata: Any,
              credentials: Any, wait_for_ready: Optional[bool], compression: Any) -> Any:
    kind = multi._kind
    method_name = next(name for _, k, name in _KINDS if k == kind)
    chain = list(multi._intercepted)
    details = aio.ClientCallDetails(multi._method.encode(), timeout,
                                    aio.Metadata(*tuple(metadata)) if metadata is not None
                                    else None, credentials, wait_for_ready)

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
                call = await call._inner()
            return call

        async def continuation(next_details: Any, next_req: Any) -> Any:
            return await run(index + 1, next_details, next_req)

        outcome = await getattr(chain[index], method_name)(continuation, call_details, req)
        if isinstance(outcome, _CALL_CLASS[kind]):
            return outcome
        return _Outcome.make(kind, outcome)

    return PendingCall.make(kind, run(0, details, request))


class _Outcome:
    """A finished OK call standing for what an interceptor returned instead of a call."""

    def __init__(self, value: Any) -> None:
        self._value = value

    @staticmethod
    def make(kind: str, value: Any) -> Any:
        return (_Response if kind.endswith("unary") else _Responses)(value)

    def cancelled(self) -> bool:
        return False

    def done(self) -> bool:
        return True

    def time_remaining(self) -> Optional[float]:
        return None

    def cancel(self) -> bool:
        return False

    def add_done_callback(self, callback: Any) -> None:
        callback(self)

    async def initial_metadata(self) -> aio.Metadata:
        return aio.Metadata()

    async def trailing_metadata(self) -> aio.Metadata:
        return aio.Metadata()

    async def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.OK

    async def details(self) -> str:
        return ""

    async def debug_error_string(self) -> str:
        return ""

    async def wait_for_connection(self) -> None:
        return None


class _Response(_Outcome, aio.UnaryUnaryCall, aio.StreamUnaryCall):
    def __await__(self) -> Generator[Any, None, Any]:
        return self._value
        yield  # noqa: unreachable - makes this a generator

    async def write(self, request: Any) -> None:
        return None

    async def done_writing(self) -> None:
        return None


class _Responses(_Outcome, aio.UnaryStreamCall, aio.StreamStreamCall):
    def __aiter__(self) -> AsyncIterator[Any]:
        return self._value.__aiter__()

    async def read(self) -> Any:
        try:
            return await self._value.__anext__()
        except StopAsyncIteration:
            return aio.EOF

    async def write(self, request: Any) -> None:
        return None

    async def done_writing(self) -> None:
        return None
