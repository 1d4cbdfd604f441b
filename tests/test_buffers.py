"""Non-protobuf payloads: buffer-protocol serializers (numpy, memoryview) and raw bytes.

argrpc accepts any buffer-protocol object from a serializer; plain grpc only bytes, so
grpc clients serialize with .tobytes() — the bytes on the wire and the checks are equal.
The server side inverts every byte (tests.support.servicer.raw_handler) so a reply can
not be mistaken for the request buffer itself.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

from tests.support.clients import Client, deadline
from tests.support.payload import ACC_SIZE, CHUNK_SIZE, MiB
from tests.support.servicer import RAW_METHOD

SIZES = [0, 1, ACC_SIZE - 1, ACC_SIZE, ACC_SIZE + 1, CHUNK_SIZE - 1, CHUNK_SIZE + 1,
         16 * MiB + 3]


def _serializer(stack: str, kind: str) -> Callable[[np.ndarray], Any]:
    if stack != "argrpc":
        return lambda a: a.tobytes()
    if kind == "numpy":
        return lambda a: a
    return lambda a: memoryview(a).cast("B")


def _method(client: Client, kind: str, seen: list[type]) -> Any:
    def deserialize(data: Any) -> Any:
        seen.append(type(data))
        return data
    return client.channel.unary_unary(
        RAW_METHOD, request_serializer=_serializer(client.stack, kind),
        response_deserializer=deserialize)


@pytest.mark.parametrize("kind", ["numpy", "memoryview"])
def test_buffer_serializer_roundtrip(client: Client, kind: str) -> None:
    method = _method(client, kind, seen := [])
    for size in SIZES:
        seen.clear()
        array = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        reply = method(array, timeout=deadline(size))
        assert len(seen) == 1 and issubclass(seen[0], (bytes, memoryview)), (size, seen)
        got = np.frombuffer(reply, dtype=np.uint8)
        assert got.size == size
        assert np.array_equal(got, np.bitwise_not(array)), f"{size} B corrupted"


def test_float_array(client: Client) -> None:
    array = np.linspace(-1, 1, 1_000_003, dtype=np.float32)
    reply = _method(client, "numpy", [])(array, timeout=deadline(array.nbytes))
    back = np.bitwise_not(np.frombuffer(reply, dtype=np.uint8)).view(np.float32)
    assert np.array_equal(back, array)


def test_received_views_stay_valid(client: Client) -> None:
    """Replies kept alive by the caller must not be overwritten by later calls."""
    method = _method(client, "numpy", [])
    arrays = [np.full(CHUNK_SIZE + 7, i, dtype=np.uint8) for i in range(6)]
    replies = [method(a, timeout=deadline(a.nbytes)) for a in arrays]
    for _ in range(4):  # more traffic through the same pool
        method(np.zeros(CHUNK_SIZE + 7, dtype=np.uint8), timeout=deadline(CHUNK_SIZE))
    for i, reply in enumerate(replies):
        got = np.frombuffer(reply, dtype=np.uint8)
        assert np.all(got == (255 - i)), f"reply {i} changed after later calls"


def test_numpy_frombuffer_view(client: Client) -> None:
    method = client.channel.unary_unary(
        RAW_METHOD, request_serializer=_serializer(client.stack, "numpy"),
        response_deserializer=lambda b: np.frombuffer(b, dtype=np.uint8))
    array = np.arange(CHUNK_SIZE * 2, dtype=np.uint64).view(np.uint8)
    got = method(array, timeout=deadline(array.nbytes))
    assert np.array_equal(got, np.bitwise_not(array))
