"""grpc's own loggers, on which argrpc reports what grpc reports there: a failure of the
user's code (a handler, a request or response iterator, a serializer, a callback) and the
user's misuse of the API (invalid metadata, abort with OK). Same logger, same level, same
words, so an application sees them exactly as it saw grpc's, filters included: grpc's
package logger has a NullHandler, so nothing is printed until the application configures
logging. argrpc's own events (its transports, fallbacks, lost peers) stay on ``argrpc``."""

from __future__ import annotations

import logging

import grpc  # noqa: F401 - its package logger (and NullHandler) first

__all__ = ["AIO", "AIO_CALL", "CHANNEL", "CODEC", "SERVER"]

SERVER = logging.getLogger("grpc._server")       # threaded handlers, their iterators, callbacks
CHANNEL = logging.getLogger("grpc._channel")     # threaded clients: request iterators, callbacks
CODEC = logging.getLogger("grpc._common")        # serializers and deserializers, both APIs
AIO = logging.getLogger("grpc._cython.cygrpc")   # grpc.aio's server, its contexts and calls
AIO_CALL = logging.getLogger("grpc.aio._call")   # grpc.aio's client request iterators
