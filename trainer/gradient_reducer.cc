#include "troupe/trainer/gradient_reducer.h"

#include <algorithm>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include "troupe/runtime/core/check.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/trainer/tensor_collectives.h"
#include "troupe/trainer/torch_compat.h"

namespace troupe::trainer {

Compression parse_compression(const std::string& name) {
  if (name == "none" || name.empty()) return Compression::kNone;
  if (name == "bf16") return Compression::kBFloat16;
  if (name == "fp16") return Compression::kFloat16;
  throw ConfigError("unknown gradient compression '" + name + "' (known: none, bf16, fp16)");
}

struct GradientReducer::Bucket {
  std::vector<size_t> params;
  torch::Tensor flat;  // the gradients, in the parameters' dtype and device
  torch::Tensor wire;  // what the group reduces (flat itself, or a copy)
  collective::WorkPtr work;
  size_t pending = 0;
  bool launched = false;
  bool averaged = false;  // reduced with kAvg (a 16-bit wire), not summed
};

GradientReducer::GradientReducer(std::vector<torch::Tensor> params, collective::Group* group, ReducerOptions options)
    : params_(std::move(params)), group_(group), options_(options) {
  TROUPE_CHECK(options_.bucket_bytes > 0);
  bucket_of_.resize(params_.size());
  offset_of_.resize(params_.size());
  ready_.assign(params_.size(), false);
  // Reverse registration order, a new bucket when full or when dtype or
  // device changes (a bucket is one flat tensor).
  Bucket* cur = nullptr;
  int64_t cur_bytes = 0, cur_numel = 0;
  std::vector<int64_t> numels;
  auto close = [&] {
    if (!cur) return;
    const auto& p0 = params_[cur->params.front()];
    void* mem = nullptr;
    if (options_.allocate && p0.device().is_cpu())
      mem = options_.allocate(static_cast<size_t>(cur_numel) * p0.element_size());
    if (mem) {
      cur->flat = torch::from_blob(mem, {cur_numel}, p0.options().requires_grad(false));
      cur->flat.zero_();
    } else {
      cur->flat = torch::zeros({cur_numel}, p0.options().requires_grad(false));
    }
    cur = nullptr;
  };
  for (size_t k = params_.size(); k-- > 0;) {
    const auto& p = params_[k];
    TROUPE_CHECK(p.requires_grad()) << "parameter " << k << " does not require grad";
    if (cur) {
      // The first bucket (the last layers, whose gradients are ready
      // first) is small, so that reducing starts early in backward.
      const int64_t limit = buckets_.size() == 1 && options_.first_bucket_bytes > 0
                                ? std::min(options_.first_bucket_bytes, options_.bucket_bytes)
                                : options_.bucket_bytes;
      const auto& p0 = params_[cur->params.front()];
      if (p0.scalar_type() != p.scalar_type() || p0.device() != p.device() ||
          cur_bytes + static_cast<int64_t>(p.numel() * p.element_size()) > limit)
        close();
    }
    if (!cur) {
      buckets_.push_back(std::make_unique<Bucket>());
      cur = buckets_.back().get();
      cur_bytes = cur_numel = 0;
    }
    bucket_of_[k] = buckets_.size() - 1;
    offset_of_[k] = cur_numel;
    cur->params.push_back(k);
    cur_numel += p.numel();
    cur_bytes += p.numel() * p.element_size();
  }
  close();

  for (size_t i = 0; i < params_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    TROUPE_CHECK(acc) << "parameter " << i << " is not a leaf";
    uintptr_t key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          on_grad_ready(i);
          return outputs;
        }));
    accumulators_.push_back(compat::keep_alive(std::move(acc)));
    hook_keys_.push_back(key);
  }
}

GradientReducer::~GradientReducer() {
  for (size_t i = 0; i < accumulators_.size(); ++i)
    std::static_pointer_cast<torch::autograd::Node>(accumulators_[i])->del_post_hook(hook_keys_[i]);
  // Operations still in flight write into the buckets: let them end first.
  for (auto& b : buckets_) {
    if (b->work) {
      try {
        b->work->wait(std::chrono::seconds(10));
      } catch (...) {
      }
    }
  }
}

int64_t GradientReducer::world_size() const { return group_ ? group_->world_size() : 1; }

std::vector<size_t> GradientReducer::bucket_params(size_t b) const { return buckets_.at(b)->params; }

void GradientReducer::prepare(bool sync) {
  sync_ = sync && group_ != nullptr;
  in_backward_ = true;
  launched_in_backward_ = 0;
  next_launch_ = 0;
  std::fill(ready_.begin(), ready_.end(), false);
  for (auto& b : buckets_) {
    b->pending = b->params.size();
    b->launched = false;
    b->work.reset();
  }
}

void GradientReducer::on_grad_ready(size_t i) {
  if (!sync_ || !in_backward_ || ready_[i]) return;
  torch::NoGradGuard no_grad;
  auto& b = *buckets_[bucket_of_[i]];
  const auto& p = params_[i];
  const auto& g = p.grad();
  auto slot = b.flat.narrow(0, offset_of_[i], p.numel());
  if (g.defined() && g.data_ptr() != slot.data_ptr()) slot.copy_(g.reshape({-1}));
  ready_[i] = true;
  if (--b.pending == 0) launch_ready();
}

void GradientReducer::launch_ready() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_]->pending == 0) {
    launch(*buckets_[next_launch_]);
    if (in_backward_) ++launched_in_backward_;
    ++next_launch_;
  }
}

void GradientReducer::launch(Bucket& b) {
  torch::NoGradGuard no_grad;
  bool stage = b.flat.is_cuda() && !options_.group_takes_device_memory;
  torch::Tensor w = b.flat;
  if (options_.compression == Compression::kBFloat16) w = w.to(torch::kBFloat16);
  if (options_.compression == Compression::kFloat16) w = w.to(torch::kFloat16);
  if (stage) w = w.to(torch::kCPU);
  b.wire = w.is_same(b.flat) ? b.flat : w.contiguous();
  collective::AllreduceOptions opts;
  // A 16-bit wire is averaged by the group (gloo divides in float32 before
  // narrowing; NCCL has ncclAvg), as torch's fp16_compress_hook divides
  // first: its sum overflowed fp16 N times sooner than one rank's gradient
  // (inf at 65504; with --amp fp16 a loss scale N times smaller, without
  // it inf weights). float32 is summed (ShmGroup serves only kSum).
  const auto wire_type = b.wire.scalar_type();
  b.averaged = wire_type == torch::kHalf || wire_type == torch::kBFloat16;
  opts.op = b.averaged ? collective::ReduceOp::kAvg : collective::ReduceOp::kSum;
  opts.timeout = options_.timeout;
  b.work = group_->allreduce(b.wire.data_ptr(), static_cast<size_t>(b.wire.numel()),
                             collective_dtype(b.wire.scalar_type()), opts);
  b.launched = true;
}

void GradientReducer::finish() {
  in_backward_ = false;
  if (!sync_) return;
  torch::NoGradGuard no_grad;
  // Parameters that got no gradient in this backward: their accumulated
  // gradient (or zeros) takes part, so every rank reduces the same buckets.
  for (size_t i = 0; i < params_.size(); ++i) {
    if (ready_[i]) continue;
    auto& b = *buckets_[bucket_of_[i]];
    const auto& p = params_[i];
    auto slot = b.flat.narrow(0, offset_of_[i], p.numel());
    const auto& g = p.grad();
    if (!g.defined()) {
      slot.zero_();
    } else if (g.data_ptr() != slot.data_ptr()) {
      slot.copy_(g.reshape({-1}));
    }
    ready_[i] = true;
    --b.pending;
  }
  launch_ready();
  TROUPE_CHECK(next_launch_ == buckets_.size());
  double inv = 1.0 / static_cast<double>(group_->world_size());
  for (auto& b : buckets_) {
    b->work->wait(options_.timeout);
    b->work.reset();
    if (!b->wire.is_same(b->flat)) b->flat.copy_(b->wire);
    if (!b->averaged) b->flat.mul_(inv);
    for (size_t i : b->params) {
      const auto& p = params_[i];
      auto view = b->flat.narrow(0, offset_of_[i], p.numel()).view(p.sizes());
      if (!p.grad().defined() || p.grad().data_ptr() != view.data_ptr()) p.mutable_grad() = view;
    }
  }
  sync_ = false;
}

void GradientReducer::broadcast_from_rank0(const std::vector<torch::Tensor>& tensors) {
  if (!group_ || group_->world_size() == 1) return;
  torch::NoGradGuard no_grad;
  for (const auto& t : tensors) {
    bool stage = t.is_cuda() && !options_.group_takes_device_memory;
    torch::Tensor w = stage ? t.to(torch::kCPU).contiguous() : t.contiguous();
    collective::BroadcastOptions opts;
    opts.timeout = options_.timeout;
    group_->broadcast(w.data_ptr(), static_cast<size_t>(w.numel()), collective_dtype(w.scalar_type()), 0, opts)
        ->wait(options_.timeout);
    if (!w.is_same(t)) t.copy_(w);
  }
}

}  // namespace troupe::trainer
