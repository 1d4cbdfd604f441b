"""Negotiation and the shm handshake, tested without argrpc._core.

Real sockets, real processes, real fds. Where an engine is needed, `FdEngine` stands in
for `_core.Engine`: it hands out real memfds and records what `attach_shm`
received, so fd passing is checked end to end; the code under test (_bootstrap, _host,
_transports.shm and its handshake) is never replaced.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import grpc
import pytest

from argrpc import _proto
from argrpc._bootstrap import BOOTSTRAP_METHOD, FastPathListener, negotiate
from argrpc._config import Config
from argrpc._transports import Caller, verbs
from argrpc._transports.shm import Shm
from argrpc._transports.shm_handshake import (HandshakeError, SecretStore, client_handshake,
                                              peer_credentials, recv_frame, send_frame)
from argrpc._host import HostIdentity, local_identity, same_host_reason

MiB = 1024 * 1024
SERVER_HOST = HostIdentity(boot_id="boot-a", netns=4026531840, hostname="srv", uid=1000, pid=4242)




def open_fds() -> set[int]:
    """Open fds, minus the one listdir itself used (it is closed by the time we look)."""
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            os.readlink(f"/proc/self/fd/{name}")
        except FileNotFoundError:
            continue
        fds.add(int(name))
    return fds


def wait_for(pred: Any, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def request(boot_id: str = "boot-a", netns: int = 4026531840, uid: int = 1000,
            pid: int | None = None, transports: tuple[str, ...] = ("shm",)) -> Any:
    req = _proto.NegotiateRequest(version=1, transports=list(transports))
    HostIdentity(boot_id, netns, "cli", uid, os.getpid() if pid is None else pid).to_proto(req.host)
    return req


# --------------------------------------------------------------------------- engine stand-in

@dataclasses.dataclass
class FdEndpoint:
    ring_fd: int
    ring_size: int


class FdConnection:
    def __init__(self, peer: dict[str, int], sock_fd: int, server: Any, peer_name: str) -> None:
        self.peer, self.sock_fd, self.server, self.peer_name = peer, sock_fd, server, peer_name
        self.alive = True

    def close(self) -> None:
        if self.alive:
            self.alive = False
            for key in ("ring_fd", "pool_fd"):
                os.close(self.peer[key])
            os.close(self.sock_fd)


class FdEngine:
    """Real memfds; attach_shm takes ownership of what it is given."""

    def __init__(self, pool_size: int = 64 * 1024, fail_attach: str = "") -> None:
        self.pool_fd = os.memfd_create("test-pool", os.MFD_CLOEXEC)
        os.ftruncate(self.pool_fd, pool_size)
        self.pool_size = pool_size
        self.fail_attach = fail_attach
        self.endpoints: list[FdEndpoint] = []
        self.attached: list[FdConnection] = []

    def new_shm_endpoint(self, conn_cfg: dict[str, int]) -> FdEndpoint:
        ring = os.memfd_create("test-ring", os.MFD_CLOEXEC)
        os.ftruncate(ring, conn_cfg["ring_size"])
        ep = FdEndpoint(ring, conn_cfg["ring_size"])
        self.endpoints.append(ep)
        return ep

    def attach_shm(self, endpoint: FdEndpoint, peer: dict[str, int], sock_fd: int, server: Any,
                   remote: Any) -> FdConnection:
        # A server's end gets the caller's PeerInfo; a client's end, only a name.
        conn = FdConnection(peer, sock_fd, server, getattr(remote, "name", remote))
        if self.fail_attach:
            conn.close()  # the contract: on failure the engine has closed what it was given
            raise RuntimeError(self.fail_attach)
        self.attached.append(conn)
        return conn

    def close(self) -> None:
        for conn in self.attached:
            conn.close()
        for ep in self.endpoints:
            os.close(ep.ring_fd)
        os.close(self.pool_fd)


CONN_CFG = {"ring_size": 64 * 1024, "acc_size": 8192, "chunk_size": 4 * MiB,
            "reads_in_flight": 4, "stream_window": MiB, "max_recv": 4 * MiB}


@pytest.fixture
def listener_factory():
    made: list[FastPathListener] = []

    def make(cfg: Config = Config(), host: HostIdentity = SERVER_HOST, **kw: Any) -> FastPathListener:
        lst = FastPathListener(kw.pop("core_server", "core-server"), cfg, 4 * MiB, host=host, **kw)
        made.append(lst)
        return lst

    yield make
    for lst in made:
        lst.close()


# --------------------------------------------------------------------------- secrets

class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_secret_is_one_time_and_bound_to_pid() -> None:
    store = SecretStore()
    a, b = store.issue(111), store.issue(222)
    assert len(a) == 32 and len(b) == 32 and a != b
    assert store.consume(b).pid == 222
    assert store.consume(a).pid == 111
    for s in (a, b):
        with pytest.raises(HandshakeError, match="unknown or already used"):
            store.consume(s)
    with pytest.raises(HandshakeError, match="unknown or already used"):
        store.consume(os.urandom(32))
    assert len(store) == 0


def test_secret_expires() -> None:
    clock = FakeClock()
    store = SecretStore(ttl=30.0, clock=clock)
    old = store.issue(1)
    clock.now += 29.0
    fresh = store.issue(2)
    assert store.consume(fresh).pid == 2
    clock.now += 1.5  # old is now 30.5 s old
    with pytest.raises(HandshakeError, match="expired"):
        store.consume(old)
    with pytest.raises(HandshakeError, match="unknown or already used"):
        store.consume(old)  # an expired secret is gone too


def test_secret_store_is_bounded() -> None:
    store = SecretStore(capacity=3)
    first = store.issue(1)
    for pid in range(2, 6):
        store.issue(pid)
    assert len(store) == 3
    with pytest.raises(HandshakeError):
        store.consume(first)  # the oldest was dropped


# --------------------------------------------------------------------------- peer credentials

def test_peer_credentials_socketpair() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert peer_credentials(a) == (os.getpid(), os.getuid(), os.getgid())
        assert peer_credentials(b) == (os.getpid(), os.getuid(), os.getgid())


def test_peer_credentials_other_process() -> None:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"argrpc-test/{os.getpid()}/{os.urandom(4).hex()}"
    srv.bind("\0" + name)
    srv.listen(1)
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect('\\0'+sys.argv[1]); s.recv(1)",
         name])
    try:
        srv.settimeout(10)
        conn, _ = srv.accept()
        with conn:
            pid, uid, gid = peer_credentials(conn)
            assert (pid, uid, gid) == (child.pid, os.getuid(), os.getgid())
            conn.send(b"x")
        assert child.wait(10) == 0
    finally:
        child.kill()
        srv.close()


# --------------------------------------------------------------------------- host identity

def test_local_identity() -> None:
    me = local_identity()
    assert me.pid == os.getpid() and me.uid == os.getuid()
    assert me.netns == os.stat("/proc/self/ns/net").st_ino
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert me.boot_id == f.read().strip()
    assert same_host_reason(me, local_identity()) == ""
    msg = _proto.HostIdentity()
    me.to_proto(msg)
    assert HostIdentity.from_proto(msg) == me


# --------------------------------------------------------------------------- decision table

@pytest.mark.parametrize("cfg,req,reason", [
    (Config(enabled=False), request(), "server has TF_RDMA_ENABLED=false"),
    (Config(transport="grpc"), request(), "server has TF_RDMA_TRANSPORT=grpc"),
    (Config(), request(boot_id="boot-b"), "different host or network namespace"),
    (Config(), request(netns=4026532000), "different host or network namespace"),
    (Config(), request(boot_id=""), "different host or network namespace"),
    (Config(), request(uid=1001), "different user (uid 1001 vs 1000)"),
    (Config(), request(transports=()), "no common fast transport"),
    (Config(transport="shm"), request(transports=("verbs",)), "no common fast transport"),
    (Config(), request(transports=("verbs",)), "verbs: the client offered verbs without its endpoint data"),
])
def test_decision_none(listener_factory: Any, cfg: Config, req: Any, reason: str) -> None:
    lst = listener_factory(cfg)
    resp = lst.decide(req)
    assert resp.transport == "none"
    assert reason in resp.reason
    assert not resp.HasField("shm")
    assert lst.transport_server("shm").socket_name is None  # no socket opened for a "no"


def test_decision_tls(listener_factory: Any) -> None:
    tls = Caller(auth=(("transport_security_type", b"ssl"),))
    resp = listener_factory(Config()).decide(request(), tls)
    assert resp.transport == "none" and "TF_RDMA_OVER_TLS" in resp.reason
    assert listener_factory(Config(over_tls=True)).decide(request(), tls).transport == "shm"


def test_decision_without_core_server(listener_factory: Any) -> None:
    resp = listener_factory(core_server=None).decide(request())
    assert resp.transport == "none" and "argrpc._core" in resp.reason


def test_decision_shm(listener_factory: Any) -> None:
    lst = listener_factory(Config(transport="shm"))
    r1, r2 = lst.decide(request()), lst.decide(request(pid=77))
    assert r1.transport == r2.transport == "shm"
    socket_name = lst.transport_server("shm").socket_name
    assert r1.shm.socket_name == r2.shm.socket_name == socket_name  # one socket
    assert r1.shm.socket_name.startswith(f"argrpc/{os.getpid()}/")
    assert len(r1.shm.socket_name.rsplit("/", 1)[1]) == 16
    assert len(r1.shm.secret) == 32 and r1.shm.secret != r2.shm.secret
    assert r1.shm.server_pid == os.getpid()
    lst.close()
    resp = lst.decide(request())
    assert resp.transport == "none" and "shutting down" in resp.reason
    probe = socket.socket(socket.AF_UNIX)
    with probe, pytest.raises(ConnectionRefusedError):
        probe.connect("\0" + r1.shm.socket_name)


def test_listener_close_stops_threads(listener_factory: Any) -> None:
    before = set(threading.enumerate())
    lst = listener_factory()
    lst.decide(request())
    assert any(t.name == "argrpc-shm-accept" for t in threading.enumerate())
    lst.close()
    lst.close()  # idempotent
    assert wait_for(lambda: set(threading.enumerate()) <= before)


# --------------------------------------------------------------------------- handshake

def raw_hello(name: str, secret: bytes, meta: bytes = b'{"v": 3, "ring_size": 65536, "pool_size": 65536}',
              fds: tuple[int, ...] = ()) -> tuple[bytes, bytes]:
    """Speak the wire protocol by hand (a hostile or broken client)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with s:
        s.settimeout(10)
        s.connect("\0" + name)
        send_frame(s, b"HI", secret + meta, fds)
        got: list[int] = []
        tag, payload = recv_frame(s, time.monotonic() + 10, 3, got)
        assert got == []
        return tag, payload


def test_handshake_success_passes_real_fds(listener_factory: Any) -> None:
    server_eng, client_eng = FdEngine(pool_size=128 * 1024), FdEngine()
    try:
        lst = listener_factory(engine_factory=lambda: server_eng)
        offer = lst.decide(request()).shm
        conn = client_handshake(offer.socket_name, offer.server_pid, offer.secret, client_eng,
                                CONN_CFG)
        assert conn.peer_name == f"shm:pid={os.getpid()}" and conn.server is None
        assert wait_for(lambda: len(server_eng.attached) == 1)
        srv_conn = server_eng.attached[0]
        assert srv_conn.server == "core-server"
        assert srv_conn.peer_name == f"shm:pid={os.getpid()}"
        assert lst.connections() == [srv_conn]
        # What each side received maps the other side's memory.
        s_ep = server_eng.endpoints[0]
        assert conn.peer["ring_size"] == MiB and conn.peer["pool_size"] == 128 * 1024
        assert srv_conn.peer["pool_size"] == 64 * 1024
        os.pwrite(s_ep.ring_fd, b"server ring", 100)
        assert os.pread(conn.peer["ring_fd"], 11, 100) == b"server ring"
        os.pwrite(client_eng.pool_fd, b"client pool", 0)
        assert os.pread(srv_conn.peer["pool_fd"], 11, 0) == b"client pool"
        # The sockets the engines own are the two ends of one connection, and blocking.
        csock = socket.socket(fileno=os.dup(conn.sock_fd))
        with csock:
            assert csock.getblocking()
            assert peer_credentials(csock)[0] == os.getpid()
        # The secret was consumed.
        with pytest.raises(HandshakeError, match="unknown or already used"):
            client_handshake(offer.socket_name, offer.server_pid, offer.secret, client_eng, CONN_CFG)
        lst.close_connections()
        assert not srv_conn.alive and lst.connections() == []
    finally:
        server_eng.close()
        client_eng.close()


def test_handshake_refusals_leak_no_fds(listener_factory: Any) -> None:
    client_eng = FdEngine()
    try:
        lst = listener_factory(engine_factory=lambda: pytest.fail("engine must not be reached"))
        name = lst.decide(request()).shm.socket_name
        before = open_fds()
        cases = [
            (os.urandom(32), "unknown or already used handshake secret"),
            (lst.decide(request(pid=os.getpid() + 100000)).shm.secret, "is not the pid the secret was issued to"),
        ]
        for secret, reason in cases:
            with pytest.raises(HandshakeError, match=reason):
                client_handshake(name, os.getpid(), secret, client_eng, CONN_CFG)
    finally:
        client_eng.close()
    assert wait_for(lambda: open_fds() <= before)


def test_handshake_bad_hellos(listener_factory: Any) -> None:
    lst = listener_factory(engine_factory=lambda: pytest.fail("engine must not be reached"))
    name = lst.decide(request()).shm.socket_name
    memfds = [os.memfd_create("x", os.MFD_CLOEXEC) for _ in range(4)]
    try:
        before = open_fds()
        # right secret, no fds
        tag, why = raw_hello(name, lst.decide(request()).shm.secret)
        assert (tag, why) == (b"NO", b"peer sent 0 file descriptors, expected 2")
        # too many fds
        tag, why = raw_hello(name, lst.decide(request()).shm.secret, fds=tuple(memfds))
        assert tag == b"NO" and b"more file descriptors" in why
        # malformed JSON / sizes
        tag, why = raw_hello(name, lst.decide(request()).shm.secret, b"{nope", tuple(memfds[:2]))
        assert tag == b"NO" and b"malformed" in why
        tag, why = raw_hello(name, lst.decide(request()).shm.secret,
                             b'{"v": 3, "ring_size": -1, "pool_size": 1}', tuple(memfds[:2]))
        assert tag == b"NO" and b"invalid ring_size" in why
        # another release's handshake (version 2 knew no ring restarts)
        tag, why = raw_hello(name, lst.decide(request()).shm.secret,
                             b'{"v": 2, "ring_size": 4096, "pool_size": 4096}', tuple(memfds[:2]))
        assert tag == b"NO" and b"shm handshake version 2, this process 3" in why
        # the server closed every fd it received
        assert wait_for(lambda: open_fds() <= before)
    finally:
        for fd in memfds:
            os.close(fd)


def test_handshake_secret_expiry(listener_factory: Any) -> None:
    lst = listener_factory(transports=(Shm(secret_ttl=0.05), verbs.VERBS),
                           engine_factory=lambda: pytest.fail("unreachable"))
    offer = lst.decide(request()).shm
    time.sleep(0.1)
    assert raw_hello(offer.socket_name, offer.secret) == (
        b"NO", b"handshake secret expired (valid for 0.05 s)")


def test_handshake_engine_failures_are_reasons(listener_factory: Any) -> None:
    def no_engine() -> Any:
        raise RuntimeError("no engine here")

    client_eng = FdEngine()
    failing = FdEngine(fail_attach="seal check failed")
    try:
        lst = listener_factory(engine_factory=no_engine)
        offer = lst.decide(request()).shm
        with pytest.raises(HandshakeError, match="server cannot create a shm endpoint: no engine here"):
            client_handshake(offer.socket_name, offer.server_pid, offer.secret, client_eng, CONN_CFG)

        lst2 = listener_factory(engine_factory=lambda: failing)
        offer = lst2.decide(request()).shm
        with pytest.raises(HandshakeError, match="could not attach.*seal check failed"):
            client_handshake(offer.socket_name, offer.server_pid, offer.secret, client_eng, CONN_CFG)
        assert client_eng.attached == [] and lst2.connections() == []
    finally:
        client_eng.close()
        failing.close()


def test_client_checks_server_identity(listener_factory: Any) -> None:
    client_eng = FdEngine()
    try:
        lst = listener_factory(engine_factory=lambda: pytest.fail("unreachable"))
        offer = lst.decide(request()).shm
        with pytest.raises(HandshakeError, match="server said pid 1 "):
            client_handshake(offer.socket_name, 1, offer.secret, client_eng, CONN_CFG)
        with pytest.raises(HandshakeError, match="cannot connect"):
            client_handshake("argrpc/0/nobody-listens", 1, offer.secret, client_eng, CONN_CFG)
    finally:
        client_eng.close()


def test_slow_peer_does_not_block_accept_loop(listener_factory: Any) -> None:
    server_eng, client_eng = FdEngine(), FdEngine()
    try:
        lst = listener_factory(engine_factory=lambda: server_eng)
        name = lst.decide(request()).shm.socket_name
        idle = [socket.socket(socket.AF_UNIX) for _ in range(3)]
        for s in idle:
            s.connect("\0" + name)  # connect and say nothing
        idle[0].send(b"HI\x00")  # half a header
        offer = lst.decide(request()).shm
        t0 = time.monotonic()
        conn = client_handshake(offer.socket_name, offer.server_pid, offer.secret, client_eng, CONN_CFG)
        assert time.monotonic() - t0 < 2.0 and conn.alive
        before = open_fds()
        t0 = time.monotonic()
        lst.close()  # aborts the stalled handshakes instead of waiting 5 s for them
        assert time.monotonic() - t0 < 2.0
        assert not any(t.name.startswith("argrpc-shm") for t in threading.enumerate())
        for s in idle:
            s.settimeout(5)
            assert s.recv(100) == b""  # hung up on, promptly
            s.close()
        assert open_fds() <= before
    finally:
        server_eng.close()
        client_eng.close()


_CHILD = r"""
import json, os, socket, struct, sys
print(os.getpid(), flush=True)
args = json.loads(sys.stdin.readline())
s = socket.socket(socket.AF_UNIX)
s.settimeout(10)
s.connect("\0" + args["name"])
payload = bytes.fromhex(args["secret"]) + b"{}"
s.sendall(b"HI" + struct.pack("!I", len(payload)) + payload)
data = b""
while True:
    chunk = s.recv(4096)
    if not chunk:
        break
    data += chunk
print(data[6:].decode())
"""


# Another user may not be able to run this venv's interpreter; the child needs no packages.
_SYSTEM_PYTHON = "/usr/bin/python3"


def run_child(lst: FastPathListener, bind_to_child: bool, user: int | None = None) -> tuple[str, bytes]:
    python = sys.executable if user is None else _SYSTEM_PYTHON
    # Another user through setpriv, not Popen(user=): that makes Popen fork() this
    # process (which holds grpc's threads) instead of vfork(), and grpc's fork handlers,
    # skipped while another thread is inside grpc, leave the child to crash before exec.
    as_user = [] if user is None else ["setpriv", f"--reuid={user}"]
    child = subprocess.Popen([*as_user, python, "-c", _CHILD], stdin=subprocess.PIPE, cwd="/",
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        if not line.strip():
            child.kill()
            _, err = child.communicate(timeout=20)
            pytest.fail(f"the client child ({python}, uid {user}) did not start: "
                        f"rc={child.returncode}\n{err[-3000:]}")
        pid = int(line)
        offer = lst.decide(request(pid=pid if bind_to_child else pid + 1)).shm
        child.stdin.write(json.dumps({"name": offer.socket_name, "secret": offer.secret.hex()}) + "\n")
        child.stdin.flush()
        out, _ = child.communicate(timeout=20)
        assert child.returncode == 0
        return out.strip(), offer.secret
    finally:
        child.kill()


def test_peer_pid_checked_across_processes(listener_factory: Any) -> None:
    lst = listener_factory(engine_factory=lambda: pytest.fail("unreachable"))
    out, _ = run_child(lst, bind_to_child=False)
    assert "is not the pid the secret was issued to" in out
    out, _ = run_child(lst, bind_to_child=True)  # pid matches; fails later, on the fds
    assert out == "peer sent 0 file descriptors, expected 2"


@pytest.mark.skipif(os.getuid() != 0 or not os.access(_SYSTEM_PYTHON, os.X_OK)
                    or shutil.which("setpriv") is None,
                    reason="needs root, setpriv and a system python to run a client as "
                           "another user")
def test_peer_uid_checked_and_secret_burned(listener_factory: Any) -> None:
    lst = listener_factory(engine_factory=lambda: pytest.fail("unreachable"))
    out, secret = run_child(lst, bind_to_child=True, user=65534)
    assert out == "peer uid 65534 is not the server's uid 0"
    # consumed on first use even though that use failed
    assert raw_hello(lst.transport_server("shm").socket_name, secret) == (
        b"NO", b"unknown or already used handshake secret")


# --------------------------------------------------------------------------- negotiate (client)

@pytest.fixture
def grpc_server():
    servers: list[grpc.Server] = []

    def start(*handlers: grpc.GenericRpcHandler) -> str:
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
        server.add_generic_rpc_handlers(handlers)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for s in servers:
        s.stop(None)


def test_negotiate_local_reasons() -> None:
    with grpc.insecure_channel("127.0.0.1:1") as ch:
        n = negotiate(ch, Config(enabled=False), 4 * MiB, 1.0)
        assert (n.transport, n.reason, n.retryable, n.connection) == ("grpc", "TF_RDMA_ENABLED=false", False, None)
        n = negotiate(ch, Config(enabled=False, transport="shm"), 4 * MiB, 1.0)
        assert n.forced_error == ""  # the master switch wins over a forced transport
        n = negotiate(ch, Config(), 4 * MiB, 1.0, secure=True)
        assert n.transport == "grpc" and "TF_RDMA_OVER_TLS" in n.reason and not n.retryable
        n = negotiate(ch, Config(transport="grpc"), 4 * MiB, 1.0)
        assert n.transport == "grpc" and n.reason == "TF_RDMA_TRANSPORT=grpc"
        n = negotiate(ch, Config(transport="shm"), 4 * MiB, 1.0, secure=True)
        assert "TF_RDMA_OVER_TLS" in n.forced_error


def test_negotiate_plain_server(grpc_server: Any) -> None:
    target = grpc_server(grpc.method_handlers_generic_handler("other.Svc", {}))
    with grpc.insecure_channel(target) as ch:
        n = negotiate(ch, Config(), 4 * MiB, 5.0)
        assert n.transport == "grpc"
        assert n.reason == "server is plain gRPC (no argrpc bootstrap)"
        assert not n.retryable and n.forced_error == ""
        forced = negotiate(ch, Config(transport="shm"), 4 * MiB, 5.0)
        assert "TF_RDMA_TRANSPORT=shm" in forced.forced_error and "plain gRPC" in forced.forced_error


def test_negotiate_unreachable_is_retryable() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        n = negotiate(ch, Config(), 4 * MiB, 1.0)
        assert n.transport == "grpc" and n.retryable and "UNAVAILABLE" in n.reason
        n = negotiate(ch, Config(), 4 * MiB, 0.3, wait_for_ready=True)
        assert n.transport == "grpc" and n.retryable and "DEADLINE_EXCEEDED" in n.reason


def test_negotiate_server_says_none(grpc_server: Any, listener_factory: Any) -> None:
    lst = listener_factory(Config(enabled=False))
    target = grpc_server(lst.handler())
    with grpc.insecure_channel(target) as ch:
        n = negotiate(ch, Config(), 4 * MiB, 5.0)
        assert n.transport == "grpc" and not n.retryable
        assert n.reason == "server: server has TF_RDMA_ENABLED=false"


def test_negotiate_real_host_mismatch(grpc_server: Any, listener_factory: Any) -> None:
    # The client sends its real identity; the server pretends to be another host.
    lst = listener_factory(Config(), host=SERVER_HOST)
    target = grpc_server(lst.handler())
    with grpc.insecure_channel(target) as ch:
        n = negotiate(ch, Config(), 4 * MiB, 5.0)
        assert n.reason.startswith("server: different host or network namespace"), n.reason


def test_bootstrap_method_is_served_for_plain_grpc_clients(grpc_server: Any, listener_factory: Any) -> None:
    me = local_identity()
    lst = listener_factory(Config(), host=me)
    target = grpc_server(lst.handler())
    with grpc.insecure_channel(target) as ch:
        rpc = ch.unary_unary(BOOTSTRAP_METHOD,
                             request_serializer=_proto.NegotiateRequest.SerializeToString,
                             response_deserializer=_proto.NegotiateResponse.FromString)
        req = _proto.NegotiateRequest(version=1, transports=["shm"])
        me.to_proto(req.host)
        resp = rpc(req, timeout=5)
        assert resp.transport == "shm" and len(resp.shm.secret) == 32
        assert resp.shm.server_pid == os.getpid()


_NO_CORE_SCRIPT = r"""
import sys
sys.modules["argrpc._core"] = None  # this interpreter cannot import the engine
import concurrent.futures, grpc
from argrpc._bootstrap import FastPathListener, negotiate
from argrpc._config import Config
from argrpc._engine import EngineUnavailable, get_engine
from argrpc._host import local_identity
try:
    get_engine(Config())
    raise SystemExit("engine was created without _core")
except EngineUnavailable as e:
    assert "argrpc._core" in str(e), e
server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
lst = FastPathListener("core-server", Config(), 4 << 20, host=local_identity())
server.add_generic_rpc_handlers((lst.handler(),))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
    n = negotiate(ch, Config(), 4 << 20, 5.0)
    assert n.transport == "grpc" and "argrpc._core" in n.reason and not n.retryable, n
    n = negotiate(ch, Config(transport="shm"), 4 << 20, 5.0)
    assert "argrpc._core" in n.forced_error, n
lst.close()
server.stop(None)
print("ok")
"""


def test_negotiate_without_core_falls_back() -> None:
    # A host where the extension cannot load: the channel must fall back with a reason.
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _NO_CORE_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_negotiate_on_closed_channel_does_not_raise() -> None:
    ch = grpc.insecure_channel("127.0.0.1:1")
    ch.close()
    n = negotiate(ch, Config(), 4 * MiB, 1.0)
    assert n.transport == "grpc" and "bootstrap RPC failed" in n.reason


# --------------------------------------------------------------------------- engine singleton

_ENGINE_SCRIPT = r"""
import os, threading
from argrpc._config import load
from argrpc._engine import get_engine, peek_engine
assert peek_engine() is None
got = []
threads = [threading.Thread(target=lambda: got.append(get_engine(load()))) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
eng = got[0]
assert all(e is eng for e in got) and eng.pool_size == 128 << 20
pid = os.fork()
if pid == 0:
    child = get_engine(load())
    ok = child is not eng and get_engine(load()) is child and child.pool_size == 128 << 20
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0
assert get_engine(load()) is eng and peek_engine() is eng
print("ok")
"""


def test_engine_singleton_and_fork() -> None:
    # The real engine in a fresh interpreter: _engine's once-per-process creation,
    # thread safety and fork handling (the child gets its own engine).
    env = dict(os.environ, TF_RDMA_BUF_SIZE="128M", TF_RDMA_SPIN_US="7",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
