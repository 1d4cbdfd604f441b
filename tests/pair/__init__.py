"""Tests across two hosts: two Soft-RoCE guests joined by one link
(softroce/pair.sh). Host B runs `tests.pair.host_b`; host A runs
pytest on this package. Outside such a pair every test here skips with the reason."""

import subprocess

PORT = 50051
CTRL_DIR = ".pair-ctrl"  # in the run's working directory, which both guests share
# The guest has 2 GiB of RAM and every process pre-faults its own pool.
SERVER_ENV = {"TF_RDMA_BUF_SIZE": "256M"}


def burn(n: int) -> list[subprocess.Popen[bytes]]:
    """n processes that keep a CPU busy (a loaded host) until stop()."""
    return [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(n)]


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.kill()
        p.wait()
