"""Helpers for provoked-failure tests: client processes to kill at a known point, and
polling a server's pool, connection count and fds back to a baseline.

"At a known point" is not guessed from timing: a client process prints a line when it
has reached the state the test wants to interrupt, and the server's `pool` command shows
whether the large message's block is in use.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any, Callable

from tests.support import payload
from tests.support.clients import UNLIMITED, make_channel
from tests.support.procs import REPO_ROOT, ServerProcess, child_env

# A client process. F_MODE:
#   request   send one F_SIZE request (digest_only) and wait for the answer
#   response  stream F_COUNT responses of F_SIZE; with F_PAUSE=1, stop reading after the
#             first and sleep (the server keeps its next responses exposed)
#   hold      one unary call answered with F_SIZE bytes, kept (a zero-copy view of the
#             server's block on shm) while the process sleeps
#   bidi      a bidi stream that has exchanged one message and then waits
#   invert    F_SIZE through the Raw/Invert method, both directions checked by sha256
#   idle      only the warm-up; the channel is left for the interpreter to drop
CLIENT_SCRIPT = r"""
import hashlib, json, os, queue, resource, sys, time
import numpy as np
import grpc, argrpc
from tests.support import payload, stubs

MiB = 1 << 20
mode, target, size = os.environ["F_MODE"], os.environ["F_TARGET"], int(os.environ["F_SIZE"])
pb2, pb2_grpc = stubs.load(os.environ["F_STUBS"])
opts = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
ch = argrpc.insecure_channel(target, options=opts)
stub = pb2_grpc.EchoStub(ch)
stub.Unary(pb2.EchoRequest(payload=b"warm-up"), timeout=240, wait_for_ready=True)
print("READY " + json.dumps([ch.transport, ch.fallback_reason]), flush=True)
if mode == "request":
    body = payload.make(11, size)
    print("SENDING", flush=True)
    stub.Unary(pb2.EchoRequest(payload=body, digest_only=True), timeout=600)
elif mode == "response":
    for r in stub.ServerStream(pb2.EchoRequest(response_count=int(os.environ["F_COUNT"]),
                                               response_size=size, response_seed=13),
                               timeout=600):
        print(f"GOT {r.index}", flush=True)
        if os.environ.get("F_PAUSE") == "1":
            time.sleep(3600)
elif mode == "hold":
    kept = stub.Unary(pb2.EchoRequest(response_size=size, response_seed=3), timeout=600)
    print(f"GOT {len(kept.payload)}", flush=True)
    time.sleep(3600)
elif mode == "bidi":
    q = queue.Queue()
    def requests():
        while True:
            item = q.get()
            if item is None:
                return
            yield item
    q.put(pb2.EchoRequest(payload=b"b" * 1000))
    calls = stub.Bidi(requests(), timeout=600)
    first = next(calls)
    print(f"GOT {len(first.payload)}", flush=True)
    time.sleep(3600)
elif mode == "invert":
    invert = ch.unary_unary("/argrpc.test.Raw/Invert", request_serializer=None,
                            response_deserializer=None)
    body = payload.make(21, size)
    want = hashlib.sha256()
    view = memoryview(body)
    for off in range(0, size, 16 * MiB):
        want.update(np.bitwise_not(np.frombuffer(view[off:off + 16 * MiB], dtype=np.uint8)))
    sent = hashlib.sha256(body).hexdigest()
    t0 = time.monotonic()
    resp = invert(body, timeout=1200)
    took = time.monotonic() - t0
    got = hashlib.sha256(resp).hexdigest()
    print("RESULT " + json.dumps({
        "transport": ch.transport, "size": len(resp), "seconds": took,
        "exact": got == want.hexdigest(), "sent_intact": hashlib.sha256(body).hexdigest() == sent,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}), flush=True)
    ch.close()
print("DONE", flush=True)
"""


class ClientProc:
    """A client process running CLIENT_SCRIPT; its stdout lines are collected."""

    def __init__(self, target: str, stubs_dir: str, mode: str, size: int,
                 env: dict[str, str], count: int = 1, pause: bool = False) -> None:
        extra = {**env, "F_MODE": mode, "F_TARGET": target, "F_SIZE": str(size),
                 "F_STUBS": stubs_dir, "F_COUNT": str(count), "F_PAUSE": "1" if pause else "0"}
        # stderr goes to a file: a pipe nobody reads could block the child.
        self._err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT], cwd=REPO_ROOT,
                                     env=child_env(extra), stdout=subprocess.PIPE,
                                     stderr=self._err, text=True)
        self.lines: list[str] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cv:
                self.lines.append(line.rstrip("\n"))
                self._cv.notify_all()
        with self._cv:
            self.lines.append("<EOF>")
            self._cv.notify_all()

    def wait_line(self, prefix: str, timeout: float) -> str:
        """The first line starting with `prefix`, or "" at EOF or timeout."""
        end = time.monotonic() + timeout
        with self._cv:
            while True:
                for line in self.lines:
                    if line.startswith(prefix):
                        return line
                if "<EOF>" in self.lines or time.monotonic() > end:
                    return ""
                self._cv.wait(0.2)

    def ready_transport(self, timeout: float) -> str:
        """Waits for READY and returns the channel's transport ("" if it never came)."""
        line = self.wait_line("READY", timeout)
        return json.loads(line.split(" ", 1)[1])[0] if line else ""

    def exit_code(self, timeout: float) -> int | None:
        """Waits for the process to end on its own; its exit status, or None if it did not."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stderr_tail(self) -> str:
        self._err.seek(0)
        return "--- client stderr (tail) ---\n" + "\n".join(self._err.read().splitlines()[-30:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


def pool(server: ServerProcess) -> dict[str, Any]:
    """The server engine's pool stats plus "connections"."""
    server.command("pool")
    return json.loads(server.expect(("POOL",), timeout=60).split(" ", 1)[1])


def wait_pool(server: ServerProcess, pred: Callable[[dict[str, Any]], bool],
              timeout: float, stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while True:
        stats = pool(server)
        if pred(stats) or stop() or time.monotonic() > end:
            return stats
        time.sleep(0.05)


class Baseline:
    """A server's pool, connection count, fds, threads and /dev/shm entries at one
    moment, to come back to."""

    def __init__(self, server: ServerProcess, timeout: float = 60.0) -> None:
        self.server = server
        self.pool = wait_pool(server, lambda s: s.get("in_use", 1) == 0, timeout=timeout)
        self.res = server.resources()

    def problems(self, timeout: float) -> tuple[list[str], float]:
        """Polls until the server is back at the baseline; what is still off, and how long
        it was given."""
        t0 = time.monotonic()
        while True:
            now, res = pool(self.server), self.server.resources()
            problems = []
            if now.get("in_use") != 0:
                problems.append(f"pool in_use {now.get('in_use')} (baseline 0)")
            if now.get("connections") != self.pool.get("connections"):
                problems.append(f"connections {now.get('connections')} "
                                f"(baseline {self.pool.get('connections')})")
            # The server's pool may have grown (up to its size): its threads are not a leak.
            own, base = (res["os_threads"] - res["pool_threads"],
                         self.res["os_threads"] - self.res["pool_threads"])
            if own > base:
                problems.append(f"threads {base} -> {own} outside the server's pool "
                                f"(Python: {sorted(set(res['thread_names']) - set(self.res['thread_names']))})")
            if res["dev_shm"] != self.res["dev_shm"]:
                problems.append(f"/dev/shm changed: {res['dev_shm']}")
            if res["fds"] > self.res["fds"]:
                new = sorted((Counter(res["fd_targets"]) -
                              Counter(self.res["fd_targets"])).elements())
                problems.append(f"fds {self.res['fds']} -> {res['fds']} (new: {new})")
            took = time.monotonic() - t0
            if not problems or took > timeout:
                return problems, took
            time.sleep(0.2)


class ShmClient:
    """An argrpc channel in this process that must keep working while another peer
    misbehaves or dies: every check is byte-exact and on the shm fast path."""

    def __init__(self, target: str, pb: Any, options: Any = ()) -> None:
        self.pb = pb
        self.pb2 = pb.pb2
        # A connection of its own: it stands for another client process of the server.
        self.channel = make_channel("argrpc", target,
                                    UNLIMITED + [("grpc.use_local_subchannel_pool", 1),
                                                 *options])
        self.stub = pb.pb2_grpc.EchoStub(self.channel)

    def echo(self, size: int, seed: int, both_ways: bool = False) -> None:
        """Echoes `size` bytes; with both_ways also has the server send `size` bytes."""
        body = payload.make(seed, size)
        resp = self.stub.Unary(self.pb2.EchoRequest(payload=body), timeout=60,
                               wait_for_ready=True)
        assert payload.sha256(resp.payload) == payload.sha256(body)
        if both_ways:
            resp = self.stub.Unary(self.pb2.EchoRequest(response_size=size,
                                                        response_seed=seed), timeout=60)
            assert resp.payload == payload.make(seed, size)
        assert self.channel.transport == "shm", self.channel.fallback_reason

    def connection(self) -> Any:
        """The negotiated engine connection (what a raw peer writes through)."""
        conn = self.channel._fast
        assert conn is not None and conn.alive
        return conn
