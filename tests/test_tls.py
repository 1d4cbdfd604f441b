"""TLS (secure_channel / add_secure_port): the fast path only when both ends opt in.

The shared-memory data path is not encrypted, so an argrpc channel created with
`argrpc.secure_channel` uses it only with TF_RDMA_OVER_TLS=true on the client (option or
environment) AND on the server; otherwise the call is ordinary gRPC over TLS, with
`channel.fallback_reason` naming TF_RDMA_OVER_TLS. Plain grpc TLS clients keep working
against an argrpc TLS server. The certificate is self-signed for 127.0.0.1/localhost and
generated at test time; servers run in their own processes (echo_server --tls-cert/key).
"""
from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator, Sequence

import grpc
import pytest

import argrpc
from tests.support import payload
from tests.support.clients import UNLIMITED, UNLIMITED_SERVER_ARGS

MiB = 1 << 20
README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture(scope="session")
def tls(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A self-signed server certificate for 127.0.0.1 and localhost (PEM files + bytes)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    d = tmp_path_factory.mktemp("tls")
    (d / "server.crt").write_bytes(cert_pem)
    (d / "server.key").write_bytes(key_pem)
    return SimpleNamespace(cert=str(d / "server.crt"), key=str(d / "server.key"),
                           cert_pem=cert_pem)


@pytest.fixture(autouse=True)
def _no_opt_in_from_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    # "No opt-in" must mean no opt-in, whatever the environment running the suite says.
    monkeypatch.delenv("TF_RDMA_OVER_TLS", raising=False)


def _tls_server(servers: Any, tls: SimpleNamespace, over_tls: str | None = None,
                how: str = "env", stack: str = "argrpc") -> Any:
    """A TLS echo server; `over_tls` set via the server's environment or its options."""
    args: tuple[str, ...] = UNLIMITED_SERVER_ARGS + ("--tls-cert", tls.cert, "--tls-key", tls.key)
    env = {"TF_RDMA_OVER_TLS": "false"}
    if over_tls is not None and how == "env":
        env["TF_RDMA_OVER_TLS"] = over_tls
    elif over_tls is not None:
        args += ("--server-option", f"TF_RDMA_OVER_TLS={over_tls}")
    return servers.get(stack, args, env)


@pytest.fixture
def secure(tls: SimpleNamespace, pb: SimpleNamespace) -> Iterator[Any]:
    """Open TLS channels (argrpc or grpc) with stubs; all closed at teardown."""
    opened: list[Any] = []

    def _open(stack: str, target: str, options: Sequence[tuple[str, Any]] = ()) -> Any:
        creds = grpc.ssl_channel_credentials(root_certificates=tls.cert_pem)
        opts = list(UNLIMITED) + list(options)
        module = argrpc if stack == "argrpc" else grpc
        channel = module.secure_channel(target, creds, options=opts)
        opened.append(channel)
        return SimpleNamespace(channel=channel, stub=pb.pb2_grpc.EchoStub(channel))

    yield _open
    for channel in opened:
        channel.close()


def _roundtrip(client: Any, pb: SimpleNamespace, sizes: Sequence[int] = (5, 3 * MiB)) -> None:
    """Unary echo (byte-exact) and a server stream work on this channel."""
    for size in sizes:
        data = payload.make(size, size)
        reply = client.stub.Unary(pb.pb2.EchoRequest(payload=data), timeout=60,
                                  wait_for_ready=True)
        assert reply.payload == data, f"{size}-byte echo over TLS was not byte-exact"
    replies = list(client.stub.ServerStream(
        pb.pb2.EchoRequest(response_count=3, response_size=1000, response_seed=7), timeout=60))
    assert [r.payload for r in replies] == [payload.make(7 + i, 1000) for i in range(3)]


def _assert_tls_fallback(channel: Any, *needles: str) -> None:
    assert channel.transport == "grpc", (
        f"TLS without opt-in on both ends must not use the unencrypted fast path "
        f"(transport={channel.transport!r})")
    reason = channel.fallback_reason
    assert reason and "TF_RDMA_OVER_TLS" in reason, reason
    for needle in needles:
        assert needle in reason, reason


# -- (a) nobody opts in -----------------------------------------------------------------

def test_secure_channel_without_opt_in_is_plain_grpc_over_tls(
        servers: Any, tls: SimpleNamespace, secure: Any, pb: SimpleNamespace) -> None:
    server = _tls_server(servers, tls)
    client = secure("argrpc", server.target)
    _roundtrip(client, pb)
    _assert_tls_fallback(client.channel)


def test_server_opt_in_alone_is_not_enough(
        servers: Any, tls: SimpleNamespace, secure: Any, pb: SimpleNamespace) -> None:
    """The client's own opt-in is required: the server allowing it does not switch a
    secure_channel to the unencrypted path."""
    server = _tls_server(servers, tls, "true")
    client = secure("argrpc", server.target)
    _roundtrip(client, pb)
    _assert_tls_fallback(client.channel)


# -- (b) both opt in --------------------------------------------------------------------

@pytest.mark.parametrize("server_how", ["env", "option"])
def test_both_opt_in_channel_option_uses_shm(
        servers: Any, tls: SimpleNamespace, secure: Any, pb: SimpleNamespace,
        server_how: str) -> None:
    server = _tls_server(servers, tls, "true", how=server_how)
    client = secure("argrpc", server.target, [("TF_RDMA_OVER_TLS", "true")])
    _roundtrip(client, pb, sizes=(5, 3 * MiB, 40 * MiB))
    assert client.channel.transport == "shm", client.channel.fallback_reason
    assert client.channel.fallback_reason == ""


def test_both_opt_in_client_environment_uses_shm(
        servers: Any, tls: SimpleNamespace, secure: Any, pb: SimpleNamespace,
        monkeypatch: pytest.MonkeyPatch) -> None:
    server = _tls_server(servers, tls, "true")
    monkeypatch.setenv("TF_RDMA_OVER_TLS", "true")
    client = secure("argrpc", server.target)
    _roundtrip(client, pb)
    assert client.channel.transport == "shm", client.channel.fallback_reason


def test_channel_option_false_overrides_environment_opt_in(
        servers: Any, tls: SimpleNamespace, secure: Any, pb: SimpleNamespace,
        monkeypatch: pytest.MonkeyPatch) -> None:
    server = _tls_server(servers, tls, "true")
    monkeypatch.setenv("TF_RDMA_OVER_TLS", "true")
    client = secure("argrpc", server.target, [("TF_RDMA_OVER_TLS", "false")])
    _roundtrip(client, pb)
    _assert_tls_fallback(client.channel)


# -- (c) only the client opts in --------------------------------------------------------

@pytest.mark.parametrize("server_over_tls", [None, "false"])
def test_client_opt_in_against_server_without_it_is_plain_grpc(
        servers: Any, tls: SimpleNamespace, secure: Any, pb: SimpleNamespace,
        server_over_tls: str | None) -> None:
    server = _tls_server(servers, tls, server_over_tls, how="option")
    client = secure("argrpc", server.target, [("TF_RDMA_OVER_TLS", "true")])
    _roundtrip(client, pb)
    # The reason is the server's refusal, not the client's own setting.
    _assert_tls_fallback(client.channel, "server")


# -- (d) plain grpc TLS clients against an argrpc TLS server ----------------------------

@pytest.mark.parametrize("server_over_tls", [None, "true"])
def test_plain_grpc_secure_channel_against_argrpc_tls_server(
        servers: Any, tls: SimpleNamespace, secure: Any, pb: SimpleNamespace,
        server_over_tls: str | None) -> None:
    server = _tls_server(servers, tls, server_over_tls)
    client = secure("grpc", server.target)
    _roundtrip(client, pb)
    # Client streaming too: the server's TLS port is a complete gRPC server.
    chunks = [payload.make(i, 70_000) for i in range(4)]
    reply = client.stub.ClientStream(iter(pb.pb2.EchoRequest(payload=c) for c in chunks),
                                     timeout=60)
    assert reply.size == sum(map(len, chunks)) and reply.index == len(chunks)
    assert reply.digest == payload.sha256(b"".join(chunks))


def test_argrpc_secure_channel_with_opt_in_against_plain_grpc_tls_server(
        servers: Any, tls: SimpleNamespace, secure: Any, pb: SimpleNamespace) -> None:
    server = _tls_server(servers, tls, stack="grpc")
    client = secure("argrpc", server.target, [("TF_RDMA_OVER_TLS", "true")])
    _roundtrip(client, pb)
    assert client.channel.transport == "grpc"
    assert client.channel.fallback_reason


# -- README -----------------------------------------------------------------------------

def test_readme_documents_the_tls_opt_in() -> None:
    text = " ".join(README.read_text().split())
    assert ("`argrpc.secure_channel(target, credentials)` uses the fast path only if you opt "
            "in with `TF_RDMA_OVER_TLS=true` (environment or option)") in text
    assert "| `TF_RDMA_OVER_TLS` | false |" in text
