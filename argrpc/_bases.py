"""grpc's synchronous ABCs, subscripted for the type checker only.

grpc's stubs make ``grpc.Future`` and the multi-callables generic, but at run time they
are plain classes that cannot be subscripted: a class statement naming ``grpc.Future[Any]``
would raise. Subclasses name these aliases instead.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc

__all__ = ["FutureBase", "RpcMethodHandlerBase", "StreamStreamBase", "StreamUnaryBase",
           "UnaryStreamBase", "UnaryUnaryBase"]

if TYPE_CHECKING:
    FutureBase = grpc.Future[Any]
    RpcMethodHandlerBase = grpc.RpcMethodHandler[Any, Any]
    UnaryUnaryBase = grpc.UnaryUnaryMultiCallable[Any, Any]
    UnaryStreamBase = grpc.UnaryStreamMultiCallable[Any, Any]
    StreamUnaryBase = grpc.StreamUnaryMultiCallable[Any, Any]
    StreamStreamBase = grpc.StreamStreamMultiCallable[Any, Any]
else:
    FutureBase = grpc.Future
    RpcMethodHandlerBase = grpc.RpcMethodHandler
    UnaryUnaryBase = grpc.UnaryUnaryMultiCallable
    UnaryStreamBase = grpc.UnaryStreamMultiCallable
    StreamUnaryBase = grpc.StreamUnaryMultiCallable
    StreamStreamBase = grpc.StreamStreamMultiCallable
