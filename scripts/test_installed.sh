#!/usr/bin/env bash
# The test suite against argrpc as a user installs it, not against the editable build:
#
#   1. wheel venv: a clean venv (no system site-packages) gets dist/'s manylinux wheel
#      (built, as users get it, without the engine's test hooks: their tests skip)
#      and the test dependencies, all as binary wheels, with NO compiler on PATH (PATH is
#      the venv's bin/ plus a directory of symlinks to the few tools the suite runs: sh,
#      coreutils, git, ip...; gcc/cc/c++/g++/clang/ld are checked to be absent). The suite
#      runs from a copy of the repository WITHOUT argrpc/ (and without build/), so neither
#      the checkout nor its package is importable: `import argrpc` in the tests and in
#      every process they spawn can only find the venv's site-packages. A pre-flight
#      check proves that before pytest starts, and ARGRPC_INSTALLED_TEST=1 makes the
#      suite's conftest check it again in the pytest process. It runs the share of the
#      suite an install can change (WHEEL_SET), or the tests its arguments name.
#   2. sdist venv: another clean venv builds and installs dist/'s sdist (with the
#      compiler: that is what an sdist is for) and runs a smoke subset of the suite.
#   3. version venvs: the wheel with the lowest grpcio and protobuf its metadata accepts,
#      with a protobuf 6.x, and with the newest of both, each in a clean venv with only
#      the smoke set's own needs (pytest, numpy), running the side-by-side checks on
#      argrpc's stack.
#
# dist/ is made by scripts/build_wheel.sh if it holds no wheel (ARGRPC_REBUILD_WHEEL=1:
# always); argrpc-bench's wheel from there too (the test extra names it: the suite runs it).
# Arguments go to the wheel venv's pytest (default: WHEEL_SET below; `tests` for the whole
# default suite, which the editable build has run already).
# Exit status: non-zero if anything fails. Prints the time of each step.
#
# Environment: PYTHON (default python3), DIST_DIR (default dist/), ARGRPC_SKIP_SDIST=1
# (no sdist venv), ARGRPC_SKIP_VERSIONS=1 (no version venvs), KEEP_INSTALLED_TEST_DIR=1 (keep the
# temporary directory: the repository copy and both venvs).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')"  # not a pyenv shim
DIST="${DIST_DIR:-$ROOT/dist}"
log() { printf '[installed] %s\n' "$*"; }
t0=$SECONDS
times=()

# Names that would let anything compile; none may be on the wheel venv's PATH.
COMPILERS=(gcc cc c++ g++ cpp clang clang++ clang-14 clang++-14 ld ld.bfd ld.gold as
           x86_64-linux-gnu-gcc x86_64-linux-gnu-g++ x86_64-linux-gnu-gcc-12
           x86_64-linux-gnu-g++-12 x86_64-linux-gnu-ld)
# What the suite and its children run besides Python (absent ones are left out: the tests
# that need them skip as they would on any host without them).
TOOLS=(sh bash dash env cat cp mv rm ls ln mkdir rmdir mktemp chmod touch readlink realpath
       dirname basename head tail tr cut sort uniq wc tee grep egrep sed awk mawk find
       xargs sleep true false kill ps pgrep id whoami uname nproc date stat du df
       timeout nice taskset git ip rdma ibv_devices ibv_devinfo ldconfig getconf py-spy)

# ------------------------------------------------------------------------ dist/
shopt -s nullglob
wheels=("$DIST"/argrpc-*-manylinux*.whl)
sdists=("$DIST"/argrpc-*.tar.gz)
bench_wheels=("$DIST"/argrpc_bench-*.whl)
if [ "${ARGRPC_REBUILD_WHEEL:-0}" = "1" ] || [ "${#wheels[@]}" -ne 1 ] || [ "${#sdists[@]}" -ne 1 ] \
        || [ "${#bench_wheels[@]}" -ne 1 ]; then
    t=$SECONDS
    DIST_DIR="$DIST" PYTHON="$PY" bash "$ROOT/scripts/build_wheel.sh"
    times+=("build sdist+wheel+repair: $((SECONDS - t))s")
    wheels=("$DIST"/argrpc-*-manylinux*.whl)
    sdists=("$DIST"/argrpc-*.tar.gz)
fi
[ "${#wheels[@]}" -eq 1 ] && [ "${#sdists[@]}" -eq 1 ] || {
    log "want exactly one manylinux wheel and one sdist in $DIST" >&2; exit 1; }
WHEEL="${wheels[0]}"
SDIST="${sdists[0]}"
log "wheel: $WHEEL"
log "sdist: $SDIST"

# ------------------------------------------------------- the repository, minus argrpc/
# The working tree (uncommitted and new unignored files too), without the package and
# build outputs: tests read README.md, csrc/knobs.h, docs/, examples/, bench/ from it.
WORK="$(mktemp -d "${TMPDIR:-/tmp}/argrpc-installed.XXXXXX")"
cleanup() {
    if [ "${KEEP_INSTALLED_TEST_DIR:-0}" = "1" ]; then log "kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
TREE="$WORK/repo"
mkdir -p "$TREE"
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
        | grep -zv -e '^argrpc/' -e '^build/' -e '^dist/' -e '^\.venvs/' \
        | xargs -0 -r sh -c 'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' sh \
        | tar --null -T - -cf -) | tar -xf - -C "$TREE"
else
    tar -C "$ROOT" --exclude=./argrpc --exclude=./build --exclude=./dist --exclude=./.venvs \
        --exclude=.git -cf - . | tar -xf - -C "$TREE"
fi
[ ! -e "$TREE/argrpc" ] || { log "the copy holds argrpc/" >&2; exit 1; }
# tests/test_knobs.py lists the tracked files with git: the copy is a repository of its own.
git -C "$TREE" init -q
git -C "$TREE" add -A

# ------------------------------------------------------------- a PATH without compilers
NOCC="$WORK/bin"
mkdir -p "$NOCC"
for tool in "${TOOLS[@]}"; do
    p="$(command -v "$tool" 2>/dev/null || true)"
    case "$p" in /*) ln -sf "$p" "$NOCC/$tool";; esac
done

# Checks run inside a venv before its pytest: argrpc comes from the venv's site-packages,
# nothing of the checkout or of the base interpreter's site-packages is on sys.path.
preflight() {  # VENV EXPECT_NO_COMPILER
    (cd "$TREE" && "$1/bin/python" - "$1" "$ROOT" "$2" "${COMPILERS[@]}" <<'PY'
import os, shutil, site, sys, sysconfig
venv, checkout, no_cc, compilers = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4:]
venv = os.path.realpath(venv)
import argrpc, argrpc._core, argrpc.aio, argrpc._proto  # noqa: E401  (the compiled engine loads)
where = os.path.realpath(argrpc.__file__)
purelib = os.path.realpath(sysconfig.get_paths()["purelib"])
platlib = os.path.realpath(sysconfig.get_paths()["platlib"])
assert where.startswith((purelib + os.sep, platlib + os.sep)), f"argrpc from {where}"
assert os.path.realpath(argrpc._core.__file__).startswith(os.path.dirname(where) + os.sep)
assert argrpc._core.test_hooks is False, "a user's engine carries the test hooks"
assert os.path.realpath(sys.prefix) == venv, sys.prefix
assert sys.prefix != sys.base_prefix
base_sites = {os.path.realpath(p) for p in site.getsitepackages([sys.base_prefix])}
for p in sys.path:
    rp = os.path.realpath(p or ".")
    assert not (rp == checkout or rp.startswith(checkout + os.sep)), f"checkout on sys.path: {p}"
    assert rp not in base_sites, f"base site-packages on sys.path: {p}"
if no_cc:
    found = {c: shutil.which(c) for c in compilers if shutil.which(c)}
    cc = (sysconfig.get_config_var("CC") or "").split()
    if cc and shutil.which(cc[0]):
        found[cc[0]] = shutil.which(cc[0])
    assert not found, f"compilers on PATH: {found}"
print(f"[installed] preflight ok: argrpc {where}; compiler on PATH: "
      f"{'none' if no_cc else shutil.which('g++')}")
PY
    )
}

pip_in() {  # VENV ARGS...: pip of that venv, quiet
    local venv="$1"; shift
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --root-user-action=ignore "$@"
}

run_pytest() {  # VENV PATH ARGS...
    local venv="$1" path="$2"; shift 2
    local rc=0
    (cd "$TREE" && env PATH="$path" ARGRPC_INSTALLED_TEST=1 VIRTUAL_ENV="$venv" \
        PYTHONPATH= PYTHONNOUSERSITE=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@") \
        || rc=$?
    if [ "$rc" -eq 5 ]; then log "pytest collected no tests (exit 5)" >&2; return 1; fi
    return "$rc"
}

# --------------------------------------------------------------------- wheel venv
VW="$WORK/venv-wheel"
NOCC_PATH="$VW/bin:$NOCC"
log "wheel venv $VW (PATH=$NOCC_PATH)"
t=$SECONDS
"$PY" -m venv --clear "$VW"
# Binary wheels only: with no compiler on PATH, a dependency that needed building would
# fail anyway; --only-binary makes that failure say so at once.
env PATH="$NOCC_PATH" PYTHONNOUSERSITE=1 "$VW/bin/python" -m pip install -q \
    --disable-pip-version-check --root-user-action=ignore --only-binary :all: \
    --find-links "$DIST" "argrpc[test] @ file://$WHEEL"
times+=("wheel venv: create + install wheel and test deps: $((SECONDS - t))s")
(export PATH="$NOCC_PATH" PYTHONNOUSERSITE=1 PYTHONPATH=; preflight "$VW" 1)
t=$SECONDS
rc_wheel=0
# What can differ in an installed wheel from the editable build the suite ran on: the
# package as pip lays it out (data, stubs, entry points, extras), the engine as the wheel
# build compiled and repaired it, processes that import argrpc from site-packages (fork,
# exit, examples, a framework, the bench CLI), and every front end and arity over it on
# each pair. The engine's internals (faults, pools, chaos, the 256 MiB transfers) are the
# same code and were tested on the editable build; of the bench, its CLI over both APIs
# and its client processes (the runner's other paths are the same Python either way).
WHEEL_SET=(tests/test_packaging.py tests/test_extras.py tests/test_version.py
           tests/test_knobs.py tests/test_doctor.py tests/test_readme.py tests/test_proto.py
           tests/test_channel_api.py tests/test_arities.py tests/test_grpc_parity.py
           tests/test_unary_multicallable.py tests/test_payloads.py tests/test_status.py
           tests/test_metadata.py tests/aio/test_aio_client.py tests/aio/test_aio_server.py
           tests/test_transports.py tests/test_same_host.py tests/test_fork.py
           tests/test_process_exit.py tests/test_service_config.py tests/test_balancing.py
           tests/test_bench_runs.py::test_cli_both_apis_in_one_real_run
           tests/test_bench_runs.py::test_client_processes_start_together_and_are_aggregated
           tests/test_ps_training.py
           tests/frameworks/test_frameworks.py::test_kserve_serves_the_same_on_argrpc
           tests/test_observability.py tests/test_tls.py)
# The grpc/grpc pair is grpcio on both ends: nothing of the installed argrpc runs in it.
# (-k matches without regard to case: both spellings of the 256 MiB cases.)
[ "$#" -gt 0 ] || set -- "${WHEEL_SET[@]}" -k "not client_grpc-server_grpc and not 256mib"
run_pytest "$VW" "$NOCC_PATH" "$@" || rc_wheel=$?
times+=("wheel venv: pytest (exit $rc_wheel): $((SECONDS - t))s")

# --------------------------------------------------------------------- sdist venv
rc_sdist=0
if [ "${ARGRPC_SKIP_SDIST:-0}" != "1" ]; then
    VS="$WORK/venv-sdist"
    log "sdist venv $VS: pip install of the sdist builds the engine (a few minutes on 2 cores)"
    t=$SECONDS
    "$PY" -m venv --clear "$VS"
    # --no-cache-dir: pip would otherwise reuse a wheel it built from an earlier sdist of
    # the same name and version (a previous run's), and test that instead of this build.
    # Only the smoke set's own needs beside it (the wheel venv has the whole test extra:
    # its frameworks take minutes to install and nothing here runs them).
    (export PYTHONNOUSERSITE=1; pip_in "$VS" --no-cache-dir --find-links "$DIST" \
        "argrpc @ file://$SDIST" pytest pytest-timeout numpy grpcio-tools uvloop argrpc-bench)
    times+=("sdist venv: create + build and install the sdist: $((SECONDS - t))s")
    (export PYTHONNOUSERSITE=1 PYTHONPATH=; preflight "$VS" 0)
    t=$SECONDS
    # Smoke: the engine's own API, aio's fast path between two argrpc ends (the wheel
    # venv runs the mixed pairs), the CLI (doctor) and the generated knob header. (A
    # user's build has no test hooks: the sim fabric's tests would only skip.)
    run_pytest "$VS" "$VS/bin:$PATH" tests/test_knobs.py tests/test_channel_api.py \
        tests/test_doctor.py tests/aio/test_aio_client.py \
        -k "not client_ or client_argrpc-server_argrpc" || rc_sdist=$?
    times+=("sdist venv: smoke pytest (exit $rc_sdist): $((SECONDS - t))s")
fi

# ------------------------------------------------------------------- version venvs
# The bounds pyproject declares, a protobuf 6.x (what many stacks pin), the newest.
VERSION_SETS=("grpcio==1.64.0 protobuf==3.19.6" "grpcio==1.64.0 protobuf==6.33.1"
              "grpcio protobuf")
rc_versions=0
if [ "${ARGRPC_SKIP_VERSIONS:-0}" != "1" ]; then
    for set in "${VERSION_SETS[@]}"; do
        VV="$WORK/venv-versions"
        t=$SECONDS
        "$PY" -m venv --clear "$VV"
        # shellcheck disable=SC2086 # one word per requirement
        (export PYTHONNOUSERSITE=1; pip_in "$VV" --only-binary :all: "argrpc @ file://$WHEEL" \
            $set pytest pytest-timeout numpy)
        got="$("$VV/bin/python" -c 'import grpc, google.protobuf as p; print(f"grpcio {grpc.__version__}, protobuf {p.__version__}")')"
        rc=0
        run_pytest "$VV" "$VV/bin:$PATH" tests/test_proto.py || rc=$?
        run_pytest "$VV" "$VV/bin:$PATH" tests/test_grpc_parity.py tests/test_limits.py \
            tests/aio/test_aio_cancel_parity.py tests/test_lifecycle_order.py \
            tests/test_user_code_logs.py -k "argrpc and not client_ and not default_" || rc=$?
        [ "$rc" -eq 0 ] || rc_versions=$rc
        times+=("version venv ($got): smoke pytest (exit $rc): $((SECONDS - t))s")
    done
fi

for line in "${times[@]}"; do log "time: $line"; done
log "time: total $((SECONDS - t0))s"
if [ "$rc_wheel" -ne 0 ] || [ "$rc_sdist" -ne 0 ] || [ "$rc_versions" -ne 0 ]; then
    log "FAILED: wheel venv pytest exit $rc_wheel, sdist venv pytest exit $rc_sdist," \
        "version venvs exit $rc_versions" >&2
    exit 1
fi
log "OK: the installed wheel passes the suite without a compiler; the sdist builds and passes the smoke set"
