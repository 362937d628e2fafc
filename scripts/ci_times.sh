#!/usr/bin/env bash
# Where a build's time went, from ninja's log (BUILD/.ninja_log): the last
# build of every output that still exists, their sum, and the N slowest
# (default 15). A cold build's sum divided by the 2 cores is about its wall
# time; most of CI's 90 minutes (README, "CI") are spent here.
# Usage: scripts/ci_times.sh [build-dir] [N]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,/^[^#]/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'
  exit 0
fi
build="${1:-build-ci}"
n="${2:-15}"
log="$build/.ninja_log"
if [ ! -f "$log" ]; then
  echo "ci_times: $log not found; build $build first" >&2
  exit 2
fi
# Seconds and output of each step, the last entry per output; outputs that
# are gone (a target since removed) are left out.
awk 'NR > 1 { t[$4] = ($2 - $1) / 1000 } END { for (k in t) printf "%.1f %s\n", t[k], k }' "$log" |
  while read -r secs out; do [ -e "$build/$out" ] && echo "$secs $out"; done | sort -rn >"$build/.ci_times"
awk -v build="$build" '{ sum += $1 } END {
  printf "%s: %d steps, %.0f s of compiling and linking in all (%.0f s on 2 cores)\n", build, NR, sum, sum / 2 }' \
  "$build/.ci_times"
head -n "$n" "$build/.ci_times" | awk '{ printf "%8.1f s  %s\n", $1, $2 }'
