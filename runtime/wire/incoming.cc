#include "troupe/runtime/wire/incoming.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "troupe/runtime/core/errors.h"

namespace troupe::wire {

size_t grown_capacity(size_t capacity, size_t filled, size_t expected, size_t chunk) {
  if (filled == 0 && capacity > 4 * chunk) return chunk;
  if (capacity >= filled && capacity - filled >= chunk / 2) return capacity;
  size_t grown = std::max(2 * capacity, filled + chunk);
  if (expected > 0) grown = std::min(grown, std::max(expected, filled + chunk));
  return grown;
}

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// Maps `len` bytes at a huge-page boundary, asking for transparent huge
// pages: nothing is committed until written, and a 64 MiB attachment then
// faults 32 times instead of 16,384 (a fresh 4 KiB page per fault made a
// large receive cost as much as the copy itself). nullptr when the address
// space cannot be had.
std::byte* reserve_huge(size_t len) {
  size_t span = len + kHugePage;
  void* p = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  auto start = reinterpret_cast<uintptr_t>(p);
  uintptr_t aligned = round_up(start, kHugePage);
  if (aligned > start) ::munmap(p, aligned - start);
  size_t tail = (start + span) - (aligned + len);
  if (tail > 0) ::munmap(reinterpret_cast<void*>(aligned + len), tail);
  ::madvise(reinterpret_cast<void*>(aligned), len, MADV_HUGEPAGE);  // advice: failure is harmless
  return reinterpret_cast<std::byte*>(aligned);
}

// Mappings of received attachments that were let go, kept for the next
// large attachment: a stream of batches or a series of large objects then
// writes into pages that are already there instead of faulting in and
// zeroing fresh ones for every item (which cost the reader more than the
// copy from the socket). Bounded in bytes and entries; a kept mapping is
// marked MADV_FREE, so under memory pressure the kernel may take its pages
// back (a reuse then faults them in again).
class MappingCache {
 public:
  static constexpr size_t kMaxBytes = size_t{256} << 20;
  static constexpr size_t kMaxEntries = 8;

  // A kept mapping of at least `len` bytes and at most twice that, or
  // {nullptr, 0}.
  std::pair<std::byte*, size_t> take(size_t len) {
    std::lock_guard lock(mu_);
    // The most recently kept first: its pages are the likeliest still there.
    for (auto it = kept_.rbegin(); it != kept_.rend(); ++it) {
      if (it->second < len || it->second > 2 * len) continue;
      auto found = *it;
      kept_.erase(std::next(it).base());
      bytes_ -= found.second;
      return found;
    }
    return {nullptr, 0};
  }

  void put(std::byte* p, size_t len) {
    if (len > kMaxBytes / 2) {
      ::munmap(p, len);
      return;
    }
    ::madvise(p, len, MADV_FREE);
    std::vector<std::pair<std::byte*, size_t>> evicted;
    {
      std::lock_guard lock(mu_);
      while (!kept_.empty() && (bytes_ + len > kMaxBytes || kept_.size() >= kMaxEntries)) {
        evicted.push_back(kept_.front());
        bytes_ -= kept_.front().second;
        kept_.erase(kept_.begin());
      }
      kept_.emplace_back(p, len);
      bytes_ += len;
    }
    for (auto [q, n] : evicted) ::munmap(q, n);
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<std::byte*, size_t>> kept_;  // oldest first
  size_t bytes_ = 0;
};

// Never destroyed: buffers may be released during static destruction.
MappingCache& mapping_cache() {
  static auto* cache = new MappingCache;
  return *cache;
}

void release(std::byte* p, size_t mapped) {
  if (mapped > 0)
    mapping_cache().put(p, mapped);
  else
    std::free(p);
}

}  // namespace

IncomingBlock::~IncomingBlock() { release(data_, mapped_); }

IncomingBlock::IncomingBlock(IncomingBlock&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(other.size_),
      filled_(std::exchange(other.filled_, 0)),
      capacity_(std::exchange(other.capacity_, 0)),
      mapped_(std::exchange(other.mapped_, 0)) {}

std::pair<std::byte*, size_t> IncomingBlock::room(size_t chunk) {
  if (capacity_ - filled_ < chunk / 2 || capacity_ == filled_) {
    size_t want = std::min(size_, grown_capacity(capacity_, filled_, size_, chunk));
    if (want > capacity_) {
      // A large attachment starts as a mapping and stays one; a small one,
      // or one whose first mapping failed, is malloc'd.
      if (mapped_ > 0) {
        if (!grow_mapped(want))
          throw DecodeError("cannot reserve " + std::to_string(want) + " bytes for an attachment of " +
                            std::to_string(size_) + " bytes");
      } else if (data_ != nullptr || size_ < kMappedFrom || !grow_mapped(want)) {
        grow_malloced(want);
      }
      capacity_ = want;
    }
  }
  return {data_ + filled_, capacity_ - filled_};
}

// Address space for `want` bytes, in whole huge pages: a new aligned
// mapping, onto whose start the pages received so far are moved (mremap
// moves page tables, not bytes). False when no address space is left.
bool IncomingBlock::grow_mapped(size_t want) {
  size_t len = round_up(want, kHugePage);
  if (len <= mapped_) return true;
  if (data_ == nullptr) {
    // A kept mapping that holds the whole announced size commits nothing
    // new, whatever the peer sends.
    auto [p, n] = mapping_cache().take(round_up(size_, kHugePage));
    if (p != nullptr) {
      data_ = p;
      mapped_ = n;
      return true;
    }
  }
  std::byte* p = reserve_huge(len);
  if (p == nullptr) return false;
  if (data_ != nullptr &&
      ::mremap(data_, mapped_, mapped_, MREMAP_MAYMOVE | MREMAP_FIXED, p) == MAP_FAILED) {
    std::memcpy(p, data_, filled_);
    ::munmap(data_, mapped_);
  }
  data_ = p;
  mapped_ = len;
  return true;
}

void IncomingBlock::grow_malloced(size_t want) {
  void* p = std::realloc(data_, want);
  if (!p)
    throw DecodeError("cannot allocate " + std::to_string(want) + " bytes for an attachment of " +
                      std::to_string(size_) + " bytes");
  data_ = static_cast<std::byte*>(p);
}

Buffer IncomingBlock::take() {
  std::byte* p = std::exchange(data_, nullptr);
  size_t n = filled_;
  size_t mapped = std::exchange(mapped_, 0);
  filled_ = capacity_ = 0;
  std::shared_ptr<std::byte> owner(p, [mapped](std::byte* q) { release(q, mapped); });
  return Buffer(std::shared_ptr<const void>(owner, p), p, n);
}

}  // namespace troupe::wire
