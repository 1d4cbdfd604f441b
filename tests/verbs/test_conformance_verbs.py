"""The conformance basics forced onto the verbs fabric (TF_RDMA_TRANSPORT=verbs on both
ends, one host): every arity, payloads from 0 B through several chunks to 64 MiB
byte-exact, a deadline and a cancel. Runs in the Soft-RoCE guest; skips with the reason
where there is no usable device. Everything in the guest is slow (TCG), so deadlines
are generous and one server serves the whole module."""
from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any, Iterator

import grpc
import pytest

from tests.support import payload
from tests.support.clients import Client, UNLIMITED, UNLIMITED_SERVER_ARGS, new_tag, open_client
from tests.support.payload import ACC_SIZE, CHUNK_SIZE, MiB
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


def _timeout(size: int) -> float:
    return 60.0 + size / (1 << 20)  # rxe under TCG moves tens of MB/s at best


def test_channel_reports_verbs(verbs_client: Client) -> None:
    assert verbs_client.channel.transport == "verbs"
    assert verbs_client.channel.fallback_reason == ""


@pytest.mark.parametrize("size", [0, 1, ACC_SIZE - 1, ACC_SIZE + 1, CHUNK_SIZE + 1,
                                  2 * CHUNK_SIZE + 3, 64 * MiB])
def test_unary_payloads_byte_exact(verbs_client: Client, size: int) -> None:
    body = payload.make(size, size)
    resp = verbs_client.stub.Unary(verbs_client.req(payload=body), timeout=_timeout(2 * size))
    assert resp.size == size and payload.sha256(resp.payload) == payload.sha256(body)


def test_server_to_client_rendezvous(verbs_client: Client) -> None:
    size = 3 * CHUNK_SIZE + 5
    resp = verbs_client.stub.Unary(verbs_client.req(response_size=size, response_seed=31),
                                   timeout=_timeout(size))
    assert resp.payload == payload.make(31, size)


def test_streaming_arities(verbs_client: Client) -> None:
    c = verbs_client
    sizes = [0, 1, ACC_SIZE + 1, 3, CHUNK_SIZE + 1, 17]
    bodies = [payload.make(i, s) for i, s in enumerate(sizes)]
    got = list(c.stub.Bidi(iter(c.req(payload=b) for b in bodies), timeout=_timeout(4 * sum(sizes))))
    assert [r.payload for r in got] == bodies
    resp = c.stub.ClientStream(iter(c.req(payload=b) for b in bodies), timeout=_timeout(2 * sum(sizes)))
    assert resp.size == sum(sizes) and resp.digest == payload.sha256(b"".join(bodies))
    call = c.stub.ServerStream(c.req(response_count=5, response_size=ACC_SIZE + 1,
                                     response_seed=100), timeout=120)
    assert [r.payload for r in call] == [payload.make(100 + i, ACC_SIZE + 1) for i in range(5)]


def test_many_small_messages_keep_order(verbs_client: Client) -> None:
    bodies = [i.to_bytes(4, "little") * (i % 7) for i in range(500)]
    got = list(verbs_client.stub.Bidi(iter(verbs_client.req(payload=b) for b in bodies),
                                      timeout=120))
    assert [r.payload for r in got] == bodies


def test_status_and_metadata(verbs_client: Client) -> None:
    c = verbs_client
    with pytest.raises(grpc.RpcError) as info:
        c.stub.Unary(c.req(abort_code=grpc.StatusCode.NOT_FOUND.value[0], abort_details="nope"),
                     timeout=60)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and info.value.details() == "nope"
    resp, call = c.stub.Unary.with_call(c.req(payload=b"m", echo_metadata=True), timeout=60,
                                        metadata=[("x-key", "v"), ("x-bin", b"\x00\x01")])
    assert resp.payload == b"m"
    assert ("x-key", "v") in list(call.trailing_metadata())


def test_deadline_exceeded(verbs_client: Client) -> None:
    with pytest.raises(grpc.RpcError) as info:
        verbs_client.stub.Unary(verbs_client.req(sleep_ms=5000), timeout=1.0)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_cancel_reaches_server(verbs_client: Client) -> None:
    c = verbs_client
    tag = new_tag()
    fut = c.stub.Unary.future(c.req(tag=tag, wait_for_cancel=True, wait_limit_ms=60000),
                              timeout=120)
    obs = c.wait_obs(tag, lambda o: bool(o.get("waiting")), timeout=60)
    assert obs.get("waiting"), f"handler did not start: {obs}"
    assert fut.cancel() is True
    with pytest.raises(grpc.FutureCancelledError):
        fut.result(timeout=30)
    obs = c.wait_obs(tag, lambda o: bool(o.get("wait_ended")), timeout=60)
    assert obs.get("wait_ended") and obs.get("is_active_after") is False, obs
    # the connection is still good afterwards
    assert c.stub.Unary(c.req(payload=b"after"), timeout=60).payload == b"after"
    assert c.channel.transport == "verbs"
