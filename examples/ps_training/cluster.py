"""The cluster a task belongs to, as TensorFlow users describe it.

Either the tf_cnn_benchmarks flags (``--ps_hosts --worker_hosts --job_name --task_index``)
or, when none of them is given, the ``TF_CONFIG`` environment variable that the Kubeflow
training operator (and TF's own launchers) set:
``{"cluster": {"ps": [...], "worker": [...]}, "task": {"type": "worker", "index": 1}}``.
Worker 0 is the chief. Giving both is an error: which one wins is a guess users should
not have to make.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from concurrent import futures
from typing import Any, Mapping

import grpc

PROTOCOLS = ("grpc", "argrpc")
_CLUSTER_FLAGS = ("ps_hosts", "worker_hosts", "job_name", "task_index")


class ClusterError(ValueError):
    """The cluster description is missing, malformed or inconsistent."""


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    ps: list[str]
    worker: list[str]

    def address(self, job: str, index: int) -> str:
        return getattr(self, job)[index]


@dataclasses.dataclass(frozen=True)
class Task:
    job: str   # "ps" or "worker"
    index: int

    @property
    def name(self) -> str:
        return f"{self.job}.{self.index}"

    @property
    def is_chief(self) -> bool:
        return self.job == "worker" and self.index == 0


def _hosts(value: str, flag: str) -> list[str]:
    hosts = [h.strip() for h in value.split(",") if h.strip()]
    for h in hosts:
        host, sep, port = h.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ClusterError(f"{flag}: {h!r} is not host:port")
    return hosts


def _from_flags(args: argparse.Namespace) -> tuple[ClusterSpec, Task]:
    missing = [f"--{f}" for f in _CLUSTER_FLAGS if getattr(args, f) in (None, "")]
    if missing:
        raise ClusterError(f"cluster flags given but {', '.join(missing)} missing "
                           "(give all four, or none and TF_CONFIG)")
    spec = ClusterSpec(ps=_hosts(args.ps_hosts, "--ps_hosts"),
                       worker=_hosts(args.worker_hosts, "--worker_hosts"))
    return spec, Task(args.job_name, int(args.task_index))


def _from_tf_config(raw: str) -> tuple[ClusterSpec, Task]:
    try:
        conf = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ClusterError(f"TF_CONFIG is not JSON: {e}") from None
    if not isinstance(conf, dict):
        raise ClusterError("TF_CONFIG must be a JSON object with 'cluster' and 'task'")
    cluster, task = conf.get("cluster"), conf.get("task")
    if not isinstance(cluster, dict) or not isinstance(task, dict):
        raise ClusterError("TF_CONFIG needs both 'cluster' and 'task' objects")
    extra = sorted(set(cluster) - {"ps", "worker"})
    if extra:
        # A chief or evaluator job would be silently ignored here: say so instead.
        raise ClusterError(f"TF_CONFIG cluster has jobs {extra}; this trainer runs 'ps' and "
                           "'worker' only (worker 0 is the chief)")
    lists: dict[str, list[str]] = {}
    for job in ("ps", "worker"):
        hosts = cluster.get(job)
        if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
            raise ClusterError(f"TF_CONFIG cluster.{job} must be a list of 'host:port' strings")
        lists[job] = _hosts(",".join(hosts), f"TF_CONFIG cluster.{job}")
    index = task.get("index")
    if not isinstance(index, int) or isinstance(index, bool):
        raise ClusterError(f"TF_CONFIG task.index must be an integer, not {index!r}")
    return ClusterSpec(ps=lists["ps"], worker=lists["worker"]), Task(str(task.get("type")), index)


def resolve(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[ClusterSpec, Task]:
    """The cluster and this task, from the flags or else TF_CONFIG; checked for sense."""
    given = [f for f in _CLUSTER_FLAGS if getattr(args, f, None) not in (None, "")]
    tf_config = environ.get("TF_CONFIG", "").strip()
    if given and tf_config:
        raise ClusterError("both cluster flags and TF_CONFIG are set: use one")
    if given:
        spec, task = _from_flags(args)
    elif tf_config:
        spec, task = _from_tf_config(tf_config)
    else:
        raise ClusterError("no cluster: give --ps_hosts --worker_hosts --job_name "
                           "--task_index, or set TF_CONFIG")
    if task.job not in ("ps", "worker"):
        raise ClusterError(f"job name {task.job!r}: this trainer runs 'ps' or 'worker'")
    if not spec.ps or not spec.worker:
        raise ClusterError("the cluster needs at least one ps and one worker")
    jobs = getattr(spec, task.job)
    if not 0 <= task.index < len(jobs):
        raise ClusterError(f"task index {task.index} is outside the {len(jobs)} "
                           f"{task.job} task(s) of the cluster")
    return spec, task


def fingerprint(spec: ClusterSpec, protocol: str, settings: Mapping[str, Any]) -> str:
    """What every task must agree on, as canonical JSON (compared field by field)."""
    return json.dumps({"cluster": {"ps": spec.ps, "worker": spec.worker},
                       "server_protocol": protocol, **settings}, sort_keys=True)


def differences(mine: str, theirs: str) -> list[str]:
    """Human-readable field differences between two fingerprints (theirs vs mine)."""
    a = json.loads(mine)
    try:
        b = json.loads(theirs)
    except json.JSONDecodeError:
        b = None
    if not isinstance(b, dict):
        return [f"fingerprint: {theirs[:80]!r} is not what this trainer sends"]
    return [f"{k}: {b.get(k)!r} vs {a.get(k)!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


# A wide layer's variable is several MB; grpc's 4 MB receive default would refuse it.
_MESSAGE_OPTIONS = [("grpc.max_receive_message_length", 256 << 20),
                    ("grpc.max_send_message_length", 256 << 20)]


def channel(protocol: str, target: str) -> grpc.Channel:
    if protocol == "argrpc":
        import argrpc
        return argrpc.insecure_channel(target, options=_MESSAGE_OPTIONS)
    return grpc.insecure_channel(target, options=_MESSAGE_OPTIONS)


def server(protocol: str, threads: int) -> grpc.Server:
    pool = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ps")
    if protocol == "argrpc":
        import argrpc
        return argrpc.server(pool, options=_MESSAGE_OPTIONS)
    return grpc.server(pool, options=_MESSAGE_OPTIONS)
