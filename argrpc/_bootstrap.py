"""Negotiation: one bootstrap RPC on the server's gRPC port picks the transport.

Client: `negotiate()` asks; every outcome that is not a fast transport carries a reason
the user can read (`channel.fallback_reason`) and never raises. Server:
`FastPathListener` answers (a generic handler added to the real grpc server) and runs
the shm handshake socket.

The choice (issue 4, point 4): on one host (same boot, network namespace and user) shm,
unless either end sets TF_RDMA_TRANSPORT=verbs; across hosts verbs when both ends have a
usable RDMA device; otherwise plain gRPC with the reason. A client that offers verbs
sends its verbs endpoint (created before the RPC: RC queue pairs need both ends' data,
and one round trip is all the bootstrap has); when the server picks verbs it creates its
own endpoint, attaches it to the client's and returns it, and the client attaches.
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
from argrpc._engine import EngineUnavailable, core_module, get_engine
from argrpc._handshake import (IO_TIMEOUT, SECRET_LEN, SECRET_TTL, HandshakeError, SecretStore,
                               ShmAcceptor, client_handshake)
from argrpc._host import HostIdentity, local_identity, same_host_reason, target_is_local

__all__ = ["BOOTSTRAP_METHOD", "FastPathListener", "Negotiation", "client_offer", "negotiate",
           "verbs_probe"]

log = logging.getLogger("argrpc")

BOOTSTRAP_SERVICE = "argrpc.v1.Bootstrap"
BOOTSTRAP_METHOD = f"/{BOOTSTRAP_SERVICE}/Negotiate"
PROTOCOL_VERSION = 1
FAST_TRANSPORTS = ("shm", "verbs")  # negotiated by this build; on one host shm wins
_MAX_VERBS_BLOB = 64 * 1024  # far above any real endpoint; bounds what a peer can make us parse
_PLAIN_SERVER_REASON = "server is plain gRPC (no argrpc bootstrap)"
# grpc auth_context values that mean the gRPC connection is encrypted.
_ENCRYPTED_TYPES = {b"ssl", b"tls", b"alts"}


@dataclasses.dataclass
class Negotiation:
    transport: str                # "shm", "verbs" or "grpc"
    connection: Any = None        # _core.Connection when transport is "shm" or "verbs"
    reason: str = ""              # why not fast ("" when fast)
    retryable: bool = False       # server unreachable: negotiate again on a later call
    forced_error: str = ""        # TF_RDMA_TRANSPORT forces an impossible transport


# --------------------------------------------------------------------------- verbs

class VerbsUnavailable(Exception):
    """This process cannot use RDMA verbs; str(e) says why."""


def verbs_probe(cfg: Config) -> dict[str, Any]:
    """The device/port/GID `verbs_select` picks for `cfg`; raises VerbsUnavailable.

    Cheap (no queue pair or memory registration): it only reads device attributes.
    """
    try:
        core = core_module()
    except EngineUnavailable as e:
        raise VerbsUnavailable(str(e)) from None
    if not hasattr(core, "verbs_select"):
        raise VerbsUnavailable("this build of argrpc's engine (argrpc._core) has no verbs fabric")
    status = core.verbs_status()
    if status:
        raise VerbsUnavailable(f"libibverbs is not loadable: {status}")
    try:
        return dict(core.verbs_select(cfg.dev_name, cfg.port_num, cfg.gid_index))
    except Exception as e:  # CoreError: the reason names what was looked at
        raise VerbsUnavailable(str(e)) from None


def _verbs_info(sel: dict[str, Any], blob: bytes) -> Any:
    return _proto.VerbsEndpoint(blob=blob, device=str(sel.get("device", "")),
                                port=int(sel.get("port", 0) or 0), gid=str(sel.get("gid", "")),
                                gid_type=str(sel.get("gid_type", "")), pid=os.getpid())


def _describe(ep: Any) -> str:
    """'rxe0:1 ::ffff:10.0.0.2 (RoCEv2) pid 123' for logs and peer names."""
    where = f"{ep.device or '?'}:{ep.port}"
    if ep.gid:
        where += f" {ep.gid}" + (f" ({ep.gid_type})" if ep.gid_type else "")
    return where + (f" pid {ep.pid}" if ep.pid else "")


def client_offer(cfg: Config) -> tuple[list[str], str]:
    """(fast transports this client would offer, why verbs is not among them or "").

    Used by `argrpc doctor`; negotiate() does the same and also creates the endpoint.
    """
    offer = ["shm"] if cfg.transport in ("auto", "shm") else []
    why = ""
    if cfg.transport in ("auto", "verbs"):
        try:
            verbs_probe(cfg)
            offer.append("verbs")
        except VerbsUnavailable as e:
            why = str(e)
    elif cfg.transport == "shm":
        why = "TF_RDMA_TRANSPORT=shm"
    return offer, why


# --------------------------------------------------------------------------- client

_FORCED_WHAT = {"shm": "shared memory", "verbs": "RDMA verbs"}


def _fallback(cfg: Config, reason: str, retryable: bool = False) -> Negotiation:
    forced = ""
    if cfg.transport in _FORCED_WHAT and cfg.enabled:
        forced = (f"TF_RDMA_TRANSPORT={cfg.transport} but {_FORCED_WHAT[cfg.transport]} is not "
                  f"possible: {reason}")
    return Negotiation(transport="grpc", reason=reason, retryable=retryable, forced_error=forced)


def negotiate(grpc_channel: grpc.Channel, cfg: Config, max_recv: int, timeout: float | None,
              wait_for_ready: bool = False, secure: bool = False, target: str = ""
              ) -> Negotiation:
    """Pick the transport for a channel. Never raises: failures fall back to gRPC.

    `target` (the channel's) lets auto mode skip creating a verbs endpoint (QPs, a
    completion channel) for a server on this host, where shared memory wins: verbs is
    offered only if that server then declines shm (another network namespace)."""
    result = _negotiate(grpc_channel, cfg, max_recv, timeout, wait_for_ready, secure, target)
    if result.transport != "grpc":
        log.debug("argrpc: channel uses %s", result.transport)
    else:
        log.debug("argrpc: channel uses plain gRPC: %s%s", result.reason,
                  " (will retry)" if result.retryable else "")
    return result


@dataclasses.dataclass
class _VerbsOffer:
    engine: Any
    endpoint: Any
    select: dict[str, Any]


def _prepare_verbs(cfg: Config, max_recv: int) -> _VerbsOffer:
    """Create this client's verbs endpoint (QPs in INIT, MRs); raises VerbsUnavailable."""
    sel = verbs_probe(cfg)
    try:
        engine = get_engine(cfg)
        endpoint = engine.new_verbs_endpoint(conn_config(cfg, max_recv), sel, cfg.qps)
    except Exception as e:  # EngineUnavailable or CoreError (e.g. memlock too low)
        raise VerbsUnavailable(f"cannot create a verbs endpoint: {e}") from None
    return _VerbsOffer(engine, endpoint, sel)


def _negotiate(grpc_channel: grpc.Channel, cfg: Config, max_recv: int, timeout: float | None,
               wait_for_ready: bool, secure: bool, target: str) -> Negotiation:
    if not cfg.enabled:
        return _fallback(cfg, "TF_RDMA_ENABLED=false")
    if secure and not cfg.over_tls:
        return _fallback(cfg, "secure_channel: the fast paths (shared memory, RDMA) are not "
                              "encrypted; set TF_RDMA_OVER_TLS=true to allow them")
    if cfg.transport == "grpc":
        return _fallback(cfg, "TF_RDMA_TRANSPORT=grpc")
    if cfg.transport == "auto" and target and target_is_local(target):
        # Shared memory first, without a verbs endpoint; verbs only if this host has a
        # device and the server declines shm (it runs in another network namespace).
        try:
            verbs_probe(cfg)
        except VerbsUnavailable as e:
            return _ask(grpc_channel, cfg, max_recv, timeout, wait_for_ready, str(e))[0]
        first, declined = _ask(grpc_channel, cfg, max_recv, timeout, wait_for_ready,
                               "not offered first: the target is on this host")
        if not declined:
            return first
    return _ask(grpc_channel, cfg, max_recv, timeout, wait_for_ready)[0]


def _ask(grpc_channel: grpc.Channel, cfg: Config, max_recv: int, timeout: float | None,
         wait_for_ready: bool, no_verbs: str = "") -> tuple[Negotiation, bool]:
    """One bootstrap RPC, offering verbs unless no_verbs says why not; also whether the
    server answered and declined."""
    request = _proto.NegotiateRequest(version=PROTOCOL_VERSION)
    if cfg.transport in ("auto", "shm"):
        request.transports.append("shm")
    verbs: _VerbsOffer | None = None
    if no_verbs:
        request.verbs_unavailable = no_verbs
    elif cfg.transport in ("auto", "verbs"):
        try:
            verbs = _prepare_verbs(cfg, max_recv)
        except VerbsUnavailable as e:
            if cfg.transport == "verbs":
                return _fallback(cfg, f"this host: {e}"), False
            request.verbs_unavailable = str(e)
        else:
            request.transports.append("verbs")
            request.verbs.CopyFrom(_verbs_info(verbs.select, bytes(verbs.endpoint.blob)))
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
            return _fallback(cfg, _PLAIN_SERVER_REASON), False
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return _fallback(cfg, f"bootstrap RPC failed: {code.name}: {details}",
                             retryable=True), False
        name = code.name if code is not None else "error"
        return _fallback(cfg, f"bootstrap RPC failed: {name}: {details}"), False
    except Exception as e:  # e.g. ValueError: the grpc channel was already closed
        return _fallback(cfg, f"bootstrap RPC failed: {e}"), False

    # An endpoint the server did not pick is dropped here (its QPs never left INIT).
    if response.transport == "verbs":
        return _attach_verbs(cfg, verbs, response), False
    verbs = None
    if response.transport != "shm":
        reason = response.reason or f"server declined the fast path ({response.transport!r})"
        return _fallback(cfg, f"server: {reason}"), True
    if "shm" not in request.transports:
        return _fallback(cfg, "server chose shm, which this client did not offer"), False
    offer = response.shm
    if (len(offer.secret) != SECRET_LEN or not offer.socket_name.startswith("argrpc/")
            or len(offer.socket_name.encode()) > 100 or "\0" in offer.socket_name):
        return _fallback(cfg, "server sent a malformed shm offer"), False
    try:
        # After the RPC on purpose: "server is plain gRPC" is the more useful reason when
        # both apply. An unused secret just expires on the server.
        engine = get_engine(cfg)
    except Exception as e:  # EngineUnavailable or CoreError
        return _fallback(cfg, str(e)), False
    try:
        conn = client_handshake(offer.socket_name, offer.server_pid, offer.secret, engine,
                                conn_config(cfg, max_recv), timeout=IO_TIMEOUT)
    except HandshakeError as e:
        return _fallback(cfg, f"shm handshake failed: {e}"), False
    except Exception as e:  # CoreError from new_shm_endpoint: still a fallback, not a crash
        log.warning("argrpc: shm handshake failed unexpectedly", exc_info=True)
        return _fallback(cfg, f"shm handshake failed: {e}"), False
    return Negotiation(transport="shm", connection=conn), False


def _attach_verbs(cfg: Config, verbs: _VerbsOffer | None, response: Any) -> Negotiation:
    if verbs is None:
        return _fallback(cfg, "server chose verbs, which this client did not offer")
    peer = response.verbs
    if not response.HasField("verbs") or not peer.blob or len(peer.blob) > _MAX_VERBS_BLOB:
        return _fallback(cfg, "server sent a malformed verbs endpoint")
    try:
        conn = verbs.engine.attach_verbs(verbs.endpoint, bytes(peer.blob), None,
                                         f"verbs:{_describe(peer)}")
    except Exception as e:  # CoreError: blob rejected, QP transition failed
        return _fallback(cfg, f"attaching the verbs connection failed: {e}")
    return Negotiation(transport="verbs", connection=conn)


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

    `host`, `engine_factory`, `verbs_select` and `secret_ttl` exist for tests (fake host
    identities, an engine stand-in, a device stand-in); production passes only the first
    three arguments.
    """

    def __init__(self, core_server: Any, cfg: Config, max_recv: int, *,
                 host: HostIdentity | None = None,
                 engine_factory: Callable[[], Any] | None = None,
                 verbs_select: Callable[[Config], dict[str, Any]] | None = None,
                 secret_ttl: float = SECRET_TTL) -> None:
        self._core_server = core_server
        self._cfg = cfg
        self._max_recv = max_recv
        self._host = host
        self._engine_factory = engine_factory or (lambda: get_engine(cfg))
        self._verbs_select = verbs_select or verbs_probe
        self._secrets = SecretStore(ttl=secret_ttl)
        self._lock = threading.Lock()
        self._acceptor: ShmAcceptor | None = None
        self._verbs_conns: list[Any] = []
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

    def decide(self, request: Any, encrypted: bool = False, user_agent: str = "") -> Any:
        """The NegotiateResponse for `request` (issues a secret when the answer is shm).
        `user_agent`: what the client's channel sent, given to its fast-path calls."""
        response = self._decide(request, encrypted, user_agent)
        client = request.host
        if response.transport == "shm":
            log.info("argrpc: offering shm to pid %d on %s", client.pid, client.hostname or "?")
        elif response.transport == "verbs":
            log.info("argrpc: verbs connection with %s on %s attached", _describe(request.verbs),
                     client.hostname or "?")
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
        shm = acceptor.connections() if acceptor is not None else []
        with self._lock:
            self._prune_verbs()
            return shm + list(self._verbs_conns)

    def close_connections(self) -> None:
        """Close every attached shm and verbs connection (their calls end UNAVAILABLE)."""
        acceptor = self._acceptor
        if acceptor is not None:
            acceptor.close_connections()
        with self._lock:
            conns, self._verbs_conns = self._verbs_conns, []
        for conn in conns:
            try:
                conn.close()
            except Exception:  # a dying connection may already be gone
                log.debug("argrpc: closing verbs connection failed", exc_info=True)

    def close(self) -> None:
        """Stop the handshake socket and its thread; attached connections stay (the
        acceptor is kept: close_connections() still needs its list of them)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            acceptor = self._acceptor
        if acceptor is not None:
            acceptor.close()

    # -- internals

    def _serve(self, request: Any, context: grpc.ServicerContext) -> Any:
        user_agent = next((str(v) for k, v in context.invocation_metadata()
                           if k == "user-agent"), "")
        return self.decide(request, encrypted=_is_encrypted(context), user_agent=user_agent)

    def _none(self, reason: str) -> Any:
        return _proto.NegotiateResponse(version=PROTOCOL_VERSION, transport="none", reason=reason)

    def _decide(self, request: Any, encrypted: bool, user_agent: str) -> Any:
        cfg = self._cfg
        if not cfg.enabled:
            return self._none("server has TF_RDMA_ENABLED=false")
        if cfg.transport == "grpc":
            return self._none("server has TF_RDMA_TRANSPORT=grpc")
        if encrypted and not cfg.over_tls:
            return self._none("server port uses TLS and the server does not set "
                              "TF_RDMA_OVER_TLS=true (the fast paths are not encrypted)")
        if self._core_server is None:
            return self._none("server's C++ engine (argrpc._core) is unavailable")
        offered = list(request.transports)
        accepted = list(FAST_TRANSPORTS) if cfg.transport == "auto" else [cfg.transport]
        common = [t for t in accepted if t in offered]
        client_no_verbs = request.verbs_unavailable
        if not common:
            why = f"; client has no verbs: {client_no_verbs}" if client_no_verbs else ""
            forced = f" (TF_RDMA_TRANSPORT={cfg.transport})" if cfg.transport != "auto" else ""
            return self._none(f"no common fast transport (client offers {offered}, server "
                              f"accepts {accepted}{forced}{why})")
        reasons = []
        if "shm" in common:
            local = self._host or local_identity()
            reason = same_host_reason(local, HostIdentity.from_proto(request.host))
            if not reason:
                return self._offer_shm(request, user_agent)
            reasons.append(reason)
        if "verbs" in common:
            answer = self._accept_verbs(request, user_agent)
            if not isinstance(answer, str):
                return answer
            reasons.append(f"verbs: {answer}")
        elif "verbs" in accepted and client_no_verbs:
            reasons.append(f"verbs: the client cannot use RDMA verbs: {client_no_verbs}")
        return self._none("; ".join(reasons))

    def _offer_shm(self, request: Any, user_agent: str) -> Any:
        try:
            acceptor = self._ensure_acceptor()
        except OSError as e:
            return self._none(f"server cannot open its shm socket: {e}")
        if acceptor is None:
            return self._none("server is shutting down")
        secret = self._secrets.issue(request.host.pid, user_agent)
        return _proto.NegotiateResponse(
            version=PROTOCOL_VERSION, transport="shm",
            shm=_proto.ShmOffer(socket_name=acceptor.name, secret=secret,
                                server_pid=os.getpid()))

    def _accept_verbs(self, request: Any, user_agent: str) -> Any:
        """The "verbs" NegotiateResponse with the server's attached endpoint, or why not."""
        peer = request.verbs
        if not request.HasField("verbs") or not peer.blob:
            return "the client offered verbs without its endpoint data"
        if len(peer.blob) > _MAX_VERBS_BLOB:
            return f"the client's verbs endpoint data is too large ({len(peer.blob)} bytes)"
        try:
            sel = self._verbs_select(self._cfg)
        except VerbsUnavailable as e:
            return f"the server cannot use RDMA verbs: {e}"
        try:
            engine = self._engine_factory()
            endpoint = engine.new_verbs_endpoint(conn_config(self._cfg, self._max_recv), sel,
                                                 self._cfg.qps)
        except Exception as e:  # CoreError (e.g. memlock too low) or no engine
            return f"the server cannot create a verbs endpoint: {e}"
        with self._lock:
            if self._closed:
                return "server is shutting down"
        try:
            # Attached before answering, so the server's QPs are ready (RTR) when the
            # client's first batch arrives right after it attached its own.
            conn = engine.attach_verbs(endpoint, bytes(peer.blob), self._core_server,
                                       f"verbs:{_describe(peer)}", user_agent=user_agent)
        except Exception as e:  # CoreError: blob rejected, QP transition failed
            return f"the server cannot connect to the client's verbs endpoint: {e}"
        with self._lock:
            self._prune_verbs()
            self._verbs_conns.append(conn)
        return _proto.NegotiateResponse(version=PROTOCOL_VERSION, transport="verbs",
                                        verbs=_verbs_info(sel, bytes(endpoint.blob)))

    def _prune_verbs(self) -> None:
        self._verbs_conns = [c for c in self._verbs_conns if getattr(c, "alive", True)]

    def _ensure_acceptor(self) -> ShmAcceptor | None:
        with self._lock:
            if self._closed:
                return None
            if self._acceptor is None:
                self._acceptor = ShmAcceptor(self._secrets, self._engine_factory,
                                             conn_config(self._cfg, self._max_recv),
                                             self._core_server)
            return self._acceptor
