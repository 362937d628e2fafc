#!/usr/bin/env bash
# `pip install ./python_shim`, offline, as a user would: builds the wheel with
# the setup venv's scikit-build-core (--no-build-isolation), installs it into
# a fresh venv made with --system-site-packages, and runs a task and an actor
# on an embedded cluster from outside the source tree, and the `troupe`
# console script. Exits 77 (skipped)
# when scripts/setup.sh has not made .venv.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
venv="$repo/.venv"
if [ ! -x "$venv/bin/python3" ] || ! "$venv/bin/python3" -c "import scikit_build_core" 2>/dev/null; then
  echo "skipped: $venv with scikit-build-core is missing (run scripts/setup.sh)"
  exit 77
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$venv/bin/pip" wheel --quiet --no-build-isolation --no-deps --wheel-dir "$work/wheels" "$repo/python_shim"
/usr/bin/python3 -m venv --system-site-packages "$work/venv"
"$work/venv/bin/pip" install --quiet --no-index --no-deps "$work"/wheels/troupe-*.whl
cd "$work"
env -u PYTHONPATH TROUPE_LOG_LEVEL=warn "$work/venv/bin/python3" - <<'PY'
import troupe

assert "/venv/" in troupe.__file__, troupe.__file__
troupe.init(num_cpus=1)

@troupe.remote
def square(x):
    return x * x

@troupe.remote
class Counter:
    def __init__(self):
        self.n = 0

    def add(self, k):
        self.n += k
        return self.n

c = Counter.remote()
assert troupe.get(square.remote(7), timeout=120) == 49
assert troupe.get([c.add.remote(1), c.add.remote(2)], timeout=120) == [1, 3]
troupe.shutdown()
print("pip-installed troupe works:", troupe.__file__)
PY
# The console script runs the CLI the wheel carries (troupe/_bin/troupe).
env -u PYTHONPATH -u TROUPE_CLI "$work/venv/bin/troupe" --help | grep -q torchrun
env -u PYTHONPATH -u TROUPE_CLI "$work/venv/bin/troupe" torchrun --help | grep -q nproc
echo "pip-installed troupe console script works: $work/venv/bin/troupe"
