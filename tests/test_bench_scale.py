"""`argrpc-bench scale`: many channels in one process, grpc beside argrpc's shared fast
connection and beside a connection per channel; `argrpc-bench replicas`: one round_robin
channel over three servers, each stack; all from real server and client processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.procs import REPO_ROOT


def test_scale_reports_each_configuration(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    run = subprocess.run([sys.executable, "-m", "argrpc_bench", "scale", "--channels", "20",
                          "--reps", "1", "--json", str(out)], cwd=REPO_ROOT,
                         env=dict(os.environ, GRPC_VERBOSITY="NONE"), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "20 channels to one server" in run.stdout, run.stdout
    rows = json.loads(out.read_text())["rows"]
    assert rows["grpc"]["transports"] == ["grpc"]
    # argrpc's twenty channels (and the warm one) share one connection; opting out, each
    # has its own.
    assert rows["argrpc"]["transports"] == ["shm"] and rows["argrpc"]["server_connections"] == 1
    assert rows["argrpc-local"]["transports"] == ["shm"]
    assert rows["argrpc-local"]["server_connections"] == 21
    assert rows["argrpc"]["fds"] < rows["argrpc-local"]["fds"], rows
    # Each argrpc-local connection keeps one descriptor on each side, and the shared one
    # none per channel.
    assert rows["argrpc-local"]["server_fds"] <= 2 * 20 + 2, rows
    assert rows["argrpc"]["rpc_per_s"] > 0 and rows["grpc"]["rpc_per_s"] > 0


def test_replicas_bench_spreads_calls_on_both_stacks(tmp_path: Path) -> None:
    out = tmp_path / "replicas.json"
    run = subprocess.run([sys.executable, "-m", "argrpc_bench", "replicas", "--calls", "30",
                          "--reps", "1", "--sizes", "64", "--json", str(out)], cwd=REPO_ROOT,
                         env=dict(os.environ, GRPC_VERBOSITY="NONE"), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "round_robin channel over 3 replicas" in run.stdout, run.stdout
    runs = json.loads(out.read_text())["runs"]
    for stack, transport in (("grpc", "grpc"), ("argrpc", "shm")):
        result = runs[stack][0]
        assert result["transport"] == transport
        assert len(result["spread"]) == 3 and min(result["spread"]) >= 50, result
