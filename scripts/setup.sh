#!/usr/bin/env bash
# Idempotent set-up for argrpc on a Debian machine (run as root, or with the tools already
# there): system build tools, Python build/test dependencies, and argrpc itself built.
#
# argrpc is installed EDITABLE (`pip install -e .`), on purpose:
#   * `python -m pytest` (scripts/test.sh) puts the repo root first on sys.path, so tests
#     import ./argrpc, not a copy in site-packages. An editable build puts the compiled
#     argrpc/_core*.so into the checkout, so the
#     code under test is exactly the code in the tree, with its own engine.
#   * one build serves the tests, argrpc-bench and any user script on this machine;
#     Python edits need no reinstall, C++ edits need this script again (it rebuilds when
#     a source is newer than the built extension).
# A plain `pip install .` would leave the checkout without _core, and tests run from the
# repo would import that unbuilt source package.
#
# Environment: PYTHON (interpreter, default python3), ARGRPC_REBUILD=1 (force a rebuild).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"

log() { printf '[setup] %s\n' "$*"; }

# ---------------------------------------------------------------- system packages
py_include="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
need_apt=()
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
command -v make >/dev/null 2>&1 || need_apt+=(make)
# rdma-core's headers are for the verbs ABI check only (scripts/check_verbs_abi.sh, run by
# tests/test_verbs_abi.py): argrpc declares the verbs ABI it uses itself and builds
# without them, and libibverbs is loaded at run time (dlopen), so hosts without RDMA
# still import argrpc.
[ -f /usr/include/infiniband/verbs.h ] || need_apt+=(libibverbs-dev)
if [ ! -f "$py_include/Python.h" ]; then
    # Only Debian's own python3 gets its headers from apt; others (pyenv, venvs of it)
    # ship them, so a missing Python.h there is reported below instead.
    need_apt+=(python3-dev)
fi
if [ "${#need_apt[@]}" -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        log "missing ${need_apt[*]} and not root: install them, then run this again" >&2
        exit 1
    fi
    log "apt-get install ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
if [ ! -f "$py_include/Python.h" ]; then
    log "no Python.h under $py_include: install the headers for $("$PY" -V 2>&1)" >&2
    exit 1
fi

# -------------------------------------------------------------- Python packages
# Already-satisfied requirements are not fetched again, so a second run is offline.
pip_install() { "$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore "$@"; }

# What to install is pyproject.toml's: the build requirements, the dependencies and every
# extra (bench, examples, test, typecheck), read from there so the two cannot drift; and
# bench/pyproject.toml's dependencies. argrpc-bench itself (the bench and test extras name
# it) and argrpc are this checkout's, installed below.
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || pip_install tomli
mapfile -t requirements < <("$PY" - <<'PYEOF'
try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

import re

with open("pyproject.toml", "rb") as f:
    meta = tomllib.load(f)
with open("bench/pyproject.toml", "rb") as f:
    bench = tomllib.load(f)
reqs = [*meta["build-system"]["requires"], *meta["project"]["dependencies"],
        *bench["project"]["dependencies"]]
for extra in meta["project"]["optional-dependencies"].values():
    reqs += extra
ours = {"argrpc", "argrpc-bench"}
reqs = [r for r in reqs if re.match(r"[A-Za-z0-9._-]+", r).group(0).lower() not in ours]
print("\n".join(dict.fromkeys(reqs)))
PYEOF
)
[ "${#requirements[@]}" -gt 0 ] || { log "no requirements read from pyproject.toml" >&2; exit 1; }
log "Python build, test, bench, examples and typecheck dependencies (pyproject.toml)"
pip_install "${requirements[@]}"

# ------------------------------------------------------------------------ argrpc
# Rebuild only when the extension is missing, fails to import, or is older than any of
# its inputs: re-running the scripts should not cost a C++ build every time.
needs_build() {
    [ "${ARGRPC_REBUILD:-0}" = "1" ] && return 0
    local so
    so="$(ls -t argrpc/_core*.so 2>/dev/null | head -n1 || true)"
    [ -n "$so" ] || return 0
    local newer
    newer="$(find csrc protos setup.py pyproject.toml setup.cfg -newer "$so" -type f \
        2>/dev/null | head -n1 || true)"
    [ -z "$newer" ] || { log "rebuild: $newer changed"; return 0; }
    # Imported from / : the editable install must be registered too, or code run outside
    # the checkout would not find argrpc; and it must resolve to THIS checkout.
    local where
    where="$(cd / && "$PY" -c 'import argrpc, argrpc._core as c; print(argrpc.__file__, c.test_hooks)' \
        2>/dev/null)" || return 0
    [ "$where" = "$ROOT/argrpc/__init__.py True" ] || { log "rebuild: argrpc resolves to $where"; return 0; }
    return 1
}

if needs_build; then
    log "building argrpc (pip install -e .; the C++ engine takes a minute on 2 cores)"
    # No build isolation: the build requirements were installed just above, so the build
    # needs no network and reuses the installed pybind11.
    # With the engine's test hooks (the sim fabric, fail points, probes): the suite and
    # the sanitizer run use them; the wheel (scripts/build_wheel.sh) leaves them out.
    ARGRPC_TEST_HOOKS=1 pip_install --no-build-isolation -e "$ROOT"
else
    log "argrpc is up to date ($(ls argrpc/_core*.so))"
fi

# argrpc-bench, editable from bench/ (pure Python: no build), unless already this checkout's.
bench_at="$(cd / && "$PY" -c 'import argrpc_bench; print(argrpc_bench.__file__)' 2>/dev/null || true)"
if [ "$bench_at" != "$ROOT/bench/argrpc_bench/__init__.py" ]; then
    log "installing argrpc-bench (pip install -e bench/)"
    pip_install --no-build-isolation --no-deps -e "$ROOT/bench"
fi

# The checkout's bytecode, written once. An environment may forbid writing it
# (PYTHONDONTWRITEBYTECODE, as some container images set), and then every process the
# suite, the bench and the Soft-RoCE guests start would compile argrpc's modules again:
# about a third of `import argrpc`, and seconds a process under an emulated CPU. The
# interpreter checks each file against its source, so an edit is never run stale.
"$PY" -m compileall -q -j 0 argrpc bench/argrpc_bench examples tests >/dev/null \
    || log "compileall failed: processes will compile argrpc's modules at every start"

# Prove the result is importable from outside the checkout too.
(cd / && "$PY" -c 'import argrpc, argrpc._core; print("[setup] argrpc ready:", argrpc.__file__)')
(cd / && "$PY" -c 'import argrpc_bench; print("[setup] argrpc-bench ready:", argrpc_bench.__file__)')
