"""One task of the cluster: ``python -m examples.ps_training.trainer --job_name=ps|worker ...``.

    # the tf_cnn_benchmarks convention
    python -m examples.ps_training.trainer --ps_hosts=h1:2222 --worker_hosts=h2:2222,h3:2222 \
        --job_name=worker --task_index=1 --server_protocol=argrpc --mode=sync
    # or the cluster from TF_CONFIG (what the Kubeflow TFJob operator sets)
    TF_CONFIG='{"cluster": {...}, "task": {"type": "ps", "index": 0}}' \
        python -m examples.ps_training.trainer --server_protocol=argrpc

Exit status: 0 done; 2 bad flags or cluster; 3 the tasks disagree (cluster, protocol or
model settings: reported by the PS that noticed, and by the worker it refused); 1 any
other failure, with the reason on the last line.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Optional, Sequence

from . import cluster, model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m examples.ps_training.trainer",
        description="Parameter-server training of an MLP on scikit-learn's digits.")
    g = p.add_argument_group("cluster (all four, or none and TF_CONFIG)")
    g.add_argument("--ps_hosts", help="comma-separated host:port of the PS tasks")
    g.add_argument("--worker_hosts", help="comma-separated host:port of the worker tasks")
    g.add_argument("--job_name", choices=("ps", "worker"))
    g.add_argument("--task_index", type=int)
    p.add_argument("--server_protocol", choices=cluster.PROTOCOLS, default="grpc",
                   help="grpc (grpcio) or argrpc; every task must use the same (default grpc)")
    t = p.add_argument_group("training (every task must agree)")
    t.add_argument("--mode", choices=("sync", "async"), default="sync",
                   help="sync: gradients averaged per step; async: applied as they come")
    t.add_argument("--train_steps", type=int, default=300, help="steps per worker (300)")
    t.add_argument("--batch_size", type=int, default=64, help="examples per worker step (64)")
    t.add_argument("--learning_rate", type=float, default=0.1)
    t.add_argument("--hidden", default="512,512",
                   help="hidden layer widths (512,512: 1.2 MB of variables)")
    t.add_argument("--seed", type=int, default=0)
    o = p.add_argument_group("checkpoints and timing")
    o.add_argument("--output_dir",
                   help="the chief writes ckpt-<step>.npz here; every task started with a "
                        "directory that holds one resumes from the newest")
    o.add_argument("--checkpoint_every", type=int, default=100, help="steps (100; 0: final only)")
    o.add_argument("--log_every", type=int, default=50, help="steps between loss lines (50)")
    o.add_argument("--startup_timeout", type=float, default=120.0,
                   help="seconds to wait for every PS to answer (120)")
    o.add_argument("--step_timeout", type=float, default=60.0,
                   help="seconds a pull or push may take, waiting for slower workers "
                        "included (60)")
    p.add_argument("--idle_timeout", type=float, default=600.0,
                   help="a PS exits non-zero after this many seconds without any worker (600)")
    return p


def _settings(args: argparse.Namespace) -> dict:
    try:
        hidden = [int(h) for h in args.hidden.split(",") if h.strip()]
    except ValueError:
        raise cluster.ClusterError(f"--hidden={args.hidden!r}: comma-separated integers") from None
    if not hidden or min(hidden) <= 0:
        raise cluster.ClusterError(f"--hidden={args.hidden!r}: positive widths")
    for flag in ("train_steps", "batch_size"):
        if getattr(args, flag) <= 0:
            raise cluster.ClusterError(f"--{flag} must be positive")
    return {"mode": args.mode, "train_steps": args.train_steps, "batch_size": args.batch_size,
            "learning_rate": args.learning_rate, "hidden": hidden, "seed": args.seed,
            "features": model.DIGITS_FEATURES}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec, task = cluster.resolve(args, os.environ)
        settings = _settings(args)
    except cluster.ClusterError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    start = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - start:7.2f}s] {task.name}: {message}", flush=True)

    # argrpc says which transport each channel took, and why it fell back, at INFO.
    logging.basicConfig(level=logging.INFO, format=f"{task.name}: %(message)s")
    fingerprint = cluster.fingerprint(spec, args.server_protocol, settings)
    if task.job == "ps":
        from . import ps
        return ps.run(spec, task, args.server_protocol, settings, fingerprint,
                      args.idle_timeout, args.output_dir, log)
    from . import worker
    try:
        return worker.run(spec, task, args.server_protocol, settings, fingerprint, args, log)
    except worker.WorkerError as e:
        log(f"error: {e}")
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
