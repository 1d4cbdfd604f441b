"""Asyncio benchmark server process: server.py's point-to-point methods on one event
loop, served by ``grpc.aio.server`` or ``argrpc.aio.server``.

    python -m argrpc_bench.aio_server --stack grpc|argrpc [--loop asyncio|uvloop]

The handlers are server.py's own functions, each run on the loop as an ``async def``:
they neither block nor wait, and a plain function would be sent to grpc.aio's migration
thread pool, a hand-off an asyncio service does not have. Prints ``PORT n`` once
listening and serves until its stdin reaches EOF, as server.py does, so it is never
orphaned.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from typing import Any, Callable, Coroutine, cast

import grpc

from argrpc_bench import LOOPS, loops
from argrpc_bench import messages as msg
from argrpc_bench.server import BIG_OPTIONS, handlers

Handler = Callable[[Any, Any], Any]


def make_server(stack: str) -> Any:
    """grpc.aio.server or argrpc.aio.server, unlimited message sizes. argrpc is imported
    only for its stack, so a grpc process never starts its engine."""
    if stack == "argrpc":
        from argrpc import aio

        return aio.server(options=BIG_OPTIONS)
    if stack == "grpc":
        return grpc.aio.server(options=BIG_OPTIONS)
    raise ValueError(f"unknown stack {stack!r} (grpc or argrpc)")


def _on_loop(fn: Handler) -> Callable[[Any, Any], Coroutine[Any, Any, Any]]:
    async def handle(request: Any, context: Any) -> Any:
        return fn(request, context)

    return handle


def async_handlers(stack: str) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
    """server.handlers(stack) with every behaviour made a coroutine function; the
    (de)serializers are the same objects."""
    return {name: grpc.unary_unary_rpc_method_handler(
                _on_loop(cast(Handler, h.unary_unary)),  # every bench method is unary
                h.request_deserializer, h.response_serializer)
            for name, h in handlers(stack).items()}


def stdin_closed(loop: asyncio.AbstractEventLoop) -> "asyncio.Future[None]":
    """Resolves when stdin reaches EOF. Read on a thread: a pipe on stdin cannot be
    registered with every loop, and blocking reads must stay off this one."""
    done: asyncio.Future[None] = loop.create_future()

    def resolve() -> None:
        if not done.done():
            done.set_result(None)

    def watch() -> None:
        try:
            while sys.stdin.readline():
                pass
        except (OSError, ValueError):
            pass
        try:
            loop.call_soon_threadsafe(resolve)
        except RuntimeError:  # the loop is already closed: nothing left to stop
            pass

    threading.Thread(target=watch, name="stdin-eof", daemon=True).start()
    return done


async def serve(stack: str) -> int:
    server = make_server(stack)
    methods = async_handlers(stack)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(msg.SERVICE, methods),))
    # by name too, as grpc's generated add_*Servicer_to_server does
    server.add_registered_method_handlers(msg.SERVICE, methods)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"PORT {port}", flush=True)
    await stdin_closed(asyncio.get_running_loop())
    await server.stop(0)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m argrpc_bench.aio_server",
                                description=__doc__)
    p.add_argument("--stack", choices=("grpc", "argrpc"), required=True)
    p.add_argument("--loop", choices=LOOPS, default="asyncio")
    args = p.parse_args(argv)
    try:
        return loops.run(serve(args.stack), args.loop)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
