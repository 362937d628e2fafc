// The memory behind NpyArrays (internal to npy.cc and npz.cc): a read-only
// file mapping, or bytes held in memory (an inflated .npz member).
#pragma once

#include <sys/mman.h>
#include <sys/stat.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "troupe/actors/npy.h"

namespace troupe::actors {

struct NpyArray::Mapping {
  // The whole file at `path`, mapped read-only. Errors name it as `kind`
  // ("npy file", "npz file", "raw token file": what the caller reads it as).
  static std::shared_ptr<Mapping> map(const std::string& path, const std::string& kind);

  // The bytes: `base`, or for a lazy mapping `fill`'s result, made on the
  // first call (from any thread; a throwing fill is retried next time).
  const std::byte* bytes() const {
    if (!lazy) return static_cast<const std::byte*>(base);
    std::call_once(filled, [this] {
      owned = fill();
      fill = nullptr;  // and what it held (the archive's mapping)
    });
    return owned.data();
  }

  // Throws ConfigError when the mapped file was written in place since it
  // was mapped (its size or modification time changed, same inode): what
  // the mapping reads then is partly the new file, zeros past a shorter
  // end, or SIGBUS. A file replaced by a rename is not this one: the
  // mapping keeps the old. Looks at most every 100 ms; a no-op for bytes
  // held in memory.
  void check_unchanged(bool now = false) const;

  void* base = nullptr;
  size_t size = 0;
  bool mapped = false;  // base came from mmap
  // What check_unchanged() compares (a mapped file's).
  std::string path, kind;
  struct stat mapped_stat {};
  mutable std::atomic<int64_t> next_check_ns{0};
  // A deflated .npz member is inflated only when its data is first read:
  // a process that only asks for shapes (a driver counting samples, a
  // trainer fed by loaders) holds no inflated copy.
  bool lazy = false;
  mutable std::function<std::vector<std::byte>()> fill;
  mutable std::once_flag filled;
  mutable std::vector<std::byte> owned;
  ~Mapping() {
    if (mapped) munmap(base, size);
  }
};

}  // namespace troupe::actors
