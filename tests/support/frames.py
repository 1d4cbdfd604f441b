"""The v1 wire format (csrc/engine/frame.h), written by hand the way a hostile peer
would: for tests/test_hostile_peer.py and the fuzzer's seed corpus (fuzz/make_seeds.py)."""
from __future__ import annotations

import struct

HEADERS, MESSAGE, RTS, FIN, HALF_CLOSE, TRAILERS, RST, WINDOW, PING = range(1, 10)


def frame(kind: int, stream: int, body: bytes = b"", length: int | None = None) -> bytes:
    """One frame: the 16-byte header (type, flags, reserved, len, stream) + padded body."""
    n = len(body) if length is None else length
    raw = struct.pack("<BBHIQ", kind, 0, 0, n, stream) + body
    return raw + b"\0" * (-len(raw) % 8)


def string(s: bytes) -> bytes:
    return struct.pack("<I", len(s)) + s


def metadata(pairs: list[tuple[bytes, bytes]]) -> bytes:
    return struct.pack("<I", len(pairs)) + b"".join(string(k) + string(v) for k, v in pairs)


def headers(stream: int, method: str = "/argrpc.test.Echo/Unary", timeout_us: int = -1,
            md: list[tuple[bytes, bytes]] | None = None) -> bytes:
    """A client's HEADERS: timeout, method, metadata."""
    body = struct.pack("<q", timeout_us) + string(method.encode()) + metadata(md or [])
    return frame(HEADERS, stream, body)


def rts(stream: int, rdv: int, length: int, addr: int, key: int) -> bytes:
    return frame(RTS, stream, struct.pack("<QQQII", rdv, length, addr, key, 0))


def status(code: int, details: bytes, md: list[tuple[bytes, bytes]] | None = None) -> bytes:
    return struct.pack("<I", code) + string(details) + metadata(md or [])
