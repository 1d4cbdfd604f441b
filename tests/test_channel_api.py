"""grpc.Channel API surface: readiness, connectivity, context manager, close, unreachable."""
from __future__ import annotations

import socket
import threading
from typing import Any, Callable

import grpc
import pytest

from tests.support.clients import UNLIMITED_SERVER_ARGS, Client, check_transport, make_channel


def test_is_grpc_channel(client: Client) -> None:
    assert isinstance(client.channel, grpc.Channel)


def test_channel_ready_future(pair: tuple[str, str], servers: Any, pb: Any) -> None:
    server = servers.get(pair[1], UNLIMITED_SERVER_ARGS)
    channel = make_channel(pair[0], server.target)
    try:
        grpc.channel_ready_future(channel).result(timeout=20)
        stub = pb.pb2_grpc.EchoStub(channel)
        assert stub.Unary(pb.pb2.EchoRequest(payload=b"r"), timeout=20).payload == b"r"
        check_transport(channel, *pair)
    finally:
        channel.close()


def test_subscribe_reports_ready(pair: tuple[str, str], servers: Any) -> None:
    server = servers.get(pair[1], UNLIMITED_SERVER_ARGS)
    channel = make_channel(pair[0], server.target)
    ready = threading.Event()
    states: list[grpc.ChannelConnectivity] = []

    def on_change(state: grpc.ChannelConnectivity) -> None:
        states.append(state)
        if state == grpc.ChannelConnectivity.READY:
            ready.set()

    try:
        channel.subscribe(on_change, try_to_connect=True)
        assert ready.wait(30), f"never READY, saw {states}"
        assert all(isinstance(s, grpc.ChannelConnectivity) for s in states)
        channel.unsubscribe(on_change)
    finally:
        channel.close()


def test_context_manager_closes(pair: tuple[str, str], servers: Any, pb: Any) -> None:
    echo_pb2, echo_pb2_grpc = pb.pb2, pb.pb2_grpc
    server = servers.get(pair[1], UNLIMITED_SERVER_ARGS)
    with make_channel(pair[0], server.target) as channel:
        stub = echo_pb2_grpc.EchoStub(channel)
        assert stub.Unary(echo_pb2.EchoRequest(payload=b"cm"), timeout=20).payload == b"cm"
        check_transport(channel, *pair)
    # grpc: "Cannot invoke RPC on closed channel!" as ValueError
    with pytest.raises(ValueError):
        stub.Unary(echo_pb2.EchoRequest(payload=b"late"), timeout=5)
    with pytest.raises(ValueError):
        stub.Unary.future(echo_pb2.EchoRequest(payload=b"late"), timeout=5)


def test_close_cancels_in_flight(client: Client) -> None:
    fut = client.stub.Unary.future(client.req(sleep_ms=3000), timeout=30)
    call = client.stub.ServerStream(client.req(response_count=100, sleep_ms=100), timeout=30)
    next(call)
    client.channel.close()
    exc = fut.exception(timeout=20)
    assert exc is not None and exc.code() == grpc.StatusCode.CANCELLED
    assert exc.details() == "Channel closed!"
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    assert info.value.code() == grpc.StatusCode.CANCELLED


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("stack", ["argrpc", "grpc"])
def test_unreachable_server(stack: str, pb: Any) -> None:
    echo_pb2, echo_pb2_grpc = pb.pb2, pb.pb2_grpc
    channel = make_channel(stack, f"127.0.0.1:{_free_port()}")
    try:
        stub = echo_pb2_grpc.EchoStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Unary(echo_pb2.EchoRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as info:
            stub.Unary(echo_pb2.EchoRequest(), timeout=1, wait_for_ready=True)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        channel.close()


@pytest.mark.parametrize("stack", ["argrpc", "grpc"])
def test_server_appears_later(stack: str, spawn: Callable[..., Any], pb: Any) -> None:
    """A channel made before its server exists negotiates once the server is up."""
    echo_pb2, echo_pb2_grpc = pb.pb2, pb.pb2_grpc
    port = _free_port()
    channel = make_channel(stack, f"127.0.0.1:{port}")
    try:
        stub = echo_pb2_grpc.EchoStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Unary(echo_pb2.EchoRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        server = spawn("argrpc", ("--port", str(port)))
        assert server.port == port
        resp = stub.Unary(echo_pb2.EchoRequest(payload=b"up"), timeout=20, wait_for_ready=True)
        assert resp.payload == b"up"
        check_transport(channel, stack, "argrpc")
    finally:
        channel.close()


def test_replacing_grpcs_constructors_with_argrpcs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A program may switch a library that builds its own server and channels by
    replacing grpc.server / grpc.insecure_channel with argrpc's. argrpc then still builds
    its inner grpc objects with grpc's own functions (no recursion), and what the
    library gets is argrpc's, on the fast path."""
    from concurrent import futures

    import argrpc

    monkeypatch.setattr(grpc, "server", argrpc.server)
    monkeypatch.setattr(grpc, "insecure_channel", argrpc.insecure_channel)

    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        return request

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.Swap", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert channel.unary_unary("/t.Swap/Echo")(b"swap", timeout=10) == b"swap"
            assert isinstance(channel, argrpc.Channel)
            assert channel.transport == "shm", channel.fallback_reason
    finally:
        server.stop(None)


def test_close_does_not_wait_on_a_blocked_request_iterator(client: Client,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """grpc's close() does not wait for user code: neither does argrpc's. A request
    iterator blocked in the user's code is left to its daemon thread, which ends at its
    next item since its call has (checked by what close() joins, not by the clock)."""
    release = threading.Event()
    sent = threading.Event()

    def requests() -> Any:
        yield client.req(payload=b"first")
        sent.set()
        release.wait(60)
        yield client.req(payload=b"late")

    joined: list[str] = []
    real_join = threading.Thread.join

    def recording_join(self: threading.Thread, timeout: float | None = None) -> None:
        joined.append(self.name)
        real_join(self, timeout)

    earlier = set(threading.enumerate())  # other tests' threads are not this call's
    fut = client.stub.ClientStream.future(requests(), timeout=30)
    try:
        assert sent.wait(20)
        monkeypatch.setattr(threading.Thread, "join", recording_join)
        client.channel.close()
        monkeypatch.undo()
        assert "argrpc-requests" not in joined, joined
    finally:
        release.set()
    exc = fut.exception(timeout=20)
    assert exc is not None and exc.code() == grpc.StatusCode.CANCELLED
    for thread in set(threading.enumerate()) - earlier:
        if thread.name == "argrpc-requests":
            thread.join(20)
            assert not thread.is_alive(), "the request thread outlived its call"
