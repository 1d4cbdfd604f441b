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

    def new_verbs_endpoint(self, conn_cfg: dict, select: dict, qps: int) -> FakeVerbsEndpoint:
        assert conn_cfg["ring_size"] > 0 and select["device"] == "rxe0"
        if self.fail_endpoint:
            raise RuntimeError(self.fail_endpoint)
        ep = FakeVerbsEndpoint(self.name, qps)
        self.endpoints.append(ep)
        return ep

    def attach_verbs(self, ep: FakeVerbsEndpoint, peer_blob: bytes, server: Any,
                     peer_name: str, user_agent: str = "") -> FakeVerbsConnection:
        if self.fail_attach:
            raise RuntimeError(self.fail_attach)
        conn = FakeVerbsConnection(ep, peer_blob, server, peer_name)
        self.attached.append(conn)
        return conn


def no_device(cfg: Config) -> dict:
    raise VerbsUnavailable("no RDMA device (test)")


OTHER_HOST = HostIdentity("boot-other", 4026531840, "srv", os.getuid(), 1)


def verbs_request(transports: tuple[str, ...] = ("shm", "verbs"), blob: bytes = b"client-blob",
                  host: HostIdentity | None = None) -> Any:
    req = _proto.NegotiateRequest(version=1, transports=list(transports))
    (host or local_identity()).to_proto(req.host)
    if "verbs" in transports:
        req.verbs.CopyFrom(_proto.VerbsEndpoint(blob=blob, device="rxe0", port=1,
                                                gid="::ffff:127.0.0.1", gid_type="RoCEv2", pid=7))
    return req


@pytest.fixture
def make_listener() -> Iterator[Any]:
    made: list[FastPathListener] = []

    def make(cfg: Config = Config(), host: HostIdentity | None = None, engine: Any = None,
             select: Any = lambda cfg: dict(SEL)) -> tuple[FastPathListener, FakeVerbsEngine]:
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
    monkeypatch.setattr(verbs, "verbs_probe", (lambda cfg: dict(SEL)) if usable else no_device)
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
