"""argrpc_bench results/report/plots/cli: the documented JSON schema, tables with ratios
against grpc, target checks, sweeps side by side, real PNGs. No timing is asserted:
the measurements here are synthetic."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from argrpc_bench import cli, report
from argrpc_bench.plots import write_plots
from argrpc_bench.progress import Progress
from argrpc_bench.results import SCHEMA, Measurement, collect_meta, from_json, to_json

MiB = 1 << 20
DOCUMENTED_FIELDS = {
    "benchmark": str, "transport": str, "mode": str, "scheme": str, "size": int,
    "buffers": int, "iterations": int, "repeats": int, "p50_us": (float, type(None)),
    "p99_us": (float, type(None)), "mean_us": (float, type(None)),
    "gbps": (float, type(None)), "rpcs_per_s": (float, type(None)),
    "steps_per_s": (float, type(None)), "workers": (int, type(None)), "env": dict,
    "note": str, "skipped": bool, "api": str, "concurrency": int, "clients": int,
    "failed": bool, "loop": str,
}


def lat(transport: str, size: int, p50: float, p99: float, mode: str = "raw",
        env: dict[str, str] | None = None) -> Measurement:
    return Measurement("latency", transport, mode, "uniform", size, 1, 1000, 1,
                       p50_us=p50, p99_us=p99, mean_us=p50 * 1.1, rpcs_per_s=1e6 / p50,
                       env=dict(env or {}))


def bw(transport: str, size: int, gbps: float, mode: str = "raw",
       env: dict[str, str] | None = None) -> Measurement:
    return Measurement("bandwidth", transport, mode, "uniform", size, 1, 20, 1,
                       p50_us=size / gbps / 1e3, p99_us=size / gbps / 1e3 * 1.2,
                       mean_us=size / gbps / 1e3, gbps=gbps, rpcs_per_s=gbps * 1e9 / size,
                       env=dict(env or {}))


def ps(transport: str, steps: float, mode: str = "raw") -> Measurement:
    size = 2 * 102_228_128
    return Measurement("ps", transport, mode, "skew", size, 161, 10, 1,
                       steps_per_s=steps, gbps=steps * size * 2 / 1e9,
                       rpcs_per_s=steps * 2 * 2 * 161, workers=2)


def skipped(benchmark: str, size: int) -> Measurement:
    return Measurement(benchmark, "verbs", "raw", "uniform", size, 1, 0, 1,
                       skipped=True, note="no RDMA device")


@pytest.fixture()
def sample() -> list[Measurement]:
    return [
        lat("grpc", 64, 200.0, 400.0), lat("shm", 64, 8.0, 50.0), skipped("latency", 64),
        lat("grpc", 64 * 1024, 400.0, 800.0), lat("shm", 64 * 1024, 40.0, 80.0),
        lat("grpc", 64, 250.0, 500.0, mode="serialized"),
        lat("shm", 64, 10.0, 20.0, mode="serialized"),
        bw("grpc", 4 * MiB, 0.5), bw("shm", 4 * MiB, 4.0),
        bw("grpc", 64 * MiB, 0.4), bw("shm", 64 * MiB, 20.0),
        bw("grpc", 4 * MiB, 0.4, mode="serialized"), bw("shm", 4 * MiB, 1.0, mode="serialized"),
        ps("grpc", 1.0), ps("shm", 6.0),
    ]


# --------------------------------------------------------------------------- JSON

def test_json_has_the_documented_schema(sample: list[Measurement], tmp_path: Path) -> None:
    meta = collect_meta(["all", "--quick"], quick=True)
    path = tmp_path / "sub" / "r.json"
    report.write_json(str(path), sample, meta)
    doc = json.loads(path.read_text())
    assert set(doc) == {"schema", "meta", "measurements"}
    assert doc["schema"] == SCHEMA == "argrpc-bench/1"
    for key in ("date", "command", "kernel", "cpus", "python", "grpcio", "protobuf"):
        assert key in doc["meta"], key
    assert doc["meta"]["command"] == "argrpc-bench all --quick"
    assert doc["meta"]["quick"] is True
    assert len(doc["measurements"]) == len(sample)
    for m in doc["measurements"]:
        assert set(m) == set(DOCUMENTED_FIELDS)
        for k, t in DOCUMENTED_FIELDS.items():
            assert isinstance(m[k], t), (k, m[k])
    assert set(DOCUMENTED_FIELDS) == {f.name for f in dataclasses.fields(Measurement)}
    back, meta_back = from_json(doc)
    assert back == sample and meta_back == doc["meta"]


def test_from_json_rejects_other_documents() -> None:
    with pytest.raises(ValueError):
        from_json({"schema": "something/2", "measurements": []})


def test_to_json_sorts_env() -> None:
    m = lat("shm", 64, 1.0, 2.0, env={"TF_RDMA_SPIN_US": "0", "TF_RDMA_ACC_SIZE": "4K"})
    d = to_json([m], {})
    assert list(d["measurements"][0]["env"]) == ["TF_RDMA_ACC_SIZE", "TF_RDMA_SPIN_US"]
    json.dumps(d)


# --------------------------------------------------------------------------- tables

def test_terminal_table_has_ratios_vs_grpc(sample: list[Measurement]) -> None:
    text = report.terminal_report(sample)
    assert "== latency" in text and "== bandwidth" in text and "== ps" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("raw") and " shm " in ln]
    lat64 = next(r for r in rows if "64 B" in r)
    assert "25.0×" in lat64 and "8.00×" in lat64          # p50 200/8, p99 400/50
    bw64 = next(r for r in rows if "64 MiB" in r)
    assert "50.0×" in bw64                                 # 20 / 0.4 GB/s
    assert "6.00×" in next(r for r in rows if "skew" in r)  # ps 6 / 1 steps/s
    assert "skipped: no RDMA device" in text
    assert "base" in next(ln for ln in text.splitlines()
                          if ln.startswith("raw") and " grpc " in ln)


def test_ratio_direction() -> None:
    g, s = lat("grpc", 64, 100.0, 100.0), lat("shm", 64, 4.0, 5.0)
    assert report.speedup(s, g, "p50_us") == pytest.approx(25.0)   # lower is better
    gb, sb = bw("grpc", MiB, 1.0), bw("shm", MiB, 3.0)
    assert report.speedup(sb, gb, "gbps") == pytest.approx(3.0)    # higher is better
    assert report.speedup(sb, None, "gbps") is None


def test_targets_pass_miss_and_by_how_much(sample: list[Measurement]) -> None:
    res = report.evaluate_targets(sample)
    by = {(r.target.text, r.where.split(",")[0]): r for r in res}
    p50 = by[("latency p50 at 64 B ≥ 20× lower", "raw")]
    assert p50.status == "PASS" and p50.ratio == pytest.approx(25.0)
    p99 = by[("latency p99 at 64 B ≥ 10× lower", "raw")]
    assert p99.status == "MISS" and "short by 1.25×" in p99.detail
    assert by[("latency p99 at 64 B ≥ 10× lower", "serialized")].status == "PASS"
    assert by[("raw bandwidth at 64 MiB ≥ 30× higher", "raw")].status == "PASS"
    # once a goal, now information: bound by protobuf, not by the transport
    ser = by[("serialized bandwidth at 4 MiB vs 10× higher", "serialized")]
    assert ser.status == "INFO" and ser.ratio == pytest.approx(2.5)
    assert ser.detail == ("2.50× (once a goal of 10×; bound by protobuf's copies of the "
                          "message, not by the transport)")
    assert by[("serialized bandwidth at 64 MiB ≥ 4× higher", "")].status == "not measured"
    assert by[("PS throughput, skew scheme ≥ 5× higher", "raw")].status == "PASS"
    text = report.terminal_report(sample)
    assert "PASS" in text and "MISS" in text and "short by" in text


def test_targets_not_measured_says_how() -> None:
    res = report.evaluate_targets([lat("grpc", 1024, 1.0, 1.0), lat("shm", 1024, 1.0, 1.0)])
    assert {r.status for r in res} == {"not measured"}
    assert all("--sizes 64" in r.detail for r in res)
    assert len(res) == 4  # only the threaded latency targets (not the floor's: no floor row)


def test_markdown_report(sample: list[Measurement], tmp_path: Path) -> None:
    plot = tmp_path / "out" / "latency.png"
    md_path = tmp_path / "docs" / "bench.md"
    meta = collect_meta(["latency"])
    md = report.markdown_report(sample, meta, [str(plot)], str(md_path))
    assert md.startswith("# argrpc-bench results")
    assert "`argrpc-bench latency`" in md and meta["kernel"] in md
    assert "| mode | scheme | size | bufs | transport | p50 µs |" in md
    assert "| raw | uniform | 64 B | 1 | shm | 8.00 |" in md
    assert "25.0×" in md and "| PASS |" in md and "| MISS |" in md
    assert "![latency](../out/latency.png)" in md
    # every table row has as many cells as its header
    for block in md.split("\n\n"):
        rows = [ln for ln in block.splitlines() if ln.startswith("|")]
        if rows:
            assert len({r.count(" | ") for r in rows if not r.startswith("|:")
                        and not r.startswith("|-")}) == 1, block


def test_failed_rows_are_errors_and_other_skips_are_not() -> None:
    why = "not measured: shm client failed: boom"
    ms = [lat("grpc", 64, 200.0, 400.0), skipped("latency", 64),
          *(dataclasses.replace(lat("shm", size, 1.0, 2.0), p50_us=None, skipped=True,
                                failed=True, note=why) for size in (64, 4096))]
    # one line per failed transport and cause, not one per size; the verbs row skipped
    # for want of a device is no error
    assert cli.failed_rows("latency 64 B,4 KiB [raw, uniform]", ms) == [
        f"latency 64 B,4 KiB [raw, uniform]: shm {why}"]
    assert cli.failed_rows("t", [skipped("latency", 64)]) == []


def test_markdown_lists_the_errors_first_lines() -> None:
    meta = collect_meta(["latency"], errors=["latency 64 B: shm not measured: boom\nits "
                                             "stderr ends:\nTraceback"])
    md = report.markdown_report([lat("grpc", 64, 200.0, 400.0)], meta)
    errors = md.split("## Errors\n", 1)[1].split("\n## ", 1)[0]
    assert "- latency 64 B: shm not measured: boom\n" in errors
    assert "Traceback" not in md
    assert "## Errors" not in report.markdown_report([], collect_meta(["latency"]))


def test_sweep_values_side_by_side() -> None:
    ms = []
    for acc, g, s in (("4K", 1.0, 10.0), ("8K", 1.0, 14.0), ("16K", 1.1, 12.0)):
        env = {"TF_RDMA_ACC_SIZE": acc}
        ms += [bw("grpc", 4 * MiB, g, env=env), bw("shm", 4 * MiB, s, env=env)]
    table = report.sweep_table(ms, "bandwidth")
    assert table is not None
    assert table.headers[5:] == ["ACC_SIZE=4K", "ACC_SIZE=8K", "ACC_SIZE=16K", "best"]
    shm_row = next(r for r in table.rows if r[4] == "shm")
    assert shm_row[5:] == ["10.0", "14.0", "12.0", "ACC_SIZE=8K"]
    text = report.terminal_report(ms)
    assert "sweep" in text and "ACC_SIZE=16K" in text
    # ratios pair each env with grpc of the same env: 12 / 1.1
    assert "10.9×" in report.benchmark_table(ms, "bandwidth").text()
    assert report.sweep_table([bw("grpc", MiB, 1.0)], "bandwidth") is None


def test_formatting() -> None:
    assert report.fmt_size(64) == "64 B"
    assert report.fmt_size(4096) == "4 KiB"
    assert report.fmt_size(64 * MiB) == "64 MiB"
    assert report.fmt_size(1536) == "1.5 KiB"
    assert report.fmt_num(None) == "–"
    assert report.fmt_num(12345.6) == "12,346"
    assert report.fmt_ratio(25.04) == "25.0×" and report.fmt_ratio(2.5) == "2.50×"


# --------------------------------------------------------------------------- plots

def test_plots_are_png_files(sample: list[Measurement], tmp_path: Path) -> None:
    paths = write_plots(sample, str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["latency.png", "bandwidth.png", "ps.png"]
    for p in paths:
        data = Path(p).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plots_skip_benchmarks_without_data(tmp_path: Path) -> None:
    ms = [bw("grpc", MiB, 1.0), bw("shm", MiB, 5.0, env={"TF_RDMA_ACC_SIZE": "4K"}),
          skipped("bandwidth", MiB)]
    assert [os.path.basename(p) for p in write_plots(ms, str(tmp_path))] == ["bandwidth.png"]
    assert write_plots([skipped("latency", 64)], str(tmp_path / "none")) == []


# --------------------------------------------------------------------------- progress

class _Stream:
    def __init__(self, tty: bool) -> None:
        self.data, self.tty = "", tty

    def write(self, s: str) -> int:
        self.data += s
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return self.tty


def test_progress_plain_lines_when_not_a_tty() -> None:
    s = _Stream(tty=False)
    p = Progress(2, stream=s)
    cb = p.step("latency")
    cb("grpc 64 B", 0.1)
    cb("grpc 64 B", 0.2)                 # same label: no new line
    cb("shm 64 B", 0.6)
    p.step("bandwidth")("grpc 1 MiB", 0.0)
    p.close()
    assert "\r" not in s.data
    assert s.data.splitlines() == ["[  0%] latency", "[  5%] latency: grpc 64 B",
                                   "[ 30%] latency: shm 64 B", "[ 50%] bandwidth",
                                   "[ 50%] bandwidth: grpc 1 MiB"]


def test_progress_bar_on_a_tty() -> None:
    s = _Stream(tty=True)
    p = Progress(1, stream=s)
    p.step("ps")("workers", 1.0)
    p.message("note: verbs skipped")
    p.close()
    assert "\r[" in s.data and "100%" in s.data and "note: verbs skipped\n" in s.data


# --------------------------------------------------------------------------- cli parsing

def test_cli_parses_sizes_transports_and_sweeps() -> None:
    assert cli.parse_sizes("64,1K,64K,1M,16M,64M") == [64, 1024, 65536, MiB, 16 * MiB,
                                                     64 * MiB]
    assert cli.parse_transports("shm,grpc,shm") == ["shm", "grpc"]
    name, vals = cli.parse_sweep("tf_rdma_acc_size=4K,8K,16K")
    assert (name, vals) == ("TF_RDMA_ACC_SIZE", ["4K", "8K", "16K"])
    envs = cli.sweep_envs([("TF_RDMA_ACC_SIZE", ["4K", "8K"]), ("TF_RDMA_SPIN_US", ["0", "50"])])
    assert envs == [{"TF_RDMA_ACC_SIZE": "4K", "TF_RDMA_SPIN_US": "0"},
                    {"TF_RDMA_ACC_SIZE": "4K", "TF_RDMA_SPIN_US": "50"},
                    {"TF_RDMA_ACC_SIZE": "8K", "TF_RDMA_SPIN_US": "0"},
                    {"TF_RDMA_ACC_SIZE": "8K", "TF_RDMA_SPIN_US": "50"}]
    assert cli.sweep_envs([]) == [{}]


@pytest.mark.parametrize("argv", [
    ["--sizes", "64,lots"], ["--transports", "tcp"], ["--sweep", "TF_RDMA_NOPE=1"],
    ["--sweep", "TF_RDMA_ACC_SIZE"], ["--sweep", "TF_RDMA_ACC_SIZE=2M"],
    ["--sweep", "TF_RDMA_SPIN_US=1", "--sweep", "TF_RDMA_SPIN_US=2"],
    ["--iterations", "5", "--duration", "1"], ["--buffers", "0"], ["bogus"]])
def test_cli_rejects_bad_arguments(argv: list[str], capsys: Any) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert "argrpc-bench: error:" in capsys.readouterr().err


# --------------------------------------------------------------------------- cli end to end
# With a stand-in runner module: what is tested is the CLI's planning and output, not the
# measured processes (tests/test_bench_runs.py runs those).

def _fake_runner(calls: list[Any], fail_mode: str | None = None) -> Any:
    import types
    from dataclasses import dataclass, field

    @dataclass
    class RunSpec:
        benchmark: str
        transports: list[str]
        mode: str = "raw"
        scheme: str = "uniform"
        sizes: list[int] = field(default_factory=lambda: [64])
        buffers: int = 1
        warmup: int = 10
        iterations: int | None = None
        duration: float | None = None
        repeats: int = 1
        workers: int = 2
        seed: int = 0
        env: dict[str, str] = field(default_factory=dict)
        api: str = "threaded"
        loop: str = "asyncio"
        concurrency: int = 1
        references: bool = False
        clients: int = 1

    def run(spec: RunSpec, progress: Any = None, log: Any = None) -> list[Measurement]:
        calls.append((spec, dict(os.environ)))
        if spec.mode == fail_mode:
            raise RuntimeError("server did not start")
        out = []
        for t in spec.transports:
            if progress:
                progress(t, 0.5)
            if t == "verbs":
                out.append(Measurement(spec.benchmark, t, spec.mode, spec.scheme, 64, 1, 0,
                                       1, skipped=True, note="no RDMA device"))
                continue
            k = 30.0 if t == "shm" else 1.0
            if spec.benchmark == "ps":
                out.append(ps(t, k))
                continue
            for size in spec.sizes:
                m = (lat(t, size, 100 / k, 200 / k, mode=spec.mode)
                     if spec.benchmark == "latency" else bw(t, size, k, mode=spec.mode))
                m.env = dict(spec.env)   # some left empty on purpose: the CLI fills them
                out.append(m)
        for m in out:
            m.api = spec.api
        return out

    mod = types.ModuleType("argrpc_bench.runner")
    mod.RunSpec = RunSpec  # type: ignore[attr-defined]
    mod.run = run  # type: ignore[attr-defined]
    mod.available_transports = lambda: {"grpc": "", "shm": "", "verbs": "no RDMA device"}  # type: ignore[attr-defined]
    return mod


CONNECT_DOC = {
    "sequential": {"grpc": {"n": 20, "ok": 20, "p50_ms": 3.0, "p99_ms": 5.0, "max_ms": 5.5,
                            "errors": []},
                   "argrpc": {"n": 20, "ok": 20, "p50_ms": 7.5, "p99_ms": 9.0, "max_ms": 9.9,
                              "errors": []}},
    "burst": {"grpc": {"n": 64, "ok": 64, "p50_ms": 90.0, "p99_ms": 150.0, "max_ms": 160.0,
                       "errors": []},
              "argrpc": {"n": 64, "ok": 63, "p50_ms": 95.0, "p99_ms": 170.0, "max_ms": 180.0,
                         "errors": ["TimeoutError: handshake"]}},
    "ratio_p50": 2.5, "processes": 20, "burst_size": 64}


@pytest.fixture()
def fake_connect(monkeypatch: Any) -> list[tuple[int, int]]:
    """`argrpc_bench.connect` whose measure() records its arguments and returns
    CONNECT_DOC instead of starting 200 processes (the CLI's planning is under test)."""
    import sys
    import types

    calls: list[tuple[int, int]] = []

    def measure(processes: int = 50, burst: int = 64, env: Any = None,
                progress: bool = False) -> dict[str, Any]:
        calls.append((processes, burst))
        return CONNECT_DOC

    mod = types.ModuleType("argrpc_bench.connect")
    mod.measure = measure  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "argrpc_bench.connect", mod)
    return calls


def test_connect_table_and_targets() -> None:
    table = report.connect_table(CONNECT_DOC)
    assert [r[:3] for r in table.rows] == [
        ["one at a time", "grpc", "20 / 20"], ["one at a time", "shm", "20 / 20"],
        ["64 at once", "grpc", "64 / 64"], ["64 at once", "shm", "63 / 64"]]
    assert table.rows[1][-1] == "0.40×"  # grpc's p50 / argrpc's
    first, burst = report.connect_targets(CONNECT_DOC)
    assert first.status == "MISS" and "2.50× grpcio's" in first.detail
    assert "allowed 2×" in first.detail
    assert burst.status == "MISS" and "63 / 64 on shm, slowest first call 180 ms" in burst.detail
    assert "TimeoutError: handshake" in burst.detail
    assert report.connect_targets(None) == []
    text = report.terminal_report([], CONNECT_DOC)
    assert "== connection set-up" in text and "MISS" in text


def test_cli_sweep_reaches_only_the_runs(monkeypatch: Any, tmp_path: Path,
                                         capsys: Any) -> None:
    import sys

    calls: list[Any] = []
    monkeypatch.setitem(sys.modules, "argrpc_bench.runner", _fake_runner(calls))
    import argrpc_bench as pkg
    monkeypatch.setattr(pkg, "runner", sys.modules["argrpc_bench.runner"], raising=False)
    monkeypatch.delenv("TF_RDMA_ACC_SIZE", raising=False)
    before = dict(os.environ)
    rc = cli.main(["bandwidth", "--sizes", "4M,64M", "--mode", "raw", "--iterations", "3",
                   "--sweep", "TF_RDMA_ACC_SIZE=4K,16K", "--sweep", "TF_RDMA_SPIN_US=0,50",
                   "--out", str(tmp_path / "o")])
    assert rc == 0
    assert dict(os.environ) == before
    assert all("TF_RDMA_ACC_SIZE" not in env for _, env in calls)
    assert [c[0].env for c in calls] == [
        {"TF_RDMA_ACC_SIZE": "4K", "TF_RDMA_SPIN_US": "0"},
        {"TF_RDMA_ACC_SIZE": "4K", "TF_RDMA_SPIN_US": "50"},
        {"TF_RDMA_ACC_SIZE": "16K", "TF_RDMA_SPIN_US": "0"},
        {"TF_RDMA_ACC_SIZE": "16K", "TF_RDMA_SPIN_US": "50"}]
    spec = calls[0][0]
    assert spec.sizes == [4 * MiB, 64 * MiB] and spec.iterations == 3
    assert spec.duration is None and spec.transports == ["grpc", "shm", "verbs"]
    out = capsys.readouterr().out
    assert "sweep" in out and "ACC_SIZE=16K, SPIN_US=50" in out
    assert "PASS" in out and "30.0×" in out
    doc = json.loads((tmp_path / "o" / "results.json").read_text())
    assert doc["schema"] == SCHEMA
    envs = {tuple(sorted(m["env"].items())) for m in doc["measurements"] if not m["skipped"]}
    assert len(envs) == 4
    assert (tmp_path / "o" / "results.md").exists()
    assert (tmp_path / "o" / "bandwidth.png").exists()
    assert str(tmp_path / "o" / "bandwidth.png") in out


def test_cli_all_quick_plan_and_failures(monkeypatch: Any, tmp_path: Path, capsys: Any,
                                         fake_connect: list[tuple[int, int]]) -> None:
    import sys

    calls: list[Any] = []
    monkeypatch.setitem(sys.modules, "argrpc_bench.runner",
                        _fake_runner(calls, fail_mode="serialized"))
    import argrpc_bench as pkg
    monkeypatch.setattr(pkg, "runner", sys.modules["argrpc_bench.runner"], raising=False)
    rc = cli.main(["all", "--quick", "--no-plots", "--out", str(tmp_path),
                   "--json", str(tmp_path / "x.json")])
    assert rc == 1                                    # the serialized runs failed ...
    specs = [c[0] for c in calls]
    # latency's cell of 64 client processes: --quick measures it in the raw mode only
    many = [s for s in specs if s.clients > 1]
    assert [(s.benchmark, s.mode, s.clients, s.sizes) for s in many] == [
        ("latency", "raw", 64, [64])]
    specs = [s for s in specs if s.clients == 1]
    assert [(s.benchmark, s.mode) for s in specs] == [
        (b, m) for b in ("latency", "bandwidth", "ps") for m in ("raw", "serialized")]
    assert 64 in specs[0].sizes and 64 * MiB in specs[2].sizes and 4 * MiB in specs[3].sizes
    assert specs[4].scheme == "skew" and specs[0].scheme == "uniform"
    out = capsys.readouterr().out
    assert "errors:" in out and "server did not start" in out
    assert "== latency" in out                        # ... and the raw ones are reported
    doc = json.loads((tmp_path / "x.json").read_text())
    assert doc["meta"]["quick"] is True and len(doc["meta"]["errors"]) == 3
    # connection set-up: 20 processes under --quick, then 64 at once; in the JSON too
    assert fake_connect == [(20, 64)] and doc["meta"]["connect"] == CONNECT_DOC
    assert "== connection set-up" in out
    assert any(t["target"].startswith("first call") for t in doc["meta"]["targets"])
    assert not list(tmp_path.glob("*.png"))


# --------------------------------------------------------------------------- asyncio API

def aio(m: Measurement, concurrency: int = 1) -> Measurement:
    return dataclasses.replace(m, api="aio", concurrency=concurrency)


@pytest.fixture()
def aio_sample() -> list[Measurement]:
    """Both APIs in one run: threaded shm 8 µs, argrpc.aio 10 µs (1.25× threaded, within
    1.5×) and 20× below grpc.aio (short of 30×); 64 in flight 12× grpc.aio's RPC/s."""
    def many(t: str, rate: float) -> Measurement:
        return aio(dataclasses.replace(lat(t, 64, 900.0, 2000.0), rpcs_per_s=rate), 64)

    return [
        lat("grpc", 64, 200.0, 400.0), lat("shm", 64, 8.0, 50.0),
        aio(lat("grpc", 64, 200.0, 400.0)), aio(lat("shm", 64, 10.0, 20.0)),
        aio(skipped("latency", 64)),
        many("grpc", 1000.0), many("shm", 12000.0),
        aio(bw("grpc", 64 * MiB, 0.5)), aio(bw("shm", 64 * MiB, 20.0)),
    ]


def test_aio_rows_are_compared_with_grpc_aio(aio_sample: list[Measurement]) -> None:
    table = report.benchmark_table(aio_sample, "latency", "aio")
    assert table.headers[4:6] == ["in flight", "transport"]
    assert table.headers[-1] == "RPC/s vs grpc"
    shm = [r for r in table.rows if r[5] == "shm"]
    assert [r[4] for r in shm] == ["1", "64"]          # ping-pong first, then in flight
    assert shm[0][-3:] == ["20.0×", "20.0×", "20.0×"]  # vs grpc.aio, not threaded grpc
    assert shm[1][-1] == "12.0×"                      # 12000 / 1000 RPC/s
    assert any("skipped: no RDMA device" in c for r in table.rows for c in r)
    # the threaded table is the one it always was: no aio rows, no extra columns
    threaded = report.benchmark_table(aio_sample, "latency")
    assert "in flight" not in threaded.headers and len(threaded.rows) == 2
    assert report.benchmark_table(aio_sample, "bandwidth", "aio").rows[1][-1] == "40.0×"


def test_aio_vs_threaded_table(aio_sample: list[Measurement]) -> None:
    table = report.api_table(aio_sample, "latency")
    assert table is not None
    assert table.headers[-3:] == ["threaded p50 µs", "aio p50 µs", "aio / threaded"]
    by = {r[4]: r for r in table.rows}
    assert by["shm"][-3:] == ["8.00", "10.0", "1.25×"]
    assert by["grpc"][-1] == "1.00×"
    assert report.api_table(aio_sample, "bandwidth") is None  # no threaded bandwidth
    only_aio = [m for m in aio_sample if m.api == "aio"]
    assert report.api_table(only_aio, "latency") is None


def test_aio_targets(aio_sample: list[Measurement]) -> None:
    res = [r for r in report.evaluate_targets(aio_sample) if r.target.api == "aio"]
    by = {r.target.text.split(" at ")[0]: r for r in res}
    p50 = by["asyncio: p50"]
    assert p50.status == "MISS" and p50.ratio == pytest.approx(20.0)
    assert "short by 1.50×" in p50.detail
    assert by["asyncio: p99"].status == "PASS"          # 400 / 20 = 20× ≥ 15×
    many = by["asyncio: 64 calls in flight"]
    assert many.status == "PASS" and many.ratio == pytest.approx(12.0)
    assert "64 in flight" in many.where
    assert by["asyncio: raw bandwidth"].status == "PASS"
    within = by["asyncio: argrpc.aio p50"]
    assert within.status == "PASS" and "aio p50 = 1.25× threaded" in within.detail
    assert within.to_dict()["versus"] == "threaded"
    text = report.terminal_report(aio_sample)
    assert "== latency, asyncio API" in text and "== latency: asyncio vs threaded" in text
    assert "== asyncio targets" in text and "== speed targets" in text
    assert text.index("== speed targets") < text.index("== asyncio targets")


def test_aio_targets_need_their_runs(aio_sample: list[Measurement]) -> None:
    threaded = [m for m in aio_sample if m.api == "threaded"]
    assert all(r.target.api == "threaded" for r in report.evaluate_targets(threaded))
    assert "asyncio" not in report.terminal_report(threaded)
    only_aio = [m for m in aio_sample if m.api == "aio"]
    texts = [r.target.text for r in report.evaluate_targets(only_aio)]
    assert texts and all(t.startswith("asyncio:") for t in texts)
    assert not any("threaded" in t for t in texts)  # needs both APIs in the run
    slow = [aio(lat("grpc", 64, 200.0, 400.0)), aio(lat("shm", 64, 24.0, 30.0)),
            lat("grpc", 64, 200.0, 400.0), lat("shm", 64, 8.0, 50.0)]
    within = next(r for r in report.evaluate_targets(slow) if r.target.versus == "threaded")
    assert within.status == "MISS" and "3.00× threaded" in within.detail
    assert "over by 2.00×" in within.detail
    res = report.evaluate_targets([aio(lat("grpc", 64, 1.0, 1.0)), aio(lat("shm", 64, 1.0, 1.0))])
    many = next(r for r in res if "in flight" in r.target.text)
    assert many.status == "not measured" and "--concurrency 64" in many.detail


def test_aio_markdown_and_json(aio_sample: list[Measurement], tmp_path: Path) -> None:
    md = report.markdown_report(aio_sample, collect_meta(["latency", "--api", "both"]))
    assert "## latency, asyncio API" in md and "## latency: asyncio vs threaded API" in md
    assert "| raw | uniform | 64 B | 1 | 64 | shm |" in md
    assert "## Asyncio targets" in md
    for block in md.split("\n\n"):
        rows = [ln for ln in block.splitlines() if ln.startswith("|")]
        if rows:
            assert len({r.count(" | ") for r in rows if not r.startswith("|:")}) == 1, block
    path = tmp_path / "r.json"
    report.write_json(str(path), aio_sample, {})
    back, _ = from_json(json.loads(path.read_text()))
    assert back == aio_sample
    # a file written before the asyncio API existed loads as threaded, one call in flight
    old = to_json([lat("shm", 64, 1.0, 2.0)], {})
    for m in old["measurements"]:
        del m["api"], m["concurrency"]
    (m,), _ = from_json(old)
    assert (m.api, m.concurrency) == ("threaded", 1)


def test_aio_plots(aio_sample: list[Measurement], tmp_path: Path) -> None:
    paths = write_plots(aio_sample, str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["latency.png", "bandwidth.png"]


def test_cli_parses_apis() -> None:
    assert cli.parse_apis("threaded") == ["threaded"]
    assert cli.parse_apis("both") == cli.parse_apis("aio,threaded") == ["threaded", "aio"]
    a = cli.build_parser().parse_args(["latency"])
    assert a.api == ["threaded"] and a.concurrency is None  # per API: 16 threads, 64 tasks


@pytest.mark.parametrize("argv", [
    ["--api", "trio"], ["--api", ""], ["latency", "--api", "aio", "--concurrency", "0"],
    ["ps", "--api", "aio"], ["latency", "--loop", "uvloop"], ["latency", "--loop", "trio"]])
def test_cli_rejects_bad_api_arguments(argv: list[str], capsys: Any) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert "argrpc-bench: error:" in capsys.readouterr().err


def test_cli_plans_both_apis_side_by_side(monkeypatch: Any, tmp_path: Path, capsys: Any,
                                          fake_connect: list[tuple[int, int]]) -> None:
    import sys

    calls: list[Any] = []
    monkeypatch.setitem(sys.modules, "argrpc_bench.runner", _fake_runner(calls))
    import argrpc_bench as pkg
    monkeypatch.setattr(pkg, "runner", sys.modules["argrpc_bench.runner"], raising=False)
    rc = cli.main(["all", "--quick", "--api", "both", "--concurrency", "8", "--no-plots",
                   "--out", str(tmp_path)])
    assert rc == 0
    specs = [c[0] for c in calls if c[0].clients == 1]
    assert [(s.benchmark, s.mode, s.api) for s in specs] == [
        (b, m, api) for b in ("latency", "bandwidth") for m in ("raw", "serialized")
        for api in ("threaded", "aio")] + [("ps", m, "threaded") for m in ("raw", "serialized")]
    assert {s.concurrency for s in specs if s.api == "aio"} == {8}
    assert {s.concurrency for s in specs if s.api == "threaded"} == {8, 1}  # 1: not latency
    assert {s.references for s in specs} == {True, False}  # the floor: threaded, not ps
    assert all(s.references == (s.api == "threaded") for s in specs if s.benchmark != "ps")
    calls.clear()
    assert cli.main(["all", "--quick", "--api", "aio", "--no-plots", "--out", str(tmp_path)]) == 0
    assert fake_connect == [(20, 64)]  # set-up is a threaded-API measure: not again
    assert {(c[0].benchmark, c[0].api) for c in calls} == {("latency", "aio"),
                                                           ("bandwidth", "aio")}
    out = capsys.readouterr().out
    assert "== latency, asyncio API" in out and "== asyncio targets" in out


# --------------------------------------------------------------------------- the floor

def test_floor_columns_and_targets() -> None:
    ms = [lat("grpc", 64, 400.0, 800.0), lat("shm", 64, 9.0, 30.0), lat("floor", 64, 3.0, 6.0),
          lat("grpc", 64, 400.0, 800.0, mode="serialized"),
          lat("shm", 64, 4.0, 12.0, mode="serialized"),
          lat("floor", 64, 3.0, 6.0, mode="serialized")]
    table = report.benchmark_table(ms, "latency")
    assert table.headers[-2:] == ["p50 / floor", "p99 / floor"]
    shm_raw = next(r for r in table.rows if r[0] == "raw" and r[4] == "shm")
    assert shm_raw[-2:] == ["3.00×", "5.00×"]
    floor_row = next(r for r in table.rows if r[4] == "floor")
    assert floor_row[-2:] == ["–", "–"]  # the floor is not compared with itself
    res = [r for r in report.evaluate_targets(ms) if r.target.versus == "floor"]
    by = {(r.target.metric, r.where.split(",")[0]): r for r in res}
    # the p50 bound is information now (the gap is the Python call path), the p99 a goal
    assert by[("p50_us", "raw")].status == "INFO"       # 3× the floor, once 1.5×
    assert by[("p50_us", "raw")].detail.startswith(
        "p50 = 3.00× the floor's (once a goal of at most 1.5×; ")
    assert by[("p99_us", "raw")].status == "MISS"       # 5× the floor, 3× allowed
    assert by[("p50_us", "serialized")].status == "INFO"  # 1.33×
    assert by[("p99_us", "serialized")].status == "PASS"  # 2×
    assert "floor = argrpc's shm ring" in report.terminal_report(ms)


def test_floor_targets_need_a_floor_row() -> None:
    ms = [lat("grpc", 64, 400.0, 800.0), lat("shm", 64, 9.0, 30.0)]
    assert not [r for r in report.evaluate_targets(ms) if r.target.versus == "floor"]
    assert "p50 / floor" not in report.benchmark_table(ms, "latency").headers
    gone = dataclasses.replace(lat("floor", 64, 3.0, 6.0), skipped=True, note="no engine",
                               p50_us=None, p99_us=None)
    res = [r for r in report.evaluate_targets([*ms, gone]) if r.target.versus == "floor"]
    assert {r.status for r in res} == {"no data"}
    assert all("floor row missing or skipped" in r.detail for r in res)


def test_memcpy_rows_bound_bandwidth() -> None:
    ms = [bw("grpc", 64 * MiB, 0.4), bw("shm", 64 * MiB, 6.0), bw("memcpy-1t", 64 * MiB, 9.0),
          bw("memcpy-2t", 64 * MiB, 12.0)]
    table = report.benchmark_table(ms, "bandwidth")
    assert table.headers[-1] == "memcpy / GB/s"
    shm = next(r for r in table.rows if r[4] == "shm")
    assert shm[-1] == "2.00×"  # the faster copy (two threads) over shm's GB/s


def test_threads_in_flight_target() -> None:
    def rate(transport: str, rps: float) -> Measurement:
        return dataclasses.replace(lat(transport, 64, 100.0, 200.0), rpcs_per_s=rps,
                                   concurrency=16)
    ms = [lat("grpc", 64, 400.0, 800.0), lat("shm", 64, 9.0, 30.0),
          rate("grpc", 4000.0), rate("shm", 50000.0)]
    res = [r for r in report.evaluate_targets(ms) if r.target.concurrency == 16]
    assert [r.status for r in res] == ["MISS"] and "12.5×" in res[0].detail
    table = report.benchmark_table(ms, "latency")
    assert "in flight" in table.headers and "RPC/s vs grpc" in table.headers


def test_cli_connect_alone_and_when_it_is_left_out(monkeypatch: Any, tmp_path: Path,
                                                   capsys: Any,
                                                   fake_connect: list[tuple[int, int]]) -> None:
    import sys

    calls: list[Any] = []
    monkeypatch.setitem(sys.modules, "argrpc_bench.runner", _fake_runner(calls))
    assert cli.main(["connect", "--processes", "3", "--burst", "2", "--no-plots",
                     "--out", str(tmp_path)]) == 0
    assert fake_connect == [(3, 2)] and calls == []  # set-up only: no benchmark planned
    assert "first call on a new channel" in capsys.readouterr().out
    assert cli.main(["connect", "--transports", "grpc", "--no-plots",
                     "--out", str(tmp_path)]) == 0
    assert fake_connect == [(3, 2)]
    assert "connection set-up not measured: it compares grpc with shm" in \
        capsys.readouterr().err
