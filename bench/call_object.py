#!/usr/bin/env python3
"""What argrpc.aio's call object costs a round trip: a 64 B bytes echo from an asyncio
client, timed through the stub (`await stub(request)`) and through a bare loop over the
same engine calls (start the watched unary call, ask it or poll on the loop's thread
in one step, else wait for its watch), in alternating rounds on one channel.

    python3 bench/call_object.py [--calls N] [--rounds R] [--server asyncio|threaded]

The bare loop is what a native call type would leave: no multicallable checks, no call
object, its status or callbacks, no finalizer. It reads private parts of the channel
and the bridge, so it measures this checkout only. Printed per way: the median over
rounds of each round's p50 and p99 (µs).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# The checkout this file is in wins over an installed argrpc.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argrpc.aio  # noqa: E402

# The server, its method and the quantiles are loop_pairs.py's.
from bench.loop_pairs import METHOD, PAYLOAD, _quantiles, serve  # noqa: E402


async def compare(target: str, calls: int, rounds: int) -> dict[str, list[tuple[float, float]]]:
    async with argrpc.aio.insecure_channel(target) as ch:
        stub = ch.unary_unary(METHOD, _registered_method=True)
        for _ in range(3000):
            await stub(PAYLOAD)
        if ch.transport != "shm":
            raise SystemExit(f"the channel runs over {ch.transport!r}, not shared memory")
        conn = ch._fast  # private: the channel's engine connection
        bridge = stub._loop_bridge  # private: the loop's bridge to the engine
        loop = asyncio.get_running_loop()

        async def bare() -> Any:
            token = bridge.register(lambda: None)
            core, _ = conn.start_unary_watched(METHOD, [], None, bridge.notifier, token,
                                               PAYLOAD, False)
            bridge.started()
            while True:
                outcome = core.answer_or_poll(bridge.notifier, bridge.engine, bridge.ready,
                                              token)
                if outcome.__class__ is list:
                    bridge.run(outcome)
                    continue
                if outcome is not None:
                    break
                changed = loop.create_future()
                bridge._callbacks[token] = \
                    lambda: changed.done() or changed.set_result(None)
                await changed
            bridge.finished(token)
            return outcome[4]

        if bytes(await bare()) != PAYLOAD:
            raise SystemExit("the bare loop's echo differs")
        clock = time.perf_counter_ns
        out: dict[str, list[tuple[float, float]]] = {"stub": [], "bare": []}
        for r in range(rounds):
            for way in ("stub", "bare") if r % 2 == 0 else ("bare", "stub"):
                lat = []
                if way == "stub":
                    for _ in range(calls):
                        t = clock()
                        await stub(PAYLOAD)
                        lat.append(clock() - t)
                else:
                    for _ in range(calls):
                        t = clock()
                        await bare()
                        lat.append(clock() - t)
                out[way].append(_quantiles(lat))
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000, help="timed calls per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--server", choices=("asyncio", "threaded"), default="asyncio")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    server = subprocess.Popen([sys.executable, __file__, "--serve", args.server],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ))
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        results = asyncio.run(compare(f"127.0.0.1:{port}", args.calls, args.rounds))
    finally:
        if server.stdin:
            server.stdin.close()
        server.wait(timeout=30)
    print(f"asyncio client, {args.server} server, 64 B bytes echo, "
          f"{args.rounds} rounds of {args.calls} calls (median of the rounds' quantiles)")
    for way, rows in results.items():
        p50 = statistics.median(r[0] for r in rows)
        p99 = statistics.median(r[1] for r in rows)
        print(f"  {way:5s} p50 {p50:6.2f} µs   p99 {p99:6.2f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
