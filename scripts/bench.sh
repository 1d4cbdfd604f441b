#!/usr/bin/env bash
# Main job: set up (idempotent), then argrpc-bench's short default comparison of plain
# grpcio and argrpc on this machine (latency, bandwidth, parameter server; about a
# minute on 2 vCPUs). Arguments go to argrpc-bench (e.g. `latency --sizes 64,1M`,
# `--sweep TF_RDMA_ACC_SIZE=4K,8K,16K`, `--out DIR`); without any, `all --quick`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
if [ "$#" -eq 0 ]; then set -- all --quick; fi
exec "${PYTHON:-python3}" -m argrpc.bench "$@"
