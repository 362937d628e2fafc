#!/usr/bin/env bash
# The main job on a fresh machine: install, build, and run on an embedded
# local cluster (1) the actor demo — actors spawned, one killed and restarted —
# and (2) train_digits — 2 trainer actors on the real digits data set, with
# checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."
# Same configuration as the test suite, so running both builds once.
bash scripts/build.sh ci hello_actors train_digits
echo "== hello_actors =="
./build-ci/examples/hello_actors
echo
echo "== train_digits =="
./build-ci/examples/train_digits "$@"
