"""Client interceptors via grpc.intercept_channel and server interceptors."""
from __future__ import annotations

import collections
from typing import Any, Callable

import grpc
import pytest

from tests.support.clients import UNLIMITED, UNLIMITED_SERVER_ARGS, Client, md_pairs
from tests.support.echo_server import REJECT_DETAILS


class _Details(collections.namedtuple(
        "_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                     "compression")), grpc.ClientCallDetails):
    pass


class AddMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds one metadata entry to every call and remembers the methods it saw."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    def _details(self, d: grpc.ClientCallDetails) -> _Details:
        self.methods.append(d.method)
        md = list(d.metadata or []) + [("x-intercepted", "yes")]
        return _Details(d.method, d.timeout, md, d.credentials, d.wait_for_ready,
                        d.compression)

    def intercept_unary_unary(self, continuation: Any, d: Any, request: Any) -> Any:
        return continuation(self._details(d), request)

    def intercept_unary_stream(self, continuation: Any, d: Any, request: Any) -> Any:
        return continuation(self._details(d), request)

    def intercept_stream_unary(self, continuation: Any, d: Any, it: Any) -> Any:
        return continuation(self._details(d), it)

    def intercept_stream_stream(self, continuation: Any, d: Any, it: Any) -> Any:
        return continuation(self._details(d), it)


EXPECTED = [("x-intercepted", "yes")]


def test_client_interceptor_all_arities(client: Client, pb: Any) -> None:
    interceptor = AddMetadata()
    stub = pb.pb2_grpc.EchoStub(grpc.intercept_channel(client.channel, interceptor))
    req = client.req(echo_metadata=True, payload=b"i")

    resp, call = stub.Unary.with_call(req, timeout=20)
    assert resp.payload == b"i"
    assert md_pairs(call.initial_metadata()) == EXPECTED
    assert md_pairs(call.trailing_metadata()) == EXPECTED

    fut = stub.Unary.future(req, timeout=20)
    assert fut.result(timeout=20).payload == b"i"
    assert md_pairs(fut.trailing_metadata()) == EXPECTED

    call = stub.ServerStream(client.req(echo_metadata=True, response_count=2), timeout=20)
    assert len(list(call)) == 2
    assert md_pairs(call.trailing_metadata()) == EXPECTED

    resp, call = stub.ClientStream.with_call(iter([req, req]), timeout=20)
    assert resp.size == 2
    assert md_pairs(call.initial_metadata()) == EXPECTED

    call = stub.Bidi(iter([req, req]), timeout=20)
    assert [r.payload for r in call] == [b"i", b"i"]
    assert md_pairs(call.trailing_metadata()) == EXPECTED

    assert interceptor.methods == [
        "/argrpc.test.Echo/Unary", "/argrpc.test.Echo/Unary", "/argrpc.test.Echo/ServerStream",
        "/argrpc.test.Echo/ClientStream", "/argrpc.test.Echo/Bidi"]


def test_client_interceptor_sees_errors(client: Client, pb: Any) -> None:
    stub = pb.pb2_grpc.EchoStub(grpc.intercept_channel(client.channel, AddMetadata()))
    with pytest.raises(grpc.RpcError) as info:
        stub.Unary(client.req(abort_code=grpc.StatusCode.NOT_FOUND.value[0],
                              abort_details="nope"), timeout=20)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "nope"


@pytest.fixture
def rejecting_server(pair: tuple[str, str], servers: Any) -> Any:
    return servers.get(pair[1], (*UNLIMITED_SERVER_ARGS,
                                 "--reject-method", "/argrpc.test.Echo/ClientStream",
                                 "--reject-method", "/argrpc.test.Echo/ServerStream"))


def test_server_interceptor_rejects_method(pair: tuple[str, str], rejecting_server: Any,
                                           connect: Callable[..., Client]) -> None:
    client = connect(pair[0], rejecting_server, UNLIMITED)
    with pytest.raises(grpc.RpcError) as info:
        client.stub.ClientStream(iter([client.req(payload=b"a")]), timeout=20)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert info.value.details() == REJECT_DETAILS

    with pytest.raises(grpc.RpcError) as info:
        list(client.stub.ServerStream(client.req(payload=b"a"), timeout=20))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert info.value.details() == REJECT_DETAILS

    # methods the interceptor lets through still work, on the same connection
    assert client.stub.Unary(client.req(payload=b"ok"), timeout=20).payload == b"ok"
    assert [r.payload for r in client.stub.Bidi(iter([client.req(payload=b"b")]), timeout=20)
            ] == [b"b"]


def test_interceptors_on_both_sides(pair: tuple[str, str], rejecting_server: Any,
                                    connect: Callable[..., Client], pb: Any) -> None:
    client = connect(pair[0], rejecting_server, UNLIMITED)
    stub = pb.pb2_grpc.EchoStub(grpc.intercept_channel(client.channel, AddMetadata()))
    resp, call = stub.Unary.with_call(client.req(echo_metadata=True, payload=b"x"), timeout=20)
    assert md_pairs(call.trailing_metadata()) == EXPECTED
    with pytest.raises(grpc.RpcError) as info:
        stub.ClientStream(iter([client.req()]), timeout=20)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
