"""argrpc-bench's connection set-up measurement (argrpc_bench.connect): fresh client
processes, each timing its first call, one at a time and in a burst. What is asserted is
that every process succeeds, that an argrpc client counts only when it ended on shared
memory, and the shape `measure()` returns; never how fast anything is."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from argrpc_bench import connect, runner

pytest.importorskip("argrpc._core")
if runner.available_transports()["shm"]:
    pytest.skip(f"shm unavailable: {runner.available_transports()['shm']}",
                allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = {"n", "ok", "p50_ms", "p99_ms", "max_ms", "errors"}


def test_measure_every_process_succeeds_on_its_transport() -> None:
    result = connect.measure(processes=2, burst=3)
    assert result["processes"] == 2 and result["burst_size"] == 3
    for mode, n in (("sequential", 2), ("burst", 3)):
        assert set(result[mode]) == set(connect.STACKS)
        for stack in connect.STACKS:
            r = result[mode][stack]
            assert set(r) == KEYS
            assert r["n"] == n and r["ok"] == n, (mode, stack, r["errors"])
            assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
    assert result["ratio_p50"] > 0
    text = connect.report(result)
    assert "| argrpc | burst | 3 / 3 |" in text and "argrpc p50 / grpc p50" in text


def test_an_argrpc_client_off_shm_is_a_failure() -> None:
    # The fast path switched off in every process: the call works, over gRPC, which is
    # not what the argrpc row measures.
    result = connect.measure(processes=1, burst=0, env={"TF_RDMA_ENABLED": "false"})
    argrpc, grpc = result["sequential"]["argrpc"], result["sequential"]["grpc"]
    assert grpc["ok"] == grpc["n"] == 1
    assert argrpc["n"] == 1 and argrpc["ok"] == 0
    assert "transport 'grpc', not 'shm'" in argrpc["errors"][0]
    assert "TF_RDMA_ENABLED=false" in argrpc["errors"][0]
    assert math.isnan(argrpc["p50_ms"]) and math.isnan(result["ratio_p50"])
    assert result["burst"]["argrpc"]["n"] == 0


def test_command_writes_json(tmp_path: str) -> None:
    path = os.path.join(str(tmp_path), "connect.json")
    out = subprocess.run([sys.executable, "-m", "argrpc_bench.connect", "--processes", "1",
                          "--burst", "2", "--json", path], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "argrpc p50 / grpc p50" in out.stdout
    with open(path) as f:
        saved = json.load(f)
    assert saved["burst"]["argrpc"]["ok"] == 2 and saved["sequential"]["grpc"]["ok"] == 1
