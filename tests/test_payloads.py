"""Payload sizes around the engine's boundaries and far beyond, byte-exact."""
from __future__ import annotations

import pytest

from tests.support import payload
from tests.support.clients import SHM_AND_REFERENCE, Client, deadline, pair_id
from tests.support.payload import ACC_SIZE, CHUNK_SIZE, MiB

SIZES = [0, 1, 100, ACC_SIZE - 1, ACC_SIZE, ACC_SIZE + 1, 64 * 1024,
         CHUNK_SIZE - 1, CHUNK_SIZE, CHUNK_SIZE + 1, 2 * CHUNK_SIZE + 3]
# Serialized EchoRequest sizes exactly at the boundaries (the engine sees message bytes).
MESSAGE_SIZES = [ACC_SIZE - 1, ACC_SIZE, ACC_SIZE + 1, CHUNK_SIZE - 1, CHUNK_SIZE, CHUNK_SIZE + 1]


@pytest.mark.parametrize("size", SIZES)
def test_unary_echo_payload(client: Client, size: int) -> None:
    body = payload.make(size, size)
    resp = client.stub.Unary(client.req(payload=body), timeout=deadline(size))
    assert resp.size == size
    assert len(resp.payload) == size
    assert resp.payload == body


@pytest.mark.parametrize("message_size", MESSAGE_SIZES)
def test_unary_exact_message_size(client: Client, message_size: int) -> None:
    body = payload.make(message_size, payload.payload_for_message_size(message_size))
    req = client.req(payload=body)
    assert req.ByteSize() == message_size
    assert client.stub.Unary(req, timeout=deadline(message_size)).payload == body


@pytest.mark.parametrize("size", [0, ACC_SIZE + 1, CHUNK_SIZE + 1])
def test_server_generated_payload(client: Client, size: int) -> None:
    """Server -> client direction independently of what the client sent."""
    resp = client.stub.Unary(client.req(response_size=size, response_seed=11),
                             timeout=deadline(size))
    assert resp.payload == payload.make(11, size)


def test_stream_mixed_sizes(client: Client) -> None:
    sizes = [0, 1, ACC_SIZE - 1, ACC_SIZE + 1, 3, CHUNK_SIZE + 1, 17, ACC_SIZE, 0, 5 * MiB]
    bodies = [payload.make(i, s) for i, s in enumerate(sizes)]
    got = list(client.stub.Bidi(iter(client.req(payload=b) for b in bodies), timeout=60))
    assert [len(r.payload) for r in got] == sizes
    assert all(r.payload == b for r, b in zip(got, bodies))

    resp = client.stub.ClientStream(iter(client.req(payload=b) for b in bodies), timeout=60)
    assert resp.size == sum(sizes)
    assert resp.digest == payload.sha256(b"".join(bodies))

    call = client.stub.ServerStream(
        client.req(response_count=6, response_size=ACC_SIZE + 1, response_seed=100), timeout=60)
    assert [r.payload for r in call] == [payload.make(100 + i, ACC_SIZE + 1) for i in range(6)]


def test_many_small_messages_in_one_stream(client: Client) -> None:
    """Small messages coalesce (eager path); order and content must survive."""
    bodies = [i.to_bytes(4, "little") * (i % 7) for i in range(2000)]
    got = list(client.stub.Bidi(iter(client.req(payload=b) for b in bodies), timeout=60))
    assert [r.payload for r in got] == bodies


@pytest.mark.slow
def test_100mib_echo_both_ways(client: Client) -> None:
    body = payload.make(100, 100 * MiB)
    resp = client.stub.Unary(client.req(payload=body), timeout=240)
    assert resp.size == len(body)
    assert len(resp.payload) == len(body)
    assert payload.sha256(resp.payload) == payload.sha256(body)


@pytest.mark.slow
@pytest.mark.parametrize("pair", SHM_AND_REFERENCE, ids=pair_id, indirect=True)
def test_256mib_client_to_server(client: Client) -> None:
    body = payload.make(256, 256 * MiB)
    resp = client.stub.Unary(client.req(payload=body, digest_only=True), timeout=240)
    assert resp.size == len(body)
    assert resp.digest == payload.sha256(body)


@pytest.mark.slow
@pytest.mark.parametrize("pair", SHM_AND_REFERENCE, ids=pair_id, indirect=True)
def test_256mib_server_to_client(client: Client) -> None:
    resp = client.stub.Unary(client.req(response_size=256 * MiB, response_seed=257), timeout=240)
    assert len(resp.payload) == 256 * MiB
    assert payload.sha256(resp.payload) == payload.sha256(payload.make(257, 256 * MiB))
