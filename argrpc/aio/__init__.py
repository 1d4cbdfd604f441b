"""``argrpc.aio``: the asyncio API of grpc (``grpc.aio``) over argrpc's engine.

Swap ``grpc.aio.insecure_channel``/``secure_channel`` for ``argrpc.aio.insecure_channel``/
``secure_channel`` and ``grpc.aio.server`` for ``argrpc.aio.server``; generated stubs and
``async def`` servicers stay unchanged. The rest of grpc.aio's names (``AioRpcError``,
``EOF``, the interceptor classes, ``Metadata``, ``Server`` as the abstract type...)
are re-exported here, so
``from argrpc import aio`` can stand in for ``from grpc import aio``.
"""

from typing import Any

from grpc.aio import (AbortError, AioRpcError, BaseError, Call, ClientCallDetails,
                      ClientInterceptor, EOF, InterceptedUnaryUnaryCall, InternalError,
                      Metadata, RpcContext, Server, ServerInterceptor, ServicerContext,
                      StreamStreamCall,
                      StreamStreamClientInterceptor, StreamStreamMultiCallable,
                      StreamUnaryCall, StreamUnaryClientInterceptor, StreamUnaryMultiCallable,
                      UnaryStreamCall, UnaryStreamClientInterceptor, UnaryStreamMultiCallable,
                      UnaryUnaryCall, UnaryUnaryClientInterceptor, UnaryUnaryMultiCallable,
                      UsageError, init_grpc_aio, shutdown_grpc_aio)

from ._channel import Channel, insecure_channel, secure_channel


def server(*args: Any, **kwargs: Any) -> Server:
    """Like ``grpc.aio.server``: an argrpc server serving fast-path and gRPC calls."""
    from ._server import server as _server

    return _server(*args, **kwargs)


__all__ = ["AbortError", "AioRpcError", "BaseError", "Call", "Channel", "ClientCallDetails",
           "ClientInterceptor", "EOF", "InterceptedUnaryUnaryCall", "InternalError", "Metadata",
           "RpcContext", "Server", "ServerInterceptor", "ServicerContext", "StreamStreamCall",
           "StreamStreamClientInterceptor", "StreamStreamMultiCallable", "StreamUnaryCall",
           "StreamUnaryClientInterceptor", "StreamUnaryMultiCallable", "UnaryStreamCall",
           "UnaryStreamClientInterceptor", "UnaryStreamMultiCallable", "UnaryUnaryCall",
           "UnaryUnaryClientInterceptor", "UnaryUnaryMultiCallable", "UsageError",
           "init_grpc_aio", "insecure_channel", "secure_channel", "server",
           "shutdown_grpc_aio"]
