"""grpc's ABCs that argrpc subclasses, subscripted for the type checker only.

grpc's stubs make ``grpc.Future``, the multi-callables and grpc.aio's multi-callables
generic, but at run time some are plain classes that cannot be subscripted (grpc.aio's
stream-request multi-callables became generic only in later grpcio releases): a class
statement naming ``grpc.Future[Any]`` would raise. Subclasses name these aliases instead.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc
from grpc import aio

__all__ = ["AioStreamStreamBase", "AioStreamUnaryBase", "AioUnaryStreamBase", "AioUnaryUnaryBase",
           "FutureBase", "RpcMethodHandlerBase", "StreamStreamBase", "StreamUnaryBase",
           "UnaryStreamBase", "UnaryUnaryBase"]

if TYPE_CHECKING:
    FutureBase = grpc.Future[Any]
    RpcMethodHandlerBase = grpc.RpcMethodHandler[Any, Any]
    UnaryUnaryBase = grpc.UnaryUnaryMultiCallable[Any, Any]
    UnaryStreamBase = grpc.UnaryStreamMultiCallable[Any, Any]
    StreamUnaryBase = grpc.StreamUnaryMultiCallable[Any, Any]
    StreamStreamBase = grpc.StreamStreamMultiCallable[Any, Any]
    AioUnaryUnaryBase = aio.UnaryUnaryMultiCallable[Any, Any]
    AioUnaryStreamBase = aio.UnaryStreamMultiCallable[Any, Any]
    AioStreamUnaryBase = aio.StreamUnaryMultiCallable[Any, Any]
    AioStreamStreamBase = aio.StreamStreamMultiCallable[Any, Any]
else:
    FutureBase = grpc.Future
    RpcMethodHandlerBase = grpc.RpcMethodHandler
    UnaryUnaryBase = grpc.UnaryUnaryMultiCallable
    UnaryStreamBase = grpc.UnaryStreamMultiCallable
    StreamUnaryBase = grpc.StreamUnaryMultiCallable
    StreamStreamBase = grpc.StreamStreamMultiCallable
    AioUnaryUnaryBase = aio.UnaryUnaryMultiCallable
    AioUnaryStreamBase = aio.UnaryStreamMultiCallable
    AioStreamUnaryBase = aio.StreamUnaryMultiCallable
    AioStreamStreamBase = aio.StreamStreamMultiCallable
