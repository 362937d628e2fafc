// Codec<torch::Tensor>: how tensors cross the wire in the torch-aware layers
// (DESIGN.md §3). A tensor travels as its dtype, its shape and its bytes in a
// troupe::Buffer; buffers of 16 KiB and more go as frame attachments, so a
// batch's pixels are written from the tensor's own memory (no copy of a
// contiguous CPU tensor) and the decoded tensor is a view of the received
// attachment (no copy either). Include this header wherever a value holding
// tensors (Batch, Sample, user structs) is encoded or decoded.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <torch/types.h>

#include "troupe/runtime/core/buffer.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/wire/codec.h"

namespace troupe::wire {

template <>
struct Codec<at::Tensor> {
  static void encode(Encoder& e, const at::Tensor& t) {
    if (!t.defined()) {
      e.write_pod<uint8_t>(0);
      return;
    }
    e.write_pod<uint8_t>(1);
    // Device memory and non-contiguous views are made into a contiguous CPU
    // tensor first; that one owns the bytes the Buffer points at.
    auto c = t.detach().to(at::kCPU).contiguous();
    e.write_pod<int8_t>(static_cast<int8_t>(c.scalar_type()));
    e.write_size(static_cast<uint64_t>(c.dim()));
    for (int64_t d : c.sizes()) e.write_pod<int64_t>(d);
    size_t bytes = c.numel() * c.element_size();
    auto owner = std::make_shared<at::Tensor>(c);
    troupe::wire::encode(
        e, Buffer(std::shared_ptr<const void>(owner, owner.get()), static_cast<const std::byte*>(c.data_ptr()), bytes));
  }

  static at::Tensor decode(Decoder& d) {
    auto tag = d.read_pod<uint8_t>();
    if (tag == 0) return {};
    if (tag != 1) throw DecodeError("bad tensor tag " + std::to_string(tag));
    auto type = d.read_pod<int8_t>();
    if (type < 0 || type >= static_cast<int8_t>(at::ScalarType::NumOptions)) {
      throw DecodeError("bad tensor dtype " + std::to_string(type));
    }
    auto dtype = static_cast<at::ScalarType>(type);
    auto dim = d.read_size();
    if (dim > 64) throw DecodeError("tensor with " + std::to_string(dim) + " dimensions");
    std::vector<int64_t> shape(dim);
    uint64_t numel = 1;
    for (auto& s : shape) {
      s = d.read_pod<int64_t>();
      if (s < 0 || (s > 0 && numel > (uint64_t(1) << 48) / uint64_t(s))) {
        throw DecodeError("bad tensor dimension " + std::to_string(s));
      }
      numel *= uint64_t(s);
    }
    Buffer b = troupe::wire::decode<Buffer>(d);
    size_t item = c10::elementSize(dtype);
    if (b.size() != numel * item) {
      throw DecodeError("tensor bytes " + std::to_string(b.size()) + " do not match its shape (" +
                        std::to_string(numel * item) + " expected)");
    }
    auto options = at::TensorOptions().dtype(dtype);
    if (numel == 0 || reinterpret_cast<uintptr_t>(b.data()) % item != 0) {
      auto t = at::empty(shape, options);
      if (numel) std::memcpy(t.data_ptr(), b.data(), b.size());
      return t;
    }
    // A view of the received bytes; the Buffer's owner lives as long as the
    // tensor. Buffers are immutable, but the view is writable: the receiver
    // holds the only reference to a freshly received attachment.
    auto owner = b.owner();
    return at::from_blob(
        const_cast<std::byte*>(b.data()), shape, [owner](void*) mutable { owner.reset(); }, options);
  }
};

}  // namespace troupe::wire
