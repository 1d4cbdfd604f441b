"""A parameter-server task: holds its shard of the variables and applies gradients.

sync:  a step's gradients are kept until every worker has pushed them, then their mean
       (summed in worker order, so the arithmetic does not depend on arrival order or
       transport) is applied once; a pull for the next step waits for that.
async: each pushed gradient is applied as it arrives (TF's between-graph asynchronous
       training); pulls never wait.

The task ends by itself when every worker has said Done (TensorFlow's own parameter
servers serve forever, so every launcher has to kill them). It also ends, non-zero, when
a worker registers with a different cluster/protocol/model (the cluster could never
finish), or when no worker has been heard from for --idle_timeout seconds.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import grpc
import numpy as np

from . import checkpoint, cluster, model
from .rpc import from_tensor, pb, pb_grpc, to_tensors

_POLL_S = 0.2  # how often a waiting pull re-checks that its caller is still there


class ParameterServer(pb_grpc.ParameterServerServicer):
    def __init__(self, task: cluster.Task, workers: int, names: list[str],
                 values: dict[str, np.ndarray], mode: str, learning_rate: float,
                 fingerprint: str, log: Callable[[str], None], version: int = 0) -> None:
        self._task, self._workers, self._names = task, workers, names
        self._vars = values
        self._mode, self._lr = mode, np.float32(learning_rate)
        self._fingerprint, self._log = fingerprint, log
        self._cond = threading.Condition()
        self._version = version
        self._restored = version
        self._pending: dict[int, dict[int, dict[str, np.ndarray]]] = {}  # step -> worker -> grads
        self._done: set[int] = set()
        self.error = ""            # set once: the cluster cannot finish
        self.finished = threading.Event()
        self.last_contact = time.monotonic()
        self.pushes = 0

    # ---------------------------------------------------------------- helpers
    def _touch(self) -> None:
        self.last_contact = time.monotonic()

    def fail(self, message: str) -> None:
        """The cluster cannot finish: wake every waiting pull with the reason, then stop."""
        with self._cond:
            if not self.error:
                self.error = message
            self._cond.notify_all()
        self.finished.set()

    def _apply(self, grads: dict[str, np.ndarray]) -> None:
        for name, g in grads.items():
            self._vars[name] -= self._lr * g

    # ---------------------------------------------------------------- RPCs
    def Register(self, request, context):
        self._touch()
        diff = cluster.differences(self._fingerprint, request.fingerprint)
        if diff:
            message = (f"{self._task.name} refuses {request.task}: the tasks were started with a "
                       f"different cluster or settings ({request.task} vs {self._task.name}): "
                       + "; ".join(diff))
            self._log(message)
            self.fail(message)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, message)
        with self._cond:
            return pb.RegisterReply(task=self._task.name, variables=self._names,
                                    version=self._version, restored_step=self._restored)

    def Pull(self, request, context):
        self._touch()
        with self._cond:
            while True:
                if self.error:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.error)
                others_done = len(self._done - {_index(request.task)})
                if self._version >= request.min_version and others_done >= request.wait_workers_done:
                    return pb.PullReply(version=self._version,
                                        tensors=to_tensors(self._vars, self._names))
                remaining = context.time_remaining()
                if remaining is not None and remaining <= 0:
                    missing = sorted(set(range(self._workers))
                                     - set(self._pending.get(self._version, {})))
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"{self._task.name}: step {self._version} still waits for "
                                  f"gradients from worker(s) {missing}")
                if not context.is_active():
                    context.abort(grpc.StatusCode.CANCELLED, "caller went away")
                self._cond.wait(min(_POLL_S, remaining) if remaining is not None else _POLL_S)

    def Push(self, request, context):
        self._touch()
        grads = {t.name: from_tensor(t) for t in request.gradients}
        if sorted(grads) != sorted(self._names):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{self._task.name} holds {self._names}, {request.task} pushed "
                          f"{sorted(grads)}")
        for name, g in grads.items():
            if g.shape != self._vars[name].shape:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{request.task}: gradient {name} has shape {g.shape}, the "
                              f"variable {self._vars[name].shape}")
        with self._cond:
            self.pushes += 1
            if self._mode == "async":
                self._apply(grads)
                self._version += 1
                self._cond.notify_all()
                return pb.PushReply(version=self._version)
            if request.step != self._version:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"{request.task} pushed gradients of step {request.step}, but "
                              f"{self._task.name} is at step {self._version}")
            step = self._pending.setdefault(request.step, {})
            step[request.worker_index] = grads
            if len(step) == self._workers:
                del self._pending[request.step]
                for name in self._names:
                    # Summed in worker order: the same float32 result whatever the timing.
                    total = step[0][name].copy()
                    for w in range(1, self._workers):
                        total += step[w][name]
                    total /= np.float32(self._workers)
                    self._vars[name] -= self._lr * total
                self._version += 1
                self._cond.notify_all()
            return pb.PushReply(version=self._version)

    def Done(self, request, context):
        self._touch()
        with self._cond:
            self._done.add(request.worker_index)
            self._cond.notify_all()
            done = len(self._done)
        if done >= self._workers:
            self.finished.set()
        return pb.DoneReply(workers_done=done)


def _index(task_name: str) -> int:
    try:
        return int(task_name.rsplit(".", 1)[-1])
    except ValueError:
        return -1


def run(spec: cluster.ClusterSpec, task: cluster.Task, protocol: str, settings: dict,
        fingerprint: str, idle_timeout: float, output_dir: Optional[str],
        log: Callable[[str], None]) -> int:
    net = model.MLP(settings["features"], tuple(settings["hidden"]))
    placement = model.place(net.shapes(), len(spec.ps))
    names = sorted(n for n, p in placement.items() if p == task.index)
    try:
        path = checkpoint.latest(output_dir)
        if path is None:
            values, version = {n: net.initial_value(n, settings["seed"]) for n in names}, 0
        else:
            values, version = checkpoint.load(path, {n: net.shapes()[n] for n in names})
            log(f"restored {len(names)} variables from {path} (global step {version})")
    except checkpoint.CheckpointError as e:
        log(f"cannot restore: {e}")
        return 2
    servicer = ParameterServer(task, len(spec.worker), names, values, settings["mode"],
                               settings["learning_rate"], fingerprint, log, version)
    server = cluster.server(protocol, threads=4 * len(spec.worker) + 4)
    pb_grpc.add_ParameterServerServicer_to_server(servicer, server)
    port = spec.address("ps", task.index).rpartition(":")[2]
    bound = _bind(server, port)
    if not bound:
        log(f"cannot listen on port {port} (in use?)")
        return 2
    server.start()
    floats = sum(v.size for v in values.values())
    log(f"serving {len(names)} variables ({floats * 4 / 1e6:.2f} MB: {', '.join(names)}) "
        f"on port {port} over {protocol}, {settings['mode']} updates, "
        f"{len(spec.worker)} worker(s)")
    try:
        while not servicer.finished.wait(1.0):
            idle = time.monotonic() - servicer.last_contact
            if idle > idle_timeout:
                servicer.fail(f"no worker has contacted {task.name} for {idle:.0f} s "
                               f"(--idle_timeout={idle_timeout:g})")
        # Let the last replies (Done, or the refusal) reach their callers.
        server.stop(grace=2.0).wait()
    finally:
        server.stop(None)
    if servicer.error:
        log(f"stopping: {servicer.error}")
        return 3
    log(f"all {len(spec.worker)} workers done after {servicer.pushes} pushes; exiting")
    return 0


def _bind(server: grpc.Server, port: str) -> int:
    for address in (f"[::]:{port}", f"0.0.0.0:{port}"):
        try:
            bound = server.add_insecure_port(address)
        except RuntimeError:
            bound = 0
        if bound:
            return bound
    return 0
