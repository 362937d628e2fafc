// Optimizers (SGD with momentum, AdamW) and the learning-rate schedule.
// Both optimizers follow torch.optim's update rules to the operation, and
// keep their state as named tensors so that a checkpoint holds it in a form
// Python reads (torch.load) and a restarted trainer continues bitwise.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "troupe/runtime/wire/codec.h"

namespace troupe::trainer {

struct OptimizerConfig {
  // "sgd" or "adamw".
  std::string name = "sgd";
  double lr = 0.1;
  // SGD
  double momentum = 0.9;
  bool nesterov = false;
  // AdamW
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  // SGD: L2 added to the gradient; AdamW: decoupled decay.
  double weight_decay = 0.0;

  TROUPE_FIELDS(name, lr, momentum, nesterov, beta1, beta2, eps, weight_decay);
};

// lr(step) = base · scale · min(1, (step + 1) / warmup_steps), then the decay.
// scale = world_size when scale_with_world (the linear scaling rule for a
// global batch that grows with the workers), else 1.
struct ScheduleConfig {
  int64_t warmup_steps = 0;
  bool scale_with_world = false;
  // "constant" or "cosine" (to min_factor · lr at total_steps).
  std::string decay = "constant";
  int64_t total_steps = 0;
  double min_factor = 0.0;

  TROUPE_FIELDS(warmup_steps, scale_with_world, decay, total_steps, min_factor);
};

// Throws troupe::ConfigError naming the bad field.
void validate(const OptimizerConfig& config);
void validate(const ScheduleConfig& config);

double learning_rate(const OptimizerConfig& opt, const ScheduleConfig& schedule, int64_t step, int64_t world_size);

// A resource bound to a model's parameters. step() applies one update with
// the given learning rate using the parameters' .grad.
class Optimizer {
 public:
  Optimizer(OptimizerConfig config, std::vector<std::pair<std::string, torch::Tensor>> params);
  void step(double lr);
  // Sets every gradient to zero in place (keeps gradient storage, which the
  // reducer's buckets may own).
  void zero_grad();
  int64_t steps() const { return steps_; }
  const OptimizerConfig& config() const { return config_; }

  // "<param>.momentum_buffer", "<param>.exp_avg", "<param>.exp_avg_sq" and
  // "step" (a scalar int64 tensor), on the CPU.
  std::map<std::string, torch::Tensor> state() const;
  // Throws troupe::Error when a tensor is missing or has the wrong shape.
  void load_state(const std::map<std::string, torch::Tensor>& state);

 private:
  struct Slot {
    std::string name;
    torch::Tensor param;
    torch::Tensor buf;  // SGD momentum / AdamW exp_avg
    torch::Tensor sq;   // AdamW exp_avg_sq
  };
  // Every parameter on one CUDA device: step() takes the multi-tensor path.
  bool on_cuda() const;
  void step_foreach(double lr);

  OptimizerConfig config_;
  std::vector<Slot> slots_;
  int64_t steps_ = 0;
};

}  // namespace troupe::trainer
