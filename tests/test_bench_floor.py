"""argrpc-bench's reference rows (argrpc_bench.floor): the latency floor over a bare
shm fabric between two real processes, and the memory-copy rates. What is asserted is
that they move the right bytes, end every wait (a dead peer, a timeout, a message that
does not fit) with an error that says so, and reach the report beside the transports;
never how fast they are."""
from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from argrpc import _config
from argrpc._engine import get_engine
from argrpc_bench import floor, runner
from argrpc_bench.runner import RunSpec

_core = pytest.importorskip("argrpc._core")
if runner.available_transports()["shm"]:
    pytest.skip(f"shm unavailable: {runner.available_transports()['shm']}",
                allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture()
def floor_server():  # type: ignore[no-untyped-def]
    proc = subprocess.Popen([sys.executable, "-m", "argrpc_bench.floor", "serve"],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("PORT "), (line, proc.stderr.read() if proc.stderr else "")
        yield proc, int(line.split()[1])
    finally:
        proc.kill()
        proc.wait(timeout=10)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None:
                f.close()


def _link(pid: int):  # type: ignore[no-untyped-def]
    return floor._link(floor._connect(f"{floor.FLOOR}:{pid}"))


def test_floor_echoes_every_size_byte_exact(floor_server) -> None:  # type: ignore[no-untyped-def]
    _, pid = floor_server
    link, peer = _link(pid)
    assert peer["pid"] == pid and isinstance(peer["env"], dict)
    for size in (0, 1, 64, 4096, 65536, link.max_message):
        payload = os.urandom(size)
        back = bytearray(size)
        link.send(payload)
        assert link.recv_into(back) == size
        assert bytes(back) == payload


def test_floor_refuses_what_does_not_fit(floor_server) -> None:  # type: ignore[no-untyped-def]
    _, pid = floor_server
    link, _ = _link(pid)
    with pytest.raises(_core.CoreError, match="does not fit"):
        link.send(bytes(link.max_message + 1))
    link.send(bytes(100))
    with pytest.raises(_core.CoreError, match="does not fit a 10 B buffer"):
        link.recv_into(bytearray(10))


def test_a_dead_peer_ends_the_wait(floor_server) -> None:  # type: ignore[no-untyped-def]
    proc, pid = floor_server
    link, _ = _link(pid)
    link.send(b"x")
    assert link.recv_into(bytearray(1)) == 1
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    started = time.monotonic()
    with pytest.raises(_core.CoreError, match="peer is gone"):
        link.send(b"y")
        link.recv_into(bytearray(1), 30.0)
    assert time.monotonic() - started < 10  # the hang-up, not the 30 s timeout, ended it


def test_a_silent_peer_times_out() -> None:
    # Both halves in this process: nobody answers, and the wait ends at its timeout.
    cfg = _config.load()
    engine = get_engine(cfg)
    a, b = socket.socketpair()
    ep_a = engine.new_shm_endpoint(_config.conn_config(cfg, -1))
    ep_b = engine.new_shm_endpoint(_config.conn_config(cfg, -1))

    def peer(ep):  # type: ignore[no-untyped-def]
        return {"ring_fd": os.dup(ep.ring_fd),
                "pool_fd": os.dup(engine.pool_fd), "ring_size": ep.ring_size,
                "pool_size": engine.pool_size}
    pa, pb = peer(ep_b), peer(ep_a)
    link_a = engine._attach_floor(ep_a, pa, a.detach(), cfg.spin_us)
    link_b = engine._attach_floor(ep_b, pb, b.detach(), cfg.spin_us)
    started = time.monotonic()
    with pytest.raises(_core.CoreError, match="no message before the timeout"):
        link_a.recv_into(bytearray(8), 0.3)
    assert time.monotonic() - started >= 0.3
    link_b.send(b"12345678")
    back = bytearray(8)
    assert link_a.recv_into(back, 5.0) == 8 and back == b"12345678"
    with pytest.raises(BufferError):
        link_a.recv_into(b"read-only", 1.0)  # a buffer the message cannot be written into


def test_copy_rate_reports_and_checks_its_arguments() -> None:
    r = _core._copy_rate(1 << 20, 2, 0.0, 5)
    assert r["copies"] >= 5
    assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("gbps", "mean_us", "p99_us"))
    with pytest.raises(_core.CoreError, match="threads"):
        _core._copy_rate(1 << 20, 0, 0.0, 1)
    with pytest.raises(_core.CoreError, match="size"):
        _core._copy_rate(0, 1, 0.0, 1)


@pytest.mark.parametrize("kind", ["latency", "bandwidth"])
def test_runner_measures_the_reference_rows_after_the_transports(kind: str) -> None:
    spec = RunSpec(benchmark=kind, transports=["grpc", "shm"], sizes=[64, 4096], warmup=2,
                   iterations=5, repeats=2, references=True, timeout=120.0)
    got = runner.run(spec)
    refs = [m for m in got if m.transport not in ("grpc", "shm")]
    names = floor.REFERENCES[kind]
    assert [m.transport for m in got[:4]] == ["grpc", "grpc", "shm", "shm"]
    assert sorted(m.transport for m in refs) == sorted(n for n in names for _ in range(2))
    for m in refs:
        assert not m.skipped and m.size in (64, 4096) and m.buffers == 1
        assert m.gbps is not None and m.gbps > 0 and m.mean_us is not None and m.mean_us > 0
    if kind == "latency":
        assert all(m.p50_us is not None and m.p50_us <= m.p99_us for m in refs)  # type: ignore[operator]


def test_references_are_left_out_where_they_say_nothing() -> None:
    base = dict(benchmark="latency", transports=["grpc"], references=True)
    assert runner.references_of(RunSpec(**base)) == ("floor",)  # type: ignore[arg-type]
    assert runner.references_of(RunSpec(**{**base, "api": "aio"})) == ()  # type: ignore[arg-type]
    assert runner.references_of(RunSpec(**{**base, "benchmark": "ps"})) == ()  # type: ignore[arg-type]
    assert runner.references_of(RunSpec(**{**base, "remote": {"grpc": "h:1"}})) == ()  # type: ignore[arg-type]
    assert runner.references_of(RunSpec(**{**base, "references": False})) == ()  # type: ignore[arg-type]


def test_reference_rows_are_skipped_with_the_reason_when_argrpc_is_off() -> None:
    got = runner.run(RunSpec(benchmark="latency", transports=["grpc"], sizes=[64], warmup=1,
                             iterations=3, references=True, env={"TF_RDMA_ENABLED": "false"},
                             timeout=120.0))
    (ref,) = [m for m in got if m.transport == "floor"]
    assert ref.skipped and "TF_RDMA_ENABLED" in ref.note and not ref.failed


def test_sizes_beyond_the_ring_skip_only_the_floor_rows() -> None:
    # The floor is one ring write each way: a 2 MiB message cannot have one. The run keeps
    # every transport row and the floor's 64 B row; the floor's 2 MiB row says why.
    spec = RunSpec(benchmark="latency", transports=["shm"], sizes=[64, 2 * 1024 * 1024],
                   warmup=1, iterations=3, references=True, timeout=120.0)
    got = runner.run(spec)
    shm = [m for m in got if m.transport == "shm"]
    assert [(m.size, m.skipped) for m in shm] == [(64, False), (2 * 1024 * 1024, False)]
    floor_rows = {m.size: m for m in got if m.transport == "floor"}
    assert not floor_rows[64].skipped and floor_rows[64].p50_us is not None
    big = floor_rows[2 * 1024 * 1024]
    assert big.skipped and "TF_RDMA_RING_SIZE" in big.note and big.p50_us is None
    assert not big.failed  # a limit of the floor, not a failure of the run


def test_a_reference_that_cannot_run_is_a_failed_row(monkeypatch: pytest.MonkeyPatch) -> None:
    # Whatever stops the reference processes (here: they cannot start), the transports'
    # rows measured before are kept and the reference rows say why they are missing.
    start_server = runner.start_server

    def refuse_the_floor(procs: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "floor server":
            raise runner.BenchError("the floor server did not start")
        return start_server(procs, name, *args, **kwargs)

    monkeypatch.setattr(runner, "start_server", refuse_the_floor)
    logged: list[str] = []
    got = runner.run(RunSpec(benchmark="latency", transports=["grpc"], sizes=[64], warmup=1,
                             iterations=3, references=True, timeout=120.0), log=logged.append)
    (grpc_row,) = [m for m in got if m.transport == "grpc"]
    assert not grpc_row.skipped and not grpc_row.failed and grpc_row.p50_us is not None
    (ref,) = [m for m in got if m.transport == "floor"]
    assert ref.skipped and ref.failed
    assert ref.note == "not measured: the floor server did not start"
    assert logged == ["floor not measured: the floor server did not start"]
