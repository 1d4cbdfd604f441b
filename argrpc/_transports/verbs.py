"""RDMA verbs (RC queue pairs) between hosts that both have a usable device.

A client that offers verbs sends its endpoint, created before the RPC: RC queue pairs
need both ends' data, and one round trip is all the bootstrap has. The server creates
its own endpoint, attaches it to the client's and returns it; the client attaches last.

Each end picks its device, port and GID by the kernel's route to the other end (the
client to its target's address, the server to the address in the client's GID), so a
host with several RDMA devices uses the one on the network the peer is reached over.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import threading
import time
from typing import Any, Callable

from argrpc import _proto
from argrpc._config import Config, conn_config
from argrpc._engine import EngineUnavailable, core_module, get_engine
from argrpc._host import target_host
from argrpc._transports.base import (Caller, Connections, Declined, ServerEnv, Transport,
                                     TransportServer, Unavailable)

__all__ = ["VERBS", "Verbs", "VerbsServer", "VerbsUnavailable", "target_address", "verbs_probe"]

_MAX_BLOB = 64 * 1024  # far above any real endpoint; bounds what a peer can make us parse
# The server's choice per client address: selection opens and queries every device.
# Short-lived, so a device or address that comes or goes is seen soon.
_CHOICE_TTL_S = 30.0
_CHOICE_MAX = 1024
_ROCE = ("RoCEv2", "RoCEv1")


class VerbsUnavailable(Unavailable):
    """This process cannot use RDMA verbs; str(e) says why."""


def verbs_probe(cfg: Config, peer: str = "", gid_type: str = "") -> dict[str, Any]:
    """The device/port/GID `verbs_select` picks for `cfg`; raises VerbsUnavailable.

    `peer` ("" if unknown): the other end's IP address, whose route decides what `cfg`
    leaves open; `gid_type`: the other end's GID type, preferred. Cheap (no queue pair
    or memory registration): it only reads device attributes.
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
        return dict(core.verbs_select(cfg.dev_name, cfg.port_num, cfg.gid_index,
                                      peer=peer or None, gid_type=gid_type or None))
    except Exception as e:  # CoreError: the reason names what was looked at
        raise VerbsUnavailable(str(e)) from None


def target_address(target: str) -> str:
    """The IP address a channel target ("host:port", "[v6]:port", "dns:///host:port", ...)
    resolves to first; "" when it names no host or the name does not resolve."""
    host = target_host(target)
    if not host:
        return ""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):  # socket.gaierror is an OSError
        return ""
    return str(infos[0][4][0]) if infos else ""


def _gid_address(gid: str) -> str:
    """The IP address a RoCE GID carries ("" if `gid` is no IPv6 address text)."""
    try:
        ip = ipaddress.IPv6Address(gid)
    except ValueError:
        return ""
    return str(ip.ipv4_mapped or ip)


def _gid_kind(gid_type: str, gid: str) -> str:
    """What the two ends' GIDs must share. RoCEv2 packets are UDP over IPv4 when the
    source GID is IPv4-mapped, over IPv6 otherwise: an IPv4 end cannot address an IPv6
    one, so that is part of the kind."""
    if gid_type != "RoCEv2":
        return gid_type or "unknown type"
    try:
        mapped = ipaddress.IPv6Address(gid).ipv4_mapped is not None
    except ValueError:
        return "RoCEv2"
    return "RoCEv2 over IPv4" if mapped else "RoCEv2 over IPv6"


def _end_text(ep: Any) -> str:
    """'rxe0 port 1 GID 1 ::ffff:10.0.0.2 (RoCEv2 over IPv4)'."""
    index = str(ep.gid_index) if ep.HasField("gid_index") else "?"
    return (f"{ep.device or '?'} port {ep.port} GID {index} {ep.gid or '(none)'} "
            f"({_gid_kind(ep.gid_type, ep.gid)})")


def _gid_mismatch(client: Any, server: Any) -> str:
    """"" when the two ends' VerbsEndpoints can pair, else why not: before any queue pair
    is connected, which would wait in RTR for packets that cannot arrive."""
    if _gid_kind(client.gid_type, client.gid) == _gid_kind(server.gid_type, server.gid):
        return ""
    return (f"the two ends' GIDs are of different types and cannot reach each other: client "
            f"{_end_text(client)}, server {_end_text(server)}; set TF_RDMA_GID_INDEX (or "
            "TF_RDMA_DEV_NAME) on one end so that both are RoCEv2 over IPv4, both RoCEv2 "
            "over IPv6, both RoCEv1 or both IB")


def _endpoint_info(sel: dict[str, Any], blob: bytes) -> Any:
    return _proto.VerbsEndpoint(blob=blob, device=str(sel.get("device", "")),
                                port=int(sel.get("port", 0) or 0), gid=str(sel.get("gid", "")),
                                gid_type=str(sel.get("gid_type", "")), pid=os.getpid(),
                                gid_index=int(sel.get("gid_index", 0) or 0))


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
    info: Any      # the VerbsEndpoint sent (device, port, GID)


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

    def offer(self, request: Any, cfg: Config, max_recv: int, target: str = "") -> _Offer:
        """`target`: the channel's, whose address the device choice follows the route to
        ("" if unknown: the choice without a peer)."""
        sel = verbs_probe(cfg, peer=target_address(target) if target else "")
        try:
            engine = get_engine(cfg)
            endpoint = engine.new_verbs_endpoint(conn_config(cfg, max_recv), sel)
        except Exception as e:  # EngineUnavailable or CoreError (e.g. memlock too low)
            raise VerbsUnavailable(f"cannot create a verbs endpoint: {e}") from None
        info = _endpoint_info(sel, bytes(endpoint.blob))
        request.transports.append(self.name)
        request.verbs.CopyFrom(info)
        return _Offer(engine, endpoint, info)

    def decline(self, request: Any, reason: str) -> None:
        request.verbs_unavailable = reason

    def client_declined(self, request: Any) -> str:
        return str(request.verbs_unavailable)

    def attach(self, offer: _Offer, response: Any, cfg: Config, max_recv: int) -> Any:
        peer = response.verbs
        if not response.HasField("verbs") or not peer.blob or len(peer.blob) > _MAX_BLOB:
            raise Unavailable("server sent a malformed verbs endpoint")
        if mismatch := _gid_mismatch(offer.info, peer):  # a server that did not check
            raise Unavailable(mismatch)
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


# verbs_probe or a stand-in: (cfg, peer=, gid_type=) -> selection; raises VerbsUnavailable.
Select = Callable[..., dict[str, Any]]


class VerbsServer(TransportServer):
    """Attaches an endpoint of its own to each client's; there is no listener."""

    def __init__(self, env: ServerEnv, select: Select) -> None:
        self._env = env
        self._select = select
        self._conns = Connections("verbs")
        self._closed = False
        self._lock = threading.Lock()
        self._chosen: dict[tuple[str, str], tuple[float, dict[str, Any]]] = {}

    def _selection(self, address: str, gid_type: str) -> dict[str, Any]:
        """The choice for a client at `address` with a GID of `gid_type`, cached a while."""
        key = (address, gid_type)
        now = time.monotonic()
        with self._lock:
            hit = self._chosen.get(key)
        if hit is not None and now - hit[0] < _CHOICE_TTL_S:
            return dict(hit[1])
        sel = self._select(self._env.cfg, peer=address, gid_type=gid_type)
        with self._lock:
            if len(self._chosen) >= _CHOICE_MAX:
                self._chosen.clear()
            self._chosen[key] = (now, sel)
        return dict(sel)

    def accept(self, request: Any, response: Any, caller: Caller) -> Declined | None:
        peer = request.verbs
        if not request.HasField("verbs") or not peer.blob:
            return Declined("the client offered verbs without its endpoint data")
        if len(peer.blob) > _MAX_BLOB:
            return Declined(f"the client's verbs endpoint data is too large ({len(peer.blob)} bytes)")
        env = self._env
        # The client's RoCE GID carries the address this server's queue pairs will send
        # to, so its route decides the device; an IB GID carries none.
        address = _gid_address(peer.gid) if peer.gid_type in _ROCE else ""
        try:
            sel = self._selection(address, peer.gid_type)
        except VerbsUnavailable as e:
            return Declined(f"the server cannot use RDMA verbs: {e}")
        if mismatch := _gid_mismatch(peer, _endpoint_info(sel, b"")):
            return Declined(mismatch)
        try:
            engine = env.engine_factory()
            endpoint = engine.new_verbs_endpoint(env.conn_cfg, sel)
        except Exception as e:  # CoreError (e.g. memlock too low) or no engine
            return Declined(f"the server cannot create a verbs endpoint: {e}")
        if self._closed:
            return Declined("server is shutting down")
        try:
            # Attached before answering, so the server's QPs are ready (RTR) when the
            # client's first batch arrives right after it attached its own.
            conn = engine.attach_verbs(endpoint, bytes(peer.blob), env.core_server,
                                       caller.remote(f"verbs:{_endpoint_text(peer)}"))
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
