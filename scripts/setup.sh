#!/usr/bin/env bash
# Installs every build, test and benchmark dependency of troupe from Debian's
# packages, and the venv .venv/ (Debian's site packages visible, plus
# scikit-build-core from PyPI) that `pip install ./python_shim` builds with.
# Idempotent: when everything is present it only checks and exits.
set -euo pipefail
cd "$(dirname "$0")/.."

# The venv of the Python shim's pip install (ignored by git).
setup_venv() {
  if [ ! -x .venv/bin/python3 ]; then
    /usr/bin/python3 -m venv --system-site-packages .venv
  fi
  if ! .venv/bin/python3 -c "import scikit_build_core" 2>/dev/null; then
    .venv/bin/pip install --quiet "scikit-build-core>=0.8"
  fi
  echo "setup: .venv ready ($(.venv/bin/python3 -c 'import scikit_build_core as s; print("scikit-build-core", s.__version__)'))"
}

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libasio-dev capnproto libcapnp-dev libtbb-dev
  libtorch-dev libopenblas0-pthread
  libgloo-dev libgtest-dev libgmock-dev libbenchmark-dev
  libspdlog-dev libfmt-dev libcli11-dev nlohmann-json3-dev
  pybind11-dev python3-dev python3-torch python3-numpy python3-sklearn
  python3-matplotlib python3-cloudpickle python3-pytest python3-venv python3-pip
  libssl-dev zlib1g-dev libyaml-dev
  clang-14 libfuzzer-14-dev
  libsqlite3-dev python3-prometheus-client
  chromium fonts-dejavu-core fonts-liberation
  slurmctld slurmd slurm-client munge
  yamllint python3-jsonschema iproute2 universal-ctags
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#PACKAGES[@]} packages present"
  setup_venv
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "setup: done"
setup_venv
