"""Per-call records for an application's metrics (csrc/common/call_stats.h, docs/core-api.md
"Metrics"): `_core.set_call_stats(on)`, `_core._take_call_stats(timeout_ms)` and
`Connection.set_stats_target(target)`.

A real argrpc server runs in this process, so one queue holds both sides' records of a
call over shared memory: the client's started/ended (kinds 0/1) and the server's (2/3).
Byte counts are message payloads, exactly the serialized protobuf sizes each side sent or
received. The fork case runs in a fresh interpreter."""
from __future__ import annotations

import json
import re
import textwrap
import threading
import time
from concurrent import futures
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import grpc
import pytest

import argrpc
from argrpc import _core
from tests.support import payload
from tests.support.clients import UNLIMITED
from tests.support.procs import run_python
from tests.support.servicer import EchoServicer

MiB = 1 << 20
UNARY = "/argrpc.test.Echo/Unary"
BIDI = "/argrpc.test.Echo/Bidi"
CLIENT_STARTED, CLIENT_ENDED, SERVER_STARTED, SERVER_ENDED = 0, 1, 2, 3
OK, CANCELLED, DEADLINE_EXCEEDED, PERMISSION_DENIED = 0, 1, 4, 7
WAIT_S = 20.0


def drain() -> None:
    while True:
        records, dropped = _core._take_call_stats(0)
        if not records and not dropped:
            return


class Records:
    """Everything taken from the queue during one test, by kind."""

    def __init__(self) -> None:
        self.all: list[tuple[Any, ...]] = []
        self.dropped = 0

    def take(self, pred: Callable[[], bool], timeout: float = WAIT_S) -> None:
        end = time.monotonic() + timeout
        while not pred() and time.monotonic() < end:
            got, dropped = _core._take_call_stats(50)
            self.all.extend(got)
            self.dropped += dropped

    def of(self, kind: int, method: str | None = None) -> list[tuple[Any, ...]]:
        return [r for r in self.all if r[0] == kind and (method is None or r[1] == method)]

    def calls(self, n: int, method: str) -> dict[int, list[tuple[Any, ...]]]:
        """Waits for all four records of n calls of `method`; returns them by kind."""
        kinds = (CLIENT_STARTED, CLIENT_ENDED, SERVER_STARTED, SERVER_ENDED)
        self.take(lambda: all(len(self.of(k, method)) >= n for k in kinds))
        out = {k: self.of(k, method) for k in kinds}
        assert all(len(v) == n for v in out.values()), (n, self.all)
        return out


@pytest.fixture(scope="module")
def echo(pb: SimpleNamespace) -> Iterator[SimpleNamespace]:
    """An argrpc server in this process and a channel to it over shm."""
    server = argrpc.server(futures.ThreadPoolExecutor(8), options=UNLIMITED)
    pb.pb2_grpc.add_EchoServicer_to_server(EchoServicer(pb.pb2), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = argrpc.insecure_channel(f"127.0.0.1:{port}", options=UNLIMITED)
    stub = pb.pb2_grpc.EchoStub(channel)
    try:
        stub.Unary(pb.pb2.EchoRequest(payload=b"warm-up"), timeout=60, wait_for_ready=True)
        assert channel.transport == "shm", channel.fallback_reason
        yield SimpleNamespace(channel=channel, stub=stub, pb2=pb.pb2, port=port)
    finally:
        channel.close()
        server.stop(None)


@pytest.fixture
def records() -> Iterator[Records]:
    """Recording on, from an empty queue; off (and emptied) again afterwards."""
    drain()
    _core.set_call_stats(True)
    try:
        yield Records()
    finally:
        _core.set_call_stats(False)
        drain()


def size(msg: Any) -> int:
    return len(msg.SerializeToString())


def check_pair(started: tuple[Any, ...], ended: tuple[Any, ...], method: str, code: int,
               sent: int, rcvd: int) -> None:
    # A channel labels its client records with its target; server records have none.
    target = started[2] if started[0] == CLIENT_STARTED else ""
    if started[0] == CLIENT_STARTED:
        assert re.fullmatch(r"127\.0\.0\.1:\d+", target), started
    assert started[1:] == (method, target, 0, 0.0, 0, 0, "shm"), started
    kind, m, t, c, duration, s, r, transport = ended
    assert (m, t, c, s, r, transport) == (method, target, code, sent, rcvd, "shm"), ended
    assert 0 < duration < WAIT_S, ended


def test_off_by_default_nothing_is_recorded(echo: SimpleNamespace) -> None:
    drain()
    echo.stub.Unary(echo.pb2.EchoRequest(payload=b"x" * 64), timeout=20)
    assert _core._take_call_stats(200) == ([], 0)


def test_unary_call_both_sides_with_exact_bytes(echo: SimpleNamespace, records: Records) -> None:
    req = echo.pb2.EchoRequest(payload=payload.make(1, 64))
    resp = echo.stub.Unary(req, timeout=20)
    assert size(req) == 66
    got = records.calls(1, UNARY)
    check_pair(got[CLIENT_STARTED][0], got[CLIENT_ENDED][0], UNARY, OK, size(req), size(resp))
    check_pair(got[SERVER_STARTED][0], got[SERVER_ENDED][0], UNARY, OK, size(resp), size(req))
    # Started before ended, on each side.
    order = [r[0] for r in records.all]
    assert order.index(CLIENT_STARTED) < order.index(CLIENT_ENDED)
    assert order.index(SERVER_STARTED) < order.index(SERVER_ENDED)


def test_streaming_call_sums_every_message(echo: SimpleNamespace, records: Records) -> None:
    reqs = [echo.pb2.EchoRequest(payload=payload.make(10 + i, n), response_count=2)
            for i, n in enumerate([1, 5000, 100, 9000])]  # eager and rendezvous alike
    resps = list(echo.stub.Bidi(iter(reqs), timeout=20))
    assert len(resps) == 2 * len(reqs)
    sent, rcvd = sum(map(size, reqs)), sum(map(size, resps))
    got = records.calls(1, BIDI)
    check_pair(got[CLIENT_STARTED][0], got[CLIENT_ENDED][0], BIDI, OK, sent, rcvd)
    check_pair(got[SERVER_STARTED][0], got[SERVER_ENDED][0], BIDI, OK, rcvd, sent)


def test_large_messages_count_exactly(echo: SimpleNamespace, records: Records) -> None:
    # 8 MiB each way: rendezvous, handed over as views of the sender's pool on shm.
    req = echo.pb2.EchoRequest(payload=payload.make(3, 8 * MiB), response_size=8 * MiB,
                               response_seed=4)
    resp = echo.stub.Unary(req, timeout=60)
    assert len(resp.payload) == 8 * MiB
    got = records.calls(1, UNARY)
    check_pair(got[CLIENT_STARTED][0], got[CLIENT_ENDED][0], UNARY, OK, size(req), size(resp))
    check_pair(got[SERVER_STARTED][0], got[SERVER_ENDED][0], UNARY, OK, size(resp), size(req))


def test_aborted_call_carries_the_code_on_both_sides(echo: SimpleNamespace,
                                                     records: Records) -> None:
    req = echo.pb2.EchoRequest(payload=b"no", abort_code=PERMISSION_DENIED, abort_details="no")
    with pytest.raises(grpc.RpcError) as err:
        echo.stub.Unary(req, timeout=20)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    got = records.calls(1, UNARY)
    check_pair(got[CLIENT_STARTED][0], got[CLIENT_ENDED][0], UNARY, PERMISSION_DENIED, size(req), 0)
    check_pair(got[SERVER_STARTED][0], got[SERVER_ENDED][0], UNARY, PERMISSION_DENIED, 0, size(req))


def test_deadline_exceeded_on_the_client(echo: SimpleNamespace, records: Records) -> None:
    req = echo.pb2.EchoRequest(payload=b"slow", sleep_ms=1500)
    with pytest.raises(grpc.RpcError) as err:
        echo.stub.Unary(req, timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    got = records.calls(1, UNARY)
    check_pair(got[CLIENT_STARTED][0], got[CLIENT_ENDED][0], UNARY, DEADLINE_EXCEEDED,
               size(req), 0)
    assert 0.15 < got[CLIENT_ENDED][0][4] < 1.4, got[CLIENT_ENDED]
    # The server's own deadline and the client's RST race: either ends it.
    server_end = got[SERVER_ENDED][0]
    assert server_end[3] in (DEADLINE_EXCEEDED, CANCELLED), server_end
    assert server_end[5:7] == (0, size(req)), server_end


def test_cancelled_call_is_cancelled_on_both_sides(echo: SimpleNamespace,
                                                   records: Records) -> None:
    req = echo.pb2.EchoRequest(payload=b"wait", wait_for_cancel=True, wait_limit_ms=20000,
                               tag="cancel-me")
    fut = echo.stub.Unary.future(req, timeout=30)
    records.take(lambda: bool(records.of(SERVER_STARTED, UNARY)))
    time.sleep(0.1)  # the handler is waiting
    assert fut.cancel()
    got = records.calls(1, UNARY)
    check_pair(got[CLIENT_STARTED][0], got[CLIENT_ENDED][0], UNARY, CANCELLED, size(req), 0)
    check_pair(got[SERVER_STARTED][0], got[SERVER_ENDED][0], UNARY, CANCELLED, 0, size(req))


def test_every_call_ends_once_under_concurrency(echo: SimpleNamespace, records: Records) -> None:
    # Ends decided by trailers, deadlines and cancels at once, on one connection. A call
    # cancelled at once may never reach the server: only whole pairs are asserted there.
    def one(i: int) -> None:
        req = echo.pb2.EchoRequest(payload=payload.make(i, 10 + i), sleep_ms=(i % 3) * 20)
        try:
            if i % 4 == 3:
                echo.stub.Unary.future(req, timeout=5).cancel()
            else:
                echo.stub.Unary(req, timeout=0.03 if i % 4 == 2 else 20)
        except grpc.RpcError:
            pass

    threads = [threading.Thread(target=one, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)

    def settled() -> bool:
        return (len(records.of(CLIENT_ENDED, UNARY)) >= 40
                and len(records.of(SERVER_ENDED, UNARY)) == len(records.of(SERVER_STARTED, UNARY)))

    records.take(settled)
    time.sleep(0.5)  # anything recorded twice would come by now
    records.take(lambda: False, timeout=0.2)
    assert len(records.of(CLIENT_STARTED, UNARY)) == len(records.of(CLIENT_ENDED, UNARY)) == 40
    server_started = len(records.of(SERVER_STARTED, UNARY))
    assert 20 <= server_started == len(records.of(SERVER_ENDED, UNARY)), records.all
    assert not records.dropped
    assert {r[3] for r in records.of(CLIENT_ENDED)} <= {OK, CANCELLED, DEADLINE_EXCEEDED}


def test_asyncio_client_calls_are_recorded(echo: SimpleNamespace, records: Records,
                                           pb: SimpleNamespace) -> None:
    # argrpc.aio starts unary calls in one step (start_unary_watched) and streams with
    # start_watched: both are client starts like the blocking ones.
    import asyncio

    import argrpc.aio

    req = echo.pb2.EchoRequest(payload=payload.make(5, 64))
    reqs = [echo.pb2.EchoRequest(payload=payload.make(6, 300)),
            echo.pb2.EchoRequest(payload=payload.make(7, 20000))]

    async def run() -> tuple[Any, list[Any], str]:
        async with argrpc.aio.insecure_channel(f"127.0.0.1:{echo.port}",
                                               options=UNLIMITED) as ch:
            stub = pb.pb2_grpc.EchoStub(ch)
            resp = await stub.Unary(req, timeout=20)
            call = stub.Bidi(iter(reqs), timeout=20)
            resps = [r async for r in call]
            return resp, resps, ch.transport

    resp, resps, transport = asyncio.run(run())
    assert transport == "shm"
    got = records.calls(1, UNARY)
    check_pair(got[CLIENT_STARTED][0], got[CLIENT_ENDED][0], UNARY, OK, size(req), size(resp))
    got = records.calls(1, BIDI)
    check_pair(got[CLIENT_STARTED][0], got[CLIENT_ENDED][0], BIDI, OK, sum(map(size, reqs)),
               sum(map(size, resps)))


def test_stats_target_labels_client_records(echo: SimpleNamespace, records: Records) -> None:
    conn = echo.channel._fast
    assert isinstance(conn, _core.Connection)
    conn.set_stats_target("dns:///echo.example:443")
    try:
        req = echo.pb2.EchoRequest(payload=b"labelled")
        echo.stub.Unary(req, timeout=20)
        got = records.calls(1, UNARY)
        assert got[CLIENT_STARTED][0][2] == got[CLIENT_ENDED][0][2] == "dns:///echo.example:443"
        assert got[SERVER_STARTED][0][2] == got[SERVER_ENDED][0][2] == ""
    finally:
        conn.set_stats_target(f"127.0.0.1:{echo.port}")  # what the channel had set


def test_switching_off_keeps_the_started_calls_whole(echo: SimpleNamespace,
                                                     records: Records) -> None:
    req = echo.pb2.EchoRequest(payload=b"half", sleep_ms=300)
    fut = echo.stub.Unary.future(req, timeout=20)
    records.take(lambda: bool(records.of(SERVER_STARTED, UNARY)))
    _core.set_call_stats(False)
    fut.result()
    echo.stub.Unary(echo.pb2.EchoRequest(payload=b"unrecorded"), timeout=20)
    got = records.calls(1, UNARY)
    records.take(lambda: False, timeout=0.3)
    assert len(records.all) == 4, records.all
    assert got[CLIENT_ENDED][0][5] == size(req)


def test_records_beyond_the_bound_are_counted_as_dropped(echo: SimpleNamespace,
                                                         records: Records) -> None:
    old = _core._call_stats_bound_for_test(3)
    try:
        assert old == 65536
        echo.stub.Unary(echo.pb2.EchoRequest(payload=b"a"), timeout=20)
        echo.stub.Unary(echo.pb2.EchoRequest(payload=b"b"), timeout=20)
        records.take(lambda: len(records.all) + records.dropped >= 8)
        assert len(records.all) == 3 and records.dropped == 5, (records.all, records.dropped)
        # Reset by the take that reported them.
        assert _core._take_call_stats(0) == ([], 0)
    finally:
        _core._call_stats_bound_for_test(old)


def test_forked_child_starts_with_an_empty_queue(stubs_dir: str) -> None:
    script = textwrap.dedent(f"""
        import json, os, sys
        from concurrent import futures
        import argrpc
        from argrpc import _core
        from tests.support import stubs
        from tests.support.servicer import EchoServicer
        pb2, pb2_grpc = stubs.load({stubs_dir!r})
        server = argrpc.server(futures.ThreadPoolExecutor(4))
        pb2_grpc.add_EchoServicer_to_server(EchoServicer(pb2), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        _core.set_call_stats(True)

        def call():
            with argrpc.insecure_channel(f"127.0.0.1:{{port}}") as ch:
                pb2_grpc.EchoStub(ch).Unary(pb2.EchoRequest(payload=b"x"), timeout=30,
                                            wait_for_ready=True)
                return ch.transport

        def take(n):
            got = []
            for _ in range(200):
                got += _core._take_call_stats(50)[0]
                if len(got) >= n:
                    break
            return [(r[0], r[1]) for r in got]

        transport = call()  # four records queued, not taken
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            first = _core._take_call_stats(0)
            own_transport = call()  # the child's own client call; its server is the parent's
            own = take(2)
            os.write(w, json.dumps({{"first": first, "own": own,
                                    "transport": own_transport}}).encode())
            os._exit(0)
        os.close(w)
        child = json.loads(os.fdopen(r).read())
        os.waitpid(pid, 0)
        parent = take(6)
        print("RESULT " + json.dumps({{"transport": transport, "child": child,
                                       "parent": parent}}))
        sys.stdout.flush()
        os._exit(0)
    """)
    proc = run_python(script)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["transport"] == "shm"
    assert res["child"]["first"] == [[], 0]
    assert res["child"]["transport"] == "shm"
    assert sorted(res["child"]["own"]) == [[CLIENT_STARTED, UNARY], [CLIENT_ENDED, UNARY]]
    # The parent keeps its own four, and has the server side of the child's call.
    assert sorted(res["parent"]) == sorted(
        [[k, UNARY] for k in (CLIENT_STARTED, CLIENT_ENDED, SERVER_STARTED, SERVER_ENDED)]
        + [[SERVER_STARTED, UNARY], [SERVER_ENDED, UNARY]])
