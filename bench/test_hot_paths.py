"""pytest-benchmark benchmarks of the hot paths: unary 64 B, 1 MiB and 64 MiB per transport.

    pytest bench/ --benchmark-only                      # run
    pytest bench/ --benchmark-only --benchmark-autosave # save a baseline
    pytest bench/ --benchmark-only --benchmark-compare  # compare with the last saved run

Not part of the test command (pytest.ini's testpaths is tests/). Each transport's server
is one ``python -m argrpc_bench.server`` process per module, started once; the client is
this process. Two families per (transport, size):

* ``test_unary_protobuf``: a protobuf ``Payload`` echoed (what an unchanged service pays:
  encode + decode on both sides, request and reply);
* ``test_unary_raw``: a numpy buffer sent one way through a buffer serializer, tiny ack
  back (the transport alone).

All grpc cases run before any shm case (the transport is a module-scoped fixture
parameter, and pytest groups by it): argrpc's engine tunes malloc for the whole process
when it starts, which must not flatter the grpc baseline measured in the same process.
The shm fixture refuses to run unless the channel really is on shared memory.
"""
from __future__ import annotations

import os
import sys
from contextlib import ExitStack
from typing import Any, Callable, Iterator

import pytest

# The checkout under test wins over any installed argrpc: regressions are measured on the
# code being edited.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from argrpc_bench import messages as msg  # noqa: E402
from argrpc_bench import runner  # noqa: E402
from argrpc_bench.client import (CALL_TIMEOUT_S, check_transport, fetch_env,  # noqa: E402
                                 make_channel)
from argrpc_bench.server import parse_raw_ack  # noqa: E402

np = pytest.importorskip("numpy")
pytest.importorskip("pytest_benchmark")

SIZES = {"64B": 64, "1MiB": 1 << 20, "64MiB": 64 << 20}
AVAILABLE = runner.available_transports()


class Target:
    def __init__(self, transport: str, channel: Any) -> None:
        self.transport = transport
        self.stack = runner.stack_of(transport)
        self.channel = channel


@pytest.fixture(scope="module", params=["grpc", "shm"])
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    transport: str = request.param
    if AVAILABLE.get(transport):
        pytest.skip(f"{transport} unavailable: {AVAILABLE[transport]}")
    stack = runner.stack_of(transport)
    with ExitStack() as procs:
        _, port = runner.start_server(procs, f"{transport} server", "argrpc_bench.server",
                                      ["--stack", stack], dict(os.environ))
        channel = make_channel(stack, f"127.0.0.1:{port}")
        procs.callback(channel.close)
        fetch_env(channel, msg.SERVICE, msg.ENV)  # settles negotiation
        check_transport(channel, transport)       # never benchmark a fallback as shm
        yield Target(transport, channel)
        check_transport(channel, transport)


def _payload(size: int) -> Any:
    return np.random.default_rng(size).integers(0, 256, size=size, dtype=np.uint8)


def _run(benchmark: Any, call: Callable[[], None], size: int, target: Target,
         direction: int) -> None:
    for _ in range(2):  # warm-up: pool growth, connection windows, first-use costs
        call()
    benchmark.extra_info.update(transport=target.transport, size=size,
                                payload_bytes_per_call=direction * size)
    # Bulk calls are slow on grpc: fewer rounds keep the module near a minute.
    if size >= 32 << 20:
        benchmark.pedantic(call, rounds=5, iterations=1)
    else:
        benchmark(call)
    mean_s = benchmark.stats.stats.mean if benchmark.stats else None
    if mean_s:
        benchmark.extra_info["gbps"] = direction * size / mean_s / 1e9


@pytest.mark.parametrize("size", list(SIZES.values()), ids=list(SIZES))
def test_unary_protobuf(benchmark: Any, target: Target, size: int) -> None:
    req = msg.Payload(buffers=[_payload(size).tobytes()])
    echo = target.channel.unary_unary(msg.path(msg.SERVICE, msg.ECHO),
                                      request_serializer=msg.Payload.SerializeToString,
                                      response_deserializer=msg.Payload.FromString)

    def call() -> None:
        if len(echo(req, timeout=CALL_TIMEOUT_S).buffers[0]) != size:
            raise AssertionError("echo came back with a different size")

    _run(benchmark, call, size, target, direction=2)


@pytest.mark.parametrize("size", list(SIZES.values()), ids=list(SIZES))
def test_unary_raw(benchmark: Any, target: Target, size: int) -> None:
    data = _payload(size)
    to_wire = msg.bytes_only(memoryview) if target.stack == "grpc" else memoryview
    sink = target.channel.unary_unary(msg.path(msg.SERVICE, msg.SINK_RAW),
                                      request_serializer=to_wire,
                                      response_deserializer=parse_raw_ack)

    def call() -> None:
        if sink(data, timeout=CALL_TIMEOUT_S) != (size, 1):
            raise AssertionError("the server acked a different size")

    _run(benchmark, call, size, target, direction=1)
