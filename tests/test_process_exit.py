"""A client process ends promptly without closing its channel, as a grpcio one does.

Scripts that never call ``channel.close()`` are common; the channel is then closed
from ``__del__`` during interpreter shutdown, and a daemon thread may still be inside
a call. Either must not keep the process alive.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import subprocess
import sys
import time

import pytest

from tests.support.clients import SHM_AND_REFERENCE, UNLIMITED_SERVER_ARGS, pair_id
from tests.support.procs import REPO_ROOT, child_env
from tests.support.hooks import needs_test_hooks

EXIT_BUDGET_S = 20.0  # generous on a loaded 2-core machine; a hang is what is caught

SCRIPT = r'''
import os, sys, threading
sys.path.insert(0, os.getcwd())
import grpc, argrpc
from tests.support import stubs
pb2, pb2_grpc = stubs.load(os.environ["STUBS"])
make = argrpc.insecure_channel if os.environ["STACK"] == "argrpc" else grpc.insecure_channel
channel = make(os.environ["TARGET"], options=[("grpc.max_receive_message_length", -1),
                                             ("grpc.max_send_message_length", -1)])
stub = pb2_grpc.EchoStub(channel)
assert stub.Unary(pb2.EchoRequest(payload=b"x"), timeout=30, wait_for_ready=True).payload == b"x"
big = b"\x05" * (8 << 20)
assert stub.Unary(pb2.EchoRequest(payload=big), timeout=60).payload == big
if os.environ["MODE"] == "call_in_flight":
    started = threading.Event()
    def hold():
        started.set()
        try:
            stub.Unary(pb2.EchoRequest(sleep_ms=60000), timeout=120)
        except grpc.RpcError:
            pass
    threading.Thread(target=hold, daemon=True).start()
    started.wait()
if os.environ.get("TRANSPORT_CHECK") == "1":
    print("TRANSPORT", channel.transport, flush=True)
print("DONE", flush=True)
'''


@pytest.mark.parametrize("pair", SHM_AND_REFERENCE, ids=pair_id)
@pytest.mark.parametrize("mode", ["idle", "call_in_flight"])
def test_process_exits_without_close(pair: tuple[str, str], mode: str, servers: Any,
                                     pb: SimpleNamespace, stubs_dir: str) -> None:
    server = servers.get(pair[1], UNLIMITED_SERVER_ARGS)
    env = {"STUBS": stubs_dir, "TARGET": server.target, "STACK": pair[0], "MODE": mode,
           "TRANSPORT_CHECK": "1" if pair[0] == "argrpc" else "0"}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=REPO_ROOT, env=child_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("DONE"):
                break
        done_at = time.monotonic()
        try:
            rc = proc.wait(timeout=EXIT_BUDGET_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"client process did not exit {EXIT_BUDGET_S:.0f} s after its last line")
        stderr = proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert rc == 0, stderr[-2000:]
    assert any(line.startswith("DONE") for line in lines), stderr[-2000:]
    print(f"exited {time.monotonic() - done_at:.2f} s after DONE")
    if pair[0] == "argrpc":
        assert "TRANSPORT shm\n" in lines
    # The server stays usable for the next client.
    assert server.alive()


RACE_SCRIPT = r'''
import sys, threading, time
from argrpc import _engine
core = _engine.core_module()

class SlowAtExit:
    """Finalizing begins, then this releases the GIL while the thread below wants it."""
    def __del__(self):
        sys.stdout.write(f"FINALIZING {sys.is_finalizing()}\n")
        sys.stdout.flush()
        time.sleep(0.6)

keep = SlowAtExit()
keep.cycle = keep  # collected during finalization, not at module teardown's start
threading.Thread(target=core._without_gil_for_test, args=(300,), daemon=True).start()
time.sleep(0.05)
print("EXITING", flush=True)
'''


@needs_test_hooks
def test_a_thread_retaking_the_gil_as_finalizing_begins_does_not_abort() -> None:
    """CPython ends such a thread from inside PyEval_RestoreThread; it parks instead.

    A daemon thread came back from the engine just before finalizing began and waits for
    the GIL; when finalization releases it (here a __del__ that sleeps), CPython unwinds
    the thread with pthread_exit(). Unwinding through the binding's frames used to end the
    process with "terminate called without an active exception".
    """
    proc = subprocess.run([sys.executable, "-c", RACE_SCRIPT], cwd=REPO_ROOT, env=child_env({}),
                          capture_output=True, text=True, timeout=EXIT_BUDGET_S)
    assert "FINALIZING True" in proc.stdout, (proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stderr
    assert "terminate" not in proc.stderr, proc.stderr
