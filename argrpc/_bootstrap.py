"""Negotiation: one bootstrap RPC on the server's gRPC port picks the transport.

Client: `negotiate()` asks; every outcome that is not "shm" carries a reason the user
can read (`channel.fallback_reason`) and never raises. Server: `FastPathListener`
answers (a generic handler added to the real grpc server) and runs the shm handshake
socket.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any, Callable

import grpc

from argrpc import _proto
from argrpc._config import Config, conn_config
from argrpc._engine import get_engine
from argrpc._handshake import (IO_TIMEOUT, SECRET_LEN, SECRET_TTL, HandshakeError, SecretStore,
                               ShmAcceptor, client_handshake)
from argrpc._host import HostIdentity, local_identity, same_host_reason

__all__ = ["BOOTSTRAP_METHOD", "FastPathListener", "Negotiation", "negotiate"]

log = logging.getLogger("argrpc")

BOOTSTRAP_SERVICE = "argrpc.v1.Bootstrap"
BOOTSTRAP_METHOD = f"/{BOOTSTRAP_SERVICE}/Negotiate"
PROTOCOL_VERSION = 1
FAST_TRANSPORTS = ("shm",)  # offered/accepted, preferred first; verbs comes later
_PLAIN_SERVER_REASON = "server is plain gRPC (no argrpc bootstrap)"
# grpc auth_context values that mean the gRPC connection is encrypted.
_ENCRYPTED_TYPES = {b"ssl", b"tls", b"alts"}


@dataclasses.dataclass
class Negotiation:
    transport: str                # "shm" or "grpc"
    connection: Any = None        # _core.Connection when transport == "shm"
    reason: str = ""              # why not fast ("" when fast)
    retryable: bool = False       # server unreachable: negotiate again on a later call
    forced_error: str = ""        # TF_RDMA_TRANSPORT forces an impossible transport


# --------------------------------------------------------------------------- client

def _fallback(cfg: Config, reason: str, retryable: bool = False) -> Negotiation:
    forced = ""
    if cfg.transport == "shm" and cfg.enabled:
        forced = f"TF_RDMA_TRANSPORT=shm but shared memory is not possible: {reason}"
    return Negotiation(transport="grpc", reason=reason, retryable=retryable, forced_error=forced)


def negotiate(grpc_channel: grpc.Channel, cfg: Config, max_recv: int, timeout: float | None,
              wait_for_ready: bool = False, secure: bool = False) -> Negotiation:
    """Pick the transport for a channel. Never raises: failures fall back to gRPC."""
    result = _negotiate(grpc_channel, cfg, max_recv, timeout, wait_for_ready, secure)
    if result.transport == "shm":
        log.debug("argrpc: channel uses shm")
    else:
        log.debug("argrpc: channel uses plain gRPC: %s%s", result.reason,
                  " (will retry)" if result.retryable else "")
    return result


def _negotiate(grpc_channel: grpc.Channel, cfg: Config, max_recv: int, timeout: float | None,
               wait_for_ready: bool, secure: bool) -> Negotiation:
    if not cfg.enabled:
        return _fallback(cfg, "TF_RDMA_ENABLED=false")
    if secure and not cfg.over_tls:
        return _fallback(cfg, "secure_channel: the shared-memory fast path is not encrypted; "
                              "set TF_RDMA_OVER_TLS=true to allow it")
    if cfg.transport == "grpc":
        return _fallback(cfg, "TF_RDMA_TRANSPORT=grpc")
    request = _proto.NegotiateRequest(version=PROTOCOL_VERSION, transports=list(FAST_TRANSPORTS))
    local_identity().to_proto(request.host)
    rpc = grpc_channel.unary_unary(
        BOOTSTRAP_METHOD,
        request_serializer=_proto.NegotiateRequest.SerializeToString,
        response_deserializer=_proto.NegotiateResponse.FromString,
    )
    try:
        response = rpc(request, timeout=timeout, wait_for_ready=wait_for_ready)
    except grpc.RpcError as e:
        code = e.code() if isinstance(e, grpc.Call) else None
        details = e.details() if isinstance(e, grpc.Call) else str(e)
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return _fallback(cfg, _PLAIN_SERVER_REASON)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return _fallback(cfg, f"bootstrap RPC failed: {code.name}: {details}", retryable=True)
        name = code.name if code is not None else "error"
        return _fallback(cfg, f"bootstrap RPC failed: {name}: {details}")
    except Exception as e:  # e.g. ValueError: the grpc channel was already closed
        return _fallback(cfg, f"bootstrap RPC failed: {e}")

    if response.transport != "shm":
        reason = response.reason or f"server declined the fast path ({response.transport!r})"
        return _fallback(cfg, f"server: {reason}")
    offer = response.shm
    if (len(offer.secret) != SECRET_LEN or not offer.socket_name.startswith("argrpc/")
            or len(offer.socket_name.encode()) > 100 or "\0" in offer.socket_name):
        return _fallback(cfg, "server sent a malformed shm offer")
    try:
        # After the RPC on purpose: "server is plain gRPC" is the more useful reason when
        # both apply. An unused secret just expires on the server.
        engine = get_engine(cfg)
    except Exception as e:  # EngineUnavailable or CoreError
        return _fallback(cfg, str(e))
    try:
        conn = client_handshake(offer.socket_name, offer.server_pid, offer.secret, engine,
                                conn_config(cfg, max_recv), timeout=IO_TIMEOUT)
    except HandshakeError as e:
        return _fallback(cfg, f"shm handshake failed: {e}")
    except Exception as e:  # CoreError from new_shm_endpoint: still a fallback, not a crash
        log.warning("argrpc: shm handshake failed unexpectedly", exc_info=True)
        return _fallback(cfg, f"shm handshake failed: {e}")
    return Negotiation(transport="shm", connection=conn)


# --------------------------------------------------------------------------- server

def _is_encrypted(context: grpc.ServicerContext) -> bool:
    try:
        auth = context.auth_context() or {}
    except Exception:
        return False
    kinds = set(auth.get("transport_security_type", ()))
    return bool(kinds & _ENCRYPTED_TYPES)


class FastPathListener:
    """Server half of negotiation: answers the bootstrap RPC, owns the shm socket.

    `host`, `engine_factory` and `secret_ttl` exist for tests (fake host identities,
    an engine stand-in); production passes only the first three arguments.
    """

    def __init__(self, core_server: Any, cfg: Config, max_recv: int, *,
                 host: HostIdentity | None = None,
                 engine_factory: Callable[[], Any] | None = None,
                 secret_ttl: float = SECRET_TTL) -> None:
        self._core_server = core_server
        self._cfg = cfg
        self._max_recv = max_recv
        self._host = host
        self._engine_factory = engine_factory or (lambda: get_engine(cfg))
        self._secrets = SecretStore(ttl=secret_ttl)
        self._lock = threading.Lock()
        self._acceptor: ShmAcceptor | None = None
        self._closed = False

    # -- public

    def handler(self) -> grpc.GenericRpcHandler:
        """Add this to the real grpc server: it serves BOOTSTRAP_METHOD on the gRPC port."""
        return grpc.method_handlers_generic_handler(BOOTSTRAP_SERVICE, {
            "Negotiate": grpc.unary_unary_rpc_method_handler(
                self._serve,
                request_deserializer=_proto.NegotiateRequest.FromString,
                response_serializer=_proto.NegotiateResponse.SerializeToString,
            ),
        })

    def decide(self, request: Any, encrypted: bool = False) -> Any:
        """The NegotiateResponse for `request` (issues a secret when the answer is shm)."""
        response = self._decide(request, encrypted)
        client = request.host
        if response.transport == "shm":
            log.info("argrpc: offering shm to pid %d on %s", client.pid, client.hostname or "?")
        else:
            log.info("argrpc: no fast path for client pid %d on %s: %s", client.pid,
                     client.hostname or "?", response.reason)
        return response

    @property
    def socket_name(self) -> str | None:
        """The abstract socket name (no leading NUL) once the first shm offer started it."""
        acceptor = self._acceptor
        return acceptor.name if acceptor is not None else None

    def connections(self) -> list[Any]:
        acceptor = self._acceptor
        return acceptor.connections() if acceptor is not None else []

    def close_connections(self) -> None:
        """Close every attached shm connection (their calls end UNAVAILABLE)."""
        acceptor = self._acceptor
        if acceptor is not None:
            acceptor.close_connections()

    def close(self) -> None:
        """Stop the handshake socket and its thread; attached connections stay."""
        with self._lock:
            self._closed = True
            acceptor, self._acceptor = self._acceptor, None
        if acceptor is not None:
            acceptor.close()

    # -- internals

    def _serve(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.decide(request, encrypted=_is_encrypted(context))

    def _none(self, reason: str) -> Any:
        return _proto.NegotiateResponse(version=PROTOCOL_VERSION, transport="none", reason=reason)

    def _decide(self, request: Any, encrypted: bool) -> Any:
        cfg = self._cfg
        if not cfg.enabled:
            return self._none("server has TF_RDMA_ENABLED=false")
        if cfg.transport == "grpc":
            return self._none("server has TF_RDMA_TRANSPORT=grpc")
        if encrypted and not cfg.over_tls:
            return self._none("server port uses TLS and the server does not set "
                              "TF_RDMA_OVER_TLS=true (the fast path is not encrypted)")
        if self._core_server is None:
            return self._none("server's C++ engine (argrpc._core) is unavailable")
        offered = list(request.transports)
        if "shm" not in offered:
            return self._none(f"no common fast transport (client offers {offered}, "
                              f"server supports {list(FAST_TRANSPORTS)})")
        local = self._host or local_identity()
        reason = same_host_reason(local, HostIdentity.from_proto(request.host))
        if reason:
            return self._none(reason)
        try:
            acceptor = self._ensure_acceptor()
        except OSError as e:
            return self._none(f"server cannot open its shm socket: {e}")
        if acceptor is None:
            return self._none("server is shutting down")
        secret = self._secrets.issue(request.host.pid)
        return _proto.NegotiateResponse(
            version=PROTOCOL_VERSION, transport="shm",
            shm=_proto.ShmOffer(socket_name=acceptor.name, secret=secret,
                                server_pid=os.getpid()))

    def _ensure_acceptor(self) -> ShmAcceptor | None:
        with self._lock:
            if self._closed:
                return None
            if self._acceptor is None:
                self._acceptor = ShmAcceptor(self._secrets, self._engine_factory,
                                             conn_config(self._cfg, self._max_recv),
                                             self._core_server)
            return self._acceptor
