"""The engine over the in-process test fabric (csrc/fabric/sim): a real Engine, a real
Server answering on threads, and real Connections from `_core._sim_pair`, the fabric
injecting faults from a seeded plan (docs/core-api.md, "Test fabric"):

* no faults, delayed or held completions, reordered READs: calls of every size, eager
  and rendezvous over several chunks, come back byte-exact;
* a failed write or READ: every call on that connection ends UNAVAILABLE with the
  fabric's reason (the peer's calls with the hang-up), nothing waits on, and another
  connection of the same engine and server goes on;
* a silent peer (dead, its NIC no longer answering): only the keepalive can tell, and
  it ends the calls in flight UNAVAILABLE;
* a live peer busy in a pull longer than the keepalive timeout is not declared dead;
* a connection that leaves the hot set while its peer writes to it is still read, with
  the fabric's nudge off, as on verbs, where nothing would ring for it a second time.

Every test reads the fabric's counters, so a fault that was planned but never hit
fails the test instead of passing it vacuously. Faults count polls, not time (but for
`read_us`, a slow link, which only makes a pull last): the only time bounds here are
generous ones on "does not hang"."""
from __future__ import annotations

import contextlib
import random
import threading
import time
from types import SimpleNamespace
from typing import Any, Iterator

import grpc
import pytest

from argrpc import _config
from argrpc import _core as core
from tests.support import payload
from tests.support.hooks import needs_test_hooks
from tests.support.load import busy_cores

pytestmark = needs_test_hooks

KiB, MiB = 1024, 1024 * 1024
ACC = 8 * KiB          # the default eager limit: ACC - 16 is the largest eager message
CHUNK = 64 * KiB       # a small rendezvous chunk, so a few hundred KiB is several READs
CONFIG = {"chunk_size": CHUNK, "max_recv": -1}
SIZES = [0, 1, 1000, ACC - 16, ACC - 15, ACC + 1, CHUNK - 1, CHUNK + 1, 6 * CHUNK + 5,
         3 * MiB + 3]
BIG = 6 * CHUNK + 5    # rendezvous, seven chunks, four READs in flight at once
ECHO, STREAM, HOLD = "/sim.Test/Echo", "/sim.Test/Stream", "/sim.Test/Hold"
HANG_S = 30.0          # "does not hang": what must end ends within this
OK = grpc.StatusCode.OK.value[0]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
INTERNAL = grpc.StatusCode.INTERNAL.value[0]
# Only the keepalive can find a silent peer: PING after 100 ms of silence, fail after
# 1 s unanswered (the defaults are 1 s and 10 s).
KEEPALIVE = {"keepalive_ms": 100, "keepalive_timeout_ms": 1000}
INJECTED = ("delayed", "reordered", "failed_writes", "failed_reads", "flushed",
            "dropped_writes", "dropped_reads", "refused_reads")


class EchoServer:
    """Takes calls from the Server on one thread and answers each on a thread of its own:
    ECHO sends the request back, STREAM sends "n,size,seed" messages, HOLD waits for
    `release` before it echoes."""

    def __init__(self, engine: Any) -> None:
        self.server = core.Server(engine, {})
        self.release = threading.Event()
        self.errors: list[str] = []
        self._holding = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._workers: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._loop, name="sim-echo", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            call = self.server.accept(0.05)
            if call is not None:
                t = threading.Thread(target=self._handle, args=(call,), daemon=True)
                t.start()
                self._workers.append(t)
            # A dispatcher's work: a call the peer ended is held here until taken.
            for _ in range(8):
                if self.server.next_event(0)[0] == "none":
                    break

    def _handle(self, call: Any) -> None:
        try:
            msg = call.recv()
            if call.method == ECHO:
                call.finish(OK, "", [], b"" if msg is None else msg)
            elif call.method == STREAM:
                n, size, seed = (int(x) for x in bytes(msg).decode().split(","))
                for i in range(n):
                    if not call.send(payload.make(seed + i, size)):
                        return
                call.finish(OK, "", [])
            elif call.method == HOLD:
                with self._cond:
                    self._holding += 1
                    self._cond.notify_all()
                self.release.wait(2 * HANG_S)
                call.finish(OK, "", [], b"" if msg is None else msg)
            else:
                call.finish(grpc.StatusCode.UNIMPLEMENTED.value[0], call.method, [])
        except Exception as e:  # noqa: BLE001 - the test that cares reads errors
            self.errors.append(f"{call.method}: {type(e).__name__}: {e}")

    def wait_holding(self, n: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self._holding >= n, HANG_S), (
                f"{self._holding} of {n} held calls reached the handler")

    def close(self) -> None:
        self.release.set()
        self._stop.set()
        self._thread.join(HANG_S)
        self.server.shutdown()
        for t in self._workers:
            t.join(HANG_S)


@pytest.fixture
def rig() -> Iterator[SimpleNamespace]:
    """An engine and a server of the test's own, so one test's failed connections and
    held calls never meet the next test."""
    engine = core.Engine({"buf_size": 256 * MiB})
    echo = EchoServer(engine)
    try:
        yield SimpleNamespace(engine=engine, echo=echo)
    finally:
        echo.close()
        engine.shutdown()


@contextlib.contextmanager
def sim_pair(rig: SimpleNamespace, plan: dict | None = None,
             **config: int) -> Iterator[SimpleNamespace]:
    client, served, link = core._sim_pair(rig.engine, rig.echo.server, plan or {},
                                          {**CONFIG, **config})
    assert client.transport == served.transport == "sim"
    try:
        yield SimpleNamespace(client=client, served=served, link=link)
    finally:
        client.close()
        served.close()


@contextlib.contextmanager
def two_processes(*plans: dict, config: dict | None = None,
                  pause_cooling_us: int = 0) -> Iterator[SimpleNamespace]:
    """A client engine and a server engine of their own, each with its progress thread,
    as two processes have, and a pair between them per plan (`pairs`: (client, served,
    link) each). `pause_cooling_us`: the server engine's cooling holds still that long
    after it armed a connection (_pause_cooling_for_test)."""
    client_engine = core.Engine({"buf_size": 64 * MiB})
    server_engine = core.Engine({"buf_size": 64 * MiB})
    if pause_cooling_us:
        core._pause_cooling_for_test(server_engine, pause_cooling_us)
    srv = EchoServer(server_engine)
    pairs: list[tuple[Any, Any, Any]] = []
    try:
        for plan in plans:
            pairs.append(core._sim_pair(client_engine, srv.server, plan, config or CONFIG,
                                        server_engine=server_engine))
        yield SimpleNamespace(client_engine=client_engine, server_engine=server_engine,
                              srv=srv, pairs=pairs)
    finally:
        for client, served, _link in pairs:
            client.close()
            served.close()
        srv.close()
        server_engine.shutdown()
        client_engine.shutdown()


def echo(conn: Any, size: int, seed: int) -> None:
    """One unary ECHO of `size` bytes, checked byte for byte."""
    data = payload.make(seed, size)
    code, details, _initial, _trailing, resp = conn.unary(ECHO, [], HANG_S, data)
    assert code == OK, (size, details, conn.error)
    got = b"" if resp is None else resp
    assert len(got) == size and payload.sha256(got) == payload.sha256(data), size


def stream(conn: Any, n: int, size: int, seed: int) -> None:
    """A server stream of n rendezvous messages, each checked byte for byte."""
    call = conn.start_call(STREAM, [], HANG_S)
    assert call.send(f"{n},{size},{seed}".encode())
    # False when the server already answered and finished (its handler needs only the
    # request), as may happen before this thread runs again: not an error.
    call.half_close()
    got = []
    while (m := call.recv()) is not None:
        got.append(payload.sha256(m))
    status = call.status(HANG_S)
    assert status is not None and status[0] == OK, (status, conn.error)
    assert got == [payload.sha256(payload.make(seed + i, size)) for i in range(n)]


def every_size(conn: Any) -> None:
    for i, size in enumerate(SIZES):
        echo(conn, size, 100 + i)
    stream(conn, 5, BIG, 7)
    # Concurrent calls on the one connection: batches coalesce, READs of several
    # messages interleave.
    sizes = [(i * 7919) % (3 * ACC) if i % 3 else BIG + i for i in range(12)]
    with_errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            echo(conn, sizes[i], 500 + i)
        except BaseException as e:  # noqa: BLE001 - asserted below, on the test's thread
            with_errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(sizes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    assert not with_errors, with_errors
    assert not any(t.is_alive() for t in threads), "a concurrent call hung"


def hold_calls(conn: Any, n: int, size: int = 10) -> list[Any]:
    """n calls whose handler holds them: in flight until EchoServer.release."""
    calls = []
    for i in range(n):
        call = conn.start_call(HOLD, [], HANG_S)
        assert call.send(payload.make(900 + i, size)) and call.half_close()
        calls.append(call)
    return calls


def ended(call: Any) -> tuple[int, str]:
    status = call.status(HANG_S)
    assert status is not None, f"a call did not end within {HANG_S} s"
    return status[0], status[1]


# ------------------------------------------------------------------------------ no faults

def test_every_size_byte_exact_without_faults(rig: SimpleNamespace) -> None:
    with sim_pair(rig) as p:
        every_size(p.client)
        c = p.link.counters()
        # Rendezvous went both ways, and nothing was injected.
        assert c["client"]["reads"] and c["server"]["reads"], c
        assert c["client"]["exposed"] and c["server"]["exposed"], c
        assert all(c[side][k] == 0 for side in c for k in INJECTED), c
        assert p.client.alive and p.served.alive
    assert not rig.echo.errors, rig.echo.errors


# ------------------------------------------------------------- delayed, held, reordered

SLOW = {
    # every completion passed over by a seeded 0..3 polls (client) or by 2 (server)
    "delayed": ({"seed": 11, "client": {"delay_polls": 3, "delay_jitter": True},
                 "server": {"delay_polls": 2}}, ("delayed",)),
    # single completions held long: a batch, and READs of both sides
    "held": ({"seed": 12, "client": {"hold_recv": 3, "hold_read": 2, "hold_polls": 100},
              "server": {"hold_read": 1, "hold_polls": 100}}, ("delayed",)),
    "reordered": ({"seed": 13, "client": {"reorder_reads": True},
                   "server": {"reorder_reads": True}}, ("reordered",)),
    "delayed_and_reordered": (
        {"seed": 14, "client": {"delay_polls": 4, "delay_jitter": True, "reorder_reads": True},
         "server": {"delay_polls": 4, "delay_jitter": True, "reorder_reads": True}},
        ("delayed", "reordered")),
}


@pytest.mark.parametrize("name", SLOW)
def test_every_size_byte_exact_under(name: str, rig: SimpleNamespace) -> None:
    plan, expected = SLOW[name]
    with sim_pair(rig, plan) as p:
        every_size(p.client)
        c = p.link.counters()
        for side in ("client", "server"):
            for k in expected:
                assert c[side][k] > 0, (side, k, c)
            for k in set(INJECTED) - {"delayed", "reordered"}:
                assert c[side][k] == 0, (side, k, c)
        assert p.client.alive and p.served.alive
    assert not rig.echo.errors, rig.echo.errors


# -------------------------------------------------------------------- a failed operation

REASON = "sim: injected by the test"
# name -> (the faulty side's plan, the side, what triggers it)
FAILURES = {
    "client_write": ("client", {"fail_write": 12}, "small"),
    "client_read": ("client", {"fail_read": 2}, "big"),
    "server_write": ("server", {"fail_write": 1}, "small"),
    "server_read": ("server", {"fail_read": 2}, "big"),
}
HELD = 3  # calls in flight on the faulty connection when it fails (3 writes each)


@pytest.mark.parametrize("name", FAILURES)
def test_failed_operation_ends_every_call_of_that_connection(name: str,
                                                             rig: SimpleNamespace) -> None:
    side, faults, trigger = FAILURES[name]
    plan = {"seed": 21, side: {**faults, "fail_reason": REASON}}
    with sim_pair(rig, plan) as p, sim_pair(rig) as other:
        held = hold_calls(p.client, HELD)
        held_other = hold_calls(other.client, 1, BIG)
        rig.echo.wait_holding(HELD + 1)
        t0 = time.monotonic()
        # The trigger: calls until the planned failure is hit (a write of a keepalive
        # PING may hit it first: then the first call finds the connection failed).
        codes = []
        for i in range(20):
            code, details, *_ = p.client.unary(ECHO, [], HANG_S,
                                               payload.make(i, BIG if trigger == "big" else 10))
            codes.append(code)
            if code != OK:
                break
        assert code == UNAVAILABLE, (codes, details)
        # The faulty side fails with the fabric's reason; its peer with the hang-up.
        lost = "connection to sim:server lost"
        want = f"argrpc: {REASON}" if side == "client" else lost
        assert want in details, details
        for call in held:
            assert ended(call) == (UNAVAILABLE, details)
        took = time.monotonic() - t0
        assert took < HANG_S, took
        faulty = p.client if side == "client" else p.served
        assert faulty.error == f"argrpc: {REASON}", faulty.error
        end = time.monotonic() + HANG_S
        while (p.client.alive or p.served.alive) and time.monotonic() < end:
            time.sleep(0.01)
        assert not p.client.alive and not p.served.alive
        c = p.link.counters()[side]
        assert c["failed_" + ("writes" if "write" in name else "reads")] == 1, c
        # The handle says why, and a call started on it now (the calls above still
        # hold the connection) ends at once, the same way.
        assert p.client.error == details
        code, late, *_ = p.client.unary(ECHO, [], HANG_S, b"late")
        assert (code, late) == (UNAVAILABLE, details)

        # The other connection of the same engine and server goes on: its held call
        # completes, then every size.
        rig.echo.release.set()
        status = ended(held_other[0])
        assert status[0] == OK, (status, other.client.error)
        every_size(other.client)
        assert all(v == 0 for k, v in other.link.counters()["client"].items() if k in INJECTED)


@pytest.mark.parametrize("op", ["write", "read"])
def test_refused_operation_ends_the_calls(op: str, rig: SimpleNamespace) -> None:
    """fail_mode "refuse": the fabric call returns false. A refused write is the
    connection's loss (UNAVAILABLE); a refused READ means the peer announced memory it
    may not (a protocol error: INTERNAL)."""
    plan = {"client": {"fail_" + op: 1, "fail_mode": "refuse", "fail_reason": REASON}}
    with sim_pair(rig, plan) as p:
        held = hold_calls(p.client, 1) if op == "read" else []
        code, details, *_ = p.client.unary(ECHO, [], HANG_S, payload.make(3, BIG))
        if op == "write":
            assert (code, details) == (UNAVAILABLE, "argrpc: write to peer sim:server failed")
        else:
            assert code == INTERNAL and "outside the peer's pool" in details, details
            assert ended(held[0]) == (code, details)
        assert not p.client.alive
        assert p.link.counters()["client"]["failed_" + op + "s"] == 1


def test_read_outside_what_the_peer_exposed_is_refused(rig: SimpleNamespace) -> None:
    """A READ is checked as a memory window checks it: only what the peer announced, by
    its key, for as long as it is announced."""
    with sim_pair(rig) as p:
        # Four announced messages, none read: the first two are pulled ahead, the last
        # stays announced (exposed by the server) until the client's FIN. The server's
        # keys count from 1, and it exposes nothing else.
        call = p.client.start_call(STREAM, [], HANG_S)
        assert call.send(f"4,{CHUNK + 1},5".encode())
        call.half_close()  # False if the server already answered: see stream()
        end = time.monotonic() + HANG_S
        while p.client._probe_last_rts()[1] != 4 and time.monotonic() < end:
            time.sleep(0.01)
        addr, key, length = p.client._probe_last_rts()
        assert (key, length) == (4, CHUNK + 1)
        assert p.client._probe_read(addr, key, length, HANG_S) == ""
        why = p.client._probe_read(addr, key + 1000, length, HANG_S)
        assert "remote access error" in why and f"key {key + 1000}" in why, why
        assert not p.client.alive and p.client.error == why
        assert p.link.counters()["client"]["refused_reads"] == 1
        assert ended(call)[0] == UNAVAILABLE


# ------------------------------------------------------------------------- a silent peer

def test_peer_silent_from_the_start_is_found_by_the_keepalive(rig: SimpleNamespace) -> None:
    with sim_pair(rig, {"server": {"drop_after_writes": 0}}, **KEEPALIVE) as p, \
            sim_pair(rig) as other:
        calls = []
        for i, size in enumerate([10, ACC + 1, BIG]):
            call = p.client.start_call(ECHO, [], HANG_S)
            assert call.send(payload.make(i, size))
            calls.append(call)
        t0 = time.monotonic()
        for call in calls:
            code, details = ended(call)
            assert code == UNAVAILABLE and "did not answer a keepalive" in details, details
        assert time.monotonic() - t0 < HANG_S
        c = p.link.counters()
        # The requests and the PINGs vanished; the server never saw a batch.
        assert c["client"]["dropped_writes"] >= 3 + 1, c
        assert c["server"]["completions"] == 0, c
        assert not p.client.alive
        # The client's end reaches the silent side (so the test leaves nothing behind).
        end = time.monotonic() + HANG_S
        while p.served.alive and time.monotonic() < end:
            time.sleep(0.01)
        assert not p.served.alive
        every_size(other.client)


def test_peer_that_goes_silent_mid_call_is_found_by_the_keepalive(rig: SimpleNamespace) -> None:
    with sim_pair(rig, {}, **KEEPALIVE) as p, sim_pair(rig) as other:
        calls = hold_calls(p.client, 2) + hold_calls(p.client, 1, BIG)
        rig.echo.wait_holding(3)
        p.link.drop("server")
        rig.echo.release.set()  # the answers, eager and rendezvous, vanish
        t0 = time.monotonic()
        for call in calls:
            code, details = ended(call)
            assert code == UNAVAILABLE and "did not answer a keepalive" in details, details
        assert time.monotonic() - t0 < HANG_S
        # Every answer was written, and vanished.
        end = time.monotonic() + HANG_S
        while p.link.counters()["server"]["dropped_writes"] < 3 and time.monotonic() < end:
            time.sleep(0.01)
        assert p.link.counters()["server"]["dropped_writes"] >= 3, p.link.counters()
        end = time.monotonic() + HANG_S
        while p.served.alive and time.monotonic() < end:
            time.sleep(0.01)
        assert not p.served.alive
        every_size(other.client)


def test_peer_busy_with_a_long_pull_is_not_declared_dead() -> None:
    """A live peer in a pull longer than the keepalive timeout, its poller never finding
    the completion queue empty (each READ lands inside the poll that delivers it, as on
    Soft-RoCE under emulation): it still answers the PINGs, so the call succeeds and
    neither side fails the connection. The server has an engine of its own, as a peer
    process has, so the client's progress thread keeps its keepalive running."""
    config = {**CONFIG, **KEEPALIVE}
    read_us, size = 12000, 256 * CHUNK  # 256 READs of at least 12 ms: over 3 s of pulling
    with two_processes({"server": {"read_us": read_us}}, config=config) as two:
        client, served, link = two.pairs[0]
        data = payload.make(3, size)
        code, details, _i, _t, resp = client.unary(ECHO, [], HANG_S, data)
        assert code == OK, (details, client.error)
        assert bytes(resp) == data
        assert client.alive and served.alive, (client.error, served.error)
        c = link.counters()
        # The pull lasted well past the keepalive timeout: the case was exercised.
        assert c["server"]["reads"] * read_us / 1e6 > 3 * KEEPALIVE["keepalive_timeout_ms"] / 1e3, c
        for engine in (two.client_engine, two.server_engine):
            assert engine.transport_stats()["sim"]["keepalive_failures"] == 0


# --------------------------------------------------------------------------- doorbells

@pytest.mark.parametrize("loaded", [False, True], ids=["quiet", "busy-cores"])
def test_connections_cooled_while_their_peer_writes_are_still_read(loaded: bool) -> None:
    """Calls after random pauses of up to twice cool_ms on a few connections, from several
    threads: a connection leaves its engine's hot set (armed by whichever thread starts
    to poll) while its peer writes to it, and the progress thread hears the doorbell at
    that moment. With `nudge` off, as on verbs, nothing rings a doorbell the engine lost
    a second time: such a request is never read and its call ends DEADLINE_EXCEEDED
    instead of OK. Each side has an engine of its own, as two processes do."""
    cool_s = _config.LIMITS.cool_ms / 1000
    plans = [{"seed": i, "nudge": False, "lazy_credits": False} for i in range(4)]
    failures: list[str] = []
    calls = [0]
    lock = threading.Lock()

    def caller(clients: list[Any], seed: int) -> None:
        rng = random.Random(seed)
        for i in range(80):
            time.sleep(rng.uniform(0, 2 * cool_s))
            data = payload.make(seed * 1000 + i, rng.choice([0, 64, ACC - 16]))
            code, details, _i, _t, resp = rng.choice(clients).unary(ECHO, [], 10.0, data)
            with lock:
                calls[0] += 1
                if code != OK or (resp or b"") != data:
                    failures.append(f"{code}: {details}")

    with two_processes(*plans) as two, busy_cores(2 if loaded else 0):
        clients = [client for client, _served, _link in two.pairs]
        threads = [threading.Thread(target=caller, args=(clients, s)) for s in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG_S * 4)
        assert not any(t.is_alive() for t in threads), "a call hung"
        assert failures == [] and calls[0] == 480, (failures[:5], calls[0])
        assert two.srv.errors == []


def test_a_doorbell_rung_while_its_connection_cools_is_heard() -> None:
    """The served side's cooling holds still for 20 ms each time it armed a quiet
    connection, so requests sent at random moments often ring while it does: the
    progress thread hears the doorbell of a connection on its way out of the hot set.
    With `nudge` off, as on verbs, such a request left unread is never read, and its call
    ends DEADLINE_EXCEEDED instead of OK."""
    cool_s = _config.LIMITS.cool_ms / 1000
    # Nothing but a doorbell wakes the server's progress thread (credits after every
    # batch: not even a debt's sweep), so it is the server's own thread, starting to
    # poll, that cools the connection.
    with two_processes({"nudge": False, "lazy_credits": False},
                       pause_cooling_us=20_000) as two:
        client = two.pairs[0][0]
        rng = random.Random(7)
        for i in range(40):
            time.sleep(rng.uniform(cool_s, 12 * cool_s))
            code, details, _i, _t, resp = client.unary(ECHO, [], 5.0, b"%d" % i)
            assert code == OK and resp == b"%d" % i, (i, code, details)
        assert two.srv.errors == []


# --------------------------------------------------------------------------- ring credits

def settled(p: SimpleNamespace) -> dict:
    """The counters once each side has returned credits for every batch the other wrote
    (an old debt is paid by the next thread that polls, or by the progress thread's sweep
    within longest_sleep_ms)."""
    end = time.monotonic() + HANG_S
    while True:
        c = p.link.counters()
        if all(c[me]["batches_read"] == c[peer]["writes"]
               for me, peer in (("client", "server"), ("server", "client"))):
            return c
        assert time.monotonic() < end, f"ring credits still owed after {HANG_S} s: {c}"
        time.sleep(0.005)


def test_credits_go_back_late_and_in_bulk(rig: SimpleNamespace) -> None:
    """On verbs every return of ring credits is a write (and an ACK) of its own, so a
    small call must not pay for one: calls one after another return credits at most once
    per credit_owe_ms (5 ms), however many batches they read, and once they stop every
    debt is paid."""
    with sim_pair(rig) as p:
        t0 = time.monotonic()
        for i in range(300):
            echo(p.client, 100, i)
        elapsed = time.monotonic() - t0
        c = settled(p)
        for side in ("client", "server"):
            assert c[side]["batches_read"] >= 300, c
            # One per 5 ms sweep, and the final payment: far fewer than one per batch
            # whenever calls take less than 5 ms.
            assert c[side]["credit_returns"] <= elapsed / 0.005 + 2, (elapsed, c)


def test_credits_owed_never_stall_a_sender_on_a_small_ring(rig: SimpleNamespace) -> None:
    """A 64 KiB ring and batches up to nearly half of it (a call's metadata), mixed at
    random with small ones: the sender may find the ring full only because the peer
    still owes credits (up to 1/8 of the ring); every call completes, byte-exact."""
    ring = 64 * KiB
    big_md = [("x-big-bin", bytes(ring // 2 - 400))]
    rnd = random.Random(5)
    with sim_pair(rig, ring_size=ring) as p:
        for i in range(200):
            md = big_md if rnd.random() < 0.3 else []
            size = rnd.choice([0, 100, 3000, ACC - 16])
            data = payload.make(i, size)
            code, details, _i, _t, resp = p.client.unary(ECHO, md, HANG_S, data)
            assert code == OK, (i, details, p.client.error)
            assert (b"" if resp is None else bytes(resp)) == data
        settled(p)
        assert p.client.alive and p.served.alive


def test_an_idle_connection_owing_no_credits_leaves_the_timer_asleep(
        rig: SimpleNamespace) -> None:
    """A connection whose credits go back late costs no sweep every few milliseconds for
    as long as it lives: once its debts are paid, its idle process's progress thread
    sleeps its longest sleep (a sweep every 5 ms would be 200 timed wake-ups a second),
    and the next calls' debts are still paid."""
    with sim_pair(rig) as p:
        for i in range(20):
            echo(p.client, 100, i)
        settled(p)
        time.sleep(0.2)  # the last sweeps of the paid debts, the hot set cooling
        before = rig.engine.timed_wakeups
        time.sleep(1.0)
        woke = rig.engine.timed_wakeups - before
        assert woke <= 1000 // _config.LIMITS.longest_sleep_ms + 10, woke
        returns = p.link.counters()["client"]["credit_returns"]
        for i in range(5):
            echo(p.client, 100, 100 + i)
        c = settled(p)
        assert c["client"]["credit_returns"] > returns, c


def test_credits_owed_by_a_busy_connection_leave_the_timer_asleep() -> None:
    """Calls one after another for a second and a half: their debts go back late and in
    bulk, returned by the threads that poll (a waiter about to spin), so neither side's
    progress thread is woken by its timer for them: a sweep every credit_owe_ms would be
    300 timed wake-ups, each taking a CPU from a thread that polls. Each side has an
    engine of its own, as two processes do."""
    with two_processes({}) as two:
        client, _served, link = two.pairs[0]
        engines = (two.client_engine, two.server_engine)
        echo(client, 100, 0)
        before = [e.timed_wakeups for e in engines]
        began, calls = time.monotonic(), 0
        while time.monotonic() - began < 1.5:
            echo(client, 100, calls)
            calls += 1
        seconds = time.monotonic() - began
        woke = [e.timed_wakeups - b for e, b in zip(engines, before)]
        c = link.counters()
        for side in ("client", "server"):
            # Late and in bulk still: about one return per credit_owe_ms of calls.
            assert 0 < c[side]["credit_returns"] <= seconds / 0.005 + 2, (calls, c)
        limits = _config.LIMITS
        bound = seconds * (1000 / limits.longest_sleep_ms + 1000 / limits.keepalive_ms) + 10
        assert max(woke) <= bound, (woke, calls)
        settled(SimpleNamespace(link=link))


# ---------------------------------------------------------------------------- the plan

@pytest.mark.parametrize("plan,config,match", [
    ({"client": {"delay_pols": 1}}, {}, "unknown sim fault for the client: delay_pols"),
    ({"clients": {}}, {}, "unknown sim plan key"),
    ({"server": {"fail_mode": "sometimes"}}, {}, "fail_mode must be"),
    ({}, {"keepalive_ms": 0}, "keepalive_ms and keepalive_timeout_ms must be > 0"),
    ({}, {"ring_size": 1000}, "ring_size must be a power of two"),
])
def test_plan_and_config_are_checked(plan: dict, config: dict, match: str,
                                     rig: SimpleNamespace) -> None:
    with pytest.raises((ValueError, core.CoreError), match=match):
        core._sim_pair(rig.engine, rig.echo.server, plan, config)
    with pytest.raises(ValueError, match="needs the Server"):
        core._sim_pair(rig.engine, None, {}, {})
    with sim_pair(rig) as p, pytest.raises(ValueError, match="side must be"):
        p.link.drop("nobody")
