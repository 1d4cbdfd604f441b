"""What holds on one host, across two: host A calls the server on host B by its address,
with no TF_RDMA_* transport set. The order matters at the end: B is killed and
restarted, then powered off for good (the last test).

Everything runs under TCG on two emulated CPUs, so deadlines are generous; the bounds
asserted are the documented liveness bounds, not speed."""
from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import grpc
import pytest

from argrpc._config import LIMITS, Config
from tests.pair import burn, stop
from tests.pair.conftest import HostB, open_remote
from tests.support import conformance_cases as cases
from tests.support import payload
from tests.support.clients import Client
from tests.support.payload import ACC_SIZE, CHUNK_SIZE, MiB

# A call to a peer that vanished ends within: the silence before a PING, the PING's
# timeout, and a margin for the emulated guests.
LIVENESS_BOUND_S = (LIMITS.keepalive_ms + Config().keepalive_timeout_ms) / 1000 + 15


BASE_S = 120.0  # rxe between two TCG guests moves ~20 MB/s
PS_PORT = 50070


def _bidi_30(c: Client) -> None:
    """30 messages of 0 B to 3 MiB through one bidi call, in order and byte-exact."""
    sizes = [0 if i % 3 == 0 else (i * 104729) % (3 << 20) for i in range(30)]
    bodies = [hashlib.sha256(b"%d" % i).digest() * (n // 32) + b"z" * (n % 32)
              for i, n in enumerate(sizes)]
    got = list(c.stub.Bidi(iter(c.req(payload=b) for b in bodies), timeout=300))
    assert [r.payload for r in got] == bodies


def test_transport_chosen_automatically(remote: Client) -> None:
    assert remote.channel.transport == "verbs", remote.channel.fallback_reason
    assert remote.channel.fallback_reason == ""


@pytest.mark.parametrize("size", cases.PAYLOAD_SIZES)
def test_unary_payloads_byte_exact(remote: Client, size: int) -> None:
    cases.unary_payload_byte_exact(remote, size, BASE_S)


def test_server_to_client_rendezvous(remote: Client) -> None:
    cases.server_to_client_rendezvous(remote, BASE_S)


def test_streaming_arities(remote: Client) -> None:
    cases.streaming_arities(remote, BASE_S)


def test_bidi_of_mixed_sizes(remote: Client) -> None:
    _bidi_30(remote)


def test_status_and_metadata(remote: Client) -> None:
    cases.status_and_metadata(remote, BASE_S)
    with pytest.raises(grpc.RpcError) as e:
        remote.stub.Unary(remote.req(raise_exception=True), timeout=BASE_S)
    assert e.value.code() == grpc.StatusCode.UNKNOWN


def test_deadline_and_cancel(remote: Client) -> None:
    cases.deadline_exceeded(remote)
    cases.cancel_reaches_server(remote, BASE_S)


def test_concurrent_calls(remote: Client) -> None:
    c = remote
    sizes = [0, 100, ACC_SIZE + 1, CHUNK_SIZE + 1, 3 * MiB, 7] * 3

    def one(i: int) -> bool:
        body = payload.make(i, sizes[i])
        return c.stub.Unary(c.req(payload=body), timeout=cases.timeout(BASE_S, 4 * sizes[i])).payload == body

    with futures.ThreadPoolExecutor(8) as pool:
        assert all(pool.map(one, range(len(sizes))))


def test_busy_cpus_do_not_make_a_live_peer_dead(remote: Client, host_b: HostB) -> None:
    """Both guests' CPUs kept busy by other processes through a long bidi call."""
    host_b.do("busy", "2")
    local = burn(2)
    try:
        _bidi_30(remote)
    finally:
        stop(local)
        host_b.do("calm")


def _pool_connections(host_b: HostB) -> int:
    return int(host_b.do("pool")["pool"].get("connections", -1))


def _final_variables(directory: Path) -> dict[str, Any]:
    import numpy as np

    from examples.ps_training import checkpoint

    path = checkpoint.latest(str(directory))
    assert path is not None, f"no checkpoint in {directory}"
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def _train_across(host_b: HostB, protocol: str, out: Path) -> list[dict[str, Any]]:
    """examples/ps_training with its PS on B and two workers on A (sync, 20 steps)."""
    worker_hosts = ",".join(f"{os.environ['RXE_SELF_ADDR']}:{50060 + i}" for i in range(2))
    common = [f"--ps_hosts={host_b.addr}:{PS_PORT}", f"--worker_hosts={worker_hosts}",
              f"--server_protocol={protocol}", "--mode=sync", "--train_steps=20",
              "--hidden=64", "--log_every=5", "--startup_timeout=300"]
    host_b.do("ps", *common, "--job_name=ps", "--task_index=0")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    workers = [subprocess.Popen([sys.executable, "-m", "examples.ps_training.trainer", *common,
                                 "--job_name=worker", f"--task_index={i}",
                                 f"--output_dir={out}"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
               for i in range(2)]
    results = []
    try:
        for w in workers:
            text, _ = w.communicate(timeout=900)
            assert w.returncode == 0, text[-3000:]
            results.append(json.loads(text.split("RESULT ", 1)[1].splitlines()[0]))
    finally:
        for w in workers:
            w.kill()
        ps = host_b.do("pswait", timeout=700)
    assert ps["rc"] == 0, ps["tail"]
    return results


def test_parameter_server_across_hosts_matches_grpc(host_b: HostB, tmp_path: Path) -> None:
    """The PS on B, the workers on A: synchronous training ends in the same variables to
    the last bit over verbs as over plain gRPC."""
    runs = {p: _train_across(host_b, p, tmp_path / p) for p in ("grpc", "argrpc")}
    for r in runs["argrpc"]:
        assert set(r["transport"].values()) == {"verbs"}, r["transport"]
    for r in runs["grpc"]:
        assert set(r["transport"].values()) == {"grpc"}, r["transport"]
    grpc_vars = _final_variables(tmp_path / "grpc")
    verbs_vars = _final_variables(tmp_path / "argrpc")
    assert int(verbs_vars["global_step"]) == 20
    for name, value in grpc_vars.items():
        assert (value == verbs_vars[name]).all(), name


def test_doctor_says_verbs_and_why(host_b: HostB) -> None:
    out = subprocess.run([sys.executable, "-m", "argrpc", "doctor", "--target", host_b.target],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = out.stdout.split(f"target {host_b.target}:", 1)[1]
    assert "transport: verbs" in report, out.stdout
    assert f"verbs selection for {host_b.addr}" in out.stdout, out.stdout


def test_b_without_a_device_falls_back_with_the_reason(host_b: HostB, pb: SimpleNamespace) -> None:
    host_b.do("nodevice")
    try:
        # Its own connection: B's server was just restarted, and the connection the
        # module's channel shares with B's old server is only found dead by its keepalive.
        c = open_remote(host_b, pb, own=True)
        try:
            assert c.channel.transport == "grpc"
            reason = c.channel.fallback_reason
            assert "verbs" in reason and "device" in reason, reason
            assert c.stub.Unary(c.req(payload=b"x" * 100000), timeout=BASE_S).payload == b"x" * 100000
        finally:
            c.close()
    finally:
        host_b.do("device")


def test_client_killed_b_returns_to_baseline(host_b: HostB, remote: Client) -> None:
    """A client process on A dies with kill -9 mid-traffic; B's engine lets go of it."""
    base = _pool_connections(host_b)
    code = (
        "import argrpc\n"
        f"ch = argrpc.insecure_channel({host_b.target!r})\n"
        "echo = ch.unary_unary('/argrpc.test.Echo/Unary')\n"
        "echo(b'', timeout=180, wait_for_ready=True)\n"
        "print('go', flush=True)\n"
        "while True:\n"
        "    echo(b'', timeout=120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "go"
        end = time.monotonic() + 120
        while _pool_connections(host_b) <= base:
            assert time.monotonic() < end, "the client process never connected to B"
            time.sleep(0.5)
        time.sleep(random.uniform(0, 1))
    finally:
        proc.kill()
        proc.wait()
    killed = time.monotonic()
    while _pool_connections(host_b) > base:
        assert time.monotonic() - killed < LIVENESS_BOUND_S, "B kept the dead client's connection"
        time.sleep(0.5)


def _call_in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        started = time.monotonic()
        try:
            out["value"] = fn()
        except grpc.RpcError as e:
            out["error"] = e
        out["elapsed"] = time.monotonic() - started

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_server_killed_mid_rendezvous_then_back(host_b: HostB, pb: SimpleNamespace) -> None:
    c = open_remote(host_b, pb)
    try:
        body = payload.make(3, 64 * MiB)
        t, out = _call_in_thread(lambda: c.stub.Unary(c.req(payload=body), timeout=600))
        time.sleep(random.uniform(0.2, 1.5))  # somewhere in the 64 MiB transfer
        killed = time.monotonic()
        host_b.do("kill9")
        t.join(LIVENESS_BOUND_S + 5)
        assert not t.is_alive(), "the call outlived the liveness bound after B's server died"
        assert time.monotonic() - killed < LIVENESS_BOUND_S
        if "error" in out:
            assert out["error"].code() == grpc.StatusCode.UNAVAILABLE, out["error"]
        host_b.do("start")
        resp = c.stub.Unary(c.req(payload=b"back"), timeout=180, wait_for_ready=True)
        assert resp.payload == b"back"
        assert c.channel.transport == "verbs", c.channel.fallback_reason
    finally:
        c.close()


def test_b_powered_off_mid_call(host_b: HostB, pb: SimpleNamespace) -> None:
    """Last: B's whole guest goes away while A has a call in flight."""
    c = open_remote(host_b, pb)
    try:
        t, out = _call_in_thread(lambda: list(c.stub.ServerStream(
            c.req(response_count=100000, response_size=CHUNK_SIZE + 1, response_seed=9),
            timeout=600)))
        time.sleep(random.uniform(0.5, 2.0))
        host_b.send("poweroff")
        gone = time.monotonic()
        t.join(LIVENESS_BOUND_S + 5)
        assert not t.is_alive(), "the call outlived the liveness bound after B powered off"
        assert "error" in out and out["error"].code() == grpc.StatusCode.UNAVAILABLE, out
        assert time.monotonic() - gone < LIVENESS_BOUND_S
    finally:
        closer = threading.Thread(target=c.close, daemon=True)
        closer.start()
        closer.join(30)
        assert not closer.is_alive(), "closing the channel to a powered-off host hung"
