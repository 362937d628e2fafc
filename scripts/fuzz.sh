#!/usr/bin/env bash
# The fuzz lane: builds the libFuzzer targets of tests/fuzz (CMake preset
# "fuzz": clang-14, ASan + UBSan, no LibTorch) and runs each for SECONDS
# (default 60) from its seeds, the inputs kept under tests/fuzz/corpus/<t>/
# and what earlier runs found (build-fuzz/corpus/<t>/). Prints one JSON line
# per target with its executions; exits 1 when a target crashed, leaving the
# input as build-fuzz/crashes/<t>/crash-* — keep it under
# tests/fuzz/corpus/<t>/ with the fix (fuzz_corpus_tests replays it).
# Usage: scripts/fuzz.sh [seconds] [target...]   (targets: frame codec connection kv npy manifest http)
#        scripts/fuzz.sh --runs N [target...]    each target for N executions (10000000: issue 18's bar)
set -euo pipefail
cd "$(dirname "$0")/.."
limit=()
if [ "${1:-}" = "--runs" ]; then
  runs=${2:?--runs needs a count}
  shift 2
  limit=(-runs="$runs")
else
  seconds=${1:-60}
  shift || true
  limit=(-max_total_time="$seconds")
fi
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(frame codec connection kv npy manifest http)
bash scripts/setup.sh
cmake --preset fuzz >/dev/null
cmake --build --preset fuzz
export ASAN_OPTIONS="abort_on_error=1:detect_leaks=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
status=0
for t in "${targets[@]}"; do
  work=build-fuzz/corpus/$t
  crashes=build-fuzz/crashes/$t
  log=build-fuzz/fuzz_$t.log
  mkdir -p "$work" "$crashes" "tests/fuzz/corpus/$t"
  clean=true
  start=$SECONDS
  if ! TROUPE_FUZZ_SEEDS="$work" build-fuzz/tests/fuzz/fuzz_$t "${limit[@]}" -print_final_stats=1 \
      -artifact_prefix="$crashes/" "$work" "tests/fuzz/corpus/$t" >"$log" 2>&1; then
    clean=false
    status=1
    tail -40 "$log" >&2
  fi
  execs=$(grep -o "stat::number_of_executed_units: *[0-9]*" "$log" | tail -1 | grep -o "[0-9]*$" || true)
  echo "{\"bench\": \"fuzz\", \"case\": \"$t\", \"seconds\": $((SECONDS - start)), \"execs\": ${execs:-0}, \"clean\": $clean}"
done
exit $status
