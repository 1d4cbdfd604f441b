"""The engine's always-on counters (csrc/engine/transport_stats.h, docs/core-api.md
"Metrics"): `Engine.transport_stats()` per transport, and `pool_stats()["waits"]`.

Over shm against an argrpc server in another process, the client engine's counters grow
by exactly the serialized size of each message, in the one path it took: eager (small),
rendezvous pulled into the pool (above acc_size, below zero_copy_min) or zero-copy view
(at least zero_copy_min). Over the in-process test fabric (csrc/fabric/sim), whose
engine is the test's own: both sides in one set of counters, a pool exhausted by a
silent peer (waits), and a peer found dead by the keepalive."""
from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import pytest

from argrpc import _core as core
from tests.support import payload
from tests.support.clients import UNLIMITED, UNLIMITED_SERVER_ARGS, make_channel
from tests.support.hooks import needs_test_hooks

KiB, MiB = 1 << 10, 1 << 20
KEYS = {"connections_open", "eager_bytes_sent", "eager_bytes_received", "rendezvous_bytes_sent",
        "rendezvous_bytes_received", "zero_copy_bytes_received", "keepalive_failures"}
OK, UNAVAILABLE, RESOURCE_EXHAUSTED = 0, 14, 8
HANG_S = 30.0


def wait_for(pred: Callable[[], bool], timeout: float = HANG_S) -> bool:
    end = time.monotonic() + timeout
    while not pred() and time.monotonic() < end:
        time.sleep(0.01)
    return pred()


# ------------------------------------------------------------------ shm, client side

def client_engine() -> Any:
    from argrpc import _engine
    engine = _engine.peek_engine()
    assert engine is not None
    return engine


def shm() -> dict[str, int]:
    return dict(client_engine().transport_stats()["shm"])


def grew(before: dict[str, int]) -> dict[str, int]:
    after = shm()
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


@pytest.fixture
def echo(servers: Any, pb: SimpleNamespace) -> Iterator[SimpleNamespace]:
    server = servers.get("argrpc", UNLIMITED_SERVER_ARGS)
    channel = make_channel("argrpc", server.target, UNLIMITED)
    stub = pb.pb2_grpc.EchoStub(channel)
    try:
        stub.Unary(pb.pb2.EchoRequest(payload=b"warm-up"), timeout=60, wait_for_ready=True)
        assert channel.transport == "shm", channel.fallback_reason
        yield SimpleNamespace(channel=channel, stub=stub, pb2=pb.pb2)
    finally:
        channel.close()


def size(msg: Any) -> int:
    return len(msg.SerializeToString())


def test_every_transport_has_every_key(echo: SimpleNamespace) -> None:
    stats = client_engine().transport_stats()
    assert "shm" in stats and all(set(v) == KEYS for v in stats.values()), stats
    assert stats["shm"]["connections_open"] >= 1


def test_small_messages_are_eager(echo: SimpleNamespace) -> None:
    before = shm()
    req = echo.pb2.EchoRequest(payload=payload.make(1, 64))
    resp = echo.stub.Unary(req, timeout=20)
    assert grew(before) == {"eager_bytes_sent": size(req), "eager_bytes_received": size(resp)}


def test_large_messages_are_rendezvous_or_zero_copy(echo: SimpleNamespace) -> None:
    # Out: 512 KiB (above acc_size) is rendezvous, whatever its size; back: a digest.
    before = shm()
    req = echo.pb2.EchoRequest(payload=payload.make(2, 512 * KiB), digest_only=True)
    resp = echo.stub.Unary(req, timeout=30)
    assert resp.size == 512 * KiB
    assert grew(before) == {"rendezvous_bytes_sent": size(req), "eager_bytes_received": size(resp)}
    # Back: 512 KiB (below zero_copy_min, 1 MiB) is pulled into this side's pool ...
    before = shm()
    req = echo.pb2.EchoRequest(payload=b"r", response_size=512 * KiB, response_seed=3)
    resp = echo.stub.Unary(req, timeout=30)
    assert grew(before) == {"eager_bytes_sent": size(req), "rendezvous_bytes_received": size(resp)}
    # ... and 8 MiB is handed over as a view of the server's block.
    before = shm()
    req = echo.pb2.EchoRequest(payload=b"z", response_size=8 * MiB, response_seed=4)
    resp = echo.stub.Unary(req, timeout=30)
    assert len(resp.payload) == 8 * MiB
    assert grew(before) == {"eager_bytes_sent": size(req), "zero_copy_bytes_received": size(resp)}


def test_connections_open_goes_up_and_back_down(servers: Any, pb: SimpleNamespace) -> None:
    server = servers.get("argrpc", UNLIMITED_SERVER_ARGS)
    stub_req = pb.pb2.EchoRequest(payload=b"hi")
    first = make_channel("argrpc", server.target, UNLIMITED)
    pb.pb2_grpc.EchoStub(first).Unary(stub_req, timeout=60, wait_for_ready=True)
    base = shm()["connections_open"]
    # Connections of their own (channels to one target share one otherwise).
    channels = [make_channel("argrpc", server.target,
                             UNLIMITED + [("grpc.use_local_subchannel_pool", 1)])
                for _ in range(2)]
    try:
        for ch in channels:
            pb.pb2_grpc.EchoStub(ch).Unary(stub_req, timeout=60, wait_for_ready=True)
            assert ch.transport == "shm"
        assert shm()["connections_open"] == base + 2
    finally:
        for ch in channels:
            ch.close()
    assert wait_for(lambda: shm()["connections_open"] == base), shm()
    first.close()
    assert wait_for(lambda: shm()["connections_open"] == base - 1), shm()


# ---------------------------------------------------------- the in-process test fabric

ECHO, HOLD = "/sim.Test/Echo", "/sim.Test/Hold"


class Answerer:
    """Answers ECHO calls of a core Server on one thread (the sim fabric's peer)."""

    def __init__(self, engine: Any) -> None:
        import threading
        self.server = core.Server(engine, {})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            call = self.server.accept(0.05)
            if call is None:
                continue
            msg = call.recv()
            if call.method == ECHO:
                call.finish(OK, "", [], b"" if msg is None else msg)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(HANG_S)
        self.server.shutdown()


@pytest.fixture
def rig() -> Iterator[SimpleNamespace]:
    engine = core.Engine({"buf_size": 64 * MiB})
    answerer = Answerer(engine)
    try:
        yield SimpleNamespace(engine=engine, server=answerer.server)
    finally:
        answerer.close()
        engine.shutdown()


def sim(rig: SimpleNamespace) -> dict[str, int]:
    return dict(rig.engine.transport_stats().get("sim", {}))


@needs_test_hooks
def test_sim_both_sides_count_every_byte_once(rig: SimpleNamespace) -> None:
    assert rig.engine.transport_stats() == {}
    client, served, _link = core._sim_pair(rig.engine, rig.server, {}, {"max_recv": -1})
    try:
        assert sim(rig)["connections_open"] == 2
        sizes = [0, 100, 8 * KiB - 16, 8 * KiB - 15, 3 * MiB + 3]
        for i, n in enumerate(sizes):
            code, details, _i, _t, resp = client.unary(ECHO, [], HANG_S, payload.make(i, n))
            assert code == OK and len(b"" if resp is None else resp) == n, details
        s = sim(rig)
        eager = 2 * (100 + 8 * KiB - 16)
        large = 2 * (8 * KiB - 15 + 3 * MiB + 3)
        # No views on this fabric: every large message is pulled.
        assert (s["eager_bytes_sent"], s["eager_bytes_received"]) == (eager, eager), s
        assert (s["rendezvous_bytes_sent"], s["rendezvous_bytes_received"]) == (large, large), s
        assert s["zero_copy_bytes_received"] == s["keepalive_failures"] == 0, s
    finally:
        client.close()
        served.close()
    assert wait_for(lambda: sim(rig)["connections_open"] == 0), sim(rig)


@needs_test_hooks
def test_pool_waits_count_allocations_that_waited(rig: SimpleNamespace) -> None:
    # A silent peer never pulls (nor FINs) what it was announced: the first 40 MiB stays
    # in the 64 MiB pool, and the second must wait for room until its deadline.
    client, served, _link = core._sim_pair(
        rig.engine, rig.server, {"server": {"drop_after_writes": 0}},
        {"max_recv": -1, "keepalive_ms": 60000, "keepalive_timeout_ms": 60000})
    try:
        assert rig.engine.pool_stats()["waits"] == 0
        held = client.start_call(HOLD, [], HANG_S)
        assert held.send(payload.make(1, 40 * MiB))
        assert rig.engine.pool_stats()["waits"] == 0
        waiting = client.start_call(HOLD, [], 0.3)
        assert not waiting.send(payload.make(2, 40 * MiB))
        status = waiting.status(HANG_S)
        assert status is not None and status[0] == RESOURCE_EXHAUSTED, status
        stats = rig.engine.pool_stats()
        assert stats["waits"] == 1 and stats["waiters"] == 0, stats
        assert set(stats) == {"capacity", "grown", "in_use", "received", "waiters", "waits"}
        assert stats["received"] == 0, stats  # the sim peer pulled nothing
        # The one that waited in vain was never committed, so never counted as sent.
        assert sim(rig)["rendezvous_bytes_sent"] == 40 * MiB, sim(rig)
    finally:
        client.close()
        served.close()


@needs_test_hooks
def test_keepalive_failures_count_a_silent_peer(rig: SimpleNamespace) -> None:
    # PING after 100 ms of silence, fail after 1 s unanswered.
    client, served, _link = core._sim_pair(
        rig.engine, rig.server, {"server": {"drop_after_writes": 0}},
        {"keepalive_ms": 100, "keepalive_timeout_ms": 1000})
    other, other_served, _ = core._sim_pair(rig.engine, rig.server, {}, {})
    try:
        call = client.start_call(ECHO, [], HANG_S)
        assert call.send(b"into the void")
        status = call.status(HANG_S)
        assert status is not None and status[0] == UNAVAILABLE, status
        assert "did not answer a keepalive" in status[1], status
        # The silent side learns of it by the hang-up, not by a keepalive of its own.
        assert wait_for(lambda: not served.alive)
        # A connection is marked dead before it is detached (and uncounted).
        assert wait_for(lambda: sim(rig)["connections_open"] == 2), sim(rig)
        assert sim(rig)["keepalive_failures"] == 1, sim(rig)
        code, _d, _i, _t, _r = other.unary(ECHO, [], HANG_S, b"still fine")
        assert code == OK
        assert sim(rig)["keepalive_failures"] == 1
    finally:
        client.close()
        served.close()
        other.close()
        other_served.close()
