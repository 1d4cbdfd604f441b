"""kill -9 of a peer over shm, with real processes.

Server side: a client process dies while the server has a large message exposed to it,
mid-stream, inside a bidi call, mid-request or idle. The server keeps serving another
client byte-exact, and its pool, connection count and fds return to the baseline.

Client side: the server process dies while calls are in flight (a large held request, a
bidi stream, a streamed response) or while the channel is idle. Every in-flight call
ends UNAVAILABLE within DEAD_PEER_BOUND_S with a readable detail, the client's engine
lets go of the connection and its blocks, and the same channel works again once a
server is back on the port.

The same scenarios over verbs are in tests/verbs/test_faults_verbs.py.
"""
from __future__ import annotations

import signal
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable

import grpc
import pytest

from tests.support import payload
from tests.support.clients import UNLIMITED, UNLIMITED_SERVER_ARGS, make_channel
from tests.support.faults import Baseline, ClientProc, ShmClient
from tests.support.payload import MiB
from tests.support.procs import ServerProcess
from tests.support.servicer import HOLD_METHOD

DEAD_PEER_BOUND_S = 2.0   # in-flight calls end within this of the peer's death
SETTLE_S = 10.0           # the server's resources are back within this
ENV = {"TF_RDMA_BUF_SIZE": "512M"}

# mode -> (size, count, pause, line that shows the client is where it should be killed)
CLIENT_STATES = {
    "hold": (64 * MiB, 1, False, "GOT"),          # zero-copy view of the server's block
    "response": (32 * MiB, 8, True, "GOT"),       # streamed, the client stopped reading
    "bidi": (0, 1, False, "GOT"),
    "request": (256 * MiB, 1, False, "SENDING"),  # somewhere in a 256 MiB request
    "idle": (0, 1, False, "DONE"),
}


@pytest.fixture
def server(spawn: Callable[..., ServerProcess]) -> ServerProcess:
    return spawn("argrpc", UNLIMITED_SERVER_ARGS, ENV)


@pytest.mark.parametrize("mode", list(CLIENT_STATES))
def test_client_killed_server_serves_and_frees(mode: str, server: ServerProcess,
                                               stubs_dir: str, pb: SimpleNamespace) -> None:
    other = ShmClient(server.target, pb)
    victim = None
    try:
        other.echo(payload.CHUNK_SIZE + 1, 1, both_ways=True)  # the server's pool exists before the baseline
        base = Baseline(server)
        size, count, pause, marker = CLIENT_STATES[mode]
        victim = ClientProc(server.target, stubs_dir, mode, size, ENV, count, pause)
        assert victim.ready_transport(60) == "shm", victim.stderr_tail()
        assert victim.wait_line(marker, 120), f"{victim.lines} {victim.stderr_tail()}"
        assert victim.proc.poll() is None, victim.lines
        victim.kill()

        other.echo(2 * payload.CHUNK_SIZE + 5, 2, both_ways=True)
        problems, took = base.problems(SETTLE_S)
        assert not problems, f"after kill -9 of a client ({mode}), within {took:.1f}s: {problems}"
        other.echo(3, 3, both_ways=True)
        assert server.alive()
    finally:
        if victim is not None:
            victim.kill()
        other.channel.close()


def _client_engine() -> Any:
    from argrpc import _engine
    return _engine.peek_engine()


def _in_flight(stub: Any, pb2: Any, kind: str, channel: Any) -> Callable[[], Any]:
    """Starts a call of `kind`; returns a function that waits for its end and gives
    (code, details)."""
    if kind == "held_request":
        fut = channel.unary_unary(HOLD_METHOD, request_serializer=None,
                                  response_deserializer=None).future(
            payload.make(4, 256 * MiB), timeout=120, metadata=(("x-hold-ms", "60000"),))
    elif kind == "bidi":
        gate = threading.Event()

        def requests() -> Any:
            yield pb2.EchoRequest(payload=b"x" * 100)
            gate.wait(120)

        fut = stub.Bidi(requests(), timeout=120)
        next(fut)
    else:  # streamed responses, 32 MiB each, the first one received
        fut = stub.ServerStream(pb2.EchoRequest(response_count=100, response_size=32 * MiB,
                                                response_seed=5, sleep_ms=200), timeout=120)
        next(fut)

    def outcome() -> tuple[Any, str]:
        try:
            if kind == "held_request":
                fut.result(timeout=60)
            else:
                for _ in fut:
                    pass
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
    return outcome


def _warm_channel(server: ServerProcess, pb: SimpleNamespace) -> tuple[Any, Any]:
    """An argrpc channel to `server` that has made one call over shm, and its stub."""
    channel = make_channel("argrpc", server.target, UNLIMITED)
    stub = pb.pb2_grpc.EchoStub(channel)
    assert stub.Unary(pb.pb2.EchoRequest(payload=b"w"), timeout=30,
                      wait_for_ready=True).payload == b"w"
    assert channel.transport == "shm", channel.fallback_reason
    return channel, stub


def test_server_killed_calls_end_and_channel_recovers(spawn: Callable[..., ServerProcess],
                                                      pb: SimpleNamespace) -> None:
    server = spawn("argrpc", UNLIMITED_SERVER_ARGS, ENV)
    channel, stub = _warm_channel(server, pb)
    try:
        kinds = ["held_request", "bidi", "stream"]
        waits = [_in_flight(stub, pb.pb2, k, channel) for k in kinds]
        time.sleep(0.5)  # the held request is with the server's handler by now
        results: dict[str, Any] = {}
        threads = [threading.Thread(target=lambda k=k, w=w: results.__setitem__(
            k, (*w(), time.monotonic())), daemon=True) for k, w in zip(kinds, waits)]
        for t in threads:
            t.start()
        port = server.port
        server.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        server.proc.wait(timeout=30)
        for t in threads:
            t.join(DEAD_PEER_BOUND_S + 30)
        for kind in kinds:
            assert kind in results, f"{kind}: the call did not end after kill -9 of the server"
            code, details, end = results[kind]
            assert code == grpc.StatusCode.UNAVAILABLE, (kind, code, details)
            assert len(details) >= 8, (kind, details)
            assert end - killed <= DEAD_PEER_BOUND_S, f"{kind}: {end - killed:.2f}s ({details})"

        engine = _client_engine()
        deadline = time.monotonic() + SETTLE_S
        while (engine.connection_count or engine.pool_stats()["in_use"]) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.connection_count == 0
        assert engine.pool_stats()["in_use"] == 0, engine.pool_stats()

        again = spawn("argrpc", (*UNLIMITED_SERVER_ARGS, "--port", str(port)), ENV)
        body = payload.make(6, 3 * payload.CHUNK_SIZE + 7)
        resp = stub.Unary(pb.pb2.EchoRequest(payload=body), timeout=60, wait_for_ready=True)
        assert payload.sha256(resp.payload) == payload.sha256(body)
        assert channel.transport == "shm", channel.fallback_reason
        again.kill()
    finally:
        channel.close()
        server.kill()


def test_server_killed_while_idle_next_call_recovers(spawn: Callable[..., ServerProcess],
                                                     pb: SimpleNamespace) -> None:
    server = spawn("argrpc", UNLIMITED_SERVER_ARGS, ENV)
    channel, stub = _warm_channel(server, pb)
    try:
        port = server.port
        server.kill()
        engine = _client_engine()
        deadline = time.monotonic() + DEAD_PEER_BOUND_S
        while engine.connection_count and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.connection_count == 0, "the idle connection outlived its dead peer"
        again = spawn("argrpc", (*UNLIMITED_SERVER_ARGS, "--port", str(port)), ENV)
        resp = stub.Unary(pb.pb2.EchoRequest(payload=b"back"), timeout=60, wait_for_ready=True)
        assert resp.payload == b"back"
        assert channel.transport == "shm", channel.fallback_reason
        again.kill()
    finally:
        channel.close()
        server.kill()


KEEPALIVE_TIMEOUT_S = 10.0  # ConnConfig::keepalive_timeout_ms (csrc/engine_config.h)


def test_hung_server_fails_calls_after_the_keepalive_timeout(
        spawn: Callable[..., ServerProcess], pb: SimpleNamespace) -> None:
    """A stopped server's socket stays open, so only an unanswered PING can tell: the call
    ends UNAVAILABLE naming the keepalive, long before its own deadline."""
    server = spawn("argrpc", UNLIMITED_SERVER_ARGS, ENV)
    channel, stub = _warm_channel(server, pb)
    try:
        future = stub.Unary.future(pb.pb2.EchoRequest(payload=b"x", sleep_ms=1000), timeout=120)
        time.sleep(0.3)  # with the handler
        server.proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            future.result(timeout=60)
        took = time.monotonic() - stopped
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
        assert "did not answer a keepalive" in info.value.details(), info.value.details()
        assert KEEPALIVE_TIMEOUT_S <= took <= KEEPALIVE_TIMEOUT_S + 5, took
    finally:
        server.proc.send_signal(signal.SIGCONT)
        channel.close()
        server.kill()


def test_a_loop_sending_into_a_stopped_peers_full_ring_holds_up_no_other_thread(
        spawn: Callable[..., ServerProcess], pb: SimpleNamespace) -> None:
    """An asyncio client's small sends keep the GIL (they return at once); when the
    peer stops reading and its ring fills, the send waits for ring credits, and lets
    the GIL go first: the process's other threads run on through that wait, and the
    calls end once the peer reads again."""
    import asyncio

    import argrpc.aio

    server = spawn("argrpc", UNLIMITED_SERVER_ARGS, ENV)
    ticks: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.001)

    async def body() -> tuple[str, float, float, list[Any]]:
        async with argrpc.aio.insecure_channel(server.target) as channel:
            stub = pb.pb2_grpc.EchoStub(channel)
            await stub.Unary(pb.pb2.EchoRequest(payload=b"w"), timeout=30)
            transport = channel.transport
            server.proc.send_signal(signal.SIGSTOP)
            resume = threading.Timer(2.0, server.proc.send_signal, (signal.SIGCONT,))
            resume.start()
            # Each call's request goes out as the call is made: eager 8,000-byte
            # messages, 2.4 MB against the peer's 1 MiB ring.
            start = time.monotonic()
            calls = [stub.Unary(pb.pb2.EchoRequest(payload=bytes(8000)), timeout=60)
                     for _ in range(300)]
            made = time.monotonic()
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            resume.join()
            return transport, start, made, outcomes

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        transport, start, made, outcomes = asyncio.run(asyncio.wait_for(body(), 60))
    finally:
        done.set()
        ticker.join()
        server.proc.send_signal(signal.SIGCONT)
        server.kill()
    assert transport == "shm"
    assert made - start >= 1.0, "the ring never filled: the sends did not wait"
    during = [t for t in ticks if start <= t <= made]
    gaps = [b - a for a, b in zip(during, during[1:])]
    assert len(during) > 10 and max(gaps) < 1.0, (len(during), max(gaps, default=None))
    assert all(not isinstance(o, BaseException) and len(o.payload) == 8000 for o in outcomes), \
        [o for o in outcomes if isinstance(o, BaseException)][:3]


def test_slow_handler_outlives_the_keepalive_timeout(spawn: Callable[..., ServerProcess],
                                                     pb: SimpleNamespace) -> None:
    """A live peer answers every PING from its engine thread, however long the handler
    takes: a call longer than the keepalive timeout is not mistaken for a dead peer."""
    server = spawn("argrpc", UNLIMITED_SERVER_ARGS, ENV)
    channel, stub = _warm_channel(server, pb)
    try:
        sleep_s = KEEPALIVE_TIMEOUT_S + 3
        resp = stub.Unary(pb.pb2.EchoRequest(payload=b"slow", sleep_ms=int(sleep_s * 1000)),
                          timeout=sleep_s + 30)
        assert resp.payload == b"slow"
        assert channel.transport == "shm", channel.fallback_reason
        assert _client_engine().connection_count == 1
    finally:
        channel.close()
        server.kill()
