"""Flower (flwr, a federated-learning framework) unchanged on argrpc: its own server and
clients (its gRPC transport: a bidirectional stream per client carrying the model's
weights each round), with grpc's factories swapped for argrpc's as the README says. Two
clients, FedAvg, the weights' digest after every round, the losses and the metrics must
equal plain grpc's; the clients must have reached the server over shared memory, and the
server's log must hold no lost connection when the clients leave."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("flwr", reason="flwr is not installed (the test extra installs it)")

from tests.support.procs import REPO_ROOT  # noqa: E402

ROUNDS, MIB = 2, 4
HANG_S = 180  # a bound on a hang, for a loaded machine


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _federation(stack: str) -> tuple[dict[str, Any], str]:
    """One federation's result (the server's JSON line) and the server's stderr."""
    port = _port()
    env = dict(os.environ, GRPC_VERBOSITY="NONE", PYTHONUNBUFFERED="1")
    run = [sys.executable, "-m", "tests.frameworks.flower_run"]
    server = subprocess.Popen(run + ["server", stack, str(port), str(ROUNDS), str(MIB)],
                              cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    clients = [subprocess.Popen(run + ["client", stack, str(port), str(seed), str(MIB)],
                                cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True) for seed in (0, 1)]
    try:
        out, err = server.communicate(timeout=HANG_S)
        client_errs = [c.communicate(timeout=HANG_S)[1] for c in clients]
    finally:
        for p in [server, *clients]:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert server.returncode == 0, err[-3000:]
    for c, cerr in zip(clients, client_errs):
        assert c.returncode == 0, cerr[-3000:]
        assert "Traceback" not in cerr, cerr[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def test_a_federation_trains_the_same_on_argrpc() -> None:
    reference, _ = _federation("grpc")
    got, server_log = _federation("argrpc")
    for result in (reference, got):
        result.pop("seconds")
    assert got == reference
    assert len(got["digests"]) == ROUNDS
    # Both clients on shared memory, and their leaving read as a close, not a loss.
    assert server_log.count("argrpc-log argrpc: shm connection from pid") == 2, server_log[-3000:]
    assert "lost" not in server_log and "Traceback" not in server_log, server_log[-3000:]
