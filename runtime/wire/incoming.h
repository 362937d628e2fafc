// Memory for bytes a connection is receiving. A frame header announces how
// much is coming, but an announcement costs nothing: buffers grow with the
// bytes that actually arrive (at most about twice what arrived plus one read
// chunk; for large attachments, pages are committed as they are written,
// at most one 2 MiB huge page ahead), so a peer that announces 64 MiB or a
// 4 GiB attachment and then stalls commits only about what it sent.
#pragma once

#include <cstddef>
#include <utility>

#include "troupe/runtime/core/buffer.h"

namespace troupe::wire {

// The capacity a read buffer should have before the next read, given its
// `capacity`, the `filled` bytes it holds and the `expected` bytes the frame
// in progress needs in all (0 when not yet known). Keeps at least chunk/2
// bytes of room, grows by doubling but never past max(expected, filled +
// chunk), and returns `chunk` once an oversized buffer is empty, so the
// memory of a large frame goes back after it.
size_t grown_capacity(size_t capacity, size_t filled, size_t expected, size_t chunk);

// One attachment being received: `size` bytes announced, memory allocated
// as they arrive. Small blocks grow with realloc (which remaps rather than
// copies large blocks); from kMappedFrom bytes announced, the block is a
// mapping aligned for transparent huge pages that grows, as realloc would,
// in whole huge pages (the pages received so far are moved, not copied).
// Neither reserves address space for what has not arrived.
class IncomingBlock {
 public:
  static constexpr size_t kMappedFrom = size_t{4} << 20;

  explicit IncomingBlock(size_t size) : size_(size) {}
  ~IncomingBlock();
  IncomingBlock(IncomingBlock&& other) noexcept;
  IncomingBlock& operator=(IncomingBlock&&) = delete;
  IncomingBlock(const IncomingBlock&) = delete;
  IncomingBlock& operator=(const IncomingBlock&) = delete;

  // Where the next bytes go: room for up to `chunk` more (grown by
  // grown_capacity), never past the announced size. Throws
  // troupe::DecodeError naming the size when memory cannot be had.
  std::pair<std::byte*, size_t> room(size_t chunk);
  // `n` bytes were written at room().first.
  void commit(size_t n) { filled_ += n; }
  bool complete() const { return filled_ == size_; }
  size_t size() const { return size_; }
  size_t filled() const { return filled_; }
  size_t capacity() const { return capacity_; }
  // The finished block, as an immutable Buffer (call once, when complete).
  Buffer take();

 private:
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  size_t filled_ = 0;
  size_t capacity_ = 0;
  size_t mapped_ = 0;  // length of the mapping when reserved, 0 when malloc'd

  bool grow_mapped(size_t want);
  void grow_malloced(size_t want);
};

}  // namespace troupe::wire
