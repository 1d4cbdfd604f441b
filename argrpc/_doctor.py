"""`argrpc doctor`: why RDMA is (not) used here, in one report.

It answers "RDMA silently not used": what the kernel and libibverbs see (devices, ports,
states, MTUs, GID tables), whether memory can be registered (the memlock limit against
TF_RDMA_BUF_SIZE), which device/port/GID argrpc would pick and why, and, for a target,
the device/port/GID chosen by the route to it and which transport an argrpc channel gets
and why. Every probe is guarded: on a host with
no RDMA at all (or without argrpc's engine) the report says what is missing instead of
failing.
"""

from __future__ import annotations

import json
import os
import resource
from typing import Any

from argrpc import _config
from argrpc._transports import names

__all__ = ["collect", "render", "run"]

_SYS_IB = "/sys/class/infiniband"
_DEV_IB = "/dev/infiniband"
_CAP_IPC_LOCK = 14  # linux/capability.h
# Beyond the pool, each verbs connection registers its receive ring and a credit
# mailbox; a few connections' worth is the margin the memlock check asks for.
_PER_CONN_MARGIN = 4


def _fmt_bytes(n: int) -> str:
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult:
            value = n / mult
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} B"


# --------------------------------------------------------------------------- probes

def _engine() -> tuple[Any, str]:
    try:
        from argrpc._engine import EngineUnavailable, core_module
    except Exception as e:  # noqa: BLE001 - a broken install is a finding, not a crash
        return None, f"argrpc cannot be imported: {e}"
    try:
        return core_module(), ""
    except EngineUnavailable as e:
        return None, str(e)


def _sysfs_devices() -> tuple[list[str], str]:
    """RDMA devices as the kernel shows them, independent of libibverbs."""
    try:
        return sorted(os.listdir(_SYS_IB)), ""
    except FileNotFoundError:
        return [], f"{_SYS_IB} does not exist"
    except OSError as e:
        return [], f"{_SYS_IB}: {e}"


def _uverbs_nodes() -> list[str]:
    try:
        return sorted(n for n in os.listdir(_DEV_IB) if n.startswith("uverbs"))
    except OSError:
        return []


def _no_device_reason(engine_error: str, libibverbs: str, sysfs: list[str],
                      sysfs_error: str) -> str:
    """Every reason that applies, the most fundamental (the kernel) first."""
    reasons = []
    if not sysfs:
        reasons.append(
            f"the kernel shows no RDMA device ({sysfs_error or _SYS_IB + ' is empty'}): no "
            "RDMA driver is loaded (e.g. mlx5_ib for ConnectX, rdma_rxe for Soft-RoCE: "
            "`modprobe rdma_rxe && rdma link add rxe0 type rxe netdev IFACE`), or this is a "
            "container that was not given the host's /dev/infiniband and /sys/class/infiniband")
    if engine_error:
        reasons.append(engine_error)
    elif libibverbs:
        reasons.append(f"libibverbs is not loadable ({libibverbs}): install rdma-core's user "
                       "space (Debian/Ubuntu: apt-get install libibverbs1 ibverbs-providers)")
    elif sysfs:
        uverbs = _uverbs_nodes()
        if not uverbs:
            reasons.append(f"the kernel has {', '.join(sysfs)} but there is no "
                           f"{_DEV_IB}/uverbs* node (ib_uverbs not loaded, or not passed "
                           "into this container)")
        else:
            reasons.append(
                f"the kernel has {', '.join(sysfs)} but libibverbs lists none: its provider "
                "library is missing (Debian: ibverbs-providers) or "
                f"{', '.join(_DEV_IB + '/' + u for u in uverbs)} is not accessible to this user")
    return "; ".join(reasons)


def _has_cap_ipc_lock() -> bool:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def memlock_report(cfg: _config.Config | None) -> dict[str, Any]:
    """The RLIMIT_MEMLOCK limit and what it means for registering TF_RDMA_BUF_SIZE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    buf = (cfg or _config.Config()).buf_size
    ring = (cfg or _config.Config()).ring_size
    need = buf + _PER_CONN_MARGIN * 2 * ring
    cap = _has_cap_ipc_lock()
    unlimited = soft == resource.RLIM_INFINITY
    if unlimited:
        ok, verdict = True, "unlimited: the pool and the rings can be registered"
    elif cap:
        ok, verdict = True, ("this process has CAP_IPC_LOCK, so the limit does not apply to "
                             "memory registration")
    elif soft >= need:
        ok, verdict = True, (f"enough for TF_RDMA_BUF_SIZE={_fmt_bytes(buf)} plus the "
                             "connections' rings")
    else:
        fits = max(0, soft - _PER_CONN_MARGIN * 2 * ring)
        hard_txt = "unlimited" if hard == resource.RLIM_INFINITY else _fmt_bytes(hard)
        verdict = (f"too low: the verbs fabric registers (pins) the buffer pool, up to "
                   f"TF_RDMA_BUF_SIZE={_fmt_bytes(buf)}, plus each connection's rings "
                   f"(about {_fmt_bytes(need)}), so memory registration will fail. Raise it "
                   f"before starting the process: `ulimit -l unlimited` (hard limit here: "
                   f"{hard_txt}; root may raise it), LimitMEMLOCK=infinity (systemd), "
                   f"--ulimit memlock=-1 (docker); or lower TF_RDMA_BUF_SIZE"
                   + (f" (this limit fits about {_fmt_bytes(fits)})" if fits else "")
                   + ". Shared memory (shm) does not need locked memory")
        ok = False
    return {"soft": None if unlimited else soft,
            "hard": None if hard == resource.RLIM_INFINITY else hard,
            "cap_ipc_lock": cap, "buf_size": buf, "needed": need, "ok": ok, "verdict": verdict}


def _target_report(target: str, transport: str | None) -> dict[str, Any]:
    from argrpc import _bootstrap
    from argrpc._channel import Channel

    options = [("TF_RDMA_TRANSPORT", transport)] if transport else None
    out: dict[str, Any] = {"target": target}
    try:
        cfg = _config.load(options)
        out["offered"], why_not = _bootstrap.client_offer(cfg)
        for name in names():
            out[f"client_{name}_reason"] = why_not.get(name, "")
        with Channel(target, None, options) as channel:
            out["transport"] = channel.transport
            out["reason"] = channel.fallback_reason
    except Exception as e:  # noqa: BLE001 - bad target or config: report, do not crash
        out["transport"] = "error"
        out["reason"] = f"{type(e).__name__}: {e}"
    return out


def _target_selection(core: Any, cfg: _config.Config, target: str) -> dict[str, Any]:
    """The device/port/GID a channel to `target` picks: by the route to its address."""
    from argrpc._transports.verbs import target_address

    address = target_address(target)
    if not address:
        return {"error": f"{target!r} names no host that resolves to an IP address"}
    try:
        sel = dict(core.verbs_select(cfg.dev_name, cfg.port_num, cfg.gid_index, peer=address))
    except Exception as e:  # noqa: BLE001 - CoreError names what it looked at
        return {"error": str(e), "peer": address}
    sel["peer"] = address
    return sel


def collect(target: str | None = None, transport: str | None = None) -> dict[str, Any]:
    """Everything the report shows, as plain data (`argrpc doctor --json` prints it)."""
    import argrpc

    report: dict[str, Any] = {"argrpc": {"version": getattr(argrpc, "__version__", "?"),
                                         "path": os.path.dirname(os.path.abspath(argrpc.__file__))}}
    cfg: _config.Config | None
    try:
        cfg = _config.load()
        report["config_error"] = ""
    except _config.ConfigError as e:
        cfg, report["config_error"] = None, str(e)
    if cfg is not None:
        report["config"] = {"TF_RDMA_ENABLED": cfg.enabled, "TF_RDMA_TRANSPORT": cfg.transport,
                            "TF_RDMA_DEV_NAME": cfg.dev_name, "TF_RDMA_PORT_NUM": cfg.port_num,
                            "TF_RDMA_GID_INDEX": cfg.gid_index, "TF_RDMA_QPS": cfg.qps,
                            "TF_RDMA_BUF_SIZE": cfg.buf_size}

    core, engine_error = _engine()
    report["engine_error"] = engine_error
    verbs_built = core is not None and hasattr(core, "verbs_devices")
    if core is not None and not verbs_built:
        engine_error = "this build of argrpc's engine (argrpc._core) has no verbs fabric"
    libibverbs = ""
    if verbs_built:
        try:
            libibverbs = core.verbs_status()
        except Exception as e:  # noqa: BLE001
            libibverbs = f"verbs_status() failed: {e}"
    report["verbs_built"] = verbs_built
    report["libibverbs"] = "not probed" if not verbs_built else (libibverbs or "loaded")
    sysfs, sysfs_error = _sysfs_devices()
    report["kernel_devices"] = sysfs
    devices: list[dict[str, Any]] = []
    if verbs_built and not libibverbs:
        try:
            devices = [dict(d) for d in core.verbs_devices()]
        except Exception as e:  # noqa: BLE001 - the contract says it raises nothing
            engine_error = f"verbs_devices() failed: {e}"
    report["devices"] = devices
    report["no_device_reason"] = "" if devices else _no_device_reason(
        engine_error, libibverbs if verbs_built else "", sysfs, sysfs_error)
    report["memlock"] = memlock_report(cfg)

    selection: dict[str, Any] = {}
    if cfg is None:
        selection["error"] = report["config_error"]
    elif not devices:
        selection["error"] = report["no_device_reason"]
    else:
        try:
            selection = dict(core.verbs_select(cfg.dev_name, cfg.port_num, cfg.gid_index))
        except Exception as e:  # noqa: BLE001 - CoreError names what it looked at
            selection["error"] = str(e)
    report["selection"] = selection
    if target:
        report["target"] = _target_report(target, transport)
        if cfg is not None and "error" not in selection:
            report["target"]["selection"] = _target_selection(core, cfg, target)
    return report


# --------------------------------------------------------------------------- text

def _knob(value: Any) -> str:
    return "auto" if value is None else str(value)


def render(report: dict[str, Any]) -> str:
    lines: list[str] = []
    add = lines.append
    add(f"argrpc {report['argrpc']['version']} ({report['argrpc']['path']})")
    if report["engine_error"]:
        add(f"engine: NOT AVAILABLE: {report['engine_error']}")
    else:
        add("engine: argrpc._core loaded" + ("" if report["verbs_built"]
                                             else " (built without the verbs fabric)"))
    if report["config_error"]:
        add(f"configuration: INVALID: {report['config_error']}")
    else:
        c = report["config"]
        add("configuration: " + ", ".join(
            f"{k}={_knob(v)}" for k, v in c.items() if k != "TF_RDMA_BUF_SIZE")
            + f", TF_RDMA_BUF_SIZE={_fmt_bytes(c['TF_RDMA_BUF_SIZE'])}")
    add(f"libibverbs: {report['libibverbs']}")
    kd = report["kernel_devices"]
    add(f"kernel RDMA devices ({_SYS_IB}): {', '.join(kd) if kd else 'none'}")

    add("")
    devices = report["devices"]
    if not devices:
        add(f"RDMA devices: none. Why: {report['no_device_reason']}")
    else:
        add(f"RDMA devices: {len(devices)}")
    for dev in devices:
        add(f"  {dev.get('name')}  node GUID {dev.get('node_guid', '?')}")
        ports = dev.get("ports") or []
        if not ports:
            add("    no ports")
        for p in ports:
            add(f"    port {p.get('port')}: {p.get('state')} ({p.get('state_num')}), link layer "
                f"{p.get('link_layer')}, MTU active {p.get('active_mtu')} / max {p.get('mtu')}, "
                f"LID {p.get('lid')}")
            gids = p.get("gids") or []
            if not gids:
                add("      GID table: empty")
            for g in gids:
                add(f"      GID[{g.get('index')}] {g.get('gid')}  {g.get('type')}")

    add("")
    m = report["memlock"]
    soft = "unlimited" if m["soft"] is None else _fmt_bytes(m["soft"])
    hard = "unlimited" if m["hard"] is None else _fmt_bytes(m["hard"])
    add(f"memlock limit (ulimit -l): soft {soft}, hard {hard}"
        + (", CAP_IPC_LOCK" if m["cap_ipc_lock"] else ""))
    add(f"  {'OK' if m['ok'] else 'PROBLEM'}: {m['verdict']}")

    add("")
    _render_selection(add, "verbs selection", report["selection"], "")

    t = report.get("target")
    if t:
        add("")
        add(f"target {t['target']}:")
        if "offered" in t:
            why_not = "; ".join(f"no {name}: {t[f'client_{name}_reason']}" for name in names()
                                if t.get(f"client_{name}_reason"))
            add(f"  this client offers: {', '.join(t['offered']) or 'nothing'}"
                + (f" ({why_not})" if why_not else ""))
        if "selection" in t:
            peer = t["selection"].get("peer")
            _render_selection(add, "verbs selection" + (f" for {peer}" if peer else ""),
                              t["selection"], "  ")
        add(f"  transport: {t['transport']}")
        if t.get("reason"):
            add(f"  why not a fast transport: {t['reason']}")
    return "\n".join(lines) + "\n"


def _render_selection(add: Any, title: str, sel: dict[str, Any], indent: str) -> None:
    if "error" in sel:
        add(f"{indent}{title}: none: {sel['error']}")
        return
    netdev = f" on {sel['netdev']}" if sel.get("netdev") else ""
    add(f"{indent}{title}: device {sel.get('device')} port {sel.get('port')} "
        f"GID[{sel.get('gid_index')}] {sel.get('gid')} ({sel.get('gid_type')}){netdev}, "
        f"MTU {sel.get('mtu')}, link layer {sel.get('link_layer')}, LID {sel.get('lid')}")
    if sel.get("why"):
        add(f"{indent}  why: {sel['why']}")


def run(target: str | None, transport: str | None, as_json: bool) -> int:
    report = collect(target, transport)
    if as_json:
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
    else:
        print(render(report), end="")
    return 0
