"""Peers killed at random moments over verbs (``argrpc-bench chaos --transport verbs``),
in the Soft-RoCE guest: a small sample, every peer forced onto verbs.

The bound is the keepalive plus the QP's retry time (``chaos.VERBS_BOUND_S``): a killed
peer's NIC stops answering, and on rxe a write to it does not always fail, so the unanswered
PING is what tells. Sizes stop at several chunks: a 256 MiB message takes minutes under
TCG. Skips with the reason where there is no usable RDMA device.
"""
from __future__ import annotations

import os
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from argrpc_bench import chaos

SEED = int(os.environ.get("ARGRPC_CHAOS_SEED", random.randrange(1 << 20)))


# Threads are judged on Python threads: grpc core's pool of native threads grows and
# shrinks by itself, so one OS thread more than the baseline after a kill proves nothing.
@pytest.mark.timeout(1500)
def test_kill_at_random_moments_over_verbs(rdma: SimpleNamespace, tmp_path: Path) -> None:
    # Two trials, one of each victim: every trial waits out a kill under an emulated CPU,
    # and the suite's chaos test (shm) samples the faults and arities more widely.
    cfg = chaos.ChaosConfig(trials=2, seed=SEED, transport="verbs", workdir=str(tmp_path),
                            sizes=("0B", "over_acc", "chunks"))
    doc = chaos.run(cfg, say=print)
    assert doc["ok"], f"seed {SEED}\n{chaos.report(doc)}"
    print(chaos.report(doc))
    assert {t["scenario"].split("/")[0] for t in doc["trials"]} == set(chaos.VICTIMS)
    assert all(t["end_s"] <= chaos.VERBS_BOUND_S for t in doc["trials"])
