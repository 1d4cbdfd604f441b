"""The transport choice with a real device, seen through `argrpc doctor
--target` as a user would: on one host shm wins unless an end forces verbs; forcing
verbs against a server that will not do it is an error with the reason."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace
from typing import Any, Callable

from tests.support.clients import UNLIMITED_SERVER_ARGS
from tests.support.procs import REPO_ROOT, child_env

SMALL_POOL = {"TF_RDMA_BUF_SIZE": "256M"}  # the guest has 2 GiB for every process's pool


def _doctor_target(target: str, transport: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "argrpc", "doctor", "--json", "--target", target,
                          "--transport", transport], cwd=REPO_ROOT,
                         env=child_env(SMALL_POOL, ["TF_RDMA_TRANSPORT"]), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_choice_with_a_device(rdma: SimpleNamespace, spawn: Callable[..., Any]) -> None:
    auto = spawn("argrpc", UNLIMITED_SERVER_ARGS, SMALL_POOL)
    report = _doctor_target(auto.target, "auto")
    assert report["selection"]["device"] == rdma.select["device"]
    t = report["target"]
    assert t["offered"] == ["shm", "verbs"] and t["client_verbs_reason"] == ""
    assert t["transport"] == "shm", t  # one host: shm, although both ends have a device
    t = _doctor_target(auto.target, "verbs")["target"]
    assert t["transport"] == "verbs" and t["reason"] == "", t  # the client forces verbs

    forced = spawn("argrpc", UNLIMITED_SERVER_ARGS, {**SMALL_POOL, "TF_RDMA_TRANSPORT": "verbs"})
    t = _doctor_target(forced.target, "auto")["target"]
    assert t["transport"] == "verbs", t  # the server forces verbs

    shm_only = spawn("argrpc", UNLIMITED_SERVER_ARGS, {**SMALL_POOL, "TF_RDMA_TRANSPORT": "shm"})
    t = _doctor_target(shm_only.target, "verbs")["target"]
    assert t["transport"] == "grpc"
    assert t["reason"].startswith("TF_RDMA_TRANSPORT=verbs but RDMA verbs is not possible: "
                                  "server: no common fast transport"), t
