"""Connection set-up: how long a new channel's first call takes.

    python -m argrpc_bench.connect [--processes 50] [--burst 64] [--json PATH]

One benchmark server per stack (``argrpc_bench.server``: grpc.server or
argrpc.server) stays up for the whole run. Each measured client is a fresh Python
process that imports everything first (grpc, argrpc on its stack, the benchmark's
messages), waits for the go, then times from creating the channel
(``grpc.insecure_channel`` / ``argrpc.insecure_channel``) to the return of its first
unary 64 B ``Echo``: for argrpc that includes the negotiation, creating the engine and
attaching the shared memory. An argrpc client that did not end on shared memory
(``channel.transport``) counts as failed.

* sequential: ``processes`` clients per stack, one at a time, the stacks interleaved
  (grpc, argrpc, grpc, ...) so the machine's drift hits both alike: p50/p99/max;
* burst: ``burst`` clients of one stack at once against its server (every client
  imports first, then all get the go together): how many succeeded, p50 and the
  slowest first call.

``measure()`` returns the numbers (see its docstring for the shape); the command prints
them as a table with argrpc's p50 over grpc's (the goal is at most 2).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import select
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

__all__ = ["STACKS", "main", "measure"]

STACKS = ("grpc", "argrpc")
GOAL_RATIO = 2.0
PAYLOAD_BYTES = 64
_CALL_TIMEOUT_S = 30.0
_READY_TIMEOUT_S = 120.0   # a fresh process's imports; many at once on 2 cores are slow
_RESULT_TIMEOUT_S = 60.0   # from the go to the result line
_SERVER_TIMEOUT_S = 60.0
_MAX_ERRORS = 5            # error texts kept per stack and mode
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # children import this argrpc


# ------------------------------------------------------------------------- the client

def _client(stack: str, target: str) -> int:
    """One measured first call. Prints ``READY``, waits for a line on stdin, then prints
    one JSON result line."""
    import grpc  # noqa: F401 - imported before the clock starts, as an application has

    from argrpc_bench import messages as msg
    from argrpc_bench.client import make_channel
    if stack == "argrpc":
        import argrpc  # noqa: F401 - likewise

    request = msg.Payload(buffers=[b"x" * PAYLOAD_BYTES])
    print("READY", flush=True)
    if not sys.stdin.readline():  # the orchestrator went away
        return 2
    try:
        t0 = time.perf_counter_ns()
        channel = make_channel(stack, target)
        echo = channel.unary_unary(msg.path(msg.SERVICE, msg.ECHO),
                                   request_serializer=msg.Payload.SerializeToString,
                                   response_deserializer=msg.Payload.FromString)
        reply = echo(request, timeout=_CALL_TIMEOUT_S)
        t1 = time.perf_counter_ns()
        transport = str(getattr(channel, "transport", "grpc"))
        reason = str(getattr(channel, "fallback_reason", "") or "")
        channel.close()
    except Exception as e:  # noqa: BLE001 - reported to the orchestrator
        _emit({"ok": False, "error": f"{type(e).__name__}: {e}"})
        return 1
    expected = "shm" if stack == "argrpc" else "grpc"
    if list(reply.buffers) != list(request.buffers):
        _emit({"ok": False, "error": "the echo came back different"})
    elif transport != expected:
        _emit({"ok": False, "error": f"transport {transport!r}, not {expected!r}: {reason}"})
    else:
        _emit({"ok": True, "ms": (t1 - t0) / 1e6, "transport": transport})
    return 0


def _emit(result: dict[str, Any]) -> None:
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()


# ------------------------------------------------------------------- the orchestrator

class _Server:
    """The benchmark server of one stack, up until close()."""

    def __init__(self, stack: str, env: Mapping[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "argrpc_bench.server", "--stack", stack],
            cwd=_PACKAGE_ROOT, env=dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True)
        assert self.proc.stdout is not None
        line = _readline(self.proc, _SERVER_TIMEOUT_S)
        if not line.startswith("PORT "):
            self.close()
            raise RuntimeError(f"connect bench: the {stack} server did not start: {line!r}")
        self.target = f"127.0.0.1:{line.split()[1]}"

    def close(self) -> None:
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()  # the server serves until its stdin's EOF
            except OSError:
                pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _readline(proc: "subprocess.Popen[str]", timeout: float) -> str:
    """One stdout line of `proc` within `timeout` s ("" on EOF or timeout)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else ""


def _spawn(stack: str, target: str, env: Mapping[str, str]) -> "subprocess.Popen[str]":
    return subprocess.Popen(
        [sys.executable, "-m", "argrpc_bench.connect", "--client", stack, "--target",
         target], cwd=_PACKAGE_ROOT, env=dict(env), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: "subprocess.Popen[str]", deadline: float) -> dict[str, Any]:
    """The result of a client that got its go; the process is gone when this returns."""
    try:
        out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return {"ok": False, "error": "no result in time (killed)"}
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    if not lines:
        return {"ok": False, "error": f"exit {proc.returncode}: {err.strip()[-500:]}"}
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    return result


def _run_clients(stack: str, target: str, count: int, env: Mapping[str, str]
                 ) -> list[dict[str, Any]]:
    """`count` fresh clients at once: all import, then all get the go together."""
    procs = [_spawn(stack, target, env) for _ in range(count)]
    try:
        results: list[Optional[dict[str, Any]]] = [None] * count
        ready_by = time.monotonic() + _READY_TIMEOUT_S
        waiting = set(range(count))
        lines: "queue.Queue[tuple[int, str]]" = queue.Queue()

        def wait_ready(i: int) -> None:
            lines.put((i, _readline(procs[i], max(0.0, ready_by - time.monotonic()))))

        threads = [threading.Thread(target=wait_ready, args=(i,), daemon=True)
                   for i in range(count)]
        for t in threads:
            t.start()
        for _ in range(count):
            i, line = lines.get(timeout=_READY_TIMEOUT_S + 5)
            if line.strip() != "READY":
                waiting.discard(i)
                procs[i].kill()
                _, err = procs[i].communicate()
                results[i] = {"ok": False, "error": f"did not start: {err.strip()[-500:]}"}
        for i in sorted(waiting):
            stdin = procs[i].stdin
            try:
                assert stdin is not None
                stdin.write("go\n")
                stdin.flush()
            except OSError as e:  # it died after READY: its stderr says why
                results[i] = {"ok": False, "error": f"lost before the go: {e}"}
        done_by = time.monotonic() + _RESULT_TIMEOUT_S
        for i in sorted(waiting):
            if results[i] is None:
                results[i] = _finish(procs[i], done_by)
        return [r for r in results if r is not None]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _summary(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    ms = sorted(float(r["ms"]) for r in results if r.get("ok"))
    errors = [str(r.get("error")) for r in results if not r.get("ok")]
    nan = float("nan")
    return {"n": len(results), "ok": len(ms),
            "p50_ms": statistics.median(ms) if ms else nan,
            "p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))] if ms else nan,
            "max_ms": ms[-1] if ms else nan,
            "errors": errors[:_MAX_ERRORS]}


def measure(processes: int = 50, burst: int = 64, env: Optional[Mapping[str, str]] = None,
            progress: bool = False) -> dict[str, Any]:
    """Measure the first call of fresh processes on each stack.

    `env` is added to this process's environment for the servers and clients (e.g.
    TF_RDMA_* knobs). Returns::

        {"sequential": {stack: {"n", "ok", "p50_ms", "p99_ms", "max_ms", "errors"}},
         "burst":      {stack: {"n", "ok", "p50_ms", "p99_ms", "max_ms", "errors"}},
         "ratio_p50": argrpc's sequential p50 / grpc's (goal: at most GOAL_RATIO),
         "processes": processes, "burst_size": burst}

    for stack in STACKS. Times are milliseconds from creating the channel to the return
    of the first call; "ok" counts the clients that succeeded (an argrpc client must end
    on shm), the times are theirs (NaN when none did); "errors" holds a few failures'
    texts. `processes` or `burst` 0 leaves that mode's entries with n 0.
    """
    child_env = dict(os.environ) | dict(env or {})
    servers: dict[str, _Server] = {}
    try:
        for stack in STACKS:
            servers[stack] = _Server(stack, child_env)
        seq: dict[str, list[dict[str, Any]]] = {s: [] for s in STACKS}
        for i in range(processes):
            for stack in STACKS:  # interleaved: the machine's drift hits both alike
                seq[stack] += _run_clients(stack, servers[stack].target, 1, child_env)
            if progress:
                print(f"sequential {i + 1}/{processes}", file=sys.stderr, flush=True)
        bursts: dict[str, list[dict[str, Any]]] = {s: [] for s in STACKS}
        if burst > 0:
            for stack in STACKS:
                if progress:
                    print(f"burst of {burst} {stack} clients", file=sys.stderr, flush=True)
                bursts[stack] = _run_clients(stack, servers[stack].target, burst, child_env)
    finally:
        for server in servers.values():
            server.close()
    sequential = {s: _summary(seq[s]) for s in STACKS}
    grpc_p50, argrpc_p50 = sequential["grpc"]["p50_ms"], sequential["argrpc"]["p50_ms"]
    return {"sequential": sequential,
            "burst": {s: _summary(bursts[s]) for s in STACKS},
            "ratio_p50": argrpc_p50 / grpc_p50 if grpc_p50 > 0 else float("nan"),
            "processes": processes, "burst_size": burst}


def report(result: Mapping[str, Any]) -> str:
    """A small Markdown table of `measure`'s result."""
    lines = ["| stack | mode | ok / n | p50 ms | p99 ms | max ms |", "|---|---|---|---|---|---|"]
    for mode in ("sequential", "burst"):
        for stack in STACKS:
            r = result[mode][stack]
            if r["n"]:
                lines.append(f"| {stack} | {mode} | {r['ok']} / {r['n']} | {r['p50_ms']:.2f} "
                             f"| {r['p99_ms']:.2f} | {r['max_ms']:.2f} |")
    ratio = result["ratio_p50"]
    lines.append("")
    lines.append(f"first call, argrpc p50 / grpc p50: {ratio:.2f} (goal <= {GOAL_RATIO:g}: "
                 f"{'PASS' if ratio <= GOAL_RATIO else 'MISS'})")
    for mode in ("sequential", "burst"):
        for stack in STACKS:
            for error in result[mode][stack]["errors"]:
                lines.append(f"{stack} {mode} failure: {error}")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m argrpc_bench.connect",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=50,
                        help="fresh client processes per stack, one at a time")
    parser.add_argument("--burst", type=int, default=64,
                        help="client processes per stack started at once (0: none)")
    parser.add_argument("--json", help="write the result here too")
    parser.add_argument("--client", choices=STACKS, help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.client:
        return _client(a.client, a.target)
    result = measure(a.processes, a.burst, progress=True)
    sys.stdout.write(report(result))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    ok = all(result[m][s]["ok"] == result[m][s]["n"] for m in ("sequential", "burst")
             for s in STACKS)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
