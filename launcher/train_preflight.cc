#include "train_preflight.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "troupe/actors/batch.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/exception_text.h"
#include "troupe/trainer/train_step.h"

namespace troupe::launcher {
namespace {

using core::last_line;

std::string path_of(const actors::DatasetSpec& spec) {
  auto it = spec.strings.find("path");
  return it == spec.strings.end() ? spec.name : it->second;
}

actors::Batch first_batch(const actors::DatasetSpec& spec, int64_t batch_size) {
  auto data = actors::make_dataset(spec);  // not empty: to_job_config counted it
  const int64_t n = std::min<int64_t>(data->size(), std::max<int64_t>(2, std::min<int64_t>(batch_size, 4)));
  std::vector<int64_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  auto batch = actors::load_and_collate(*data, std::move(idx), 0);  // as the trainer loads
  batch.tensors = data->finish(std::move(batch.tensors));           // as the trainer does
  return batch;
}

// One step of `step` on `batch` (train or eval), its failure made a
// one-line ConfigError naming the model, the data file and the keys.
void try_step(trainer::TrainStep& step, trainer::Model& model, const actors::Batch& batch, bool train,
              const std::string& data_file) {
  trainer::StepOutput out;
  const std::string where =
      "the model " + model.describe() + " on the first samples of " + data_file + " " + batch.tensors.describe();
  try {
    model.train(train);
    // As the trainer's first step (or its evaluation) would be told.
    trainer::StepContext context;
    context.training = train;
    step.set_context(context);
    model.set_context(context);
    if (train) {
      out = step.train(model, batch.tensors);
    } else {
      torch::NoGradGuard ng;
      out = step.eval(model, batch.tensors);
    }
  } catch (const c10::Error& e) {
    throw ConfigError(where + " failed: " + last_line(e.what_without_backtrace()));
  } catch (const ConfigError& e) {
    throw ConfigError(where + ": " + e.what());
  } catch (const std::exception& e) {
    // The TorchScript interpreter's errors (a KeyError for a missing batch
    // key) are std::runtime_errors with the script's traceback.
    throw ConfigError(where + " failed: " + last_line(e.what()));
  }
  trainer::check_output(out, step);
  if (train && !out.loss.requires_grad())
    throw ConfigError(where + ": the 'loss' it returned does not depend on the parameters");
  if (train && !std::isfinite(out.loss.detach().to(torch::kDouble).item<double>()))
    throw ConfigError(where + ": its 'loss' is not finite (" +
                      std::to_string(out.loss.detach().to(torch::kDouble).item<double>()) + ") on the first batch");
  // A summed metric that forward never returns is a typo: that metric
  // would be averaged where it was meant to be summed.
  for (const auto& name : model.summed_metrics())
    if (!out.metrics.count(name)) {
      std::string returned;
      for (const auto& [k, v] : out.metrics) returned += (returned.empty() ? "" : ", ") + k;
      throw ConfigError(where + ": its summed_metrics names '" + name +
                        "', which forward does not return (it returns " + (returned.empty() ? "no metrics" : returned) +
                        ")");
    }
}

}  // namespace

void preflight(const trainer::TrainerConfig& config) {
  torch::manual_seed(static_cast<uint64_t>(config.seed));
  auto model = trainer::make_model(config.model);
  trainer::apply_cpu_gemm(config, *model);  // the products the trainers will run
  auto step = trainer::make_step(config.step, *model);
  try_step(*step, *model, first_batch(config.data, config.batch_size), true, path_of(config.data));
  if (!config.validation_data.name.empty())
    try_step(*step, *model, first_batch(config.validation_data, config.batch_size), false,
             path_of(config.validation_data));
}

}  // namespace troupe::launcher
