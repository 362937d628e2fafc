#include "troupe/runtime/wire/incoming.h"

#include <algorithm>
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

IncomingBlock::~IncomingBlock() { std::free(data_); }

IncomingBlock::IncomingBlock(IncomingBlock&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(other.size_),
      filled_(std::exchange(other.filled_, 0)),
      capacity_(std::exchange(other.capacity_, 0)) {}

std::pair<std::byte*, size_t> IncomingBlock::room(size_t chunk) {
  if (capacity_ - filled_ < chunk / 2 || capacity_ == filled_) {
    size_t want = std::min(size_, grown_capacity(capacity_, filled_, size_, chunk));
    if (want > capacity_) {
      void* p = std::realloc(data_, want);
      if (!p)
        throw DecodeError("cannot allocate " + std::to_string(want) + " bytes for an attachment of " +
                          std::to_string(size_) + " bytes");
      data_ = static_cast<std::byte*>(p);
      capacity_ = want;
    }
  }
  return {data_ + filled_, capacity_ - filled_};
}

Buffer IncomingBlock::take() {
  std::byte* p = std::exchange(data_, nullptr);
  size_t n = filled_;
  filled_ = capacity_ = 0;
  std::shared_ptr<std::byte> owner(p, [](std::byte* q) { std::free(q); });
  return Buffer(std::shared_ptr<const void>(owner, p), p, n);
}

}  // namespace troupe::wire
