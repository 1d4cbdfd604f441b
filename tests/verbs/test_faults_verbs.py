"""Failure handling of the verbs fabric with real processes in the
Soft-RoCE guest, both ends forced onto verbs (TF_RDMA_TRANSPORT=verbs):

1. `kill -9` of the server while a large rendezvous is in flight (client->server request,
   and server->client streamed responses): the client's call ends UNAVAILABLE (or
   DEADLINE_EXCEEDED, had its deadline come first) within KILL_BOUND_S, with a detail.
2. The same channel's next call, once a server is back on the same port, succeeds over
   verbs, byte-exact (the channel renegotiates).
3. `kill -9` of a client process mid-rendezvous (both directions): the server keeps
   serving another client byte-exact, and its pool (in_use, connection count) and fds
   come back to what they were before that client came.
4. A 256 MiB unary echo, byte-exact both ways (sha256), in a fresh client process.
5. A client process that never close()s its channel still exits.

"Mid-rendezvous" is not guessed from timing: the kill happens once the server's pool
shows the large message's block in use (echo_server's `pool` command). Everything under
TCG is slow and noisy, so the bounds are generous and the measured times are printed
(`pytest -s` shows them). Skips with the reason where there is no usable RDMA device.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any, Iterator

import grpc
import pytest

from tests.support import payload
from tests.support.clients import UNLIMITED, UNLIMITED_SERVER_ARGS
from tests.support.payload import MiB
from tests.support.faults import Baseline, ClientProc, pool, wait_pool
from tests.support.procs import ServerProcess

VERBS_ENV = {"TF_RDMA_TRANSPORT": "verbs", "TF_RDMA_BUF_SIZE": "256M"}
# The 256 MiB echo needs a pool larger than one message (the pool is sparse: only what
# is used is faulted in, so this costs the guest's 2 GiB nothing up front).
BIG_ENV = {"TF_RDMA_TRANSPORT": "verbs", "TF_RDMA_BUF_SIZE": "512M"}

KILL_BOUND_S = 30.0       # a killed peer must fail the in-flight call within this
BIG = 96 * MiB            # a client->server rendezvous that lasts seconds under TCG,
#                           received into the pool (at most half of it holds received messages)
STREAM_SIZE = 32 * MiB    # server->client: several large streamed responses
STREAM_COUNT = 8
CALL_TIMEOUT = 600.0      # far beyond KILL_BOUND_S: the kill, not the deadline, must end it
START_TIMEOUT = 180.0


def _log(msg: str) -> None:
    print(f"[faults] {msg}", file=sys.stderr, flush=True)


@pytest.fixture(scope="module")
def verbs_env(rdma: SimpleNamespace) -> Iterator[None]:
    """This process's channels use verbs (the engine is process-wide; if an earlier test
    module created it, its pool is the same 256M the conformance tests use)."""
    saved = {k: os.environ.get(k) for k in VERBS_ENV}
    os.environ.update(VERBS_ENV)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _server(stubs_dir: str, env: dict[str, str] = VERBS_ENV, port: int = 0) -> ServerProcess:
    args = [*UNLIMITED_SERVER_ARGS] + (["--port", str(port)] if port else [])
    return ServerProcess("argrpc", stubs_dir, args, env, start_timeout=START_TIMEOUT)


class _Chan:
    """An argrpc channel in this process, checked to be on verbs after its warm-up."""

    def __init__(self, target: str, pb: SimpleNamespace) -> None:
        import argrpc

        self.pb2 = pb.pb2
        self.channel = argrpc.insecure_channel(target, options=UNLIMITED)
        self.stub = pb.pb2_grpc.EchoStub(self.channel)
        self.echo_ok(b"warm-up")

    def req(self, **fields: Any) -> Any:
        return self.pb2.EchoRequest(**fields)

    def echo_ok(self, body: bytes, timeout: float = 240.0) -> None:
        resp = self.stub.Unary(self.req(payload=body), timeout=timeout, wait_for_ready=True)
        assert resp.size == len(body) and payload.sha256(resp.payload) == payload.sha256(body)
        assert self.channel.transport == "verbs", self.channel.fallback_reason

    def close(self) -> None:
        self.channel.close()


def _assert_killed_status(code: Any, details: str, elapsed: float, what: str) -> None:
    assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), (
        f"{what}: expected UNAVAILABLE, got {code} {details!r}")
    assert details and len(details.strip()) >= 8, f"{what}: unreadable detail {details!r}"
    assert elapsed <= KILL_BOUND_S, f"{what}: took {elapsed:.1f}s (bound {KILL_BOUND_S}s)"


def _kill_server_mid_call(chan: _Chan, server: ServerProcess, direction: str
                          ) -> tuple[Any, str, float]:
    """Start a large call in `direction`, SIGKILL the server once its pool holds the
    message, and return (code, details, seconds from the kill to the call's end).
    Raises AssertionError if the call did not end within KILL_BOUND_S + 30 s."""
    outcome: dict[str, Any] = {}
    first = threading.Event()

    def run() -> None:
        try:
            if direction == "request":
                chan.stub.Unary(chan.req(payload=payload.make(3, BIG), digest_only=True),
                                timeout=CALL_TIMEOUT)
            else:
                call = chan.stub.ServerStream(chan.req(
                    response_count=STREAM_COUNT, response_size=STREAM_SIZE, response_seed=9),
                    timeout=CALL_TIMEOUT)
                outcome["call"] = call
                for _ in call:
                    first.set()
            outcome["code"], outcome["details"] = grpc.StatusCode.OK, "completed"
        except grpc.RpcError as e:
            outcome["code"], outcome["details"] = e.code(), e.details() or ""
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            outcome["code"], outcome["details"] = None, f"{type(e).__name__}: {e}"
        outcome["end"] = time.monotonic()
        first.set()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    if direction == "response":
        assert first.wait(CALL_TIMEOUT), "no streamed response arrived"
    stats = wait_pool(server, lambda s: s.get("in_use", 0) > 0, timeout=120,
                       stop=lambda: "end" in outcome)
    assert "end" not in outcome, f"the call ended before the kill: {outcome}"
    assert stats.get("in_use", 0) > 0, f"server pool never held the message: {stats}"
    server.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    server.proc.wait(timeout=30)
    worker.join(KILL_BOUND_S + 30)
    if worker.is_alive():  # a hang: free the thread, then report it as the failure
        call = outcome.get("call")
        if call is not None:
            call.cancel()
        raise AssertionError(
            f"{direction}: the in-flight call did not end within {KILL_BOUND_S + 30:.0f}s "
            f"of kill -9 of the server (pool at the kill: {stats})")
    elapsed = outcome["end"] - killed
    _log(f"server kill mid-{direction}: {outcome['code']} after {elapsed:.2f}s: "
         f"{outcome['details']!r} (server pool at the kill: {stats})")
    return outcome["code"], outcome["details"], elapsed


# -- 1 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("direction", ["request", "response"])
def test_server_kill_fails_inflight_call(verbs_env: None, stubs_dir: str, pb: SimpleNamespace,
                                         direction: str) -> None:
    server = _server(stubs_dir)
    chan = None
    try:
        chan = _Chan(server.target, pb)
        code, details, elapsed = _kill_server_mid_call(chan, server, direction)
        _assert_killed_status(code, details, elapsed, f"server kill mid-{direction}")
    finally:
        if chan is not None:
            chan.close()
        server.kill()


# -- 2 ------------------------------------------------------------------------------------
def test_same_channel_renegotiates_after_server_restart(verbs_env: None, stubs_dir: str,
                                                         pb: SimpleNamespace) -> None:
    server = _server(stubs_dir)
    chan, again = None, None
    try:
        chan = _Chan(server.target, pb)
        port = server.port
        code, details, _ = _kill_server_mid_call(chan, server, "request")
        assert code != grpc.StatusCode.OK, details
        server.kill()
        again = _server(stubs_dir, port=port)
        assert again.port == port
        t0 = time.monotonic()
        chan.echo_ok(payload.make(5, 3 * payload.CHUNK_SIZE + 7))  # rendezvous, both ways
        _log(f"same channel after restart: first call OK in {time.monotonic() - t0:.2f}s "
             f"over {chan.channel.transport}")
        chan.echo_ok(b"small")  # eager path too
        resp = chan.stub.Unary(chan.req(response_size=2 * payload.CHUNK_SIZE + 1,
                                        response_seed=77), timeout=240)
        assert resp.payload == payload.make(77, 2 * payload.CHUNK_SIZE + 1)
        assert pool(again).get("connections", 0) >= 1
    finally:
        if chan is not None:
            chan.close()
        server.kill()
        if again is not None:
            again.kill()


IDLE_BOUND_S = 30.0  # idle keepalive (2 s) + the QP's retries, with TCG to spare


def test_idle_connection_notices_dead_server(verbs_env: None, stubs_dir: str,
                                             pb: SimpleNamespace) -> None:
    """An idle verbs connection has no socket to hang up: the idle keepalive's write to
    the dead peer fails, so the connection is gone before the next call needs it, and
    that call, once a server is back, succeeds at once over verbs."""
    from argrpc import _engine

    server = _server(stubs_dir)
    chan, again = None, None
    try:
        chan = _Chan(server.target, pb)
        engine = _engine.peek_engine()
        before = engine.connection_count
        port = server.port
        server.kill()
        t0 = time.monotonic()
        while engine.connection_count >= before and time.monotonic() - t0 < IDLE_BOUND_S:
            time.sleep(0.1)
        _log(f"idle connection to a killed server dropped after {time.monotonic() - t0:.2f}s")
        assert engine.connection_count < before, "the idle connection outlived its dead peer"
        again = _server(stubs_dir, port=port)
        chan.echo_ok(payload.make(6, payload.CHUNK_SIZE + 9))
    finally:
        if chan is not None:
            chan.close()
        server.kill()
        if again is not None:
            again.kill()


# -- 3: client processes killed --------------------------------------------------------
@pytest.mark.parametrize("direction", ["request", "response"])
def test_client_kill_server_keeps_serving_and_frees(verbs_env: None, stubs_dir: str,
                                                    pb: SimpleNamespace, direction: str) -> None:
    server = _server(stubs_dir)
    other, victim = None, None
    try:
        other = _Chan(server.target, pb)  # the client that must keep working
        # One rendezvous each way first, so the server's pool has grown (its memfd exists)
        # before the baseline: what is compared afterwards is what the dead client left.
        other.echo_ok(payload.make(15, payload.CHUNK_SIZE + 1))
        base = Baseline(server)
        _log(f"client kill mid-{direction}: server baseline pool={base.pool} "
             f"fds={base.res['fds']}")

        size, count = (BIG, 1) if direction == "request" else (STREAM_SIZE, STREAM_COUNT)
        # Response direction: the client stops reading after the first response, so the
        # server has the next ones exposed when it dies.
        victim = ClientProc(server.target, stubs_dir, direction, size, VERBS_ENV, count,
                            pause=direction == "response")
        transport = victim.ready_transport(START_TIMEOUT)
        assert transport == "verbs", (
            f"client not ready on verbs ({transport!r}): {victim.lines} {victim.stderr_tail()}")
        started = victim.wait_line("SENDING" if direction == "request" else "GOT", 240)
        assert started, f"client did not start its call: {victim.lines} {victim.stderr_tail()}"
        during = wait_pool(server, lambda s: s.get("in_use", 0) > 0, timeout=120,
                            stop=lambda: victim.proc.poll() is not None)
        assert victim.proc.poll() is None, f"client ended before the kill: {victim.lines}"
        assert during.get("in_use", 0) > 0, f"server pool never held the message: {during}"
        assert not any(l.startswith("DONE") for l in victim.lines)
        victim.kill()
        killed = time.monotonic()
        _log(f"client kill mid-{direction}: killed with server pool {during}")

        # The server keeps serving the other client, byte-exact, both rendezvous directions.
        other.echo_ok(payload.make(17, 2 * payload.CHUNK_SIZE + 5))
        resp = other.stub.Unary(other.req(response_size=payload.CHUNK_SIZE + 3,
                                          response_seed=19), timeout=240)
        assert resp.payload == payload.make(19, payload.CHUNK_SIZE + 3)
        _log(f"client kill mid-{direction}: other client served "
             f"{time.monotonic() - killed:.2f}s after the kill")

        problems, took = base.problems(timeout=60)
        _log(f"client kill mid-{direction}: server back at baseline after {took:.2f}s: "
             f"{problems or 'yes'}")
        other.echo_ok(b"still fine")
        assert server.alive()
        assert not problems, f"server did not free the killed client's resources: {problems}"
    finally:
        if victim is not None:
            victim.kill()
        if other is not None:
            other.close()
        server.kill()


def _server_fate(server: ServerProcess) -> str:
    """What became of the server, for a failure's message: a server the kernel killed
    leaves its client only a transport error (its queue pair stops answering)."""
    rc = server.proc.poll()
    try:
        kernel = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
        oom = [l for l in kernel.splitlines() if "Out of memory" in l or "oom-kill" in l]
        oom_text = str(oom[-3:] or "none")
    except (OSError, subprocess.SubprocessError) as exc:
        oom_text = f"unknown (dmesg: {exc})"
    return (f"server: {'running' if rc is None else f'exited rc={rc}'}; "
            f"kernel OOM lines: {oom_text}\n{server.log_tail(15)}")


def test_256mib_unary_echo_byte_exact(rdma: SimpleNamespace, stubs_dir: str) -> None:
    size = 256 * MiB
    # Byte exactness, not how soon a dead peer fails: an emulated CPU copying 256 MiB
    # through rxe can leave a queue pair unacknowledged for longer than the default
    # timeout's seven tries (about 7.5 s), so each try here waits 8.6 s; and it can hold a
    # live peer's keepalive answer behind the transfer for longer than the default 10 s.
    env = {**BIG_ENV, "TF_RDMA_QP_TIMEOUT": "21", "TF_RDMA_KEEPALIVE_TIMEOUT_MS": "120000"}
    server = _server(stubs_dir, env=env)
    client = None
    try:
        client = ClientProc(server.target, stubs_dir, "invert", size, env)
        assert client.ready_transport(START_TIMEOUT) == "verbs", (
            f"{client.lines} {client.stderr_tail()}")
        line = client.wait_line("RESULT", 1200)
        assert line, (f"no result: {client.lines} {client.stderr_tail()}\n"
                      f"{_server_fate(server)}")
        result = json.loads(line.split(" ", 1)[1])
        _log(f"256 MiB echo: {result}")
        assert result["transport"] == "verbs" and result["size"] == size, result
        assert result["exact"] and result["sent_intact"], result
        assert client.wait_line("DONE", 120), f"{client.lines} {client.stderr_tail()}"
        t0 = time.monotonic()
        rc = client.exit_code(120)
        _log(f"256 MiB echo: client exit {rc} {time.monotonic() - t0:.2f}s after DONE")
        assert rc == 0, f"client did not exit cleanly after its last call (rc={rc}) " + \
            client.stderr_tail()
        assert wait_pool(server, lambda s: s.get("in_use", 1) == 0, 60).get("in_use") == 0
    finally:
        if client is not None:
            client.kill()
        server.kill()


def test_client_process_exits_without_channel_close(rdma: SimpleNamespace,
                                                     stubs_dir: str) -> None:
    server = _server(stubs_dir)
    client = None
    try:
        client = ClientProc(server.target, stubs_dir, "idle", 0, VERBS_ENV)
        assert client.ready_transport(START_TIMEOUT) == "verbs", (
            f"{client.lines} {client.stderr_tail()}")
        assert client.wait_line("DONE", 120), f"{client.lines} {client.stderr_tail()}"
        t0 = time.monotonic()
        rc = client.exit_code(60)
        _log(f"unclosed channel: client exit {rc} {time.monotonic() - t0:.2f}s after DONE")
        assert rc is not None, "client did not exit within 60 s of its last line"
        assert rc == 0, f"client exit status {rc}: {client.stderr_tail()}"
    finally:
        if client is not None:
            client.kill()
        server.kill()


# -- fork -------------------------------------------------------------------------------------
def _forked_child(chan: _Chan, results: Any) -> None:
    try:
        for i in range(3):  # the inherited channel: its own verbs connection in the child
            chan.echo_ok(payload.make(60 + i, payload.CHUNK_SIZE + 11 * i))
        results.put(("ok", chan.channel.transport))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.put(("error", f"{type(e).__name__}: {e}"))


def test_fork_child_and_parent_both_work_over_verbs(verbs_env: None, stubs_dir: str,
                                                    pb: SimpleNamespace) -> None:
    """fork() with a live verbs connection: the child negotiates its own connection (new
    QPs, its own engine), and the parent's registered buffers keep working (no
    copy-on-write page left behind the HCA): large calls both ways stay byte-exact."""
    import multiprocessing

    server = _server(stubs_dir)
    chan = None
    try:
        chan = _Chan(server.target, pb)
        chan.echo_ok(payload.make(50, 2 * payload.CHUNK_SIZE + 1))
        before = chan.channel._fast
        ctx = multiprocessing.get_context("fork")
        results = ctx.Queue()
        child = ctx.Process(target=_forked_child, args=(chan, results))
        child.start()
        for i in range(3):  # the parent writes its staging and ring pages meanwhile
            chan.echo_ok(payload.make(70 + i, payload.CHUNK_SIZE + 7 * i))
        outcome = results.get(timeout=600)
        child.join(120)
        assert outcome == ("ok", "verbs"), outcome
        assert child.exitcode == 0
        for i in range(3):
            chan.echo_ok(payload.make(80 + i, 3 * payload.CHUNK_SIZE + i))
            chan.echo_ok(b"small %d" % i)
        assert chan.channel._fast is before and before.alive
    finally:
        if chan is not None:
            chan.close()
        server.kill()
