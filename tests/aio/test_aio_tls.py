"""TLS under argrpc.aio, as tests/test_tls.py shows it for the threaded API: an
argrpc.aio secure_channel uses the unencrypted fast path only when it and the
argrpc.aio server both opt in with TF_RDMA_OVER_TLS=true; otherwise the call is gRPC
over TLS and `fallback_reason` names the knob. grpc.aio TLS clients keep working against
an argrpc.aio TLS server. Server and clients share this process's loop."""
from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace
from typing import Any, Optional

import grpc
import pytest
from grpc import aio

import argrpc.aio
from tests.test_tls import tls  # noqa: F401 - the self-signed certificate fixture

MiB = 1 << 20
SERVICE = "t.AioTls"
UNLIMITED = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


@pytest.fixture(autouse=True)
def _no_opt_in_from_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TF_RDMA_OVER_TLS", raising=False)


async def _digest(request: bytes, context: aio.ServicerContext) -> bytes:
    return hashlib.sha256(request).digest()


async def _count(request: bytes, context: aio.ServicerContext) -> Any:
    for i in range(3):
        yield bytes([i]) * 1000


async def _outcome(tls: SimpleNamespace, client_stack: str, server_opt: Optional[str],
                   client_opt: Optional[str]) -> tuple[str, str]:
    """One argrpc.aio TLS server (TF_RDMA_OVER_TLS=server_opt as an option) and one
    secure channel of `client_stack`; its (transport, fallback_reason) after calls that
    must all work."""
    server_options = UNLIMITED + ([("TF_RDMA_OVER_TLS", server_opt)] if server_opt else [])
    server = argrpc.aio.server(options=server_options)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Digest": grpc.unary_unary_rpc_method_handler(_digest),
        "Count": grpc.unary_stream_rpc_method_handler(_count)}),))
    creds = grpc.ssl_server_credentials([(open(tls.key, "rb").read(), tls.cert_pem)])
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    try:
        module: Any = argrpc.aio if client_stack == "argrpc" else aio
        options = UNLIMITED + ([("TF_RDMA_OVER_TLS", client_opt)] if client_opt else [])
        channel_creds = grpc.ssl_channel_credentials(root_certificates=tls.cert_pem)
        async with module.secure_channel(f"localhost:{port}", channel_creds,
                                         options=options) as channel:
            digest = channel.unary_unary(f"/{SERVICE}/Digest")
            for size in (5, 3 * MiB):
                data = bytes(range(256)) * (size // 256) + b"t" * (size % 256)
                assert await digest(data, timeout=30) == hashlib.sha256(data).digest()
            assert [m async for m in channel.unary_stream(f"/{SERVICE}/Count")(b"", timeout=30)] \
                == [bytes([i]) * 1000 for i in range(3)]
            return (getattr(channel, "transport", "grpc.aio"),
                    getattr(channel, "fallback_reason", ""))
    finally:
        await server.stop(None)


def _run(*args: Any) -> tuple[str, str]:
    return asyncio.run(asyncio.wait_for(_outcome(*args), 60))


@pytest.mark.parametrize("server_opt", [None, "true"])
def test_without_the_clients_opt_in_it_is_grpc_over_tls(tls: SimpleNamespace,  # noqa: F811
                                                        server_opt: Optional[str]) -> None:
    transport, reason = _run(tls, "argrpc", server_opt, None)
    assert transport == "grpc" and "TF_RDMA_OVER_TLS" in reason, (transport, reason)


def test_both_opt_in_uses_shm(tls: SimpleNamespace) -> None:  # noqa: F811
    assert _run(tls, "argrpc", "true", "true") == ("shm", "")


def test_client_opt_in_against_a_server_without_it(tls: SimpleNamespace) -> None:  # noqa: F811
    transport, reason = _run(tls, "argrpc", None, "true")
    assert transport == "grpc", (transport, reason)
    assert "TF_RDMA_OVER_TLS" in reason and "server" in reason, reason


def test_grpc_aio_tls_client_against_an_argrpc_aio_tls_server(tls: SimpleNamespace  # noqa: F811
                                                              ) -> None:
    assert _run(tls, "grpc", "true", None)[0] == "grpc.aio"


def test_secure_channel_needs_credentials() -> None:
    with pytest.raises(ValueError):
        argrpc.aio.secure_channel("localhost:1", None)  # type: ignore[arg-type]
