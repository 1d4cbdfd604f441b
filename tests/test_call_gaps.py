"""bench/call_gaps.py runs end to end: every stack measured at every gap, both ways of
waiting, with the server's CPU beside each, and an unknown stack refused by name."""
from __future__ import annotations

import re
import subprocess
import sys

from tests.support.procs import REPO_ROOT, child_env

SCRIPT = str(REPO_ROOT / "bench" / "call_gaps.py")


def test_every_stack_gap_and_way_is_measured() -> None:
    out = subprocess.run([sys.executable, SCRIPT, "--calls", "100", "--rounds", "1",
                          "--gaps", "0,200"], env=child_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    rows = {}
    for line in out.stdout.splitlines():
        m = re.fullmatch(r"([\w-]+)\s+(\d+)" + r"\s+([\d.]+) /\s+([\d.]+)\s+(\d+)%" * 2, line)
        if m:
            rows[(m[1], int(m[2]))] = [float(x) for x in m.groups()[2:]]
    stacks = ("argrpc", "argrpc-spin", "grpc", "pipe")
    assert set(rows) == {(s, g) for s in stacks for g in (0, 200)}, out.stdout
    for key, (p50_spin, p99_spin, cpu_spin, p50_sleep, p99_sleep, cpu_sleep) in rows.items():
        assert 0 < p50_spin <= p99_spin and 0 < p50_sleep <= p99_sleep, (key, out.stdout)
        assert 0 <= cpu_spin <= 210 and 0 <= cpu_sleep <= 210, (key, out.stdout)


def test_an_unknown_stack_is_refused_by_name() -> None:
    out = subprocess.run([sys.executable, SCRIPT, "--stacks", "argrpc,nccl"], env=child_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unknown stack(s) nccl" in out.stderr, out.stderr
