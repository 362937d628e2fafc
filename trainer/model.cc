#include "troupe/trainer/model.h"

#include <filesystem>

#include <torch/script.h>
#include <torch/torch.h>

#include "troupe/runtime/core/errors.h"

namespace troupe::trainer {
namespace {

struct MlpImpl : torch::nn::Module {
  MlpImpl(int64_t in, int64_t hidden, int64_t out)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        fc3(register_module("fc3", torch::nn::Linear(hidden, out))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = x.reshape({x.size(0), -1});
    x = torch::relu(fc1->forward(x));
    x = torch::relu(fc2->forward(x));
    return fc3->forward(x);
  }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(Mlp);

struct CnnImpl : torch::nn::Module {
  CnnImpl(int64_t channels, int64_t image, int64_t hidden, int64_t out)
      : channels_(channels),
        image_(image),
        conv1(register_module("conv1",
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, hidden, 3).padding(1).bias(false)))),
        bn1(register_module("bn1", torch::nn::BatchNorm2d(hidden))),
        conv2(register_module("conv2",
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(hidden, hidden, 3).padding(1).bias(false)))),
        bn2(register_module("bn2", torch::nn::BatchNorm2d(hidden))),
        fc(register_module("fc", torch::nn::Linear(hidden, out))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = x.reshape({x.size(0), channels_, image_, image_});
    x = torch::relu(bn1->forward(conv1->forward(x)));
    x = torch::relu(bn2->forward(conv2->forward(x)));
    x = x.mean({2, 3});
    return fc->forward(x);
  }
  int64_t channels_, image_;
  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::BatchNorm2d bn2;
  torch::nn::Linear fc;
};
TORCH_MODULE(Cnn);

template <class Holder>
class NnModel final : public Model {
 public:
  NnModel(Holder m, std::string description) : m_(std::move(m)), description_(std::move(description)) {}
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

class ScriptModel final : public Model {
 public:
  explicit ScriptModel(const std::string& path) : path_(path) {
    try {
      m_ = torch::jit::load(path, torch::kCPU);
    } catch (const c10::Error& e) {
      throw ConfigError("cannot load TorchScript model '" + path + "': " + e.what_without_backtrace());
    }
  }
  torch::Tensor forward(const torch::Tensor& input) override { return m_.forward({input}).toTensor(); }
  std::vector<std::pair<std::string, torch::Tensor>> named_parameters() override {
    std::vector<std::pair<std::string, torch::Tensor>> out;
    for (const auto& p : m_.named_parameters(true)) out.emplace_back(p.name, p.value);
    return out;
  }
  std::vector<std::pair<std::string, torch::Tensor>> named_buffers() override {
    std::vector<std::pair<std::string, torch::Tensor>> out;
    for (const auto& b : m_.named_buffers(true)) out.emplace_back(b.name, b.value);
    return out;
  }
  void train(bool on) override { m_.train(on); }
  void to(const torch::Device& device) override { m_.to(device); }
  std::string describe() const override { return "torchscript(" + path_ + ")"; }

 private:
  std::string path_;
  torch::jit::Module m_;
};

void check_positive(int64_t v, const char* what) {
  if (v <= 0) throw ConfigError(std::string("model: ") + what + " must be positive, got " + std::to_string(v));
}

}  // namespace

std::vector<std::string> model_names() { return {"mlp", "cnn", "torchscript"}; }

void validate(const ModelSpec& spec) {
  if (spec.name == "mlp") {
    check_positive(spec.input_dim, "input_dim");
    check_positive(spec.hidden, "hidden");
    check_positive(spec.num_classes, "num_classes");
  } else if (spec.name == "cnn") {
    check_positive(spec.channels, "channels");
    check_positive(spec.image_size, "image_size");
    check_positive(spec.hidden, "hidden");
    check_positive(spec.num_classes, "num_classes");
  } else if (spec.name == "torchscript") {
    if (spec.path.empty()) throw ConfigError("model 'torchscript' needs a path (the file torch.jit.save wrote)");
    std::error_code ec;
    if (!std::filesystem::is_regular_file(spec.path, ec))
      throw ConfigError("TorchScript model file '" + spec.path + "' does not exist");
  } else {
    std::string known;
    for (const auto& n : model_names()) known += (known.empty() ? "" : ", ") + n;
    throw ConfigError("unknown model '" + spec.name + "' (known: " + known + ")");
  }
}

std::vector<torch::Tensor> Model::parameters() {
  std::vector<torch::Tensor> out;
  for (auto& [name, p] : named_parameters()) out.push_back(p);
  return out;
}

int64_t Model::parameter_count() {
  int64_t n = 0;
  for (auto& [name, p] : named_parameters()) n += p.numel();
  return n;
}

std::unique_ptr<Model> make_model(const ModelSpec& spec) {
  validate(spec);
  if (spec.name == "mlp") {
    return std::make_unique<NnModel<Mlp>>(Mlp(spec.input_dim, spec.hidden, spec.num_classes),
                                          "mlp(" + std::to_string(spec.input_dim) + "→" + std::to_string(spec.hidden) +
                                              "→" + std::to_string(spec.hidden) + "→" +
                                              std::to_string(spec.num_classes) + ")");
  }
  if (spec.name == "cnn") {
    return std::make_unique<NnModel<Cnn>>(Cnn(spec.channels, spec.image_size, spec.hidden, spec.num_classes),
                                          "cnn(" + std::to_string(spec.channels) + "×" +
                                              std::to_string(spec.image_size) + "², " + std::to_string(spec.hidden) +
                                              " channels, BatchNorm)");
  }
  return std::make_unique<ScriptModel>(spec.path);
}

}  // namespace troupe::trainer
