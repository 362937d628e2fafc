# Finds troupe's dependencies and resolves the AUTO feature options.
find_package(Threads REQUIRED)
find_package(CapnProto CONFIG REQUIRED)
find_package(TBB CONFIG REQUIRED)
find_package(spdlog CONFIG REQUIRED)
find_package(OpenSSL REQUIRED)
find_package(Gloo CONFIG REQUIRED)
find_package(nlohmann_json CONFIG REQUIRED)

find_path(ASIO_INCLUDE_DIR asio.hpp REQUIRED)
add_library(troupe_asio INTERFACE)
target_include_directories(troupe_asio SYSTEM INTERFACE ${ASIO_INCLUDE_DIR})
target_compile_definitions(troupe_asio INTERFACE ASIO_STANDALONE ASIO_NO_DEPRECATED)
target_link_libraries(troupe_asio INTERFACE Threads::Threads)

find_path(CLI11_INCLUDE_DIR CLI/CLI.hpp REQUIRED)

function(troupe_resolve_auto var found)
  if(${var} STREQUAL "AUTO")
    if(${found})
      set(${var} ON PARENT_SCOPE)
    else()
      set(${var} OFF PARENT_SCOPE)
    endif()
  elseif(${var} AND NOT ${found})
    message(FATAL_ERROR "${var}=ON but the dependency was not found")
  endif()
endfunction()

if(NOT DEFINED CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
  set(CUDAToolkit_ROOT /usr/local/cuda)
endif()
find_package(CUDAToolkit QUIET)
troupe_resolve_auto(TROUPE_WITH_CUDA CUDAToolkit_FOUND)

set(_nccl_found OFF)
if(TROUPE_WITH_CUDA)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64)
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(_nccl_found ON)
  endif()
endif()
troupe_resolve_auto(TROUPE_WITH_NCCL _nccl_found)
if(TROUPE_WITH_NCCL)
  # By target name, not path: the exported troupe::collective then names
  # troupe::nccl, which troupeConfig.cmake finds again where the package is
  # used (a path from this machine would be wrong on another).
  add_library(troupe::nccl UNKNOWN IMPORTED)
  set_target_properties(troupe::nccl PROPERTIES IMPORTED_LOCATION ${NCCL_LIBRARY})
endif()

# LibTorch. Default: the system's (Debian's 1.13) through its TorchConfig.
# TROUPE_TORCH_ROOT names another LibTorch, e.g. a PyTorch 2.x wheel's torch/
# folder (scripts/torch2_check.sh) or the GPU machine's
# torch.utils.cmake_prefix_path/../.. . A CUDA-built wheel's TorchConfig wants
# libtorch_cuda and the CUDA toolkit; when either is absent (a CPU machine
# building against the CUDA wheel), import torch_cpu + c10 directly instead,
# so the same headers and CPU kernels are tested. 1.13 vs 2.x source
# differences live in trainer/torch_compat.h, never here.
set(TROUPE_TORCH_ROOT "" CACHE PATH "LibTorch to build against (folder holding include/, lib/, share/cmake/)")
set(TROUPE_TORCH_KIND "system")
function(troupe_import_torch_cpu root)
  # A build folder configured before against another LibTorch (another
  # version's folder): find this one's libraries and link its headers
  # afresh, rather than keep the cached ones.
  set(inc ${CMAKE_BINARY_DIR}/torch-include)
  if(DEFINED TROUPE_TORCH_IMPORTED_ROOT AND NOT TROUPE_TORCH_IMPORTED_ROOT STREQUAL root)
    unset(TROUPE_TORCH_torch_cpu_LIB CACHE)
    unset(TROUPE_TORCH_c10_LIB CACHE)
    file(REMOVE_RECURSE ${inc})  # the links, never what they point at
  endif()
  set(TROUPE_TORCH_IMPORTED_ROOT ${root} CACHE INTERNAL "the LibTorch whose torch_cpu and c10 are imported")
  foreach(lib torch_cpu c10)
    find_library(TROUPE_TORCH_${lib}_LIB ${lib} PATHS ${root}/lib NO_DEFAULT_PATH REQUIRED)
  endforeach()
  # The wheel's include/ also carries its own fmt (12.x), which would shadow
  # the system fmt that spdlog was built against (9.x on Debian 12) for every
  # file that includes both. c10/ATen/torch's API headers do not use fmt, so
  # the build sees the wheel's include/ through a folder of links to all of
  # it but fmt.
  file(MAKE_DIRECTORY ${inc})
  file(GLOB entries RELATIVE ${root}/include ${root}/include/*)
  foreach(e IN LISTS entries)
    if(NOT e STREQUAL "fmt" AND NOT IS_SYMLINK ${inc}/${e})
      file(CREATE_LINK ${root}/include/${e} ${inc}/${e} SYMBOLIC)
    endif()
  endforeach()
  add_library(troupe_torch_cpu INTERFACE IMPORTED GLOBAL)
  target_include_directories(troupe_torch_cpu SYSTEM INTERFACE
    ${inc} ${root}/include/torch/csrc/api/include)
  target_link_libraries(troupe_torch_cpu INTERFACE
    ${TROUPE_TORCH_torch_cpu_LIB} ${TROUPE_TORCH_c10_LIB} Threads::Threads)
  # A CUDA-built libtorch_cpu names libcudart/libcupti; on a CPU machine they
  # are absent and only reached through CUDA calls troupe never makes there.
  target_link_options(troupe_torch_cpu INTERFACE LINKER:--allow-shlib-undefined)
  set(TORCH_LIBRARIES troupe_torch_cpu PARENT_SCOPE)
endfunction()
if(TROUPE_WITH_TORCH AND TROUPE_TORCH_ROOT)
  # PyPI's libtorch.so exports copies of libstdc++ functions (std::filesystem
  # among them) built by its own toolchain; with libtorch ahead of libstdc++
  # in DT_NEEDED, ours bind to those and crash (remove_all jumped to 0 on the
  # GPU machine). Naming libstdc++ first makes every lookup find it first.
  add_link_options(LINKER:--push-state,--no-as-needed -lstdc++ LINKER:--pop-state)
  if(NOT EXISTS ${TROUPE_TORCH_ROOT}/include/torch/torch.h AND
     NOT EXISTS ${TROUPE_TORCH_ROOT}/include/torch/csrc/api/include/torch/torch.h)
    message(FATAL_ERROR "TROUPE_TORCH_ROOT=${TROUPE_TORCH_ROOT} holds no LibTorch headers")
  endif()
  # troupe links Debian's libraries (spdlog, capnp, TBB, ...), built with
  # the C++11 std::string ABI. A LibTorch built with the old one
  # (_GLIBCXX_USE_CXX11_ABI=0) cannot share a std::string with them: every
  # torch binary would fail to link, naming c10::detail::torchCheckFail.
  # Its libc10 exports that function in the old mangling ("RKSs").
  if(EXISTS ${TROUPE_TORCH_ROOT}/lib/libc10.so)
    file(STRINGS ${TROUPE_TORCH_ROOT}/lib/libc10.so _torch_old_abi LIMIT_COUNT 1
      REGEX "_ZN3c106detail14torchCheckFailEPKcS2_jRKSs")
    if(_torch_old_abi)
      message(FATAL_ERROR "TROUPE_TORCH_ROOT=${TROUPE_TORCH_ROOT} is a LibTorch built with the pre-C++11 "
        "std::string ABI (_GLIBCXX_USE_CXX11_ABI=0: its lib/libc10.so exports c10::detail::torchCheckFail "
        "with the old std::string), and troupe links libraries built with the C++11 ABI. Use a LibTorch "
        "built with the C++11 ABI (PyPI's torch 2.11.0 manylinux_2_28 wheel is one; scripts/torch2_check.sh "
        "downloads it).")
    endif()
  endif()
  file(GLOB _torch_cuda_libs ${TROUPE_TORCH_ROOT}/lib/libtorch_cuda*.so)
  if(_torch_cuda_libs AND TROUPE_WITH_CUDA AND NOT CUDAToolkit_FOUND)
    message(WARNING "TROUPE_TORCH_ROOT has libtorch_cuda but no CUDA toolkit was found")
  endif()
  # -DTROUPE_WITH_CUDA=OFF builds for the CPU against a CUDA wheel even where
  # a CUDA toolkit is installed (its NCCL may not be the one libtorch_cuda
  # was linked against).
  if(_torch_cuda_libs AND CUDAToolkit_FOUND AND TROUPE_WITH_CUDA)
    # TorchConfig finds Caffe2 and its libraries with PATHS, which come after
    # the system's: without this a machine that also has Debian's LibTorch
    # would mix the two.
    list(PREPEND CMAKE_PREFIX_PATH ${TROUPE_TORCH_ROOT})
    set(Caffe2_DIR ${TROUPE_TORCH_ROOT}/share/cmake/Caffe2)
    find_package(Torch CONFIG REQUIRED PATHS ${TROUPE_TORCH_ROOT}/share/cmake/Torch NO_DEFAULT_PATH)
    set(TROUPE_TORCH_KIND "config")
  else()
    troupe_import_torch_cpu(${TROUPE_TORCH_ROOT})
    set(TROUPE_TORCH_KIND "cpu-import")
  endif()
elseif(TROUPE_WITH_TORCH)
  find_package(Torch CONFIG REQUIRED)
endif()

# The shim is built against /usr/bin/python3, the interpreter that has
# Debian's torch and numpy (the first python3 on PATH may be another one).
if(NOT DEFINED Python3_EXECUTABLE AND EXISTS /usr/bin/python3)
  set(Python3_EXECUTABLE /usr/bin/python3)
endif()
set(_py_found OFF)
if(NOT TROUPE_WITH_PYTHON STREQUAL "OFF")
  find_package(Python3 COMPONENTS Interpreter Development.Module QUIET)
  find_package(pybind11 CONFIG QUIET)
  if(Python3_FOUND AND pybind11_FOUND)
    set(_py_found ON)
  endif()
endif()
troupe_resolve_auto(TROUPE_WITH_PYTHON _py_found)

message(STATUS "troupe: CUDA=${TROUPE_WITH_CUDA} NCCL=${TROUPE_WITH_NCCL} PYTHON=${TROUPE_WITH_PYTHON} TORCH=${TROUPE_WITH_TORCH} (${TROUPE_TORCH_KIND} ${TROUPE_TORCH_ROOT})")
