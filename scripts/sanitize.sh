#!/usr/bin/env bash
# The sanitizer lanes: the runtime and collective tests built without
# LibTorch (TROUPE_WITH_TORCH=OFF keeps the build short) or the Python shim
# (an instrumented extension cannot load into Debian's uninstrumented
# interpreter; the shim's tests run in the regular suite), under
#   address  AddressSanitizer + UndefinedBehaviorSanitizer (preset "asan"),
#   thread   ThreadSanitizer (preset "tsan"): every thread the runtime
#            starts (I/O loops, mailboxes, the head's HTTP threads, Gloo's
#            and the shared-memory reducer's), in every process a test
#            starts (head, agents and workers are instrumented too).
# Any sanitizer report fails the test that triggered it. CI runs both after
# the test suite. Usage: scripts/sanitize.sh [address|thread] [ctest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
lane=address
if [ $# -gt 0 ] && { [ "$1" = address ] || [ "$1" = thread ]; }; then
  lane=$1
  shift
fi
preset=$([ "$lane" = thread ] && echo tsan || echo asan)
bash scripts/setup.sh
# No CLI either: none of these tests runs it, and its files are 2 minutes
# of an instrumented build.
cmake --preset "$preset" -DTROUPE_WITH_TORCH=OFF -DTROUPE_WITH_PYTHON=OFF -DTROUPE_BUILD_BENCH=OFF \
  -DTROUPE_BUILD_EXAMPLES=OFF -DTROUPE_BUILD_CLI=OFF -DTROUPE_TEST_LAYERS=collective >/dev/null
cmake --build --preset "$preset"
# halt_on_error: a report ends the process, so the test fails instead of
# printing and going on. LeakSanitizer is on. Every instrumented process
# (heads, agents and workers too, whose own exit status no test may read)
# also writes its reports under $reports; any report there fails the lane.
reports="$PWD/build-$preset/sanitizer-reports"
rm -rf "$reports"
mkdir -p "$reports"
export ASAN_OPTIONS="abort_on_error=1:detect_leaks=1:log_path=$reports/asan"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$reports/ubsan"
# TSan's suppressions, each with its reason: scripts/tsan.supp.
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/scripts/tsan.supp:log_path=$reports/tsan"
# LimitsFd (a head under RLIMIT_NOFILE=128) is left out and runs in the
# regular suite: out of descriptors, UBSan's vptr check reports valid
# objects (nlohmann-json's in the head), because it probes whether a vtable
# is readable by writing it into a pipe (sanitizer_common's
# IsAccessibleMemoryRange) and takes a failed pipe() for "unreadable";
# runtime suppressions cannot match it, as they match the dynamic type the
# failed probe could not read. TSan needs descriptors of its own too.
rc=0
ctest --test-dir "build-$preset" --output-on-failure -j 2 --timeout 900 -E '^LimitsFd\.' "$@" || rc=$?
# A file holding only LeakSanitizer's "Unable to get registers from thread
# N." is no finding: LSan writes it when a thread of a process doing its
# exit leak check cannot be read (the process is being killed, as the
# integration tests kill real processes, or the thread is exiting), and it
# then counts that thread's whole stack as reachable and goes on; a leak
# it finds after that is reported in the same file, which then fails.
note='^==[0-9]+==Unable to get registers from thread [0-9]+\.$'
if compgen -G "$reports/*" >/dev/null; then
  for f in "$reports"/*; do
    if ! grep -Evq "$note|^\s*$" "$f"; then
      echo "sanitize: note only, not a finding: $f: $(head -n 1 "$f")" >&2
      continue
    fi
    echo "sanitize: $lane report from a process the tests started:" >&2
    echo "--- $f" >&2
    head -n 60 "$f" >&2
    rc=1
  done
fi
exit $rc
