"""Status code paths: abort, set_code, handler exception, unimplemented; RpcError is a Call."""
from __future__ import annotations

from typing import Any, Callable

import grpc
import pytest

from tests.support.clients import Client, md_pairs
from tests.support.servicer import EXCEPTION_TEXT

ABORTS = [
    (grpc.StatusCode.INVALID_ARGUMENT, "bad argument"),
    (grpc.StatusCode.NOT_FOUND, "no such thing"),
    (grpc.StatusCode.PERMISSION_DENIED, "go away"),
    (grpc.StatusCode.FAILED_PRECONDITION, "détails non-ASCII ✓"),
    (grpc.StatusCode.INTERNAL, ""),
]


def _rpc_error(fn: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    err = info.value
    assert isinstance(err, grpc.Call), "RpcError raised by a call must also be a grpc.Call"
    return err


def _call_each_arity(client: Client, req: Any) -> dict[str, Callable[[], Any]]:
    stub = client.stub
    return {
        "unary": lambda: stub.Unary(req, timeout=20),
        "server_stream": lambda: list(stub.ServerStream(req, timeout=20)),
        "client_stream": lambda: stub.ClientStream(iter([req]), timeout=20),
        "bidi": lambda: list(stub.Bidi(iter([req]), timeout=20)),
    }


@pytest.mark.parametrize("code,details", ABORTS, ids=[c.name for c, _ in ABORTS])
def test_abort_each_arity(client: Client, code: grpc.StatusCode, details: str) -> None:
    req = client.req(abort_code=code.value[0], abort_details=details)
    for arity, fn in _call_each_arity(client, req).items():
        err = _rpc_error(fn)
        assert (err.code(), err.details()) == (code, details), arity


def test_abort_keeps_trailing_metadata(client: Client) -> None:
    md = (("x-why", "because"), ("x-blob-bin", b"\x00\x01\xfe\xff"))
    req = client.req(echo_metadata=True, abort_code=grpc.StatusCode.ABORTED.value[0],
                     abort_details="aborted with metadata")
    err = _rpc_error(lambda: client.stub.Unary(req, metadata=md, timeout=20))
    assert err.code() == grpc.StatusCode.ABORTED
    assert err.details() == "aborted with metadata"
    assert md_pairs(err.initial_metadata()) == list(md)
    assert md_pairs(err.trailing_metadata()) == list(md)


def test_abort_future_exception(client: Client) -> None:
    req = client.req(abort_code=grpc.StatusCode.OUT_OF_RANGE.value[0], abort_details="oor")
    fut = client.stub.Unary.future(req, timeout=20)
    exc = fut.exception(timeout=20)
    assert isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call)
    assert exc.code() == grpc.StatusCode.OUT_OF_RANGE and exc.details() == "oor"
    assert fut.code() == grpc.StatusCode.OUT_OF_RANGE
    with pytest.raises(grpc.RpcError):
        fut.result()


def test_abort_mid_server_stream(client: Client) -> None:
    """Messages sent before the failure are delivered, then the status."""
    call = client.stub.ServerStream(
        client.req(response_count=5, fail_after=3, payload=b"p",
                   abort_code=grpc.StatusCode.DATA_LOSS.value[0], abort_details="lost"),
        timeout=20)
    got = []
    with pytest.raises(grpc.RpcError) as info:
        for resp in call:
            got.append(resp.index)
    assert got == [0, 1, 2]
    assert info.value.code() == grpc.StatusCode.DATA_LOSS
    assert call.code() == grpc.StatusCode.DATA_LOSS and call.details() == "lost"


def test_exception_mid_server_stream(client: Client) -> None:
    call = client.stub.ServerStream(
        client.req(response_count=5, fail_after=2, payload=b"p", raise_exception=True),
        timeout=20)
    got = []
    with pytest.raises(grpc.RpcError) as info:
        for resp in call:
            got.append(resp.index)
    assert got == [0, 1]
    assert info.value.code() == grpc.StatusCode.UNKNOWN
    assert info.value.details() == f"Exception iterating responses: {EXCEPTION_TEXT}"


def test_set_code_and_details(client: Client) -> None:
    req = client.req(set_code=grpc.StatusCode.UNAUTHENTICATED.value[0], set_details="who?")
    for arity, fn in _call_each_arity(client, req).items():
        err = _rpc_error(fn)
        assert (err.code(), err.details()) == (grpc.StatusCode.UNAUTHENTICATED, "who?"), arity


def test_exception_is_unknown(client: Client) -> None:
    req = client.req(raise_exception=True)
    expected = {
        "unary": f"Exception calling application: {EXCEPTION_TEXT}",
        "server_stream": f"Exception iterating responses: {EXCEPTION_TEXT}",
        "client_stream": f"Exception calling application: {EXCEPTION_TEXT}",
        "bidi": f"Exception iterating responses: {EXCEPTION_TEXT}",
    }
    for arity, fn in _call_each_arity(client, req).items():
        err = _rpc_error(fn)
        assert err.code() == grpc.StatusCode.UNKNOWN, arity
        assert err.details() == expected[arity], arity


@pytest.mark.parametrize("method", ["/argrpc.test.Echo/NoSuchMethod", "/no.such.Service/Call"])
def test_unimplemented(client: Client, method: str) -> None:
    unary = client.channel.unary_unary(method)
    err = _rpc_error(lambda: unary(b"", timeout=20))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED
    assert err.details() == "Method not found!"

    stream = client.channel.stream_stream(method)
    call = stream(iter([b"a", b"b"]), timeout=20)
    err = _rpc_error(lambda: list(call))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED


def test_with_call_error_is_call(client: Client) -> None:
    req = client.req(abort_code=grpc.StatusCode.ALREADY_EXISTS.value[0], abort_details="dup")
    err = _rpc_error(lambda: client.stub.Unary.with_call(req, timeout=20))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert err.trailing_metadata() is not None


def test_channel_usable_after_errors(client: Client) -> None:
    for _ in range(5):
        _rpc_error(lambda: client.stub.Unary(client.req(raise_exception=True), timeout=20))
    assert client.stub.Unary(client.req(payload=b"still fine"), timeout=20).payload == b"still fine"
