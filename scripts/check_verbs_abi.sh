#!/usr/bin/env bash
# The verbs ABI check: argrpc declares the part of libibverbs it uses itself
# (csrc/fabric/verbs/ibv_types.h), so the extension builds without rdma-core's headers;
# this compiles and runs tests/abi/verbs_abi_check.cc, which compares those declarations
# (sizes, offsets, field types, enum values, function types) with rdma-core's
# <infiniband/verbs.h> wherever the compiler finds it.
#
# Usage: scripts/check_verbs_abi.sh [compiler args]   e.g. -I/opt/rdma-core/include
# The arguments come before -Icsrc, so -I DIR also puts another fabric/verbs/ibv_types.h
# first (tests/test_verbs_abi.py checks a perturbed copy that way).
# Environment: CXX (default g++).
# Exit: 0 they match; 1 they differ (the compiler's static_assert names what);
#       2 no rdma-core header to compare with.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
read -r -a CXX_CMD <<< "${CXX:-g++}"
log() { printf '[verbs-abi] %s\n' "$*"; }

# The header the check will compare with: the compiler's own search, so a -I or CPATH
# pointing at another rdma-core counts.
deps="$(printf '#include <infiniband/verbs.h>\n' |
    "${CXX_CMD[@]}" -x c++ -std=c++17 "$@" -M - 2>/dev/null)" || deps=""
header="$(tr ' \\' '\n\n' <<< "$deps" | grep '/infiniband/verbs\.h$' | head -n1 || true)"
if [ -z "$header" ]; then
    log "no <infiniband/verbs.h> to compare with (Debian: libibverbs-dev; Fedora: rdma-core-devel)" >&2
    exit 2
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/argrpc-verbs-abi.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
if ! "${CXX_CMD[@]}" -std=c++17 -Wall -Wextra "$@" -I"$ROOT/csrc" \
        "$ROOT/tests/abi/verbs_abi_check.cc" -o "$WORK/check"; then
    log "csrc/fabric/verbs/ibv_types.h differs from $header (see the static_asserts above)" >&2
    exit 1
fi
if ! "$WORK/check"; then
    log "csrc/fabric/verbs/ibv_types.h differs from $header" >&2
    exit 1
fi
log "csrc/fabric/verbs/ibv_types.h matches $header"
