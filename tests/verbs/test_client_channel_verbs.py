"""gRPC's client channel over the verbs fabric: three replica processes behind one
target, round_robin over their verbs connections, channels sharing those connections,
and the service config's retryPolicy (a request stream too) and hedgingPolicy, from a
threaded and an asyncio client, each its own process with TF_RDMA_TRANSPORT=verbs on a
real (Soft-RoCE) device. tests/test_balancing.py and tests/test_service_config.py hold
the same scenarios against grpc on shared memory."""
from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

from tests.support.procs import script_result

VERBS = {"TF_RDMA_BUF_SIZE": "256M", "TF_RDMA_TRANSPORT": "verbs"}  # small pools: 2 GiB guest
HANG_S = 60

REPLICA = r"""
import sys, time
from concurrent import futures
import grpc, argrpc
name = sys.argv[1]
server = argrpc.server(futures.ThreadPoolExecutor(8))
def attempt(context):
    return int(dict(context.invocation_metadata()).get("grpc-previous-rpc-attempts", 0))
def who(request, context):
    return f"{name}:{getattr(context, 'transport', 'grpc')}".encode()
def flaky(request, context):
    if attempt(context) < 2:
        context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")
    return f"{name}:after {attempt(context)}".encode()
def slow(request, context):
    if attempt(context) == 0:  # silent until the hedge overtakes it
        while context.is_active():
            time.sleep(0.01)
        return b"first"
    return f"hedged after {attempt(context)}".encode()
def collect(requests, context):
    got = list(requests)
    if attempt(context) < 1:
        context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")
    return b"|".join(got) + f" after {attempt(context)}".encode()
server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("r", {
    "Who": grpc.unary_unary_rpc_method_handler(who),
    "Flaky": grpc.unary_unary_rpc_method_handler(flaky),
    "Slow": grpc.unary_unary_rpc_method_handler(slow),
    "Collect": grpc.stream_unary_rpc_method_handler(collect)})])
print(server.add_insecure_port("127.0.0.1:0"), flush=True)
server.start()
sys.stdin.read()
server.stop(None)
"""

CLIENT = r"""
import asyncio, collections, json, os
import grpc, argrpc, argrpc.aio
from argrpc import _engine

TARGET = os.environ["REPLICAS"]
POLICY = {"maxAttempts": 4, "initialBackoff": "0.01s", "maxBackoff": "0.05s",
          "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}
CONFIG = json.dumps({"loadBalancingConfig": [{"round_robin": {}}], "methodConfig": [
    {"name": [{"service": "r", "method": "Flaky"}, {"service": "r", "method": "Collect"}],
     "retryPolicy": POLICY},
    {"name": [{"service": "r", "method": "Slow"}], "hedgingPolicy": {
        "maxAttempts": 2, "hedgingDelay": "0.2s", "nonFatalStatusCodes": ["UNAVAILABLE"]}}]})
OPTIONS = [("grpc.service_config", CONFIG)]
out = {}

def open_verbs():
    return _engine.peek_engine().transport_stats().get("verbs", {}).get("connections_open", 0)

with argrpc.insecure_channel(TARGET, options=OPTIONS) as ch:
    who = ch.unary_unary("/r/Who")
    out["spread"] = sorted(collections.Counter(who(b"", timeout=60).decode()
                                               for _ in range(60)).items())
    out["transport"] = [ch.transport, ch.fallback_reason]
    out["flaky"] = sorted({ch.unary_unary("/r/Flaky")(b"", timeout=60).decode().split(":")[1]
                           for _ in range(6)})
    out["hedged"] = ch.unary_unary("/r/Slow")(b"", timeout=60).decode()
    out["collect"] = ch.stream_unary("/r/Collect")(iter([b"a", b"b", b"c"]), timeout=60).decode()
    # Channels of the process share the connections the first one made.
    others = [argrpc.insecure_channel(TARGET, options=OPTIONS) for _ in range(50)]
    out["others"] = sorted({o.unary_unary("/r/Who")(b"", timeout=60).decode().split(":")[1]
                            for o in others})
    out["verbs_connections"] = open_verbs()
    for o in others:
        o.close()


async def aio_main():
    async with argrpc.aio.insecure_channel(TARGET, options=OPTIONS) as ch:
        who = ch.unary_unary("/r/Who")
        got = [(await who(b"", timeout=60)).decode() for _ in range(30)]
        out["aio_spread"] = sorted(collections.Counter(got).items())
        out["aio_flaky"] = (await ch.unary_unary("/r/Flaky")(b"", timeout=60)).decode()
        out["aio_hedged"] = (await ch.unary_unary("/r/Slow")(b"", timeout=60)).decode()

        async def requests():
            for r in (b"x", b"y"):
                await asyncio.sleep(0.01)
                yield r
        out["aio_collect"] = (await ch.stream_unary("/r/Collect")(requests(),
                                                                 timeout=60)).decode()
        out["aio_transport"] = [ch.transport, ch.fallback_reason]

asyncio.run(aio_main())
print("RESULT " + json.dumps(out), flush=True)
"""


def test_replicas_shared_connections_and_service_config_over_verbs(rdma: SimpleNamespace
                                                                   ) -> None:
    env = {**os.environ, **VERBS}
    replicas = [subprocess.Popen([sys.executable, "-c", REPLICA, f"r{i}"], env=env, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                for i in range(3)]
    try:
        ports = []
        for p in replicas:
            assert p.stdout is not None
            ports.append(int(p.stdout.readline()))
        target = "ipv4:" + ",".join(f"127.0.0.1:{port}" for port in ports)
        r = script_result(CLIENT, {**VERBS, "REPLICAS": target}, timeout=300)
    finally:
        for p in replicas:
            assert p.stdin is not None
            p.stdin.close()
        for p in replicas:
            try:
                p.wait(HANG_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    assert r["transport"] == ["verbs", ""], r["transport"]
    assert r["spread"] == [[f"r{i}:verbs", 20] for i in range(3)], r["spread"]
    assert r["flaky"] == ["after 2"], r["flaky"]  # every call retried twice, to success
    assert r["hedged"] == "hedged after 1"
    assert r["collect"] == "a|b|c after 1"
    assert r["others"] == ["verbs"]
    assert r["verbs_connections"] == 3, r  # one per replica, for 51 channels
    assert r["aio_transport"] == ["verbs", ""], r["aio_transport"]
    assert r["aio_spread"] == [[f"r{i}:verbs", 10] for i in range(3)], r["aio_spread"]
    assert r["aio_flaky"].endswith("after 2")
    assert r["aio_hedged"] == "hedged after 1"
    assert r["aio_collect"] == "x|y after 1"
