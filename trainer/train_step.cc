#include "troupe/trainer/train_step.h"

#include <algorithm>

#include <torch/torch.h>

#include "troupe/runtime/core/errors.h"

namespace troupe::trainer {

void TrainStep::load_state(const std::map<std::string, torch::Tensor>& state) {
  if (state.empty()) return;
  std::string keys;
  for (const auto& [k, v] : state) keys += (keys.empty() ? "'" : ", '") + k + "'";
  throw ConfigError("the state to load holds step state (" + keys + ") but step " + describe() +
                    " keeps none: it was written by another step");
}

namespace {

// The model's output for steps that feed it batch["input"] only.
torch::Tensor predict(Model& model, const actors::TensorDict& batch) {
  return model.forward(batch.at("input")).to(torch::kFloat32);
}

class ClassificationStep final : public TrainStep {
 public:
  StepOutput train(Model& model, const actors::TensorDict& batch) override {
    auto logits = predict(model, batch);
    const auto& y = batch.at("target");
    StepOutput out;
    out.loss = torch::nn::functional::cross_entropy(logits, y);
    torch::NoGradGuard ng;
    out.metrics["accuracy"] = logits.argmax(1).eq(y).to(torch::kFloat64).mean();
    return out;
  }
  std::string describe() const override { return "classification (cross-entropy, accuracy)"; }
};

class RegressionStep final : public TrainStep {
 public:
  StepOutput train(Model& model, const actors::TensorDict& batch) override {
    auto pred = predict(model, batch);
    auto y = batch.at("target").to(torch::kFloat32).reshape(pred.sizes());
    StepOutput out;
    out.loss = torch::mse_loss(pred, y);
    torch::NoGradGuard ng;
    out.metrics["mae"] = (pred - y).abs().mean();
    return out;
  }
  std::string describe() const override { return "regression (MSE, MAE)"; }
};

// The model computes loss and metrics itself from the whole batch.
class ModuleStep final : public TrainStep {
 public:
  explicit ModuleStep(const Model& model) {
    for (const auto& m : model.summed_metrics()) summed_.insert(m);
  }
  std::set<std::string> summed_metrics() const override { return summed_; }
  StepOutput train(Model& model, const actors::TensorDict& batch) override {
    actors::TensorDict result = model.forward_batch(batch);
    StepOutput out;
    for (const auto& [key, value] : result) {
      if (key == "loss") {
        out.loss = value;
      } else {
        out.metrics[key] = value;
      }
    }
    if (!out.loss.defined()) {
      std::string keys;
      for (const auto& k : result.keys()) keys += (keys.empty() ? "" : ", ") + k;
      throw ConfigError("model " + model.describe() +
                        " returned no 'loss' (it returned: " + (keys.empty() ? "nothing" : keys) + ")");
    }
    return out;
  }
  std::string describe() const override { return "module (the model returns loss and metrics)"; }

 private:
  std::set<std::string> summed_;
};

std::string list(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace

bool register_step(const std::string& name, StepFactory factory) {
  return actors::FactoryRegistry<StepFactory>::instance().add(name, std::move(factory));
}

std::vector<std::string> step_names() {
  return actors::FactoryRegistry<StepFactory>::instance().names({"auto", "classification", "regression", "module"});
}

void validate(const StepSpec& spec) {
  actors::FactoryRegistry<StepFactory>::instance().check(
      spec.name,
      spec.name == "auto" || spec.name == "classification" || spec.name == "regression" || spec.name == "module",
      "step", "TROUPE_STEP");
  auto names = step_names();
  if (std::find(names.begin(), names.end(), spec.name) == names.end())
    throw ConfigError("unknown step '" + spec.name + "' (known: " + list(names) + ")");
}

std::unique_ptr<TrainStep> make_step(const StepSpec& spec, Model& model) {
  validate(spec);
  std::string name = spec.name;
  if (name == "auto") name = model.takes_batch() ? "module" : "classification";
  if (name != "module" && model.takes_batch()) {
    throw ConfigError("step '" + name + "' feeds batch[\"input\"] to the model, but " + model.describe() +
                      " takes the whole batch dict (use step 'module' or 'auto')");
  }
  if (name == "classification") return std::make_unique<ClassificationStep>();
  if (name == "regression") return std::make_unique<RegressionStep>();
  if (name == "module") {
    if (!model.takes_batch()) {
      throw ConfigError("step 'module' needs a model that takes the batch dict; " + model.describe() +
                        " takes one tensor");
    }
    return std::make_unique<ModuleStep>(model);
  }
  if (auto factory = actors::FactoryRegistry<StepFactory>::instance().find(name)) {
    auto step = actors::run_factory("step '" + name + "'", [&] { return (*factory)(spec.config); });
    if (!step) throw ConfigError("step factory '" + name + "' returned no step");
    return step;
  }
  throw ConfigError("step '" + name + "' is registered in the driver but not in this worker's binary");
}

void check_output(const StepOutput& out, const TrainStep& step) {
  if (!out.loss.defined()) {
    std::string returned;
    for (const auto& [key, value] : out.metrics) returned += (returned.empty() ? "" : ", ") + key;
    throw ConfigError("step " + step.describe() + " returned no 'loss' (it returned " +
                      (returned.empty() ? std::string("nothing") : returned) + ")");
  }
  if (out.loss.numel() != 1 || !out.loss.is_floating_point()) {
    throw ConfigError("step " + step.describe() + " returned a 'loss' of " + actors::describe_tensor(out.loss) +
                      "; it must be one floating-point value");
  }
  for (const auto& [key, value] : out.metrics) {
    if (!value.defined() || value.numel() != 1) {
      throw ConfigError("step " + step.describe() + " returned metric '" + key + "' of " +
                        actors::describe_tensor(value) + "; metrics must be one value each");
    }
  }
}

std::map<std::string, double> finish_metrics(const std::map<std::string, double>& sums,
                                             const std::vector<std::string>& summed, int64_t samples) {
  std::map<std::string, double> out;
  for (const auto& [k, v] : sums) {
    bool is_sum = std::find(summed.begin(), summed.end(), k) != summed.end();
    out[k] = is_sum ? v : (samples > 0 ? v / static_cast<double>(samples) : 0.0);
  }
  return out;
}

}  // namespace troupe::trainer
