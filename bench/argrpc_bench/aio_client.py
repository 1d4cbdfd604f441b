"""Asyncio benchmark client process: client.py's latency and bandwidth loops on one event
loop, through ``grpc.aio`` or ``argrpc.aio``.

    python -m argrpc_bench.aio_client (client.py's options) [--concurrency N]
        [--loop asyncio|uvloop]

* latency: per size, client.py's ping-pong (one call in flight, every call timed); then,
  with ``--concurrency N`` > 1, N tasks of the one loop keep N calls in flight on the one
  channel: RPC/s over the phase, and each call's latency under that load.
* bandwidth: as client.py, one call at a time.

Warm-up, phases, the garbage-collector policy, the transport checks, the one JSON result
line, progress lines and the exit on stdin EOF are client.py's.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import sys
import time
from typing import Any, Awaitable, Callable, Sequence

import grpc

from argrpc_bench import LOOPS, loops
from argrpc_bench import messages as msg
from argrpc_bench import schemes
from argrpc_bench.client import (CALL_TIMEOUT_S, P2PCall, Plan, arg_parser, check_transport,
                                     emit_outcome, exit_on_stdin_eof, p2p_call, parse_args,
                                     progress, result_row)
from argrpc_bench.server import BIG_OPTIONS, tf_rdma_env

AsyncCall = Callable[[], Awaitable[Any]]


def make_channel(stack: str, target: str) -> Any:
    """grpc.aio.insecure_channel or argrpc.aio.insecure_channel, unlimited sizes."""
    if stack == "argrpc":
        from argrpc import aio  # only on this stack: a grpc client never loads the engine

        return aio.insecure_channel(target, options=BIG_OPTIONS)
    if stack == "grpc":
        return grpc.aio.insecure_channel(target, options=BIG_OPTIONS)
    raise ValueError(f"unknown stack {stack!r} (grpc or argrpc)")


async def fetch_env(channel: Any) -> dict[str, Any]:
    """The server's own report ({pid, env}); also the call that settles negotiation."""
    call = channel.unary_unary(msg.path(msg.SERVICE, msg.ENV), request_serializer=None,
                               response_deserializer=None)
    report: dict[str, Any] = json.loads(await call(b"", timeout=60, wait_for_ready=True))
    return report


async def first_call(rpc: P2PCall) -> AsyncCall:
    """Makes the first call, checked, and returns the timed loop's call."""
    method, request, check = rpc.method, rpc.request, rpc.check
    check(await method(request, timeout=CALL_TIMEOUT_S))
    if rpc.check_each:
        async def checked() -> None:
            check(await method(request, timeout=CALL_TIMEOUT_S))
        return checked
    return lambda: method(request, timeout=CALL_TIMEOUT_S)


async def timed_phases(calls: Sequence[AsyncCall], plan: Plan
                       ) -> tuple[list[int], float, list[int]]:
    """client.timed_phases with one task per call, each keeping its call in flight; the
    plan counts calls over all tasks. All samples (ns), timed seconds, calls per repeat."""
    samples: list[int] = []
    total_s = 0.0
    per_repeat: list[int] = []
    for _ in range(plan.repeats):
        gc.collect()
        gc.disable()
        try:
            started = time.perf_counter()
            count = 0

            async def keep_calling(call: AsyncCall) -> None:
                nonlocal count
                while not plan.phase_done(count, started):
                    count += 1
                    t0 = time.perf_counter_ns()
                    await call()
                    samples.append(time.perf_counter_ns() - t0)

            if len(calls) == 1:  # the ping-pong pays for no task
                await keep_calling(calls[0])
            else:
                await asyncio.gather(*(keep_calling(c) for c in calls))
            total_s += time.perf_counter() - started
        finally:
            gc.enable()
        per_repeat.append(count)
    return samples, total_s, per_repeat


async def measure(channel: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    plan = Plan(args.warmup, args.iterations, args.duration, args.repeats)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    latency = args.benchmark == "latency"
    concurrency = args.concurrency if latency else 1
    out: list[dict[str, Any]] = []
    for i, size in enumerate(sizes):
        bufs = schemes.make_buffers(schemes.buffer_sizes(args.scheme, size, args.buffers,
                                                         args.seed), args.seed)
        bytes_per_call = (2 if latency else 1) * size  # latency: request and reply

        def rpc() -> P2PCall:
            # one per task: a raw frame is reused by its own calls only
            return p2p_call(channel, args.benchmark, args.stack, args.mode, bufs)

        call = await first_call(rpc())
        for _ in range(max(0, args.warmup - 1)):
            await call()
        out.append(result_row(size, args.buffers, 1, bytes_per_call,
                        await timed_phases([call], plan)))
        if concurrency > 1:
            calls = [call] + [await first_call(rpc()) for _ in range(concurrency - 1)]
            for _ in range(max(1, math.ceil(args.warmup / concurrency))):
                await asyncio.gather(*(c() for c in calls))
            out.append(result_row(size, args.buffers, concurrency, bytes_per_call,
                            await timed_phases(calls, plan)))
            del calls
        del call, bufs
        progress(i + 1, len(sizes))
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"ok": False, "pid": os.getpid(), "env": tf_rdma_env(),
                              "benchmark": args.benchmark, "transport": None}
    channel = make_channel(args.stack, args.target)
    try:
        server = await fetch_env(channel)
        result["server_env"] = server["env"]
        result["server_pid"] = server["pid"]
        result["transport"] = check_transport(channel, args.transport)
        result["results"] = await measure(channel, args)
        # A connection that died mid-run would have carried the rest over plain gRPC.
        check_transport(channel, args.transport)
        result["ok"] = True
    finally:
        await channel.close()
    return result


def main(argv: list[str] | None = None) -> int:
    p = arg_parser("python -m argrpc_bench.aio_client")
    p.add_argument("--loop", choices=LOOPS, default="asyncio")
    args = parse_args(argv, p)
    exit_on_stdin_eof()
    return emit_outcome(lambda: loops.run(run(args), args.loop))


if __name__ == "__main__":
    sys.exit(main())
