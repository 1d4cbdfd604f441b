"""The invariant behind "a dead peer never leaves a call waiting", tested at the points
where it is hardest to keep.

Invariant (``new_stream`` in csrc/engine/connection_streams.cc, ``fail`` in
csrc/engine/connection.cc): every stream of a connection is in the connection's registry
from its creation to its destruction; ``fail()`` first marks the connection dead, then
ends every registered stream that still runs and fails every message a stream was still
receiving; a stream created after the mark ends at birth. So whatever a call is doing when its connection fails, it ends
UNAVAILABLE at once, and once its last call is gone the connection's fds are too.

``Connection._probe_fail_at(point)`` makes the client's connection fail as if its peer
had hung up exactly there, the next time it gets there:

* ``submit``: a call's message is about to be sent, its stream not yet known by id;
* ``copy_in``: a large message was copied into the pool, the send lock not yet taken
  (a server killed there used to leave the call waiting for its whole deadline);
* ``register``: the stream was just given its id, before it checks the connection;
* ``flush``: a batch is about to be written;
* ``pull``: the first chunk of a large response arrived; the call's trailers may have
  arrived before it (a peer killed there used to leave the reader waiting, then the
  call ended OK without its response).

Randomly timed kills of real processes are in tests/test_chaos.py.
"""
from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Callable

import grpc
import pytest

from argrpc_bench.chaos import CONNECTION_FD_KINDS, snapshot
from tests.support import payload
from tests.support.clients import UNLIMITED_SERVER_ARGS
from tests.support.faults import ShmClient
from tests.support.procs import ServerProcess
from tests.support.hooks import needs_test_hooks

pytestmark = needs_test_hooks

BIG = 100 * 1024          # rendezvous (over TF_RDMA_ACC_SIZE), below the zero-copy minimum
BOUND_S = 2.0             # the failed call ends within this (it should be at once)
SETTLE_S = 5.0            # the dead connection's fds and blocks are gone within this

# point -> the arities where a call reaches it (pull: the client pulls the response)
POINTS = {
    "submit": ("unary", "server_stream", "client_stream", "bidi"),
    "copy_in": ("unary", "server_stream", "client_stream", "bidi"),
    "register": ("unary", "server_stream", "client_stream", "bidi"),
    "flush": ("unary", "server_stream", "client_stream", "bidi"),
    "pull": ("unary", "server_stream", "bidi"),
}
CASES = [(point, arity) for point, arities in POINTS.items() for arity in arities]


@pytest.fixture(scope="module")
def server(stubs_dir: str) -> Any:
    srv = ServerProcess("argrpc", stubs_dir, UNLIMITED_SERVER_ARGS)
    yield srv
    srv.kill()


def _call(stub: Any, pb2: Any, arity: str, size: int) -> Callable[[], Any]:
    """One call of `arity` whose request and responses are `size` bytes each."""
    def req() -> Any:
        return pb2.EchoRequest(payload=payload.make(5, size), response_size=size,
                               response_seed=9, response_count=2)

    if arity == "unary":
        return lambda: stub.Unary(req(), timeout=60)
    if arity == "server_stream":
        return lambda: list(stub.ServerStream(req(), timeout=60))
    if arity == "client_stream":
        return lambda: stub.ClientStream(iter([req(), req()]), timeout=60)
    return lambda: list(stub.Bidi(iter([req(), req()]), timeout=60))


def _engine() -> Any:
    from argrpc import _engine

    return _engine.peek_engine()


# Where the call has not left yet: its HEADERS were not encoded (a unary call's go with
# its request).
NOT_LEFT = [("submit", a) for a in POINTS["submit"]] + [("copy_in", "unary")]


@pytest.mark.parametrize("point,arity", NOT_LEFT, ids=[f"{p}-{a}" for p, a in NOT_LEFT])
def test_a_call_that_never_left_starts_again(point: str, arity: str, server: ServerProcess,
                                             pb: SimpleNamespace) -> None:
    """The connection fails before the call's HEADERS went out: the call starts again
    where the channel routes it now (gRFC A6's transparent retry) and succeeds."""
    client = ShmClient(server.target, pb)
    try:
        client.echo(10, 1)
        conn = client.connection()
        conn._probe_fail_at(point)
        _call(client.stub, pb.pb2, arity, BIG)()
        assert not conn.alive and "test fail point" in conn.error
        client.echo(BIG, 2, both_ways=True)
    finally:
        client.channel.close()


@pytest.mark.parametrize("point,arity", CASES, ids=[f"{p}-{a}" for p, a in CASES])
def test_failure_at_point_ends_the_call_and_frees_the_connection(
        point: str, arity: str, server: ServerProcess, pb: SimpleNamespace) -> None:
    # Transparent retries off: a call that never left would start again elsewhere
    # (test_a_call_that_never_left_starts_again).
    client = ShmClient(server.target, pb, [("grpc.enable_retries", 0)])
    try:
        client.echo(10, 1)
        engine = _engine()
        before = snapshot()
        conn = client.connection()
        conn._probe_fail_at(point)
        call = _call(client.stub, pb.pb2, arity, BIG)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            call()
        took = time.monotonic() - t0
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
        assert "test fail point" in info.value.details(), info.value.details()
        assert took < BOUND_S, f"the call took {took:.2f}s to end"
        assert not conn.alive
        assert conn.error == info.value.details()
        del conn, info  # the handle and the error are all that could keep it now

        def left() -> dict[str, tuple[int, int]]:
            """Connection fd kinds not below the warm level minus one (the warm
            connection held at least one of each): (before, now)."""
            now = snapshot()["fd_kinds"]
            return {k: (before["fd_kinds"].get(k, 0), now.get(k, 0))
                    for k in CONNECTION_FD_KINDS
                    if now.get(k, 0) > before["fd_kinds"].get(k, 0) - 1}

        end = time.monotonic() + SETTLE_S
        while (left() or engine.connection_count != before["connections"] - 1
               or engine.pool_stats()["in_use"]) and time.monotonic() < end:
            time.sleep(0.02)
        assert engine.connection_count == before["connections"] - 1
        assert engine.pool_stats()["in_use"] == 0, engine.pool_stats()
        assert not left(), f"the failed connection's fds are still open: {left()}"

        # The channel renegotiates and works again, on the fast path.
        client.echo(BIG, 2, both_ways=True)
    finally:
        client.channel.close()


def test_unknown_fail_point_is_refused(server: ServerProcess, pb: SimpleNamespace) -> None:
    client = ShmClient(server.target, pb)
    try:
        client.echo(10, 1)
        with pytest.raises(ValueError, match="unknown fail point 'nowhere'"):
            client.connection()._probe_fail_at("nowhere")
    finally:
        client.channel.close()
