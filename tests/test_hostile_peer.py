"""A hostile peer: it negotiates correctly (real bootstrap RPC, real shm handshake), then
writes malformed or oversized frames into the server's receive ring with the real
fabric, bypassing the engine's framing (`Connection._probe_raw_batch`).

For each kind of bad input the server must close that connection with a log line that
says what was wrong, keep running, keep serving another client byte-exact, and end up
with its connection count and pool back where they were.
"""
from __future__ import annotations

import asyncio
import struct
import time
from types import SimpleNamespace
from typing import Any, Callable

import grpc
import pytest

from tests.support import inproc, payload
from tests.support.clients import UNLIMITED_SERVER_ARGS
from tests.support.faults import Baseline, ShmClient
from tests.support.frames import (FIN, HALF_CLOSE, HEADERS, MESSAGE, PING, RTS, frame,
                                  headers, metadata, rts, string)
from tests.support.procs import ServerProcess
from tests.support.hooks import needs_test_hooks

pytestmark = needs_test_hooks

SETTLE_S = 10.0
# A client stream id above any the warm-up calls used (ids must grow and be odd).
S = 1001
# name -> (batch, what the server's log line must say)
CASES: dict[str, tuple[bytes, str]] = {
    "length_not_multiple_of_8": (b"\0" * 13, "batch immediate 13 is invalid"),
    "truncated_header": (b"\0" * 8, "truncated frame header"),
    "frame_past_batch": (frame(PING, 0, b"", length=4096), "runs past its batch"),
    "unknown_type": (frame(200, S), "unknown frame type 200"),
    "even_stream_id": (headers(2), "reused or not a client id"),
    "stream_id_reused": (headers(S) + headers(S), "reused or not a client id"),
    "metadata_count_huge": (
        frame(HEADERS, S, struct.pack("<q", -1) + struct.pack("<I", 4) + b"/a/b"
              + struct.pack("<I", 0xFFFFFFFF)), "malformed HEADERS frame"),
    "string_length_past_end": (
        frame(HEADERS, S, struct.pack("<q", -1) + struct.pack("<I", 1 << 30)),
        "malformed HEADERS frame"),
    "rts_outside_pool": (
        headers(S) + rts(S, 1, 1 << 20, 0xDEAD0000, 7),
        "outside the peer's pool"),
    "rts_truncated": (headers(S) + frame(RTS, S, b"\1" * 12), "malformed RTS frame"),
    "fin_never_announced": (frame(FIN, 0, struct.pack("<Q", 12345)),
                            "FIN for a rendezvous that was never announced"),
}


def window_overrun(pb2: Any) -> list[bytes]:
    """A unary call whose handler reads its one request and sleeps, then more eager
    messages on it than the receiver's window (1 MiB) allows, over three batches."""
    first = pb2.EchoRequest(sleep_ms=20000).SerializeToString()
    flood = b"".join(frame(MESSAGE, S, b"x" * 8000) for _ in range(60))
    return [headers(S) + frame(MESSAGE, S, first), flood, flood, flood]


@pytest.fixture
def server(spawn: Callable[..., ServerProcess]) -> ServerProcess:
    return spawn("argrpc", UNLIMITED_SERVER_ARGS)


def _log_has(server: ServerProcess, text: str, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if text in server.log_tail(200):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("case", [*CASES, "window_overrun"])
def test_malformed_batch_closes_only_that_connection(case: str, server: ServerProcess,
                                                     pb: SimpleNamespace) -> None:
    if case == "window_overrun":
        batches, reason = window_overrun(pb.pb2), "overran the flow-control window"
    else:
        batches, reason = [CASES[case][0]], CASES[case][1]
    other, hostile = ShmClient(server.target, pb), ShmClient(server.target, pb)
    try:
        other.echo(payload.CHUNK_SIZE + 1, 1)
        hostile.echo(10, 2)
        base = Baseline(server)
        assert base.pool["connections"] == 2, base.pool
        conn = hostile.connection()
        for batch in batches:
            if not conn._probe_raw_batch(batch):
                break  # the server already closed it
        assert _log_has(server, reason, SETTLE_S), (
            f"no log line with {reason!r}\n{server.log_tail()}")
        # The server drops the connection and tells us: our side dies too.
        end = time.monotonic() + SETTLE_S
        while conn.alive and time.monotonic() < end:
            time.sleep(0.02)
        assert not conn.alive, "the hostile connection was not closed"
        assert server.alive()
        other.echo(2 * payload.CHUNK_SIZE + 3, 3)  # rendezvous both ways, byte-exact
        other.echo(100, 4)
        base.pool["connections"] = 1  # the hostile one is gone; nothing else may be
        problems, took = base.problems(SETTLE_S)
        assert not problems, f"{case}: after {took:.1f}s: {problems}"
        # The hostile client's channel renegotiates: a fresh connection works.
        hostile.echo(1000, 5)
    finally:
        other.channel.close()
        hostile.channel.close()


FORGED_NAME = b"/\xff\xfe.Echo/\x80"
FORGED_AS_READ = "/\ufffd\ufffd.Echo/\ufffd"
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


class _Recorder(grpc.GenericRpcHandler):
    """Serves /e.E/Echo and records every name it is asked for."""

    def __init__(self, asyncio_handler: bool = False) -> None:
        self.asked: list[str] = []
        self._asyncio = asyncio_handler

    def service(self, details: grpc.HandlerCallDetails) -> Any:
        self.asked.append(details.method)
        if details.method != "/e.E/Echo":
            return None
        if self._asyncio:
            async def echo(req: bytes, ctx: Any) -> bytes:
                return req
            return grpc.unary_unary_rpc_method_handler(echo)
        return grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)

    def forge_and_wait(self, conn: Any) -> bool:
        """A call named FORGED_NAME, through `conn`; True once the server looked it up."""
        assert conn._probe_raw_batch(
            frame(HEADERS, S, struct.pack("<q", -1) + string(FORGED_NAME) + metadata([]))
            + frame(MESSAGE, S, b"abc") + frame(HALF_CLOSE, S))
        end = time.monotonic() + SETTLE_S
        while FORGED_AS_READ not in self.asked and time.monotonic() < end:
            time.sleep(0.02)
        return FORGED_AS_READ in self.asked


# A HEADERS frame is well formed whatever bytes its method name holds: the server reads
# the name with replacement characters and looks it up as any name (grpc reads such a
# path as Latin-1), finds no handler and ends the call UNIMPLEMENTED; the connection
# stays and the server goes on (the threaded one used to raise where it took the call
# and lose that worker silently, the asyncio one to drop what it took with it). The
# forging connection's own next call would take a stream id below the forged one, which
# ends it: the server's next call comes on a connection of its own.
def test_a_method_name_that_is_not_utf8_is_looked_up_and_unimplemented() -> None:
    import argrpc

    recorder = _Recorder()
    with inproc.threaded("argrpc", recorder) as channel:
        assert channel.unary_unary("/e.E/Echo")(b"x", timeout=30) == b"x"
        assert channel.transport == "shm", channel.fallback_reason
        assert recorder.forge_and_wait(channel._fast), recorder.asked
        assert channel._fast.alive, "a well-formed frame closed the connection"
        other = argrpc.insecure_channel(channel._target, options=OWN_CONNECTION)
        try:
            for _ in range(4):  # more than the server's workers
                assert other.unary_unary("/e.E/Echo")(b"y", timeout=30) == b"y"
        finally:
            other.close()


def test_an_asyncio_server_looks_up_a_name_that_is_not_utf8_too() -> None:
    import argrpc

    recorder = _Recorder(asyncio_handler=True)

    async def scenario() -> None:
        async with inproc.asyncio_server("argrpc", recorder) as target:
            async with argrpc.aio.insecure_channel(target) as channel:
                assert await channel.unary_unary("/e.E/Echo")(b"x", timeout=30) == b"x"
                assert channel.transport == "shm"
                loop = asyncio.get_running_loop()
                assert await loop.run_in_executor(None, recorder.forge_and_wait,
                                                  channel._fast), recorder.asked
                assert channel._fast.alive, "a well-formed frame closed the connection"
            async with argrpc.aio.insecure_channel(target, options=OWN_CONNECTION) as other:
                assert await other.unary_unary("/e.E/Echo")(b"y", timeout=30) == b"y"

    asyncio.run(scenario())
