"""What a fast connection costs a server, and what happens at the open-file limit.

A server holding 1000 shm connections (clients in ten processes, each channel with a
connection of its own) grows by at most 256 MiB and 3 descriptors per connection (grpc's
own TCP connection is one of them): the rings are faulted in as used and each connection
keeps only its socket. A connection that carries a long run of small calls keeps to its
rings' first pages (a sender whose peer has read everything starts the ring again). Near RLIMIT_NOFILE, on either side, new channels stay on plain gRPC
with a reason naming the limit, nothing raises but grpc's own errors, no argrpc thread
prints a traceback, and the server's accept loop goes on serving once descriptors are
free again."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent import futures
from typing import Any

import grpc
import pytest

import argrpc

HANG_S = 120  # a bound on a hang, for a loaded machine
LOCAL_POOL = '[("grpc.use_local_subchannel_pool", 1)]'

CLIENT = r"""
import collections, resource, sys, time
import grpc, argrpc
target, n, limit, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
if limit:
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
channels = [argrpc.insecure_channel(target, options=%s) for _ in range(n)]
ends, reasons = collections.Counter(), collections.Counter()
for ch in channels:
    try:
        ch.unary_unary("/c/Echo")(b"x" * 100, timeout=timeout)
        ends[ch.transport] += 1
    except grpc.RpcError as e:
        ends["rpc error"] += 1
    except BaseException as e:
        ends["raised " + type(e).__name__] += 1
    if ch.transport == "grpc":
        reasons[ch.fallback_reason] += 1
print(dict(ends), flush=True)
print(dict(reasons), flush=True)
sys.stdin.read()  # hold the connections until told
""" % LOCAL_POOL

SERVER = r"""
import resource, sys
from concurrent import futures
import grpc, argrpc
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[1])))
server = argrpc.server(futures.ThreadPoolExecutor(8))
server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
    "c", {"Echo": grpc.unary_unary_rpc_method_handler(lambda r, c: r)})])
print(server.add_insecure_port("127.0.0.1:0"), flush=True)
server.start()
sys.stdin.read()
server.stop(None)
"""


def _echo_server() -> tuple[Any, int]:
    server = argrpc.server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "c", {"Echo": grpc.unary_unary_rpc_method_handler(lambda r, c: r)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def _clients(port: int, processes: int, channels: int, limit: int = 0,
             timeout: float = 60.0) -> list[Any]:
    """Client processes, each calling once on `channels` channels of their own. A server at
    its fd limit cannot take gRPC connections either: those calls wait for their deadline,
    so the limit tests give them a short one."""
    return [subprocess.Popen([sys.executable, "-c", CLIENT, f"127.0.0.1:{port}",
                              str(channels), str(limit), str(timeout)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(processes)]


def _results(client: Any) -> tuple[dict[str, int], dict[str, int]]:
    ends = eval(client.stdout.readline())  # noqa: S307 - our own child's dict literal
    reasons = eval(client.stdout.readline())  # noqa: S307
    return ends, reasons


def _finish(clients: list[Any]) -> list[str]:
    errs = []
    for c in clients:
        _, err = c.communicate(timeout=HANG_S)
        errs.append(err)
    return errs


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _ring_rss_kib() -> int:
    """What this process holds of argrpc's ring segments, over all their mappings."""
    total, in_ring = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and ":" not in head[0]:  # a mapping's first line
                in_ring = "argrpc-ring" in line
            elif in_ring and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def test_small_calls_keep_to_the_rings_first_pages() -> None:
    server, port = _echo_server()
    try:
        with argrpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            echo = channel.unary_unary("/c/Echo")
            echo(b"x", timeout=HANG_S)
            assert channel.transport == "shm"
            # 20,000 requests and answers of about 100 bytes: two laps of a 1 MiB ring
            # each way, had every batch gone on from the last.
            for _ in range(20_000):
                echo(b"x" * 64, timeout=HANG_S)
            held = _ring_rss_kib()
        # Two segments (one per side), each mapped by both ends in this process; a
        # segment's header and the first pages of its ring.
        assert 0 < held <= 4 * 64, f"the rings hold {held} KiB after 20,000 small calls"
    finally:
        server.stop(None)


def test_a_thousand_connections_cost_the_server_little() -> None:
    server, port = _echo_server()
    try:
        # One connection first: the engine, its pool and threads are not what is measured.
        with argrpc.insecure_channel(f"127.0.0.1:{port}") as warm:
            warm.unary_unary("/c/Echo")(b"x", timeout=HANG_S)
        time.sleep(0.2)
        rss, fds = _rss_mib(), len(os.listdir("/proc/self/fd"))
        clients = _clients(port, 10, 100)
        try:
            for c in clients:
                ends, _ = _results(c)
                assert ends == {"shm": 100}, ends
            grew_mib = _rss_mib() - rss
            grew_fds = len(os.listdir("/proc/self/fd")) - fds
            assert grew_mib <= 256, f"server RSS grew {grew_mib:.0f} MiB for 1000 connections"
            assert grew_fds <= 3 * 1000, f"{grew_fds} more fds for 1000 connections"
        finally:
            errs = _finish(clients)
        assert not any("Traceback" in e for e in errs), errs
    finally:
        server.stop(None)


def test_a_client_near_its_fd_limit_stays_on_grpc_with_the_reason() -> None:
    server, port = _echo_server()
    try:
        clients = _clients(port, 1, 150, limit=200, timeout=5.0)
        ends, reasons = _results(clients[0])
        err = _finish(clients)[0]
        assert "Traceback" not in err, err
        assert not [k for k in ends if k.startswith("raised")], ends
        assert ends.get("shm", 0) > 0 and ends.get("grpc", 0) > 0, ends
        assert any("open-file limit" in r and "RLIMIT_NOFILE 200" in r for r in reasons), reasons
    finally:
        server.stop(None)


def test_a_server_near_its_fd_limit_declines_and_goes_on() -> None:
    server = subprocess.Popen([sys.executable, "-c", SERVER, "200"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]
        clients = _clients(port, 1, 120, timeout=5.0)
        ends, reasons = _results(clients[0])
        assert ends.get("shm", 0) > 0 and ends.get("grpc", 0) > 0, ends
        assert not [k for k in ends if k.startswith("raised")], ends
        assert any("server: the process is near its open-file limit" in r for r in reasons), \
            reasons
        _finish(clients)  # the descriptors come back
        deadline = time.monotonic() + HANG_S
        while True:  # the server notices the connections' ends, then serves again
            again = _clients(port, 1, 1, timeout=5.0)
            ends, _ = _results(again[0])
            _finish(again)
            if ends == {"shm": 1}:
                break
            assert time.monotonic() < deadline, ends
            time.sleep(0.2)
    finally:
        _, err = server.communicate("", timeout=HANG_S)
    assert "Traceback" not in err, err
