#!/usr/bin/env bash
# Main job: set up (idempotent), then argrpc-bench's short default comparison of plain
# grpcio and argrpc on this machine (latency with its floor, bandwidth, parameter server,
# connection set-up; both APIs; about four minutes on 2 vCPUs), then a real workload: examples/ps_training's parameter-server training
# over grpc and over argrpc, side by side (about 15 s). Arguments go to argrpc-bench
# (e.g. `latency --sizes 64,1M`, `--sweep TF_RDMA_ACC_SIZE=4K,8K,16K`, `--out DIR`) and
# skip the training run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
if [ "$#" -gt 0 ]; then exec "${PYTHON:-python3}" -m argrpc_bench "$@"; fi
"${PYTHON:-python3}" -m argrpc_bench all --quick --api both
mkdir -p bench-results
exec "${PYTHON:-python3}" -m examples.ps_training.launch --ps 2 --workers 3 --compare \
    --json bench-results/ps_training.json
