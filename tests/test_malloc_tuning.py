"""Malloc tuning (TF_RDMA_MALLOC_TUNING): a protobuf message of tens of MiB below glibc's
largest mmap threshold (32 MiB) is built and parsed in reused heap memory, not in fresh
mappings that page-fault on every message (above it, without tuning, every one does). Counted as page faults of the threads that run the
serializer, the deserializer and the handler, in their own processes."""
from __future__ import annotations

import json
import platform
import subprocess
import sys
from typing import Any

import pytest

from argrpc import _malloc
from tests.support.procs import REPO_ROOT, child_env

SIZE = 40 << 20
HEAP_SIZE = 24 << 20
PAGES = HEAP_SIZE // 4096
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
    # below glibc's largest mmap threshold: above it (malloc_mmap_max) blocks are mapped
    r = _probe({}, size=HEAP_SIZE)
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
