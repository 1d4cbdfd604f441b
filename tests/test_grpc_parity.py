"""Small corners where a drop-in must answer exactly as grpc does, on every pair (the
grpc<->grpc reference included): an OK call's details and debug string, and a server's
``__del__``."""
from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc
import pytest

from tests.support.clients import Client


def _ok_calls(client: Client) -> dict[str, Any]:
    """grpc.Call objects of OK calls whose handler set details (every arity)."""
    req = client.req(payload=b"x", set_details="the handler's own words")
    stub = client.stub
    _, unary = stub.Unary.with_call(req, timeout=20)
    future = stub.Unary.future(req, timeout=20)
    future.result()
    stream = stub.ServerStream(req, timeout=20)
    list(stream)
    _, client_stream = stub.ClientStream.with_call(iter([req]), timeout=20)
    bidi = stub.Bidi(iter([req]), timeout=20)
    list(bidi)
    return {"unary": unary, "future": future, "server_stream": stream,
            "client_stream": client_stream, "bidi": bidi}


def test_ok_call_has_empty_details_and_debug_string(client: Client) -> None:
    for kind, call in _ok_calls(client).items():
        assert call.code() == grpc.StatusCode.OK, kind
        assert call.details() == "", (kind, call.details())
        assert call.debug_error_string() == "", (kind, call.debug_error_string())


@pytest.mark.parametrize("stack", ["argrpc", "grpc"])
def test_server_del_stops_it(stack: str) -> None:
    """grpc's server defines __del__, and code calls it to stop a server."""
    import argrpc

    mod: Any = argrpc if stack == "argrpc" else grpc
    server = mod.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t", {"U": grpc.unary_unary_rpc_method_handler(lambda r, c: b"ok")}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = mod.insecure_channel(f"127.0.0.1:{port}")
    try:
        assert channel.unary_unary("/t/U")(b"", timeout=20) == b"ok"
        server.__del__()
        assert server.wait_for_termination(timeout=10) is False, "still serving after __del__"
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/t/U")(b"", timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        channel.close()
        server.stop(None)


def test_unstarted_server_del_is_harmless() -> None:
    import argrpc

    server = argrpc.server(futures.ThreadPoolExecutor(max_workers=1))
    server.__del__()
    server.__del__()
