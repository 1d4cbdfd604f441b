"""Back-pressure of the sender's registered pool (TF_RDMA_BUF_SIZE) on the shm path.

A large message (> TF_RDMA_ACC_SIZE) is copied into a block of the SENDER's pool and
pulled by the receiver; the block returns when the receiver is done with it. A message of
at least TF_RDMA_ZERO_COPY_MIN (1M) is handed to the receiver's deserializer as a view of
that block (at most 1/4 of the sender's pool per connection; beyond that it is copied), so
a handler that keeps the view keeps the sender's block in use. When the pool is full a
sender waits for room within the call's deadline, then fails RESOURCE_EXHAUSTED naming
TF_RDMA_BUF_SIZE; a message larger than the whole pool fails at once. Never truncated or
corrupt: every request below is checked with a sha256 computed by the server handler.

The pool is process-wide and read from the environment once, so the client side runs in
its own interpreter with TF_RDMA_BUF_SIZE=64M (the minimum) and prints one RESULT line.
The server is an ordinary argrpc echo server (tests.support.servicer.hold_handler).
"""
from __future__ import annotations

from typing import Any

import grpc
import pytest

from tests.support.clients import UNLIMITED_SERVER_ARGS
from tests.support.procs import script_result

MiB = 1 << 20
POOL = 64 * MiB

# Client side of every case, in a fresh interpreter. ECHO_CASE picks the scenario.
CLIENT_SCRIPT = r"""
import hashlib, json, os, sys, threading, time, traceback
from concurrent.futures import ThreadPoolExecutor
import grpc, argrpc
from argrpc import _engine
from tests.support import payload, stubs

MiB = 1 << 20
TARGET = os.environ["ECHO_TARGET"]
CASE = os.environ["ECHO_CASE"]
# Each channel a connection of its own: each lends the server its own share of the pool.
OPTS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1),
        ("grpc.use_local_subchannel_pool", 1)]
HOLD = "/argrpc.test.Hold/Digest"
pb2, pb2_grpc = stubs.load(os.environ["ECHO_STUBS"])
out = {"case": CASE}


class Chan:
    def __init__(self):
        self.ch = argrpc.insecure_channel(TARGET, options=OPTS)
        self.hold = self.ch.unary_unary(HOLD, request_serializer=lambda b: b,
                                        response_deserializer=json.loads)
        self.echo = pb2_grpc.EchoStub(self.ch)
        self.hold(b"warm-up", timeout=60, wait_for_ready=True)

    def transport(self):
        return [self.ch.transport, self.ch.fallback_reason]


def stats():
    return _engine.peek_engine().pool_stats()


def poll(pred, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = stats()
        if pred(s):
            return s
        time.sleep(0.02)
    return stats()


def hold_call(chan, seed, size, timeout, md=()):
    data = payload.make(seed, size)
    try:
        r = chan.hold(data, metadata=list(md), timeout=timeout)
    except grpc.RpcError as e:
        return {"code": e.code().name, "details": e.details()}
    return {"code": "OK", "exact": r["sha256"] == hashlib.sha256(data).hexdigest()
            and r["size"] == size, "size": r["size"], "released": r["released"]}


def echo_call(chan, seed, size, timeout):
    data = payload.make(seed, size)
    try:
        r = chan.echo.Unary(pb2.EchoRequest(payload=data, digest_only=True), timeout=timeout)
    except grpc.RpcError as e:
        return {"code": e.code().name, "details": e.details()}
    return {"code": "OK", "exact": r.digest == payload.sha256(data) and r.size == size,
            "size": r.size}


def stream_call(chan, seed, size, timeout):
    # The request waits for pool room on the thread that sends the requests, not the one
    # that waits for the call's end.
    data = payload.make(seed, size)
    reqs = iter([pb2.EchoRequest(payload=data)])
    try:
        chan.echo.ClientStream(reqs, timeout=timeout)
    except grpc.RpcError as e:
        return {"code": e.code().name, "details": e.details()}
    return {"code": "OK"}


def bidi_call(chan, seed, size, timeout):
    # The responses are read while the requests' thread waits for pool room.
    data = payload.make(seed, size)
    call = chan.echo.Bidi(iter([pb2.EchoRequest(payload=data)]), timeout=timeout)
    try:
        for _ in call:
            pass
    except grpc.RpcError as e:
        return {"code": e.code().name, "details": e.details()}
    return {"code": "OK"}


def release(chan, tag):
    return chan.hold(b"", metadata=[("x-release", tag)], timeout=60)


def fill_pool(tag, nchan=4, size=16 * MiB):
    # Each channel lends at most 1/4 of the pool as a view, so four channels each with one
    # held 16 MiB view keep the whole 64 MiB pool in use.
    chans = [Chan() for _ in range(nchan)]
    ex = ThreadPoolExecutor(nchan + 2)
    md = [("x-hold-ms", "120000"), ("x-hold-tag", tag)]
    holders = [ex.submit(hold_call, c, 100 + i, size, 150, md) for i, c in enumerate(chans)]
    out["full"] = poll(lambda s: s["in_use"] >= s["capacity"])
    return chans, ex, holders


try:
    out["capacity"] = None
    if CASE == "concurrent":
        chan = Chan()
        out["capacity"] = stats()["capacity"]
        peak = {"in_use": 0, "waiters": 0}
        stop = threading.Event()

        def monitor():
            while not stop.is_set():
                s = stats()
                peak["in_use"] = max(peak["in_use"], s["in_use"])
                peak["waiters"] = max(peak["waiters"], s["waiters"])
                time.sleep(0.002)

        mon = threading.Thread(target=monitor)
        mon.start()

        def worker(i):
            size = 20 * MiB + 4096 * i + i  # distinct, not page-aligned
            # raw buffer (the server keeps a view while hashing) and protobuf
            return [hold_call(chan, i, size, 120, [("x-hold-ms", "50")]),
                    echo_call(chan, 1000 + i, size, 120)]

        with ThreadPoolExecutor(8) as ex:
            out["results"] = [r for rs in ex.map(worker, range(8)) for r in rs]
        stop.set()
        mon.join()
        out["peak"] = peak
        out["transport"] = chan.transport()
        out["after"] = poll(lambda s: s["in_use"] == 0)
    elif CASE == "wait_then_ok":
        chans, ex, holders = fill_pool("wait")
        waiter = Chan()
        out["capacity"] = stats()["capacity"]
        blocked = ex.submit(hold_call, waiter, 7, 16 * MiB, 120)
        out["waiting"] = poll(lambda s: s["waiters"] >= 1)
        out["blocked_done_before_release"] = blocked.done()
        out["release"] = release(waiter, "wait")
        out["blocked"] = blocked.result()
        out["holders"] = [h.result() for h in holders]
        out["after"] = poll(lambda s: s["in_use"] == 0)
        out["transport"] = [c.transport() for c in chans + [waiter]]
    elif CASE == "deadline":
        chans, ex, holders = fill_pool("deadline")
        late = Chan()
        out["capacity"] = stats()["capacity"]
        out["blocked"] = hold_call(late, 7, 16 * MiB, 1.0)
        out["blocked_echo"] = echo_call(late, 8, 4 * MiB, 1.0)
        out["blocked_stream"] = stream_call(late, 12, 16 * MiB, 1.0)
        out["blocked_bidi"] = bidi_call(late, 13, 16 * MiB, 1.0)
        out["holders_done_before_release"] = [h.done() for h in holders]
        out["release"] = release(late, "deadline")
        out["holders"] = [h.result() for h in holders]
        out["freed"] = poll(lambda s: s["in_use"] == 0)
        out["later"] = [hold_call(late, 9, 16 * MiB, 60), echo_call(late, 10, 20 * MiB, 60),
                        hold_call(chans[0], 11, 30 * MiB, 60)]
        out["after"] = poll(lambda s: s["in_use"] == 0)
        out["transport"] = [c.transport() for c in chans + [late]]
    elif CASE == "too_big":
        chan = Chan()
        out["capacity"] = stats()["capacity"]
        out["raw"] = hold_call(chan, 1, 80 * MiB, 60)
        out["proto"] = echo_call(chan, 2, 80 * MiB, 60)
        out["later"] = [hold_call(chan, 3, 20 * MiB, 60), echo_call(chan, 4, 48 * MiB, 60),
                        hold_call(chan, 5, 100, 60)]
        out["after"] = poll(lambda s: s["in_use"] == 0)
        out["transport"] = chan.transport()
    else:
        out["error"] = f"unknown case {CASE}"
except Exception:
    out["error"] = traceback.format_exc()
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)  # held/blocked calls are all finished; skip slow interpreter teardown
"""


def _run(case: str, target: str, stubs_dir: str) -> dict[str, Any]:
    result = script_result(CLIENT_SCRIPT, {"ECHO_CASE": case, "ECHO_TARGET": target,
                                           "ECHO_STUBS": stubs_dir, "TF_RDMA_BUF_SIZE": "64M"})
    assert result["capacity"] == POOL, result
    return result


@pytest.fixture
def target(servers: Any) -> str:
    # An argrpc server with the default pool (1G) and unlimited message sizes; the hold
    # handler needs one worker per held call plus one for the release call.
    return servers.get("argrpc", UNLIMITED_SERVER_ARGS + ("--workers", "12")).target


def _assert_shm(transports: Any) -> None:
    for transport, reason in (transports if isinstance(transports[0], list) else [transports]):
        assert transport == "shm", f"expected the shm fast path, got {transport}: {reason}"


def _assert_exact(result: dict[str, Any], size: int | None = None) -> None:
    assert result["code"] == "OK", result
    assert result["exact"], f"payload corrupted in transit: {result}"
    if size is not None:
        assert result["size"] == size, result


def _assert_pool_error(result: dict[str, Any], allow_deadline: bool) -> None:
    codes = {"RESOURCE_EXHAUSTED"} | ({"DEADLINE_EXCEEDED"} if allow_deadline else set())
    assert result["code"] in codes, result
    if result["code"] == "RESOURCE_EXHAUSTED":
        assert "TF_RDMA_BUF_SIZE" in result["details"], result["details"]


def test_concurrent_large_calls_exceeding_pool_all_complete(target: str, stubs_dir: str) -> None:
    """8 threads x (20 MiB raw + 20 MiB protobuf) = 320 MiB through a 64 MiB pool."""
    r = _run("concurrent", target, stubs_dir)
    _assert_shm(r["transport"])
    assert len(r["results"]) == 16
    for res in r["results"]:
        _assert_exact(res)
    # The pool never held more than its capacity, and every block came back.
    assert r["peak"]["in_use"] <= POOL, r["peak"]
    assert r["after"]["in_use"] == 0 and r["after"]["waiters"] == 0, r["after"]


def test_full_pool_makes_sender_wait_then_succeed(target: str, stubs_dir: str) -> None:
    """Views held by the server fill the client's pool; a new large call waits (a pool
    waiter is seen) and completes byte-exact once the server drops the views."""
    r = _run("wait_then_ok", target, stubs_dir)
    _assert_shm(r["transport"])
    assert r["full"]["in_use"] == POOL, f"held views did not fill the pool: {r['full']}"
    assert r["waiting"]["waiters"] >= 1, f"no sender waited for pool room: {r['waiting']}"
    assert not r["blocked_done_before_release"], r["blocked"]
    _assert_exact(r["blocked"], 16 * MiB)
    for holder in r["holders"]:
        _assert_exact(holder, 16 * MiB)
        assert holder["released"], holder
    assert r["after"]["in_use"] == 0, r["after"]


def test_full_pool_until_deadline_fails_then_recovers(target: str, stubs_dir: str) -> None:
    """No room before the deadline: RESOURCE_EXHAUSTED naming TF_RDMA_BUF_SIZE (or
    DEADLINE_EXCEEDED), never a partial message; later calls succeed once the pool frees."""
    r = _run("deadline", target, stubs_dir)
    _assert_shm(r["transport"])
    assert r["full"]["in_use"] == POOL, f"held views did not fill the pool: {r['full']}"
    _assert_pool_error(r["blocked"], allow_deadline=True)
    _assert_pool_error(r["blocked_echo"], allow_deadline=True)
    # The thread that waits for the call's end (or its responses) is not the one that
    # waits for room: it leaves the end to the sender, which names the cause. The server
    # knows these calls (their HEADERS go out at once) and may end them first at the
    # same deadline, as grpc's would: DEADLINE_EXCEEDED, on a busy host mostly.
    _assert_pool_error(r["blocked_stream"], allow_deadline=True)
    _assert_pool_error(r["blocked_bidi"], allow_deadline=True)
    # The failed calls did not disturb the held ones: each still sees its exact request.
    assert r["holders_done_before_release"] == [False] * 4, r
    for holder in r["holders"]:
        _assert_exact(holder, 16 * MiB)
        assert holder["released"], holder
    assert r["freed"]["in_use"] == 0, r["freed"]
    sizes = [16 * MiB, 20 * MiB, 30 * MiB]
    for res, size in zip(r["later"], sizes):
        _assert_exact(res, size)
    assert r["after"]["in_use"] == 0, r["after"]


def test_message_larger_than_pool_fails_and_channel_survives(target: str, stubs_dir: str
                                                              ) -> None:
    """80 MiB through a 64 MiB pool: RESOURCE_EXHAUSTED at once, naming TF_RDMA_BUF_SIZE;
    the same channel keeps working (still shm) for large and small calls."""
    r = _run("too_big", target, stubs_dir)
    for res in (r["raw"], r["proto"]):
        assert res["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED.name, res
        assert "TF_RDMA_BUF_SIZE" in res["details"], res["details"]
    for res, size in zip(r["later"], [20 * MiB, 48 * MiB, 100]):
        _assert_exact(res, size)
    _assert_shm(r["transport"])
    assert r["after"]["in_use"] == 0, r["after"]


AHEAD_SERVER = r"""
import json, sys, time
from concurrent import futures
import grpc, argrpc
from argrpc import _engine
peak = {"peak_received": 0}
server = argrpc.server(futures.ThreadPoolExecutor(4), options=[
    ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
def echo(requests, context):
    for r in requests:
        time.sleep(0.5)  # the requests after this one arrive meanwhile
        peak["peak_received"] = max(peak["peak_received"],
                               _engine.peek_engine().pool_stats().get("received", 0))
        yield r
server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
    "h", {"Bidi": grpc.stream_stream_rpc_method_handler(echo)})])
print(server.add_insecure_port("127.0.0.1:0"), flush=True)
server.start()
sys.stdin.readline()
# The client has its last answer once the status came; the worker that sent it may still
# be unwinding its handler (which holds the last message): a leak outlasts the bound.
stats = _engine.peek_engine().pool_stats()
until = time.monotonic() + 10
while stats["in_use"] and time.monotonic() < until:
    time.sleep(0.01)
    stats = _engine.peek_engine().pool_stats()
print(json.dumps({**peak, **stats}), flush=True)
server.stop(None)
"""

AHEAD_CLIENT = r"""
import json, os, subprocess, sys
import grpc, argrpc
server = subprocess.Popen([sys.executable, "-c", os.environ["AHEAD_SERVER"]], text=True,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
port = int(server.stdout.readline())
out = {}
unlimited = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
with argrpc.insecure_channel(f"127.0.0.1:{port}", options=unlimited) as ch:
    sizes = [96 << 20] * 3
    try:
        got = []
        for m in ch.stream_stream("/h/Bidi")((bytes([i]) * n for i, n in enumerate(sizes)),
                                             timeout=120):
            got.append([len(m), m[0], m[-1]])
            del m
        out["code"], out["got"] = "OK", got
    except grpc.RpcError as e:
        out["code"], out["details"] = e.code().name, e.details()
    out["transport"] = [ch.transport, ch.fallback_reason]
server.stdin.write("stats\n")
server.stdin.flush()
out["server"] = json.loads(server.stdout.readline())
server.stdin.close()
server.wait(60)
print("RESULT " + json.dumps(out))
"""


def test_requests_received_ahead_leave_room_for_the_answer() -> None:
    """A bidi handler slower than its client, 96 MiB each way, through a 256 MiB pool:
    the requests after the one it answers arrive and are received ahead while its
    response waits for room in its own pool, which only the handler's next read frees.
    Received messages hold at most half the pool (the rest are received into heap
    memory), so the response finds room: every one arrives, byte-exact, on the fast path."""
    env = {"TF_RDMA_BUF_SIZE": "256M", "TF_RDMA_CHUNK_SIZE": "128M",
           "AHEAD_SERVER": AHEAD_SERVER}
    r = script_result(AHEAD_CLIENT, env, timeout=300)
    assert r["code"] == "OK", r
    assert r["got"] == [[96 * MiB, i, i] for i in range(3)]
    assert r["transport"][0] == "shm", r["transport"]
    assert 0 < r["server"]["peak_received"] <= 128 * MiB, r["server"]
    assert r["server"]["in_use"] == 0, r["server"]
