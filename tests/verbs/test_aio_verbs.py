"""argrpc.aio over the verbs fabric: an asyncio client and an asyncio server, each its own
process with TF_RDMA_TRANSPORT=verbs, on a real (Soft-RoCE) device. The loop's notifier
and non-blocking calls are fabric-independent; this shows they carry verbs too:
every arity, 0 B to 16 MiB byte-exact, a deadline and a cancel."""
from __future__ import annotations

from types import SimpleNamespace

from tests.aio.servers import AioServer
from tests.support.procs import script_result

VERBS = {"TF_RDMA_BUF_SIZE": "256M", "TF_RDMA_TRANSPORT": "verbs"}  # small pools: 2 GiB guest

CLIENT_SCRIPT = r"""
import asyncio, hashlib, json, os, time
import grpc
from argrpc import aio
from tests.aio.aio_service import UNLIMITED, method

MiB = 1 << 20


async def main(out):
    async with aio.insecure_channel(os.environ["AIO_TARGET"], options=UNLIMITED) as ch:
        echo = ch.unary_unary(method("echo"))
        sizes = [0, 100, 70_000, 4 * MiB, 16 * MiB]
        out["echo"] = []
        for n in sizes:
            body = bytes(range(256)) * (n // 256) + b"q" * (n % 256)
            out["echo"].append((n, await echo(body, timeout=60) == body))
        out["transport"] = [ch.transport, ch.fallback_reason]
        out["count"] = [len(m) async for m in ch.unary_stream(method("count"))(b"3,1048576",
                                                                             timeout=60)]
        out["join"] = bytes(await ch.stream_unary(method("join"))(iter([b"a", b"b" * 70_000]),
                                                              timeout=60)).count(b"b")
        out["bidi"] = [len(m) async for m in ch.stream_stream(method("bidi"))(
            iter([b"x" * 10, b"y" * (2 * MiB)]), timeout=60)]
        out["gathered"] = sorted(await asyncio.gather(*(echo(b"%d" % i, timeout=60)
                                                        for i in range(200)))) == \
            sorted(b"%d" % i for i in range(200))
        started = time.monotonic()
        try:
            await ch.unary_unary(method("hang"))(b"verbs-deadline", timeout=0.5)
            out["deadline"] = "no error"
        except aio.AioRpcError as e:
            out["deadline"] = [e.code().name, round(time.monotonic() - started, 2)]
        call = ch.unary_unary(method("hang"))(b"verbs-cancel", timeout=30)
        await asyncio.sleep(0.3)
        call.cancel()
        try:
            await call
            out["cancel"] = "no error"
        except asyncio.CancelledError:
            out["cancel"] = "cancelled"
        out["transport_after"] = [ch.transport, ch.fallback_reason]


out = {}
asyncio.run(main(out))
print("RESULT " + json.dumps(out), flush=True)
"""


def test_aio_client_and_server_over_verbs(rdma: SimpleNamespace) -> None:
    server = AioServer("argrpc", env=VERBS)
    try:
        r = script_result(CLIENT_SCRIPT, {**VERBS, "AIO_TARGET": server.target})
    finally:
        server.kill()
    assert r["transport"] == ["verbs", ""], r["transport"]
    assert all(ok for _, ok in r["echo"]), r["echo"]
    assert r["count"] == [1 << 20] * 3
    assert r["join"] == 70_000
    assert r["bidi"] == [10, 2 << 20]
    assert r["gathered"]
    assert r["deadline"][0] == "DEADLINE_EXCEEDED" and r["deadline"][1] < 3, r["deadline"]
    assert r["cancel"] == "cancelled"
    assert r["transport_after"] == ["verbs", ""], r["transport_after"]
