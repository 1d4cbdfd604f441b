"""A worker task: pull the variables, compute gradients on its minibatch, push them.

Every step pulls each PS's shard and pushes each PS's gradients in parallel (one RPC per
PS), so a step costs one round trip per direction on the slowest link. Worker 0, the
chief, writes checkpoints and, once every worker's updates are in, the final checkpoint
and the test accuracy.
"""
from __future__ import annotations

import json
import statistics
import time
from typing import Any, Callable

import grpc
import numpy as np

from . import checkpoint, cluster, model
from .rpc import from_tensor, pb, pb_grpc, to_tensors


class WorkerError(RuntimeError):
    """Training cannot go on; the message says which task and why. exit_code: the status."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class _PS:
    """One PS task as the worker sees it: its channel, stub and variable names."""

    def __init__(self, index: int, address: str, protocol: str) -> None:
        self.name = f"ps.{index}"
        self.address = address
        self.channel = cluster.channel(protocol, address)
        self.stub = pb_grpc.ParameterServerStub(self.channel)
        self.names: list[str] = []
        self.restored = 0  # the global step of the checkpoint this PS started from

    def transport(self) -> str:
        return getattr(self.channel, "transport", "grpc")


def _rpc_error(ps: _PS, what: str, e: grpc.RpcError) -> WorkerError:
    code = e.code()
    exit_code = 3 if code == grpc.StatusCode.FAILED_PRECONDITION else 1
    return WorkerError(f"{what} on {ps.name} ({ps.address}) failed: {code.name}: {e.details()}",
                       exit_code)


def _all(pss: list[_PS], what: str, call: Callable[[_PS], Any]) -> list[Any]:
    """Start call(ps) on every PS at once (each returns a future); wait for all results."""
    pending = [(ps, call(ps)) for ps in pss]
    results = []
    for ps, future in pending:
        try:
            results.append(future.result())
        except grpc.RpcError as e:
            for _, other in pending:
                other.cancel()
            raise _rpc_error(ps, what, e) from None
    return results


def _pull(pss: list[_PS], what: str, request: "pb.PullRequest",
          timeout: float) -> tuple[dict[str, np.ndarray], int]:
    """Every PS's shard, merged, and the oldest version among them."""
    replies = _all(pss, what, lambda ps: ps.stub.Pull.future(request, timeout=timeout))
    params = {t.name: from_tensor(t) for r in replies for t in r.tensors}
    return params, min(r.version for r in replies)


def run(spec: cluster.ClusterSpec, task: cluster.Task, protocol: str, settings: dict,
        fingerprint: str, args: Any, log: Callable[[str], None]) -> int:
    data = model.load_digits(settings["seed"])
    net = model.MLP(data.features, tuple(settings["hidden"]))
    placement = model.place(net.shapes(), len(spec.ps))
    workers = len(spec.worker)
    pss = [_PS(i, a, protocol) for i, a in enumerate(spec.ps)]
    try:
        return _train(task, workers, pss, data, net, placement, protocol, settings,
                      fingerprint, args, log)
    finally:
        for ps in pss:
            ps.channel.close()


def _connect(task: cluster.Task, pss: list[_PS], fingerprint: str, timeout: float,
             log: Callable[[str], None]) -> int:
    """Register with every PS; returns the global step they start from (all must agree)."""
    deadline = time.monotonic() + timeout
    for ps in pss:
        try:
            grpc.channel_ready_future(ps.channel).result(timeout=max(0.0, deadline - time.monotonic()))
        except grpc.FutureTimeoutError:
            raise WorkerError(f"{ps.name} at {ps.address} did not answer within "
                              f"--startup_timeout={timeout:g} s") from None
        try:
            reply = ps.stub.Register(pb.RegisterRequest(task=task.name, fingerprint=fingerprint),
                                     timeout=30, wait_for_ready=True)
        except grpc.RpcError as e:
            raise _rpc_error(ps, "registration", e) from None
        ps.names = list(reply.variables)
        ps.restored = reply.restored_step
    versions = {ps.name: ps.restored for ps in pss}
    if len(set(versions.values())) > 1:
        raise WorkerError(f"the PS tasks start from different global steps {versions}: they "
                          "restored different checkpoints", 3)
    for ps in pss:
        transport = ps.transport()
        reason = getattr(ps.channel, "fallback_reason", "")
        log(f"connected to {ps.name} at {ps.address}: transport {transport}"
            + (f" ({reason})" if reason else ""))
    return pss[0].restored


def _train(task: cluster.Task, workers: int, pss: list[_PS], data: model.Dataset,
           net: model.MLP, placement: dict[str, int], protocol: str, settings: dict,
           fingerprint: str, args: Any, log: Callable[[str], None]) -> int:
    restored = _connect(task, pss, fingerprint, args.startup_timeout, log)
    expected = sorted(placement)
    held = sorted(n for ps in pss for n in ps.names)
    if held != expected:
        raise WorkerError(f"the PS tasks hold {held}, the model needs {expected}", 3)

    steps, batch, mode = settings["train_steps"], settings["batch_size"], settings["mode"]
    sync = mode == "sync"
    # A restored cluster goes on from its global step: in async mode every push is one,
    # so each worker has done its share of them.
    first = restored if sync else restored // workers
    if restored:
        log(f"resuming at global step {restored}: steps {first}..{steps} of this worker")
    step_s: list[float] = []
    pull_s: list[float] = []
    push_s: list[float] = []
    losses: list[float] = []
    window = max(1, min(args.log_every, steps // 4 or 1))
    warmup = first + min(5, (steps - first) // 10)
    t_timed = time.perf_counter()
    for step in range(first, steps):
        if step == warmup:
            t_timed = time.perf_counter()
        t0 = time.perf_counter()
        params, version = _pull(pss, f"pull of step {step}", pb.PullRequest(
            task=task.name, min_version=step if sync else 0), args.step_timeout)
        t1 = time.perf_counter()
        x, y = model.minibatch(data, task.index, workers, step, batch, settings["seed"])
        loss, grads = net.loss_and_grads(params, x, y)
        t2 = time.perf_counter()
        _all(pss, f"push of step {step}", lambda ps: ps.stub.Push.future(pb.PushRequest(
            task=task.name, worker_index=task.index, step=step if sync else version,
            gradients=to_tensors(grads, ps.names), loss=loss), timeout=args.step_timeout))
        t3 = time.perf_counter()
        losses.append(loss)
        if step >= warmup:
            step_s.append(t3 - t0)
            pull_s.append(t1 - t0)
            push_s.append(t3 - t2)
        if task.is_chief and args.output_dir and args.checkpoint_every and step > 0 \
                and step % args.checkpoint_every == 0:
            _checkpoint(args.output_dir, params, version, log)
        if (step + 1) % window == 0 or step + 1 == steps:
            recent = losses[-window:]
            log(f"step {step + 1}/{steps} loss {statistics.fmean(recent):.4f} "
                f"step {1e3 * statistics.fmean(step_s[-window:] or [t3 - t0]):.2f} ms")
    elapsed = time.perf_counter() - t_timed

    result: dict[str, Any] = {
        "task": task.name, "protocol": protocol, "mode": mode,
        "transport": {ps.name: ps.transport() for ps in pss},
        "steps": steps, "batch_size": batch,
        "examples_per_sec": batch * len(step_s) / elapsed if step_s and elapsed > 0 else 0.0,
        "step_ms_p50": 1e3 * statistics.median(step_s) if step_s else 0.0,
        "step_ms_mean": 1e3 * statistics.fmean(step_s) if step_s else 0.0,
        "pull_ms_p50": 1e3 * statistics.median(pull_s) if pull_s else 0.0,
        "push_ms_p50": 1e3 * statistics.median(push_s) if push_s else 0.0,
        "first_step": first,
        "first_loss": statistics.fmean(losses[:window]) if losses else None,
        "last_loss": statistics.fmean(losses[-window:]) if losses else None,
    }
    if task.is_chief:
        result.update(_finish_chief(task, workers, pss, data, net, steps if sync else 0,
                                    args, log))
    _all(pss, "done", lambda ps: ps.stub.Done.future(
        pb.DoneRequest(task=task.name, worker_index=task.index), timeout=30))
    print("RESULT " + json.dumps(result, sort_keys=True), flush=True)
    return 0


def _finish_chief(task: cluster.Task, workers: int, pss: list[_PS], data: model.Dataset,
                  net: model.MLP, min_version: int, args: Any,
                  log: Callable[[str], None]) -> dict[str, Any]:
    """The final variables (every worker's updates in), evaluated and checkpointed."""
    params, version = _pull(pss, "final pull", pb.PullRequest(
        task=task.name, min_version=min_version, wait_workers_done=workers - 1),
        args.step_timeout * 10)
    accuracy = net.accuracy(params, data.x_test, data.y_test)
    train_loss, _ = net.loss_and_grads(params, data.x_train, data.y_train)
    out: dict[str, Any] = {"test_accuracy": accuracy, "final_train_loss": train_loss,
                           "global_step": version}
    if args.output_dir:
        out["checkpoint"] = _checkpoint(args.output_dir, params, version, log)
    log(f"final: global step {version}, test accuracy {accuracy:.4f} on "
        f"{len(data.y_test)} held-out images, train loss {train_loss:.4f}")
    return out


def _checkpoint(directory: str, params: dict[str, np.ndarray], step: int,
                log: Callable[[str], None]) -> str:
    path = checkpoint.save(directory, params, step)
    log(f"checkpoint {path}")
    return path
