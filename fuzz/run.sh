#!/usr/bin/env bash
# Builds fuzz/frame_fuzzer.cc with libFuzzer, AddressSanitizer and UBSan (clang) and
# runs it for a fixed time budget. Usage: bash fuzz/run.sh [SECONDS] (default 60).
# A crash, a sanitizer report or a hung input fails the run; its input is kept in
# $FUZZ_OUT (default /tmp/argrpc-fuzz) and the log's tail is printed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUDGET="${1:-60}"
OUT="${FUZZ_OUT:-/tmp/argrpc-fuzz}"
CXX="${FUZZ_CXX:-clang++-14}"

if ! command -v "$CXX" >/dev/null; then
    [ "$(id -u)" -eq 0 ] || { echo "fuzz: $CXX missing (apt-get install clang-14 libclang-rt-14-dev libfuzzer-14-dev)" >&2; exit 1; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q clang-14 libclang-rt-14-dev libfuzzer-14-dev >/dev/null
fi

mkdir -p "$OUT/corpus"
cd "$ROOT"
# Everything but the Python bindings: the engine, both fabrics (libibverbs is only
# dlopen'ed, never linked), the pool.
mapfile -t SRCS < <(find csrc -name '*.cc' ! -path 'csrc/bindings/*' | sort)
"$CXX" -std=c++17 -O1 -g -fno-omit-frame-pointer \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -Icsrc fuzz/frame_fuzzer.cc "${SRCS[@]}" -ldl -lpthread -o "$OUT/frame_fuzzer"
python3 fuzz/make_seeds.py "$OUT/seeds" >/dev/null

# detect_leaks=0: the engine and its threads live for the whole process by design.
rc=0
ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    "$OUT/frame_fuzzer" -max_total_time="$BUDGET" -max_len=65536 -timeout=20 \
    -rss_limit_mb=4096 -artifact_prefix="$OUT/" "$OUT/corpus" "$OUT/seeds" \
    >"$OUT/log" 2>&1 || rc=$?
if [ "$rc" -ne 0 ] || grep -qE "ERROR: (AddressSanitizer|libFuzzer)|runtime error:" "$OUT/log"; then
    echo "fuzz: FAILED (exit $rc); inputs and log in $OUT" >&2
    grep -vE "^argrpc: connection" "$OUT/log" | tail -60 >&2
    exit 1
fi
grep -E "^#[0-9]+[[:space:]]+DONE" "$OUT/log" | tail -1 || true
echo "fuzz: $BUDGET s, no crash, no sanitizer report (corpus: $(ls "$OUT/corpus" | wc -l) inputs in $OUT/corpus)"
