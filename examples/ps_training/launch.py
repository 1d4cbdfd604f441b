"""Start a whole PS cluster on this machine, one process per task, and see it through.

    python -m examples.ps_training.launch --ps 2 --workers 3 --protocol argrpc
    python -m examples.ps_training.launch --ps 1 --workers 2 --compare --train_steps 200
    python -m examples.ps_training.launch ... --tf_config     # TF_CONFIG instead of flags

Arguments the launcher does not know go to every task (``--mode async``,
``--train_steps 500``, ...). Each task's output is printed with its name in front
(``ps.0 | ...``). The PS tasks exit by themselves once every worker is done; if any task
fails, the others are stopped and the launcher exits 1 naming the task. Every child dies
with the launcher (PR_SET_PDEATHSIG), so an interrupted launcher leaves no PS behind.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Iterable, Optional, Sequence

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PR_SET_PDEATHSIG = 1
_STOP_GRACE_S = 5.0
_LAUNCHER_OWNS = ("--ps_hosts", "--worker_hosts", "--job_name", "--task_index",
                  "--server_protocol")


@dataclass
class _Task:
    name: str
    proc: subprocess.Popen
    reader: threading.Thread
    result: Optional[dict] = None


@dataclass
class Outcome:
    protocol: str
    ok: bool
    failed: str = ""                   # "worker.1 exited with status 1"
    results: dict[str, dict] = field(default_factory=dict)   # task -> its RESULT line
    pids: list[int] = field(default_factory=list)
    seconds: float = 0.0


def _free_ports(n: int, host: str) -> list[int]:
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def _die_with_parent() -> None:
    # A killed launcher must not leave parameter servers serving forever.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _short_status(rc: int) -> str:
    return signal.Signals(-rc).name if rc < 0 else f"exit {rc}"


def _status(rc: int) -> str:
    return f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with status {rc}"


class Cluster:
    """The processes of one run: started together, watched together, stopped together."""

    def __init__(self, ps: int, workers: int, protocol: str, task_args: Sequence[str],
                 tf_config: bool, host: str, out: IO[str]) -> None:
        self.protocol, self.out = protocol, out
        ports = _free_ports(ps + workers, host)
        self.ps_hosts = [f"{host}:{p}" for p in ports[:ps]]
        self.worker_hosts = [f"{host}:{p}" for p in ports[ps:]]
        self._task_args, self._tf_config = list(task_args), tf_config
        self._lock = threading.Lock()
        self.tasks: list[_Task] = []

    def _command(self, job: str, index: int) -> tuple[list[str], dict[str, str]]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, env.get("PYTHONPATH")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        # Every task shares this machine's cores: a BLAS thread pool per task (OpenBLAS
        # spins its idle threads) made a 1 ms step take 100 ms with 3 tasks on 2 cores.
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(var, "1")
        cmd = [sys.executable, "-m", "examples.ps_training.trainer",
               f"--server_protocol={self.protocol}", *self._task_args]
        if self._tf_config:
            env["TF_CONFIG"] = json.dumps({"cluster": {"ps": self.ps_hosts,
                                                       "worker": self.worker_hosts},
                                           "task": {"type": job, "index": index}})
        else:
            env.pop("TF_CONFIG", None)
            cmd += [f"--ps_hosts={','.join(self.ps_hosts)}",
                    f"--worker_hosts={','.join(self.worker_hosts)}",
                    f"--job_name={job}", f"--task_index={index}"]
        return cmd, env

    def _print(self, name: str, line: str) -> None:
        with self._lock:
            self.out.write(f"{name:>8} | {line}\n")
            self.out.flush()

    def _read(self, task: _Task) -> None:
        assert task.proc.stdout is not None
        for line in task.proc.stdout:
            line = line.rstrip("\n")
            if line.startswith("RESULT "):
                with contextlib.suppress(json.JSONDecodeError):
                    task.result = json.loads(line[len("RESULT "):])
                continue
            self._print(task.name, line)

    def start(self) -> None:
        jobs = [("ps", i) for i in range(len(self.ps_hosts))] + \
               [("worker", i) for i in range(len(self.worker_hosts))]
        for job, index in jobs:
            cmd, env = self._command(job, index)
            proc = subprocess.Popen(cmd, env=env, cwd=_REPO, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True, preexec_fn=_die_with_parent)
            task = _Task(f"{job}.{index}", proc, threading.Thread())
            task.reader = threading.Thread(target=self._read, args=(task,), daemon=True)
            task.reader.start()
            self.tasks.append(task)
            self._print("launch", f"started {task.name} (pid {proc.pid}) at "
                        f"{(self.ps_hosts if job == 'ps' else self.worker_hosts)[index]}")

    def stop(self, tasks: Sequence[_Task]) -> list[str]:
        """SIGTERM, then SIGKILL after a grace period; returns the names it had to stop."""
        running = [t for t in tasks if t.proc.poll() is None]
        for t in running:
            with contextlib.suppress(ProcessLookupError):
                t.proc.terminate()
        deadline = time.monotonic() + _STOP_GRACE_S
        for t in running:
            try:
                t.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                t.proc.kill()
                t.proc.wait()
        return [t.name for t in running]

    def watch(self, timeout: float, ps_exit_timeout: float) -> Outcome:
        """Wait for the workers, then the PS tasks; stop everything at the first failure."""
        start = time.monotonic()
        outcome = Outcome(self.protocol, ok=False, pids=[t.proc.pid for t in self.tasks])
        workers_done_at: Optional[float] = None
        try:
            while True:
                now = time.monotonic()
                failed = next((t for t in self.tasks
                               if t.proc.poll() is not None and t.proc.returncode != 0), None)
                if failed is not None:
                    outcome.failed = f"{failed.name} {_status(failed.proc.returncode)}"
                    break
                if all(t.proc.poll() is not None for t in self.tasks):
                    outcome.ok = True
                    break
                if workers_done_at is None and all(t.proc.poll() is not None for t in self.tasks
                                                   if t.name.startswith("worker.")):
                    workers_done_at = now
                if workers_done_at is not None and now - workers_done_at > ps_exit_timeout:
                    late = [t.name for t in self.tasks if t.proc.poll() is None]
                    outcome.failed = (f"{', '.join(late)} did not exit within {ps_exit_timeout:g} s "
                                      "of the workers finishing")
                    break
                if now - start > timeout:
                    outcome.failed = f"the run took longer than --timeout={timeout:g} s"
                    break
                time.sleep(0.05)
        finally:
            stopped = self.stop(self.tasks)
            for t in self.tasks:
                t.reader.join(5.0)
            if outcome.failed:
                self._print("launch", f"FAILED: {outcome.failed}"
                            + (f"; stopped {', '.join(stopped)}" if stopped else ""))
            self._print("launch", "reaped " + ", ".join(
                f"{t.name} ({_short_status(t.proc.returncode)})" for t in self.tasks))
        outcome.seconds = time.monotonic() - start
        outcome.results = {t.name: t.result for t in self.tasks if t.result is not None}
        return outcome


def _mean(values: Iterable[Optional[float]]) -> Optional[float]:
    known = [v for v in values if v is not None]  # None: a resumed worker had no step left
    return statistics.fmean(known) if known else None


def summarize(outcome: Outcome) -> dict:
    """Cluster-level numbers from the workers' RESULT lines."""
    workers = [r for name, r in sorted(outcome.results.items()) if name.startswith("worker.")]
    chief = outcome.results.get("worker.0", {})
    if not workers:
        return {"protocol": outcome.protocol, "ok": outcome.ok, "failed": outcome.failed}
    transports = sorted({t for r in workers for t in r["transport"].values()})
    return {
        "protocol": outcome.protocol, "ok": outcome.ok, "failed": outcome.failed,
        "mode": workers[0]["mode"], "workers": len(workers),
        "transport": ",".join(transports),
        "examples_per_sec": sum(r["examples_per_sec"] for r in workers),
        "step_ms_p50": statistics.median(r["step_ms_p50"] for r in workers),
        "pull_ms_p50": statistics.median(r["pull_ms_p50"] for r in workers),
        "push_ms_p50": statistics.median(r["push_ms_p50"] for r in workers),
        "first_loss": _mean(r["first_loss"] for r in workers),
        "last_loss": _mean(r["last_loss"] for r in workers),
        "test_accuracy": chief.get("test_accuracy"),
        "global_step": chief.get("global_step"),
        "checkpoint": chief.get("checkpoint"),
        "seconds": outcome.seconds,
    }


_ROWS = [("transport", "transport", "{}"),
         ("examples/sec (all workers)", "examples_per_sec", "{:,.0f}"),
         ("step time p50 (ms)", "step_ms_p50", "{:.2f}"),
         ("  pull p50 (ms)", "pull_ms_p50", "{:.2f}"),
         ("  push p50 (ms)", "push_ms_p50", "{:.2f}"),
         ("loss, first -> last window", None, ""),
         ("test accuracy (held out)", "test_accuracy", "{:.4f}"),
         ("wall time (s)", "seconds", "{:.1f}")]


def table(summaries: Sequence[dict]) -> str:
    head = ["", *(s["protocol"] for s in summaries)]
    rows = []
    for label, key, fmt in _ROWS:
        cells = []
        for s in summaries:
            if key is None:
                cells.append(f"{s['first_loss']:.3f} -> {s['last_loss']:.3f}"
                             if s.get("first_loss") is not None else "-")
            else:
                v = s.get(key)
                cells.append(fmt.format(v) if v is not None else "-")
        rows.append([label, *cells])
    if len(summaries) == 2 and all(s.get("examples_per_sec") for s in summaries):
        ratio = summaries[1]["examples_per_sec"] / summaries[0]["examples_per_sec"]
        rows.append([f"{summaries[1]['protocol']} / {summaries[0]['protocol']} examples/sec",
                     "", f"{ratio:.2f}x"])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i])
                       for i, c in enumerate(r)) for r in [head, *rows]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.ps_training.launch", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0],
                                epilog="Other arguments go to every task (see "
                                       "python -m examples.ps_training.trainer --help).")
    p.add_argument("--ps", type=int, default=1, help="PS tasks (1)")
    p.add_argument("--workers", type=int, default=2, help="worker tasks (2)")
    p.add_argument("--protocol", choices=("grpc", "argrpc"), default="argrpc")
    p.add_argument("--compare", action="store_true",
                   help="train with grpc, then with argrpc, and print both side by side")
    p.add_argument("--tf_config", action="store_true",
                   help="describe the cluster to the tasks with TF_CONFIG instead of flags")
    p.add_argument("--output_dir", help="checkpoints (per protocol with --compare)")
    p.add_argument("--host", default="127.0.0.1", help="address the tasks listen on")
    p.add_argument("--timeout", type=float, default=1800.0, help="whole-run limit, s (1800)")
    p.add_argument("--ps_exit_timeout", type=float, default=30.0,
                   help="how long the PS tasks may outlive the workers, s (30)")
    p.add_argument("--json", help="write the summaries here")
    return p


def run_once(args: argparse.Namespace, protocol: str, task_args: list[str],
             out: IO[str]) -> Outcome:
    extra = list(task_args)
    if args.output_dir:
        directory = os.path.join(args.output_dir, protocol) if args.compare else args.output_dir
        extra.append(f"--output_dir={directory}")
    cluster = Cluster(args.ps, args.workers, protocol, extra, args.tf_config, args.host, out)
    previous = signal.getsignal(signal.SIGTERM)
    # A SIGTERM to the launcher tears the cluster down like a failure would.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        cluster.start()
        return cluster.watch(args.timeout, args.ps_exit_timeout)
    except KeyboardInterrupt:
        stopped = cluster.stop(cluster.tasks)
        cluster._print("launch", f"interrupted; stopped {', '.join(stopped) or 'nothing'}")
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, task_args = build_parser().parse_known_args(argv)
    if args.ps < 1 or args.workers < 1:
        print("error: --ps and --workers must be at least 1", file=sys.stderr)
        return 2
    owned = [a for a in task_args if a.split("=", 1)[0] in _LAUNCHER_OWNS]
    if owned:
        # Passed through they would override what the launcher chose for each task.
        print(f"error: {', '.join(owned)}: the launcher sets the cluster and protocol itself "
              "(use --ps, --workers, --protocol, --tf_config)", file=sys.stderr)
        return 2
    protocols = ["grpc", "argrpc"] if args.compare else [args.protocol]
    summaries = []
    try:
        for protocol in protocols:
            print(f"launch: {args.ps} PS + {args.workers} workers over {protocol}", flush=True)
            outcome = run_once(args, protocol, task_args, sys.stdout)
            summaries.append(summarize(outcome))
            if not outcome.ok:
                print(f"launch: FAILED ({protocol}): {outcome.failed}", file=sys.stderr, flush=True)
                return 1
    except KeyboardInterrupt:
        return 130
    print()
    print(table(summaries), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summaries, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
