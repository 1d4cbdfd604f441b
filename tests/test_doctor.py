"""`argrpc doctor` on this host: it must work without any RDMA and say what is missing,
and for a target say which transport an argrpc channel gets (shm against a local argrpc
server, plain gRPC with the reason against a grpcio server)."""
from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any, Callable

import pytest

import argrpc
from argrpc import _doctor
from tests.support.procs import REPO_ROOT, child_env

HAS_RDMA = bool(os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"))


def _command() -> list[str]:
    """The installed console script when it runs the argrpc under test (this checkout's,
    or the installed package's under scripts/test_installed.sh), else `python -m argrpc`."""
    exe = shutil.which("argrpc")
    if exe:
        probe = subprocess.run([sys.executable, "-c", "import argrpc; print(argrpc.__file__)"],
                               cwd="/", capture_output=True, text=True)
        if probe.stdout.strip() in (str(REPO_ROOT / "argrpc" / "__init__.py"),
                                    os.path.abspath(argrpc.__file__)):
            return [exe]
    return [sys.executable, "-m", "argrpc"]


def doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    drop = [k for k in os.environ if k.startswith("TF_RDMA_")]
    return subprocess.run([*_command(), "doctor", *args], cwd=REPO_ROOT,
                          env=child_env(env, drop), capture_output=True, text=True, timeout=120)


def test_console_script_is_declared() -> None:
    meta = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["argrpc"] == "argrpc._cli:main"


@pytest.mark.skipif(HAS_RDMA, reason="this host has RDMA devices")
def test_doctor_without_rdma_says_why() -> None:
    out = doctor()
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "RDMA devices: none. Why:" in text, text
    assert "/sys/class/infiniband" in text  # the kernel-level reason comes first
    assert "memlock limit (ulimit -l)" in text
    assert "verbs selection: none" in text
    assert "libibverbs:" in text

    report = json.loads(doctor("--json").stdout)
    assert report["devices"] == [] and report["no_device_reason"]
    assert report["selection"]["error"]
    assert set(report["memlock"]) >= {"soft", "hard", "cap_ipc_lock", "buf_size", "ok", "verdict"}


def test_doctor_target_argrpc_server_is_shm(spawn: Callable[..., Any]) -> None:
    server = spawn("argrpc")
    out = doctor("--target", server.target)
    assert out.returncode == 0, out.stderr
    assert f"target {server.target}:" in out.stdout
    assert "  transport: shm\n" in out.stdout, out.stdout
    report = json.loads(doctor("--json", "--target", server.target).stdout)
    assert report["target"]["transport"] == "shm" and report["target"]["reason"] == ""
    assert "shm" in report["target"]["offered"]


def test_doctor_target_plain_grpc_server_gives_reason(spawn: Callable[..., Any]) -> None:
    server = spawn("grpc")
    report = json.loads(doctor("--json", "--target", server.target).stdout)
    assert report["target"]["transport"] == "grpc"
    assert "plain gRPC" in report["target"]["reason"]


@pytest.mark.skipif(HAS_RDMA, reason="this host has RDMA devices")
def test_doctor_forced_verbs_without_device_is_explained(spawn: Callable[..., Any]) -> None:
    server = spawn("argrpc")
    out = doctor("--target", server.target, "--transport", "verbs")
    assert out.returncode == 0, out.stderr
    assert "  transport: grpc\n" in out.stdout, out.stdout
    assert "TF_RDMA_TRANSPORT=verbs but RDMA verbs is not possible: this host:" in out.stdout


def test_doctor_unreachable_target_and_bad_config() -> None:
    report = json.loads(doctor("--json", "--target", "127.0.0.1:1").stdout)
    assert report["target"]["transport"] == "grpc" and "UNAVAILABLE" in report["target"]["reason"]
    out = doctor(env={"TF_RDMA_QPS": "99"})
    assert out.returncode == 0 and "configuration: INVALID: TF_RDMA_QPS" in out.stdout, out.stdout


def test_memlock_verdicts(monkeypatch: pytest.MonkeyPatch) -> None:
    from argrpc._config import Config

    cfg = Config(buf_size=1 << 30)
    monkeypatch.setattr(_doctor, "_has_cap_ipc_lock", lambda: False)
    monkeypatch.setattr(resource, "getrlimit", lambda _: (8 << 20, 8 << 20))
    low = _doctor.memlock_report(cfg)
    assert not low["ok"] and "ulimit -l unlimited" in low["verdict"]
    assert "TF_RDMA_BUF_SIZE=1 GiB" in low["verdict"] and "shm" in low["verdict"]
    monkeypatch.setattr(resource, "getrlimit", lambda _: (4 << 30, 4 << 30))
    assert _doctor.memlock_report(cfg)["ok"]
    inf = resource.RLIM_INFINITY
    monkeypatch.setattr(resource, "getrlimit", lambda _: (inf, inf))
    rep = _doctor.memlock_report(cfg)
    assert rep["ok"] and rep["soft"] is None and "unlimited" in rep["verdict"]
    monkeypatch.setattr(resource, "getrlimit", lambda _: (8 << 20, 8 << 20))
    monkeypatch.setattr(_doctor, "_has_cap_ipc_lock", lambda: True)
    assert "CAP_IPC_LOCK" in _doctor.memlock_report(cfg)["verdict"]


def test_render_lists_devices_ports_and_gids() -> None:
    # The text layout for a device, without needing one: a report as collect() builds it.
    report = _doctor.collect()
    report["devices"] = [{"name": "rxe0", "node_guid": "0011:22ff:fe33:4455", "ports": [
        {"port": 1, "state": "ACTIVE", "state_num": 4, "mtu": 4096, "active_mtu": 4096,
         "link_layer": "Ethernet", "lid": 0,
         "gids": [{"index": 0, "gid": "fe80::11:22ff:fe33:4455", "type": "RoCEv2"},
                  {"index": 1, "gid": "::ffff:127.0.0.1", "type": "RoCEv2"}]}]}]
    report["selection"] = {"device": "rxe0", "port": 1, "gid_index": 1, "gid": "::ffff:127.0.0.1",
                           "gid_type": "RoCEv2", "mtu": 4096, "link_layer": "Ethernet", "lid": 0,
                           "why": "first device with an ACTIVE port; RoCEv2 IPv4-mapped GID"}
    text = _doctor.render(report)
    assert "RDMA devices: 1" in text and "  rxe0  node GUID 0011:22ff:fe33:4455" in text
    assert "port 1: ACTIVE (4), link layer Ethernet, MTU active 4096 / max 4096" in text
    assert "GID[1] ::ffff:127.0.0.1  RoCEv2" in text
    assert "verbs selection: device rxe0 port 1 GID[1] ::ffff:127.0.0.1 (RoCEv2)" in text
    assert "why: first device with an ACTIVE port" in text


def test_render_shows_the_choice_for_a_target() -> None:
    # With --target, the device/port/GID chosen by the route to the target's address.
    report = _doctor.collect()
    report["target"] = {"target": "192.0.2.2:50051", "offered": ["verbs"], "transport": "verbs",
                        "reason": "", "client_shm_reason": "", "client_verbs_reason": "",
                        "selection": {
                            "device": "mlx5_1", "port": 1, "gid_index": 3,
                            "gid": "::ffff:192.0.2.1", "gid_type": "RoCEv2", "mtu": 4096,
                            "link_layer": "Ethernet", "lid": 0, "netdev": "eth1",
                            "peer": "192.0.2.2",
                            "why": "device mlx5_1, port 1, GID 3: RoCEv2 ::ffff:192.0.2.1 (eth1), "
                                   "this host's address on the route to 192.0.2.2"}}
    text = _doctor.render(report)
    assert ("  verbs selection for 192.0.2.2: device mlx5_1 port 1 GID[3] ::ffff:192.0.2.1 "
            "(RoCEv2) on eth1, MTU 4096") in text
    assert "    why: device mlx5_1, port 1, GID 3: RoCEv2" in text
    report["target"]["selection"] = {"error": "'x:1' names no host that resolves to an IP address"}
    assert "  verbs selection: none: 'x:1' names no host" in _doctor.render(report)
