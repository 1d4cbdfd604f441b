"""argrpc-bench against a server it did not start (``--remote``, ``RunSpec.remote``) and
the server on its own (``argrpc-bench serve``): option parsing and its errors, and real
runs against a server started separately on 127.0.0.1 (grpc; shm where available, which
an argrpc client picks by itself on one host). A few calls of a tiny payload each; nothing
is timing-asserted."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator

import pytest

from argrpc_bench import cli, runner
from argrpc_bench.results import Measurement
from argrpc_bench.runner import RunSpec

AVAILABLE = runner.available_transports()
ROOT = Path(__file__).resolve().parents[1]
KNOB, VALUE = "TF_RDMA_ACC_SIZE", "16K"


def tiny(benchmark: str, transports: list[str], remote: dict[str, str],
         **kw: Any) -> RunSpec:
    return RunSpec(benchmark=benchmark, transports=transports, mode="raw", sizes=[64, 4096],
                   warmup=1, iterations=5, repeats=1, timeout=120.0, remote=remote, **kw)


@pytest.fixture
def servers() -> Iterator[dict[str, Any]]:
    """A grpc and an argrpc benchmark server on free ports of 127.0.0.1, started as a
    remote host would (not by the run under test); stopped at the end."""
    with ExitStack() as procs:
        env = dict(os.environ)
        env.pop("TF_RDMA_TRANSPORT", None)  # the argrpc server must choose by itself
        grpc_server, grpc_port = runner.start_server(
            procs, "grpc server", "argrpc_bench.server", ["--stack", "grpc"], env)
        out: dict[str, Any] = {"grpc": f"127.0.0.1:{grpc_port}", "procs": [grpc_server]}
        if not AVAILABLE["shm"]:
            argrpc_server, argrpc_port = runner.start_server(
                procs, "argrpc server", "argrpc_bench.server", ["--stack", "argrpc"],
                env)
            out["argrpc"] = f"127.0.0.1:{argrpc_port}"
            out["procs"].append(argrpc_server)
        yield out
        for p in out["procs"]:
            p.close()


def _no_local_server(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: Any, **kw: Any) -> Any:
        raise AssertionError("a remote run started a server of its own")
    monkeypatch.setattr(runner, "start_server", refuse)


# --------------------------------------------------------------------- real runs

def test_remote_grpc_run_measures_against_the_given_server(
        servers: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    _no_local_server(monkeypatch)
    got = runner.run(tiny("latency", ["grpc"], {"grpc": servers["grpc"]}))
    assert [(m.transport, m.size, m.skipped) for m in got] == [("grpc", 64, False),
                                                               ("grpc", 4096, False)]
    assert all(m.iterations == 5 and m.p50_us and m.p50_us > 0 for m in got)
    got = runner.run(tiny("bandwidth", ["grpc"], {"grpc": servers["grpc"]}))
    assert len(got) == 2 and all(m.gbps and m.gbps > 0 for m in got)
    # the run left the server it did not start alone
    assert all(p.proc.poll() is None for p in servers["procs"])


@pytest.mark.skipif(bool(AVAILABLE["shm"]), reason=AVAILABLE["shm"] or "shm available")
def test_remote_argrpc_server_is_reached_on_the_transport_argrpc_picks(
        servers: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TF_RDMA_TRANSPORT", raising=False)
    _no_local_server(monkeypatch)
    # one host: argrpc's own choice is shm, with no TF_RDMA_TRANSPORT from the runner
    assert "TF_RDMA_TRANSPORT" not in runner.transport_env(
        runner.normalize(tiny("latency", ["shm"], {"shm": servers["argrpc"]})), "shm")
    got = runner.run(tiny("latency", ["grpc", "shm"],
                          {"grpc": servers["grpc"], "shm": servers["argrpc"]}))
    assert [m.transport for m in got] == ["grpc", "grpc", "shm", "shm"]
    assert not any(m.skipped for m in got)


def _failed(got: list[Measurement], transport: str, cause: str) -> None:
    """``got`` has ``transport``'s two rows, failed and saying ``cause`` (a regex)."""
    rows = [m for m in got if m.transport == transport]
    assert [m.size for m in rows] == [64, 4096]
    for m in rows:
        assert m.skipped and m.failed and m.p50_us is None and m.gbps is None
        assert re.match(f"not measured: .*{cause}", m.note), m.note


@pytest.mark.skipif(bool(AVAILABLE["shm"]), reason=AVAILABLE["shm"] or "shm available")
def test_remote_argrpc_client_on_a_grpc_server_is_a_failed_row_saying_why(
        servers: dict[str, Any]) -> None:
    # the shm client reaches a plain grpc server, measured for real beside it as grpc
    logged: list[str] = []
    got = runner.run(tiny("latency", ["shm", "grpc"],
                          {"shm": servers["grpc"], "grpc": servers["grpc"]}),
                     log=logged.append)
    _failed(got, "shm", "channel transport is 'grpc', not 'shm'")
    assert all(not m.skipped and m.p50_us for m in got if m.transport == "grpc")
    assert len(logged) == 1 and logged[0].startswith("shm not measured: shm (server ")
    assert all(p.proc.poll() is None for p in servers["procs"])  # not the run's to stop


def test_remote_server_without_the_specs_knob_is_refused(servers: dict[str, Any]) -> None:
    # the fixture's server was started without KNOB: the numbers would not be the spec's
    got = runner.run(tiny("latency", ["grpc"], {"grpc": servers["grpc"]}, env={KNOB: VALUE}),
                     log=lambda text: None)
    _failed(got, "grpc", f"server process has .*{KNOB}")


def test_remote_target_nobody_serves_fails_at_once_saying_so() -> None:
    started = time.monotonic()
    got = runner.run(tiny("latency", ["grpc"], {"grpc": "127.0.0.1:1"}),
                     log=lambda text: None)
    _failed(got, "grpc", "remote grpc server at 127.0.0.1:1 does not answer")
    assert time.monotonic() - started < 30


def _serve(*args: str) -> tuple[subprocess.Popen[str], int]:
    """``argrpc-bench serve`` in the background, as on a remote host: its port."""
    proc = subprocess.Popen([sys.executable, "-m", "argrpc_bench", "serve", *args],
                            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "PORT n", or EOF if it failed
    if not line.startswith("PORT "):
        proc.kill()
        raise AssertionError(f"serve printed {line!r}; stderr: {proc.communicate()[1]}")
    return proc, int(line.split()[1])


def test_cli_serve_then_remote_run_end_to_end(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    # stdin is /dev/null: --until signal (serve's default) must not stop at its EOF
    proc, port = _serve("--stack", "grpc", "--host", "127.0.0.1", "--port", "0")
    try:
        rc = cli.main(["latency", "--mode", "raw", "--sizes", "64", "--iterations", "5",
                       "--warmup", "1", "--repeats", "1", "--remote",
                       f"grpc=127.0.0.1:{port}", "--no-plots", "--out", str(tmp_path)])
        assert rc == 0
        captured = capsys.readouterr()
        assert f"grpc measured against the server at 127.0.0.1:{port}" in captured.err
        doc = json.loads((tmp_path / "results.json").read_text())
        # the ping-pong and 16 client threads; no floor (it says nothing of a remote peer)
        assert [(m["transport"], m["skipped"], m["concurrency"])
                for m in doc["measurements"]] == [("grpc", False, 1), ("grpc", False, 16)]
        assert doc["meta"]["specs"][0]["remote"] == {"grpc": f"127.0.0.1:{port}"}
        assert proc.poll() is None  # still serving: the run did not own it
    finally:
        proc.send_signal(signal.SIGTERM)
        rc_serve = proc.wait(timeout=30)
    assert rc_serve == 0
    assert "grpc server on 127.0.0.1:0" in proc.communicate()[1]


@pytest.mark.skipif(bool(AVAILABLE["shm"]), reason=AVAILABLE["shm"] or "shm available")
def test_cli_writes_the_grpc_rows_when_the_shm_client_lands_on_grpc(
        servers: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # one bare target for both transports, a plain grpc server: argrpc's client lands on
    # gRPC there, a failure of the shm rows only; the grpc ones are measured and written
    rc = cli.main(["latency", "--mode", "raw", "--sizes", "64", "--iterations", "5",
                   "--warmup", "1", "--repeats", "1", "--concurrency", "1",
                   "--transports", "grpc,shm", "--remote", servers["grpc"], "--no-plots",
                   "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1
    doc = json.loads((tmp_path / "results.json").read_text())
    rows = {m["transport"]: m for m in doc["measurements"]}
    assert sorted(rows) == ["grpc", "shm"] and len(doc["measurements"]) == 2
    assert not rows["grpc"]["skipped"] and rows["grpc"]["p50_us"] > 0
    assert rows["shm"]["failed"] and "not 'shm'" in rows["shm"]["note"]
    (error,) = doc["meta"]["errors"]
    assert "shm not measured: " in error and "not 'shm'" in error and error in out
    assert all(p.proc.poll() is None for p in servers["procs"])


def test_server_until_stdin_is_the_default_of_the_module() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "argrpc_bench.server", "--stack",
                             "grpc"], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().startswith("PORT ")
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0


# --------------------------------------------------------------------- parsing

def test_parse_remote() -> None:
    assert cli.parse_remote("verbs=192.0.2.2:50062") == ("verbs", "192.0.2.2:50062")
    assert cli.parse_remote("hostb:50061") == (None, "hostb:50061")
    assert cli.parse_remote("grpc=[::1]:9") == ("grpc", "[::1]:9")
    assert cli.remote_targets([("grpc", "b:1"), (None, "b:2")], ["grpc", "verbs"]) == \
        {"grpc": "b:1", "verbs": "b:2"}
    assert runner.split_target("[fe80::1]:443") == ("[fe80::1]", 443)


@pytest.mark.parametrize("argv, message", [
    (["--remote", "nohost"], "is not HOST:PORT"),
    (["--remote", "b:port"], "is not a number"),
    (["--remote", "b:0"], "out of range"),
    (["--remote", "b:70000"], "out of range"),
    (["--remote", "::1:50051"], "in brackets"),
    (["--remote", "tcp=b:1"], "unknown transport 'tcp'"),
    (["--remote", "b:1"], "say which transport"),
    (["--remote", "grpc=b:1", "--remote", "grpc=b:2"], "two servers for grpc"),
    (["--remote", "b:1", "--remote", "b:2", "--transports", "grpc"], "two servers without"),
    (["--remote", "grpc=b:1", "--transports", "grpc,verbs"], "no server for verbs"),
    (["--remote", "verbs=b:1", "--transports", "grpc", "--remote", "grpc=b:2"],
     "server given for verbs"),
    (["--remote", "grpc=b:1", "--api", "aio"], "threaded API only"),
    (["--remote", "grpc=b:1", "--sweep", "TF_RDMA_ACC_SIZE=4K,8K"], "--sweep"),
])
def test_cli_rejects_bad_remote_arguments(argv: list[str], message: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["latency", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argrpc-bench: error:" in err and message in err, err


# (not "benchmark": pytest-benchmark owns that fixture name)
@pytest.mark.parametrize("kind", ["ps", "all"])
def test_cli_remote_is_for_point_to_point_only(kind: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main([kind, "--remote", "grpc=b:1"])
    assert e.value.code == 2
    assert "latency or bandwidth only" in capsys.readouterr().err


def test_cli_remote_plans_the_named_transports() -> None:
    p = cli.build_parser()
    a = p.parse_args(["bandwidth", "--remote", "grpc=b:1", "--remote", "verbs=b:2"])
    cli._check_args(p, a)
    assert a.transports == ["grpc", "verbs"]
    (spec, *rest) = cli.plan(a)
    assert spec.remote == {"grpc": "b:1", "verbs": "b:2"}
    assert all(s.remote == spec.remote for s in rest)
    a = p.parse_args(["latency", "--remote", "b:9", "--transports", "verbs"])
    cli._check_args(p, a)
    assert a.remote == {"verbs": "b:9"}
    a = p.parse_args(["latency"])  # without --remote nothing changes
    cli._check_args(p, a)
    assert a.remote == {} and a.transports == ["grpc", "shm", "verbs"]
    assert all(s.remote == {} for s in cli.plan(a))


def test_cli_help_documents_remote_and_serve(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "--remote [TRANSPORT=]HOST:PORT" in out and "argrpc-bench serve" in out
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--stack" in out and "--port" in out and "SIGTERM" in out


@pytest.mark.parametrize("argv", [[], ["--stack", "tcp"], ["--stack", "grpc", "--port", "x"],
                                  ["--stack", "grpc", "--port", "70000"]])
def test_cli_serve_rejects_bad_arguments(argv: list[str],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", *argv])
    assert e.value.code == 2
    assert "argrpc-bench serve: error:" in capsys.readouterr().err


@pytest.mark.parametrize("kw, message", [
    (dict(benchmark="ps", remote={"grpc": "b:1"}), "ps benchmark"),
    (dict(api="aio", remote={"grpc": "b:1"}), "threaded API"),
    (dict(remote={"grpc": "b:1"}, transports=["grpc", "shm"]), "none for \\['shm'\\]"),
    (dict(remote={"grpc": "b:1", "verbs": "b:2"}), "does not measure"),
    (dict(remote={"grpc": "b"}), "not HOST:PORT"),
    (dict(remote={"tcp": "b:1"}), "unknown transport"),
])
def test_runner_checks_remote_specs(kw: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = dict(benchmark="latency", transports=["grpc"])
    base.update(kw)
    with pytest.raises(ValueError, match=message):
        runner.normalize(RunSpec(**base))


# ----------------------------------------------------------- bench/across_hosts.py

def _across_hosts() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("across_hosts",
                                                  ROOT / "bench" / "across_hosts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_across_hosts_outside_a_pair_says_how_to_run_it() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RXE_")}
    done = subprocess.run([sys.executable, "bench/across_hosts.py", "run"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "not host A of a two-host pair" in done.stderr
    assert "softroce/pair.sh" in done.stderr


def test_across_hosts_report_judges_medians_and_shows_failures(tmp_path: Path) -> None:
    ah = _across_hosts()
    M = 1 << 20

    def rep(ib: float, verbs: float, grpc: float, rtt: float, v_lat: float,
            errors: dict[str, str]) -> dict[str, Any]:
        bw = {str(s): {"gbps": x} for s, x in ((4 * M, verbs), (64 * M, verbs / 2))}
        return {"ib_write_bw_gbps": {str(4 * M): ib, str(64 * M): ib},
                "ib_write_lat": {"rtt_us": rtt},
                "bw": {"verbs": bw, "grpc": {str(4 * M): {"gbps": grpc},
                                             str(64 * M): {"gbps": grpc}}},
                "lat": {"verbs": {"p50_us": v_lat}, "shm": {"p50_us": 100.0},
                        "grpc": {"p50_us": 5000.0}},
                "errors": errors,
                "rxe": {"verbs bandwidth 67108864": {"a": {"duplicate_request": 2},
                                                     "b": {"completer_retry_err": 3}}}}

    doc = {"device": "rxe0", "peer": "192.0.2.2", "bw_sizes": [4 * M, 64 * M],
           "lat_size": 64, "reps": [rep(0.03, 0.03, 0.01, 500, 900, {}),
                                    rep(0.03, 0.027, 0.01, 500, 1200, {}),
                                    rep(0.03, 0.036, 0.01, 500, 1000,
                                        {"shm latency": "BenchError: boom"})]}
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(doc))
    done = subprocess.run([sys.executable, "bench/across_hosts.py", "run", "--report",
                           str(path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "PASS  bandwidth 4 MiB: argrpc-verbs / ib_write_bw = 100%" in out
    assert "MISS  bandwidth 64 MiB: argrpc-verbs / ib_write_bw = 50%" in out
    assert "PASS  bandwidth 4 MiB: argrpc-verbs / grpc = 3.00×" in out
    # 2 × 500 + 100 = 1100 µs: p50 900, 1200 and 1000 → median 1000 / 1100
    assert "PASS  latency 64 B: argrpc-verbs p50 / (2 × RTT + shm p50) = 0.91" in out
    assert "FAILED rep 3: shm latency: BenchError: boom" in out
    assert "| verbs bandwidth 64 MiB | 9 | 6 |" in out  # summed over reps and hosts
    assert ah.report(doc) == out.rstrip("\n")


def test_across_hosts_parses_perftest_rows() -> None:
    ah = _across_hosts()
    bw = (" #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n"
          " 4194304    32               33.10              33.08                0.000008\n")
    assert abs(ah.parse_bw(bw, 4194304) - 33.08 * (1 << 20) / 1e9) < 1e-12
    lat = (" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    "
           "t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]\n"
           " 64       1000          189.32         3735.46      295.74             "
           "469.66        420.10          2773.34              3600.00\n")
    got = ah.parse_lat(lat, 64)
    assert got["rtt_us"] == 2 * 295.74 and got["p99_us"] == 2773.34
