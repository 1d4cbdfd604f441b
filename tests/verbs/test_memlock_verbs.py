"""A client process whose locked-memory limit runs out, on a real (Soft-RoCE) device: no
CAP_IPC_LOCK (capsh drops it) and `ulimit -l` of 24 MiB, room for the pool's first
registered prefix and a few connections' rings. Its first connections take verbs; the
next fall back to gRPC with the reason naming the limit; a message that would need more
of the pool registered (sent or received) fails alone, RESOURCE_EXHAUSTED naming the
limit, and the connection it was on goes on; the server (whose limit is fine) goes on
too and logs no protocol error."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.support.procs import script_result

VERBS = {"TF_RDMA_BUF_SIZE": "256M", "TF_RDMA_TRANSPORT": "verbs"}  # small pools: 2 GiB guest
HANG_S = 60
LIMIT_KIB = 24 * 1024

SERVER = r"""
import sys
from concurrent import futures
import grpc, argrpc
unlimited = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
server = argrpc.server(futures.ThreadPoolExecutor(4), options=unlimited)
def echo(request, context):
    if bytes(request[:5]) == b"send ":  # a response of that many bytes
        return b"r" * int(bytes(request[5:]))
    return bytes(request[:8]) + b":" + getattr(context, "transport", "grpc").encode()
server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("h", {
    "E": grpc.unary_unary_rpc_method_handler(echo)})])
print(server.add_insecure_port("127.0.0.1:0"), flush=True)
server.start()
sys.stdin.read()
server.stop(None)
"""

CLIENT = r"""
import json, os, sys, threading
import grpc, argrpc
opts = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", -1),
        ("grpc.max_send_message_length", -1)]
out = {"channels": []}
chans = [argrpc.insecure_channel(os.environ["TARGET"], options=opts) for _ in range(8)]
for ch in chans:
    answer = ch.unary_unary("/h/E")(b"x", timeout=60).decode()
    out["channels"].append([answer, ch.transport, ch.fallback_reason])
first = chans[0].unary_unary("/h/E")

def ends(request):
    try:
        return ["OK", len(first(request, timeout=60))]
    except grpc.RpcError as e:
        return [e.code().name, e.details()]

out["small"] = [ends(b"y" * (1 << 20)), ends(b"send %d" % (1 << 20))]
out["sent"] = ends(b"y" * (40 << 20))
out["received"] = ends(b"send %d" % (40 << 20))
out["after"] = [first(b"z", timeout=60).decode(), chans[0].transport]
out["threads"] = sorted(t.name for t in threading.enumerate())
print("RESULT " + json.dumps(out), flush=True)
"""


def test_a_client_out_of_locked_memory(rdma: SimpleNamespace) -> None:
    if shutil.which("capsh") is None:
        pytest.skip("capsh is not installed (libcap2-bin)")
    server = subprocess.Popen([sys.executable, "-c", SERVER], env={**os.environ, **VERBS},
                              text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        # auto: the channels that cannot have verbs fall back to gRPC (forced verbs would
        # fail their calls instead).
        env = {**VERBS, "TF_RDMA_TRANSPORT": "auto", "TARGET": f"127.0.0.1:{port}"}
        launcher = ("import os, sys\n"
                    "os.execvp('capsh', ['capsh', '--drop=cap_ipc_lock', '--', '-c', "
                    f"'ulimit -l {LIMIT_KIB}; exec ' + sys.executable + ' -c \"$CLIENT_CODE\"'])\n")
        r = script_result(launcher, {**env, "CLIENT_CODE": CLIENT}, timeout=300)
    finally:
        try:  # closes the server's stdin: it stops
            _, err = server.communicate(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            server.kill()
            _, err = server.communicate()
    transports = [t for _, t, _ in r["channels"]]
    assert all(a.startswith("x:") for a, _, _ in r["channels"]), r["channels"]
    assert transports[0] == "verbs" and "grpc" in transports, r["channels"]
    assert transports == sorted(transports, key=lambda t: t != "verbs"), r["channels"]
    for answer, transport, reason in r["channels"]:
        assert answer == f"x:{transport}"
        if transport == "grpc":
            assert "locked-memory limit (ulimit -l)" in reason, reason
    assert r["small"] == [["OK", len("yyyyyyyy:verbs")], ["OK", 1 << 20]]
    for case in ("sent", "received"):
        code, details = r[case]
        assert code == "RESOURCE_EXHAUSTED", r[case]
        assert "locked-memory limit (ulimit -l)" in details, details
    assert r["after"] == ["z:verbs", "verbs"], r["after"]
    assert "protocol error" not in err and "Traceback" not in err, err[-3000:]

