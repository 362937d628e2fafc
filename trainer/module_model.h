// ModuleModel: a torch::nn module holder (what TORCH_MODULE declares) as a
// troupe Model, so a model registered with TROUPE_MODEL can be an ordinary
// LibTorch module: wrap_module(MyNet(...), "mynet"). Its forward takes one
// tensor (batch["input"]). A module whose forward takes the whole batch and
// returns its own loss and metrics (forward(const TensorDict&) ->
// TensorDict with "loss": a graph network reading x, edge_index and batch)
// is wrapped with wrap_batch_module(MyGnn(...), "gnn").
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>

#include "troupe/runtime/core/errors.h"
#include "troupe/trainer/model.h"

namespace troupe::trainer {

template <class Holder, bool TakesBatch = false>
class ModuleModel final : public Model {
 public:
  ModuleModel(Holder m, std::string description) : m_(std::move(m)), description_(std::move(description)) {}
  torch::Tensor forward(const torch::Tensor& input) override {
    if constexpr (TakesBatch) {
      (void)input;
      throw ConfigError(description_ + " takes the whole batch (forward(TensorDict)), not one input tensor");
    } else {
      return m_->forward(input);
    }
  }
  bool takes_batch() const override { return TakesBatch; }
  actors::TensorDict forward_batch(const actors::TensorDict& batch) override {
    if constexpr (TakesBatch) return m_->forward(batch);
    else return Model::forward_batch(batch);
  }
  std::vector<std::pair<std::string, torch::Tensor>> named_parameters() override {
    std::vector<std::pair<std::string, torch::Tensor>> out;
    for (auto& item : m_->named_parameters(true)) out.emplace_back(item.key(), item.value());
    return out;
  }
  std::vector<std::pair<std::string, torch::Tensor>> named_buffers() override {
    std::vector<std::pair<std::string, torch::Tensor>> out;
    for (auto& item : m_->named_buffers(true)) out.emplace_back(item.key(), item.value());
    return out;
  }
  void train(bool on) override { m_->train(on); }
  void to(const torch::Device& device) override { m_->to(device); }
  // A module that defines int use_cpu_gemm() (computing its linear layers
  // with trainer::linear from then on, and returning how many) is told to
  // where TrainerConfig::cpu_gemm asks for oneDNN; others keep ATen's.
  int route_cpu_gemm() override {
    if constexpr (requires(Holder & h) { static_cast<int>(h->use_cpu_gemm()); }) return m_->use_cpu_gemm();
    return 0;
  }
  std::string describe() const override { return description_; }

 private:
  Holder m_;
  std::string description_;
};

template <class Holder>
std::unique_ptr<Model> wrap_module(Holder module, std::string description) {
  return std::make_unique<ModuleModel<Holder>>(std::move(module), std::move(description));
}

// For a module whose forward(const actors::TensorDict&) returns a
// TensorDict with a scalar "loss" and any scalar metrics (step "module").
template <class Holder>
std::unique_ptr<Model> wrap_batch_module(Holder module, std::string description) {
  return std::make_unique<ModuleModel<Holder, true>>(std::move(module), std::move(description));
}

}  // namespace troupe::trainer
