"""Same-host detection with a real second network namespace.

A server in another network namespace is on "another host" as far as shared memory is
concerned: its abstract Unix socket is invisible and its loopback is not ours. The
argrpc channel must notice that in the bootstrap and stay on plain gRPC, with the reason.
Needs root and iproute2 (CI runs as root); skips with the reason otherwise.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Iterator

import pytest

import argrpc
from tests.support.procs import REPO_ROOT, child_env

NS = f"argrpc-t{os.getpid()}"
HOST_IP, NS_IP = "10.231.7.1", "10.231.7.2"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@pytest.fixture
def netns() -> Iterator[str]:
    if os.geteuid() != 0:
        pytest.skip("creating a network namespace needs root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    veth = f"av{os.getpid() % 100000}"
    try:
        _ip("netns", "add", NS)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create a network namespace here: {e.stderr.strip()}")
    try:
        _ip("link", "add", veth, "type", "veth", "peer", "name", veth + "p")
        _ip("link", "set", veth + "p", "netns", NS)
        _ip("addr", "add", f"{HOST_IP}/30", "dev", veth)
        _ip("link", "set", veth, "up")
        _ip("netns", "exec", NS, "ip", "addr", "add", f"{NS_IP}/30", "dev", veth + "p")
        _ip("netns", "exec", NS, "ip", "link", "set", veth + "p", "up")
        _ip("netns", "exec", NS, "ip", "link", "set", "lo", "up")
        yield NS
    finally:
        subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=20)
        subprocess.run(["ip", "netns", "del", NS], capture_output=True, timeout=20)


def test_server_in_other_netns_is_not_shm(netns: str, stubs_dir: str, pb) -> None:
    cmd = ["ip", "netns", "exec", netns, sys.executable, "-m", "tests.support.echo_server",
           "--stack", "argrpc", "--host", NS_IP, "--port", "0", "--stubs", stubs_dir]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=child_env(None), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = ""
        while not line.startswith(("PORT", "ERROR")):
            line = proc.stdout.readline()
            assert line, f"server exited: {proc.stderr.read() if proc.stderr else ''}"
        assert line.startswith("PORT "), line
        port = int(line.split()[1])
        with argrpc.insecure_channel(f"{NS_IP}:{port}") as channel:
            stub = pb.pb2_grpc.EchoStub(channel)
            reply = stub.Unary(pb.pb2.EchoRequest(payload=b"across namespaces"), timeout=30)
            assert reply.payload == b"across namespaces"
            assert channel.transport == "grpc"
            assert "network namespace" in channel.fallback_reason
    finally:
        proc.kill()
        proc.wait(timeout=10)
