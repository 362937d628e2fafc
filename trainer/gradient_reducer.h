// GradientReducer: DDP-equivalent gradient synchronisation over a
// collective::Group. Parameters are packed, in reverse registration order
// (roughly the order backward produces their gradients), into buckets of
// about bucket_bytes. A post-hook on each parameter's gradient accumulator
// copies the finished gradient into its bucket; the moment a bucket is
// complete it is all-reduced asynchronously, so communication overlaps the
// rest of backward. Buckets are launched strictly in bucket order, so every
// rank issues the same collectives in the same order. finish() waits for
// the buckets, divides by the world size and points every parameter's .grad
// at its slice of the bucket (no copy back; later micro-steps accumulate
// there in place).
//
//   reducer.prepare(/*sync=*/last_micro_step);
//   loss.backward();
//   reducer.finish();           // grads are now the average over ranks
//
// On accumulation micro-steps (sync = false) nothing is communicated; the
// gradients accumulate locally and the next synchronising step reduces the
// sum. Buckets may travel as bf16 or fp16 (halving the bytes); the group
// reduces those in float32.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

#include "troupe/runtime/collective/group.h"

namespace troupe::trainer {

enum class Compression { kNone, kBFloat16, kFloat16 };
// "none", "bf16", "fp16"; ConfigError for anything else.
Compression parse_compression(const std::string& name);

struct ReducerOptions {
  int64_t bucket_bytes = 25 * 1024 * 1024;
  // The first bucket filled (the last layers') holds at most this much, as
  // DDP's first bucket: its reduction starts while backward goes on. 0 =
  // as large as the others.
  int64_t first_bucket_bytes = 1024 * 1024;
  Compression compression = Compression::kNone;
  // True when the group reduces device memory itself (NCCL); otherwise CUDA
  // buckets are staged through host memory.
  bool group_takes_device_memory = false;
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // Where CPU buckets live (e.g. ShmGroup::allocate); null or a null
  // result = ordinary memory. The memory must outlive the reducer.
  std::function<void*(size_t bytes)> allocate;
};

// A resource bound to one model's parameters and one group; not copyable.
class GradientReducer {
 public:
  // `group` may be null: then nothing is communicated and finish()
  // returns at once (a parameter backward gave no gradient keeps none). A
  // group of world size 1 is used as any other (its reductions change
  // nothing; every parameter gets a gradient, zeros when unused).
  GradientReducer(std::vector<torch::Tensor> params, collective::Group* group, ReducerOptions options = {});
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // Call before each backward: sync = true when this backward ends an
  // accumulation window (its gradients must be reduced).
  void prepare(bool sync);
  // After backward: on a synchronising step launches what is left (buckets
  // with parameters that received no gradient reduce zeros for them), waits
  // and averages. Rethrows the group's failure.
  void finish();

  // Every rank's parameters (and, with buffers, the buffers) become rank
  // 0's. Used once after construction, as DDP does.
  void broadcast_from_rank0(const std::vector<torch::Tensor>& tensors);

  size_t bucket_count() const { return buckets_.size(); }
  // Parameter indices (into the constructor's list) of bucket b, in order.
  std::vector<size_t> bucket_params(size_t b) const;
  // Buckets launched during the last backward, before finish() was called
  // (evidence of overlap).
  int64_t launched_during_backward() const { return launched_in_backward_; }
  int64_t world_size() const;

 private:
  struct Bucket;
  void on_grad_ready(size_t param);
  void launch_ready();
  void launch(Bucket& b);

  std::vector<torch::Tensor> params_;
  collective::Group* group_;
  ReducerOptions options_;
  std::vector<std::unique_ptr<Bucket>> buckets_;
  // Per parameter: its bucket, its offset there.
  std::vector<size_t> bucket_of_;
  std::vector<int64_t> offset_of_;
  std::vector<bool> ready_;
  std::vector<std::shared_ptr<void>> accumulators_;  // keeps hooks alive
  std::vector<uintptr_t> hook_keys_;
  bool sync_ = false;
  bool in_backward_ = false;
  size_t next_launch_ = 0;
  int64_t launched_in_backward_ = 0;
};

}  // namespace troupe::trainer
