"""The polling lease (csrc/engine/polling_lease.h): a server worker that has just sent
its call's status counts as polling until it is back in accept(), so that the peer's
next request rings no doorbell. What must hold is that the lease is only ever held on
that short way, never while anything else runs:

* it is taken by the thread accept() gave the call, when that call's status goes out,
  and by no other thread (a handler's own pool, another worker);
* not when another call already waits (the worker takes that one at once);
* accept() ends it, and so do `drop_polling_lease()` and the thread's end;
* the threaded server drops it before the application's callbacks run;
* its holder counts as a worker: a request that comes meanwhile starts no other one,
  and it takes the spin over from a worker spinning in accept(), so a one-client
  ping-pong is served by one worker while the others sleep.

Over the in-process test fabric (csrc/fabric/sim), whose engine is the test's own, so
`Engine.polling_leases` counts exactly this server's leases; the last test runs the
threaded facade in this process (its engine is this process's, so the count is its)."""
from __future__ import annotations

import contextlib
import select
import threading
import time
from concurrent import futures
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import grpc
import pytest

from argrpc import _core as core
from tests.support.hooks import needs_test_hooks

ECHO = "/lease.Test/Echo"
HANG_S = 30.0
OK = grpc.StatusCode.OK.value[0]


@pytest.fixture
def rig() -> Iterator[SimpleNamespace]:
    engine = core.Engine({"buf_size": 64 << 20})
    server = core.Server(engine, {})
    client, served, _link = core._sim_pair(engine, server, {}, {"max_recv": -1})
    try:
        yield SimpleNamespace(engine=engine, server=server, client=client)
    finally:
        client.close()
        served.close()
        server.shutdown()
        engine.shutdown()


class Caller:
    """Unary calls on a thread of their own; `result()` waits for each one's status."""

    def __init__(self, client: Any, n: int = 1) -> None:
        self.results: list[Any] = []
        self._threads = [threading.Thread(target=self._call, args=(client, i), daemon=True)
                         for i in range(n)]
        for t in self._threads:
            t.start()

    def _call(self, client: Any, i: int) -> None:
        self.results.append(client.unary(ECHO, [], HANG_S, b"x%d" % i))

    def join(self) -> list[Any]:
        for t in self._threads:
            t.join(HANG_S)
            assert not t.is_alive(), "a call did not end"
        return self.results


def answer(call: Any) -> None:
    request = call.recv()
    assert request is not None
    assert call.finish(OK, "", [], request)


@needs_test_hooks
def test_the_accepting_thread_holds_it_until_accept(rig: SimpleNamespace) -> None:
    caller = Caller(rig.client)
    call = rig.server.accept(HANG_S)
    assert call is not None
    assert rig.engine.polling_leases == 0
    answer(call)
    assert rig.engine.polling_leases == 1
    # Back in accept(): nothing waits, it returns empty-handed, and the lease is over.
    assert rig.server.accept(0.01) is None
    assert rig.engine.polling_leases == 0
    assert [r[0] for r in caller.join()] == [OK]


@needs_test_hooks
def test_another_thread_finishing_takes_none(rig: SimpleNamespace) -> None:
    caller = Caller(rig.client)
    call = rig.server.accept(HANG_S)
    assert call is not None
    other = threading.Thread(target=answer, args=(call,))
    other.start()
    other.join(HANG_S)
    assert rig.engine.polling_leases == 0
    assert [r[0] for r in caller.join()] == [OK]


@needs_test_hooks
def test_none_while_another_call_waits(rig: SimpleNamespace) -> None:
    caller = Caller(rig.client, n=2)
    first = rig.server.accept(HANG_S)
    assert first is not None
    # The dispatcher's view: a call waits and no worker is in accept() to take it.
    kind = "none"
    for _ in range(100):
        kind = rig.server.next_event(HANG_S / 100)[0]
        if kind == "starved":
            break
    assert kind == "starved"
    answer(first)
    assert rig.engine.polling_leases == 0
    second = rig.server.accept(HANG_S)
    assert second is not None
    answer(second)
    assert rig.engine.polling_leases == 1
    rig.server.drop_polling_lease()
    assert rig.engine.polling_leases == 0
    assert [r[0] for r in caller.join()] == [OK, OK]


@needs_test_hooks
def test_the_threads_end_ends_it(rig: SimpleNamespace) -> None:
    caller = Caller(rig.client)
    held = []

    def worker() -> None:
        call = rig.server.accept(HANG_S)
        assert call is not None
        answer(call)
        held.append(rig.engine.polling_leases)

    t = threading.Thread(target=worker)
    t.start()
    t.join(HANG_S)
    assert held == [1]
    # join() returns once Python is done with the thread, a moment before the thread
    # itself ends (and with it its lease).
    end = time.monotonic() + HANG_S
    while rig.engine.polling_leases and time.monotonic() < end:
        time.sleep(0.001)
    assert rig.engine.polling_leases == 0
    assert [r[0] for r in caller.join()] == [OK]


@needs_test_hooks
def test_a_held_up_holder_holds_back_no_waiting_call() -> None:
    """A lease taken while the server's progress thread sleeps long (up to
    longest_sleep_ms) and then held, as by a worker preempted on its way back to
    accept(): the next request sits unread, its doorbell not rung. The client's thread
    waiting on the call rings it after lease_check_ms (Fabric::nudge), and the request
    reaches the server. The served side has an engine of its own, as a peer process
    would, whose accept() spins until the first call comes, and returns ring credits as
    shm does, so its progress thread, never rung, stays in its long sleep (one that
    wakes while the lease is out, at its longest sleep's end, looks itself every
    lease_check_ms: the nudge is looked for over a few rounds)."""
    engine = core.Engine({"buf_size": 64 << 20})
    server_engine = core.Engine({"buf_size": 64 << 20, "spin_us": 100_000})  # the most allowed
    server = core.Server(server_engine, {})
    # Credits as shm returns them: no periodic sweep wakes the progress thread.
    client, served, link = core._sim_pair(engine, server, {"lazy_credits": False},
                                          {"max_recv": -1}, server_engine)
    try:
        for _ in range(5):
            # The call starts once accept() spins, so its request rings nothing.
            first: list[Caller] = []

            def call_once_accepting() -> None:
                end = time.monotonic() + HANG_S
                while server.idle_workers == 0 and time.monotonic() < end:
                    time.sleep(0.0005)
                first.append(Caller(client))

            starter = threading.Thread(target=call_once_accepting)
            starter.start()
            call = server.accept(HANG_S)
            assert call is not None
            answer(call)
            starter.join()
            assert first[0].join()[0][0] == OK
            assert server_engine.polling_leases == 1  # this thread's, held from here on
            before = link.counters()["server"]["nudges"]
            second = Caller(client)
            # Nobody polls the served side: the request shows only once the progress
            # thread has read it. It waits for the lease's holder, on its way back,
            # instead of asking the dispatcher for another worker.
            end = time.monotonic() + HANG_S
            while server.queued == 0 and time.monotonic() < end:
                time.sleep(0.0005)
            assert server.queued == 1, "the request was held back"
            assert server.next_event(0.01)[0] == "none"
            assert server_engine.polling_leases == 1
            call = server.accept(HANG_S)  # drops the lease, then takes the call
            assert call is not None
            answer(call)
            assert second.join()[0][0] == OK
            assert server.accept(0.01) is None
            if link.counters()["server"]["nudges"] > before:
                break
        else:
            pytest.fail("the waiting client never rang the served side (Fabric::nudge)")
    finally:
        client.close()
        served.close()
        server.shutdown()
        engine.shutdown()
        server_engine.shutdown()


@needs_test_hooks
def test_its_holder_counts_as_a_worker(rig: SimpleNamespace) -> None:
    caller = Caller(rig.client)
    call = rig.server.accept(HANG_S)
    assert call is not None
    answer(call)
    assert rig.engine.polling_leases == 1
    second = Caller(rig.client)
    end = time.monotonic() + HANG_S
    while rig.server.queued == 0 and time.monotonic() < end:
        time.sleep(0.0005)
    assert rig.server.queued == 1
    assert rig.server.next_event(0.05)[0] == "none"  # no second worker asked for
    rig.server.drop_polling_lease()  # gone elsewhere (other work): now one is
    assert rig.server.next_event(HANG_S)[0] == "starved"
    rig.server.worker_started()
    call = rig.server.accept(HANG_S)
    assert call is not None
    answer(call)
    assert [r[0] for r in caller.join() + second.join()] == [OK, OK]


@needs_test_hooks
def test_a_loop_ending_its_lease_wakes_itself_for_what_came_meanwhile() -> None:
    """An event loop's lease (Notifier::poll): the loop's thread took one when a call's
    answer came while it polled, and the next answer, written during the lease, rang no
    doorbell. The loop ends the lease on its way to sleep, which reads that answer and
    posts it from the loop's own thread, past its last look at `pending`: the notifier's
    eventfd must say so, or the loop sleeps on a call that has its answer until some
    timer or other file descriptor wakes it."""
    engine = core.Engine({"buf_size": 64 << 20, "spin_us": 100_000})  # the most allowed
    # The served side has an engine of its own, as a peer process would: its workers'
    # leases are not counted in the loop's engine.
    server_engine = core.Engine({"buf_size": 64 << 20})
    server = core.Server(server_engine, {})
    client, served, _link = core._sim_pair(engine, server, {}, {"max_recv": -1},
                                           server_engine)
    notifier = core.Notifier()
    notifier.look_before_sleeping()  # this thread is the loop's
    answered = []
    calls = []  # a client call let go of is cancelled

    def answer_one() -> None:
        call = server.accept(HANG_S)
        assert call is not None
        answer(call)
        answered.append(call)

    try:
        seen = 0
        for token in range(1, 41, 2):
            # An answer that comes while the loop polls: the loop keeps a lease.
            t = threading.Thread(target=answer_one)
            t.start()
            calls.append(client.start_unary_watched(ECHO, [], HANG_S, notifier, token, b"a"))
            got: list[int] = []
            end = time.monotonic() + HANG_S
            while not got and time.monotonic() < end:
                got = notifier.poll(engine, 100_000)
            t.join(HANG_S)
            assert got == [token]
            if engine.polling_leases != 1:
                continue  # it came between two polls: no lease this time
            t = threading.Thread(target=answer_one)
            t.start()
            calls.append(client.start_unary_watched(ECHO, [], HANG_S, notifier, token + 1,
                                                    b"b"))
            t.join(HANG_S)
            if notifier.pending:
                notifier.drain()  # the progress thread read it first: no lost wake-up here
                notifier.end_lease()
                continue
            notifier.end_lease()
            assert engine.polling_leases == 0
            assert notifier.pending, "ending the lease read the answer"
            readable, _, _ = select.select([notifier.fd], [], [], 0)
            assert readable, "posted on the loop's thread past its look, and the eventfd " \
                "left silent"
            assert notifier.drain() == [token + 1]
            seen += 1
            if seen == 3:
                break
        assert seen, "no answer came during a lease in twenty tries"
        assert len(answered) >= 2 * seen
    finally:
        notifier.end_lease()
        client.close()
        served.close()
        server.shutdown()
        engine.shutdown()
        server_engine.shutdown()


@contextlib.contextmanager
def echo_channel(pb: SimpleNamespace, unary: Callable[[Any, grpc.ServicerContext], Any],
                 workers: int) -> Iterator[grpc.Channel]:
    """A threaded argrpc server in this process whose Echo.Unary is `unary`, and a
    channel to it."""
    import argrpc

    class Echo(pb.pb2_grpc.EchoServicer):  # type: ignore[name-defined,misc]
        def Unary(self, request: Any, context: grpc.ServicerContext) -> Any:
            return unary(request, context)

    server = argrpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    pb.pb2_grpc.add_EchoServicer_to_server(Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with argrpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        server.stop(None)


def test_one_client_is_served_by_one_worker(stubs_dir: str, pb: SimpleNamespace) -> None:
    """Blocking calls one after another from one client, on a server with threads to
    spare: every call runs on the same worker. A second worker taking turns with the
    first would spin in accept() while the first serves, a third busy thread beside the
    client's."""
    ran_on: set[int] = set()

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        ran_on.add(threading.get_ident())
        return pb.pb2.EchoResponse(payload=request.payload)

    with echo_channel(pb, unary, workers=8) as channel:
        stub = pb.pb2_grpc.EchoStub(channel)
        request = pb.pb2.EchoRequest(payload=b"p")
        stub.Unary(request, timeout=HANG_S, wait_for_ready=True)
        assert channel.transport == "shm"  # type: ignore[attr-defined]
        ran_on.clear()
        for _ in range(20_000):
            stub.Unary(request, timeout=HANG_S)
    assert len(ran_on) == 1, f"{len(ran_on)} workers served one client's calls"


def test_threaded_server_drops_it_before_callbacks(stubs_dir: str, pb: SimpleNamespace) -> None:
    """Calls one after another, so only the callback's own worker could hold a lease
    while the callback runs; with the server's callbacks, for many calls."""
    from argrpc import _engine

    seen: list[int] = []

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        engine = _engine.peek_engine()
        assert engine is not None
        context.add_callback(lambda: seen.append(engine.polling_leases))
        return pb.pb2.EchoResponse(payload=request.payload)

    with echo_channel(pb, unary, workers=4) as channel:
        stub = pb.pb2_grpc.EchoStub(channel)
        for i in range(200):
            stub.Unary(pb.pb2.EchoRequest(payload=b"p"), timeout=HANG_S,
                       wait_for_ready=True)
            # The callback runs after the status went out: wait for it before the
            # next call, so that no other call's worker is on its way meanwhile.
            end = time.monotonic() + HANG_S
            while len(seen) <= i and time.monotonic() < end:
                time.sleep(0.001)
            assert len(seen) == i + 1, "the callback did not run"
        assert channel.transport == "shm"  # type: ignore[attr-defined]
    assert seen == [0] * 200
