#!/usr/bin/env bash
# Where a build's time went, from ninja's log (BUILD/.ninja_log, which keeps
# the last build of every output): the sum of all steps, the number of
# steps, and the N slowest (default 15). A cold build's sum divided by the
# cores is about its wall time; CI's budget (README, "CI") is spent mostly
# here. Usage: scripts/ci_times.sh [build-dir] [N]
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build-ci}"
n="${2:-15}"
log="$build/.ninja_log"
if [ ! -f "$log" ]; then
  echo "ci_times: $log not found; build $build first" >&2
  exit 2
fi
awk -v n="$n" -v build="$build" '
  NR > 1 { t[$4] = ($2 - $1) / 1000 }
  END {
    for (k in t) { sum += t[k]; steps++ }
    printf "%s: %d steps, %.0f s of compiling and linking in all (%.0f s on 2 cores)\n", build, steps, sum, sum / 2
    for (k in t) printf "%8.1f s  %s\n", t[k], k | "sort -rn | head -n " n
  }' "$log"
