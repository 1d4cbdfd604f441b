"""Page faults of protobuf messages on the fast path, counted per thread.

``python -m tests.support.fault_probe SIZE CALLS`` starts an argrpc server in a child
process (``serve``), sends CALLS protobuf messages of one SIZE-byte ``bytes`` field from
this process's main thread and prints one JSON object: per call, the minor page faults
of the client's serializer, and of the server's deserializer and handler (reading the
field) on the handler's thread, plus whether the handler got the bytes that were sent.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import resource
import subprocess
import sys
from concurrent import futures
from typing import Any, Iterator

import grpc

import argrpc
from argrpc_bench import messages as msg

UNLIMITED = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]



def serve_until_eof(handler: grpc.GenericRpcHandler) -> None:
    """A probe's child: an argrpc server for `handler`, its port on stdout, until stdin
    closes."""
    server = argrpc.server(futures.ThreadPoolExecutor(2), options=UNLIMITED)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()
    server.stop(None)


@contextlib.contextmanager
def served_channel(module: str) -> Iterator[tuple[Any, "subprocess.Popen[str]"]]:
    """A channel to `python -m module serve` (see serve_until_eof) and that child; the
    child is told to stop and waited for on the way out."""
    child = subprocess.Popen([sys.executable, "-m", module, "serve"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        channel = argrpc.insecure_channel(f"127.0.0.1:{port}", options=UNLIMITED)
        yield channel, child
        channel.close()
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(timeout=30)

def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def serve() -> None:
    seen: list[dict[str, Any]] = []

    def parse(data: Any) -> Any:
        f0 = _faults()
        request = msg.Payload.FromString(data)
        seen.append({"parse": _faults() - f0})
        return request

    def sink(request: Any, context: grpc.ServicerContext) -> bytes:
        f0 = _faults()
        digest = hashlib.sha256(request.buffers[0]).hexdigest()
        seen[-1].update(field=_faults() - f0, sha256=digest)
        return b"ok"

    def report(request: bytes, context: grpc.ServicerContext) -> bytes:
        return json.dumps(seen).encode()

    handler = grpc.method_handlers_generic_handler(msg.SERVICE, {
        msg.SINK: grpc.unary_unary_rpc_method_handler(sink, parse, None),
        "Report": grpc.unary_unary_rpc_method_handler(report, None, None)})
    serve_until_eof(handler)


def main(size: int, calls: int) -> None:
    with served_channel("tests.support.fault_probe") as (channel, child):
        serialize_faults: list[int] = []

        def serialize(message: Any) -> bytes:
            f0 = _faults()
            out: bytes = message.SerializeToString()
            serialize_faults.append(_faults() - f0)
            return out

        sink = channel.unary_unary(msg.path(msg.SERVICE, msg.SINK),
                                   request_serializer=serialize, response_deserializer=None)
        data = bytes(range(256)) * (size // 256)
        for _ in range(calls):
            sink(msg.Payload(buffers=[data]))
        seen = json.loads(bytes(channel.unary_unary(msg.path(msg.SERVICE, "Report"))(b"")))
        print(json.dumps({
            "transport": channel.transport,
            "serialize": serialize_faults,
            "parse": [s["parse"] for s in seen],
            "field": [s["field"] for s in seen],
            "intact": all(s["sha256"] == hashlib.sha256(data).hexdigest() for s in seen),
        }))


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        main(int(sys.argv[1]), int(sys.argv[2]))
