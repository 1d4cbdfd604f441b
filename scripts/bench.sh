#!/usr/bin/env bash
# Main job: set up (idempotent), then the argrpc vs plain grpcio side-by-side on this
# machine. Arguments go to bench/compare.py (e.g. --quick, --iterations N, --json PATH).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "${PYTHON:-python3}" bench/compare.py "$@"
