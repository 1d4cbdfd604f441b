"""No leaked fds, threads or /dev/shm entries after channels and servers close.

Lazily created process-wide state (grpc core's threads, argrpc's engine and pool) is
created by a warm-up round; after that, rounds of open/use/close must return the
process to where it was. Teardown is asynchronous, so counts are polled for a while.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import grpc

from tests.support import resources
from tests.support.clients import UNLIMITED, UNLIMITED_SERVER_ARGS, Client, open_client
from tests.support.payload import ACC_SIZE, CHUNK_SIZE
from tests.support.procs import ServerProcess


def _exercise(client: Client) -> None:
    """A bit of every path: eager, rendezvous, all arities, errors, cancel, concurrency."""
    stub, req = client.stub, client.req
    assert stub.Unary(req(payload=b"s"), timeout=20).payload == b"s"
    big = b"\x07" * (CHUNK_SIZE + 1)
    assert stub.Unary(req(payload=big), timeout=30).payload == big
    assert len(list(stub.ServerStream(req(response_count=3, response_size=ACC_SIZE + 1),
                                      timeout=20))) == 3
    assert stub.ClientStream(iter([req(payload=b"a")] * 3), timeout=20).size == 3
    assert len(list(stub.Bidi(iter([req(payload=b"b")] * 3), timeout=20))) == 3
    try:
        stub.Unary(req(raise_exception=True), timeout=20)
    except grpc.RpcError:
        pass
    fut = stub.Unary.future(req(sleep_ms=300), timeout=20)
    fut.cancel()
    burst = [stub.Unary.future(req(sleep_ms=50, payload=b"c"), timeout=20) for _ in range(8)]
    assert all(f.result(timeout=20).payload == b"c" for f in burst)


def _round(stack: str, server: ServerProcess, pb: SimpleNamespace) -> None:
    client = open_client(stack, server, pb.pb2, pb.pb2_grpc, UNLIMITED)
    try:
        _exercise(client)
    finally:
        client.close()


def test_client_process_no_leaks(pair: tuple[str, str], servers: Any,
                                 pb: SimpleNamespace) -> None:
    server = servers.get(pair[1], UNLIMITED_SERVER_ARGS)
    _round(pair[0], server, pb)  # warm-up: process-wide lazy state
    resources.settle(resources.snapshot(), resources.snapshot, timeout=2)
    before = resources.snapshot()
    for _ in range(3):
        _round(pair[0], server, pb)
    after, problems = resources.settle(before, resources.snapshot)
    assert not problems, problems


def test_context_manager_no_leaks(pair: tuple[str, str], servers: Any,
                                  pb: SimpleNamespace) -> None:
    from tests.support.clients import make_channel

    server = servers.get(pair[1], UNLIMITED_SERVER_ARGS)

    def use() -> None:
        with make_channel(pair[0], server.target, UNLIMITED) as channel:
            stub = pb.pb2_grpc.EchoStub(channel)
            assert stub.Unary(pb.pb2.EchoRequest(payload=b"cm"), timeout=20).payload == b"cm"

    use()
    before = resources.snapshot()
    for _ in range(3):
        use()
    _, problems = resources.settle(before, resources.snapshot)
    assert not problems, problems


def test_server_process_no_leaks(pair: tuple[str, str], spawn: Callable[..., ServerProcess],
                                 pb: SimpleNamespace) -> None:
    server = spawn(pair[1], (*UNLIMITED_SERVER_ARGS, "--workers", "4"))
    # A probe connection stays open throughout, so what is measured is what the other
    # connections leave behind.
    probe = open_client(pair[0], server, pb.pb2, pb.pb2_grpc, UNLIMITED)
    try:
        _round(pair[0], server, pb)
        before = probe.query("resources")
        for _ in range(3):
            _round(pair[0], server, pb)
        _, problems = resources.settle(before, lambda: probe.query("resources"))
        assert not problems, f"server process: {problems}"
    finally:
        probe.close()

    report = server.finish()
    assert report["stop_ok"] is True
    assert report["executor_shutdown_ok"] is True, "worker threads did not end after stop"
    assert not resources.new_shm_entries(report["before"], report["exit"])
    # The engine may keep its process-wide pool, but a stopped server keeps no sockets.
    sockets = [[t for t in report[k]["fd_targets"] if t.startswith("socket:")]
               for k in ("before", "exit")]
    assert len(sockets[1]) <= len(sockets[0]), f"sockets left open after stop: {sockets[1]}"
    # Server stopped and executor shut down: no Python thread of the server may remain.
    assert report["exit"]["threads"] <= report["before"]["threads"], (
        report["before"]["thread_names"], report["exit"]["thread_names"])
