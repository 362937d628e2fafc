#!/usr/bin/env bash
# The GPU lane of issue 17, run ON the GPU machine (CUDA, NCCL, PyTorch 2.x in
# a venv, CMake, ninja; none of troupe's Debian dependencies; no network).
#
#   scripts/gpu_check.sh [unpack|configure|build|test|bench|all]
#
# Each stage fits one 10-minute command and resumes from the previous one
# (the git-ignored build-gpu/ stays between calls; the prefix is re-unpacked
# in seconds when the machine was restarted), e.g.
#   run(carry=[".gpu-bundle"], command="scripts/gpu_check.sh build")
#   run(command="scripts/gpu_check.sh test"); run(command="scripts/gpu_check.sh bench")
# Stages:
#   unpack     .gpu-bundle/troupe-deps.tar.xz (scripts/gpu_bundle.sh) into
#              $GPU_PREFIX (/tmp/troupe-gpu-prefix), never onto /; rewrites the absolute /usr paths
#              in its pkg-config and CMake files and symlinks to the prefix.
#   configure  against $TORCH_PY's torch (torch.utils.cmake_prefix_path), the
#              machine's CUDA and NCCL (the venv's nvidia-nccl when present)
#              and the prefix (CMAKE_PREFIX_PATH, PKG_CONFIG_PATH, PATH for
#              the capnp compiler, LD_LIBRARY_PATH at run time).
#   build      ninja -j$JOBS (default: all cores).
#   test       ctest -L gpu, then the actors/trainer suites.
#   bench      bench/run gpu_train when that case exists.
# Every stage appends JSON lines to $OUT/gpu-check.jsonl (stage, status,
# seconds, GPU name) and its output to $OUT/gpu-check.log ($OUT defaults to
# out/ when not set by the device tool).
set -euo pipefail

cd "$(dirname "$0")/.."
root=$PWD
bundle=${GPU_BUNDLE:-$root/.gpu-bundle/troupe-deps.tar.xz}
# Outside the source tree: CMake refuses exported include dirs inside it.
prefix=${GPU_PREFIX:-/tmp/troupe-gpu-prefix}
build=${GPU_BUILD:-$root/build-gpu}
torch_py=${TORCH_PY:-/opt/torch/.venv/bin/python}
jobs=${JOBS:-$(nproc)}
out=${OUT:-$root/out}
mkdir -p "$out"
report=$out/gpu-check.jsonl
log=$out/gpu-check.log
multiarch=x86_64-linux-gnu

gpu_name() { nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 || echo none; }
record() { # stage status seconds [detail]
  printf '{"stage":"%s","status":"%s","seconds":%s,"gpu":"%s","date":"%s","detail":"%s"}\n' \
    "$1" "$2" "$3" "$(gpu_name)" "$(date -u +%FT%TZ)" "${4:-}" >>"$report"
}

env_for_prefix() {
  local lib=$prefix/usr/lib/$multiarch
  export PATH=$prefix/usr/bin:$PATH
  export CMAKE_PREFIX_PATH=$prefix/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
  export PKG_CONFIG_PATH=$lib/pkgconfig:$prefix/usr/share/pkgconfig
  export LD_LIBRARY_PATH=$lib:$prefix/lib/$multiarch${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}

unpack() {
  local stamp=$prefix/.unpacked
  [[ -f $bundle ]] || { echo "no bundle at $bundle: run scripts/gpu_bundle.sh and carry .gpu-bundle" >&2; return 1; }
  [[ -f $stamp && $stamp -nt $bundle ]] && return 0
  rm -rf "$prefix" && mkdir -p "$prefix"
  tar -C "$prefix" -xJf "$bundle"
  # Debian's files name /usr absolutely: point them into the prefix.
  grep -rlE '(^|[ ="])/usr(/|"|$)' "$prefix"/usr/lib/$multiarch/pkgconfig "$prefix"/usr/share/pkgconfig \
    "$prefix"/usr/lib/$multiarch/cmake "$prefix"/usr/share/cmake 2>/dev/null |
    xargs -r sed -i -E "s#(^|[ =\"])/usr(/|\"|\$)#\1$prefix/usr\2#g"
  find "$prefix" -type l -lname '/*' | while read -r l; do
    local t
    t=$(readlink "$l")
    [[ -e $prefix$t ]] && ln -sfn "$prefix$t" "$l"
  done
  touch "$stamp"
}

configure() {
  env_for_prefix
  local torch_cmake torch_root nccl_dir args
  torch_cmake=$("$torch_py" -c 'import torch; print(torch.utils.cmake_prefix_path)')
  torch_root=$(dirname "$(dirname "$torch_cmake")")
  args=(-S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
        -DTROUPE_TORCH_ROOT="$torch_root" -DTROUPE_WITH_PYTHON=OFF
        -DOPENSSL_ROOT_DIR="$prefix/usr")
  # shellcheck disable=SC2206 # extra arguments, split on spaces on purpose
  [[ -n ${GPU_CMAKE_ARGS:-} ]] && args+=(${GPU_CMAKE_ARGS})
  # The venv's NCCL (nvidia-nccl-cu*), when the CUDA install has none.
  nccl_dir=$("$torch_py" -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__ or nvidia.nccl.__path__[0]))' 2>/dev/null || true)
  if [[ -n $nccl_dir && -f $nccl_dir/include/nccl.h ]]; then
    args+=(-DNCCL_INCLUDE_DIR="$nccl_dir/include" -DNCCL_LIBRARY="$(ls "$nccl_dir"/lib/libnccl.so* | head -n1)")
  fi
  [[ -x /usr/local/cuda/bin/nvcc ]] && args+=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
  cmake "${args[@]}"
}

build_all() { env_for_prefix; cmake --build "$build" -j"$jobs"; }

run_tests() {
  env_for_prefix
  local rc=0
  ctest --test-dir "$build" -L gpu --output-on-failure --timeout 300 -j2 || rc=$?
  ctest --test-dir "$build" -R 'actors|trainer|tensor_collectives|elastic' --output-on-failure --timeout 300 -j4 || rc=$?
  return $rc
}

run_bench() {
  env_for_prefix
  if grep -q gpu_train bench/run 2>/dev/null; then
    TROUPE_BUILD=$build bench/run gpu_train --out "$out"
  else
    echo "bench/run has no gpu_train case yet: nothing to measure" && return 0
  fi
}

stage() { # name function
  local t0=$SECONDS status=ok
  echo "=== gpu_check $1 $(date -u +%FT%TZ)" | tee -a "$log"
  "$2" > >(tee -a "$log") 2>&1 || status=fail
  record "$1" "$status" $((SECONDS - t0))
  [[ $status == ok ]]
}

case ${1:-all} in
  unpack) stage unpack unpack ;;
  configure) stage unpack unpack && stage configure configure ;;
  build) stage unpack unpack && { [[ -f $build/build.ninja ]] || stage configure configure; } && stage build build_all ;;
  test) stage unpack unpack && stage test run_tests ;;
  bench) stage unpack unpack && stage bench run_bench ;;
  all) stage unpack unpack && stage configure configure && stage build build_all && stage test run_tests && stage bench run_bench ;;
  *) echo "unknown stage '$1' (unpack|configure|build|test|bench|all)" >&2; exit 2 ;;
esac
