"""argrpc's metrics on a Prometheus endpoint.

An argrpc server and client in one process, argrpc's OpenTelemetry plugin registered with
a ``MeterProvider`` whose reader is OpenTelemetry's Prometheus exporter, and
``prometheus_client``'s HTTP server publishing it::

    python -m examples.prometheus_metrics.serve --port 9464 --calls 100 --linger 60
    curl -s http://127.0.0.1:9464/metrics | grep -E '^(grpc|argrpc)_'

grpc's per-call metrics appear as ``grpc_client_attempt_duration_seconds`` and so on (the
names grpc's own plugin gives them), argrpc's as ``argrpc_*`` labelled by transport.
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent import futures

import grpc
import prometheus_client
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider

import argrpc
import argrpc.observability

SERVICE = "demo.Echo"
METHOD = f"/{SERVICE}/Echo"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=9464, help="metrics port (0: any free one)")
    parser.add_argument("--calls", type=int, default=100, help="small calls to make")
    parser.add_argument("--large-mib", type=int, default=8, help="size of the one large call")
    parser.add_argument("--linger", type=float, default=30.0,
                        help="seconds to keep serving /metrics after the calls")
    args = parser.parse_args()

    provider = MeterProvider(metric_readers=[PrometheusMetricReader()])
    # Generic handlers' methods are "other" unless the filter names them (as with grpc).
    plugin = argrpc.observability.OpenTelemetryPlugin(
        meter_provider=provider,
        generic_method_attribute_filter=lambda method: method.startswith(SERVICE))
    plugin.register_global()
    metrics_server, _ = prometheus_client.start_http_server(args.port, addr="127.0.0.1")

    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    server = argrpc.server(futures.ThreadPoolExecutor(4), options=options)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with argrpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        echo = channel.unary_unary(METHOD)
        for _ in range(args.calls):
            assert echo(b"x" * 64) == b"x" * 64
        large = bytes(args.large_mib << 20)
        assert echo(large) == large
        print(f"transport {channel.transport}", flush=True)
        print(f"SCRAPE http://127.0.0.1:{metrics_server.server_port}/metrics", flush=True)
        time.sleep(args.linger)
    server.stop(None)
    plugin.deregister_global()
    return 0


if __name__ == "__main__":
    sys.exit(main())
