#!/usr/bin/env bash
# Builds and tests troupe against a LibTorch 2.x (the portability lane of
# issue 17) on a CPU machine, next to the usual build against Debian's 1.13.
#
#   scripts/torch2_check.sh [fetch|configure|build|test|all] [ctest -R regex]
#
# The LibTorch is a PyTorch wheel (CPU x86_64 Linux; the default index's wheel
# is CUDA-built, which is fine: cmake/TroupeDependencies.cmake then imports
# torch_cpu + c10 without its TorchConfig). The wheel is downloaded once with
# `pip download $TROUPE_TORCH2_SPEC --no-deps` into $TROUPE_TORCH2_CACHE and
# unpacked there, one folder per pinned version.
# A CUDA-built libtorch_cpu names libcudart/libcupti, absent on a CPU machine:
# the test step generates stub libraries for exactly the symbols it imports
# (each returns an error, so torch sees no CUDA) and puts them on
# LD_LIBRARY_PATH. The tests run the TorchScript/checkpoint files that
# Debian's torch 1.13 python writes through LibTorch 2.x, and the reverse.
#
# Too slow for .ci/run (a full build with LibTorch 2.x headers, no ccache
# hits shared with the 1.13 build): run it by hand after touching
# trainer/torch_compat.h or the torch-facing code.
#
# Environment: TROUPE_TORCH_ROOT (a LibTorch 2.x folder to use as it is),
# TROUPE_TORCH2_CACHE (default ~/.cache/troupe-torch2),
# TROUPE_TORCH2_SPEC (pip requirement, default "torch==2.11.0": the
# version the GPU machines carry; the newest torch this machine's index
# served on 2026-12-04, a 2.15.0 wheel, is built with the old std::string
# ABI, which CMake refuses, naming it), JOBS (build
# parallelism, default 1, run under nice), TROUPE_TEST_WRAP (a prefix for the
# ctest command, e.g. "flock /tmp/troupe-cpu.lock").
set -euo pipefail

cd "$(dirname "$0")/.."
cache=${TROUPE_TORCH2_CACHE:-$HOME/.cache/troupe-torch2}
spec=${TROUPE_TORCH2_SPEC:-torch==2.11.0}
# A pinned version has a wheel and an unpacked folder of its own.
version=
[[ $spec == torch==* ]] && version=${spec#torch==}
jobs=${JOBS:-1}
# An unpacked LibTorch 2.x already on the machine (a venv's
# site-packages/torch) can be named instead of downloading the wheel; the
# script never writes there.
given_root=${TROUPE_TORCH_ROOT:-}
export TROUPE_TORCH_ROOT=${TROUPE_TORCH_ROOT:-$cache/root${version:+-$version}/torch}
stubs=$cache/stubs${version:+-$version}
stage=${1:-all}
regex=${2:-}

die() { echo "torch2_check: $*" >&2; exit 1; }

# The cached wheel of $version (torch-2.11.0-cp311-..., torch-2.11.0+cpu-...;
# not torch-2.11.1-...), or of any 2.x when none is pinned; "" when none.
cached_wheel() {
  local found
  shopt -s nullglob
  if [[ -n $version ]]; then found=("$cache/torch-$version"[-+]*.whl); else found=("$cache"/torch-2*.whl); fi
  shopt -u nullglob
  echo "${found[0]:-}"
}

fetch() {
  [[ -f $TROUPE_TORCH_ROOT/include/torch/script.h ]] && return 0
  [[ -n $given_root ]] && die "TROUPE_TORCH_ROOT=$given_root holds no include/torch/script.h: not a LibTorch"
  mkdir -p "$cache"
  local wheel
  wheel=$(cached_wheel)
  if [[ -z $wheel ]]; then
    python3 -m pip download --no-deps --only-binary=:all: -d "$cache" "$spec" ||
      die "pip download $spec failed (no network? put its torch-*.whl into $cache)"
    wheel=$(cached_wheel)
    [[ -n $wheel ]] || die "pip download $spec left no torch-${version:-2}*.whl in $cache"
  fi
  echo "torch2_check: unpacking $wheel"
  # Only what a C++ build needs: headers, libraries, CMake config.
  python3 - "$wheel" "$(dirname "$TROUPE_TORCH_ROOT")" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for n in z.namelist():
        if n.startswith(("torch/include/", "torch/lib/", "torch/share/cmake/")):
            z.extract(n, sys.argv[2])
EOF
  chmod -R u+w "$(dirname "$TROUPE_TORCH_ROOT")"
}

# Stub shared libraries for what libtorch_cpu needs but this machine lacks.
make_stubs() {
  local lib=$TROUPE_TORCH_ROOT/lib/libtorch_cpu.so need syms
  mkdir -p "$stubs"
  for need in $(readelf -d "$lib" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
    [[ -e $TROUPE_TORCH_ROOT/lib/$need ]] && continue
    ldconfig -p | grep -q " $need " && continue
    [[ -e $stubs/$need ]] && continue
    syms=$(nm -D --undefined-only "$lib" | sed -n "s/^ *U \(.*\)@$need$/\1/p")
    [[ -n $syms ]] || continue
    echo "torch2_check: stub $need ($(wc -w <<<"$syms") symbols)"
    { for s in $syms; do echo "int $s(void) { return 100; }"; done; } >"$stubs/$need.c"
    { echo "$need {"; echo " global:"; for s in $syms; do echo "  $s;"; done; echo " local: *;"; echo "};"; } \
      >"$stubs/$need.map"
    cc -shared -fPIC -o "$stubs/$need" -Wl,-soname,"$need" -Wl,--version-script="$stubs/$need.map" \
      "$stubs/$need.c"
  done
}

# CUDA off: this is the CPU lane. With a CUDA toolkit installed, the wheel's
# TorchConfig would link libtorch_cuda against the toolkit's NCCL, which
# need not be the one the wheel was built with.
configure() { cmake --preset torch2 -DTROUPE_WITH_CUDA=OFF; }
build() { nice -n 19 cmake --build --preset torch2 -j"$jobs"; }
run_tests() {
  make_stubs
  local args=(--preset torch2)
  [[ -n $regex ]] && args+=(-R "$regex")
  LD_LIBRARY_PATH=$stubs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} ${TROUPE_TEST_WRAP:-} ctest "${args[@]}"
}

case $stage in
  fetch) fetch ;;
  configure) fetch; configure ;;
  build) build ;;
  test) run_tests ;;
  all) fetch; configure; build; run_tests ;;
  *) die "unknown stage '$stage' (fetch|configure|build|test|all)" ;;
esac
