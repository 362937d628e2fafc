#include "troupe/trainer/model.h"

#include <filesystem>
#include <set>
#include <sstream>

#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/script.h>
#include <torch/torch.h>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/exception_text.h"
#include "troupe/trainer/cpu_gemm.h"
#include "troupe/trainer/module_model.h"
#include "troupe/trainer/sync_batch_norm.h"

namespace troupe::trainer {
namespace {

// A built-in model's linear layer: through oneDNN once the trainer routed
// the model (use_cpu_gemm), else the layer's own forward.
torch::Tensor apply_linear(torch::nn::Linear& layer, const torch::Tensor& x, bool cpu_gemm) {
  return cpu_gemm ? trainer::linear(x, layer->weight, layer->bias) : layer->forward(x);
}

struct MlpImpl : torch::nn::Module {
  MlpImpl(int64_t in, int64_t hidden, int64_t out)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        fc3(register_module("fc3", torch::nn::Linear(hidden, out))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = x.reshape({x.size(0), -1});
    x = torch::relu(apply_linear(fc1, x, cpu_gemm_));
    x = torch::relu(apply_linear(fc2, x, cpu_gemm_));
    return apply_linear(fc3, x, cpu_gemm_);
  }
  // ModuleModel::route_cpu_gemm: the layers' products by oneDNN from now on.
  int use_cpu_gemm() {
    cpu_gemm_ = true;
    return 3;
  }
  torch::nn::Linear fc1, fc2, fc3;
  bool cpu_gemm_ = false;
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
    // Synchronised over the ranks with TrainerConfig::sync_batchnorm.
    x = torch::relu(batch_norm(bn1, conv1->forward(x)));
    x = torch::relu(batch_norm(bn2, conv2->forward(x)));
    x = x.mean({2, 3});
    return apply_linear(fc, x, cpu_gemm_);
  }
  // ModuleModel::route_cpu_gemm (the convolutions stay ATen's).
  int use_cpu_gemm() {
    cpu_gemm_ = true;
    return 1;
  }
  int64_t channels_, image_;
  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::BatchNorm2d bn2;
  torch::nn::Linear fc;
  bool cpu_gemm_ = false;
};
TORCH_MODULE(Cnn);

// The first line of a message that has several (TorchScript's errors quote
// the source below it), said as one. A zip that torch.save wrote (a
// pickled module or state dict) has no constants.pkl, which TorchScript's
// loader looks for first: that is said plainly.
std::string load_error_reason(const std::string& text) {
  std::string line = core::first_line(text);
  const bool more = line != core::last_line(text);
  while (!line.empty() && (line.back() == ':' || line.back() == ' ')) line.pop_back();
  if (line.find("constants.pkl") != std::string::npos) {
    line +=
        " (not a TorchScript file: torch.save writes one only Python can read; save the module with "
        "torch.jit.save(torch.jit.script(model), path))";
    return line;
  }
  return more ? line + " (torch's message goes on; load the file in Python to see it all)" : line;
}

// A TorchScript module. Its graphs run unoptimised: the profiling executor
// would specialise and fuse them after a few warm-up calls, so a
// replacement trainer (a fresh process) would compute its first steps with
// other kernels than the warmed-up survivors, and recovery would no longer
// give bitwise-equal weights.
class ScriptModel final : public Model {
 public:
  explicit ScriptModel(const std::string& path) : path_(path) {
    try {
      m_ = torch::jit::load(path, torch::kCPU);
    } catch (const c10::Error& e) {
      throw ConfigError("cannot load TorchScript model '" + path +
                        "': " + load_error_reason(e.what_without_backtrace()));
    } catch (const std::exception& e) {
      // TorchScript's own compile errors (a module saved in a form this
      // LibTorch cannot read back): many lines of source excerpt.
      throw ConfigError("cannot load TorchScript model '" + path + "': " + load_error_reason(e.what()));
    }
    takes_batch_ = check_signature();
    has_set_context_ = check_set_context();
    // Saved training, with some submodules in eval: those stay in eval.
    // (Saved in eval as a whole, nothing can be told apart: all train.)
    if (m_.is_training())
      for (const auto& sub : m_.named_modules())
        if (!sub.value.is_training()) kept_in_eval_.insert(sub.name);
  }
  torch::Tensor forward(const torch::Tensor& input) override {
    if (takes_batch_) throw ConfigError("TorchScript model '" + path_ + "' takes the batch dict, not one tensor");
    torch::jit::GraphOptimizerEnabledGuard plain(false);
    return m_.forward({input}).toTensor();
  }
  bool takes_batch() const override { return takes_batch_; }
  void set_context(const StepContext& c) override {
    if (!has_set_context_) return;
    c10::Dict<std::string, int64_t> d;
    d.insert("step", c.step);
    d.insert("epoch", c.epoch);
    d.insert("micro_step", c.micro_step);
    d.insert("accumulation", c.accumulation);
    d.insert("rank", c.rank);
    d.insert("world_size", c.world_size);
    d.insert("training", c.training ? 1 : 0);
    try {
      torch::jit::GraphOptimizerEnabledGuard plain(false);  // as forward: the same code on every trainer
      m_.get_method("set_context")({d});
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      throw ConfigError("TorchScript model '" + path_ + "': set_context failed: " + core::last_line(what) + "\n" +
                        what);
    } catch (const std::exception& e) {
      // The interpreter's own errors (a raise, an assert, a KeyError in
      // the script) are std::runtime_errors: the user's, not a crash to
      // heal (it was retried for ever).
      throw ConfigError("TorchScript model '" + path_ + "': set_context failed: " + core::last_line(e.what()) + "\n" +
                        e.what());
    }
  }
  std::vector<std::string> summed_metrics() const override {
    std::vector<std::string> out;
    if (!m_.hasattr("summed_metrics")) return out;
    auto v = m_.attr("summed_metrics");
    if (!v.isList()) throw ConfigError("TorchScript model '" + path_ + "': summed_metrics must be a List[str]");
    for (const auto& e : v.toListRef()) {
      if (!e.isString()) throw ConfigError("TorchScript model '" + path_ + "': summed_metrics must be a List[str]");
      out.push_back(e.toStringRef());
    }
    return out;
  }
  actors::TensorDict forward_batch(const actors::TensorDict& batch) override {
    if (!takes_batch_) return Model::forward_batch(batch);
    c10::Dict<std::string, at::Tensor> in;
    for (const auto& [key, value] : batch) in.insert(key, value);
    c10::IValue out;
    try {
      torch::jit::GraphOptimizerEnabledGuard plain(false);
      out = m_.forward({in});
    } catch (const c10::Error& e) {
      // The interpreter's message is the script's traceback ending in the
      // error itself: that line first (a one-line report keeps it, e.g.
      // "KeyError: features"), then the traceback.
      const std::string what = e.what_without_backtrace();
      throw ConfigError("TorchScript model '" + path_ + "' failed on a batch " + batch.describe() + ": " +
                        core::last_line(what) + "\n" + what);
    }
    actors::TensorDict result;
    for (const auto& entry : out.toGenericDict()) result.set(entry.key().toStringRef(), entry.value().toTensor());
    return result;
  }
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
  // Training mode leaves in eval mode the submodules the module was saved
  // with in eval mode while it trained (a frozen BatchNorm), as a torch
  // loop that calls model.train() after validation would not, but as the
  // user saved it: a validation pass does not unfreeze them.
  void train(bool on) override {
    m_.train(on);
    if (!on) return;
    for (auto sub : m_.named_modules())
      if (kept_in_eval_.count(sub.name)) sub.value.train(false);
  }
  void to(const torch::Device& device) override { m_.to(device); }
  int route_cpu_gemm() override { return route_linear(m_); }
  std::string describe() const override { return "torchscript(" + path_ + ")"; }

 private:
  // True for forward(Dict[str, Tensor]) -> Dict[str, Tensor], false for
  // forward(Tensor) -> Tensor; anything else is a ConfigError naming the
  // file, before any training.
  // Whether the module defines set_context(self, context: Dict[str, int])
  // -> None; one of another signature is refused, naming the expected one.
  bool check_set_context() const {
    auto method = m_.find_method("set_context");
    if (!method) return false;
    const auto& schema = method->function().getSchema();
    const auto& args = schema.arguments();
    const auto& rets = schema.returns();
    bool ok = args.size() == 2 && rets.size() == 1 && rets[0].type()->kind() == c10::TypeKind::NoneType;
    if (ok) {
      auto d = args[1].type()->cast<c10::DictType>();
      ok = d && d->getKeyType()->kind() == c10::TypeKind::StringType &&
           d->getValueType()->kind() == c10::TypeKind::IntType;
    }
    if (!ok) {
      std::ostringstream given;
      given << schema;
      throw ConfigError("TorchScript model '" + path_ + "': its set_context is " + given.str() +
                        ", where troupe calls set_context(self, context: Dict[str, int]) -> None");
    }
    return true;
  }

  bool check_signature() const {
    auto method = m_.find_method("forward");
    if (!method) throw ConfigError("TorchScript model '" + path_ + "' has no forward method");
    const auto& schema = method->function().getSchema();
    auto is_dict = [](const c10::TypePtr& t) {
      auto d = t->cast<c10::DictType>();
      return d && d->getKeyType()->kind() == c10::TypeKind::StringType &&
             d->getValueType()->kind() == c10::TypeKind::TensorType;
    };
    const auto& all = schema.arguments();
    const auto& rets = schema.returns();
    // The arguments after self that a call must give (later ones have
    // defaults).
    std::vector<c10::Argument> args(all.begin(), all.end());
    while (args.size() > 2 && args.back().default_value()) args.pop_back();
    if (args.size() == 2 && is_dict(args[1].type())) {
      if (rets.size() == 1 && is_dict(rets[0].type())) return true;
      throw ConfigError("TorchScript model '" + path_ +
                        "': forward(batch: Dict[str, Tensor]) must return Dict[str, Tensor] with a 'loss', not " +
                        (rets.empty() ? std::string("nothing") : rets[0].type()->str()));
    }
    if (args.size() == 2 && args[1].type()->kind() == c10::TypeKind::TensorType) return false;
    std::string got;
    for (size_t i = 1; i < args.size(); ++i) got += (got.empty() ? "" : ", ") + args[i].type()->str();
    throw ConfigError("TorchScript model '" + path_ + "': forward must take one Tensor or one Dict[str, Tensor], " +
                      "it takes (" + got + ")");
  }

  std::string path_;
  torch::jit::Module m_;
  std::set<std::string> kept_in_eval_;  // submodules saved in eval mode in a module saved training
  bool takes_batch_ = false;
  bool has_set_context_ = false;  // set_context(self, context: Dict[str, int])
};

void check_positive(int64_t v, const char* what) {
  if (v <= 0) throw ConfigError(std::string("model: ") + what + " must be positive, got " + std::to_string(v));
}

}  // namespace

std::vector<std::string> model_names() {
  return actors::FactoryRegistry<ModelFactory>::instance().names({"mlp", "cnn", "torchscript"});
}

bool register_model(const std::string& name, ModelFactory factory) {
  return actors::FactoryRegistry<ModelFactory>::instance().add(name, std::move(factory));
}

actors::TensorDict Model::forward_batch(const actors::TensorDict& batch) {
  return {{"output", forward(batch.at("input"))}};
}

void validate(const ModelSpec& spec) {
  actors::FactoryRegistry<ModelFactory>::instance().check(
      spec.name, spec.name == "mlp" || spec.name == "cnn" || spec.name == "torchscript", "model", "TROUPE_MODEL");
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
  } else if (!actors::FactoryRegistry<ModelFactory>::instance().find(spec.name)) {
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
    return std::make_unique<ModuleModel<Mlp>>(Mlp(spec.input_dim, spec.hidden, spec.num_classes),
                                              "mlp(" + std::to_string(spec.input_dim) + "→" +
                                                  std::to_string(spec.hidden) + "→" + std::to_string(spec.hidden) +
                                                  "→" + std::to_string(spec.num_classes) + ")");
  }
  if (spec.name == "cnn") {
    return std::make_unique<ModuleModel<Cnn>>(Cnn(spec.channels, spec.image_size, spec.hidden, spec.num_classes),
                                              "cnn(" + std::to_string(spec.channels) + "×" +
                                                  std::to_string(spec.image_size) + "², " +
                                                  std::to_string(spec.hidden) + " channels, BatchNorm)");
  }
  if (spec.name == "torchscript") return std::make_unique<ScriptModel>(spec.path);
  auto factory = *actors::FactoryRegistry<ModelFactory>::instance().find(spec.name);
  auto model = actors::run_factory("model '" + spec.name + "'", [&] { return factory(spec); });
  if (!model) throw ConfigError("model factory '" + spec.name + "' returned no model");
  return model;
}

}  // namespace troupe::trainer
