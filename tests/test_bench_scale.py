"""`argrpc-bench scale`: many channels in one process, grpc beside argrpc's shared fast
connection and beside a connection per channel, from real server and client processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.procs import REPO_ROOT


def test_scale_reports_each_configuration(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    run = subprocess.run([sys.executable, "-m", "argrpc.benchtool", "scale", "--channels", "20",
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
