"""Where a channel's calls go: the negotiation state both channels keep (``argrpc.Channel``
and ``argrpc.aio.Channel``), apart from how each runs the negotiation (a blocking call
under a lock, or an awaited one).

States: ``new`` (negotiate on the next call; also after the fast connection died),
``fast`` (``_fast`` holds the connection of the transport ``_fast_name``), ``grpc``
(settled on grpc for the channel's lifetime), ``retry`` (the server was unreachable: grpc,
or the forced error, until ``_next_try``), ``forced`` (``TF_RDMA_TRANSPORT`` forces an
impossible transport: calls fail).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Optional, Protocol

import grpc

from . import _config, _metrics_hooks, _status
from ._subchannels import SUBCHANNELS, Shared

if TYPE_CHECKING:
    from ._bootstrap import Negotiation

__all__ = ["NegotiationState", "encrypts"]

_LOGGER = logging.getLogger("argrpc")

NEW, FAST, GRPC, RETRY, FORCED = "new", "fast", "grpc", "retry", "forced"
_RETRY_INTERVAL_S = _config.LIMITS.renegotiate_interval_s


def encrypts(credentials: Any) -> bool:
    """Whether a channel's credentials encrypt its gRPC connection, so that the fast path
    (which encrypts nothing) needs TF_RDMA_OVER_TLS. Local credentials encrypt nothing
    either: the connection never leaves the host, and the shm handshake checks the peer's
    uid itself. grpc exposes no public way to tell them apart, hence the type's name."""
    if credentials is None:
        return False
    inner = getattr(credentials, "_credentials", None)
    return type(inner).__name__ != "LocalChannelCredentials"


class Balanced(Protocol):
    """What a channel's routing reads of its balancer (``_client.balancer``)."""

    def tried(self) -> bool: ...
    def transport(self) -> str: ...
    def fallback_reason(self) -> str: ...


class NegotiationState:
    _cfg: _config.Config
    _target: str
    _pool_key: Any  # what a shared connection must match (_subchannels.pool_key)
    _balancer: Optional["Balanced"] = None  # a channel's round-robin balancer, if any

    def _init_negotiation(self, track: bool = True) -> None:
        self._fast: Any = None
        self._fast_name = ""
        self._shared: Optional[Shared] = None  # what _fast is a handle on
        self._state = NEW
        self._reason = ""
        self._forced_error = ""
        self._next_try = 0.0
        self._logged = False
        self._closed = False
        if track:  # a channel, not one of its subchannels
            _metrics_hooks.track_channel(self)

    def _closing(self) -> bool:
        """close() has begun: no new fast connection."""
        return self._closed

    def _negotiation_due(self, wait_for_ready: Optional[bool]) -> bool:
        """No live fast connection and it is time to ask (again). A wait_for_ready call
        waits for the server anyway: it asks at once instead of after the interval."""
        if self._state == NEW:
            return True
        return self._state in (RETRY, FORCED) and (
            time.monotonic() >= self._next_try or bool(wait_for_ready and self._state == RETRY))

    def _drop_lost(self, fast: Any) -> None:
        """The fast connection died: the next call renegotiates."""
        self._fast = None
        self._state = NEW
        _LOGGER.info("argrpc: %s connection to %s lost (%s); renegotiating", self._fast_name,
                     self._target, fast.error or "closed")
        self._let_go(fast, _status.CHANNEL_CLOSED)

    def _let_go(self, fast: Any, why: str) -> None:
        """This channel is done with its handle `fast`: its own calls end CANCELLED `why`,
        and the connection closes if no other channel shares it."""
        shared, self._shared = self._shared, None
        if shared is None:
            return  # every fast handle comes from SUBCHANNELS with its Shared
        try:
            SUBCHANNELS.release(shared, fast, why)
        except Exception:  # noqa: BLE001 - already dead; nothing to release
            pass

    def _take_shared(self) -> bool:
        """Use a live connection another channel of this process shares (no negotiation),
        if there is one."""
        got = SUBCHANNELS.take(self._pool_key)
        if got is None:
            return False
        handle, shared = got
        if self._closing():
            SUBCHANNELS.release(shared, handle, _status.CHANNEL_CLOSED)
            return False
        self._adopt(handle, shared)
        return True

    def _adopt(self, handle: Any, shared: Shared) -> None:
        self._fast, self._fast_name, self._state = handle, shared.transport, FAST
        self._shared = shared
        self._reason = self._forced_error = ""

    def _settle(self, neg: Optional["Negotiation"], error: Optional[BaseException] = None
                ) -> None:
        """Takes a negotiation's outcome (or the exception it raised unexpectedly)."""
        # Late: negotiation needs the proto and engine modules.
        from ._bootstrap import Negotiation
        from ._transports import names

        if neg is None:
            _LOGGER.warning("argrpc: negotiation failed unexpectedly", exc_info=error)
            neg = Negotiation(transport="grpc", reason=f"negotiation failed: {error}",
                              kind="error")
        conn = neg.connection
        if neg.transport in names() and conn is not None:
            if self._closing():  # close() ran while we negotiated
                conn.close()
                return
            conn.set_stats_target(self._target)
            self._adopt(*SUBCHANNELS.add(self._pool_key, conn, neg.transport,
                                         neg.compression_disabled))
            return
        if conn is not None:
            conn.close()
        if self._state == NEW:  # retries of an unreachable server are one fallback
            _metrics_hooks.fallback(neg.kind or "other")
        self._reason = neg.reason or "no fast transport"
        self._forced_error = neg.forced_error
        if neg.retryable:
            self._state, self._next_try = RETRY, time.monotonic() + _RETRY_INTERVAL_S
        elif neg.forced_error:
            self._state, self._next_try = FORCED, float("inf")
        else:
            self._state = GRPC
        if not self._logged:
            self._logged = True
            level = logging.WARNING if neg.forced_error or self._cfg.transport not in (
                "auto", "grpc") else logging.INFO
            _LOGGER.log(level, "argrpc: channel to %s uses plain gRPC: %s%s", self._target,
                        neg.forced_error or self._reason,
                        " (will retry)" if neg.retryable else "")

    def _refused_compression(self, compression: Any) -> str:
        """Why the fast connection's server refuses a call's compression ("" if it does
        not): grpc's server answers such a call UNIMPLEMENTED with these words. A call's
        NoCompression means the channel's, which the negotiating call already used."""
        shared = self._shared
        if compression is None or shared is None or \
                not shared.compression_disabled & (1 << compression.value):
            return ""
        name = "deflate" if compression is grpc.Compression.Deflate else "gzip"
        return f"Compression algorithm '{name}' is disabled."

    @property
    def _on_grpc(self) -> bool:
        """Calls go over plain gRPC now (settled on it, retrying, or not negotiated yet)."""
        balancer = self._balancer
        if balancer is not None and self._state != GRPC:
            return not self._closed and balancer.tried() and balancer.transport() == "grpc"
        return not self._closed and self._fast is None and self._state != NEW

    def _fallback_text(self) -> str:
        """Why the channel is not on a fast transport ("" when it is)."""
        if self._fast is not None:
            return ""
        balancer = self._balancer
        if balancer is not None and self._state != GRPC:
            return balancer.fallback_reason()
        return self._forced_error or self._reason
