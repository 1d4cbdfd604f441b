"""Freed heap memory a process keeps after large protobuf messages, on the fast path.

``python -m tests.support.heap_probe SIZE,SIZE,...`` starts an argrpc server in a child
process (``serve``) that echoes a one-``bytes``-field ``Payload`` back, sends one message
of each SIZE (a fresh field each time) from this process's main thread and prints one
JSON object: the server's VmRSS after each call (once the engine had time to check the
heap after the last large message), and for both processes at the end the resident
memory glibc held free: VmRSS minus VmRSS after an explicit ``malloc_trim(0)``, which
hands back every free page of the heap. Also the engine's heap-bound counters
(``_core._heap_stats()``) of both.
"""
from __future__ import annotations

import ctypes
import json
import sys
import time
from typing import Any

import grpc

from argrpc import _core
from argrpc_bench import messages as msg
from tests.support.fault_probe import serve_until_eof, served_channel

SETTLE_S = 0.5  # the engine checks the heap 100 ms after the last large message


def vm_rss(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def held_free() -> int:
    """Resident bytes glibc holds free: what an explicit malloc_trim(0) gives back."""
    before = vm_rss()
    ctypes.CDLL(None).malloc_trim(0)
    return max(0, before - vm_rss())


def serve() -> None:
    def echo(request: Any, context: grpc.ServicerContext) -> Any:
        return msg.Payload(buffers=[request.buffers[0]])

    def report(request: bytes, context: grpc.ServicerContext) -> bytes:
        stats = _core._heap_stats()
        return json.dumps({"held_free": held_free(), "heap": stats}).encode()

    handler = grpc.method_handlers_generic_handler(msg.SERVICE, {
        msg.ECHO: grpc.unary_unary_rpc_method_handler(
            echo, msg.Payload.FromString, msg.Payload.SerializeToString),
        "Report": grpc.unary_unary_rpc_method_handler(report, None, None)})
    serve_until_eof(handler)


def main(sizes: list[int]) -> None:
    with served_channel("tests.support.heap_probe") as (channel, child):
        echo = channel.unary_unary(msg.path(msg.SERVICE, msg.ECHO),
                                   request_serializer=msg.Payload.SerializeToString,
                                   response_deserializer=msg.Payload.FromString)
        server_rss, intact = [], True
        for i, size in enumerate(sizes):
            data = bytes([i % 256]) * size
            reply = echo(msg.Payload(buffers=[data]))
            intact = intact and reply.buffers[0] == data
            del reply, data
            time.sleep(SETTLE_S)
            server_rss.append(vm_rss(child.pid))
        server = json.loads(bytes(channel.unary_unary(msg.path(msg.SERVICE, "Report"))(b"")))
        print(json.dumps({
            "transport": channel.transport,
            "intact": intact,
            "server_rss": server_rss,
            "server_held_free": server["held_free"],
            "server_heap": server["heap"],
            "client_held_free": held_free(),
            "client_heap": _core._heap_stats(),
        }))


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        main([int(s) for s in sys.argv[1].split(",")])
