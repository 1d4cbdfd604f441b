#!/usr/bin/env bash
# ASan+UBSan step: builds argrpc._core with ARGRPC_SANITIZE=address,undefined in a private
# copy of the checkout and runs the engine tests from that copy under the sanitizers.
# Fails if a test fails or any process (pytest, a spawned server or client) reports.
# Assumes scripts/setup.sh ran (pybind11, grpcio-tools, pytest installed).
#
# Usage: scripts/sanitize.sh [pytest args]   (none: the default engine set below)
# Environment: PYTHON (default python3), KEEP_SANITIZE_DIR=1 (keep the copy and reports),
# ASAN_OPTIONS / UBSAN_OPTIONS (appended to this script's own).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
log() { printf '[sanitize] %s\n' "$*"; }

for tool in gcc g++ nm; do
    command -v "$tool" >/dev/null || { log "$tool missing: run scripts/setup.sh" >&2; exit 1; }
done
LIBASAN="$(gcc -print-file-name=libasan.so)"
LIBUBSAN="$(gcc -print-file-name=libubsan.so)"
LIBSTDCXX="$(g++ -print-file-name=libstdc++.so)"
for lib in "$LIBASAN" "$LIBUBSAN" "$LIBSTDCXX"; do
    # gcc prints the bare name back when it has no such library.
    [ -e "$lib" ] || { log "no $lib for gcc (Debian: libasan8, libubsan1)" >&2; exit 1; }
done

WORK="$(mktemp -d "${TMPDIR:-/tmp}/argrpc-sanitize.XXXXXX")"
cleanup() {
    if [ "${KEEP_SANITIZE_DIR:-0}" = "1" ]; then log "kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
SRC="$WORK/src"
REPORTS="$WORK/reports"
mkdir -p "$SRC" "$REPORTS"

# ------------------------------------------------------------------ private copy
# The checkout's own argrpc/_core*.so and build/ may be in use: never build there. The copy
# is the working tree (uncommitted and new unignored files included) minus build outputs.
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
        | xargs -0 -r sh -c 'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' sh \
        | tar --null -T - -cf -) | tar -xf - -C "$SRC"
else
    (cd "$ROOT" && tar --exclude=./build --exclude=./.git --exclude='*.so' --exclude='*.o' \
        --exclude=__pycache__ --exclude=.pytest_cache -cf - .) | tar -xf - -C "$SRC"
fi
log "copy of $ROOT in $SRC"

# ------------------------------------------------------------------------- build
# CPPFLAGS because setuptools appends it to the C++ compile and link lines (CFLAGS and
# CXXFLAGS would replace Python's). -fno-sanitize-recover: UB aborts the process like an
# ASan error does. -fno-wrapv: Python's flags carry -fwrapv, which turns UBSan's
# signed-overflow check off.
log "building argrpc._core with ASan+UBSan (gcc; a few minutes on 2 cores)"
(
    cd "$SRC"
    export CC=gcc CXX=g++ ARGRPC_SANITIZE=address,undefined ARGRPC_TEST_HOOKS=1
    export CPPFLAGS="${CPPFLAGS:+$CPPFLAGS }-fno-sanitize-recover=undefined -fno-wrapv"
    "$PY" setup.py build_ext --inplace
) >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log" >&2; log "build failed" >&2; exit 1; }
so="$(ls "$SRC"/argrpc/_core*.so)"
syms="$(nm -D "$so")"
grep -q '__asan_report_' <<<"$syms" && grep -q '__ubsan_handle_.*_abort' <<<"$syms" \
    || { log "$so lacks ASan or non-recovering UBSan instrumentation" >&2; exit 1; }

# --------------------------------------------------------------------------- run
# GCC's libubsan carries its own copy of the report machinery, and ASan's interposes on
# its __sanitizer_set_report_path, so UBSAN_OPTIONS=log_path is ignored and a UBSan report
# goes to stderr, which the tests discard for servers. This shim, preloaded into every
# process, points libubsan's own copy at $REPORTS/ubsan.<pid>.
cat >"$WORK/ubsan_log.c" <<'EOF_C'
#include <dlfcn.h>
#include <stdlib.h>
__attribute__((constructor)) static void ubsan_log_path(void) {
  const char* path = getenv("ARGRPC_UBSAN_LOG");
  void* rt = path ? dlopen(UBSAN_RT, RTLD_NOW | RTLD_NOLOAD) : NULL;
  void (*set)(const char*) = rt ? (void (*)(const char*))dlsym(rt, "__sanitizer_set_report_path") : NULL;
  if (set) set(path);
}
EOF_C
gcc -shared -fPIC -O1 -DUBSAN_RT="\"$LIBUBSAN\"" "$WORK/ubsan_log.c" -o "$WORK/ubsan_log.so" -ldl

# CPython is not instrumented, so the runtimes are preloaded, ASan first. libstdc++ too:
# python does not link it, and without it ASan finds no real __cxa_throw and dies on the
# engine's first C++ exception. Children inherit all this (tests/support/procs.py copies
# os.environ); each process writes its report to $REPORTS/<tool>.<pid>, where it outlives
# the tests' temporary server logs. No leak check: CPython leaks by design at exit.
export LD_PRELOAD="$LIBASAN $LIBUBSAN $LIBSTDCXX $WORK/ubsan_log.so${LD_PRELOAD:+ $LD_PRELOAD}"
# Options already in the environment come last, so they win (e.g. for a local deep dive).
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:log_path=$REPORTS/asan${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="halt_on_error=1:abort_on_error=1:print_stacktrace=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
export ARGRPC_UBSAN_LOG="$REPORTS/ubsan"
export PYTHONDONTWRITEBYTECODE=1 PYTHONFAULTHANDLER=1

cd "$SRC"
# Bytecode written once, as scripts/setup.sh does for the checkout: no process of the run
# compiles the package again.
"$PY" -m compileall -q -j 0 argrpc tests >/dev/null || log "compileall failed"
"$PY" -c 'import argrpc._core; print("[sanitize] engine:", argrpc._core.__file__)'

if [ "$#" -eq 0 ]; then
    # The files that drive the engine (tests/aio: the event-loop side of it); the bench,
    # README, config and doctor tests barely touch it, and tests/verbs needs a device (it
    # runs in the Soft-RoCE guest). Of the client/server pairs only argrpc's own: the
    # grpc/grpc pair never loads the engine, and in a mixed pair the argrpc end falls back
    # to plain gRPC after a refused handshake, which test_handshake_unit and
    # test_hostile_peer drive here directly (the suite runs every pair on the plain build).
    set -- \
        tests/test_arities.py tests/test_payloads.py tests/test_deadline_cancel.py \
        tests/test_concurrency.py tests/test_pool_pressure.py tests/test_dead_peer.py \
        tests/test_leaks.py tests/test_server_stop.py tests/test_handshake_unit.py \
        tests/test_process_exit.py tests/test_status.py tests/test_metadata.py \
        tests/test_channel_api.py tests/test_buffers.py tests/test_limits.py \
        tests/test_interceptors.py tests/test_same_host.py tests/test_environment.py \
        tests/test_tls.py tests/test_fork.py tests/test_hostile_peer.py \
        tests/test_fail_points.py tests/test_server_pool.py tests/test_signals.py \
        tests/test_nonblocking_handlers.py tests/test_sim_fabric.py tests/test_connection_gone.py \
        tests/test_subchannels.py tests/test_grpc_parity.py tests/test_planned_calls.py \
        tests/test_unary_multicallable.py tests/aio \
        -k "not client_grpc and not server_grpc"
fi
rc=0  # pipefail: pytest's own status survives the tee
"$PY" -m pytest -q -p no:cacheprovider --durations=10 "$@" 2>&1 | tee "$WORK/pytest.log" \
    || rc=$?

reports="$(find "$REPORTS" -type f | sort)"
if [ -n "$reports" ]; then
    log "sanitizer reports:" >&2
    while IFS= read -r f; do printf '==== %s\n' "$f" >&2; cat "$f" >&2; done <<<"$reports"
    rc=1
fi
# A report that reached a stderr the tests show (a process the preload missed) counts too.
if grep -qE 'runtime error:|ERROR: AddressSanitizer|AddressSanitizer: CHECK failed' \
        "$WORK/pytest.log"; then
    log "sanitizer output in the pytest log (above)" >&2
    rc=1
fi
if [ "$rc" -eq 0 ]; then log "passed"; else log "FAILED (exit $rc)" >&2; fi
exit "$rc"
