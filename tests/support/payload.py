"""Deterministic payloads that both the client and the server process can rebuild."""
from __future__ import annotations

import hashlib

import numpy as np

from argrpc._config import knob

# A period that is not a divisor of any power of two, so a chunk copied to the wrong
# offset (chunks are powers of two) never lands on identical bytes.
_PERIOD = (1 << 20) + 7

ACC_SIZE: int = knob("TF_RDMA_ACC_SIZE").default
CHUNK_SIZE: int = knob("TF_RDMA_CHUNK_SIZE").default
MiB = 1 << 20


def make(seed: int, size: int) -> bytes:
    """Pseudo-random bytes of `size`, fully determined by `seed`."""
    if size <= 0:
        return b""
    base = np.random.default_rng(seed).integers(0, 256, min(size, _PERIOD), dtype=np.uint8)
    return np.resize(base, size).tobytes()


def sha256(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def _varint_len(n: int) -> int:
    length = 1
    while n >= 0x80:
        n >>= 7
        length += 1
    return length


def payload_for_message_size(message_size: int) -> int:
    """Payload length whose EchoRequest{payload} serialises to exactly `message_size` bytes.

    Field 1 (bytes) costs one tag byte plus the varint length prefix.
    """
    if message_size == 0:
        return 0
    for payload in range(max(0, message_size - 11), message_size):
        if payload and 1 + _varint_len(payload) + payload == message_size:
            return payload
    raise ValueError(f"no payload serialises to exactly {message_size} bytes")
