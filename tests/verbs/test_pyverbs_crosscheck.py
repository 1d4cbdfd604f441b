"""pyverbs (rdma-core's own Python bindings) is the independent witness: the devices,
port states, MTUs and GID tables argrpc reports, and the device/port/GID it selects,
must match what pyverbs sees."""
from __future__ import annotations

import ipaddress
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

_GID_TYPES = {0: "IB", 1: "RoCEv1", 2: "RoCEv2"}        # enum ibv_gid_type (ibv_gid_entry)
_LINK_LAYERS = {1: "InfiniBand", 2: "Ethernet"}
_ACTIVE = 4                                              # IBV_PORT_ACTIVE


def _mtu_bytes(enum_value: Any) -> int:
    return 128 << int(enum_value)                        # IBV_MTU_256 = 1 ... IBV_MTU_4096 = 5


def _gid(text: str) -> ipaddress.IPv6Address:
    return ipaddress.IPv6Address(text)


def _pyverbs_view(devices: list[Any]) -> dict[str, dict[str, Any]]:
    """{name: {"guid": int, "ports": {num: {...,"gids": {(index, gid, type)}}}}} from pyverbs."""
    import pyverbs.device as d

    out: dict[str, dict[str, Any]] = {}
    for dev in devices:
        name = dev.name.decode()
        ports: dict[int, dict[str, Any]] = {}
        with d.Context(name=name) as ctx:
            attr = ctx.query_device()
            # max_entries: the whole table of every port (larger is EINVAL with rxe)
            size = sum(ctx.query_port(n).gid_tbl_len for n in range(1, attr.phys_port_cnt + 1))
            table = ctx.query_gid_table(size)
            for num in range(1, attr.phys_port_cnt + 1):
                pa = ctx.query_port(num)
                ports[num] = {
                    "state_num": int(pa.state), "active_mtu": _mtu_bytes(pa.active_mtu),
                    "mtu": _mtu_bytes(pa.max_mtu), "link_layer": _LINK_LAYERS.get(int(pa.link_layer)),
                    "lid": int(pa.lid),
                    "gids": {(g.gid_index, _gid(g.gid_str()), _GID_TYPES[int(g.gid_type)])
                             for g in table if g.port_num == num},
                }
        out[name] = {"guid": int(dev.guid), "ports": ports}
    return out


def _argrpc_view(core: ModuleType) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for dev in core.verbs_devices():
        ports = {}
        for p in dev["ports"]:
            ports[p["port"]] = {
                "state_num": p["state_num"], "active_mtu": p["active_mtu"], "mtu": p["mtu"],
                "link_layer": p["link_layer"], "lid": p["lid"],
                "gids": {(g["index"], _gid(g["gid"]), g["type"]) for g in p["gids"]},
            }
        out[dev["name"]] = {"guid": int(dev["node_guid"].replace(":", ""), 16), "ports": ports}
    return out


def test_device_list_matches(pyverbs_devices: list[Any], rdma: SimpleNamespace) -> None:
    assert sorted(d.name.decode() for d in pyverbs_devices) == sorted(
        d["name"] for d in rdma.devices)


def test_ports_states_mtus_and_gid_tables_match(pyverbs_devices: list[Any],
                                               rdma: SimpleNamespace) -> None:
    theirs, ours = _pyverbs_view(pyverbs_devices), _argrpc_view(rdma.core)
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert ours[name]["guid"] == theirs[name]["guid"], f"{name}: node GUID differs"
        assert ours[name]["ports"].keys() == theirs[name]["ports"].keys()
        for num, port in theirs[name]["ports"].items():
            mine = ours[name]["ports"][num]
            for key in ("state_num", "active_mtu", "mtu", "link_layer", "lid"):
                assert mine[key] == port[key], f"{name} port {num}: {key} {mine[key]} vs {port[key]}"
            assert mine["gids"] == port["gids"], f"{name} port {num}: GID tables differ"
    for dev in rdma.devices:  # the state name agrees with its number
        for p in dev["ports"]:
            assert (p["state"] == "ACTIVE") == (p["state_num"] == _ACTIVE)


def _expected_choice(view: dict[str, dict[str, Any]]) -> tuple[str, int, int]:
    """The documented default: mlx5_0 if present else the first device with an ACTIVE port;
    its first ACTIVE port; GID: RoCEv2 IPv4-mapped, else RoCEv2, else RoCEv1, else IB."""
    names = ["mlx5_0"] if "mlx5_0" in view else []
    names += [n for n in view if n != "mlx5_0"]
    for name in names:
        active = [n for n, p in sorted(view[name]["ports"].items()) if p["state_num"] == _ACTIVE]
        if not active:
            continue
        gids = sorted(view[name]["ports"][active[0]]["gids"], key=lambda g: g[0])
        for want in (lambda g: g[2] == "RoCEv2" and g[1].ipv4_mapped is not None,
                     lambda g: g[2] == "RoCEv2", lambda g: g[2] == "RoCEv1",
                     lambda g: g[2] == "IB"):
            hits = [g for g in gids if want(g)]
            if hits:
                return name, active[0], hits[0][0]
        return name, active[0], -1
    raise AssertionError("pyverbs sees no ACTIVE port")


def test_default_selection_matches_pyverbs(pyverbs_devices: list[Any], rdma: SimpleNamespace) -> None:
    view = _pyverbs_view(pyverbs_devices)
    name, port, index = _expected_choice(view)
    sel = rdma.select
    assert (sel["device"], sel["port"], sel["gid_index"]) == (name, port, index), sel
    entry = next(g for g in view[name]["ports"][port]["gids"] if g[0] == index)
    assert _gid(sel["gid"]) == entry[1] and sel["gid_type"] == entry[2]
    assert sel["mtu"] == view[name]["ports"][port]["active_mtu"]
    assert sel["link_layer"] == view[name]["ports"][port]["link_layer"]
    assert sel["why"], "the selection must say why"


def test_explicit_selection_and_clear_errors(pyverbs_devices: list[Any], rdma: SimpleNamespace) -> None:
    core, sel = rdma.core, rdma.select
    view = _pyverbs_view(pyverbs_devices)
    gids = view[sel["device"]]["ports"][sel["port"]]["gids"]
    for index, gid, kind in gids:   # every GID pyverbs lists can be chosen by index
        got = core.verbs_select(sel["device"], sel["port"], index)
        assert (got["gid_index"], _gid(got["gid"]), got["gid_type"]) == (index, gid, kind)
    with pytest.raises(core.CoreError, match="no_such_dev0"):
        core.verbs_select("no_such_dev0", None, None)
    bad_port = max(view[sel["device"]]["ports"]) + 1
    with pytest.raises(core.CoreError, match=str(bad_port)):
        core.verbs_select(sel["device"], bad_port, None)
    unused = max(g[0] for g in gids) + 1
    with pytest.raises(core.CoreError):
        core.verbs_select(sel["device"], sel["port"], unused)


def test_doctor_reports_what_pyverbs_sees(pyverbs_devices: list[Any], rdma: SimpleNamespace) -> None:
    from argrpc import _doctor

    report = _doctor.collect()
    assert report["libibverbs"] == "loaded" and not report["no_device_reason"]
    assert sorted(d["name"] for d in report["devices"]) == sorted(
        d.name.decode() for d in pyverbs_devices)
    assert report["selection"]["device"] == rdma.select["device"]
    text = _doctor.render(report)
    assert f"verbs selection: device {rdma.select['device']} port {rdma.select['port']}" in text
