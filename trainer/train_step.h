// TrainStep: what one training step computes from a batch — "batch dict in,
// `loss` (+ named metric tensors) out" — separately from how the trainer
// reduces gradients, steps the optimizer or heals. Built in:
//   classification  cross-entropy of model(batch["input"]) against
//                   batch["target"]; metric `accuracy`
//   regression      MSE of model(batch["input"]) against batch["target"];
//                   metric `mae`
//   module          the model takes the whole batch and returns the dict
//                   itself (a TorchScript forward(Dict[str, Tensor]) ->
//                   Dict[str, Tensor]): `loss` plus every other entry as a
//                   metric
// and the user's own, registered by name with TROUPE_STEP. A StepSpec (name
// + config string) is what crosses the wire; make_step() builds the step on
// the trainer's side.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>

#include <torch/types.h>

#include "troupe/actors/factory_registry.h"
#include "troupe/actors/tensor_dict.h"
#include "troupe/runtime/wire/codec.h"
#include "troupe/trainer/model.h"
#include "troupe/trainer/step_context.h"

namespace troupe::trainer {

// What a step returns: the batch's mean loss (what backward() runs on) and
// scalar metrics, each a mean over the batch's samples unless the step
// lists it in summed_metrics().
struct StepOutput {
  torch::Tensor loss;
  std::map<std::string, torch::Tensor> metrics;
};

// A resource: one per trainer.
class TrainStep {
 public:
  TrainStep() = default;
  TrainStep(const TrainStep&) = delete;
  TrainStep& operator=(const TrainStep&) = delete;
  virtual ~TrainStep() = default;

  // The training forward pass on `batch` (already on the model's device).
  virtual StepOutput train(Model& model, const actors::TensorDict& batch) = 0;
  // Validation; called in eval mode under no-grad. Defaults to train()
  // (context().training tells the two apart).
  virtual StepOutput eval(Model& model, const actors::TensorDict& batch) { return train(model, batch); }
  // Metrics that are summed over samples and ranks (counts, token totals)
  // rather than averaged.
  virtual std::set<std::string> summed_metrics() const { return {}; }
  virtual std::string describe() const = 0;

  // The step's own state (counters, a queue of past embeddings, a
  // curriculum's stage): tensors by name, kept with the weights, so a
  // checkpoint holds it, a heal sends a survivor's to the replacement and a
  // step cut short by a failure is rolled back to the state before it. It
  // must be the same on every rank, as the weights are (a survivor's stands
  // for all): update it from what every rank sees alike (the context, a
  // reduced value), never from the rank's own batch alone. Returned tensors
  // are copied (to the CPU) before the next call. None by default.
  virtual std::map<std::string, torch::Tensor> state() const { return {}; }
  // Takes back what state() returned: CPU tensors from a checkpoint or a
  // heal (move them where the step keeps them), copies on their own device
  // in a roll-back. Called with every resume, heal and roll-back, also
  // with an empty map when the checkpoint resumed from has no step state
  // (one written before the step kept any). By default a step takes an
  // empty map and refuses any other (ConfigError naming the keys).
  virtual void load_state(const std::map<std::string, torch::Tensor>& state);

  // Set by the trainer before each train() and eval().
  const StepContext& context() const { return context_; }
  void set_context(const StepContext& context) { context_ = context; }

 private:
  StepContext context_;
};

struct StepSpec {
  // "auto" (module for a model that takes the batch dict, else
  // classification), a built-in name, or a registered one.
  std::string name = "auto";
  // Passed to a registered step's factory as is.
  std::string config;
  TROUPE_FIELDS(name, config);
};

using StepFactory = std::function<std::unique_ptr<TrainStep>(const std::string& config)>;
// Registers `factory` under `name`; returns true to initialise a static.
// Prefer TROUPE_STEP.
bool register_step(const std::string& name, StepFactory factory);
// Built-in and registered names.
std::vector<std::string> step_names();

// Throws ConfigError when no step has `spec.name` (built in or registered).
void validate(const StepSpec& spec);

// Builds the step for `model`. Throws ConfigError for an unknown name, or a
// step that does not fit the model (classification on a model that takes
// the batch dict).
std::unique_ptr<TrainStep> make_step(const StepSpec& spec, Model& model);

// Checks what a step returned: a defined scalar floating `loss` and scalar
// metrics. Throws ConfigError naming the step and the offending key.
void check_output(const StepOutput& out, const TrainStep& step);

// Metric sums over `samples` samples (TrainReport::metric_sums, added up
// over ranks) made into the reported values: a mean metric divided by the
// samples, a summed one (listed in `summed`) as is.
std::map<std::string, double> finish_metrics(const std::map<std::string, double>& sums,
                                             const std::vector<std::string>& summed, int64_t samples);

}  // namespace troupe::trainer

// At namespace scope in the user's binary:
//   TROUPE_STEP("contrastive", [](const std::string& config) {
//     return std::make_unique<MyStep>(config);
//   });
#define TROUPE_STEP(name, factory)                                                 \
  static const bool TROUPE_REGISTRY_CONCAT(troupe_step_registered_, __COUNTER__) = \
      ::troupe::trainer::register_step(name, factory)
