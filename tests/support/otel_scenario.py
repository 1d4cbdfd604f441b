"""One process: a server and a client of one stack, a global OpenTelemetry plugin, a fixed
set of calls; prints what an in-memory reader collected as JSON.

``--stack grpc`` uses grpc and grpc_observability's plugin (the oracle), ``--stack argrpc``
argrpc's channel, server and plugin (over shared memory unless TF_RDMA_* says otherwise).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent import futures
from typing import Any

import grpc

sys.path.insert(0, os.getcwd())

from tests.support import stubs  # noqa: E402
from tests.support.servicer import EchoServicer  # noqa: E402

GENERIC_SERVICE = "x.Gen"
# Generic too, but named in the metrics by the plugin's generic_method_attribute_filter.
SLOW_SERVICE = "x.Slow"


def _calls(channel: Any, pb2: Any, pb2_grpc: Any, big: int) -> None:
    """Responses are digests (or echoes) so that their sizes are the same on every stack;
    only ClientStream's carries the server's report (peer, metadata), which is not."""
    stub = pb2_grpc.EchoStub(channel)
    stub.Unary(pb2.EchoRequest(payload=b"x" * 64, digest_only=True))
    stub.Unary(pb2.EchoRequest(payload=b"b" * big, digest_only=True))
    try:
        stub.Unary(pb2.EchoRequest(abort_code=grpc.StatusCode.NOT_FOUND.value[0],
                                   abort_details="nope"))
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.NOT_FOUND, e
    list(stub.ServerStream(pb2.EchoRequest(payload=b"y" * 10, response_count=3,
                                           digest_only=True)))
    stub.ClientStream(iter([pb2.EchoRequest(payload=b"z" * 5)] * 4))
    list(stub.Bidi(iter([pb2.EchoRequest(payload=b"w" * 7, digest_only=True)] * 2)))
    echo = channel.unary_unary(f"/{GENERIC_SERVICE}/Do")
    assert echo(b"abc", timeout=10) == b"abc"
    assert len(echo(b"e" * big, timeout=30)) == big  # a large answer too
    try:
        channel.unary_unary("/x.Nope/Missing")(b"q", timeout=10)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNIMPLEMENTED, e
    try:
        channel.unary_unary(f"/{SLOW_SERVICE}/Sleep")(b"zz", timeout=0.1)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e


def _sleep(request: bytes, context: grpc.ServicerContext) -> bytes:
    time.sleep(0.4)
    return request


def _dump(reader: Any) -> list[dict[str, Any]]:
    out = []
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                points = []
                for p in m.data.data_points:
                    point: dict[str, Any] = {"attributes": dict(p.attributes)}
                    if hasattr(p, "bucket_counts"):
                        point.update(count=p.count, sum=p.sum, bounds=list(p.explicit_bounds))
                    else:
                        point["value"] = p.value
                    points.append(point)
                out.append({"scope": sm.scope.name, "scope_version": sm.scope.version,
                            "name": m.name, "unit": m.unit, "description": m.description,
                            "type": type(m.data).__name__, "points": points})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stack", choices=("grpc", "argrpc"), required=True)
    parser.add_argument("--stubs", required=True)
    parser.add_argument("--big", type=int, default=4 << 20)
    args = parser.parse_args()
    pb2, pb2_grpc = stubs.load(args.stubs)

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    if args.stack == "grpc":
        import grpc_observability as observability
        mod: Any = grpc
    else:
        import argrpc
        import argrpc.observability as observability  # type: ignore[no-redef]
        mod = argrpc
    plugin = observability.OpenTelemetryPlugin(
        meter_provider=provider,
        generic_method_attribute_filter=lambda method: method.startswith(SLOW_SERVICE))
    plugin.register_global()

    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    server = mod.server(futures.ThreadPoolExecutor(4), options=options)
    pb2_grpc.add_EchoServicer_to_server(EchoServicer(pb2), server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GENERIC_SERVICE, {
        "Do": grpc.unary_unary_rpc_method_handler(lambda request, context: request)}),
        grpc.method_handlers_generic_handler(SLOW_SERVICE, {
            "Sleep": grpc.unary_unary_rpc_method_handler(_sleep)})))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    target = f"127.0.0.1:{port}"
    channel = mod.insecure_channel(target, options=options)
    _calls(channel, pb2, pb2_grpc, args.big)
    transport = getattr(channel, "transport", "grpc")
    channel.close()
    server.stop(None)
    # argrpc's own instruments are observed while the plugin is registered; grpc's plugin
    # exports what it recorded when it is deregistered.
    own = [m for m in _dump(reader) if m["scope"] == "argrpc"]
    plugin.deregister_global()
    metrics = [m for m in _dump(reader) if m["scope"] != "argrpc"] + own
    print(json.dumps({"target": target, "transport": transport, "metrics": metrics}))


if __name__ == "__main__":
    main()
