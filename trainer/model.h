// Models a trainer can hold: built-in ones from a factory by name (an MLP
// and a small CNN with BatchNorm) or a TorchScript module saved in Python
// with torch.jit.save. ModelSpec is the plain value that crosses the wire;
// Model is the resource built from it on the trainer's side, behind one
// interface (forward, named parameters and buffers, train/eval, device), so
// the reducer, optimizers and checkpoints never care which kind it is.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "troupe/runtime/wire/codec.h"

namespace troupe::trainer {

struct ModelSpec {
  // "mlp", "cnn" or "torchscript".
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

  TROUPE_FIELDS(name, input_dim, hidden, num_classes, channels, image_size, path);
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
  // In registration order (the order optimizers and the reducer use).
  virtual std::vector<std::pair<std::string, torch::Tensor>> named_parameters() = 0;
  // Non-trainable state (BatchNorm running statistics).
  virtual std::vector<std::pair<std::string, torch::Tensor>> named_buffers() = 0;
  virtual void train(bool on) = 0;
  virtual void to(const torch::Device& device) = 0;
  virtual std::string describe() const = 0;

  std::vector<torch::Tensor> parameters();
  int64_t parameter_count();
};

// Builds the model on the CPU. Parameters are initialised from torch's
// default generator, so seed it first (torch::manual_seed) for
// reproducibility; TorchScript modules keep the weights of their file.
// Throws troupe::ConfigError for a bad spec.
std::unique_ptr<Model> make_model(const ModelSpec& spec);

}  // namespace troupe::trainer
