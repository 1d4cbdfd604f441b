"""Run echo servers and helper clients as separate processes."""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import argrpc
from argrpc_bench.chaos import reap

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
# Where the argrpc under test lives: the checkout in an editable run, site-packages when
# scripts/test_installed.sh runs the suite against the installed wheel.
PACKAGE_ROOT = Path(argrpc.__file__).resolve().parent.parent


def child_env(extra: Mapping[str, str] | None = None,
              drop: Sequence[str] = ()) -> dict[str, str]:
    """Environment for a child: this one, the repo and its argrpc-bench importable,
    TF_RDMA_* as asked."""
    env = dict(os.environ)
    for key in drop:
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), str(REPO_ROOT / "bench")]
        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


class LoggedChild:
    """A child process whose stderr goes to a temporary log: kill() reaps it (with the
    chaos peer's reaper) and removes the log."""

    proc: subprocess.Popen[str]
    _log: Any

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        reap(self.proc, self._log)
        try:
            os.unlink(self._log.name)
        except OSError:
            pass


class ServerError(RuntimeError):
    """The server process failed to start; carries its ERROR line or log tail."""


class ServerProcess(LoggedChild):
    """One tests.support.echo_server process; `target` is its host:port."""

    def __init__(self, stack: str, stubs_dir: str | os.PathLike[str],
                 args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 start_timeout: float = 60.0) -> None:
        self.stack = stack
        self._log = tempfile.NamedTemporaryFile(
            prefix=f"echo-server-{stack}-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "tests.support.echo_server", "--stack", stack,
               "--port", "0", "--stubs", str(stubs_dir), *args]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=child_env(env), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        first = self.expect(("PORT", "ERROR"), timeout=start_timeout)
        if not first.startswith("PORT "):
            self.kill()
            raise ServerError(f"{stack} server failed: {first}\n{self.log_tail()}")
        self.port = int(first.split()[1])
        self.target = f"127.0.0.1:{self.port}"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def expect(self, prefixes: tuple[str, ...], timeout: float = 60.0) -> str:
        """Next stdout line starting with one of `prefixes` (others are skipped)."""
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.stack} server said nothing matching {prefixes} "
                                   f"in {timeout}s\n{self.log_tail()}")
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                rc = self.proc.wait(timeout=10)
                return f"EXITED rc={rc}"
            if line.startswith(prefixes):
                return line

    def command(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self, grace: float | None, timeout: float = 90.0) -> bool:
        """Ask the server to stop(grace) and wait for it to say it finished."""
        self.command(f"stop {'none' if grace is None else grace}")
        line = self.expect(("STOPPED",), timeout=timeout)
        return json.loads(line.split(" ", 1)[1]) if line.startswith("STOPPED") else False

    def resources(self) -> dict[str, Any]:
        self.command("resources")
        return json.loads(self.expect(("RESOURCES",)).split(" ", 1)[1])

    def finish(self, timeout: float = 90.0) -> dict[str, Any]:
        """Close stdin, return the exit REPORT and reap the process."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        line = self.expect(("REPORT",), timeout=timeout)
        if not line.startswith("REPORT "):
            raise ServerError(f"{self.stack} server gave no report ({line})\n{self.log_tail()}")
        self.proc.wait(timeout=30)
        return json.loads(line.split(" ", 1)[1])

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = Path(self._log.name).read_text(errors="replace")
        except OSError:
            return ""
        return "--- server stderr (tail) ---\n" + "\n".join(text.splitlines()[-lines:])


def run_python(code: str, env: Mapping[str, str] | None = None,
               drop_env: Sequence[str] = (), timeout: float = 120.0
               ) -> subprocess.CompletedProcess[str]:
    """Run a short client script in a fresh interpreter (fresh environment parsing)."""
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT,
                          env=child_env(env, drop_env), capture_output=True, text=True,
                          timeout=timeout)


def script_result(code: str, env: Mapping[str, str], timeout: float = 300.0) -> dict[str, Any]:
    """Runs a client script whose last "RESULT <json>" line says what it saw, in a fresh
    interpreter with no TF_RDMA_* but those of `env`; that JSON, which must not carry
    an "error"."""
    drop = [k for k in os.environ if k.startswith("TF_RDMA_")]
    proc = run_python(code, env=env, drop_env=drop, timeout=timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, f"client process failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1][len("RESULT "):])
    assert "error" not in result, result["error"]
    return result

