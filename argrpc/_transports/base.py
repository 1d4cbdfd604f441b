"""What negotiation asks of a fast transport, on the client and on the server.

A transport object is stateless and shared by every channel and server of the process;
`server(env)` makes the stateful server half (its listener, its connections) for one
argrpc server. Protobuf messages are typed Any: their classes are generated at import.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import threading
from typing import Any, Callable

from argrpc._config import Config, conn_config

__all__ = ["Caller", "Connections", "Declined", "ServerEnv", "Transport", "TransportServer",
           "Unavailable"]

log = logging.getLogger("argrpc")


class Unavailable(Exception):
    """The transport cannot be used here or with this peer; str(e) is a reason fit for
    `channel.fallback_reason`."""


@dataclasses.dataclass(frozen=True)
class Caller:
    """The client as grpc saw it on the call that negotiated: every fast-path call of the
    connection answers `peer()`, `auth_context()`, `peer_identity_key()` and the
    user-agent with these, as that gRPC call did (same process, same identity)."""
    address: str = ""
    user_agent: str = ""
    auth: tuple[tuple[str, bytes], ...] = ()
    identity_key: str = ""

    @classmethod
    def of(cls, context: Any) -> Caller:
        """From a grpc or grpc.aio ServicerContext."""
        user_agent = next((str(v) for k, v in (context.invocation_metadata() or ())
                           if k == "user-agent"), "")
        auth = tuple((str(k), bytes(v)) for k, vs in (context.auth_context() or {}).items()
                     for v in vs)
        return cls(address=context.peer() or "", user_agent=user_agent, auth=auth,
                   identity_key=context.peer_identity_key() or "")

    def remote(self, name: str) -> Any:
        """The engine's PeerInfo for a connection argrpc calls `name` in its logs."""
        from argrpc import _core
        return _core.PeerInfo(name, address=self.address, user_agent=self.user_agent,
                              auth=list(self.auth), identity_key=self.identity_key)


@dataclasses.dataclass(frozen=True)
class Declined:
    """Why a server half does not accept an offer."""
    reason: str
    # The server answers "none" with this reason at once: the failure is the server's
    # (shutting down, no socket), so it is the reason worth reading, not the next
    # transport's.
    final: bool = False


@dataclasses.dataclass(frozen=True)
class ServerEnv:
    """What a server half shares with the argrpc server that owns it."""
    core_server: Any                  # _core.Server: accepted connections serve its calls
    cfg: Config
    max_recv: int
    engine_factory: Callable[[], Any]  # the process's _core.Engine (it may raise)

    @property
    def conn_cfg(self) -> dict[str, int]:
        return conn_config(self.cfg, self.max_recv)


class Connections:
    """The live connections a server half attached (dead ones drop out when listed)."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._lock = threading.Lock()
        self._items: list[Any] = []

    def add(self, conn: Any) -> None:
        with self._lock:
            self._prune()
            self._items.append(conn)

    def discard(self, conn: Any) -> None:
        with self._lock:
            if conn in self._items:
                self._items.remove(conn)

    def live(self) -> list[Any]:
        with self._lock:
            self._prune()
            return list(self._items)

    def close_all(self) -> None:
        """Close every connection (their calls end UNAVAILABLE)."""
        with self._lock:
            conns, self._items = self._items, []
        for conn in conns:
            try:
                conn.close()
            except Exception:  # a dying connection may already be gone
                log.debug("argrpc: closing %s connection failed", self._what, exc_info=True)

    def _prune(self) -> None:
        self._items = [c for c in self._items if getattr(c, "alive", True)]


class TransportServer(abc.ABC):
    """One argrpc server's half of a transport."""

    @abc.abstractmethod
    def accept(self, request: Any, response: Any, caller: Caller) -> Declined | None:
        """Answer the client's offer in `request`: create the server side of the connection,
        fill this transport's part of `response` and return None; or return why not.
        `caller` goes with every call of the connection."""

    @abc.abstractmethod
    def connections(self) -> list[Any]:
        """The attached connections that are still alive."""

    @abc.abstractmethod
    def close_connections(self) -> None:
        """Close every attached connection."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop accepting (listeners, handshakes in progress); attached connections stay.
        Idempotent."""


class Transport(abc.ABC):
    """A fast path: its name on the wire and in TF_RDMA_TRANSPORT, and its part of
    negotiation."""

    name: str           # in NegotiateRequest.transports, NegotiateResponse.transport
    what: str           # for people: "TF_RDMA_TRANSPORT=x but <what> is not possible"
    # Usable only between processes of one host (network namespace, user): for a target
    # on this host the client offers these first and defers the others' costlier offers.
    same_host_only: bool = False

    @abc.abstractmethod
    def why_unavailable(self, cfg: Config) -> str:
        """"" if this process can offer the transport with `cfg`, else why not (cheap: it
        creates nothing)."""

    @abc.abstractmethod
    def offer(self, request: Any, cfg: Config, max_recv: int, target: str = "") -> Any:
        """Add the client's offer to `request`; return what `attach` needs of it.
        `target`: the channel's ("" if unknown). Raises Unavailable."""

    def decline(self, request: Any, reason: str) -> None:
        """Tell the server in `request` why this client does not offer the transport,
        where the wire has room for it."""

    def client_declined(self, request: Any) -> str:
        """The server's side of `decline`: why the client said it cannot offer it."""
        return ""

    @abc.abstractmethod
    def attach(self, offer: Any, response: Any, cfg: Config, max_recv: int) -> Any:
        """The client's connection from its `offer` and the server's `response`.
        Raises Unavailable."""

    @abc.abstractmethod
    def describe(self, request: Any) -> str:
        """The server's log line (after "argrpc: ") when it accepted `request`."""

    @abc.abstractmethod
    def server(self, env: ServerEnv) -> TransportServer:
        """A new server half for the argrpc server `env` describes."""
