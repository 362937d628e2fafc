#!/usr/bin/env bash
# Shape checks (.clang-tidy: no function over 80 lines) over the sources of
# runtime/, actors/ and trainer/, with the compile commands of a configured
# build (default build-ci; scripts/test.sh makes it). Exits non-zero on any
# finding in those folders. Usage: scripts/lint.sh [build-dir]
#
# clang parses code that GCC compiles: precompiled headers (GCC's .gch) are
# dropped from the commands, and clang's own complaints about system headers
# (LibTorch 1.13 with libstdc++ 12, _Float16) are printed as notes, not
# failures, since they are not findings about troupe's code.
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build-ci}"
if [ ! -f "$build/compile_commands.json" ]; then
  echo "lint: $build/compile_commands.json not found; configure first (cmake --preset ci)" >&2
  exit 2
fi
# Generated headers (Cap'n Proto) must exist before clang parses the sources.
cmake --build "$build" --target troupe_runtime >/dev/null
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 - "$build/compile_commands.json" "$work/compile_commands.json" <<'PY'
import json, re, sys
entries = json.load(open(sys.argv[1]))
for e in entries:
    e["command"] = re.sub(r"\s-include\s+\S*cmake_pch\.hxx|\s-Winvalid-pch", "", e["command"])
json.dump(entries, open(sys.argv[2], "w"))
PY
files=$(git ls-files 'runtime/*.cc' 'actors/*.cc' 'trainer/*.cc')
jobs="$(nproc)"
echo "lint: clang-tidy over $(echo "$files" | wc -w) files with $jobs jobs"
printf '%s\n' $files | xargs -P "$jobs" -n 2 clang-tidy -p "$work" --quiet >"$work/log" 2>&1 || true
findings=$(grep -E "^[^ ]*/(runtime|actors|trainer)/[^ ]*:[0-9]+:[0-9]+: (warning|error): .*\[readability-" "$work/log" |
  sed "s|^$PWD/||; s|^.*/include/troupe/||" | sort -u || true)
notes=$(grep -c "clang-diagnostic-error" "$work/log" || true)
[ "$notes" -gt 0 ] && echo "lint: note: $notes clang parse complaints (system headers, _Float16) ignored"
if [ -n "$findings" ]; then
  echo "$findings"
  echo "lint: FAILED: $(echo "$findings" | wc -l) finding(s)"
  exit 1
fi
echo "lint: ok"
