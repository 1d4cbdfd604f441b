"""argrpc-bench peers: the other libraries' rows beside argrpc's, one definition of a round
trip, a peer that is missing or fails is a skipped row with the reason."""
from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from argrpc_bench import peers, runner
from argrpc_bench.results import Measurement

SPEC = runner.RunSpec(benchmark="latency", transports=["grpc", "shm"], sizes=[64],
                      iterations=50, repeats=1)


def _row(peer: str, size: int, **kw: Any) -> Measurement:
    return runner._base(SPEC, peer, size, 1, **kw)


def test_a_peer_that_is_not_installed_is_a_skipped_row_saying_how_to_get_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    rows = peers.run_peers(["torch-rpc"], [64, 4096], ["--iterations", "5"], 10.0, _row)
    assert [(m.transport, m.size, m.skipped) for m in rows] == [
        ("torch-rpc", 64, True), ("torch-rpc", 4096, True)]
    assert all(m.note.startswith("torch is not installed (pip install torch") for m in rows)


def test_the_table_puts_each_row_against_argrpc_over_shared_memory() -> None:
    rows = [_row("shm", 64, p50_us=10.0, p99_us=20.0),
            _row("nixl-none", 64, p50_us=5.0, p99_us=40.0),
            _row("ucxx", 64, note="ucxx is not installed", skipped=True)]
    text = peers.table(rows).splitlines()
    assert text[1].split()[:4] == ["shm", "64", "10.0", "20.0"]
    nixl = next(line for line in text if line.startswith("nixl-none"))
    assert nixl.split()[-2:] == ["0.50×", "2.00×"]  # faster at p50, slower at p99
    assert "skipped: ucxx is not installed" in text[-1]


def _round_trips_every_size(peer: str) -> None:
    rows = peers.run_peers([peer], [0, 64, 1 << 20], ["--iterations", "50"], 60.0, _row)
    assert [m.size for m in rows] == [0, 64, 1 << 20]
    for m in rows:
        assert not m.skipped, m.note
        assert m.p50_us is not None and 0 < m.p50_us <= (m.p99_us or 0)


@pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None,
                    reason="NIXL is not installed (pip install --no-deps nixl-cu12)")
def test_nixl_round_trips_every_size() -> None:
    _round_trips_every_size("nixl-none")


@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None,
                    reason="ucxx is not installed (pip install ucxx-cu12)")
@pytest.mark.parametrize("peer", ["ucxx-none", "ucxx-peer"])
def test_ucxx_round_trips_every_size(peer: str) -> None:
    _round_trips_every_size(peer)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="PyTorch is not installed (pip install torch; its CPU build)")
def test_torch_rpc_round_trips_every_size() -> None:
    _round_trips_every_size("torch-rpc")


def test_the_rounds_table_pairs_each_row_with_the_reference_of_its_own_round() -> None:
    # NIXL is faster than shm in a quiet round and slower in a loud one: the medians of
    # the per-round ratios, and the count of rounds at or below, say so; a round in which
    # a row was skipped does not count for it.
    quiet = [_row("shm", 64, p50_us=10.0, p99_us=20.0),
             _row("nixl-none", 64, p50_us=5.0, p99_us=40.0)]
    loud = [_row("shm", 64, p50_us=20.0, p99_us=30.0),
            _row("nixl-none", 64, p50_us=30.0, p99_us=33.0)]
    gone = [_row("shm", 64, p50_us=8.0, p99_us=16.0),
            _row("nixl-none", 64, note="not measured: it hung", skipped=True)]
    text = peers.rounds_table([quiet, loud, gone]).splitlines()
    assert text[0].startswith("over 3 rounds; ratios and counts against shm")
    shm = next(line for line in text if line.startswith("shm")).split()
    nixl = next(line for line in text if line.startswith("nixl-none")).split()
    assert shm[2:] == ["10.0", "20.0", "1.00×", "1.00×", "3/3", "3/3"]
    # p50: 0.5× and 1.5× (median 1.00×), one round of two at or below; p99: 2.0× and 1.1×
    assert nixl[2:] == ["17.5", "36.5", "1.00×", "1.55×", "1/2", "0/2"]
    against_nixl = peers.rounds_table([quiet, loud, gone], "nixl-none").splitlines()
    shm = next(line for line in against_nixl if line.startswith("shm")).split()
    assert shm[4:] == ["1.33×", "0.70×", "1/2", "2/2"]  # p99: 0.50× and 0.91×


def test_the_table_can_be_taken_against_a_peer() -> None:
    rows = [_row("shm", 64, p50_us=10.0, p99_us=20.0),
            _row("nixl-none", 64, p50_us=5.0, p99_us=40.0)]
    text = peers.table(rows, "nixl-none").splitlines()
    assert "p50/nixl-none" in text[0]
    assert next(line for line in text if line.startswith("shm")).split()[-2:] == \
        ["2.00×", "0.50×"]


@pytest.mark.parametrize("argv,complaint", [
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--peers", "nixl-none", "--reference", "ucxx-none"], "is not a row of this run"),
])
def test_a_bad_rounds_or_reference_is_refused_by_name(
        argv: list[str], complaint: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        peers.main(argv)
    assert e.value.code == 2
    assert complaint in capsys.readouterr().err
