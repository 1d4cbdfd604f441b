"""What serving means on both front ends (`argrpc.server` and `argrpc.aio.server`): the
engine's server for the fast path, the one `maximum_concurrent_rpcs` count, the handler
registry and lookup, the behaviour of a handler's arity, the details a generic handler
and an interceptor are given, and a server's stages. The threaded and asyncio servers
differ only in how they run handlers, apply interceptors (grpc's sync and async
interceptor APIs) and wait; neither imports the other."""

from __future__ import annotations

import enum
import logging
import threading
from typing import Any, Iterable, Mapping, Optional

import grpc

from . import _config, _engine, _grpc_payloads, _metrics_hooks

_LOGGER = logging.getLogger("argrpc._server")


class Stage(enum.Enum):
    """Where a server is in its life: handlers registered after NEW are grpc's to warn
    about and ignore; STOPPING is stop()'s grace."""
    NEW = "new"
    STARTED = "started"
    STOPPING = "stopping"
    STOPPED = "stopped"


# The members as module attributes, for the checks a server makes on every call: a
# member looked up on its Enum class goes through the metaclass's __getattr__ hook (in
# Python 3.11), about nine times the cost of a module attribute.
NEW, STARTED, STOPPING, STOPPED = Stage.NEW, Stage.STARTED, Stage.STOPPING, Stage.STOPPED


class Handlers:
    """A server's method handlers, looked up as grpc looks them up: a registered method by
    its full name first, then the generic handlers in the order they were added. Each is
    also handed to the gRPC server beside the fast path (the serializer output made bytes
    for it), so both ports serve the same methods."""

    def __init__(self, grpc_server: Any) -> None:
        self._grpc = grpc_server
        self._generic: list[grpc.GenericRpcHandler] = []
        self._registered: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    def add_generic(self, handlers: tuple[grpc.GenericRpcHandler, ...]) -> None:
        self._grpc.add_generic_rpc_handlers(
            tuple(_grpc_payloads.GrpcGenericHandler(h) for h in handlers))
        self._generic.extend(handlers)

    def add_registered(self, service_name: str,
                       method_handlers: Mapping[str, grpc.RpcMethodHandler[Any, Any]],
                       started: bool) -> None:
        for method in method_handlers:
            _metrics_hooks.register_server_method(service_name, method)
        # grpc warns and ignores once started; forwarding keeps its exact behaviour.
        self._grpc.add_registered_method_handlers(service_name, {
            name: _grpc_payloads.grpc_method_handler(h) for name, h in method_handlers.items()})
        if started:
            return
        for method, handler in method_handlers.items():
            self._registered[f"/{service_name}/{method}"] = handler

    def registered(self, method: str) -> Optional[grpc.RpcMethodHandler[Any, Any]]:
        return self._registered.get(method)

    def all_registered(self) -> Mapping[str, grpc.RpcMethodHandler[Any, Any]]:
        """Every registered method by its full name (none is added once serving)."""
        return self._registered

    def generic(self, details: grpc.HandlerCallDetails
                ) -> Optional[grpc.RpcMethodHandler[Any, Any]]:
        for generic in self._generic:
            handler: Optional[grpc.RpcMethodHandler[Any, Any]] = generic.service(details)
            if handler is not None:
                return handler
        return None


class HandlerCallDetails(grpc.HandlerCallDetails):
    """What generic handlers and interceptors are given about a fast-path call; its
    metadata is converted only if somebody reads it."""

    __slots__ = ("method", "_state")

    def __init__(self, method: str, state: Any) -> None:
        self.method = method
        self._state = state  # the call's state: its invocation_metadata() converts

    # read-only, converted when read; grpc's stubs declare a plain attribute
    @property
    def invocation_metadata(self) -> tuple[Any, ...]:  # type: ignore[override]
        return tuple(self._state.invocation_metadata())


def core_server(cfg: _config.Config, max_recv: int, max_concurrent: Optional[int]) -> Any:
    """The engine's server for the fast path, or None when the server is plain gRPC only
    (off, forced to grpc, or, with the transport left to argrpc, not available here)."""
    if not cfg.enabled or cfg.transport == "grpc":
        return None
    try:
        core = _engine.core_module()
        engine = _engine.get_engine(cfg)
        return core.Server(engine, {
            "max_recv": max_recv,
            "max_concurrent": -1 if max_concurrent is None else int(max_concurrent),
        })
    except Exception as exc:
        if cfg.transport != "auto":
            # The user demanded a fast transport: failing loudly beats a silent
            # plain-gRPC server.
            raise
        _LOGGER.warning("argrpc server: fast path unavailable, serving plain gRPC "
                        "only: %s", exc)
        return None


class Admission:
    """Places under maximum_concurrent_rpcs for calls on the gRPC port: the engine's
    count when the fast path is on (one limit for both ports), else a local one."""

    def __init__(self, limit: int, core: Any) -> None:
        self._limit = limit
        self._core = core
        self._count = 0
        self._lock = threading.Lock()

    def admit(self) -> bool:
        if self._core is not None:
            return bool(self._core.admit())
        with self._lock:
            if self._count >= self._limit:
                return False
            self._count += 1
            return True

    def release(self) -> None:
        if self._core is not None:
            self._core.release()
            return
        with self._lock:
            self._count = max(0, self._count - 1)


def behavior(handler: grpc.RpcMethodHandler[Any, Any]) -> Any:
    """The behaviour of the handler's arity: only what grpc reads (a handler the user
    writes need not have the other three)."""
    if handler.request_streaming:
        return handler.stream_stream if handler.response_streaming else handler.stream_unary
    return handler.unary_stream if handler.response_streaming else handler.unary_unary


def validate_generic_handlers(handlers: Iterable[Any]) -> None:
    """grpc's check of add_generic_rpc_handlers(), in its words."""
    for handler in handlers:
        if getattr(handler, "service", None) is None:
            raise AttributeError(
                f'"{handler}" must conform to grpc.GenericRpcHandler type but does not '
                'have "service" method!')
