"""Benchmark server process for the point-to-point benchmarks.

    python -m argrpc_bench.server --stack grpc|argrpc [--threads N]
        [--host 127.0.0.1] [--port 0] [--until stdin|signal]

Serves, on one port, every method both point-to-point benchmarks need (the client picks
by mode and buffer count, so one server serves a whole run):

* ``Echo`` / ``EchoRaw`` / ``EchoFramed`` (latency: the request comes back);
* ``Sink`` / ``SinkRaw`` / ``SinkFramed`` (bandwidth: the request is received and
  unpacked, a tiny ack goes back);
* ``Env``: the TF_RDMA_* environment of this process, so a run can prove which settings
  the measured server actually had.

Prints ``PORT n`` once listening and serves until its stdin reaches EOF: the
orchestrator closes it when done, and if the orchestrator dies the pipe closes too, so a
server is never orphaned. The stack (grpc.server or argrpc.server) is the only difference
between transports; the handlers are the same code.

By default it listens on a free port of 127.0.0.1, for a client the same runner starts.
For a client on another host (``argrpc-bench --remote``), ``--host 0.0.0.0 --port N``
listens where that client can reach it, and ``--until signal`` (what ``argrpc-bench
serve`` uses) serves until SIGINT or SIGTERM instead, for a server started by hand or in
the background with no orchestrator holding its stdin. An argrpc server chooses its
transport per connection, as any argrpc server does: no TF_RDMA_TRANSPORT is needed for
verbs across hosts.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import struct
import sys
import threading
from concurrent import futures
from typing import Any, Callable, Mapping, Sequence

import grpc

from argrpc_bench import messages as msg

# Unlimited both ways: the default 4 MiB receive cap would reject bulk messages, and the
# point is to compare transports, not limits.
BIG_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
]
DEFAULT_THREADS = 8
_RAW_ACK = struct.Struct("<QI")  # payload bytes received, buffer count


def tf_rdma_env() -> dict[str, str]:
    """The TF_RDMA_* part of this process's environment."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("TF_RDMA_")}


def env_report() -> bytes:
    return json.dumps({"pid": os.getpid(), "env": tf_rdma_env()}).encode()


def raw_ack(size: int, count: int) -> bytes:
    return _RAW_ACK.pack(size, count)


def parse_raw_ack(data: Any) -> tuple[int, int]:
    size, count = _RAW_ACK.unpack(bytes(data))
    return int(size), int(count)


class Received:
    """A raw request: the message as received plus zero-copy views of its buffers. Echo
    sends ``data`` back as is (it already is the packed form of ``views``)."""

    __slots__ = ("data", "views")

    def __init__(self, data: Any, framed: bool) -> None:
        self.data = data
        self.views = msg.unpack(data, framed)


def raw_serializer(stack: str) -> Callable[[Any], Any]:
    """Identity on argrpc (buffers go out as they are); ``bytes`` for grpcio's core."""
    return msg.bytes_only(msg.identity) if stack == "grpc" else msg.identity


def handlers(stack: str) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
    uu = grpc.unary_unary_rpc_method_handler
    out_raw = raw_serializer(stack)

    def echo(req: Any, ctx: grpc.ServicerContext) -> Any:
        return req

    def sink(req: Any, ctx: grpc.ServicerContext) -> Any:
        return msg.Ack(size=sum(len(b) for b in req.buffers), count=len(req.buffers))

    def echo_raw(req: Received, ctx: grpc.ServicerContext) -> Any:
        return req.data

    def sink_raw(req: Received, ctx: grpc.ServicerContext) -> bytes:
        return raw_ack(sum(v.nbytes for v in req.views), len(req.views))

    def env(req: bytes, ctx: grpc.ServicerContext) -> bytes:
        return env_report()

    return {
        msg.ECHO: uu(echo, msg.Payload.FromString, msg.Payload.SerializeToString),
        msg.SINK: uu(sink, msg.Payload.FromString, msg.Ack.SerializeToString),
        msg.ECHO_RAW: uu(echo_raw, lambda d: Received(d, False), out_raw),
        msg.ECHO_FRAMED: uu(echo_raw, lambda d: Received(d, True), out_raw),
        msg.SINK_RAW: uu(sink_raw, lambda d: Received(d, False), out_raw),
        msg.SINK_FRAMED: uu(sink_raw, lambda d: Received(d, True), out_raw),
        msg.ENV: uu(env, None, None),
    }


def make_server(stack: str, threads: int) -> grpc.Server:
    """grpc.server or argrpc.server with the same pool size and unlimited message sizes.
    argrpc is imported only for its stack, so a grpc process never starts its engine."""
    pool = futures.ThreadPoolExecutor(max_workers=threads)
    if stack == "argrpc":
        import argrpc

        return argrpc.server(pool, options=BIG_OPTIONS)
    if stack == "grpc":
        return grpc.server(pool, options=BIG_OPTIONS)
    raise ValueError(f"unknown stack {stack!r} (grpc or argrpc)")


UNTIL = ("stdin", "signal")


def _serve_stdin(commands: Mapping[str, Callable[[], str]]) -> None:
    """Until stdin's EOF; a line naming one of `commands` is answered (one line)."""
    try:
        for line in sys.stdin:  # EOF = the orchestrator is done or gone
            answer = commands.get(line.strip())
            if answer is not None:
                print(answer(), flush=True)
    except KeyboardInterrupt:
        pass


def _serve_signal() -> None:
    """Until SIGINT or SIGTERM, stdin untouched (it may be a terminal or /dev/null)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):  # a timed wait: the handler runs between the waits
        pass


def listen_address(host: str, port: int) -> str:
    """``host:port`` for add_insecure_port; an IPv6 literal gets its brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def serve(server: grpc.Server, handlers: Sequence[grpc.GenericRpcHandler],
          commands: Mapping[str, Callable[[], str]] | None = None, grace: float = 0,
          address: str = "127.0.0.1:0", until: str = "stdin",
          registered: Mapping[str, Mapping[str, grpc.RpcMethodHandler[Any, Any]]] | None = None
          ) -> int:
    """Listen on `address` (default: a free port of 127.0.0.1), print ``PORT n``, serve
    until stdin closes (``until="stdin"``; a stdin line that names one of `commands` is
    answered with what it returns, one line) or until SIGINT/SIGTERM (``"signal"``).
    `registered` (service -> method -> handler) is also registered by name, as grpc's
    generated ``add_*Servicer_to_server`` does beside its generic handler."""
    if until not in UNTIL:
        raise ValueError(f"until must be one of {UNTIL}, not {until!r}")
    server.add_generic_rpc_handlers(tuple(handlers))
    for service, methods in (registered or {}).items():
        server.add_registered_method_handlers(service, methods)
    port = server.add_insecure_port(address)
    if port == 0:  # grpc reports a failed bind as port 0, not as an error
        raise RuntimeError(f"cannot listen on {address}")
    server.start()
    print(f"PORT {port}", flush=True)
    if until == "signal":
        _serve_signal()
    else:
        _serve_stdin(commands or {})
    server.stop(grace).wait(10)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m argrpc_bench.server", description=__doc__)
    p.add_argument("--stack", choices=("grpc", "argrpc"), required=True)
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                   help="server thread-pool size, the same for every stack")
    add_listen_args(p, host="127.0.0.1", port=0, until="stdin")
    args = p.parse_args(argv)
    server = make_server(args.stack, args.threads)
    methods = handlers(args.stack)
    handler = grpc.method_handlers_generic_handler(msg.SERVICE, methods)
    return serve(server, [handler], address=listen_address(args.host, args.port),
                 until=args.until, registered={msg.SERVICE: methods})


def add_listen_args(p: argparse.ArgumentParser, host: str, port: int, until: str) -> None:
    """--host / --port / --until, shared with ``argrpc-bench serve`` (other defaults)."""
    p.add_argument("--host", default=host,
                   help=f"address to listen on (default {host}; 0.0.0.0 or :: for clients "
                        "on other hosts)")
    p.add_argument("--port", type=_port, default=port,
                   help=f"port to listen on (default {port}" + (": a free one" if port == 0
                                                                 else "") + ")")
    p.add_argument("--until", choices=UNTIL, default=until,
                   help="serve until stdin reaches EOF (an orchestrator holds it) or until "
                        f"SIGINT/SIGTERM (default {until})")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port out of range 0..65535: {port}")
    return port


if __name__ == "__main__":
    sys.exit(main())
