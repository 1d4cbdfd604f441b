"""Conformance cases shared by the groups that run them on another fabric or across hosts
(tests/verbs/test_conformance_verbs.py in one guest, tests/pair across two): each takes
a connected Client and a base timeout, and asserts what grpc would give."""
from __future__ import annotations

import grpc
import pytest

from tests.support import payload
from tests.support.clients import Client, new_tag
from tests.support.payload import ACC_SIZE, CHUNK_SIZE, MiB

# 0 B, both sides of the eager limit, one and several rendezvous chunks, and 64 MiB.
PAYLOAD_SIZES = [0, 1, ACC_SIZE - 1, ACC_SIZE + 1, CHUNK_SIZE + 1, 2 * CHUNK_SIZE + 3, 64 * MiB]


def timeout(base: float, size: int) -> float:
    """A deadline for moving `size` bytes on an emulated fabric (tens of MB/s at best)."""
    return base + size / (1 << 20)


def unary_payload_byte_exact(c: Client, size: int, base: float) -> None:
    body = payload.make(size, size)
    resp = c.stub.Unary(c.req(payload=body), timeout=timeout(base, 2 * size))
    assert resp.size == size and payload.sha256(resp.payload) == payload.sha256(body)


def server_to_client_rendezvous(c: Client, base: float) -> None:
    size = 3 * CHUNK_SIZE + 5
    resp = c.stub.Unary(c.req(response_size=size, response_seed=31), timeout=timeout(base, size))
    assert resp.payload == payload.make(31, size)


def streaming_arities(c: Client, base: float) -> None:
    sizes = [0, 1, ACC_SIZE + 1, 3, CHUNK_SIZE + 1, 17]
    bodies = [payload.make(i, s) for i, s in enumerate(sizes)]
    got = list(c.stub.Bidi(iter(c.req(payload=b) for b in bodies),
                           timeout=timeout(base, 4 * sum(sizes))))
    assert [r.payload for r in got] == bodies
    resp = c.stub.ClientStream(iter(c.req(payload=b) for b in bodies),
                               timeout=timeout(base, 2 * sum(sizes)))
    assert resp.size == sum(sizes) and resp.digest == payload.sha256(b"".join(bodies))
    call = c.stub.ServerStream(c.req(response_count=5, response_size=ACC_SIZE + 1,
                                     response_seed=100), timeout=base)
    assert [r.payload for r in call] == [payload.make(100 + i, ACC_SIZE + 1) for i in range(5)]


def status_and_metadata(c: Client, base: float) -> None:
    with pytest.raises(grpc.RpcError) as info:
        c.stub.Unary(c.req(abort_code=grpc.StatusCode.NOT_FOUND.value[0], abort_details="nope"),
                     timeout=base)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and info.value.details() == "nope"
    resp, call = c.stub.Unary.with_call(c.req(payload=b"m", echo_metadata=True), timeout=base,
                                        metadata=[("x-key", "v"), ("x-bin", b"\x00\x01")])
    assert resp.payload == b"m"
    assert ("x-key", "v") in list(call.trailing_metadata())


def deadline_exceeded(c: Client) -> None:
    with pytest.raises(grpc.RpcError) as info:
        c.stub.Unary(c.req(sleep_ms=5000), timeout=1.0)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def cancel_reaches_server(c: Client, base: float) -> None:
    tag = new_tag()
    fut = c.stub.Unary.future(c.req(tag=tag, wait_for_cancel=True, wait_limit_ms=60000),
                              timeout=2 * base)
    obs = c.wait_obs(tag, lambda o: bool(o.get("waiting")), timeout=base)
    assert obs.get("waiting"), f"handler did not start: {obs}"
    assert fut.cancel() is True
    with pytest.raises(grpc.FutureCancelledError):
        fut.result(timeout=30)
    obs = c.wait_obs(tag, lambda o: bool(o.get("wait_ended")), timeout=base)
    assert obs.get("wait_ended") and obs.get("is_active_after") is False, obs
    # the connection is still good afterwards
    assert c.stub.Unary(c.req(payload=b"after"), timeout=base).payload == b"after"
