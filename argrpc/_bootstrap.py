"""Negotiation: one bootstrap RPC on the server's gRPC port picks the transport.

Client: `negotiate()` asks; every outcome that is not a fast transport carries a reason
the user can read (`channel.fallback_reason`) and never raises. Server:
`FastPathListener` answers (a generic handler added to the real grpc server) and owns
each transport's server half.

The choice: the first transport of the registry (`argrpc._transports`) that both ends
offer and that works between them; on one host that is shared memory, across hosts RDMA
verbs when both ends have a usable device; otherwise plain gRPC with the reason.
TF_RDMA_TRANSPORT names the one transport an end will use.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable, Generator, Sequence

import grpc
import grpc.aio

from argrpc import _proto
from argrpc._config import Config
from argrpc._engine import get_engine
from argrpc._fd_limit import near_limit_reason
from argrpc._host import HostIdentity, local_identity, same_host_reason, target_is_local
from argrpc._transports import (REGISTRY, Caller, ServerEnv, Transport, TransportServer,
                                Unavailable, by_name, selected)

__all__ = ["BOOTSTRAP_METHOD", "FastPathListener", "Negotiation", "client_offer", "negotiate",
           "negotiate_async", "negotiation"]

log = logging.getLogger("argrpc")

BOOTSTRAP_SERVICE = "argrpc.v1.Bootstrap"
BOOTSTRAP_METHOD = f"/{BOOTSTRAP_SERVICE}/Negotiate"
PROTOCOL_VERSION = 1
_PLAIN_SERVER_REASON = "server is plain gRPC (no argrpc bootstrap)"
_DEFERRED_REASON = "not offered first: the target is on this host"
# grpc auth_context values that mean the gRPC connection is encrypted.
_ENCRYPTED_TYPES = {b"ssl", b"tls", b"alts"}


@dataclasses.dataclass
class Negotiation:
    transport: str                # a registered transport's name, or "grpc"
    connection: Any = None        # _core.Connection when the transport is a fast one
    reason: str = ""              # why not fast ("" when fast)
    retryable: bool = False       # server unreachable: negotiate again on a later call
    forced_error: str = ""        # TF_RDMA_TRANSPORT forces an impossible transport
    kind: str = ""                # the reason's class, a metric label ("" when fast)
    compression_disabled: int = 0  # what the server refuses (bits of grpc.Compression values)


def client_offer(cfg: Config) -> tuple[list[str], dict[str, str]]:
    """(fast transports this client would offer, why not for each of the others).

    Used by `argrpc doctor`; negotiate() does the same and also creates what the offers
    need (a verbs endpoint).
    """
    offered: list[str] = []
    why_not: dict[str, str] = {}
    for t in REGISTRY:
        if cfg.transport not in ("auto", t.name):
            why_not[t.name] = f"TF_RDMA_TRANSPORT={cfg.transport}"
        elif why := t.why_unavailable(cfg):
            why_not[t.name] = why
        else:
            offered.append(t.name)
    return offered, why_not


# --------------------------------------------------------------------------- client

def _fallback(cfg: Config, reason: str, kind: str, retryable: bool = False) -> Negotiation:
    forced = ""
    required = by_name(cfg.transport)
    if required is not None and cfg.enabled:
        forced = (f"TF_RDMA_TRANSPORT={cfg.transport} but {required.what} is not "
                  f"possible: {reason}")
    return Negotiation(transport="grpc", reason=reason, retryable=retryable, forced_error=forced,
                       kind=kind)


def negotiate(grpc_channel: grpc.Channel, cfg: Config, max_recv: int, timeout: float | None,
              wait_for_ready: bool = False, secure: bool = False, target: str = "",
              grpc_alone: str = "") -> Negotiation:
    """Pick the transport for a channel. Never raises: failures fall back to gRPC.

    `target` (the channel's) lets auto mode skip what a cross-host offer creates (a verbs
    endpoint: QPs, a completion channel) for a server on this host, where a same-host
    transport wins: the others are offered only if that server then declines (another
    network namespace)."""
    rpc = _bootstrap_rpc(grpc_channel)
    _start_connecting(grpc_channel)
    steps = negotiation(cfg, max_recv, secure, target, grpc_alone)
    try:
        request = next(steps)
        while True:
            start = time.monotonic()
            for _ in range(_attempts()):
                try:
                    answer: Any = rpc(request, timeout=_left(timeout, start),
                                      wait_for_ready=wait_for_ready)
                    break
                except Exception as e:  # noqa: BLE001 - every failure is a reason to fall back
                    answer = e
                    if not _worth_asking_again(e):
                        break
            request = steps.send(answer)
    except StopIteration as done:
        return _logged(done.value)


async def negotiate_async(aio_channel: Any, cfg: Config, max_recv: int, timeout: float | None,
                          wait_for_ready: bool = False, secure: bool = False, target: str = "",
                          grpc_alone: str = "") -> Negotiation:
    """negotiate() over a `grpc.aio` channel: the same steps, the RPC awaited."""
    rpc = _bootstrap_rpc(aio_channel)
    _start_connecting(aio_channel)
    steps = negotiation(cfg, max_recv, secure, target, grpc_alone)
    try:
        request = next(steps)
        while True:
            start = time.monotonic()
            for _ in range(_attempts()):
                try:
                    answer: Any = await rpc(request, timeout=_left(timeout, start),
                                            wait_for_ready=wait_for_ready)
                    break
                except Exception as e:  # noqa: BLE001 - every failure is a reason to fall back
                    # Without its traceback: the frames in it hold the failed call, which
                    # keeps the grpc.aio channel from shutting down (its state watchers
                    # wait) until the garbage collector breaks the cycle.
                    answer = e.with_traceback(None)
                    if not _worth_asking_again(e):
                        break
            request = steps.send(answer)
    except StopIteration as done:
        return _logged(done.value)


# grpcio skips its fork handlers when other threads are inside gRPC at fork(), and in such
# a child the first RPC of a new channel often fails UNAVAILABLE ("Stream removed",
# "Wrong file descriptor generation") while the next one works: grpc's own calls fail
# the same way there. A negotiation in a forked child asks once more when that happens,
# or the child's channel would sit on gRPC for the retry interval. An unused offer of the
# first request just expires on the server.
_forked = False


def _after_fork_in_child() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def _attempts() -> int:
    return 2 if _forked else 1


def _worth_asking_again(error: BaseException) -> bool:
    return isinstance(error, (grpc.Call, grpc.aio.AioRpcError)) and \
        error.code() == grpc.StatusCode.UNAVAILABLE


def _left(timeout: float | None, start: float) -> float | None:
    return None if timeout is None else max(0.0, timeout - (time.monotonic() - start))


def _start_connecting(channel: Any) -> None:
    """Have grpc connect now, while the offer is being prepared: the bootstrap RPC then
    finds the connection (or most of it) made. A new channel's first call does this
    anyway, only later; what grpc's connectivity API shows is the same. grpc's threaded
    channel has no public way to ask without a subscription (which polls on a thread of
    its own), so its cygrpc channel is asked; one that lacks it just connects later."""
    try:
        if isinstance(channel, grpc.aio.Channel):
            channel.get_state(try_to_connect=True)
        else:
            getattr(channel, "_channel").check_connectivity_state(True)
    except Exception:  # noqa: BLE001 - closed, or a grpc without it: the RPC connects
        pass


def _bootstrap_rpc(channel: Any) -> Any:
    # Not a registered method, though grpc's own metrics would then name it: grpc 1.85
    # crashes the process making a registered multicallable on a closed channel.
    return channel.unary_unary(
        BOOTSTRAP_METHOD,
        request_serializer=_proto.NegotiateRequest.SerializeToString,
        response_deserializer=_proto.NegotiateResponse.FromString,
    )


def _logged(result: Negotiation) -> Negotiation:
    if result.transport != "grpc":
        log.debug("argrpc: channel uses %s", result.transport)
    else:
        log.debug("argrpc: channel uses plain gRPC: %s%s", result.reason,
                  " (will retry)" if result.retryable else "")
    return result


# The negotiation itself, apart from how its RPC is made (a blocking call on a grpc
# channel, or awaited on a grpc.aio one): a generator that yields each bootstrap
# request, is sent the response (or the exception the RPC raised) and returns the
# Negotiation.
Steps = Generator[Any, Any, Negotiation]


def negotiation(cfg: Config, max_recv: int, secure: bool, target: str,
                grpc_alone: str = "") -> Steps:
    if not cfg.enabled:
        return _fallback(cfg, "TF_RDMA_ENABLED=false", "disabled")
    if secure and not cfg.over_tls:
        return _fallback(cfg, "secure_channel: the fast paths (shared memory, RDMA) are not "
                              "encrypted; set TF_RDMA_OVER_TLS=true to allow them", "tls")
    if cfg.transport == "grpc":
        return _fallback(cfg, "TF_RDMA_TRANSPORT=grpc", "transport_grpc")
    if grpc_alone:  # the target's scheme or balancing policy is grpc's: no server to ask
        return _fallback(cfg, grpc_alone, "grpc_alone")
    if near_limit := near_limit_reason():  # asked again after the interval
        return _fallback(cfg, near_limit, "fd_limit", retryable=True)
    if cfg.transport == "auto" and target and target_is_local(target):
        # Same-host transports first; the others only if this process can use them and
        # the server declines (it runs in another network namespace). Whether it can is
        # asked only then: probing for a verbs device loads libibverbs, which cost a new
        # process's first call more than a millisecond before its bootstrap RPC.
        later = [t for t in selected(cfg) if not t.same_host_only]
        first, declined = yield from _ask(cfg, max_recv, target,
                                          {t.name: _DEFERRED_REASON for t in later})
        if not declined:
            return first
        why_not = {t: why for t in later if (why := t.why_unavailable(cfg))}
        if len(why_not) == len(later):
            return _quoting(first, why_not)
    return (yield from _ask(cfg, max_recv, target))[0]


def _quoting(declined: Negotiation, why_not: dict[Transport, str]) -> Negotiation:
    """The server's refusal as if the request had carried the real reasons the client
    cannot use the deferred transports: the server only quotes what the client said."""
    reason = declined.reason
    for t, why in why_not.items():
        for before in (f"client has no {t.name}: ", f"the client cannot use {t.what}: "):
            reason = reason.replace(before + _DEFERRED_REASON, before + why)
    return dataclasses.replace(declined, reason=reason)


def _ask(cfg: Config, max_recv: int, target: str, skipped: dict[str, str] | None = None
         ) -> Generator[Any, Any, tuple[Negotiation, bool]]:
    """One bootstrap RPC, offering every selected transport except `skipped` (name: why
    not); also whether the server answered and declined."""
    request = _proto.NegotiateRequest(version=PROTOCOL_VERSION)
    offers: dict[str, Any] = {}
    for t in selected(cfg):
        why = (skipped or {}).get(t.name)
        if why:
            t.decline(request, why)
            continue
        try:
            offers[t.name] = t.offer(request, cfg, max_recv, target=target)
        except Unavailable as e:
            if cfg.transport == t.name:
                return _fallback(cfg, f"this host: {e}", "this_host"), False
            t.decline(request, str(e))
    local_identity().to_proto(request.host)
    response = yield request
    if isinstance(response, grpc.RpcError):
        code = response.code() if isinstance(response, (grpc.Call, grpc.aio.AioRpcError)) else None
        details = response.details() if isinstance(response, (grpc.Call, grpc.aio.AioRpcError)) \
            else str(response)
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return _fallback(cfg, _PLAIN_SERVER_REASON, "plain_server"), False
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return _fallback(cfg, f"bootstrap RPC failed: {code.name}: {details}",
                             "server_unreachable", retryable=True), False
        name = code.name if code is not None else "error"
        return _fallback(cfg, f"bootstrap RPC failed: {name}: {details}",
                         "bootstrap_failed"), False
    if isinstance(response, BaseException):  # e.g. ValueError: the channel was closed
        return _fallback(cfg, f"bootstrap RPC failed: {response}", "bootstrap_failed"), False

    chosen = by_name(response.transport)
    if chosen is None:
        reason = response.reason or f"server declined the fast path ({response.transport!r})"
        return _fallback(cfg, f"server: {reason}", "server_declined"), True
    if chosen.name not in offers:
        return _fallback(cfg, f"server chose {chosen.name}, which this client did not "
                              "offer", "not_offered"), False
    offer = offers.pop(chosen.name)
    offers.clear()  # what the server did not pick is released now (e.g. QPs still in INIT)
    try:
        conn = chosen.attach(offer, response, cfg, max_recv)
    except Unavailable as e:
        return _fallback(cfg, str(e), "attach_failed"), False
    return Negotiation(transport=chosen.name, connection=conn,
                       compression_disabled=response.compression_disabled), False


# --------------------------------------------------------------------------- server

def _is_encrypted(caller: Caller) -> bool:
    return any(k == "transport_security_type" and v in _ENCRYPTED_TYPES for k, v in caller.auth)


class FastPathListener:
    """Server half of negotiation: answers the bootstrap RPC, owns each transport's server
    half.

    `host`, `engine_factory` and `transports` exist for tests (fake host identities, an
    engine stand-in, transports with stand-ins of their own); production passes only the
    first three arguments.
    """

    def __init__(self, core_server: Any, cfg: Config, max_recv: int, *,
                 compression_disabled: int = 0,
                 host: HostIdentity | None = None,
                 engine_factory: Callable[[], Any] | None = None,
                 transports: Sequence[Transport] = REGISTRY) -> None:
        self._core_server = core_server
        self._cfg = cfg
        self._compression_disabled = compression_disabled
        self._host = host
        self._transports = tuple(transports)
        env = ServerEnv(core_server, cfg, max_recv, engine_factory or (lambda: get_engine(cfg)))
        self._servers = {t.name: t.server(env) for t in self._transports}

    # -- public

    def method_handlers(self) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
        """Register these on the real grpc server under BOOTSTRAP_SERVICE (as registered
        methods: no catch-all generic handler can shadow them, and grpc's own metrics name
        the call instead of counting it as "other")."""
        return {"Negotiate": grpc.unary_unary_rpc_method_handler(
            self._serve,
            request_deserializer=_proto.NegotiateRequest.FromString,
            response_serializer=_proto.NegotiateResponse.SerializeToString,
        )}

    def handler(self) -> grpc.GenericRpcHandler:
        """The same as a generic handler, for a plain grpc server of the caller's."""
        return grpc.method_handlers_generic_handler(BOOTSTRAP_SERVICE, self.method_handlers())

    def decide(self, request: Any, caller: Caller = Caller()) -> Any:
        """The NegotiateResponse for `request` (the chosen transport's server half has
        accepted it). `caller`: the client as grpc saw the negotiating call, given to its
        fast-path calls."""
        response = self._decide(request, caller)
        chosen = by_name(response.transport, self._transports)
        if chosen is not None:
            log.info("argrpc: %s", chosen.describe(request))
        else:
            client = request.host
            log.info("argrpc: no fast path for client pid %d on %s: %s", client.pid,
                     client.hostname or "?", response.reason)
        return response

    def transport_server(self, name: str) -> TransportServer:
        return self._servers[name]

    def connections(self) -> list[Any]:
        return [conn for half in self._servers.values() for conn in half.connections()]

    def close_connections(self) -> None:
        """Close every attached connection (their calls end UNAVAILABLE)."""
        for half in self._servers.values():
            half.close_connections()

    def close(self) -> None:
        """Stop the transports' listeners and handshakes; attached connections stay."""
        for half in self._servers.values():
            half.close()

    # -- internals

    def _serve(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.decide(request, Caller.of(context))

    def _none(self, reason: str) -> Any:
        return _proto.NegotiateResponse(version=PROTOCOL_VERSION, transport="none", reason=reason)

    def _decide(self, request: Any, caller: Caller) -> Any:
        cfg = self._cfg
        if not cfg.enabled:
            return self._none("server has TF_RDMA_ENABLED=false")
        if cfg.transport == "grpc":
            return self._none("server has TF_RDMA_TRANSPORT=grpc")
        if _is_encrypted(caller) and not cfg.over_tls:
            return self._none("server port uses TLS and the server does not set "
                              "TF_RDMA_OVER_TLS=true (the fast paths are not encrypted)")
        if self._core_server is None:
            return self._none("server's C++ engine (argrpc._core) is unavailable")
        offered = list(request.transports)
        accepted = selected(cfg, self._transports)
        if not any(t.name in offered for t in accepted):
            why = "".join(f"; client has no {t.name}: {no}" for t in self._transports
                          if (no := t.client_declined(request)))
            forced = f" (TF_RDMA_TRANSPORT={cfg.transport})" if cfg.transport != "auto" else ""
            return self._none(f"no common fast transport (client offers {offered}, server "
                              f"accepts {[t.name for t in accepted]}{forced}{why})")
        reasons = []
        for t in accepted:
            if t.name not in offered:
                if no := t.client_declined(request):
                    reasons.append(f"{t.name}: the client cannot use {t.what}: {no}")
                continue
            if t.same_host_only:
                local = self._host or local_identity()
                elsewhere = same_host_reason(local, HostIdentity.from_proto(request.host))
                if elsewhere:
                    reasons.append(elsewhere)
                    continue
            response = _proto.NegotiateResponse(version=PROTOCOL_VERSION, transport=t.name,
                                                compression_disabled=self._compression_disabled)
            declined = self._servers[t.name].accept(request, response, caller)
            if declined is None:
                return response
            if declined.final:
                return self._none(declined.reason)
            reasons.append(f"{t.name}: {declined.reason}")
        return self._none("; ".join(reasons))
