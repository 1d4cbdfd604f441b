"""One measured run of a bench that needs a server process and a client process: the
server prints ``PORT n`` and serves until its stdin closes; the client, given
``--target``, prints one ``RESULT {json}`` line."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Sequence

__all__ = ["run_server_and_client"]


def run_server_and_client(module: str, server_args: Sequence[str], client_args: Sequence[str],
                          timeout: float, what: str) -> dict[str, Any]:
    me = [sys.executable, "-m", module]
    server = subprocess.Popen(me + list(server_args), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"{what}: the server did not start: {line!r}")
        out = subprocess.run(me + list(client_args) + ["--target", f"127.0.0.1:{line.split()[1]}"],
                             capture_output=True, text=True, timeout=timeout)
        lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            raise RuntimeError(f"{what}: the client failed: {out.stderr[-2000:]}")
        result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
        return result
    finally:
        if server.stdin is not None:
            server.stdin.close()
        try:
            server.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
