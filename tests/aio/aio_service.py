"""The asyncio server the client tests call: generic bytes handlers, the same on an
argrpc.aio and a grpc.aio server, run as its own process so a test can kill it.

    python -m tests.aio.aio_service --stack argrpc|grpc [--port N]

Prints "PORT <n>" once serving and serves until stdin closes. Handlers that a client
cancels or abandons record what they saw under a tag; the `obs` method returns it.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
from typing import Any, AsyncIterator

import grpc
from grpc import aio

SERVICE = "t.AioClient"
UNLIMITED = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
HANG_S = 10.0
TRAILING = (("t", "v"), ("t-bin", b"\x00\xff"))

_OBS: dict[str, list] = {}


def method(name: str) -> str:
    return f"/{SERVICE}/{name}"


def _record(tag: str, event: str, value: Any = None) -> None:
    _OBS.setdefault(tag, []).append([event, value])


async def _hang(tag: str, context: aio.ServicerContext) -> None:
    """Waits until the client goes away (or HANG_S), recording how it ended."""
    try:
        await asyncio.sleep(HANG_S)
        _record(tag, "woke")
    except asyncio.CancelledError:
        _record(tag, "cancelled")
        raise


async def echo(request: bytes, context: aio.ServicerContext) -> bytes:
    return request


async def meta(request: bytes, context: aio.ServicerContext) -> bytes:
    """Sends the client's x- metadata back as initial and trailing metadata."""
    mine = tuple((k, v) for k, v in context.invocation_metadata() if k.startswith("x-"))
    await context.send_initial_metadata(mine)
    context.set_trailing_metadata(mine + TRAILING)
    return json.dumps([[k, v if isinstance(v, str) else v.hex()] for k, v in mine]).encode()


async def fail(request: bytes, context: aio.ServicerContext) -> bytes:
    """Aborts with the code and details the request names (JSON)."""
    want = json.loads(request)
    context.set_trailing_metadata(TRAILING)
    await context.abort(grpc.StatusCode[want["code"]], want["details"])
    return b""


async def hang(request: bytes, context: aio.ServicerContext) -> bytes:
    tag = request.decode()
    _record(tag, "start", context.time_remaining())
    context.add_done_callback(lambda ctx: _record(tag, "done", ctx.cancelled()))
    await _hang(tag, context)
    return b"woke"


async def delay(request: bytes, context: aio.ServicerContext) -> bytes:
    await asyncio.sleep(int(request) / 1000)
    return request


async def count(request: bytes, context: aio.ServicerContext) -> AsyncIterator[bytes]:
    """Request "n" or "n,size": n messages, each its index or `size` bytes of it."""
    n, _, size = request.decode().partition(",")
    for i in range(int(n)):
        yield bytes([i % 256]) * int(size) if size else b"%d" % i


async def hang_stream(request: bytes, context: aio.ServicerContext) -> AsyncIterator[bytes]:
    tag = request.decode()
    _record(tag, "start", context.time_remaining())
    context.add_done_callback(lambda ctx: _record(tag, "done", ctx.cancelled()))
    try:
        yield b"first"
        await asyncio.sleep(HANG_S)
        _record(tag, "woke")
    except (asyncio.CancelledError, GeneratorExit):
        # A cancellation that comes while the server writes "first" leaves the
        # generator at its yield, closed whenever it is collected: "done" says it.
        _record(tag, "cancelled")
        raise


async def fail_stream(request: bytes, context: aio.ServicerContext) -> AsyncIterator[bytes]:
    yield b"a"
    yield b"b"
    context.set_trailing_metadata(TRAILING)
    await context.abort(grpc.StatusCode.OUT_OF_RANGE, "enough")


async def join(requests: Any, context: aio.ServicerContext) -> bytes:
    return b"|".join([r async for r in requests])


async def hang_client_stream(requests: Any, context: aio.ServicerContext) -> bytes:
    tag = (await context.read()).decode()
    _record(tag, "start", context.time_remaining())
    context.add_done_callback(lambda ctx: _record(tag, "done", ctx.cancelled()))
    await _hang(tag, context)
    return b"woke"


async def bidi(requests: Any, context: aio.ServicerContext) -> AsyncIterator[bytes]:
    async for r in requests:
        yield r


async def hold(request: Any, context: aio.ServicerContext) -> bytes:
    """Keeps the request (over the fast path a large one is a view of the client's pool
    block) for x-hold-ms milliseconds, then answers {"sha256", "size"} of it."""
    ms = int(dict(context.invocation_metadata()).get("x-hold-ms", "0"))
    digest = hashlib.sha256(request).hexdigest()
    size = memoryview(request).nbytes
    await asyncio.sleep(ms / 1000)
    return json.dumps({"sha256": digest, "size": size}).encode()


async def obs(request: bytes, context: aio.ServicerContext) -> bytes:
    return json.dumps(_OBS.get(request.decode(), [])).encode()


HANDLERS = {
    "echo": grpc.unary_unary_rpc_method_handler(echo),
    "meta": grpc.unary_unary_rpc_method_handler(meta),
    "fail": grpc.unary_unary_rpc_method_handler(fail),
    "hang": grpc.unary_unary_rpc_method_handler(hang),
    "delay": grpc.unary_unary_rpc_method_handler(delay),
    "hold": grpc.unary_unary_rpc_method_handler(hold),
    "obs": grpc.unary_unary_rpc_method_handler(obs),
    "count": grpc.unary_stream_rpc_method_handler(count),
    "hang_stream": grpc.unary_stream_rpc_method_handler(hang_stream),
    "fail_stream": grpc.unary_stream_rpc_method_handler(fail_stream),
    "join": grpc.stream_unary_rpc_method_handler(join),
    "hang_client_stream": grpc.stream_unary_rpc_method_handler(hang_client_stream),
    "bidi": grpc.stream_stream_rpc_method_handler(bidi),
}


async def serve(stack: str, port: int) -> None:
    if stack == "argrpc":
        import argrpc.aio
        server = argrpc.aio.server(options=UNLIMITED)
    else:
        server = aio.server(options=UNLIMITED)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, HANDLERS),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"PORT {bound}", flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await server.stop(None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stack", choices=("argrpc", "grpc"), required=True)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    asyncio.run(serve(args.stack, args.port))


if __name__ == "__main__":
    main()
