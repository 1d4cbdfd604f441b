"""The soak as a test: ``argrpc-bench soak`` for ARGRPC_SOAK_SECONDS
(default 30) in a fresh process, which must exit 0 — no unprovoked error, fds, pool use
and live heap flat, private RSS within the tolerance — and report every arity and every
provocation.

Marked ``soak`` and left out of the default test command (pytest.ini deselects it):
    python -m pytest -m soak tests/test_soak.py
    ARGRPC_SOAK_SECONDS=600 python -m pytest -m soak tests/test_soak.py   # the 10 minutes
The soak runs in its own process so its engine, pool and RSS figures are its own, not
this test process's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from argrpc_bench import soak

SECONDS = float(os.environ.get("ARGRPC_SOAK_SECONDS", "30"))
# Start-up, the warm-up sweep (4 huge calls per slot) and the settle add a minute or two
# on a busy 2-core machine; a hang is caught by the soak's own watchdog well before this.
BUDGET_S = SECONDS + 300
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.soak
@pytest.mark.timeout(BUDGET_S + 60)
def test_soak(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "argrpc_bench", "soak", "--duration", str(SECONDS),
         "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=BUDGET_S)
    # The summary (stdout) says what failed; the stderr tail says what happened last.
    context = f"exit {proc.returncode}\n{proc.stdout}\n--- stderr tail ---\n" + \
        "\n".join(proc.stderr.splitlines()[-30:])
    assert proc.returncode != soak.EXIT_TRANSPORT, "the soak's channel was not on shm\n" + context
    assert out.exists(), context
    doc = json.loads(out.read_text())
    failed = [f"{c['name']}: {c['detail']}" for c in doc["checks"] if not c["ok"]]
    errors = doc["warmup"]["first_errors"] + doc["soak"]["first_errors"]
    assert not failed and not errors, context
    assert proc.returncode == 0 and doc["ok"] and doc["transport"] == "shm", context

    calls = doc["soak"]["calls"]
    for arity in soak.ARITIES:
        assert calls.get(f"{arity}/none", {}).get("ok", 0) > 0, (arity, calls)
    for provocation, _ in soak.PROVOCATIONS:
        provoked = sum(row["provoked"] for kind, row in calls.items()
                       if kind.endswith("/" + provocation))
        assert provoked > 0, (provocation, calls)
    for when in ("start", "end"):
        for who in ("client", "server"):
            snap = doc["resources"][when][who]
            assert snap["VmRSS"] > 0 and snap["fds"] > 0, (when, who, snap)
