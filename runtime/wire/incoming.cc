#include "troupe/runtime/wire/incoming.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

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

// Reserves `len` bytes of address space at a huge-page boundary, asking for
// transparent huge pages: nothing is committed until written, and a 64 MiB
// attachment then faults 32 times instead of 16,384 (a fresh 4 KiB page per
// fault made a large receive cost twice the copy itself). nullptr when the
// address space cannot be had.
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

void release(std::byte* p, size_t mapped) {
  if (mapped > 0)
    ::munmap(p, mapped);
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
    if (data_ == nullptr && size_ >= kMappedFrom) {
      // Address space for the whole announced size; pages are committed
      // only as bytes arrive, so a stalled peer still costs what it sent.
      size_t len = round_up(size_, kHugePage);
      if (std::byte* p = reserve_huge(len)) {
        data_ = p;
        mapped_ = len;
      }
    }
    if (want > capacity_ && mapped_ == 0) {
      void* p = std::realloc(data_, want);
      if (!p)
        throw DecodeError("cannot allocate " + std::to_string(want) + " bytes for an attachment of " +
                          std::to_string(size_) + " bytes");
      data_ = static_cast<std::byte*>(p);
    }
    capacity_ = std::max(capacity_, want);
  }
  return {data_ + filled_, capacity_ - filled_};
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
