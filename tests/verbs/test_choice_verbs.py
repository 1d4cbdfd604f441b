"""The transport choice with a real device, seen through `argrpc doctor
--target` as a user would: on one host shm wins unless an end forces verbs; forcing
verbs against a server that will not do it is an error with the reason."""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, Callable

from tests.support.clients import UNLIMITED_SERVER_ARGS
from tests.support.procs import REPO_ROOT, child_env

SMALL_POOL = {"TF_RDMA_BUF_SIZE": "256M"}  # the guest's memory holds every process's pool


def _doctor_target(target: str, transport: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "argrpc", "doctor", "--json", "--target", target,
                          "--transport", transport], cwd=REPO_ROOT,
                         env=child_env(SMALL_POOL, ["TF_RDMA_TRANSPORT"]), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_choice_with_a_device(rdma: SimpleNamespace, spawn: Callable[..., Any]) -> None:
    # Every process here imports argrpc under an emulated CPU: the three servers start
    # together, and the doctors run two at a time (each holds a pool: the guest's memory).
    envs = [SMALL_POOL, {**SMALL_POOL, "TF_RDMA_TRANSPORT": "verbs"},
            {**SMALL_POOL, "TF_RDMA_TRANSPORT": "shm"}]
    with ThreadPoolExecutor(3) as ex:
        auto, forced, shm_only = ex.map(lambda e: spawn("argrpc", UNLIMITED_SERVER_ARGS, e),
                                        envs)
    with ThreadPoolExecutor(2) as ex:
        auto_auto, auto_verbs, forced_auto, shm_only_verbs = ex.map(
            lambda a: _doctor_target(*a),
            [(auto.target, "auto"), (auto.target, "verbs"), (forced.target, "auto"),
             (shm_only.target, "verbs")])

    assert auto_auto["selection"]["device"] == rdma.select["device"]
    t = auto_auto["target"]
    assert t["offered"] == ["shm", "verbs"] and t["client_verbs_reason"] == ""
    assert t["transport"] == "shm", t  # one host: shm, although both ends have a device
    t = auto_verbs["target"]
    assert t["transport"] == "verbs" and t["reason"] == "", t  # the client forces verbs

    t = forced_auto["target"]
    assert t["transport"] == "verbs", t  # the server forces verbs

    t = shm_only_verbs["target"]
    assert t["transport"] == "grpc"
    assert t["reason"].startswith("TF_RDMA_TRANSPORT=verbs but RDMA verbs is not possible: "
                                  "server: no common fast transport"), t
