"""RDMA verbs (RC queue pairs) between hosts that both have a usable device.

A client that offers verbs sends its endpoint, created before the RPC: RC queue pairs
need both ends' data, and one round trip is all the bootstrap has. The server creates
its own endpoint, attaches it to the client's and returns it; the client attaches last.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from argrpc import _proto
from argrpc._config import Config, conn_config
from argrpc._engine import EngineUnavailable, core_module, get_engine
from argrpc._transports.base import (Connections, Declined, ServerEnv, Transport, TransportServer,
                                     Unavailable)

__all__ = ["VERBS", "Verbs", "VerbsServer", "VerbsUnavailable", "verbs_probe"]

_MAX_BLOB = 64 * 1024  # far above any real endpoint; bounds what a peer can make us parse


class VerbsUnavailable(Unavailable):
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


def _endpoint_info(sel: dict[str, Any], blob: bytes) -> Any:
    return _proto.VerbsEndpoint(blob=blob, device=str(sel.get("device", "")),
                                port=int(sel.get("port", 0) or 0), gid=str(sel.get("gid", "")),
                                gid_type=str(sel.get("gid_type", "")), pid=os.getpid())


def _endpoint_text(ep: Any) -> str:
    """'rxe0:1 ::ffff:10.0.0.2 (RoCEv2) pid 123' for logs and peer names."""
    where = f"{ep.device or '?'}:{ep.port}"
    if ep.gid:
        where += f" {ep.gid}" + (f" ({ep.gid_type})" if ep.gid_type else "")
    return where + (f" pid {ep.pid}" if ep.pid else "")


@dataclasses.dataclass
class _Offer:
    engine: Any
    endpoint: Any  # its QPs stay in INIT, and are dropped, unless the server picks verbs


class Verbs(Transport):
    name = "verbs"
    what = "RDMA verbs"

    def __init__(self, select: Callable[[Config], dict[str, Any]] | None = None) -> None:
        self._select = select  # a device stand-in for tests' servers

    def why_unavailable(self, cfg: Config) -> str:
        try:
            verbs_probe(cfg)
        except VerbsUnavailable as e:
            return str(e)
        return ""

    def offer(self, request: Any, cfg: Config, max_recv: int) -> _Offer:
        sel = verbs_probe(cfg)
        try:
            engine = get_engine(cfg)
            endpoint = engine.new_verbs_endpoint(conn_config(cfg, max_recv), sel, cfg.qps)
        except Exception as e:  # EngineUnavailable or CoreError (e.g. memlock too low)
            raise VerbsUnavailable(f"cannot create a verbs endpoint: {e}") from None
        request.transports.append(self.name)
        request.verbs.CopyFrom(_endpoint_info(sel, bytes(endpoint.blob)))
        return _Offer(engine, endpoint)

    def decline(self, request: Any, reason: str) -> None:
        request.verbs_unavailable = reason

    def client_declined(self, request: Any) -> str:
        return str(request.verbs_unavailable)

    def attach(self, offer: _Offer, response: Any, cfg: Config, max_recv: int) -> Any:
        peer = response.verbs
        if not response.HasField("verbs") or not peer.blob or len(peer.blob) > _MAX_BLOB:
            raise Unavailable("server sent a malformed verbs endpoint")
        try:
            return offer.engine.attach_verbs(offer.endpoint, bytes(peer.blob), None,
                                             f"verbs:{_endpoint_text(peer)}")
        except Exception as e:  # CoreError: blob rejected, QP transition failed
            raise Unavailable(f"attaching the verbs connection failed: {e}") from None

    def describe(self, request: Any) -> str:
        return (f"verbs connection with {_endpoint_text(request.verbs)} on "
                f"{request.host.hostname or '?'} attached")

    def server(self, env: ServerEnv) -> VerbsServer:
        return VerbsServer(env, self._select or verbs_probe)


class VerbsServer(TransportServer):
    """Attaches an endpoint of its own to each client's; there is no listener."""

    def __init__(self, env: ServerEnv, select: Callable[[Config], dict[str, Any]]) -> None:
        self._env = env
        self._select = select
        self._conns = Connections("verbs")
        self._closed = False

    def accept(self, request: Any, response: Any, user_agent: str) -> Declined | None:
        peer = request.verbs
        if not request.HasField("verbs") or not peer.blob:
            return Declined("the client offered verbs without its endpoint data")
        if len(peer.blob) > _MAX_BLOB:
            return Declined(f"the client's verbs endpoint data is too large ({len(peer.blob)} bytes)")
        env = self._env
        try:
            sel = self._select(env.cfg)
        except VerbsUnavailable as e:
            return Declined(f"the server cannot use RDMA verbs: {e}")
        try:
            engine = env.engine_factory()
            endpoint = engine.new_verbs_endpoint(env.conn_cfg, sel, env.cfg.qps)
        except Exception as e:  # CoreError (e.g. memlock too low) or no engine
            return Declined(f"the server cannot create a verbs endpoint: {e}")
        if self._closed:
            return Declined("server is shutting down")
        try:
            # Attached before answering, so the server's QPs are ready (RTR) when the
            # client's first batch arrives right after it attached its own.
            conn = engine.attach_verbs(endpoint, bytes(peer.blob), env.core_server,
                                       f"verbs:{_endpoint_text(peer)}", user_agent=user_agent)
        except Exception as e:  # CoreError: blob rejected, QP transition failed
            return Declined(f"the server cannot connect to the client's verbs endpoint: {e}")
        self._conns.add(conn)
        response.verbs.CopyFrom(_endpoint_info(sel, bytes(endpoint.blob)))
        return None

    def connections(self) -> list[Any]:
        return self._conns.live()

    def close_connections(self) -> None:
        self._conns.close_all()

    def close(self) -> None:
        self._closed = True


VERBS = Verbs()
