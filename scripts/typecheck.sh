#!/usr/bin/env bash
# Type checks (CI runs this right after scripts/test.sh, which builds the engine):
#   1. mypy --strict over argrpc/ with pyproject.toml's [tool.mypy] (its exclusions are
#      commented there);
#   2. stubtest: argrpc/_core.pyi against the compiled argrpc._core, so the stub cannot
#      drift from csrc/bindings.
# mypy and the grpcio/protobuf stubs are pinned in pyproject's [typecheck] extra, which
# scripts/setup.sh installs. Environment: PYTHON (interpreter, default python3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"

"$PY" -m mypy --strict
"$PY" -m mypy.stubtest --mypy-config-file pyproject.toml \
    --allowlist scripts/core-stubtest-allowlist.txt argrpc._core
echo "typecheck: mypy --strict and stubtest clean"
