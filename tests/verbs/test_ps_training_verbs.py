"""examples/ps_training over verbs: the PS cluster with every argrpc channel forced
onto the RDMA device, against plain grpc in the same guest boot. A synchronous run must
end in the same variables to the last bit, whichever transport carried them. (The
asynchronous mode, whose arithmetic follows arrival order, runs over shm in the suite: over
verbs it would add a minute of emulated CPU and only a falling loss to compare.)"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from tests.support.procs import REPO_ROOT, child_env

# The guest's 2 GiB holds one pool per task.
ENV = {"TF_RDMA_TRANSPORT": "verbs", "TF_RDMA_BUF_SIZE": "128M", "OPENBLAS_NUM_THREADS": "1"}


def _final(directory: Path) -> dict[str, np.ndarray]:
    latest = (directory / "checkpoint").read_text().split(":", 1)[1].strip()
    with np.load(directory / latest) as z:
        return {k: z[k] for k in z.files}


def test_training_over_verbs_and_grpc(rdma: SimpleNamespace, tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    r = subprocess.run(
        [sys.executable, "-m", "examples.ps_training.launch", "--ps=1", "--workers=2",
         "--compare", "--mode=sync", "--train_steps=20", "--hidden=64", "--log_every=5",
         "--startup_timeout=300", f"--output_dir={tmp_path / 'ckpt'}", f"--json={summary}"],
        cwd=REPO_ROOT, env=child_env(ENV, ["TF_CONFIG"]), capture_output=True, text=True,
        timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    runs = {s["protocol"]: s for s in json.loads(summary.read_text())}
    assert runs["argrpc"]["transport"] == "verbs", runs["argrpc"]
    assert runs["grpc"]["transport"] == "grpc"
    for s in runs.values():
        assert s["last_loss"] < s["first_loss"], s
    grpc_vars, verbs_vars = _final(tmp_path / "ckpt" / "grpc"), _final(tmp_path / "ckpt" / "argrpc")
    assert int(verbs_vars["global_step"]) == 20
    for name, value in grpc_vars.items():
        assert np.array_equal(value, verbs_vars[name]), name
