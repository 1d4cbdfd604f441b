"""bench/loop_pairs.py runs end to end: each pairing asked for is measured in fresh
processes on shared memory, and a kind it does not know is refused by name."""
from __future__ import annotations

import re
import subprocess
import sys

from tests.support.procs import REPO_ROOT, child_env

SCRIPT = str(REPO_ROOT / "bench" / "loop_pairs.py")


def test_each_pairing_asked_for_is_measured() -> None:
    out = subprocess.run([sys.executable, SCRIPT, "--calls", "200", "--rounds", "1",
                          "--pairs", "threaded/asyncio,asyncio/threaded"], env=child_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = {(m[1], m[2]): (float(m[3]), float(m[4])) for m in re.finditer(
        r"^\s*(\w+)\s+(\w+)\s+([\d.]+)\s+([\d.]+)$", out.stdout, re.MULTILINE)}
    assert set(rows) == {("threaded", "asyncio"), ("asyncio", "threaded")}, out.stdout
    for pair, (p50, p99) in rows.items():
        assert 0 < p50 <= p99, (pair, out.stdout)


def test_an_unknown_kind_is_refused_by_name() -> None:
    out = subprocess.run([sys.executable, SCRIPT, "--pairs", "threaded/trio"],
                         env=child_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "threaded/trio" in out.stderr, out.stderr
