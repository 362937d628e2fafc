// ModuleModel: a torch::nn module holder (what TORCH_MODULE declares) as a
// troupe Model, so a model registered with TROUPE_MODEL can be an ordinary
// LibTorch module: wrap_module(MyNet(...), "mynet"). Its forward takes one
// tensor (batch["input"]); a model that wants the whole batch subclasses
// Model and overrides takes_batch() and forward_batch().
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>

#include "troupe/trainer/model.h"

namespace troupe::trainer {

template <class Holder>
class ModuleModel final : public Model {
 public:
  ModuleModel(Holder m, std::string description) : m_(std::move(m)), description_(std::move(description)) {}
  torch::Tensor forward(const torch::Tensor& input) override { return m_->forward(input); }
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
  std::string describe() const override { return description_; }

 private:
  Holder m_;
  std::string description_;
};

template <class Holder>
std::unique_ptr<Model> wrap_module(Holder module, std::string description) {
  return std::make_unique<ModuleModel<Holder>>(std::move(module), std::move(description));
}

}  // namespace troupe::trainer
