"""Malloc tuning (TF_RDMA_MALLOC_TUNING): a protobuf message of tens of MiB, above glibc's
largest mmap threshold (32 MiB) too, is built and parsed in reused heap memory, not in
fresh mappings that page-fault on every message (without tuning, every one does). Counted
as page faults of the threads that run the serializer, the deserializer and the handler,
in their own processes. And what the heap keeps free for that reuse stays bounded
(malloc_retain_max), however large the messages."""
from __future__ import annotations

import json
import platform
import subprocess
import sys
from typing import Any

import google.protobuf
import pytest

from argrpc import _config, _malloc
from tests.support.procs import REPO_ROOT, child_env

MiB = 1 << 20
SIZE = 64 * MiB  # above the mmap threshold: each buffer a mapping of its own by default
PAGES = SIZE // 4096
WARM = 2  # the first calls grow the heap and the pool

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                                reason="malloc tuning is for glibc's malloc")


def _probe(env: dict[str, str], calls: int = 5, size: int = SIZE) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "tests.support.fault_probe", str(size),
                          str(calls)], cwd=REPO_ROOT, env=child_env(env), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["transport"] == "shm" and result["intact"]
    return result


def test_large_protobuf_messages_do_not_page_fault_after_warm_up() -> None:
    r = _probe({})
    # The client serializes on its main thread; the server parses and reads the field on
    # a thread of its pool, started after argrpc was imported.
    for stage in ("serialize", "parse", "field"):
        assert max(r[stage][WARM:]) < PAGES // 20, (stage, r)


def test_without_tuning_every_message_page_faults() -> None:
    # The control: the same calls fault through each fresh buffer, so the test above
    # measures the tuning, not an accident of the probe.
    r = _probe({"TF_RDMA_MALLOC_TUNING": "false"})
    for stage in ("serialize", "parse", "field"):
        assert min(r[stage][WARM:]) > PAGES // 2, (stage, r)


def _heap_probe(sizes: list[int]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "tests.support.heap_probe",
                          ",".join(map(str, sizes))], cwd=REPO_ROOT, env=child_env({}),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["transport"] == "shm" and result["intact"]
    return result


def test_freed_heap_memory_kept_is_bounded() -> None:
    # Messages of 256 MiB and others between leave the client's heap with more than the
    # cap free after each call (upb's 512 MiB encode block alone); the engine trims it.
    # What either process then holds free is what an explicit malloc_trim(0) gives back.
    cap = _config.LIMITS.malloc_retain_max
    slack = 16 * MiB
    r = _heap_probe([256 * MiB, 96 * MiB, 256 * MiB, 64 * MiB, 256 * MiB])
    assert r["client_heap"]["trims"] > 0, r
    assert r["client_held_free"] <= cap + slack, r
    assert r["server_held_free"] <= cap + slack, r
    # the echo server's resident memory does not creep up from one call to the next
    assert r["server_rss"][-1] <= r["server_rss"][0] + slack, r


def test_memory_kept_for_reuse_is_measured() -> None:
    # The control for the bound above: at 64 MiB the heap keeps the buffers for the next
    # message (the fault test), and the probe sees them, below the cap and untrimmed.
    cap = _config.LIMITS.malloc_retain_max
    r = _heap_probe([64 * MiB] * 4)
    assert r["client_heap"]["trims"] == 0 and r["server_heap"]["trims"] == 0, r
    if int(google.protobuf.__version__.split(".")[0]) >= 7:
        # protobuf 7's upb frees its 128 MiB encode block after each message: the heap
        # keeps it free for the next one. protobuf 6's keeps its blocks in use instead.
        assert 128 * MiB <= r["client_held_free"] <= cap, r
    else:
        assert r["client_held_free"] <= cap, r
    assert r["server_heap"]["checks"] >= 4, r


@pytest.mark.parametrize("env,wanted", [
    ({}, True),
    ({"TF_RDMA_MALLOC_TUNING": "off"}, False),
    ({"TF_RDMA_ENABLED": "false"}, False),
    ({"TF_RDMA_TRANSPORT": "grpc"}, False),
    ({"TF_RDMA_TRANSPORT": "shm"}, True),
    ({"TF_RDMA_MALLOC_TUNING": "maybe"}, False),
])
def test_import_time_arena_cap_follows_the_knobs(env: dict[str, str], wanted: bool) -> None:
    assert _malloc._wanted(env) is wanted
