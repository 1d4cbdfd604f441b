"""Tests across two hosts: two Soft-RoCE guests joined by one link
(../shared/softroce/run-in-rxe-pair.sh). Host B runs `tests.pair.host_b`; host A runs
pytest on this package. Outside such a pair every test here skips with the reason."""

PORT = 50051
CTRL_DIR = ".pair-ctrl"  # in the run's working directory, which both guests share
# The guest has 2 GiB of RAM and every process pre-faults its own pool.
SERVER_ENV = {"TF_RDMA_BUF_SIZE": "256M"}
