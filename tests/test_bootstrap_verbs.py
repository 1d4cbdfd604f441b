"""Verbs negotiation with an engine and device stand-in, so the choice
table and the endpoint exchange are tested on any host; tests/verbs/ runs the real thing
in the Soft-RoCE guest.

Choice: same host -> shm unless an end forces verbs; across hosts -> verbs when both
have a usable device; forcing the impossible is an error with the reason."""
from __future__ import annotations

import concurrent.futures
import os
from typing import Any, Iterator

import grpc
import pytest

from argrpc import _proto
from argrpc._bootstrap import FastPathListener, negotiate
from argrpc._config import Config
from argrpc._transports import shm, verbs
from argrpc._transports.base import Unavailable
from argrpc._transports.verbs import VerbsUnavailable
from argrpc._host import HostIdentity, local_identity, target_is_local

MiB = 1 << 20
SEL = {"device": "rxe0", "port": 1, "gid_index": 1, "gid": "::ffff:127.0.0.1",
       "gid_type": "RoCEv2", "mtu": 4096, "link_layer": "Ethernet", "lid": 0, "why": "test"}


class FakeVerbsEndpoint:
    def __init__(self, name: str, qps: int) -> None:
        self.blob = f"blob-{name}-{qps}".encode()
        self.qps = qps


class FakeVerbsConnection:
    transport = "verbs"

    def __init__(self, ep: FakeVerbsEndpoint, peer_blob: bytes, server: Any, peer: str) -> None:
        self.ep, self.peer_blob, self.server, self.peer_name = ep, peer_blob, server, peer
        self.alive = True
        self.error = ""

    def close(self) -> None:
        self.alive = False


class FakeVerbsEngine:
    def __init__(self, name: str, fail_endpoint: str = "", fail_attach: str = "") -> None:
        self.name, self.fail_endpoint, self.fail_attach = name, fail_endpoint, fail_attach
        self.endpoints: list[FakeVerbsEndpoint] = []
        self.attached: list[FakeVerbsConnection] = []

    def new_verbs_endpoint(self, conn_cfg: dict, select: dict) -> FakeVerbsEndpoint:
        assert conn_cfg["ring_size"] > 0 and select["device"] == "rxe0"
        if self.fail_endpoint:
            raise RuntimeError(self.fail_endpoint)
        ep = FakeVerbsEndpoint(self.name, conn_cfg["qps"])
        self.endpoints.append(ep)
        return ep

    def attach_verbs(self, ep: FakeVerbsEndpoint, peer_blob: bytes, server: Any,
                     remote: Any) -> FakeVerbsConnection:
        if self.fail_attach:
            raise RuntimeError(self.fail_attach)
        conn = FakeVerbsConnection(ep, peer_blob, server, getattr(remote, "name", remote))
        self.attached.append(conn)
        return conn


def no_device(cfg: Config, **route: str) -> dict:
    raise VerbsUnavailable("no RDMA device (test)")


OTHER_HOST = HostIdentity("boot-other", 4026531840, "srv", os.getuid(), 1)


def verbs_request(transports: tuple[str, ...] = ("shm", "verbs"), blob: bytes = b"client-blob",
                  host: HostIdentity | None = None, gid: str = "::ffff:127.0.0.1",
                  gid_type: str = "RoCEv2") -> Any:
    req = _proto.NegotiateRequest(version=1, transports=list(transports))
    (host or local_identity()).to_proto(req.host)
    if "verbs" in transports:
        req.verbs.CopyFrom(_proto.VerbsEndpoint(blob=blob, device="rxe0", port=1, gid=gid,
                                                gid_type=gid_type, pid=7, gid_index=1))
    return req


@pytest.fixture
def make_listener() -> Iterator[Any]:
    made: list[FastPathListener] = []

    def make(cfg: Config = Config(), host: HostIdentity | None = None, engine: Any = None,
             select: Any = lambda cfg, **route: dict(SEL)
             ) -> tuple[FastPathListener, FakeVerbsEngine]:
        eng = engine or FakeVerbsEngine("server")
        lst = FastPathListener("core-server", cfg, 4 * MiB, host=host or local_identity(),
                               engine_factory=lambda: eng,
                               transports=(shm.SHM, verbs.Verbs(select=select)))
        made.append(lst)
        return lst, eng

    yield make
    for lst in made:
        lst.close()


def test_same_host_prefers_shm(make_listener: Any) -> None:
    lst, eng = make_listener()
    resp = lst.decide(verbs_request())
    assert resp.transport == "shm" and not eng.endpoints  # no verbs resources spent


@pytest.mark.parametrize("server_cfg,transports", [
    (Config(), ("verbs",)),                     # the client forces verbs
    (Config(transport="verbs"), ("shm", "verbs")),  # the server forces verbs
])
def test_forced_verbs_on_one_host(make_listener: Any, server_cfg: Config,
                                  transports: tuple[str, ...]) -> None:
    lst, eng = make_listener(server_cfg)
    resp = lst.decide(verbs_request(transports))
    assert resp.transport == "verbs", resp.reason
    assert resp.verbs.blob == f"blob-server-{Config().qps}".encode() and resp.verbs.device == "rxe0"
    assert resp.verbs.gid == "::ffff:127.0.0.1" and resp.verbs.gid_type == "RoCEv2"
    (conn,) = eng.attached
    assert conn.peer_blob == b"client-blob" and conn.server == "core-server"
    assert conn.peer_name.startswith("verbs:rxe0:1 ::ffff:127.0.0.1 (RoCEv2)")
    assert lst.connections() == [conn]
    lst.close_connections()
    assert not conn.alive and lst.connections() == []


def test_across_hosts_verbs_when_both_have_a_device(make_listener: Any) -> None:
    lst, eng = make_listener(Config(qps=8), host=OTHER_HOST)
    resp = lst.decide(verbs_request())
    assert resp.transport == "verbs" and resp.verbs.blob == b"blob-server-8"


@pytest.mark.parametrize("kw,req,reason", [
    ({"select": no_device}, verbs_request(),
     "different host or network namespace; verbs: the server cannot use RDMA verbs: "
     "no RDMA device (test)"),
    ({"engine": FakeVerbsEngine("s", fail_endpoint="memlock too low: ulimit -l")},
     verbs_request(), "verbs: the server cannot create a verbs endpoint: memlock too low"),
    ({"engine": FakeVerbsEngine("s", fail_attach="bad blob")}, verbs_request(),
     "verbs: the server cannot connect to the client's verbs endpoint: bad blob"),
    ({}, verbs_request(blob=b""), "verbs: the client offered verbs without its endpoint data"),
    ({}, verbs_request(blob=b"x" * (65 * 1024)), "endpoint data is too large"),
    ({"cfg": Config(transport="shm")}, verbs_request(("verbs",)),
     "no common fast transport (client offers ['verbs'], server accepts ['shm'] "
     "(TF_RDMA_TRANSPORT=shm))"),
])
def test_across_hosts_no_verbs_reasons(make_listener: Any, kw: dict, req: Any, reason: str) -> None:
    lst, eng = make_listener(host=OTHER_HOST, **kw)
    resp = lst.decide(req)
    assert resp.transport == "none" and reason in resp.reason, resp.reason
    assert not eng.attached


def test_client_without_device_is_named_in_the_reason(make_listener: Any) -> None:
    lst, _ = make_listener(host=OTHER_HOST)
    req = verbs_request(("shm",))
    req.verbs_unavailable = "no RDMA device here"
    resp = lst.decide(req)
    assert resp.reason == ("different host or network namespace; verbs: the client cannot "
                           "use RDMA verbs: no RDMA device here")


# ------------------------------------------------------------------ both ends over real gRPC

@pytest.fixture
def served(make_listener: Any) -> Iterator[Any]:
    servers: list[grpc.Server] = []

    def serve(lst: FastPathListener) -> str:
        srv = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
        srv.add_generic_rpc_handlers((lst.handler(),))
        port = srv.add_insecure_port("127.0.0.1:0")
        srv.start()
        servers.append(srv)
        return f"127.0.0.1:{port}"

    yield serve
    for srv in servers:
        srv.stop(None)


def _client_verbs(monkeypatch: pytest.MonkeyPatch, usable: bool = True) -> FakeVerbsEngine:
    eng = FakeVerbsEngine("client")
    monkeypatch.setattr(verbs, "get_engine", lambda cfg: eng)
    monkeypatch.setattr(verbs, "verbs_probe",
                        (lambda cfg, **route: dict(SEL)) if usable else no_device)
    return eng


def test_negotiate_verbs_end_to_end(make_listener: Any, served: Any,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    client = _client_verbs(monkeypatch)
    lst, server = make_listener(host=OTHER_HOST)
    with grpc.insecure_channel(served(lst)) as ch:
        n = negotiate(ch, Config(qps=2), 4 * MiB, 5.0)
    assert n.transport == "verbs" and n.reason == "" and n.connection is client.attached[0]
    conn = client.attached[0]
    assert conn.peer_blob == f"blob-server-{Config().qps}".encode() and conn.ep.blob == b"blob-client-2"
    assert conn.server is None and conn.peer_name.startswith("verbs:rxe0:1")
    assert server.attached[0].peer_blob == b"blob-client-2"


def test_negotiate_forced_verbs_without_device_is_an_error(make_listener: Any, served: Any,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    _client_verbs(monkeypatch, usable=False)
    lst, server = make_listener()
    with grpc.insecure_channel(served(lst)) as ch:
        n = negotiate(ch, Config(transport="verbs"), 4 * MiB, 5.0)
        assert n.transport == "grpc" and n.forced_error == (
            "TF_RDMA_TRANSPORT=verbs but RDMA verbs is not possible: this host: "
            "no RDMA device (test)")
    assert not server.attached


def test_negotiate_forced_verbs_server_refuses(make_listener: Any, served: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    client = _client_verbs(monkeypatch)
    lst, _ = make_listener(select=no_device)
    with grpc.insecure_channel(served(lst)) as ch:
        n = negotiate(ch, Config(transport="verbs"), 4 * MiB, 5.0)
    assert n.transport == "grpc" and not client.attached
    assert n.forced_error == ("TF_RDMA_TRANSPORT=verbs but RDMA verbs is not possible: server: "
                              "verbs: the server cannot use RDMA verbs: no RDMA device (test)")


def test_negotiate_client_attach_failure_falls_back(make_listener: Any, served: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    client = _client_verbs(monkeypatch)
    client.fail_attach = "QP to RTR failed: Invalid argument"
    lst, _ = make_listener(host=OTHER_HOST)
    with grpc.insecure_channel(served(lst)) as ch:
        n = negotiate(ch, Config(), 4 * MiB, 5.0)
    assert n.transport == "grpc" and n.reason == (
        "attaching the verbs connection failed: QP to RTR failed: Invalid argument")


# ------------------------------------------------------------------ local targets: shm first

@pytest.mark.parametrize("target,local", [
    ("127.0.0.1:50051", True), ("localhost:1", True), ("[::1]:1", True),
    ("dns:///localhost:1", True), ("ipv4:127.0.0.1:1", True), ("unix:/tmp/x.sock", True),
    ("0.0.0.0:1", True), ("192.0.2.1:1", False), ("[2001:db8::1]:1", False),
    ("example.invalid:443", False), ("", False),
])
def test_target_is_local(target: str, local: bool) -> None:
    assert target_is_local(target) is local


def test_local_target_same_host_creates_no_verbs_endpoint(make_listener: Any, served: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """auto mode, a server on this host: shm wins, and no verbs endpoint (QPs) was made
    for an offer that could not win."""
    client = _client_verbs(monkeypatch)
    lst, server = make_listener()  # the real local host identity: shm is possible
    monkeypatch.setattr(lst, "decide", _spy(lst.decide, seen := []))
    target = served(lst)
    with grpc.insecure_channel(target) as ch:
        n = negotiate(ch, Config(), 4 * MiB, 5.0, target=target)
    assert [tuple(r.transports) for r in seen] == [("shm",)]
    assert not client.endpoints
    if n.connection is not None:
        n.connection.close()


def test_local_target_in_other_namespace_then_offers_verbs(make_listener: Any, served: Any,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """auto mode, a local address but a server that declines shm (another network
    namespace or container): the second offer carries verbs, which wins."""
    client = _client_verbs(monkeypatch)
    lst, server = make_listener(host=OTHER_HOST)
    monkeypatch.setattr(lst, "decide", _spy(lst.decide, seen := []))
    target = served(lst)
    with grpc.insecure_channel(target) as ch:
        n = negotiate(ch, Config(qps=2), 4 * MiB, 5.0, target=target)
    assert [tuple(r.transports) for r in seen] == [("shm",), ("shm", "verbs")]
    assert seen[0].verbs_unavailable.startswith("not offered first")
    assert n.transport == "verbs" and len(client.endpoints) == 1


def test_local_target_without_device_asks_once(make_listener: Any, served: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _client_verbs(monkeypatch, usable=False)
    lst, _ = make_listener(host=OTHER_HOST)
    monkeypatch.setattr(lst, "decide", _spy(lst.decide, seen := []))
    target = served(lst)
    with grpc.insecure_channel(target) as ch:
        n = negotiate(ch, Config(), 4 * MiB, 5.0, target=target)
    assert len(seen) == 1 and n.transport == "grpc"
    assert "no RDMA device (test)" in n.reason


def _spy(fn: Any, seen: list[Any]) -> Any:
    def wrapped(request: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(request)
        return fn(request, *args, **kwargs)
    return wrapped


# ------------------------------------------------------------------ route and GID types

class RecordingSelect:
    """A device stand-in that answers `sel` and records what each end asked it."""

    def __init__(self, sel: dict | None = None) -> None:
        self.sel = dict(sel or SEL)
        self.calls: list[dict[str, str]] = []

    def __call__(self, cfg: Config, **route: str) -> dict:
        self.calls.append(route)
        return dict(self.sel)


@pytest.mark.parametrize("gid,gid_type,address", [
    ("::ffff:192.0.2.1", "RoCEv2", "192.0.2.1"),  # IPv4-mapped: routed as IPv4
    ("2001:db8::1", "RoCEv2", "2001:db8::1"),
    ("fe80::2:c903:0:1", "IB", ""),  # an IB GID carries no IP address: no route
])
def test_server_selects_by_the_route_to_the_clients_gid(make_listener: Any, gid: str,
                                                         gid_type: str, address: str) -> None:
    select = RecordingSelect({**SEL, "gid": gid, "gid_type": gid_type})
    lst, eng = make_listener(host=OTHER_HOST, select=select)
    resp = lst.decide(verbs_request(gid=gid, gid_type=gid_type))
    assert resp.transport == "verbs", resp.reason
    assert select.calls == [{"peer": address, "gid_type": gid_type}]
    assert resp.verbs.gid_index == 1 and resp.verbs.HasField("gid_index")


def test_server_caches_its_choice_per_client_address(make_listener: Any) -> None:
    select = RecordingSelect()
    lst, eng = make_listener(host=OTHER_HOST, select=select)
    for _ in range(3):
        assert lst.decide(verbs_request()).transport == "verbs"
    assert lst.decide(verbs_request(gid="::ffff:127.0.0.2")).transport == "verbs"
    assert [c["peer"] for c in select.calls] == ["127.0.0.1", "127.0.0.2"]
    assert len(eng.attached) == 4


@pytest.mark.parametrize("server_gid,server_type,client_gid,client_type,kinds", [
    ("fe80::2", "RoCEv2", "::ffff:127.0.0.1", "RoCEv2",
     ("::ffff:127.0.0.1 (RoCEv2 over IPv4)", "fe80::2 (RoCEv2 over IPv6)")),
    ("fe80::2:c903:0:1", "IB", "::ffff:127.0.0.1", "RoCEv2",
     ("::ffff:127.0.0.1 (RoCEv2 over IPv4)", "fe80::2:c903:0:1 (IB)")),
    ("::ffff:10.0.0.1", "RoCEv2", "::ffff:10.0.0.2", "RoCEv1",
     ("::ffff:10.0.0.2 (RoCEv1)", "::ffff:10.0.0.1 (RoCEv2 over IPv4)")),
])
def test_gid_type_mismatch_is_declined_naming_both_ends(
        make_listener: Any, server_gid: str, server_type: str, client_gid: str,
        client_type: str, kinds: tuple[str, str]) -> None:
    lst, eng = make_listener(host=OTHER_HOST, select=RecordingSelect(
        {**SEL, "gid": server_gid, "gid_type": server_type}))
    resp = lst.decide(verbs_request(gid=client_gid, gid_type=client_type))
    assert resp.transport == "none"
    assert (f"client rxe0 port 1 GID 1 {kinds[0]}, server rxe0 port 1 GID 1 {kinds[1]}"
            in resp.reason), resp.reason
    assert not eng.endpoints and not eng.attached  # decided before any queue pair exists


def test_gid_type_mismatch_is_the_channels_fallback_reason(make_listener: Any, served: Any,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    client = _client_verbs(monkeypatch)
    lst, _ = make_listener(select=RecordingSelect({**SEL, "gid": "fe80::2", "gid_index": 0}))
    with grpc.insecure_channel(served(lst)) as ch:
        n = negotiate(ch, Config(transport="verbs"), 4 * MiB, 5.0)
    assert n.transport == "grpc" and not client.attached
    assert n.forced_error.startswith(
        "TF_RDMA_TRANSPORT=verbs but RDMA verbs is not possible: server: verbs: the two ends' "
        "GIDs are of different types and cannot reach each other: client rxe0 port 1 GID 1 "
        "::ffff:127.0.0.1 (RoCEv2 over IPv4), server rxe0 port 1 GID 0 fe80::2 (RoCEv2 over "
        "IPv6)"), n.forced_error


def test_client_refuses_a_server_gid_of_another_type() -> None:
    """A server that did not check (an older one) answered with a GID the client's
    queue pairs cannot reach: the client says so instead of attaching."""
    engine = FakeVerbsEngine("client")
    offer = verbs._Offer(engine, FakeVerbsEndpoint("client", 1), verbs._endpoint_info(SEL, b"c"))
    resp = _proto.NegotiateResponse(transport="verbs", verbs=_proto.VerbsEndpoint(
        blob=b"s", device="mlx5_1", port=2, gid="2001:db8::5", gid_type="RoCEv2"))
    with pytest.raises(Unavailable, match=r"client rxe0 port 1 GID 1 ::ffff:127.0.0.1 \(RoCEv2 "
                                          r"over IPv4\), server mlx5_1 port 2 GID \? 2001:db8::5"):
        verbs.VERBS.attach(offer, resp, Config(), 4 * MiB)
    assert not engine.attached


@pytest.mark.parametrize("target,address", [
    ("192.0.2.2:50051", "192.0.2.2"), ("[2001:db8::2]:50051", "2001:db8::2"),
    ("dns:///192.0.2.2:443", "192.0.2.2"), ("ipv4:192.0.2.2:1,192.0.2.3:1", "192.0.2.2"),
    ("ipv6:[::1]:1", "::1"), ("", ""),
])
def test_target_address(target: str, address: str) -> None:
    assert verbs.target_address(target) == address


def test_target_address_resolves_a_name() -> None:
    assert verbs.target_address("localhost:50051") in ("127.0.0.1", "::1")


@pytest.mark.parametrize("target,peer", [("192.0.2.2:50051", "192.0.2.2"), ("", "")])
def test_client_selects_by_the_route_to_its_target(monkeypatch: pytest.MonkeyPatch, target: str,
                                                   peer: str) -> None:
    eng = FakeVerbsEngine("client")
    select = RecordingSelect()
    monkeypatch.setattr(verbs, "get_engine", lambda cfg: eng)
    monkeypatch.setattr(verbs, "verbs_probe", select)
    request = _proto.NegotiateRequest()
    verbs.VERBS.offer(request, Config(), 4 * MiB, target=target)
    assert select.calls == [{"peer": peer}]
    assert request.verbs.gid_index == 1 and request.verbs.HasField("gid_index")
