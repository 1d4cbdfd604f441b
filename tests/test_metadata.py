"""Metadata both ways, text and binary (-bin) keys, initial and trailing, every arity."""
from __future__ import annotations

import base64
import json

import grpc

from tests.support.clients import Client, md_pairs

MD = (
    ("x-text", "hello"),
    ("x-empty", ""),
    ("x-long", "v" * 4000),
    ("x-raw-bin", bytes(range(256))),
    ("x-zero-bin", b"\x00"),
    ("x-repeat", "one"),
    ("x-repeat", "two"),
)


def _seen_by_server(resp_info: str) -> list[tuple[str, object]]:
    """Decode the invocation metadata the servicer reported back."""
    out: list[tuple[str, object]] = []
    for key, value in json.loads(resp_info)["metadata"]:
        if isinstance(value, str) and value.startswith("b64:"):
            out.append((key, base64.b64decode(value[4:])))
        else:
            out.append((key, value))
    return [(k, v) for k, v in out if k.startswith("x-")]


def test_invocation_metadata_reaches_server(client: Client) -> None:
    resp = client.stub.Unary(client.req(payload=b"m"), metadata=MD, timeout=20)
    assert _seen_by_server(resp.info) == list(MD)


def test_binary_values_are_bytes_text_values_str(client: Client) -> None:
    _, call = client.stub.Unary.with_call(client.req(echo_metadata=True), metadata=MD,
                                          timeout=20)
    for key, value in md_pairs(call.trailing_metadata()):
        assert isinstance(value, bytes if key.endswith("-bin") else str), key


def test_unary_initial_and_trailing(client: Client) -> None:
    resp, call = client.stub.Unary.with_call(client.req(echo_metadata=True, payload=b"m"),
                                             metadata=MD, timeout=20)
    assert resp.payload == b"m"
    assert md_pairs(call.initial_metadata()) == list(MD)
    assert md_pairs(call.trailing_metadata()) == list(MD)


def test_unary_future_metadata(client: Client) -> None:
    fut = client.stub.Unary.future(client.req(echo_metadata=True), metadata=MD, timeout=20)
    fut.result(timeout=20)
    assert md_pairs(fut.initial_metadata()) == list(MD)
    assert md_pairs(fut.trailing_metadata()) == list(MD)


def test_server_stream_metadata(client: Client) -> None:
    call = client.stub.ServerStream(client.req(echo_metadata=True, response_count=3),
                                    metadata=MD, timeout=20)
    # initial metadata is available before the messages are read
    assert md_pairs(call.initial_metadata()) == list(MD)
    assert len(list(call)) == 3
    assert md_pairs(call.trailing_metadata()) == list(MD)
    assert call.code() == grpc.StatusCode.OK


def test_client_stream_metadata(client: Client) -> None:
    reqs = iter([client.req(echo_metadata=True, payload=b"a"), client.req(payload=b"b")])
    resp, call = client.stub.ClientStream.with_call(reqs, metadata=MD, timeout=20)
    assert resp.size == 2
    assert _seen_by_server(resp.info) == list(MD)
    assert md_pairs(call.initial_metadata()) == list(MD)
    assert md_pairs(call.trailing_metadata()) == list(MD)


def test_bidi_metadata(client: Client) -> None:
    reqs = iter([client.req(echo_metadata=True, payload=b"a"), client.req(payload=b"b")])
    call = client.stub.Bidi(reqs, metadata=MD, timeout=20)
    assert md_pairs(call.initial_metadata()) == list(MD)
    got = list(call)
    assert [r.payload for r in got] == [b"a", b"b"]
    assert _seen_by_server(got[0].info) == list(MD)
    assert md_pairs(call.trailing_metadata()) == list(MD)


def test_no_metadata_sent(client: Client) -> None:
    _, call = client.stub.Unary.with_call(client.req(echo_metadata=True), timeout=20)
    assert md_pairs(call.initial_metadata()) == []
    assert md_pairs(call.trailing_metadata()) == []


def test_conversion_is_shared_between_equal_lists_and_stays_right() -> None:
    """The server converts each call's metadata; equal engine lists share one converted
    tuple, and the cache never answers for a different list."""
    from argrpc import _metadata
    raw = [("user-agent", b"ua/1"), ("k-bin", b"\x00\xff"), ("t", b"v")]
    first = _metadata.from_core(list(raw))
    assert first == (("user-agent", "ua/1"), ("k-bin", b"\x00\xff"), ("t", "v"))
    assert first[1].key == "k-bin" and first[1].value == b"\x00\xff"
    assert _metadata.from_core(list(raw)) is first
    assert _metadata.from_core([("t", b"w")]) == (("t", "w"),)
    # unhashable entries are converted without the cache
    assert _metadata.from_core([["t", bytearray(b"x")]]) == (("t", "x"),)
    # past the cache's size, every answer is still its own list's
    for i in range(3 * _metadata._CONVERTED_MAX):
        assert _metadata.from_core([("k", str(i).encode())]) == (("k", str(i)),)
    assert len(_metadata._CONVERTED) <= _metadata._CONVERTED_MAX
