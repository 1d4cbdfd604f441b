"""An argrpc.aio client under load, run as its own process so a test can kill it at any
moment: mixed unary, streaming and large calls from one loop, forever.

    python -m tests.aio.aio_load TARGET

Prints "READY <transport>" after its first call, then calls until killed.
"""
from __future__ import annotations

import asyncio
import sys

from argrpc import aio
from tests.aio.aio_service import UNLIMITED, method

SIZES = (0, 64, 4096, 300_000, 3 << 20)


async def _worker(channel: aio.Channel, seed: int) -> None:
    echo = channel.unary_unary(method("echo"))
    count = channel.unary_stream(method("count"))
    bidi = channel.stream_stream(method("bidi"))
    i = seed
    while True:
        i += 1
        kind = i % 3
        size = SIZES[i % len(SIZES)]
        if kind == 0:
            body = bytes([i % 251]) * size
            assert await echo(body, timeout=30) == body
        elif kind == 1:
            got = [m async for m in count(b"4,%d" % size, timeout=30)]
            assert len(got) == 4
        else:
            got = [m async for m in bidi(iter([b"a" * size, b"b"]), timeout=30)]
            assert len(got) == 2


async def main(target: str) -> None:
    async with aio.insecure_channel(target, options=UNLIMITED) as channel:
        await channel.unary_unary(method("echo"))(b"hi", timeout=30)
        print(f"READY {channel.transport}", flush=True)
        await asyncio.gather(*[_worker(channel, s) for s in range(8)])


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
