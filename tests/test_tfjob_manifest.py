"""The Kubeflow TFJob manifest of the PS training example, checked offline.

No cluster is involved: the manifest is validated against a JSON Schema transcribed from
the training operator's TFJob v1 API (examples/ps_training/k8s/tfjob.schema.json), against
the operator's admission rules re-stated below, and the TF_CONFIG the operator would
inject into each replica is fed to the trainer's own cluster resolution.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import pathlib
import re
from typing import Any

import jsonschema
import pytest
import yaml

from examples.ps_training import cluster, trainer

K8S = pathlib.Path(__file__).resolve().parent.parent / "examples" / "ps_training" / "k8s"
MANIFEST = K8S / "tfjob.yaml"
SCHEMA = K8S / "tfjob.schema.json"

# The k8s-rdma-shared-dev-plugin's resource: its fixed "rdma" prefix plus the resourceName
# of the plugin's example ConfigMap (Mellanox/k8s-rdma-shared-dev-plugin).
RDMA_RESOURCE = "rdma/hca_shared_devices_a"

# What the operator derives from the manifest (namespace: the manifest sets none, so
# whatever `kubectl apply` uses; "default" here).
NAMESPACE = "default"
PS_ADDRESSES = [f"argrpc-ps-training-ps-{i}.default.svc:2222" for i in range(2)]
WORKER_ADDRESSES = [f"argrpc-ps-training-worker-{i}.default.svc:2222" for i in range(3)]

# --- the operator's rules ---------------------------------------------------------------
# Mirrors kubeflow/training-operator pkg/webhooks/tensorflow/tfjob_webhook.go with
# pkg/webhooks/utils/utils.go (ValidateReplicaSpecs), and ValidateV1TFJob before them.
TF_CONTAINER = "tensorflow"            # TFJobDefaultContainerName
TF_PORT_NAME, TF_PORT = "tfjob-port", 2222  # TFJobDefaultPortName, TFJobDefaultPort
REPLICA_TYPES = ("PS", "Worker", "Chief", "Master", "Evaluator")
_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def operator_errors(job: dict[str, Any]) -> list[str]:
    """What the operator's admission webhook would refuse ([] when it accepts).

    Stricter than the webhook on one point: it passes no list of valid replica types for
    TFJob, but its controller only ever reconciles these five, so another key is refused.
    """
    errors = []
    name = (job.get("metadata") or {}).get("name") or ""
    if len(name) > 63 or not _DNS1035.fullmatch(name):
        errors.append(f"metadata.name {name!r}: not a DNS-1035 label")
    specs = (job.get("spec") or {}).get("tfReplicaSpecs")
    if not specs:
        return errors + ["spec.tfReplicaSpecs: required"]
    for rtype, rspec in specs.items():
        where = f"spec.tfReplicaSpecs[{rtype}]"
        if rtype not in REPLICA_TYPES:
            errors.append(f"{where}: unsupported replica type")
        containers = (((rspec or {}).get("template") or {}).get("spec") or {}).get("containers")
        if not containers:
            errors.append(f"{where}.template.spec.containers: must be specified")
            continue
        for i, c in enumerate(containers):
            if not c.get("image"):
                errors.append(f"{where}.template.spec.containers[{i}].image: required")
        # The webhook asks for at least one; pod container names are unique, so exactly one.
        if sum(c.get("name") == TF_CONTAINER for c in containers) != 1:
            errors.append(f"{where}: needs one container named {TF_CONTAINER}")
    if sum(t in ("Chief", "Master") for t in specs) > 1:
        errors.append("spec.tfReplicaSpecs: more than 1 Chief or Master role")
    return errors


def operator_tf_config(job: dict[str, Any], rtype: str, index: int) -> str:
    """TF_CONFIG as the operator sets it in the tensorflow container of one replica.

    Mirrors genTFConfigJSONStr/genClusterSpec of pkg/controller.v1/tensorflow/tensorflow.go:
    job names are the lower-cased replica types, addresses the replicas' headless
    Services "<job>-<type>-<i>.<namespace>.svc:<tfjob-port>" (no cluster domain unless the
    operator runs with CUSTOM_CLUSTER_DOMAIN), and "environment": "cloud".
    """
    name = job["metadata"]["name"]
    namespace = job["metadata"].get("namespace", NAMESPACE)
    spec = {}
    for t, rspec in job["spec"]["tfReplicaSpecs"].items():
        rt = t.lower()
        port = next((p["containerPort"] for p in tf_container(job, t).get("ports", [])
                     if p.get("name") == TF_PORT_NAME), TF_PORT)
        spec[rt] = [f"{name}-{rt}-{i}.{namespace}.svc:{port}"
                    for i in range(rspec.get("replicas", 1))]
    return json.dumps({"cluster": spec, "task": {"type": rtype.lower(), "index": index},
                       "environment": "cloud"})


def tf_container(job: dict[str, Any], rtype: str) -> dict[str, Any]:
    containers = job["spec"]["tfReplicaSpecs"][rtype]["template"]["spec"]["containers"]
    (c,) = [c for c in containers if c["name"] == TF_CONTAINER]
    return c


# --- fixtures ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def job() -> dict[str, Any]:
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    assert len(docs) == 1, f"{MANIFEST.name} should hold one document, has {len(docs)}"
    return docs[0]


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def schema_errors(validator: Any, doc: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(doc)]


# --- the manifest -----------------------------------------------------------------------

def test_manifest_matches_schema(job, validator):
    assert schema_errors(validator, job) == []


def test_manifest_passes_operator_rules(job):
    assert operator_errors(job) == []


def test_replicas_are_two_ps_and_three_workers(job):
    specs = job["spec"]["tfReplicaSpecs"]
    assert {t: s["replicas"] for t, s in specs.items()} == {"PS": 2, "Worker": 3}


def test_typo_key_is_rejected(job, validator):
    bad = copy.deepcopy(job)
    bad["spec"]["tfReplicaSpec"] = bad["spec"].pop("tfReplicaSpecs")
    errors = schema_errors(validator, bad)
    assert any("'tfReplicaSpec' was unexpected" in e for e in errors), errors


def test_wrong_restart_policy_is_rejected(job, validator):
    bad = copy.deepcopy(job)
    bad["spec"]["tfReplicaSpecs"]["Worker"]["restartPolicy"] = "Sometimes"
    errors = schema_errors(validator, bad)
    assert any(e.startswith("spec/tfReplicaSpecs/Worker/restartPolicy:") for e in errors), errors


def test_renamed_container_is_rejected(job, validator):
    bad = copy.deepcopy(job)
    tf_container(bad, "PS")["name"] = "trainer"
    assert any(e.startswith("spec/tfReplicaSpecs/PS/template/spec/containers:")
               for e in schema_errors(validator, bad))
    assert operator_errors(bad) == ["spec.tfReplicaSpecs[PS]: needs one container named tensorflow"]


@pytest.mark.parametrize("breakage, expected", [
    (lambda j: tf_container(j, "Worker").update(image=""), "containers[0].image: required"),
    (lambda j: j["spec"]["tfReplicaSpecs"].update(Driver=j["spec"]["tfReplicaSpecs"]["PS"]),
     "[Driver]: unsupported replica type"),
    (lambda j: j["spec"]["tfReplicaSpecs"].update(Chief=j["spec"]["tfReplicaSpecs"]["PS"],
                                                  Master=j["spec"]["tfReplicaSpecs"]["PS"]),
     "more than 1 Chief or Master"),
    (lambda j: j["metadata"].update(name="Argrpc_PS"), "not a DNS-1035 label"),
], ids=["empty-image", "unknown-type", "chief-and-master", "bad-name"])
def test_operator_rules_can_fail(job, validator, breakage, expected):
    bad = copy.deepcopy(job)
    breakage(bad)
    errors = operator_errors(bad)
    assert any(expected in e for e in errors), errors
    assert schema_errors(validator, bad), "the schema should refuse it too"


# --- what runs in the pods --------------------------------------------------------------

@pytest.mark.parametrize("rtype", ["PS", "Worker"])
def test_trainer_flags_parse_and_use_argrpc(job, rtype):
    c = tf_container(job, rtype)
    assert c["command"] == ["python3", "-m", "examples.ps_training.trainer"]
    assert importlib.util.find_spec(c["command"][2]) is not None
    args = trainer.build_parser().parse_args(c["args"])
    assert args.server_protocol == "argrpc"
    assert args.mode == "sync"
    assert args.output_dir


def test_every_task_gets_the_same_flags(job):
    # The PS refuses a worker whose cluster/protocol/model settings differ.
    assert tf_container(job, "PS")["args"] == tf_container(job, "Worker")["args"]


@pytest.mark.parametrize("rtype", ["PS", "Worker"])
def test_output_dir_is_on_a_volume(job, rtype):
    # The chief writes checkpoints there; on a rerun every task restores from it.
    pod = job["spec"]["tfReplicaSpecs"][rtype]["template"]["spec"]
    output_dir = trainer.build_parser().parse_args(tf_container(job, rtype)["args"]).output_dir
    mounts = {m["mountPath"].rstrip("/"): m["name"]
              for m in tf_container(job, rtype).get("volumeMounts", [])}
    mount = next((n for p, n in mounts.items()
                  if output_dir == p or output_dir.startswith(p + "/")), None)
    assert mount is not None, f"--output_dir={output_dir} is not under any volumeMount {mounts}"
    claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName")
              for v in pod.get("volumes", [])}
    assert claims.get(mount) == "argrpc-ps-training-checkpoints", claims


def test_tf_config_resolves_for_every_replica(job):
    parser = trainer.build_parser()
    seen = []
    for rtype, rspec in job["spec"]["tfReplicaSpecs"].items():
        args = parser.parse_args(tf_container(job, rtype)["args"])
        for i in range(rspec["replicas"]):
            spec, task = cluster.resolve(args, {"TF_CONFIG": operator_tf_config(job, rtype, i)})
            assert (task.job, task.index) == (rtype.lower(), i)
            assert spec.ps == PS_ADDRESSES
            assert spec.worker == WORKER_ADDRESSES
            seen.append(task.name)
    assert sorted(seen) == ["ps.0", "ps.1", "worker.0", "worker.1", "worker.2"]


def test_tf_config_form_matches_the_operator(job):
    # The operator's own unit tests spell addresses "test-tfjob-ps-0.default.svc:2222".
    conf = json.loads(operator_tf_config(job, "Worker", 2))
    assert conf == {"cluster": {"ps": PS_ADDRESSES, "worker": WORKER_ADDRESSES},
                    "task": {"type": "worker", "index": 2}, "environment": "cloud"}


@pytest.mark.parametrize("rtype", ["PS", "Worker"])
def test_rdma_device_and_memlock_reach_the_container(job, rtype):
    c = tf_container(job, rtype)
    assert int(c["resources"]["limits"][RDMA_RESOURCE]) >= 1
    assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
    assert {"name": TF_PORT_NAME, "containerPort": TF_PORT} in c["ports"]
