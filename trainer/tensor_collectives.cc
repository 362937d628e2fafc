#include "troupe/trainer/tensor_collectives.h"

#include <sstream>
#include <string>
#include <vector>

#include "troupe/config.h"
#include "troupe/runtime/collective/gloo_group.h"
#include "troupe/runtime/collective/nccl_group.h"
#include "troupe/runtime/core/errors.h"

namespace troupe::trainer {
namespace {

using collective::Group;
using collective::WorkPtr;

// Keeps the operation's tensors (and so their storage) alive as long as the
// caller holds the Work; the group's contract is that memory stays valid
// until the Work completes.
class TensorWork final : public collective::Work {
 public:
  TensorWork(WorkPtr inner, std::vector<torch::Tensor> tensors)
      : inner_(std::move(inner)), tensors_(std::move(tensors)) {}
  void wait(std::chrono::milliseconds timeout) override { inner_->wait(timeout); }
  bool is_completed() override { return inner_->is_completed(); }

 private:
  WorkPtr inner_;
  std::vector<torch::Tensor> tensors_;
};

enum class Kind { kGloo, kNccl, kOther };

// Of the group that moves the data: a trainer's is join_group's wrapper,
// which alone is neither (an NCCL trainer's SyncBatchNorm staged its
// statistics to host memory and handed NCCL a host pointer).
Kind kind_of(Group& group) {
  Group& backend = group.backend();
  if (dynamic_cast<collective::GlooGroup*>(&backend) != nullptr) return Kind::kGloo;
#if TROUPE_WITH_NCCL
  if (dynamic_cast<collective::NcclGroup*>(&backend) != nullptr) return Kind::kNccl;
#endif
  return Kind::kOther;
}

std::string describe(Group& group) {
  const char* backend = "";
  switch (kind_of(group)) {
    case Kind::kGloo:
      backend = "gloo ";
      break;
    case Kind::kNccl:
      backend = "nccl ";
      break;
    case Kind::kOther:
      break;
  }
  return std::string(backend) + "group '" + group.name() + "'";
}

std::string device_name(const torch::Tensor& t) {
  std::ostringstream s;
  s << t.device();
  return s.str();
}

// The checks every tensor of an operation passes; returns its dtype.
collective::DType check_tensor(const char* op, const char* role, Group& group, const torch::Tensor& t) {
  if (!t.defined()) throw ConfigError(std::string(op) + ": the " + role + " is undefined");
  if (!t.is_contiguous()) {
    throw ConfigError(std::string(op) + ": the " + role +
                      " is not contiguous (collectives use its storage as one block: pass tensor.contiguous()"
                      " and copy the result back)");
  }
  collective::DType dtype;
  try {
    dtype = collective_dtype(t.scalar_type());
  } catch (const ConfigError& e) {
    throw ConfigError(std::string(op) + ": " + e.what());
  }
  const Kind kind = kind_of(group);
  if (kind == Kind::kGloo && !t.device().is_cpu()) {
    throw ConfigError(std::string(op) + ": the " + role + " is on " + device_name(t) + ", but " + describe(group) +
                      " moves host memory: use a CPU tensor or an NCCL group");
  }
  if (kind == Kind::kNccl && !t.device().is_cuda()) {
    throw ConfigError(std::string(op) + ": the " + role + " is on " + device_name(t) + ", but " + describe(group) +
                      " moves device memory: use a CUDA tensor or a gloo group");
  }
  return dtype;
}

void check_pair(const char* op, const torch::Tensor& in, const torch::Tensor& out) {
  if (in.scalar_type() != out.scalar_type()) {
    throw ConfigError(std::string(op) + ": input dtype " + c10::toString(in.scalar_type()) + " and output dtype " +
                      c10::toString(out.scalar_type()) + " differ");
  }
  if (in.device() != out.device()) {
    throw ConfigError(std::string(op) + ": input on " + device_name(in) + " and output on " + device_name(out) +
                      " differ");
  }
}

size_t count_of(const torch::Tensor& t) { return static_cast<size_t>(t.numel()); }

WorkPtr keep(WorkPtr work, std::vector<torch::Tensor> tensors) {
  return std::make_shared<TensorWork>(std::move(work), std::move(tensors));
}

}  // namespace

bool moves_device_memory(Group& group) { return kind_of(group) == Kind::kNccl; }

collective::DType collective_dtype(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kFloat32:
      return collective::DType::kFloat32;
    case torch::kFloat64:
      return collective::DType::kFloat64;
    case torch::kInt32:
      return collective::DType::kInt32;
    case torch::kInt64:
      return collective::DType::kInt64;
    case torch::kBFloat16:
      return collective::DType::kBFloat16;
    case torch::kFloat16:
      return collective::DType::kFloat16;
    case torch::kUInt8:
      return collective::DType::kUInt8;
    default:
      throw ConfigError(std::string("unsupported tensor dtype ") + c10::toString(dtype) +
                        " (collectives take Float, Double, Int, Long, BFloat16, Half and Byte)");
  }
}

WorkPtr allreduce(Group& group, const torch::Tensor& tensor, const collective::AllreduceOptions& opts) {
  auto dtype = check_tensor("allreduce", "tensor", group, tensor);
  return keep(group.allreduce(tensor.data_ptr(), count_of(tensor), dtype, opts), {tensor});
}

WorkPtr broadcast(Group& group, const torch::Tensor& tensor, int root, const collective::BroadcastOptions& opts) {
  auto dtype = check_tensor("broadcast", "tensor", group, tensor);
  return keep(group.broadcast(tensor.data_ptr(), count_of(tensor), dtype, root, opts), {tensor});
}

WorkPtr allgather(Group& group, const torch::Tensor& input, const torch::Tensor& out,
                  const collective::AllgatherOptions& opts) {
  auto dtype = check_tensor("allgather", "input tensor", group, input);
  check_tensor("allgather", "output tensor", group, out);
  check_pair("allgather", input, out);
  if (out.numel() != input.numel() * group.world_size()) {
    throw ConfigError("allgather: the output has " + std::to_string(out.numel()) + " elements, expected " +
                      std::to_string(input.numel()) + " x world size " + std::to_string(group.world_size()));
  }
  return keep(group.allgather(input.data_ptr(), out.data_ptr(), count_of(input), dtype, opts), {input, out});
}

WorkPtr reduce_scatter(Group& group, const torch::Tensor& input, const torch::Tensor& out,
                       const collective::ReduceScatterOptions& opts) {
  auto dtype = check_tensor("reduce_scatter", "input tensor", group, input);
  check_tensor("reduce_scatter", "output tensor", group, out);
  check_pair("reduce_scatter", input, out);
  if (input.numel() != out.numel() * group.world_size()) {
    throw ConfigError("reduce_scatter: the input has " + std::to_string(input.numel()) + " elements, expected " +
                      std::to_string(out.numel()) + " x world size " + std::to_string(group.world_size()));
  }
  return keep(group.reduce_scatter(input.data_ptr(), out.data_ptr(), count_of(out), dtype, opts), {input, out});
}

WorkPtr send(Group& group, const torch::Tensor& tensor, int dst, const collective::SendOptions& opts) {
  auto dtype = check_tensor("send", "tensor", group, tensor);
  return keep(group.send(tensor.data_ptr(), count_of(tensor), dtype, dst, opts), {tensor});
}

WorkPtr recv(Group& group, const torch::Tensor& tensor, int src, const collective::RecvOptions& opts) {
  auto dtype = check_tensor("recv", "tensor", group, tensor);
  return keep(group.recv(tensor.data_ptr(), count_of(tensor), dtype, src, opts), {tensor});
}

Group& DeviceGroups::for_tensor(const torch::Tensor& tensor) const {
  if (!tensor.defined()) throw ConfigError("no collective group for an undefined tensor");
  if (tensor.device().is_cuda()) {
    if (!cuda) throw ConfigError("a tensor on " + device_name(tensor) + " needs an NCCL group, and there is none");
    return *cuda;
  }
  if (tensor.device().is_cpu()) {
    if (!cpu) throw ConfigError("a CPU tensor needs a gloo group, and there is none");
    return *cpu;
  }
  throw ConfigError("no collective backend for tensors on " + device_name(tensor));
}

}  // namespace troupe::trainer
