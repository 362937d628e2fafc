#!/usr/bin/env bash
# The GPU lane of issue 17, run ON the GPU machine (CUDA, NCCL, PyTorch 2.x in
# a venv, CMake, ninja; none of troupe's Debian dependencies; no network).
#
#   scripts/gpu_check.sh [unpack|configure|build|test|gpu_tests|suites|bench|all]
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
#   build      ninja -j$JOBS (default: all cores) of $GPU_TARGETS.
#   test       ctest -L gpu, then the trainer suites ($GPU_SUITES) against
#              this LibTorch (all runs them around the bench).
#   bench      troupe_bench_gpu_train (bench/gpu_train.cc) against the
#              machine's PyTorch: JSON lines to $OUT/gpu_train.jsonl.
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
  # Cap'n Proto 0.9's blob.h compares const char* with kj::StringPtr in an
  # order that GCC 13 in C++20 mode finds no operator for (kj drops its
  # const char* overloads where rewritten comparisons exist); compare as
  # StringPtr on both sides, the member operator that every compiler takes.
  sed -i -e 's/{ return a == b.asString(); }/{ return b.asString() == kj::StringPtr(a); }/' \
    -e 's/{ return a != b.asString(); }/{ return !(b.asString() == kj::StringPtr(a)); }/' \
    "$prefix/usr/include/capnp/blob.h"
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
  # Release: no debug info, so the lane's build and links are quicker.
  # CMAKE_POLICY_VERSION_MINIMUM: a CMake 4 there refuses package files that
  # ask for policies older than 3.5; older CMakes ignore the variable.
  args=(-S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_POLICY_VERSION_MINIMUM=3.5
        -DTROUPE_TORCH_ROOT="$torch_root" -DTROUPE_WITH_PYTHON=OFF
        -DOPENSSL_ROOT_DIR="$prefix/usr"
        -DTORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}")
  # shellcheck disable=SC2206 # extra arguments, split on spaces on purpose
  [[ -n ${GPU_CMAKE_ARGS:-} ]] && args+=(${GPU_CMAKE_ARGS})
  # The venv's NCCL (nvidia-nccl-cu*), when the CUDA install has none.
  nccl_dir=$("$torch_py" -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
  if [[ -n $nccl_dir && -f $nccl_dir/include/nccl.h ]]; then
    args+=(-DNCCL_INCLUDE_DIR="$nccl_dir/include" -DNCCL_LIBRARY="$(ls "$nccl_dir"/lib/libnccl.so* | head -n1)")
  fi
  [[ -x /usr/local/cuda/bin/nvcc ]] && args+=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
  cmake "${args[@]}"
}

# What the lane needs (GPU_TARGETS=all builds everything): the GPU tests,
# the trainer suites run after them, and the benchmark.
targets=${GPU_TARGETS:-nccl_group_test troupe_cuda_trainer_test troupe_tensor_collectives_test troupe_trainer_unit_test troupe_trainer_job_test troupe_open_trainer_test troupe_bench_gpu_train}

build_all() {
  env_for_prefix
  # shellcheck disable=SC2086 # a list of targets
  # -k 0: a target that fails to compile does not stop the others, so the
  # tests and the benchmark that did build still run.
  local rc=0
  cmake --build "$build" -j"$jobs" ${targets:+--target $targets} -- -k 0 || rc=$?
  # How the binaries reach libstdc++ (docs/runtime.md: PyPI's libtorch.so
  # exports std::filesystem functions of its own).
  local probe=$build/tests/trainer/troupe_trainer_job_test
  local cxx
  cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build/CMakeCache.txt")
  if [[ -x $probe && -n $cxx ]]; then
    echo "libstdc++ of $cxx: $("$cxx" -print-file-name=libstdc++.so) (static: $("$cxx" -print-file-name=libstdc++.a))"
    echo "NEEDED of $(basename "$probe"): $(readelf -d "$probe" | awk '/NEEDED/ {printf "%s ", $5}')"
  fi
  return $rc
}

run_gpu_tests() {
  env_for_prefix
  # torch.load checks and TorchScript files need a python with torch.
  export TROUPE_TEST_PYTHON=$torch_py
  ctest --test-dir "$build" -L gpu --output-on-failure --timeout "${GPU_TEST_TIMEOUT:-180}" -j2
}

run_suites() {
  env_for_prefix
  export TROUPE_TEST_PYTHON=$torch_py
  # The digits data (TrainJobTest.CnnWithBatchNormTrainsOnDigits), carried
  # by the bundle where the machine has no scikit-learn.
  local digits
  digits=$(dirname "$bundle")/digits.csv.gz
  [[ -f $digits && -z ${TROUPE_DIGITS_PATH:-} ]] && export TROUPE_DIGITS_PATH=$digits
  # -R matches test names (gtest's Suite.Case), not binaries.
  local suites='TrainJobTest|OpenTrainerTest|OptimizerTest|ModelTest|GradientReducerTest|ShmGroupTest'
  suites+='|SyncBatchNormTest|GradClipTest|ScheduleTest|TensorCollectivesTest'
  ctest --test-dir "$build" -LE gpu -R "${GPU_SUITES:-$suites}" \
    --output-on-failure --timeout "${GPU_TEST_TIMEOUT:-180}" -j4
}

run_tests() { local rc=0; run_gpu_tests || rc=$?; run_suites || rc=$?; return $rc; }

run_bench() {
  env_for_prefix
  # shellcheck disable=SC2086 # extra arguments, split on spaces on purpose
  timeout -k 10 "${GPU_BENCH_TIMEOUT:-300}" "$build/bench/troupe_bench_gpu_train" --python "$torch_py" ${GPU_BENCH_ARGS:-} | tee -a "$out/gpu_train.jsonl"
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
  gpu_tests) stage unpack unpack && stage gpu_tests run_gpu_tests ;;
  suites) stage unpack unpack && stage suites run_suites ;;
  bench) stage unpack unpack && stage bench run_bench ;;
  # The GPU tests, then the benchmark (the figures the lane is for), then
  # the CPU suites against this LibTorch; a failing stage stops none after it.
  all) stage unpack unpack && stage configure configure && {
      rc=0
      stage build build_all || rc=1
      stage gpu_tests run_gpu_tests || rc=1
      stage bench run_bench || rc=1
      stage suites run_suites || rc=1
      exit $rc
    } ;;
  *) echo "unknown stage '$1' (unpack|configure|build|test|gpu_tests|suites|bench|all)" >&2; exit 2 ;;
esac
