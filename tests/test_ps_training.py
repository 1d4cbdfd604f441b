"""examples/ps_training: parameter-server training over grpc and argrpc, end to end.

Every test runs real task processes (the launcher, or the trainer by hand) on loopback:
the loss must fall, a synchronous run must compute bit-identical variables whatever the
transport, the launcher must reap every task, a protocol mismatch must be refused with a
clear status, and a dead worker must stop the whole cluster naming the task.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from examples.ps_training import cluster, model

REPO = Path(__file__).resolve().parent.parent
# Small enough for seconds per run, wide enough that the loss visibly falls.
SHORT = ["--train_steps=40", "--hidden=64", "--log_every=10", "--checkpoint_every=20"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1")
    env.pop("TF_CONFIG", None)
    return env


def _launch(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "examples.ps_training.launch", *args],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)


def _pids(stdout: str) -> dict[str, int]:
    return {m[0]: int(m[1]) for m in re.findall(r"started (\S+) \(pid (\d+)\)", stdout)}


def _gone(pid: int, within: float = 5.0) -> bool:
    """The process has exited: no such pid, or a zombie left for init to reap.

    (Init here reaps orphans lazily; whether the launcher reaped its own children is
    checked through its "reaped" line, which it prints from waitpid's results.)
    """
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                if f.read().rsplit(")", 1)[-1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            return " ".join(line.strip() for line in f if line.startswith(("State", "PPid")))
    except FileNotFoundError:
        return "gone now"


def _checkpoint(directory: Path) -> dict[str, np.ndarray]:
    latest = (directory / "checkpoint").read_text().split(":", 1)[1].strip()
    with np.load(directory / latest) as z:
        return {k: z[k] for k in z.files}


# --------------------------------------------------------------------------- training
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_compare_trains_over_both_protocols(mode: str, tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    r = _launch("--ps=1", "--workers=2", "--compare", f"--mode={mode}", *SHORT,
                f"--output_dir={tmp_path / 'ckpt'}", f"--json={summary}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    runs = {s["protocol"]: s for s in json.loads(summary.read_text())}
    assert runs["grpc"]["transport"] == "grpc"
    assert runs["argrpc"]["transport"] == "shm"  # both ends argrpc on one host
    for s in runs.values():
        assert s["ok"] and s["last_loss"] < 0.8 * s["first_loss"], s
        assert s["test_accuracy"] > 0.5, s
        assert s["examples_per_sec"] > 0
    # the side-by-side table and every task's prefixed log lines
    assert re.search(r"test accuracy \(held out\)\s+\d\.\d{4}\s+\d\.\d{4}", r.stdout)
    for task in ("ps.0", "worker.0", "worker.1"):
        assert re.search(rf"^\s*{re.escape(task)} \| ", r.stdout, re.M), task
    assert "ps.0: all 2 workers done" in r.stdout
    assert len(re.findall(r"reaped ps\.0 \(exit 0\), worker\.0 \(exit 0\), "
                          r"worker\.1 \(exit 0\)", r.stdout)) == 2, r.stdout[-2000:]
    pids = [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", r.stdout)]
    assert len(pids) == 6  # 3 tasks per protocol
    for pid in pids:
        assert _gone(pid), f"task pid {pid} still exists after the launcher returned"

    ckpts = {p: _checkpoint(tmp_path / "ckpt" / p) for p in ("grpc", "argrpc")}
    steps = 40 if mode == "sync" else 80  # async: every worker's push is a global step
    for ck in ckpts.values():
        assert int(ck["global_step"]) == steps
        assert sorted(k for k in ck if k != "global_step") == sorted(
            model.MLP(64, (64,)).shapes())
    if mode == "sync":
        # The transport must not change the math: the same variables to the last bit.
        for name, value in ckpts["grpc"].items():
            assert np.array_equal(value, ckpts["argrpc"][name]), name
        assert runs["grpc"]["test_accuracy"] == runs["argrpc"]["test_accuracy"]


def test_tf_config_cluster_and_two_ps(tmp_path: Path) -> None:
    """The tasks learn the cluster from TF_CONFIG; variables are split over two PS tasks."""
    r = _launch("--ps=2", "--workers=2", "--protocol=argrpc", "--tf_config", *SHORT,
                f"--output_dir={tmp_path}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "--ps_hosts" not in r.stdout
    for ps in ("ps.0", "ps.1"):
        assert re.search(rf"{ps}: serving \d variables", r.stdout), ps
        assert f"{ps}: all 2 workers done" in r.stdout
    assert int(_checkpoint(tmp_path)["global_step"]) == 40


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_second_run_resumes_from_the_newest_checkpoint(mode: str, tmp_path: Path) -> None:
    """Stopped at step 20 and started again for 40 steps, a cluster goes on from step 20;
    in sync mode it ends exactly where one uninterrupted 40-step run ends."""
    common = ["--ps=2", "--workers=2", "--protocol=argrpc", f"--mode={mode}",
              "--hidden=64", "--checkpoint_every=20"]
    first = _launch(*common, "--train_steps=20", f"--output_dir={tmp_path / 'a'}")
    assert first.returncode == 0, first.stdout[-3000:]
    second = _launch(*common, "--train_steps=40", f"--output_dir={tmp_path / 'a'}")
    assert second.returncode == 0, second.stdout[-3000:]
    done = 20 if mode == "sync" else 40  # async: every push is a global step
    for ps in ("ps.0", "ps.1"):
        assert re.search(rf"{ps}: restored \d variables from .*ckpt-{done}\.npz "
                         rf"\(global step {done}\)", second.stdout), second.stdout[-3000:]
    assert "resuming at global step" in second.stdout
    resumed = _checkpoint(tmp_path / "a")
    assert int(resumed["global_step"]) == 2 * done
    if mode == "sync":
        straight = _launch(*common, "--train_steps=40", f"--output_dir={tmp_path / 'b'}")
        assert straight.returncode == 0, straight.stdout[-3000:]
        for name, value in _checkpoint(tmp_path / "b").items():
            assert np.array_equal(value, resumed[name]), name


def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    r = _launch("--ps=1", "--workers=1", "--hidden=64", "--train_steps=5",
                f"--output_dir={tmp_path}")
    assert r.returncode == 0, r.stdout[-3000:]
    r = _launch("--ps=1", "--workers=1", "--hidden=32", "--train_steps=5",
                f"--output_dir={tmp_path}", timeout=120)
    assert r.returncode == 1
    assert re.search(r"ps\.0: cannot restore: .*ckpt-5\.npz: dense0/bias is "
                     r"float32\[64\], the model needs float32\[32\]", r.stdout), \
        r.stdout[-3000:]
    assert "FAILED: ps.0 exited with status 2" in r.stdout


# --------------------------------------------------------------------------- failures
def _trainer(job: str, index: int, protocol: str, ps: str, workers: str,
             *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "examples.ps_training.trainer", f"--ps_hosts={ps}",
         f"--worker_hosts={workers}", f"--job_name={job}", f"--task_index={index}",
         f"--server_protocol={protocol}", *SHORT, *extra],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("ps_protocol,worker_protocol", [("argrpc", "grpc"), ("grpc", "argrpc")])
def test_protocol_mismatch_is_refused(ps_protocol: str, worker_protocol: str) -> None:
    ps_addr = f"127.0.0.1:{free_port()}"
    workers = f"127.0.0.1:{free_port()}"
    ps = _trainer("ps", 0, ps_protocol, ps_addr, workers)
    worker = _trainer("worker", 0, worker_protocol, ps_addr, workers)
    try:
        w_out, _ = worker.communicate(timeout=60)
        p_out, _ = ps.communicate(timeout=30)
    finally:
        for p in (ps, worker):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert worker.returncode == 3, w_out
    assert ps.returncode == 3, p_out
    expected = f"server_protocol: '{worker_protocol}' vs '{ps_protocol}'"
    assert "FAILED_PRECONDITION" in w_out and expected in w_out, w_out
    assert "ps.0 refuses worker.0" in p_out and expected in p_out, p_out


def test_cluster_mismatch_is_refused() -> None:
    ps_addr = f"127.0.0.1:{free_port()}"
    workers = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    ps = _trainer("ps", 0, "argrpc", ps_addr, ",".join(workers))
    worker = _trainer("worker", 0, "argrpc", ps_addr, workers[0])  # thinks it is alone
    try:
        w_out, _ = worker.communicate(timeout=60)
        ps.communicate(timeout=30)
    finally:
        for p in (ps, worker):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert worker.returncode == 3 and "cluster:" in w_out, w_out


def test_unreachable_ps_is_an_error_not_a_hang() -> None:
    worker = _trainer("worker", 0, "argrpc", f"127.0.0.1:{free_port()}",
                      f"127.0.0.1:{free_port()}", "--startup_timeout=2")
    out, _ = worker.communicate(timeout=60)
    assert worker.returncode == 1
    assert "ps.0 at 127.0.0.1:" in out and "--startup_timeout=2" in out, out


def _start_launcher(*args: str) -> tuple[subprocess.Popen[str], dict[str, int], list[str]]:
    """Start a long run; return once every worker has logged a step."""
    proc = subprocess.Popen([sys.executable, "-m", "examples.ps_training.launch", *args],
                            cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    stepped: set[str] = set()
    deadline = time.monotonic() + 90
    while len(stepped) < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.match(r"\s*(worker\.\d) \| .* step \d+/", line)
        if m:
            stepped.add(m[1])
    assert len(stepped) == 2, "".join(lines)
    return proc, _pids("".join(lines)), lines


def test_dead_worker_stops_the_cluster() -> None:
    proc, pids, lines = _start_launcher("--ps=1", "--workers=2", "--protocol=argrpc",
                                        "--train_steps=100000", "--hidden=64",
                                        "--log_every=5")
    os.kill(pids["worker.1"], signal.SIGKILL)
    rest, _ = proc.communicate(timeout=60)
    out = "".join(lines) + rest
    assert proc.returncode == 1, out[-3000:]
    assert "FAILED: worker.1 was killed by SIGKILL" in out, out[-3000:]
    assert re.search(r"stopped (ps\.0, worker\.0|worker\.0, ps\.0)", out), out[-3000:]
    for pid in pids.values():
        assert _gone(pid), f"pid {pid} outlived the launcher"


def test_killed_launcher_takes_its_tasks_along() -> None:
    proc, pids, _ = _start_launcher("--ps=1", "--workers=2", "--protocol=grpc",
                                    "--train_steps=100000", "--hidden=64", "--log_every=5")
    proc.kill()
    proc.wait()
    assert proc.stdout is not None
    proc.stdout.close()
    for name, pid in pids.items():
        # Orphans are reaped by init once they die; they must die (PR_SET_PDEATHSIG).
        assert _gone(pid, within=10), (f"{name} (pid {pid}) survived its launcher: "
                                       + _describe(pid))


# --------------------------------------------------------------------------- cluster
def _args(*argv: str) -> argparse.Namespace:
    from examples.ps_training.trainer import build_parser
    return build_parser().parse_args(list(argv))


def test_cluster_from_flags_and_tf_config_agree() -> None:
    flags = _args("--ps_hosts=a:1,b:2", "--worker_hosts=c:3", "--job_name=ps", "--task_index=1")
    spec, task = cluster.resolve(flags, {})
    conf = {"cluster": {"ps": ["a:1", "b:2"], "worker": ["c:3"]},
            "task": {"type": "ps", "index": 1}}
    assert cluster.resolve(_args(), {"TF_CONFIG": json.dumps(conf)}) == (spec, task)
    assert task.name == "ps.1" and not task.is_chief
    assert cluster.resolve(_args(), {"TF_CONFIG": json.dumps(
        {**conf, "task": {"type": "worker", "index": 0}})})[1].is_chief


@pytest.mark.parametrize("argv,tf_config,message", [
    ((), None, "no cluster"),
    (("--ps_hosts=a:1",), None, "--worker_hosts, --job_name, --task_index missing"),
    (("--ps_hosts=a", "--worker_hosts=c:3", "--job_name=ps", "--task_index=0"), None,
     "'a' is not host:port"),
    (("--ps_hosts=a:1", "--worker_hosts=c:3", "--job_name=worker", "--task_index=1"), None,
     "task index 1 is outside the 1 worker"),
    (("--ps_hosts=a:1", "--worker_hosts=c:3", "--job_name=ps", "--task_index=0"), "{}",
     "both cluster flags and TF_CONFIG"),
    ((), "{not json", "TF_CONFIG is not JSON"),
    ((), '{"cluster": {"ps": ["a:1"], "worker": ["c:3"], "chief": ["d:4"]}, '
         '"task": {"type": "chief", "index": 0}}', "jobs ['chief']"),
    ((), '{"cluster": {"ps": ["a:1"], "worker": ["c:3"]}, "task": {"type": "evaluator", '
         '"index": 0}}', "job name 'evaluator'"),
    ((), '{"cluster": {"ps": ["a:1"], "worker": "c:3"}, "task": {"type": "ps", "index": 0}}',
     "cluster.worker must be a list"),
])
def test_bad_cluster_names_the_problem(argv: tuple[str, ...], tf_config: str | None,
                                       message: str) -> None:
    env = {} if tf_config is None else {"TF_CONFIG": tf_config}
    with pytest.raises(cluster.ClusterError, match=re.escape(message)):
        cluster.resolve(_args(*argv), env)


def test_bad_cluster_exits_2_with_the_reason() -> None:
    r = subprocess.run([sys.executable, "-m", "examples.ps_training.trainer"], cwd=REPO,
                       env=dict(_env(), TF_CONFIG="[1, 2]"), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "TF_CONFIG must be a JSON object" in r.stderr, r.stderr


def test_placement_balances_bytes_across_ps_tasks() -> None:
    shapes = model.MLP(64, (256, 256, 256)).shapes()
    placement = model.place(shapes, 2)
    load = [sum(int(np.prod(shapes[n])) for n, p in placement.items() if p == i) for i in (0, 1)]
    assert set(placement) == set(shapes)
    assert placement["dense1/kernel"] != placement["dense2/kernel"]  # the two big ones
    assert max(load) < 1.3 * min(load), load
    assert model.place(shapes, 2) == placement  # every task derives the same placement


def test_sync_gradient_matches_a_numerical_derivative() -> None:
    net = model.MLP(5, (4,), classes=3)
    params = {n: net.initial_value(n, 1) * 0.5 for n in net.shapes()}
    params = {n: v.astype(np.float64) for n, v in params.items()}
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((6, 5)), rng.integers(0, 3, 6)
    _, grads = net.loss_and_grads(params, x, y)
    for name in ("dense0/kernel", "dense1/bias"):
        bumped = {k: v.copy() for k, v in params.items()}
        bumped[name].flat[0] += 1e-6
        numeric = (net.loss_and_grads(bumped, x, y)[0] - net.loss_and_grads(params, x, y)[0]) / 1e-6
        assert abs(numeric - grads[name].flat[0]) < 1e-4, name


def test_launcher_refuses_the_flags_it_sets_itself() -> None:
    r = _launch("--task_index=1", timeout=60)
    assert r.returncode == 2 and "--task_index=1: the launcher sets the cluster" in r.stderr


def test_fingerprint_differences_name_the_fields() -> None:
    spec = cluster.ClusterSpec(ps=["a:1"], worker=["b:2"])
    mine = cluster.fingerprint(spec, "argrpc", {"mode": "sync"})
    assert cluster.differences(mine, mine) == []
    theirs = cluster.fingerprint(spec, "grpc", {"mode": "async"})
    assert cluster.differences(mine, theirs) == ["mode: 'async' vs 'sync'",
                                                 "server_protocol: 'grpc' vs 'argrpc'"]
    assert "not what this trainer sends" in cluster.differences(mine, "{garbage")[0]
