"""Cores kept busy by other processes, for the tests that must hold on a loaded machine."""
from __future__ import annotations

import contextlib
import subprocess
import sys
from typing import Iterator


@contextlib.contextmanager
def busy_cores(n: int) -> Iterator[None]:
    """`n` processes that spin for as long as the block runs."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for h in hogs:
            h.kill()
            h.wait()
