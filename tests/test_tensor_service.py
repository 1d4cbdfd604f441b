"""examples/tensor_service: the asyncio tensor service on real arrays, over grpc.aio and
argrpc.aio, every byte checked by the example itself (it exits non-zero otherwise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tensor_service_compare() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "examples.tensor_service.service", "--compare",
         "--tensors", "3", "--mib", "4"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["stack"] for r in rows] == ["grpc", "argrpc"]
    assert rows[0]["transport"] == "grpc"
    assert rows[1]["transport"] == "shm"
    for r in rows:
        assert r["names"] == 4  # the three tensors and the warm-up one
        assert r["put_MiB_s"] > 0 and r["get_MiB_s"] > 0
