"""Serializer output on the plain-gRPC path.

argrpc lets a serializer return any buffer-protocol object (memoryview, numpy array) and
sends it without a copy on the fast path. grpc's own core accepts only `bytes`, so on the
plain-gRPC path (fallback channels, plain clients of an argrpc server) such a buffer is
copied into `bytes` once; `bytes` themselves pass through untouched.
"""
from __future__ import annotations

import collections
from typing import Any, Callable, Optional, overload

import grpc

from ._bases import RpcMethodHandlerBase


def nbytes(payload: Any) -> int:
    """A payload's size (TypeError when it is not a buffer)."""
    if isinstance(payload, bytes):
        return len(payload)
    return memoryview(payload).nbytes


def is_buffer(value: Any) -> bool:
    """Whether a serializer's output can be sent as it is (the buffer protocol)."""
    try:
        memoryview(value).release()
    except TypeError:
        return False
    return True


def bytes_serializer(serializer: Optional[Callable[[Any], Any]]) -> Optional[Callable[[Any], Any]]:
    if serializer is None:
        return None

    def serialize(message: Any) -> Any:
        out = serializer(message)
        if type(out) is bytes:
            return out
        try:
            view = memoryview(out)
        except TypeError:
            return out  # None, a str: grpc's core says what it does with them, as for grpc
        with view:
            return view.tobytes()

    return serialize


class _MethodHandler(
        collections.namedtuple("_MethodHandler", (
            "request_streaming", "response_streaming", "request_deserializer",
            "response_serializer", "unary_unary", "unary_stream", "stream_unary",
            "stream_stream")),
        RpcMethodHandlerBase):
    pass


@overload
def grpc_method_handler(handler: None) -> None: ...


@overload
def grpc_method_handler(handler: grpc.RpcMethodHandler[Any, Any]
                        ) -> grpc.RpcMethodHandler[Any, Any]: ...


def grpc_method_handler(handler: Optional[grpc.RpcMethodHandler[Any, Any]]
                        ) -> Optional[grpc.RpcMethodHandler[Any, Any]]:
    """The same handler with a response serializer grpc's core can send."""
    if handler is None or handler.response_serializer is None:
        return handler
    return _MethodHandler(
        handler.request_streaming, handler.response_streaming, handler.request_deserializer,
        bytes_serializer(handler.response_serializer), handler.unary_unary,
        handler.unary_stream, handler.stream_unary, handler.stream_stream)


class GrpcGenericHandler(grpc.GenericRpcHandler):
    """Wraps a user's generic handler for the grpc server beside the fast path."""

    def __init__(self, inner: grpc.GenericRpcHandler) -> None:
        self._inner = inner

    def service(self, handler_call_details: grpc.HandlerCallDetails
                ) -> Optional[grpc.RpcMethodHandler[Any, Any]]:
        handler: Optional[grpc.RpcMethodHandler[Any, Any]] = self._inner.service(
            handler_call_details)
        return grpc_method_handler(handler)
