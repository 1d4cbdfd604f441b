"""Echo server process for the conformance suite.

    python -m tests.support.echo_server --stack argrpc|grpc --port 0 [--workers N]
        [--stubs DIR] [--max-recv N] [--max-send N] [--reject-method /pkg.Svc/M ...]
        [--tls-cert PEM --tls-key PEM] [--server-option KEY=VALUE ...]

Prints "PORT <n>" once serving. Reads commands on stdin, one per line:
    stop <grace|none>   server.stop(grace) and wait; prints "STOPPED"
    resources           prints "RESOURCES <json>"
    pool                prints "POOL <json>": the argrpc engine's pool_stats() plus
                        "connections" (engine.connection_count) and "missed_doorbells",
                        or {} with no engine
End of stdin stops the server (grace 1 s), shuts the executor down and prints
"REPORT <json>" with resource snapshots taken before the server existed, after start and
after shutdown, plus every handler observation (see servicer.Observations), then exits. A setup failure prints "ERROR <type>: <message>" and exits 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from concurrent import futures
from typing import Any, Callable

import grpc

from tests.support import resources, stubs
from tests.support.servicer import (EchoServicer, hold_handler, nonblocking_handler,
                                    raw_handler)

REJECT_DETAILS = "rejected by interceptor"


class RejectInterceptor(grpc.ServerInterceptor):
    """Rejects the listed methods with PERMISSION_DENIED, keeping each method's arity."""

    def __init__(self, methods: list[str]) -> None:
        self._methods = set(methods)

    def intercept_service(self, continuation: Callable[[Any], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self._methods:
            return handler

        def reject(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, REJECT_DETAILS)

        def reject_stream(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, REJECT_DETAILS)
            yield  # makes this a generator like a real streaming handler

        kwargs = {"request_deserializer": handler.request_deserializer,
                  "response_serializer": handler.response_serializer}
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(reject_stream, **kwargs)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(reject, **kwargs)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(reject_stream, **kwargs)
        return grpc.unary_unary_rpc_method_handler(reject, **kwargs)


def _emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stack", choices=("argrpc", "grpc"), required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--stubs", help="directory with echo_pb2*.py (generated if omitted)")
    p.add_argument("--max-recv", type=int, help="grpc.max_receive_message_length")
    p.add_argument("--max-send", type=int, help="grpc.max_send_message_length")
    p.add_argument("--reject-method", action="append", default=[],
                   help="full method name a server interceptor rejects")
    p.add_argument("--tls-cert", help="PEM certificate chain: serve on a TLS port "
                   "(add_secure_port) instead of an insecure one; needs --tls-key")
    p.add_argument("--tls-key", help="PEM private key for --tls-cert")
    p.add_argument("--server-option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra (key, value) server option, e.g. TF_RDMA_OVER_TLS=true")
    args = p.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        p.error("--tls-cert and --tls-key go together")
    return args


def _make_server(args: argparse.Namespace, executor: futures.ThreadPoolExecutor) -> Any:
    options: list[tuple[str, Any]] = []
    if args.max_recv is not None:
        options.append(("grpc.max_receive_message_length", args.max_recv))
    if args.max_send is not None:
        options.append(("grpc.max_send_message_length", args.max_send))
    for item in args.server_option:
        key, _, value = item.partition("=")
        options.append((key, value))
    interceptors = [RejectInterceptor(args.reject_method)] if args.reject_method else None
    if args.stack == "argrpc":
        import argrpc
        return argrpc.server(executor, interceptors=interceptors, options=options)
    return grpc.server(executor, interceptors=interceptors, options=options)


def _stop(server: Any, grace: float | None, timeout: float = 60.0) -> bool:
    return bool(server.stop(grace).wait(timeout))


def _shutdown_executor(executor: futures.ThreadPoolExecutor, timeout: float = 20.0) -> bool:
    """False if the pool's threads did not end (e.g. worker loops that ignore stop())."""
    t = threading.Thread(target=executor.shutdown, kwargs={"wait": True}, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive()


def _pool_report(stack: str) -> dict[str, Any]:
    """The argrpc engine's pool stats and connection count ({} for grpc or no engine)."""
    if stack != "argrpc":
        return {}
    from argrpc import _engine
    engine = _engine.peek_engine()
    if engine is None:
        return {}
    report = dict(engine.pool_stats())
    report["connections"] = engine.connection_count
    report["missed_doorbells"] = engine.missed_doorbells
    return report


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    stub_dir = args.stubs or stubs.generate(tempfile.mkdtemp(prefix="echo-stubs-"))
    pb2, pb2_grpc = stubs.load(stub_dir)
    before = resources.snapshot()
    executor = futures.ThreadPoolExecutor(max_workers=args.workers,
                                          thread_name_prefix=resources.SERVER_POOL_PREFIX)
    try:
        server = _make_server(args, executor)
        servicer = EchoServicer(pb2)
        pb2_grpc.add_EchoServicer_to_server(servicer, server)
        server.add_generic_rpc_handlers((raw_handler(args.stack == "argrpc"),))
        server.add_generic_rpc_handlers((hold_handler(),))
        server.add_generic_rpc_handlers((nonblocking_handler(),))
        address = f"{args.host}:{args.port}"
        if args.tls_cert:
            with open(args.tls_key, "rb") as f:
                key = f.read()
            with open(args.tls_cert, "rb") as f:
                chain = f.read()
            port = server.add_secure_port(
                address, grpc.ssl_server_credentials([(key, chain)]))
        else:
            port = server.add_insecure_port(address)
        server.start()
    except Exception as exc:  # reported to the test, which asserts on it
        _emit(f"ERROR {type(exc).__module__}.{type(exc).__qualname__}: {exc}")
        sys.stdout.flush()
        os._exit(2)
    started = resources.snapshot()
    _emit(f"PORT {port}")

    stopped = False
    stop_ok = True
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "stop":
            grace = None if len(words) < 2 or words[1] == "none" else float(words[1])
            stop_ok = _stop(server, grace)
            stopped = True
            _emit(f"STOPPED {json.dumps(stop_ok)}")
        elif words[0] == "resources":
            _emit("RESOURCES " + json.dumps(resources.snapshot()))
        elif words[0] == "pool":
            _emit("POOL " + json.dumps(_pool_report(args.stack)))
        else:
            _emit(f"UNKNOWN {words[0]}")

    if not stopped:
        stop_ok = _stop(server, 1.0)
    executor_ok = _shutdown_executor(executor)
    del server
    report = {
        "before": before,
        "started": started,
        "exit": resources.snapshot(),
        "stop_ok": stop_ok,
        "executor_shutdown_ok": executor_ok,
        "observations": servicer.obs.all(),
    }
    _emit("REPORT " + json.dumps(report))
    # grpc/argrpc may keep daemon-ish native threads; the report is all the test needs.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
