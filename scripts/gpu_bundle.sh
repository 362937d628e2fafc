#!/usr/bin/env bash
# Makes the dependency bundle for the GPU lane (issue 17), on the
# development machine (Debian 12, network or a warm apt cache).
#
#   scripts/gpu_bundle.sh            -> .gpu-bundle/troupe-deps.tar.xz
#
# The GPU machine has CUDA, NCCL, PyTorch 2.x, CMake and ninja but none of
# troupe's Debian dependencies and no network; what travels there is the
# working tree plus up to 64 MiB of carried, git-ignored files. This script
# `apt-get download`s troupe's build dependencies and the runtime libraries
# they pull in, `dpkg -x`es them into a prefix (never onto /), drops docs and
# man pages, and packs the prefix. scripts/gpu_check.sh unpacks it there.
# It fails loudly when the archive exceeds $BUNDLE_LIMIT_MIB (default 56: the
# carry limit is 64 MiB for the bundle and any other carried paths together).
set -euo pipefail

cd "$(dirname "$0")/.."
out=.gpu-bundle
limit_mib=${BUNDLE_LIMIT_MIB:-56}
debs=${GPU_BUNDLE_DEBS:-$HOME/.cache/troupe-gpu-debs}

# Build deps (headers, CMake configs, the capnp compiler, pkg-config, which
# the GPU machine may lack) and the runtime
# libraries they link; the C runtime, libstdc++, OpenSSL 3 and zlib runtimes
# are assumed present (any glibc-2.36-or-newer Linux has them), their -dev
# packages are not.
packages=(
  libasio-dev libcli11-dev nlohmann-json3-dev
  capnproto libcapnp-dev libcapnp-0.9.2
  libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5 libhwloc15
  libspdlog-dev libspdlog1.10 libfmt-dev libfmt9
  libgloo-dev libgloo0 libhiredis-dev libhiredis0.14
  libibverbs-dev libibverbs1 ibverbs-providers libnl-3-200 libnl-3-dev libnl-route-3-200 libnl-route-3-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev libbenchmark1debian
  libssl-dev libssl3 zlib1g-dev zlib1g
  pkgconf pkgconf-bin libpkgconf3 pkg-config
  libsqlite3-dev libsqlite3-0 libyaml-dev libyaml-0-2
)

mkdir -p "$debs" "$out"
(cd "$debs" && apt-get download "${packages[@]}")

prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
for p in "${packages[@]}"; do
  deb=$(ls -t "$debs/${p}_"*.deb | head -n1)
  dpkg -x "$deb" "$prefix"
  basename "$deb" >>"$prefix/MANIFEST"
done
rm -rf "$prefix"/usr/share/{doc,man,lintian,bug,doc-base}

# The digits data set of the trainer suites (python3-sklearn ships it; the
# GPU machine's venv may have no scikit-learn): gpu_check.sh points
# TROUPE_DIGITS_PATH at this copy. Taken from the installed package, else
# from its downloaded .deb, so a machine that has not run setup.sh makes
# the same bundle (on 2026-12-04 one did not, and the digits test failed
# there for want of the file).
digits=$(ls /usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz 2>/dev/null || true)
if [[ -z $digits ]]; then
  (cd "$debs" && apt-get download python3-sklearn)
  dpkg -x "$(ls -t "$debs"/python3-sklearn_*.deb | head -n1)" "$prefix/sklearn"
  digits=$prefix/sklearn/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz
fi
[[ -f $digits ]] || { echo "gpu_bundle: FAIL: no digits.csv.gz in python3-sklearn" >&2; exit 1; }
cp "$digits" "$out/digits.csv.gz"
rm -rf "$prefix/sklearn"

archive=$out/troupe-deps.tar.xz
tar -C "$prefix" -cJf "$archive" .
size=$(stat -c %s "$archive")
echo "gpu_bundle: $archive $((size / 1024)) KiB, ${#packages[@]} packages"
if ((size > limit_mib * 1024 * 1024)); then
  echo "gpu_bundle: FAIL: $archive is over ${limit_mib} MiB" >&2
  exit 1
fi
