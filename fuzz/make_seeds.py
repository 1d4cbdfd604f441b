#!/usr/bin/env python3
"""Writes the fuzzer's seed corpus: inputs of [u16 length][batch] records that open
calls and drive every frame type, so mutation starts from frames the parser accepts.

    python3 fuzz/make_seeds.py DIR
"""
from __future__ import annotations

import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.frames import (FIN, HALF_CLOSE, MESSAGE, PING, RST, TRAILERS,  # noqa: E402
                                  WINDOW, frame, headers, rts, status)


def record(*batches: bytes) -> bytes:
    return b"".join(struct.pack("<H", len(b)) + b for b in batches)


SEEDS = {
    "unary": record(headers(1, md=[(b"k", b"v")]) + frame(MESSAGE, 1, b"\x0a\x03abc")
                    + frame(HALF_CLOSE, 1)),
    "two_batches": record(headers(1), frame(MESSAGE, 1, b"x" * 100) + frame(HALF_CLOSE, 1)),
    "stream_window_rst": record(headers(3, "/argrpc.test.Echo/Bidi", timeout_us=5_000_000)
                                + frame(WINDOW, 3, struct.pack("<Q", 4096))
                                + frame(RST, 3, status(1, b"cancelled")[:4] + b"\0" * 4)),
    # Key 1 at offset 0: the block the fuzzer's client exposes first (frame_fuzzer.cc).
    "rts_fin": record(headers(5) + rts(5, 1, 64 * 1024, 0, 1), frame(FIN, 0, struct.pack("<Q", 1))),
    "ping_trailers": record(frame(PING, 0) + frame(TRAILERS, 7, status(0, b"ok"))),
    "many_calls": record(*[headers(2 * i + 1) + frame(HALF_CLOSE, 2 * i + 1) for i in range(8)]),
}


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "fuzz/corpus")
    out.mkdir(parents=True, exist_ok=True)
    for name, data in SEEDS.items():
        (out / name).write_bytes(data)
    print(f"{len(SEEDS)} seeds in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
