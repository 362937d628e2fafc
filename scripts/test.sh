#!/usr/bin/env bash
# The whole test suite from a fresh machine: install, build (warnings are
# errors), run every test through CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh ci
ctest --preset ci "$@"
