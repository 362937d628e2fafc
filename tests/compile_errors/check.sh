#!/usr/bin/env bash
# Builds one compile-error snippet's object target (tests/compile_errors/,
# EXCLUDE_FROM_ALL) and checks that it fails with troupe's message as the
# first error and at most MAX errors in all: what a user sees when misusing
# the API is one sentence naming the problem, not pages of std::tuple.
# Usage: check.sh BUILD_DIR TARGET REGEX MAX
set -uo pipefail
build=$1 target=$2 want=$3 max=$4
out=$(cmake --build "$build" --target "$target" 2>&1)
if [ $? -eq 0 ]; then
  echo "FAIL: $target compiled; it must not"
  exit 1
fi
first=$(grep -m1 -E "error:" <<<"$out")
errors=$(grep -cE "error:" <<<"$out")
if ! grep -qE -- "$want" <<<"$first"; then
  echo "FAIL: $target's first error is not troupe's ('$want'):"
  echo "$out" | head -30
  exit 1
fi
if [ "$errors" -gt "$max" ]; then
  echo "FAIL: $target gives $errors errors (at most $max):"
  echo "$out" | grep -E "error:" | head -20
  exit 1
fi
echo "ok: $target: $errors error(s), first: ${first#*error: }"
