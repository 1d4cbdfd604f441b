"""A tests.aio.aio_service process for a test to call (and kill)."""
from __future__ import annotations

import subprocess
import sys
import tempfile
from typing import Mapping, Optional

from tests.support.procs import REPO_ROOT, LoggedChild, child_env


class AioServer(LoggedChild):
    """One tests.aio.aio_service process; `target` is its host:port."""

    def __init__(self, stack: str, port: int = 0,
                 env: Optional[Mapping[str, str]] = None) -> None:
        self.stack = stack
        self._log = tempfile.NamedTemporaryFile(prefix=f"aio-server-{stack}-", suffix=".log",
                                                delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.aio.aio_service", "--stack", stack,
             "--port", str(port)],
            cwd=REPO_ROOT, env=child_env(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.kill()
            raise RuntimeError(f"{stack} aio server did not start: {line!r}")
        self.port = int(line.split()[1])
        self.target = f"127.0.0.1:{self.port}"
