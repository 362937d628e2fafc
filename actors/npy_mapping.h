// The memory behind NpyArrays (internal to npy.cc and npz.cc): a read-only
// file mapping, or bytes held in memory (an inflated .npz member).
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "troupe/actors/npy.h"

namespace troupe::actors {

struct NpyArray::Mapping {
  // The whole file at `path`, mapped read-only. Errors name it as `kind`
  // ("npy file", "npz file", "raw token file": what the caller reads it as).
  static std::shared_ptr<Mapping> map(const std::string& path, const std::string& kind);

  void* base = nullptr;
  size_t size = 0;
  bool mapped = false;  // base came from mmap
  std::vector<std::byte> owned;
  ~Mapping() {
    if (mapped) munmap(base, size);
  }
};

}  // namespace troupe::actors
