// Buffer: an immutable, reference-counted block of bytes. Frame attachments
// (tensors, batches) are Buffers, so they can be written with scatter/gather
// I/O straight from the memory that owns them, without copies.
#pragma once

#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace troupe {

class Buffer {
 public:
  Buffer() = default;
  // Views memory kept alive by `owner`.
  Buffer(std::shared_ptr<const void> owner, const std::byte* data, size_t size)
      : owner_(std::move(owner)), data_(data), size_(size) {}

  // Takes ownership of a vector of bytes.
  static Buffer from_vector(std::vector<std::byte> v) {
    auto p = std::make_shared<std::vector<std::byte>>(std::move(v));
    return Buffer(p, p->data(), p->size());
  }
  // Copies `size` bytes.
  static Buffer copy(const void* data, size_t size) {
    std::vector<std::byte> v(size);
    if (size) std::memcpy(v.data(), data, size);
    return from_vector(std::move(v));
  }
  static Buffer from_string(const std::string& s) { return copy(s.data(), s.size()); }
  // Allocates `size` uninitialised bytes and returns them with a writable
  // pointer (used by readers that fill an attachment from the socket).
  static Buffer allocate(size_t size, std::byte** writable) {
    std::shared_ptr<std::byte[]> p(new std::byte[size ? size : 1]);
    *writable = p.get();
    return Buffer(std::shared_ptr<const void>(p, p.get()), p.get(), size);
  }

  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const std::shared_ptr<const void>& owner() const { return owner_; }
  std::string to_string() const { return std::string(reinterpret_cast<const char*>(data_), size_); }

 private:
  std::shared_ptr<const void> owner_;
  const std::byte* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace troupe
