"""The progress thread (csrc/engine/engine.cc) sleeps until something is due.

On a shared-memory connection it sweeps only at the earliest deadline or keepalive
check, at least every `longest_sleep_ms`: an idle process must not wake hundreds of
times a second (a 5 ms period did, on CPUs its peers' calls need). Counted from the
kernel's own record of the thread's sleeps, not timed."""
from __future__ import annotations

import os
import threading
import time
from concurrent import futures
from typing import Iterator

import grpc
import pytest

import argrpc
from argrpc import _config

ECHO = "/progress.Test/Echo"
HOLD = "/progress.Test/Hold"


def progress_threads() -> list[str]:
    tasks = f"/proc/{os.getpid()}/task"
    found = []
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                if f.read().strip() == "argrpc-progress":
                    found.append(tid)
        except FileNotFoundError:  # ended meanwhile
            pass
    return found


def wakeups(tids: list[str]) -> int:
    total = 0
    for tid in tids:
        with open(f"/proc/{os.getpid()}/task/{tid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches"):
                    total += int(line.split()[1])
    return total


@pytest.fixture
def release() -> threading.Event:
    return threading.Event()


@pytest.fixture
def channel(release: threading.Event) -> Iterator[grpc.Channel]:
    def hold(req: bytes, ctx: grpc.ServicerContext) -> bytes:
        release.wait(30)
        return req

    handler = grpc.method_handlers_generic_handler("progress.Test", {
        "Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req),
        "Hold": grpc.unary_unary_rpc_method_handler(hold)})
    server = argrpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ch = argrpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield ch
    finally:
        release.set()
        ch.close()
        server.stop(None)


@pytest.mark.parametrize("timeout", [None, 60.0], ids=["no-deadline", "call-with-deadline"])
def test_an_idle_progress_thread_sleeps(channel: grpc.Channel, release: threading.Event,
                                        timeout: float | None) -> None:
    echo = channel.unary_unary(ECHO)
    assert echo(b"x", timeout=timeout) == b"x"
    assert channel.transport == "shm"  # type: ignore[attr-defined]
    tids = progress_threads()
    assert tids, "no thread named argrpc-progress in this process"
    # A call left in flight (its deadline a minute away) must not bring the period back.
    pending = channel.unary_unary(HOLD).future(b"y", timeout=timeout) if timeout else None
    time.sleep(0.2)
    before = wakeups(tids)
    time.sleep(1.0)
    woke = wakeups(tids) - before
    # At most one sweep per longest_sleep_ms, plus a keepalive look per connection and
    # second; a 5 ms period would be 200.
    bound = 1000 // _config.LIMITS.longest_sleep_ms + 40
    assert woke <= bound, f"{len(tids)} progress thread(s) woke {woke} times in 1 s idle"
    if pending is not None:
        assert not pending.done()
        release.set()
        assert pending.result(timeout=10) == b"y"
