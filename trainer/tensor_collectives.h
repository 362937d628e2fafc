// Collectives on torch::Tensors: a thin layer over troupe::collective::Group
// that checks what the raw-pointer interface cannot (the tensor is defined
// and contiguous, its dtype has a collective element type, its device
// matches the group's backend: CPU tensors go to a GlooGroup, CUDA tensors
// to an NcclGroup) and keeps the tensors alive until the operation is done.
// Every check failure throws troupe::ConfigError naming the operation, the
// dtype or device found and what was expected.
//
//   auto g = collective::join_group(spec);            // gloo: CPU tensors
//   trainer::allreduce(*g, grad, {.op = collective::ReduceOp::kAvg})->wait();
//
// DeviceGroups routes a tensor to the group of its device when a member
// holds both kinds.
#pragma once

#include <memory>

#include <torch/types.h>

#include "troupe/runtime/collective/group.h"

namespace troupe::trainer {

// The collective element type of `dtype`; ConfigError naming the dtype when
// it has none (bool, int8, int16, complex, ...).
collective::DType collective_dtype(torch::ScalarType dtype);

// True when `group` moves device memory (an NcclGroup); a gloo group (and a
// ShmGroup over one) moves host memory, so CUDA tensors go through a host
// copy on their way to it.
bool moves_device_memory(collective::Group& group);

// All operations are asynchronous like Group's; the returned Work holds the
// tensors until it completes. In-place operations write into `tensor`.
collective::WorkPtr allreduce(collective::Group& group, const torch::Tensor& tensor,
                              const collective::AllreduceOptions& opts = {});
collective::WorkPtr broadcast(collective::Group& group, const torch::Tensor& tensor, int root,
                              const collective::BroadcastOptions& opts = {});
// `out` holds world_size * input.numel() elements of input's dtype (any
// shape); rank r's input lands in block r.
collective::WorkPtr allgather(collective::Group& group, const torch::Tensor& input, const torch::Tensor& out,
                              const collective::AllgatherOptions& opts = {});
// `input` holds world_size * out.numel() elements; rank r's `out` receives
// the reduction of block r.
collective::WorkPtr reduce_scatter(collective::Group& group, const torch::Tensor& input, const torch::Tensor& out,
                                   const collective::ReduceScatterOptions& opts = {});
collective::WorkPtr send(collective::Group& group, const torch::Tensor& tensor, int dst,
                         const collective::SendOptions& opts = {});
collective::WorkPtr recv(collective::Group& group, const torch::Tensor& tensor, int src,
                         const collective::RecvOptions& opts = {});

// A member's groups by device kind, for code that moves both host and
// device tensors. Either may be null when the member has no such group.
struct DeviceGroups {
  std::shared_ptr<collective::Group> cpu;   // a GlooGroup
  std::shared_ptr<collective::Group> cuda;  // an NcclGroup

  // The group for `tensor`'s device; ConfigError when there is none.
  collective::Group& for_tensor(const torch::Tensor& tensor) const;
};

}  // namespace troupe::trainer
