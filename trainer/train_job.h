// TrainJob: the driver side of data-parallel training. Given a runtime and
// a TrainJobConfig it reserves a placement group with one bundle per
// trainer, spawns the TrainerActors, forms their collective group, runs the
// epochs in lock step, reduces metrics across ranks, prints progress,
// writes metrics as JSON lines, evaluates, checkpoints (from rank 0,
// written asynchronously by the driver) and returns a Result.
//
//   troupe::trainer::TrainJobConfig cfg;
//   cfg.scaling.num_workers = 2;
//   cfg.trainer.data = troupe::actors::DatasetSpec("digits").set("normalize", 1);
//   cfg.epochs = 10;
//   auto result = troupe::trainer::TrainJob(rt, cfg).fit();
//
// Bad input (unknown model, missing TorchScript file, batch size 0, more
// workers than the cluster can place) fails in the constructor or at the
// start of fit(), before any trainer is spawned, with a ConfigError.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "runtime/client/runtime.h"
#include "actors/data_loader_actor.h"
#include "trainer/checkpoint.h"
#include "trainer/trainer_actor.h"

namespace troupe::trainer {

struct ScalingConfig {
  int64_t num_workers = 1;
  // What each trainer reserves: {{"CPU", 1}} or {{"GPU", 1}, {"CPU", 2}}.
  Resources resources_per_worker = {{"CPU", 1}};
  PlacementStrategy strategy = PlacementStrategy::kPack;
  // How long to wait for the placement group before failing with the
  // reason it is PENDING.
  std::chrono::milliseconds placement_timeout{std::chrono::seconds(10)};
};

struct CheckpointConfig {
  // "" = no checkpoints.
  std::string dir;
  // Every N optimizer steps (0 = only at epoch ends).
  int64_t every_steps = 0;
  bool at_epoch_end = true;
  // Newest K kept (0 = all).
  int keep = 3;
  // Written on a driver thread while training goes on.
  bool async = true;
};

struct TrainJobConfig {
  std::string name = "train";
  ScalingConfig scaling;
  TrainerConfig trainer;
  int64_t epochs = 1;
  // Stop after this many optimizer steps in all (0 = run the epochs).
  int64_t max_steps = 0;
  CheckpointConfig checkpoint;
  // A checkpoint directory (step-…) or a root holding several (the latest
  // valid one is used). The world size may differ from the checkpoint's.
  std::string resume_from;
  // JSON lines: one per step, per epoch and per evaluation ("" = none).
  std::string metrics_path;
  // Progress lines on stdout: a live line during an epoch, one per epoch.
  bool verbose = true;
  // Steps per train() call when nothing else bounds it (live progress).
  int64_t progress_every_steps = 0;
  bool evaluate = true;
  // Feed trainers from one DataLoaderActor each (colocated in the trainer's
  // bundle, streaming batches) rather than from the trainer's own copy of
  // the data set. Only when the training split is the whole data set
  // (validation_fraction == 0): a loader samples the whole set.
  bool use_loaders = true;
  int64_t loader_threads = 1;
  // Executable for the trainers ("" = the driver's own).
  std::string executable;
  std::chrono::milliseconds call_timeout{std::chrono::minutes(10)};
};

struct EpochMetrics {
  int64_t epoch = 0;
  int64_t steps = 0;         // optimizer steps at the end of the epoch
  double train_loss = 0;     // mean over the epoch's samples, all ranks
  double train_accuracy = 0;
  double samples_per_second = 0;
  double val_loss = 0;
  double val_accuracy = 0;
  int64_t val_count = 0;
  double seconds = 0;
};

struct JobEvent {
  double time = 0;  // seconds since fit() began
  std::string kind;  // "placed", "started", "resumed", "checkpoint", "epoch", "finished"
  std::string detail;
};

struct Result {
  std::vector<EpochMetrics> history;
  std::vector<JobEvent> events;
  std::optional<CheckpointInfo> last_checkpoint;
  // Rank 0's final state (model, optimizer, cursor).
  TrainState final_state;
  int64_t steps = 0;
};

class TrainJob {
 public:
  // Validates the config (ConfigError on bad input); starts nothing.
  TrainJob(Runtime& rt, TrainJobConfig config);
  ~TrainJob();
  TrainJob(const TrainJob&) = delete;
  TrainJob& operator=(const TrainJob&) = delete;

  Result fit();

 private:
  struct Impl;
  Runtime& rt_;
  TrainJobConfig config_;
};

// Throws ConfigError for anything a TrainJob would reject up front.
void validate(const TrainJobConfig& config);

}  // namespace troupe::trainer
