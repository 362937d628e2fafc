#!/usr/bin/env bash
# Shape check: no function over 80 lines (DESIGN §8) in runtime/, actors/
# and trainer/, headers included. Exits non-zero on any finding.
#
#   scripts/lint.sh                  (CI) universal-ctags lists every function
#                                    definition with its first and last line;
#                                    a function whose last line is more than 80
#                                    lines after its first is a finding. Under
#                                    a second. Counting from the signature's
#                                    line, it is at least as strict as
#                                    clang-tidy's readability-function-size
#                                    (which counts from the body's brace).
#   scripts/lint.sh --clang-tidy [build-dir]
#                                    the same limit through clang-tidy
#                                    (.clang-tidy) with the compile commands of
#                                    a configured build (default build-ci). It
#                                    parses every file, LibTorch's headers
#                                    included: about 9 minutes on 2 cores,
#                                    which is why CI runs the first.
#
# clang parses code that GCC compiles: precompiled headers (GCC's .gch) are
# dropped from the commands, and clang's own complaints about system headers
# (LibTorch 1.13 with libstdc++ 12, _Float16) are printed as notes, not
# failures, since they are not findings about troupe's code.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,/^[^#]/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'
  exit 0
fi
limit=80
if [ "${1:-}" != "--clang-tidy" ]; then
  sources=$(git ls-files 'runtime/*.cc' 'runtime/*.h' 'actors/*.cc' 'actors/*.h' 'trainer/*.cc' 'trainer/*.h')
  findings=$(echo "$sources" |
    ctags-universal --languages=C++ --langmap=C++:+.h --kinds-C++=f --fields=+ne -x --_xformat='%n	%e	%F	%N' -L - |
    awk -F'\t' -v limit="$limit" '$2 != "" && $2 - $1 > limit {
      printf "%s:%s: function %s has %d lines (more than %d)\n", $3, $1, $4, $2 - $1, limit }')
  if [ -n "$findings" ]; then
    echo "$findings"
    echo "lint: FAILED: $(echo "$findings" | wc -l) function(s) over $limit lines"
    exit 1
  fi
  echo "lint: ok ($(echo "$sources" | wc -l) files, no function over $limit lines)"
  exit 0
fi
shift
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
