#!/usr/bin/env bash
# Installs the troupe of build directory $1 into a fresh prefix, builds
# tests/consumer against it with find_package(troupe) (a project that
# enables only CXX), and runs the driver it makes. What README's
# "Use troupe from another CMake project" says, as a test.
set -euo pipefail
build="$1"
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/troupe-consumer.XXXXXX")"
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
cmake -S "$here" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$work/prefix" \
  "${launcher[@]}" >"$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
TROUPE_SESSION_DIR="$work" TROUPE_LOG_LEVEL=info "$work/build/consumer"
