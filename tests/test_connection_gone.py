"""A connection that is gone between the channel's choice of it and its use.

A channel picks its fast connection (``_fast``, checked ``alive``) and then starts the
call on it. In between, another thread may close the channel, or the engine may fail
the connection (its peer died) and drop it: the handle the channel picked then holds
nothing. Such a call must end like any call on a dead connection, with a gRPC status
(UNAVAILABLE and why; CANCELLED "Channel closed!" when the channel was closed), never a
bare exception: code written for grpc catches ``grpc.RpcError`` only.

The interleaving is forced with the fail point ``route`` (``Connection._probe_fail_at``):
the next call started through that handle finds its connection failed and released by
every holder first. It is tested on the engine's own calls over the sim fabric, on every
API of both front ends over shared memory, and at random moments with real threads
closing a channel while others call through it (grpc's pair is the oracle there).
"""
from __future__ import annotations

import asyncio
import random
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import grpc
import pytest

from argrpc import _core as core
from tests.support import payload
from tests.support.clients import UNLIMITED, UNLIMITED_SERVER_ARGS, make_channel
from tests.support.procs import ServerProcess
from tests.test_sim_fabric import rig, sim_pair  # noqa: F401 - rig is a fixture
from tests.support.hooks import needs_test_hooks

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
CANCELLED = grpc.StatusCode.CANCELLED.value[0]
FAIL_POINT = "test fail point"
ECHO = "/sim.Test/Echo"
ROUNDS = 40                 # channels closed under calls at random moments, per stack
HANG_S = 60.0               # "does not hang"


# ------------------------------------------------------------------ sim fabric, engine

@pytest.fixture
def sim(rig: SimpleNamespace) -> Iterator[SimpleNamespace]:
    """A client connection of a sim pair whose server echoes."""
    with sim_pair(rig) as pair:
        yield pair


def _start(conn: Any, how: str) -> tuple[int, str]:
    """Starts a call of one kind on `conn` and returns how it ended."""
    if how == "unary":
        code, details, _, _, response = conn.unary(ECHO, [], 10.0, b"x" * 100)
        assert response is None
        return code, details
    if how == "start_call":
        call = conn.start_call(ECHO, [], 10.0)
        assert call.done() and not call.send(b"x") and call.recv() is None
        assert call.initial_metadata() is None and not call.cancel(CANCELLED, "no")
        code, details, _ = call.status(HANG_S)
        return code, details
    notifier = core.Notifier()
    if how == "start_watched":
        call = conn.start_watched(ECHO, [], 10.0, notifier, 7, True)
        assert call.try_send(b"x", True) == 0 and call.try_recv() is False
    else:
        call, sent = conn.start_unary_watched(ECHO, [], 10.0, notifier, 7, b"x")
        assert sent == 0
        assert call.try_unary()[:2] == call.try_status()[:2]
    # The loop learns of the end as of any other: the call's token is posted.
    assert notifier.drain() == [7]
    assert call.settled() and call.try_initial_metadata() is False
    code, details, _ = call.try_status()
    return code, details


STARTS = ("unary", "start_call", "start_watched", "start_unary_watched")


@needs_test_hooks
@pytest.mark.parametrize("how", STARTS)
def test_sim_call_on_a_connection_failed_and_dropped_after_the_route(
        sim: SimpleNamespace, how: str) -> None:
    code, _, _, _, _ = sim.client.unary(ECHO, [], 10.0, b"warm")
    assert code == 0
    sim.client._probe_fail_at("route")
    assert sim.client.alive  # armed, not yet fired: the route still sees it alive
    code, details = _start(sim.client, how)
    assert (code, FAIL_POINT in details) == (UNAVAILABLE, True), (code, details)
    assert not sim.client.alive and sim.client.error == details
    # Every later call on the handle ends the same way.
    assert _start(sim.client, how) == (code, details)


@needs_test_hooks
def test_sim_a_call_that_never_left_is_handed_back(sim: SimpleNamespace) -> None:
    """Asked to (retry_unsent), the engine hands back a call that ended UNAVAILABLE before
    its HEADERS were written, for the channel to start again elsewhere; a closed
    connection's calls end CANCELLED as before: a close is no reason to retry."""
    code, _, _, _, _ = sim.client.unary(ECHO, [], 10.0, b"warm", True)
    assert code == 0
    sim.client._probe_fail_at("route")
    assert sim.client.unary(ECHO, [], 10.0, b"x", True) is None
    assert sim.client.start_call(ECHO, [], 10.0, True) is None
    # Without the ask, the same end as before.
    assert sim.client.unary(ECHO, [], 10.0, b"x")[0] == UNAVAILABLE


@needs_test_hooks
def test_sim_a_closed_connections_calls_are_not_handed_back(sim: SimpleNamespace) -> None:
    sim.client.close()
    code, details, _, _, _ = sim.client.unary(ECHO, [], 10.0, b"x", True)
    assert (code, details) == (CANCELLED, "Channel closed!")
    call = sim.client.start_call(ECHO, [], 10.0, True)
    assert call is not None and call.done()


@needs_test_hooks
@pytest.mark.parametrize("how", STARTS)
def test_sim_call_on_a_connection_closed_by_another_thread(sim: SimpleNamespace,
                                                            how: str) -> None:
    code, _, _, _, _ = sim.client.unary(ECHO, [], 10.0, b"warm")
    assert code == 0
    closer = threading.Thread(target=sim.client.close)
    closer.start()
    closer.join()
    assert _start(sim.client, how) == (CANCELLED, "Channel closed!")


# ------------------------------------------------------------- shm, both front ends

@pytest.fixture(scope="module")
def server(stubs_dir: str) -> Iterator[ServerProcess]:
    srv = ServerProcess("argrpc", stubs_dir, UNLIMITED_SERVER_ARGS)
    yield srv
    srv.kill()


def _request(pb2: Any, size: int = 100) -> Any:
    return pb2.EchoRequest(payload=payload.make(3, size), response_count=2)


def _threaded_calls(stub: Any, pb2: Any) -> dict[str, Callable[[], Any]]:
    """Every way the threaded API hands a call's outcome over."""
    req = _request(pb2)
    return {
        "unary": lambda: stub.Unary(req, timeout=HANG_S),
        "unary.with_call": lambda: stub.Unary.with_call(req, timeout=HANG_S),
        "unary.future": lambda: stub.Unary.future(req, timeout=HANG_S).result(),
        "server_stream": lambda: list(stub.ServerStream(req, timeout=HANG_S)),
        "client_stream": lambda: stub.ClientStream(iter([req, req]), timeout=HANG_S),
        "client_stream.with_call": lambda: stub.ClientStream.with_call(iter([req]),
                                                                      timeout=HANG_S),
        "client_stream.future": lambda: stub.ClientStream.future(
            iter([req]), timeout=HANG_S).result(),
        "bidi": lambda: list(stub.Bidi(iter([req, req]), timeout=HANG_S)),
    }


THREADED = ("unary", "unary.with_call", "unary.future", "server_stream", "client_stream",
            "client_stream.with_call", "client_stream.future", "bidi")


# A call that never left is started again where the channel routes it next (gRFC A6's
# transparent retry); with grpc.enable_retries=0 it ends with the connection's end.
RETRIES = {"transparent": UNLIMITED, "off": UNLIMITED + [("grpc.enable_retries", 0)]}


@needs_test_hooks
@pytest.mark.parametrize("retries", RETRIES)
@pytest.mark.parametrize("api", THREADED)
def test_threaded_call_on_a_connection_dropped_after_the_route(
        api: str, retries: str, server: ServerProcess, pb: SimpleNamespace) -> None:
    channel = make_channel("argrpc", server.target, RETRIES[retries])
    try:
        stub = pb.pb2_grpc.EchoStub(channel)
        stub.Unary(_request(pb.pb2), timeout=HANG_S, wait_for_ready=True)
        assert channel.transport == "shm", channel.fallback_reason
        channel._fast._probe_fail_at("route")
        if retries == "transparent":
            assert _threaded_calls(stub, pb.pb2)[api]()
        else:
            with pytest.raises(grpc.RpcError) as info:
                _threaded_calls(stub, pb.pb2)[api]()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
            assert FAIL_POINT in info.value.details(), info.value.details()
        # The next call renegotiates and is on the fast path again.
        _threaded_calls(stub, pb.pb2)[api]()
        assert channel.transport == "shm", channel.fallback_reason
    finally:
        channel.close()


AIO = ("unary", "server_stream", "client_stream", "bidi")


async def _aio_call(stub: Any, pb2: Any, arity: str) -> Any:
    req = _request(pb2)
    if arity == "unary":
        return await stub.Unary(req, timeout=HANG_S)
    if arity == "server_stream":
        return [r async for r in stub.ServerStream(req, timeout=HANG_S)]
    if arity == "client_stream":
        return await stub.ClientStream(iter([req, req]), timeout=HANG_S)
    return [r async for r in stub.Bidi(iter([req, req]), timeout=HANG_S)]


@needs_test_hooks
@pytest.mark.parametrize("retries", RETRIES)
@pytest.mark.parametrize("arity", AIO)
def test_aio_call_on_a_connection_dropped_after_the_route(
        arity: str, retries: str, server: ServerProcess, pb: SimpleNamespace) -> None:
    from argrpc import aio

    async def main() -> None:
        async with aio.insecure_channel(server.target, options=RETRIES[retries]) as channel:
            stub = pb.pb2_grpc.EchoStub(channel)
            await stub.Unary(_request(pb.pb2), timeout=HANG_S, wait_for_ready=True)
            assert channel._fast is not None and channel._fast.alive
            channel._fast._probe_fail_at("route")
            if retries == "transparent":
                assert await asyncio.wait_for(_aio_call(stub, pb.pb2, arity), HANG_S)
            else:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await asyncio.wait_for(_aio_call(stub, pb.pb2, arity), HANG_S)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
                assert FAIL_POINT in info.value.details(), info.value.details()
            await asyncio.wait_for(_aio_call(stub, pb.pb2, arity), HANG_S)
            assert channel._fast is not None and channel._fast.alive

    asyncio.run(main())


# ------------------------------------------------- random moments, real threads, grpc

# grpc's own ends for a call whose channel another thread closes: the call in flight
# ends CANCELLED; one started after the close raises ValueError with one of these.
CLOSED_CHANNEL = ("Cannot invoke RPC: Channel closed!", "Cannot invoke RPC on closed channel!")


@pytest.mark.parametrize("stack", ["grpc", "argrpc"])
def test_channel_closed_by_another_thread_at_random_moments(
        stack: str, server: ServerProcess, pb: SimpleNamespace) -> None:
    """Threads call back to back, each API in turn; another thread closes the channel at
    a random moment. Every call ends as grpc's would: OK, an RpcError with a status, or
    grpc's ValueError for a call started on a closed channel."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    bad: list[str] = []
    for _ in range(ROUNDS):
        channel = make_channel(stack, server.target, UNLIMITED)
        stub = pb.pb2_grpc.EchoStub(channel)
        stub.Unary(_request(pb.pb2), timeout=HANG_S, wait_for_ready=True)
        calls = list(_threaded_calls(stub, pb.pb2).items())
        stop = threading.Event()

        def run(offset: int) -> None:
            i = offset
            while not stop.is_set():
                name, call = calls[i % len(calls)]
                i += 1
                try:
                    call()
                    what = "OK"
                except grpc.RpcError as e:
                    what = e.code().name
                except ValueError as e:
                    if str(e) not in CLOSED_CHANNEL:
                        bad.append(f"{name}: ValueError: {e}")
                    what = "closed"
                    stop.set()
                except Exception as e:  # noqa: BLE001 - what the test is for
                    bad.append(f"{name}: {type(e).__name__}: {e}")
                    what = "bare"
                    stop.set()
                outcomes[what] = outcomes.get(what, 0) + 1

        threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(2)]
        for t in threads:
            t.start()
        time.sleep(rng.uniform(0.0, 0.05))
        channel.close()
        for t in threads:
            t.join(HANG_S)
        stop.set()
        assert not any(t.is_alive() for t in threads), f"a call hung (seed {seed})"
    assert not bad, f"seed {seed}: {bad[:5]} ({outcomes})"
    assert outcomes.get("closed", 0) > 0, outcomes
