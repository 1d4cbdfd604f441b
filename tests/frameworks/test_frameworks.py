"""Frameworks from PyPI that build their own gRPC servers and channels, run unchanged with
grpc's factories swapped for argrpc's as the README says, side by side with plain grpc:
every answer and status must be the same, the framework's own client must reach its own
server over shared memory, and nothing may read as a lost connection when they part.

- Flower (flwr, federated learning): its server and two clients (its gRPC transport: a
  bidirectional stream per client carrying the model's weights each round), FedAvg over
  a 4 MiB model: the weights' digest after every round, the losses and the metrics.
- KServe (model serving): its ModelServer (a grpc.aio server with its interceptors) and
  its InferenceGRPCClient, the v2 inference protocol: FP32 tensors of 1 KiB to 4 MiB,
  a tensor over the server's 8 MiB limit, the model's InvalidInput, an unknown model and
  a deadline.

How fast each is end to end on both stacks is in docs/benchmarks.md."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.support.procs import REPO_ROOT

HANG_S = 180  # a bound on a hang, for a loaded machine
FLOWER_ROUNDS, FLOWER_MIB = 2, 4


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(module: str, *args: Any, out: Any = subprocess.PIPE) -> subprocess.Popen[str]:
    env = dict(os.environ, GRPC_VERBOSITY="NONE", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", f"tests.frameworks.{module}",
                             *map(str, args)], cwd=REPO_ROOT, env=env, stdout=out,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str]) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    return out or "", err


def _attached_over_shm(server_log: str, clients: int) -> None:
    assert server_log.count("argrpc-log argrpc: shm connection from pid") == clients, \
        server_log[-3000:]
    assert "lost" not in server_log, server_log[-3000:]


def _flower(stack: str) -> tuple[dict[str, Any], str]:
    port = _port()
    server = _start("flower_run", "server", stack, port, FLOWER_ROUNDS, FLOWER_MIB)
    clients = [_start("flower_run", "client", stack, port, seed, FLOWER_MIB,
                      out=subprocess.DEVNULL) for seed in (0, 1)]
    try:
        out, err = _finish(server)
    finally:
        client_logs = [_finish(c)[1] for c in clients]
    for log in client_logs:
        assert "Traceback" not in log, log[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    result.pop("seconds")
    return result, err


def test_flower_trains_the_same_on_argrpc() -> None:
    pytest.importorskip("flwr", reason="flwr is not installed (the test extra installs it)")
    reference, _ = _flower("grpc")
    got, server_log = _flower("argrpc")
    assert got == reference
    assert len(got["digests"]) == FLOWER_ROUNDS
    _attached_over_shm(server_log, 2)


def _kserve(stack: str) -> tuple[dict[str, Any], str]:
    grpc_port, http_port = _port(), _port()
    server = _start("kserve_run", "server", stack, grpc_port, http_port)
    try:
        deadline = time.monotonic() + HANG_S
        while True:  # its gRPC port opens once the model is loaded
            try:
                socket.create_connection(("127.0.0.1", grpc_port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, \
                    server.communicate()[1][-3000:]
                time.sleep(0.2)
        out, _ = _finish(_start("kserve_run", "client", stack, grpc_port))
    finally:
        server.send_signal(signal.SIGTERM)  # kserve stops on SIGTERM, as in a pod
    _, err = _finish(server)
    result = json.loads(out.strip().splitlines()[-1])
    result.pop("seconds")
    return result, err


def test_kserve_serves_the_same_on_argrpc() -> None:
    pytest.importorskip("kserve", reason="kserve is not installed (the test extra installs it)")
    reference, _ = _kserve("grpc")
    got, server_log = _kserve("argrpc")
    assert got == reference
    assert reference["answers"]["invalid input"][0] == "INVALID_ARGUMENT"
    _attached_over_shm(server_log, 1)
