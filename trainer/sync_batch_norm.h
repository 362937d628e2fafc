// SyncBatchNorm: batch normalisation whose statistics are those of the whole
// data-parallel batch, as PyTorch's torch.nn.SyncBatchNorm. With small
// per-rank batches (detection, segmentation, many ranks) each rank's own
// statistics are too noisy; with these, N ranks of batch B normalise exactly
// as one process on the concatenated batch of N·B would, gradients included
// (they flow back through the all-reduce).
//
// A C++ model opts in per layer by calling trainer::batch_norm(bn, x) where
// it would call bn(x) (any torch::nn::BatchNorm1d/2d/3d). Outside a training
// step with TrainerConfig::sync_batchnorm on, that is bn->forward(x), bit for
// bit; inside one, the trainer holds a SyncBatchNormScope on the step's
// thread and every such layer in train mode all-reduces its statistics over
// the trainer's group. Evaluation (eval mode) uses the running statistics,
// which are the same on every rank.
//
//   x = torch::relu(troupe::trainer::batch_norm(bn1, conv1(x)));
#pragma once

#include <torch/nn/modules/batchnorm.h>
#include <torch/types.h>

namespace troupe::collective {
class Group;
}

namespace troupe::trainer {

// While alive, trainer::batch_norm() on this thread synchronises over
// `group` (null or of world size 1: local statistics). Scopes nest.
class SyncBatchNormScope {
 public:
  explicit SyncBatchNormScope(collective::Group* group);
  ~SyncBatchNormScope();
  SyncBatchNormScope(const SyncBatchNormScope&) = delete;
  SyncBatchNormScope& operator=(const SyncBatchNormScope&) = delete;

  // The innermost scope's group, or null.
  static collective::Group* current();

 private:
  collective::Group* previous_;
};

// Training-mode batch normalisation of `input` ([N, C, ...]) with the mean
// and (biased) variance per channel over the inputs of every rank of
// `group`; running_mean/running_var (when defined) move towards them by
// `momentum` (the unbiased variance, as BatchNorm). `weight`/`bias` may be
// undefined (no affine). Every rank must call it for the same layers in the
// same order (it is two all-reduces forward and two backward).
torch::Tensor sync_batch_norm(const torch::Tensor& input, const torch::Tensor& weight, const torch::Tensor& bias,
                              torch::Tensor running_mean, torch::Tensor running_var, double momentum, double eps,
                              collective::Group& group);

// bn->forward(input), or sync_batch_norm with bn's parameters and running
// statistics when bn is training inside a SyncBatchNormScope of more than
// one rank.
template <size_t D, class Derived>
torch::Tensor batch_norm(torch::nn::BatchNormImplBase<D, Derived>& bn, const torch::Tensor& input);

template <class Impl>
torch::Tensor batch_norm(torch::nn::ModuleHolder<Impl>& bn, const torch::Tensor& input) {
  return batch_norm(*bn, input);
}

namespace detail {
// The group batch_norm() synchronises over right now (null: none).
collective::Group* sync_group_for_training();
}  // namespace detail

template <size_t D, class Derived>
torch::Tensor batch_norm(torch::nn::BatchNormImplBase<D, Derived>& bn, const torch::Tensor& input) {
  collective::Group* group = bn.is_training() ? detail::sync_group_for_training() : nullptr;
  if (!group) return bn.forward(input);
  // The momentum BatchNorm itself would use this step (a cumulative
  // average when the options give none).
  double momentum = bn.options.momentum().value_or(0.0);
  if (bn.options.track_running_stats() && bn.num_batches_tracked.defined()) {
    bn.num_batches_tracked += 1;
    if (!bn.options.momentum().has_value()) momentum = 1.0 / bn.num_batches_tracked.template item<double>();
  }
  return sync_batch_norm(input, bn.weight, bn.bias, bn.running_mean, bn.running_var, momentum, bn.options.eps(),
                         *group);
}

}  // namespace troupe::trainer
