#include "troupe/trainer/sync_batch_norm.h"

#include <chrono>
#include <string>

#include <torch/autograd.h>
#include <torch/torch.h>

#include "troupe/runtime/collective/group.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/trainer/tensor_collectives.h"

namespace troupe::trainer {
namespace {

thread_local collective::Group* t_sync_group = nullptr;

constexpr auto kTimeout = std::chrono::minutes(5);

// Sums `t` over the group's ranks (a copy; `t` is left alone) and returns
// it on t's device. A CUDA trainer's group is an NcclGroup, which sums
// device memory; a CUDA trainer on a gloo group (trainers sharing one GPU)
// sums a host copy.
torch::Tensor summed(const torch::Tensor& t, collective::Group& group) {
  const bool stage = t.is_cuda() && !moves_device_memory(group);
  auto out = stage ? t.detach().to(torch::kCPU).contiguous() : t.detach().contiguous().clone();
  collective::AllreduceOptions opts;
  opts.op = collective::ReduceOp::kSum;
  opts.timeout = kTimeout;
  allreduce(group, out, opts)->wait(kTimeout);
  return stage ? out.to(t.device()) : out;
}

// y = Σ_ranks x. Backward: the gradient of every rank's loss reaches every
// rank's x (∂y/∂x_r is the identity for each r), so the incoming gradients
// are summed over ranks too.
struct AllReduceSum : torch::autograd::Function<AllReduceSum> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return summed(x, *reinterpret_cast<collective::Group*>(group));
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto* group = reinterpret_cast<collective::Group*>(ctx->saved_data["group"].toInt());
    return {summed(grads[0], *group), torch::Tensor()};
  }
};

torch::Tensor all_reduce_sum(const torch::Tensor& x, collective::Group& group) {
  return AllReduceSum::apply(x, reinterpret_cast<int64_t>(&group));
}

void check_input(const torch::Tensor& input, const torch::Tensor& running_mean, const torch::Tensor& weight) {
  if (input.dim() < 2)
    throw ConfigError("sync_batch_norm: input needs [N, C, ...], got " + std::to_string(input.dim()) + " dimension(s)");
  const torch::Tensor& per_channel = weight.defined() ? weight : running_mean;
  if (per_channel.defined() && per_channel.size(0) != input.size(1))
    throw ConfigError("sync_batch_norm: input has " + std::to_string(input.size(1)) + " channels, the layer " +
                      std::to_string(per_channel.size(0)));
}

}  // namespace

SyncBatchNormScope::SyncBatchNormScope(collective::Group* group) : previous_(t_sync_group) { t_sync_group = group; }
SyncBatchNormScope::~SyncBatchNormScope() { t_sync_group = previous_; }
collective::Group* SyncBatchNormScope::current() { return t_sync_group; }

namespace detail {
collective::Group* sync_group_for_training() {
  return t_sync_group && t_sync_group->world_size() > 1 ? t_sync_group : nullptr;
}
}  // namespace detail

torch::Tensor sync_batch_norm(const torch::Tensor& input, const torch::Tensor& weight, const torch::Tensor& bias,
                              torch::Tensor running_mean, torch::Tensor running_var, double momentum, double eps,
                              collective::Group& group) {
  check_input(input, running_mean, weight);
  const int64_t channels = input.size(1);
  std::vector<int64_t> dims = {0};
  std::vector<int64_t> shape(static_cast<size_t>(input.dim()), 1);
  shape[1] = channels;
  for (int64_t d = 2; d < input.dim(); ++d) dims.push_back(d);
  // First all-reduce: per-channel sums and the element count; second: the
  // squared deviations from the global mean (two passes, as stable as one
  // process computing the variance of the concatenated batch).
  const double local = static_cast<double>(input.numel() / std::max<int64_t>(channels, 1));
  // Statistics in float32 for a 16-bit input (autocast's conv output), as
  // ATen's batch_norm keeps them: in fp16 the count (N*H*W, 65536 for a
  // batch of 64 32x32 images) overflowed and every step threw; in bf16
  // counts and sums were rounded to 8 bits. The output is the input's type.
  const bool narrow = input.scalar_type() == torch::kHalf || input.scalar_type() == torch::kBFloat16;
  const torch::Tensor x = narrow ? input.to(torch::kFloat) : input;
  auto first =
      all_reduce_sum(torch::cat({x.sum(dims), torch::full({1}, local, x.options().requires_grad(false))}), group);
  const double count = first[channels].item<double>();
  if (count <= 1)
    throw ConfigError("sync_batch_norm: " + std::to_string(static_cast<int64_t>(count)) +
                      " value(s) per channel over all ranks; batch statistics need more than one");
  auto mean = first.slice(0, 0, channels) / count;
  auto centered = x - mean.reshape(shape);
  auto var = all_reduce_sum((centered * centered).sum(dims), group) / count;
  if (running_mean.defined() && running_var.defined()) {
    torch::NoGradGuard no_grad;
    running_mean.mul_(1 - momentum).add_(mean.detach().to(running_mean.dtype()), momentum);
    running_var.mul_(1 - momentum).add_(var.detach().to(running_var.dtype()) * (count / (count - 1)), momentum);
  }
  auto out = centered * torch::rsqrt(var + eps).reshape(shape);
  if (weight.defined()) out = out * weight.reshape(shape);
  if (bias.defined()) out = out + bias.reshape(shape);
  return narrow ? out.to(input.scalar_type()) : out;
}

}  // namespace troupe::trainer
