# Precompiled headers, so that each build parses the heavy headers once per
# kind of target instead of once per file. Measured on the 2-core machine
# (scripts/ci_times.sh prints a build's slowest files): LibTorch's headers
# take ~25 s to parse per file, Asio + nlohmann-json + Cap'n Proto + spdlog
# ~6 s.
#
# Two header sets: "runtime" (those the runtime's own headers use) and
# "torch" (the runtime set plus <torch/torch.h>). GCC refuses a precompiled
# header made with another -fpie setting, and CMake compiles libraries with
# -fPIC and executables with -fPIE, so each set is precompiled twice:
#   runtime: by troupe_runtime (libraries) and troupe_pch_runtime (executables)
#   torch:   by troupe_actors  (libraries) and troupe_pch_torch   (executables)
# troupe_pch_* are stub executables that are never linked: targets reuse
# their header (CMake's REUSE_FROM), whose build ninja orders before them.
set(TROUPE_PCH_RUNTIME_HEADERS
  <asio.hpp> <nlohmann/json.hpp> <spdlog/spdlog.h> <capnp/message.h> <capnp/serialize.h>
  <atomic> <chrono> <condition_variable> <deque> <filesystem> <functional> <map> <memory>
  <mutex> <optional> <set> <string> <thread> <unordered_map> <vector>)
set(TROUPE_PCH_TORCH_HEADERS ${TROUPE_PCH_RUNTIME_HEADERS} <torch/torch.h> <torch/script.h>)

# troupe_pch_host(target runtime|torch): TARGET precompiles the set.
function(troupe_pch_host target set)
  string(TOUPPER ${set} up)
  target_precompile_headers(${target} PRIVATE ${TROUPE_PCH_${up}_HEADERS})
endfunction()

# troupe_pch_stub(runtime|torch LIBS...): the executables' host of the set.
# It takes LIBS' usage requirements so that its header compiles with its
# users' definitions; EXCLUDE_FROM_ALL: only its header is ever built.
function(troupe_pch_stub set)
  add_executable(troupe_pch_${set} EXCLUDE_FROM_ALL ${PROJECT_SOURCE_DIR}/cmake/pch_stub.cc)
  target_link_libraries(troupe_pch_${set} PRIVATE ${ARGN})
  troupe_pch_host(troupe_pch_${set} ${set})
endfunction()

# troupe_use_pch(runtime|torch targets...): each target's files include the
# set's precompiled header (the stub's for executables, the library host's
# otherwise).
function(troupe_use_pch set)
  if(set STREQUAL "torch")
    set(lib_host troupe_actors)
  else()
    set(lib_host troupe_runtime)
  endif()
  foreach(t ${ARGN})
    get_target_property(type ${t} TYPE)
    if(type STREQUAL "EXECUTABLE")
      target_precompile_headers(${t} REUSE_FROM troupe_pch_${set})
    else()
      target_precompile_headers(${t} REUSE_FROM ${lib_host})
    endif()
  endforeach()
endfunction()
