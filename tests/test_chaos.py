"""Peers killed at random moments (``argrpc-bench chaos``, bench/argrpc_bench/chaos.py), a
bounded sample of it: real server and client processes over shared memory, half of the
trials with both cores kept busy by two spinning processes.

Each run draws a new seed (``ARGRPC_CHAOS_SEED`` fixes it), so the sample covers other
scenarios and other moments every time; a failure prints the seed and the command that
replays the failing trial. The 500-trial result is in docs/benchmarks.md.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from argrpc_bench import chaos

REPO = Path(__file__).resolve().parent.parent
SEED = int(os.environ.get("ARGRPC_CHAOS_SEED", random.randrange(1 << 20)))
KILL_TRIALS = int(os.environ.get("ARGRPC_CHAOS_TRIALS", "24"))


def _run(tmp_path: Path, **kw: Any) -> dict[str, Any]:
    cfg = chaos.ChaosConfig(seed=SEED, workdir=str(tmp_path), **kw)
    doc = chaos.run(cfg, say=print)
    assert doc["ok"], f"seed {SEED}\n{chaos.report(doc)}"
    return doc


@pytest.mark.timeout(900)
def test_kill_at_random_moments(tmp_path: Path) -> None:
    """SIGKILL of the server or of a client, every arity and size, half under load."""
    doc = _run(tmp_path, trials=KILL_TRIALS, load="half")
    trials = doc["trials"]
    assert len(trials) == KILL_TRIALS
    assert {t["scenario"].split("/")[0] for t in trials} == set(chaos.VICTIMS)
    assert any(t["loaded"] for t in trials) and not all(t["loaded"] for t in trials)
    for t in trials:
        assert t["end_s"] is not None and t["end_s"] <= chaos.SHM_BOUND_S, t
        if t["scenario"].startswith("server/"):
            assert t["code"] in ("UNAVAILABLE", "DEADLINE_EXCEEDED"), t


@pytest.mark.timeout(600)
def test_peer_hangs_up_but_keeps_its_memory(tmp_path: Path) -> None:
    """A peer that shuts its argrpc socket and lives on, memory still mapped."""
    doc = _run(tmp_path, trials=4, faults=("hangup",), sizes=("eager", "chunks"),
               arities=("unary", "bidi"))
    assert all(t["end_s"] <= chaos.SHM_BOUND_S for t in doc["trials"])


@pytest.mark.timeout(600)
def test_stopped_peer_is_dropped_after_the_keepalive(tmp_path: Path) -> None:
    """SIGSTOP: the survivor's calls end, and its pool blocks come back, within the
    keepalive bound; a stopped client cannot pin the server's pool."""
    doc = _run(tmp_path, trials=2, faults=("stop",), sizes=("chunks",),
               arities=("server_stream",))
    assert {t["scenario"].split("/")[0] for t in doc["trials"]} == set(chaos.VICTIMS)
    assert all(t["end_s"] <= chaos.KEEPALIVE_BOUND_S for t in doc["trials"])


def test_cli_replays_one_trial(tmp_path: Path) -> None:
    """``--only`` runs just that trial, and the table and verdict are printed."""
    out = tmp_path / "chaos.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "argrpc_bench", "chaos", "--seed", str(SEED), "--trials", "40",
         "--only", "7", "--sizes", "0B,eager", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "| scenario |" in proc.stdout and proc.stdout.rstrip().endswith(f"written: {out}")
    assert "\nPASS\n" in proc.stdout
    import json

    doc = json.loads(out.read_text())
    assert [t["index"] for t in doc["trials"]] == [7]
    again = chaos.plan(chaos.ChaosConfig(seed=SEED, trials=40, sizes=("0B", "eager")))[7]
    assert doc["trials"][0]["scenario"] == again.scenario.name


def test_bad_arguments_are_refused() -> None:
    proc = subprocess.run([sys.executable, "-m", "argrpc_bench", "chaos", "--faults", "boom"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "boom: choose from kill,stop,hangup" in proc.stderr


@pytest.mark.timeout(300)
def test_a_server_that_cannot_start_says_why(tmp_path: Path) -> None:
    """The trial's details quote the server's own last words (here the environment
    variable it refused), not an error of reading them after the log was closed."""
    cfg = chaos.ChaosConfig(seed=SEED, trials=1, victims=("server",), transport="bogus",
                            workdir=str(tmp_path))
    doc = chaos.run(cfg)
    assert not doc["ok"]
    (trial,) = doc["trials"]
    assert trial["outcome"] == "setup failed", trial
    assert "chaos server did not start" in trial["details"], trial
    assert "TF_RDMA_TRANSPORT='bogus'" in trial["details"], trial
