"""argrpc_bench.runner: tiny real runs of every benchmark over every transport available
here, under the threaded and the asyncio API, the sweep environment reaching the
measured processes (and only them), skipped transports, and a transport whose processes
fail as failed rows beside the others, kept and written. Runs are a few iterations on a
tiny payload: seconds each, and nothing is timing-asserted (the machine is shared and
noisy)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from argrpc_bench import report, runner
from argrpc_bench.results import FIELDS, Measurement
from argrpc_bench.runner import RunSpec

AVAILABLE = runner.available_transports()
LIVE = [t for t in ("grpc", "shm", "verbs") if not AVAILABLE[t]]
KNOB, VALUE = "TF_RDMA_ACC_SIZE", "16K"  # valid, and not the default (8K)


def tiny(benchmark: str, transports: list[str], mode: str = "raw", **kw: object) -> RunSpec:
    defaults: dict[str, object] = dict(
        sizes=[] if benchmark == "ps" else [64, 64 << 10], buffers=3, warmup=1,
        iterations=2 if benchmark == "ps" else 5, repeats=2, workers=2, seed=3,
        model_bytes=256 << 10, timeout=120.0)
    defaults.update(kw)
    return RunSpec(benchmark=benchmark, transports=transports, mode=mode, **defaults)  # type: ignore[arg-type]


def finite_positive(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x > 0


def check_measured(m: Measurement, spec: RunSpec) -> None:
    assert isinstance(m, Measurement)
    assert not m.skipped and m.note == ""
    assert (m.benchmark, m.mode, m.scheme, m.repeats) == \
        (spec.benchmark, spec.mode, spec.scheme, spec.repeats)
    assert m.iterations == spec.iterations
    for key in ("p50_us", "p99_us", "mean_us", "gbps", "rpcs_per_s"):
        assert finite_positive(getattr(m, key)), (key, m)
    assert m.p50_us <= m.p99_us  # type: ignore[operator]
    if spec.benchmark == "ps":
        assert finite_positive(m.steps_per_s) and m.workers == spec.workers
        assert m.buffers == 161  # ResNet-50's variable count, scaled down in bytes
        assert m.size == 2 * spec.model_bytes  # type: ignore[operator]  # pull + push
    else:
        assert m.steps_per_s is None and m.workers is None
        assert m.buffers == spec.buffers
    json.dumps(m.__dict__)  # JSON-ready as is


def test_available_transports_names_every_transport() -> None:
    assert set(AVAILABLE) == {"grpc", "shm", "verbs"}
    assert AVAILABLE["grpc"] == ""
    assert all(isinstance(v, str) for v in AVAILABLE.values())


@pytest.mark.parametrize("mode", ["raw", "serialized"])
# (not "benchmark": pytest-benchmark owns that fixture name)
@pytest.mark.parametrize("kind", ["latency", "bandwidth", "ps"])
def test_tiny_run_of_each_benchmark_on_each_available_transport(kind: str,
                                                                 mode: str) -> None:
    spec = tiny(kind, LIVE, mode)
    got = runner.run(spec)
    per_transport = 1 if kind == "ps" else len(spec.sizes)
    assert [m.transport for m in got] == [t for t in LIVE for _ in range(per_transport)]
    if kind != "ps":
        assert [m.size for m in got] == spec.sizes * len(LIVE)
    for m in got:
        check_measured(m, spec)
        assert set(m.__dict__) == set(FIELDS)


def test_duration_mode_and_progress_reach_the_end() -> None:
    seen: list[tuple[str, float]] = []
    spec = tiny("latency", ["grpc"], iterations=None, duration=0.2, repeats=1)
    got = runner.run(spec, progress=lambda label, frac: seen.append((label, frac)))
    assert len(got) == 2 and all(m.iterations >= 1 for m in got)
    fractions = [f for _, f in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0


@pytest.mark.parametrize("kind", ["latency", "ps"])
def test_sweep_env_reaches_the_measured_processes_only(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KNOB, raising=False)
    before = dict(os.environ)
    got = runner.run(tiny(kind, LIVE, env={KNOB: VALUE}))
    # The client / worker processes reported it, and the runner checked that their
    # server / PS reported the same (it raises otherwise).
    assert got and all(m.env.get(KNOB) == VALUE for m in got)
    assert dict(os.environ) == before and KNOB not in os.environ


def test_server_and_client_report_the_env_they_were_given(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KNOB, raising=False)
    spec = runner.normalize(tiny("bandwidth", ["grpc"], env={KNOB: VALUE}))
    with ExitStack() as procs:
        server, port = runner.start_server(procs, "server", "argrpc_bench.server",
                                           ["--stack", "grpc"], runner.child_env(spec))
        client = runner.spawn(procs, "client", "argrpc_bench.client", [
            "--target", f"127.0.0.1:{port}", "--stack", "grpc", "--transport", "grpc",
            "--benchmark", "bandwidth", "--sizes", "1024", "--iterations", "2"],
            runner.child_env(spec))
        doc = client.result(deadline=_deadline())
        server.close()
    assert doc["ok"] and doc["env"][KNOB] == VALUE and doc["server_env"][KNOB] == VALUE
    assert doc["server_pid"] == server.proc.pid != os.getpid()
    assert KNOB not in os.environ


def test_unavailable_transport_is_skipped_with_its_reason() -> None:
    # Disabling argrpc for the measured processes makes shm (and verbs) unavailable to
    # them; grpc still runs. verbs without a device is skipped the same way.
    got = runner.run(tiny("latency", ["grpc", "shm", "verbs"],
                          env={"TF_RDMA_ENABLED": "false"}))
    by = {t: [m for m in got if m.transport == t] for t in ("grpc", "shm", "verbs")}
    assert all(not m.skipped for m in by["grpc"]) and len(by["grpc"]) == 2
    for t in ("shm", "verbs"):
        assert len(by[t]) == 2
        for m in by[t]:
            assert m.skipped and m.note and m.p50_us is None and m.gbps is None
            assert not m.failed  # this machine's (or spec's) reason: not a failure
    assert "TF_RDMA_ENABLED" in by["shm"][0].note or "engine" in by["shm"][0].note


@pytest.mark.skipif(not AVAILABLE["verbs"], reason="verbs is available here")
def test_verbs_without_fabric_says_why() -> None:
    for bench in ("bandwidth", "ps"):
        (m, *_) = runner.run(tiny(bench, ["verbs"]))
        assert m.skipped and m.transport == "verbs" and m.note == AVAILABLE["verbs"]


def _shm_served_by_plain_grpc(monkeypatch: pytest.MonkeyPatch
                              ) -> tuple[list[runner.Child], dict[str, list[str]]]:
    """The shm transport's server started as a plain grpc one, so that argrpc's shm client
    really lands on gRPC; returns every process the run starts (in order) and, when the
    first grpc process starts, which earlier ones were still alive."""
    children: list[runner.Child] = []
    alive: dict[str, list[str]] = {}
    spawn, start_server = runner.spawn, runner.start_server

    def recording_spawn(procs: ExitStack, name: str, *args: Any) -> runner.Child:
        if name.startswith("grpc") and "at grpc start" not in alive:
            alive["at grpc start"] = [c.name for c in children if c.proc.poll() is None]
        child = spawn(procs, name, *args)
        children.append(child)
        return child

    def plain_grpc_for_shm(procs: ExitStack, name: str, module: str, args: list[str],
                           *rest: Any) -> tuple[runner.Child, int]:
        if name.startswith("shm"):
            args = ["grpc" if a == "argrpc" else a for a in args]
        return start_server(procs, name, module, args, *rest)

    monkeypatch.setattr(runner, "spawn", recording_spawn)
    monkeypatch.setattr(runner, "start_server", plain_grpc_for_shm)
    return children, alive


@pytest.mark.skipif(bool(AVAILABLE["shm"]), reason=AVAILABLE["shm"] or "shm available")
@pytest.mark.parametrize("api", ["threaded", "aio"])
def test_shm_client_on_plain_grpc_is_a_failed_row_and_the_run_goes_on(
        api: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # TF_RDMA_TRANSPORT=auto from the spec (it wins over the runner's shm): the client may
    # fall back, and its transport check must refuse the plain gRPC channel it gets. shm
    # first: its failure must neither stop the grpc rows after it nor leave a process of
    # its own around when they start.
    children, alive = _shm_served_by_plain_grpc(monkeypatch)
    logged: list[str] = []
    got = runner.run(tiny("latency", ["shm", "grpc"], api=api,
                          env={"TF_RDMA_TRANSPORT": "auto"}), log=logged.append)
    shm = [m for m in got if m.transport == "shm"]
    grpc_rows = [m for m in got if m.transport == "grpc"]
    assert [m.size for m in shm] == [m.size for m in grpc_rows] == [64, 64 << 10]
    for m in shm:
        assert m.skipped and m.failed and m.p50_us is None and m.api == api
        assert m.note.startswith("not measured: shm")
        assert "not 'shm'" in m.note and "server is plain gRPC" in m.note
    for m in grpc_rows:
        check_measured(m, tiny("latency", ["grpc"], api=api))
    # the whole error went to the log, and after it which process (with its last stderr
    # lines, had it written any)
    (entry,) = logged
    assert entry.startswith(f"shm not measured: {shm[0].note[len('not measured: '):]}\n"
                            f"shm {'aio ' if api == 'aio' else ''}client (pid ")
    assert alive["at grpc start"] == []
    assert [c.name.split()[0] for c in children] == ["shm"] * 2 + ["grpc"] * 2
    assert all(c.proc.poll() is not None for c in children)


def _live_children() -> list[str]:
    """This process's children that have not exited, from /proc (``pid comm``)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # exited while listed
        comm_end = text.rindex(")")
        state, ppid = text[comm_end + 2:].split()[:2]
        if int(ppid) == os.getpid() and state != "Z":
            out.append(f"{stat.parent.name} {text[text.index('(') + 1:comm_end]}")
    return out


@pytest.mark.skipif(bool(AVAILABLE["shm"]), reason=AVAILABLE["shm"] or "shm available")
def test_cli_writes_every_row_beside_a_failed_transport_and_exits_1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from argrpc_bench import cli

    # TF_RDMA_TRANSPORT=verbs for the measured processes: the shm client must use verbs,
    # which it cannot here (no device: its calls fail) or which is not shm (a device:
    # the transport check fails). The grpc stack ignores the knob and is measured.
    # Children of this process from before (other tests' servers) are not the run's.
    before = set(_live_children())
    rc = cli.main(["latency", "--transports", "grpc,shm", "--sweep",
                   "TF_RDMA_TRANSPORT=verbs", "--sizes", "64,4K", "--mode", "raw",
                   "--iterations", "5", "--warmup", "1", "--repeats", "1", "--concurrency",
                   "1", "--clients", "1", "--no-floor", "--no-plots", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 1, captured.err
    assert set(_live_children()) - before == set()
    doc = json.loads((tmp_path / "results.json").read_text())
    rows = {(m["transport"], m["size"]): m for m in doc["measurements"]}
    assert sorted(rows) == [("grpc", 64), ("grpc", 4096), ("shm", 64), ("shm", 4096)]
    for size in (64, 4096):
        g = rows[("grpc", size)]
        assert not g["skipped"] and not g["failed"] and g["p50_us"] > 0
        assert g["env"] == {"TF_RDMA_TRANSPORT": "verbs"}
        m = rows[("shm", size)]
        assert m["skipped"] and m["failed"] and m["p50_us"] is None
        assert m["note"].startswith("not measured: shm client") and "verbs" in m["note"]
    # one error for the failed transport, naming its rows' run and cause, in the JSON,
    # on stdout and in the Markdown page
    (error,) = doc["meta"]["errors"]
    assert error.startswith("latency 64 B,4 KiB [raw, uniform] TF_RDMA_TRANSPORT=verbs: shm ")
    assert error.endswith(rows[("shm", 64)]["note"])
    assert f"errors:\n  {error}\n" in captured.out
    assert "skipped: not measured: shm client" in captured.out  # the table row
    assert f"- {error}" in (tmp_path / "results.md").read_text()
    # the child's own stderr reached the orchestrator's
    assert "error: latency 64 B,4 KiB" in captured.err and "its stderr ends:" in captured.err


def _deadline() -> float:
    import time

    return time.monotonic() + 60


# ------------------------------------------------------------------ asyncio API

@pytest.mark.parametrize("kind", ["latency", "bandwidth"])
def test_tiny_aio_run_gives_rows_for_grpc_aio_and_argrpc_aio(kind: str) -> None:
    spec = tiny(kind, LIVE, api="aio", concurrency=4)
    got = runner.run(spec)
    # latency: per size the ping-pong, then 4 calls in flight; bandwidth: one at a time
    flights = [1, 4] if kind == "latency" else [1]
    assert [(m.transport, m.size, m.concurrency) for m in got] == [
        (t, s, c) for t in LIVE for s in spec.sizes for c in flights]
    for m in got:
        assert m.api == "aio"
        check_measured(m, spec)
    transports = {m.transport for m in got}
    assert "grpc" in transports and ("shm" in transports or AVAILABLE["shm"])


def test_aio_serialized_run_and_progress_labels() -> None:
    seen: list[str] = []
    spec = tiny("latency", LIVE, mode="serialized", sizes=[64], api="aio", concurrency=2)
    got = runner.run(spec, progress=lambda label, frac: seen.append(label))
    assert len(got) == 2 * len(LIVE) and all(m.api == "aio" for m in got)
    assert "aio grpc 64 B" in seen and seen[-1] == "done"


def test_aio_unavailable_transport_is_skipped() -> None:
    got = runner.run(tiny("latency", ["grpc", "shm"], api="aio", concurrency=2,
                          env={"TF_RDMA_ENABLED": "false"}))
    shm = [m for m in got if m.transport == "shm"]
    assert len(shm) == 2 and all(m.skipped and m.api == "aio" for m in shm)
    assert all(not m.skipped for m in got if m.transport == "grpc")


def test_aio_run_on_uvloop() -> None:
    """Both processes of each pair on uvloop: argrpc.aio then gets every answer through
    its notifier's fd (it polls the engine only on asyncio's own loop), grpc.aio as it
    does on any loop. The rows say which loop, and count as their own cells."""
    pytest.importorskip("uvloop")
    spec = tiny("latency", LIVE, sizes=[64], api="aio", concurrency=1, loop="uvloop")
    got = runner.run(spec)
    assert [m.transport for m in got] == list(LIVE)
    for m in got:
        assert (m.api, m.loop) == ("aio", "uvloop")
        check_measured(m, spec)
    asyncio_row = dataclasses.replace(got[-1], loop="asyncio")
    assert report.cell_key(asyncio_row) != report.cell_key(got[-1])


def test_aio_spec_is_checked() -> None:
    with pytest.raises(ValueError, match="asyncio"):
        runner.normalize(tiny("ps", ["grpc"], api="aio"))
    with pytest.raises(ValueError, match="api"):
        runner.normalize(tiny("latency", ["grpc"], api="trio"))
    with pytest.raises(ValueError, match="concurrency"):
        runner.normalize(tiny("latency", ["grpc"], api="aio", concurrency=0))
    with pytest.raises(ValueError, match="asyncio API"):
        runner.normalize(tiny("latency", ["grpc"], loop="uvloop"))
    with pytest.raises(ValueError, match="unknown event loop"):
        runner.normalize(tiny("latency", ["grpc"], api="aio", loop="trio"))


def test_cli_both_apis_in_one_real_run(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from argrpc_bench import cli

    rc = cli.main(["latency", "--api", "both", "--sizes", "64", "--mode", "raw",
                   "--iterations", "5", "--warmup", "1", "--concurrency", "3",
                   "--clients", "1",  # the process fan-out has its own test below
                   "--transports", ",".join(LIVE), "--no-plots", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "== latency, asyncio API" in out and "== asyncio targets" in out
    doc = json.loads((tmp_path / "results.json").read_text())
    rows = {(m["api"], m["transport"], m["concurrency"]) for m in doc["measurements"]}
    # the floor: the threaded ping-pong's reference, measured with it
    assert rows == {(api, t, c) for t in LIVE for api, c in
                    (("threaded", 1), ("threaded", 3), ("aio", 1), ("aio", 3))} \
        | {("threaded", "floor", 1)}
    if "shm" in LIVE:
        assert "== latency: asyncio vs threaded API" in out


def test_client_processes_start_together_and_are_aggregated() -> None:
    spec = tiny("latency", LIVE, sizes=[64], clients=3, repeats=2)
    got = runner.run(spec)
    assert [(m.transport, m.clients, m.concurrency) for m in got] == \
        [(t, 3, 1) for t in LIVE]
    for m in got:
        assert not m.skipped and m.size == 64
        # every process made its calls in every phase; the aggregate counts them all
        assert m.iterations == spec.iterations
        for key in ("p50_us", "p99_us", "mean_us", "gbps", "rpcs_per_s"):
            assert finite_positive(getattr(m, key)), (key, m)


@pytest.mark.parametrize("bad", [dict(clients=0), dict(clients=2, api="aio"),
                                 dict(clients=2, benchmark="ps")])
def test_client_processes_spec_is_checked(bad: dict[str, object]) -> None:
    spec = tiny(str(bad.pop("benchmark", "latency")), ["grpc"], **bad)
    with pytest.raises(ValueError, match="clients"):
        runner.normalize(spec)
