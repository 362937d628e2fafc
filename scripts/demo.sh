#!/usr/bin/env bash
# The main job on a fresh machine: install, build, and run the demo driver on
# an embedded local cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh default hello_actors
./build/examples/hello_actors "$@"
