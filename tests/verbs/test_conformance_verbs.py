"""The conformance basics forced onto the verbs fabric (TF_RDMA_TRANSPORT=verbs on both
ends, one host): every arity, payloads from 0 B through several chunks to 64 MiB
byte-exact, a deadline and a cancel. Runs in the Soft-RoCE guest; skips with the reason
where there is no usable device. Everything in the guest is slow (TCG), so deadlines
are generous and one server serves the whole module."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Iterator

import pytest

from tests.support import conformance_cases as cases
from tests.support.clients import Client, UNLIMITED, UNLIMITED_SERVER_ARGS, open_client
from tests.support.procs import ServerProcess

# Both processes (server and this client) get the same fabric settings. The pool is
# kept small: the guest has 2 GiB of RAM and every process pre-faults its own pool.
VERBS_ENV = {"TF_RDMA_TRANSPORT": "verbs", "TF_RDMA_BUF_SIZE": "256M"}


@pytest.fixture(scope="module")
def verbs_client(rdma: SimpleNamespace, stubs_dir: str, pb: SimpleNamespace) -> Iterator[Client]:
    saved = {k: os.environ.get(k) for k in VERBS_ENV}
    os.environ.update(VERBS_ENV)  # this process's channel (and engine) read them
    pb2, pb2_grpc = pb.pb2, pb.pb2_grpc
    server = ServerProcess("argrpc", stubs_dir, UNLIMITED_SERVER_ARGS, VERBS_ENV,
                           start_timeout=120)
    client = None
    try:
        client = open_client("argrpc", server, pb2, pb2_grpc, UNLIMITED, check=False)
        client.stub.Unary(client.req(payload=b"warm-up"), timeout=120, wait_for_ready=True)
        assert client.channel.transport == "verbs", client.channel.fallback_reason
        yield client
    finally:
        if client is not None:
            client.close()
        server.kill()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


BASE_S = 60.0


def test_channel_reports_verbs(verbs_client: Client) -> None:
    assert verbs_client.channel.transport == "verbs"
    assert verbs_client.channel.fallback_reason == ""


def test_handler_sees_grpcs_peer_over_verbs(verbs_client: Client) -> None:
    """Over verbs too the handler's peer() and auth context are grpc's, and the
    context says which fabric served the call."""
    info = json.loads(verbs_client.stub.Unary(verbs_client.req(payload=b"p"), timeout=BASE_S).info)
    assert info["transport"] == "verbs", info
    assert info["transport_peer"].startswith("verbs:"), info
    assert info["peer"].startswith(("ipv4:", "ipv6:")), info
    assert info["auth"] == {"transport_security_type": ["insecure"],
                            "security_level": ["TSI_SECURITY_NONE"]}, info


@pytest.mark.parametrize("size", cases.PAYLOAD_SIZES)
def test_unary_payloads_byte_exact(verbs_client: Client, size: int) -> None:
    cases.unary_payload_byte_exact(verbs_client, size, BASE_S)


def test_server_to_client_rendezvous(verbs_client: Client) -> None:
    cases.server_to_client_rendezvous(verbs_client, BASE_S)


def test_streaming_arities(verbs_client: Client) -> None:
    cases.streaming_arities(verbs_client, 2 * BASE_S)


def test_many_small_messages_keep_order(verbs_client: Client) -> None:
    bodies = [i.to_bytes(4, "little") * (i % 7) for i in range(500)]
    got = list(verbs_client.stub.Bidi(iter(verbs_client.req(payload=b) for b in bodies),
                                      timeout=120))
    assert [r.payload for r in got] == bodies


def test_status_and_metadata(verbs_client: Client) -> None:
    cases.status_and_metadata(verbs_client, BASE_S)


def test_deadline_exceeded(verbs_client: Client) -> None:
    cases.deadline_exceeded(verbs_client)


def test_cancel_reaches_server(verbs_client: Client) -> None:
    cases.cancel_reaches_server(verbs_client, BASE_S)
    assert verbs_client.channel.transport == "verbs"

