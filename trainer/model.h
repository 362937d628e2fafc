// Models a trainer can hold: built-in ones from a factory by name (an MLP
// and a small CNN with BatchNorm), the user's own registered with
// TROUPE_MODEL, or a TorchScript module saved in Python with torch.jit.save
// (forward(Tensor) -> Tensor, or forward(Dict[str, Tensor]) ->
// Dict[str, Tensor] returning its own `loss`). ModelSpec is the plain value that crosses the wire;
// Model is the resource built from it on the trainer's side, behind one
// interface (forward, named parameters and buffers, train/eval, device), so
// the reducer, optimizers and checkpoints never care which kind it is.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "troupe/actors/factory_registry.h"
#include "troupe/actors/tensor_dict.h"
#include "troupe/runtime/wire/codec.h"
#include "troupe/trainer/step_context.h"

namespace troupe::trainer {

struct ModelSpec {
  // "mlp", "cnn", "torchscript" or a name registered with TROUPE_MODEL.
  std::string name = "mlp";
  // mlp: input_dim → hidden → hidden → num_classes (ReLU between).
  int64_t input_dim = 784;
  int64_t hidden = 128;
  int64_t num_classes = 10;
  // cnn: input [channels, image_size, image_size]; conv-BN-ReLU ×2 with
  // `hidden` channels, global average pool, linear.
  int64_t channels = 1;
  int64_t image_size = 8;
  // torchscript: the file torch.jit.save wrote.
  std::string path;
  // For registered models: passed to the factory (with the rest of the
  // spec) as is, e.g. JSON the user's factory parses.
  std::string config;

  TROUPE_FIELDS(name, input_dim, hidden, num_classes, channels, image_size, path, config);
};

// The built-in names, for messages.
std::vector<std::string> model_names();

// Throws troupe::ConfigError naming the problem (unknown name, missing
// TorchScript file, non-positive sizes) without building anything.
void validate(const ModelSpec& spec);

// A resource: one per trainer, owned by a unique_ptr.
class Model {
 public:
  Model() = default;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;
  virtual ~Model() = default;

  virtual torch::Tensor forward(const torch::Tensor& input) = 0;
  // Whether the model takes the whole batch (forward_batch) rather than
  // one input tensor; such a model computes its own loss (step "module").
  virtual bool takes_batch() const { return false; }
  // The model on a whole batch. Default: {"output": forward(batch["input"])}.
  virtual actors::TensorDict forward_batch(const actors::TensorDict& batch);
  // For a model that takes the batch: the metrics it returns that are
  // summed over samples and ranks rather than averaged (a TorchScript
  // module declares them as `summed_metrics: List[str]`).
  virtual std::vector<std::string> summed_metrics() const { return {}; }
  // In registration order (the order optimizers and the reducer use).
  virtual std::vector<std::pair<std::string, torch::Tensor>> named_parameters() = 0;
  // Non-trainable state (BatchNorm running statistics).
  virtual std::vector<std::pair<std::string, torch::Tensor>> named_buffers() = 0;
  virtual void train(bool on) = 0;
  virtual void to(const torch::Device& device) = 0;
  // Has the model's fp32 CPU linear layers computed by oneDNN (cpu_gemm.h)
  // where it can, before its first forward; returns how many it routed.
  // Default: none (a ModuleModel asks its module, module_model.h).
  virtual int route_cpu_gemm() { return 0; }
  virtual std::string describe() const = 0;
  // Where the next forward stands in the job, before each one in training
  // and evaluation (the trainer sets the step's context too). Default:
  // nothing; a TorchScript module that defines (and exports:
  // @torch.jit.export) `set_context(self, context: Dict[str, int]) -> None`
  // is called with
  // step, epoch, micro_step, accumulation, rank, world_size, training (1/0).
  virtual void set_context(const StepContext& context) { (void)context; }

  std::vector<torch::Tensor> parameters();
  int64_t parameter_count();
};

// Builds the model on the CPU. Parameters are initialised from torch's
// default generator, so seed it first (torch::manual_seed) for
// reproducibility; TorchScript modules keep the weights of their file.
// Throws troupe::ConfigError for a bad spec.
std::unique_ptr<Model> make_model(const ModelSpec& spec);

using ModelFactory = std::function<std::unique_ptr<Model>(const ModelSpec&)>;
// Registers `factory` under `name`; returns true to initialise a static.
// Prefer TROUPE_MODEL. (trainer/module_model.h wraps a torch::nn module.)
bool register_model(const std::string& name, ModelFactory factory);

}  // namespace troupe::trainer

// At namespace scope in the user's binary:
//   TROUPE_MODEL("gnn", [](const troupe::trainer::ModelSpec& s) {
//     return troupe::trainer::wrap_module(Gnn(s.hidden), "gnn");
//   });
#define TROUPE_MODEL(name, factory)                                                 \
  static const bool TROUPE_REGISTRY_CONCAT(troupe_model_registered_, __COUNTER__) = \
      ::troupe::trainer::register_model(name, factory)
