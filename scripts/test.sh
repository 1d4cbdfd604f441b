#!/usr/bin/env bash
# Set up (idempotent), then the test suite. Run from the repo root so tests import the
# checkout's argrpc, built in place by setup.sh. Arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "${PYTHON:-python3}" -m pytest -q "$@"
