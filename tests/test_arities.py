"""All four arities, through every calling style of the multicallables."""
from __future__ import annotations

import json
import queue
import threading
from typing import Any, Iterator

import grpc

from tests.support import payload
from tests.support.clients import Client, check_transport


def test_transport_negotiated(client: Client, pair: tuple[str, str]) -> None:
    # The fixture already checked after a warm-up call; check again after more calls.
    for _ in range(3):
        client.stub.Unary(client.req(payload=b"x"), timeout=20)
    check_transport(client.channel, *pair)
    assert isinstance(client.channel, grpc.Channel)
    # The server must agree; and whichever way the call went, its peer and auth context
    # read as grpc's (the address the client negotiated from, an insecure connection).
    info = json.loads(client.stub.Unary(client.req(payload=b"p"), timeout=20).info)
    assert info["transport"] == ("shm" if pair == ("argrpc", "argrpc") else "grpc"), info
    assert info["transport_peer"].startswith("shm:pid=" if pair == ("argrpc", "argrpc") else ""), info
    assert info["peer"].startswith(("ipv4:", "ipv6:")), info
    assert info["auth"] == {"transport_security_type": ["insecure"],
                            "security_level": ["TSI_SECURITY_NONE"]}, info


def test_unary_call_styles(client: Client) -> None:
    resp = client.stub.Unary(client.req(payload=b"hello"), timeout=20)
    assert resp.payload == b"hello"

    resp, call = client.stub.Unary.with_call(client.req(payload=b"with_call"), timeout=20)
    assert resp.payload == b"with_call"
    assert call.code() == grpc.StatusCode.OK
    assert isinstance(call, grpc.Call)

    fut = client.stub.Unary.future(client.req(payload=b"future"), timeout=20)
    assert isinstance(fut, grpc.Future)
    assert fut.result(timeout=20).payload == b"future"
    assert fut.done() and not fut.cancelled()
    assert fut.exception() is None
    assert fut.code() == grpc.StatusCode.OK

    done = threading.Event()
    fut2 = client.stub.Unary.future(client.req(payload=b"cb"), timeout=20)
    fut2.add_done_callback(lambda f: done.set())
    assert done.wait(30)
    assert fut2.result().payload == b"cb"


def test_server_stream(client: Client) -> None:
    call = client.stub.ServerStream(
        client.req(response_count=5, response_size=1000, response_seed=7), timeout=20)
    got = list(call)
    assert [r.index for r in got] == list(range(5))
    for r in got:
        assert r.payload == payload.make(7 + r.index, 1000)
    assert call.code() == grpc.StatusCode.OK


def test_server_stream_no_messages(client: Client) -> None:
    call = client.stub.ServerStream(client.req(response_count=-1), timeout=20)
    assert list(call) == []
    assert call.code() == grpc.StatusCode.OK


def test_server_stream_next(client: Client) -> None:
    call = client.stub.ServerStream(client.req(response_count=3, payload=b"n"), timeout=20)
    assert next(call).index == 0
    assert next(call).index == 1
    assert next(call).index == 2
    try:
        next(call)
        raise AssertionError("stream should have ended")
    except StopIteration:
        pass
    assert call.code() == grpc.StatusCode.OK


def test_client_stream(client: Client) -> None:
    chunks = [payload.make(i, 100 * i) for i in range(10)]
    reqs = (client.req(payload=c) for c in chunks)
    resp = client.stub.ClientStream(reqs, timeout=20)
    assert resp.size == sum(map(len, chunks))
    assert resp.index == 10
    assert resp.digest == payload.sha256(b"".join(chunks))

    resp, call = client.stub.ClientStream.with_call(iter([client.req(payload=b"a")]), timeout=20)
    assert resp.size == 1 and call.code() == grpc.StatusCode.OK

    fut = client.stub.ClientStream.future(iter([client.req(payload=b"ab")]), timeout=20)
    assert fut.result(timeout=20).size == 2


def test_client_stream_no_messages(client: Client) -> None:
    resp = client.stub.ClientStream(iter(()), timeout=20)
    assert resp.size == 0 and resp.index == 0
    assert resp.digest == payload.sha256(b"")


def test_bidi_ping_pong(client: Client) -> None:
    """Each request is sent only after the previous response arrived: real interleaving."""
    outbox: queue.Queue[Any] = queue.Queue()

    def requests() -> Iterator[Any]:
        while (item := outbox.get()) is not None:
            yield item

    call = client.stub.Bidi(requests(), timeout=30)
    try:
        for i in range(20):
            body = payload.make(i, i * 37)
            outbox.put(client.req(payload=body))
            resp = next(call)
            assert resp.payload == body
    finally:
        outbox.put(None)
    assert list(call) == []
    assert call.code() == grpc.StatusCode.OK


def test_bidi_many_responses_per_request(client: Client) -> None:
    reqs = [client.req(payload=b"q", response_count=3, response_size=10, response_seed=i * 10)
            for i in range(4)]
    got = list(client.stub.Bidi(iter(reqs), timeout=20))
    assert len(got) == 12
    assert [r.index for r in got] == [0, 1, 2] * 4
    assert got[4].payload == payload.make(10 + 1, 10)


def test_bidi_no_messages(client: Client) -> None:
    call = client.stub.Bidi(iter(()), timeout=20)
    assert list(call) == []
    assert call.code() == grpc.StatusCode.OK


def test_generic_multicallable_raw_bytes(client: Client) -> None:
    """channel.unary_unary with no (de)serializers moves bytes as they are."""
    method = client.channel.unary_unary("/argrpc.test.Raw/Invert")
    data = bytes(range(256))
    assert method(data, timeout=20) == bytes(255 - b for b in data)
