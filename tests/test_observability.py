"""argrpc.observability.OpenTelemetryPlugin against grpc_observability's, on real calls.

The oracle: the same calls (tests/support/otel_scenario.py) on a grpc client and server
with grpc's plugin, and on an argrpc client and server with argrpc's, each collected with
the OpenTelemetry SDK's in-memory reader. grpc's instruments must come out with the same
names, units, descriptions, scope, label sets, call counts and message byte sums, whether
argrpc carried the calls over shared memory or over plain gRPC.
"""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support.procs import REPO_ROOT, child_env

pytest.importorskip("opentelemetry.sdk.metrics", reason="needs opentelemetry-sdk (argrpc[test])")
pytest.importorskip("grpc_observability", reason="needs grpcio-observability (argrpc[test])")

BOOTSTRAP = "argrpc.v1.Bootstrap/Negotiate"
CALL_DURATION = "grpc.client.call.duration"
ATTEMPT_DURATION = "grpc.client.attempt.duration"
SCENARIO_TIMEOUT_S = 120


def _scenario(stack: str, stubs_dir: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.otel_scenario", "--stack", stack,
         "--stubs", stubs_dir], cwd=REPO_ROOT, env=child_env(env or {}),
        capture_output=True, text=True, timeout=SCENARIO_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def _series(run: dict[str, Any], scope: str) -> dict[str, dict[str, Any]]:
    """{metric name: {"meta": ..., "points": {label tuple: point}}}, labels with the run's
    target replaced by "T" so two runs compare."""
    out: dict[str, dict[str, Any]] = {}
    for m in run["metrics"]:
        if m["scope"] != scope:
            continue
        points = {}
        for p in m["points"]:
            attrs = dict(p["attributes"])
            if attrs.get("grpc.target") == run["target"]:
                attrs["grpc.target"] = "T"
            points[tuple(sorted(attrs.items()))] = p
        out[m["name"]] = {"meta": (m["unit"], m["description"], m["type"],
                                   m["scope_version"]), "points": points}
    return out


def _without_bootstrap(series: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The series without argrpc's negotiation: the server names it (a registered method),
    the client counts it as "other" (grpc's unregistered call), so the client's "other"
    series lose what the server's named series show of it."""
    def named(name: str) -> dict[str, Any]:
        points = series.get(name, {"points": {}})["points"]
        return next((p for k, p in points.items() if ("grpc.method", BOOTSTRAP) in k), {})

    started, duration = named("grpc.server.call.started"), named("grpc.server.call.duration")
    request = named("grpc.server.call.rcvd_total_compressed_message_size").get("sum", 0)
    answer = named("grpc.server.call.sent_total_compressed_message_size").get("sum", 0)
    out = {}
    for name, s in series.items():
        points = {k: dict(p) for k, p in s["points"].items() if ("grpc.method", BOOTSTRAP) not in k}
        other = (("grpc.method", "other"), ("grpc.status", "OK"), ("grpc.target", "T"))
        if name == "grpc.client.attempt.started":
            other = (("grpc.method", "other"), ("grpc.target", "T"))
        p = points.get(other)
        # (argrpc's call duration never counted it: it times its own channels' calls)
        if name.startswith("grpc.client.attempt.") and p is not None and started:
            if "value" in p:
                p["value"] -= started["value"]
            else:
                p["count"] -= duration["count"]
                p["sum"] -= {"grpc.client.attempt.sent_total_compressed_message_size": request,
                             "grpc.client.attempt.rcvd_total_compressed_message_size": answer
                             }.get(name, 0)
        out[name] = {"meta": s["meta"], "points": points}
    return out


@pytest.fixture(scope="module")
def oracle(stubs_dir: str) -> dict[str, Any]:
    return _scenario("grpc", stubs_dir)


# grpc-python's server records a call whose client deadline passed (its handler still
# running) as OK; argrpc's records the status the call ended with. grpc's server never
# reads the request of an UNIMPLEMENTED call; argrpc's received it with the headers.
SLOW = "x.Slow/Sleep"
UNREAD = ("grpc.server.call.rcvd_total_compressed_message_size",
          (("grpc.method", "other"), ("grpc.status", "UNIMPLEMENTED")))


# ClientStream's answer carries the server's report (peer address, metadata): its size is
# checked within a run (what the client received is what the server sent).
VARIES = "argrpc.test.Echo/ClientStream"
ANSWER_SIZES = ("grpc.client.attempt.rcvd_total_compressed_message_size",
                "grpc.server.call.sent_total_compressed_message_size")


def _comparable(name: str, points: dict[Any, Any]) -> set[Any]:
    return {k for k in points
            if not (name.startswith("grpc.server.call.") and dict(k)["grpc.method"] == SLOW)}


def _compare(oracle: dict[str, Any], run: dict[str, Any]) -> None:
    want = _series(oracle, "grpc-python")
    got = _without_bootstrap(_series(run, "grpc-python"))
    assert CALL_DURATION not in want, "grpc-python now records the call duration itself"
    assert set(got) == set(want) | {CALL_DURATION}, (sorted(got), sorted(want))
    for name, w in want.items():
        g = got[name]
        assert g["meta"] == w["meta"], name
        keys = _comparable(name, w["points"])
        assert _comparable(name, g["points"]) == keys, (name, sorted(g["points"]), sorted(keys))
        for key in keys:
            wp, gp = w["points"][key], g["points"][key]
            if "value" in wp:
                assert gp["value"] == wp["value"], (name, key)
                continue
            assert gp["count"] == wp["count"], (name, key)
            assert gp["bounds"] == wp["bounds"], (name, key)
            if name.endswith("_size"):
                if (name, key) != UNREAD and not (name in ANSWER_SIZES
                                                  and dict(key)["grpc.method"] == VARIES):
                    assert gp["sum"] == wp["sum"], (name, key)
            else:
                assert gp["sum"] > 0, (name, key)
    received, sent = (sum(p["sum"] for k, p in got[n]["points"].items()
                          if dict(k)["grpc.method"] == VARIES) for n in ANSWER_SIZES)
    assert received == sent > 0
    # The call duration: one point per attempt (argrpc makes one attempt per call).
    calls, attempts = got[CALL_DURATION], got[ATTEMPT_DURATION]
    assert calls["meta"][:3] == ("s", "End-to-end time taken to complete a call from "
                                      "client's perspective", "Histogram")
    assert {k: p["count"] for k, p in calls["points"].items()} == \
        {k: p["count"] for k, p in attempts["points"].items()}


def test_fast_path_calls_match_grpcs_own_plugin(oracle: dict[str, Any], stubs_dir: str) -> None:
    run = _scenario("argrpc", stubs_dir)
    assert run["transport"] == "shm"
    _compare(oracle, run)
    # The negotiation is one call on the gRPC connection, named by the server.
    started = _series(run, "grpc-python")["grpc.server.call.started"]["points"]
    assert started[(("grpc.method", BOOTSTRAP),)]["value"] == 1


def test_plain_grpc_calls_match_grpcs_own_plugin(oracle: dict[str, Any], stubs_dir: str) -> None:
    """TF_RDMA_ENABLED=false: grpc carries every call and grpc's own plugin (which argrpc's
    registers) records the attempts; argrpc times the calls."""
    run = _scenario("argrpc", stubs_dir, {"TF_RDMA_ENABLED": "false"})
    assert run["transport"] == "grpc"
    _compare(oracle, run)
    fallbacks = _series(run, "argrpc")["argrpc.fallbacks"]["points"]
    assert fallbacks == {(("argrpc.reason", "disabled"),): {
        "attributes": {"argrpc.reason": "disabled"}, "value": 1}}


def test_argrpc_instruments_by_transport(oracle: dict[str, Any], stubs_dir: str) -> None:
    run = _scenario("argrpc", stubs_dir)
    own = _series(run, "argrpc")
    assert {"argrpc.connections.open", "argrpc.transport.bytes", "argrpc.pool.in_use",
            "argrpc.pool.capacity", "argrpc.pool.waits", "argrpc.keepalive.failures"} <= set(own)
    moved = {dict(k)["argrpc.path"] + "/" + dict(k)["argrpc.direction"]: p["value"]
             for k, p in own["argrpc.transport.bytes"]["points"].items()
             if dict(k)["argrpc.transport"] == "shm"}
    # Client and server share the process: every message is counted sent and received.
    # The 4 MiB requests and answer went by rendezvous (received into the pool, or as a
    # view of the sender's block), the small ones eagerly.
    big = 4 << 20
    assert moved["rendezvous/sent"] >= 3 * big, moved
    assert moved["rendezvous/received"] + moved.get("zero_copy/received", 0) >= 3 * big, moved
    assert 0 < moved["eager/sent"] < big, moved
    assert own["argrpc.keepalive.failures"]["points"][(("argrpc.transport", "shm"),)]["value"] == 0
    assert own["argrpc.pool.capacity"]["points"][()]["value"] > 0
    assert "argrpc.fallbacks" not in own  # nothing fell back


def test_register_like_grpcs_plugin() -> None:
    script = r'''
import logging
import grpc_observability
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
import argrpc.observability as obs

provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
plugin = obs.OpenTelemetryPlugin(meter_provider=provider)
plugin.register_global()
try:
    obs.OpenTelemetryPlugin(meter_provider=provider).register_global()
except RuntimeError as e:
    print("twice:", e)
plugin.deregister_global()
try:
    plugin.deregister_global()
except RuntimeError as e:
    print("none:", e)
with obs.OpenTelemetryPlugin(meter_provider=provider):
    print("inside")
# grpc's own plugin registered by the application first stays the application's.
theirs = grpc_observability.OpenTelemetryPlugin(meter_provider=provider)
theirs.register_global()
with obs.OpenTelemetryPlugin(meter_provider=provider):
    pass
theirs.deregister_global()  # raises if argrpc's had deregistered it
print("theirs kept")
'''
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=child_env({}),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("twice: ") and lines[1].startswith("none: "), lines
    assert lines[2:] == ["inside", "theirs kept"], lines


def test_argrpc_without_a_plugin_never_loads_opentelemetry() -> None:
    script = r'''
import sys, argrpc, argrpc.aio
from argrpc import _engine, _config
core = _engine.core_module()
_engine.get_engine(_config.load())
assert not [m for m in sys.modules if m.startswith(("opentelemetry", "grpc_observability"))]
print(core._take_call_stats(0))
'''
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=child_env({}),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "([], 0)"


def test_asyncio_calls_are_recorded(stubs_dir: str, pb: SimpleNamespace) -> None:
    script = r'''
import asyncio, json, os, sys
sys.path.insert(0, os.getcwd())
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
import argrpc.aio, argrpc.observability
from tests.support import stubs
pb2, pb2_grpc = stubs.load(os.environ["STUBS"])

class Echo(pb2_grpc.EchoServicer):
    async def Unary(self, request, context):
        return pb2.EchoResponse(payload=request.payload)

async def main():
    reader = InMemoryMetricReader()
    plugin = argrpc.observability.OpenTelemetryPlugin(
        meter_provider=MeterProvider(metric_readers=[reader]))
    plugin.register_global()
    server = argrpc.aio.server()
    pb2_grpc.add_EchoServicer_to_server(Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    target = f"127.0.0.1:{port}"
    async with argrpc.aio.insecure_channel(target) as channel:
        stub = pb2_grpc.EchoStub(channel)
        for _ in range(3):
            await stub.Unary(pb2.EchoRequest(payload=b"a" * 100))
        transport = channel.transport
    await server.stop(None)
    plugin.deregister_global()
    points = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    if dict(p.attributes).get("grpc.method") == "argrpc.test.Echo/Unary":
                        points[m.name] = (dict(p.attributes), getattr(p, "count", None),
                                          getattr(p, "sum", getattr(p, "value", None)))
    print(json.dumps({"target": target, "transport": transport, "points": points}))

asyncio.run(main())
'''
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT,
                          env=child_env({"STUBS": stubs_dir}), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    assert run["transport"] == "shm"
    points = run["points"]
    request = len(pb.pb2.EchoRequest(payload=b"a" * 100).SerializeToString())
    assert points["grpc.client.attempt.started"] == [
        {"grpc.method": "argrpc.test.Echo/Unary", "grpc.target": run["target"]}, None, 3]
    attrs, count, total = points["grpc.client.attempt.sent_total_compressed_message_size"]
    assert attrs["grpc.status"] == "OK" and count == 3 and total == 3 * request
    assert points["grpc.server.call.started"][2] == 3
    assert points["grpc.server.call.rcvd_total_compressed_message_size"][1:] == [3, 3 * request]
    assert points[CALL_DURATION][1] == 3


def test_a_forked_child_records_its_own_calls() -> None:
    """The engine gives a forked child an empty queue with recording still on; the plugin
    starts the child's own thread to take it (the parent's is not copied by fork)."""
    script = r'''
import json, os, threading, time
from concurrent import futures
import grpc
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
import argrpc, argrpc.observability

reader = InMemoryMetricReader()
plugin = argrpc.observability.OpenTelemetryPlugin(
    meter_provider=MeterProvider(metric_readers=[reader]),
    generic_method_attribute_filter=lambda method: method.startswith("demo."))
plugin.register_global()
server = argrpc.server(futures.ThreadPoolExecutor(4))
server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("demo.E", {
    "E": grpc.unary_unary_rpc_method_handler(lambda request, context: request)}),))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
channel = argrpc.insecure_channel(f"127.0.0.1:{port}")
echo = channel.unary_unary("/demo.E/E")

def started(name):
    total = 0
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    total += sum(p.value for p in m.data.data_points
                                 if dict(p.attributes).get("grpc.method") == "demo.E/E")
    return total

for _ in range(2):
    echo(b"p", timeout=30)
started("grpc.client.attempt.started")  # recorded before the fork
pid = os.fork()
if pid == 0:
    code = 1
    try:
        for _ in range(3):
            echo(b"c", timeout=30)
        deadline = time.monotonic() + 10
        while started("grpc.client.attempt.started") < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        taker = any(t.name == "argrpc-metrics" for t in threading.enumerate())
        print("child", channel.transport, started("grpc.client.attempt.started"), taker,
              flush=True)
        code = 0
    finally:
        os._exit(code)
_, status = os.waitpid(pid, 0)
echo(b"p", timeout=30)
print("parent", os.waitstatus_to_exitcode(status), started("grpc.client.attempt.started"),
      started("grpc.server.call.started"), flush=True)
channel.close()
server.stop(None)
plugin.deregister_global()
'''
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=child_env({}),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split("\n")
    # The child's reader holds the parent's two calls (copied by fork) and its own three;
    # the parent's, its own three calls and, as the server, the child's three as well.
    assert "child shm 5 True" in lines, proc.stdout
    assert "parent 0 3 6" in lines, proc.stdout
