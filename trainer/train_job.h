// TrainJob: the driver side of data-parallel training. Given a runtime and
// a TrainJobConfig it places one trainer per worker (each in a one-bundle
// placement group with its DataLoaderActor), forms their collective group,
// runs the epochs in lock step, reduces metrics across ranks, prints
// progress, writes metrics and events as JSON lines, evaluates, checkpoints
// (from rank 0, written asynchronously by the driver) and returns a Result.
//
//   troupe::trainer::TrainJobConfig cfg;
//   cfg.scaling.num_workers = 2;
//   cfg.trainer.data = troupe::actors::DatasetSpec("digits").set("normalize", 1);
//   cfg.epochs = 10;
//   cfg.failure.max_failures = 3;   // survive three failures
//   auto result = troupe::trainer::TrainJob(rt, cfg).fit();
//
// Failures (FailureConfig): when a trainer, a loader or a node dies, the
// driver aborts the group in every survivor, places a replacement (or, with
// none available, shrinks to the survivors down to scaling.min_workers),
// re-forms the group under the next generation, heals the newcomers with a
// live peer's whole state by broadcast, and retries the step that failed:
// no completed step is lost, and with replacements the final weights are
// bitwise those of a run without failures. With every trainer gone it
// restarts from the last checkpoint. An elastic job below max_workers grows
// back at a step boundary when room appears.
//
// Bad input (unknown model, missing TorchScript file, batch size 0, more
// workers than the cluster can place) fails in the constructor or at the
// start of fit(), before any trainer is spawned, with a ConfigError.
//
// Inside (docs/runtime.md, "Recovery and elasticity"): fit() is a driver
// loop over SlotPool (placement, standbys, room to grow), Gang (the trainers
// of one generation: fan-out, group, heal, the fail-fast round),
// FailureRecovery (one failure's steps), JobReporter (events, metrics JSON
// lines, console) and ConsumedRecord (Result::consumed).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "troupe/actors/data_loader_actor.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/trainer/checkpoint.h"
#include "troupe/trainer/trainer_actor.h"

namespace troupe::trainer {

struct ScalingConfig {
  int64_t num_workers = 1;
  // What each trainer reserves: {{"CPU", 1}} or {{"GPU", 1}, {"CPU", 2}}.
  // A part of a GPU ({{"GPU", 0.5}}) lets two trainers share one GPU; they
  // then reduce through host memory (TrainerConfig::collective "gloo").
  Resources resources_per_worker = {{"CPU", 1}};
  // Elastic range (0 = num_workers for both). The job starts with
  // num_workers, or with as many as can be placed when that is at least
  // min_workers; it shrinks to no fewer than min_workers after failures and
  // grows back to max_workers when room appears.
  int64_t min_workers = 0;
  int64_t max_workers = 0;
  // How often, at a step boundary, a job below max_workers checks the
  // cluster for room to grow (0 = at every step boundary).
  std::chrono::milliseconds grow_interval{std::chrono::seconds(2)};
  // Each trainer has its own one-bundle placement group (so one can be
  // replaced without disturbing the others); the strategy applies to each
  // of them. PACK fills nodes in turn, SPREAD places each on the least
  // loaded node.
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

// How a job recovers from a failure: the policy (FailureConfig::mode, kHeal
// or kCheckpoint) and what a recovery did (Recovery::mode, any of the three).
enum class RecoveryMode {
  // A replacement (or the survivors alone) is healed from a live peer by
  // broadcast; the disk is read only when every trainer is gone.
  kHeal,
  // Every failure goes back to the last checkpoint (the torchrun / Ray
  // Train behaviour; for comparison).
  kCheckpoint,
  // Back to the initial weights: every trainer gone and no checkpoint. Only
  // an outcome; validate() refuses it as FailureConfig::mode.
  kRestart,
};
// "heal", "checkpoint", "restart".
const char* to_string(RecoveryMode mode);
std::ostream& operator<<(std::ostream& os, RecoveryMode mode);

struct FailureConfig {
  // Failures survived before fit() gives up with JobFailed (-1 = no limit).
  int64_t max_failures = 0;
  RecoveryMode mode = RecoveryMode::kHeal;
  // How long to wait for a replacement's resources before shrinking (or
  // failing below scaling.min_workers): longer than a stall that gets a
  // node agent fenced, so that the node, rejoining, can take it.
  std::chrono::milliseconds replacement_timeout{std::chrono::seconds(10)};
  // How long survivors get to leave an aborted step before they are killed
  // and counted as failed too.
  std::chrono::milliseconds abort_timeout{std::chrono::seconds(5)};
  // Hot spares: trainers kept placed, started and set up (each with its
  // loader), idle, so a dead trainer's replacement needs no process start.
  // Each holds a worker's resources. Refilled at step boundaries (no more
  // often than scaling.grow_interval) when there is room.
  int64_t standby_workers = 0;
};

// What the driver saw at a step boundary (TrainJobConfig::on_step).
struct StepInfo {
  int64_t step = 0;
  int64_t epoch = 0;
  int64_t world_size = 0;
  double time = 0;  // seconds since fit() began
  // Samples and seconds of the train() calls that just ended.
  int64_t samples = 0;
  double seconds = 0;
  // The share of those seconds a trainer spent waiting for its batches
  // (the largest over ranks, 0-1; TrainReport::wait_seconds).
  double data_wait = 0;
};

struct TrainJobConfig {
  std::string name = "train";
  ScalingConfig scaling;
  TrainerConfig trainer;
  int64_t epochs = 1;
  // Stop after this many optimizer steps in all, counted from the job's
  // first step (a resume goes on to it), or at the end of the epochs,
  // whichever comes first (0 = run the epochs). A stop mid-epoch writes a
  // checkpoint of the step reached (with checkpoint.dir set).
  int64_t max_steps = 0;
  CheckpointConfig checkpoint;
  FailureConfig failure;
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
  // A step whose loss is NaN or infinite fails the job (naming the step
  // and the newest checkpoint), rather than training on to NaN weights
  // and a run that ends as done; false trains on.
  bool stop_on_nonfinite_loss = true;
  // Feed trainers from one DataLoaderActor each (colocated in the trainer's
  // bundle, streaming batches) rather than from the trainer's own copy of
  // the data set. Only when the training split is the whole data set
  // (validation_fraction == 0): a loader samples the whole set.
  bool use_loaders = true;
  // Pipeline threads of each loader (decode, augment, collate; 1-256).
  int64_t loader_threads = 1;
  // Batches each loader makes of its trainer's next round as soon as it has
  // sent this round's, so that a round does not begin by waiting for its
  // pipeline's first batch (LoaderConfig::look_ahead; 0-64, 0 = none).
  int64_t loader_look_ahead = 2;
  // Executable for the trainers ("" = the driver's own).
  std::string executable;
  // Send the files the trainers read (the TorchScript model, the data sets'
  // files: files_read) from the driver, which reads them, rather than
  // have every trainer and loader open them at the driver's paths: for
  // hosts that do not share the driver's files. Each host fetches each
  // file once into its session directory (shipped_file.h); the driver
  // holds them in its object store while the job runs.
  bool ship_files = false;
  std::chrono::milliseconds call_timeout{std::chrono::minutes(10)};
  // What setting up and forming the gang may take (trainers that start,
  // load their model and meet in a group, a heal's or a checkpoint's state
  // sent to them): call_timeout bounds a round, whose time a user knows;
  // this, at least, bounds the rest, whose time a loaded machine stretches.
  std::chrono::milliseconds setup_timeout{std::chrono::minutes(5)};
  std::chrono::milliseconds setup_bound() const { return std::max(call_timeout, setup_timeout); }
  // Keep the data set indices every completed step trained on, per epoch
  // (Result::consumed): for tests of exactly-once delivery.
  bool record_indices = false;
  // Called on the driver's thread at every step boundary it sees (after
  // each round of train() calls); fault injection and live plots hook here.
  std::function<void(const StepInfo&)> on_step;
  // Polled on the driver's thread at every step boundary: true stops the
  // job there, early. It checkpoints the step reached (with checkpoint.dir
  // set; mid-epoch, so resume_from goes on from that very step) and fit()
  // returns with Result::interrupted. For a driver told to stop by a
  // signal (troupe train on SIGINT or SIGTERM). Also polled every 200 ms
  // while the driver waits for a placement, the trainers' setup (a
  // shipped file's fetch), a group forming or a state loading, as the job
  // starts, heals or grows: a stop there ends fit() at once, interrupted,
  // with the state of trainers that hold it saved when it is newer than
  // the last checkpoint (nothing trained yet: none). Keep it cheap.
  std::function<bool()> stop_requested;
  // With stop_requested set, a round of train() calls (the steps between
  // two boundaries) is cut to about this long, at least one step, judged
  // by the last round's time a step; so a stop comes this soon even when
  // progress_every_steps and checkpoint.every_steps are 0 or far apart.
  std::chrono::milliseconds stop_within{5000};
};

struct EpochMetrics {
  int64_t epoch = 0;
  int64_t steps = 0;      // optimizer steps at the end of the epoch
  double train_loss = 0;  // mean over the epoch's samples, all ranks
  double train_accuracy = 0;
  double samples_per_second = 0;
  // The share of the epoch's training time the trainers waited for their
  // batches (per call the largest over ranks; 0-1). Printed when 5 % or more.
  double data_wait = 0;
  double val_loss = 0;
  double val_accuracy = 0;
  int64_t val_count = 0;
  double seconds = 0;
  // Every metric the step returned, reduced over the epoch's samples and
  // all ranks (mean, or sum for the step's summed metrics);
  // train_accuracy/val_accuracy repeat "accuracy" when there is one.
  std::map<std::string, double> train_metrics;
  std::map<std::string, double> val_metrics;

  // train_loss, and of train_accuracy/val_loss/val_accuracy those that were
  // measured (an accuracy where the step reports one, validation where it
  // ran): the epoch record of the metrics file and a checkpoint's metrics.
  std::map<std::string, double> summary() const;
};

// What a JobEvent records. to_string() gives the spelling used on stdout and
// in the metrics file's {"kind": "event", "event": ...} lines (read by tools
// such as examples/elastic_experiment/plot.py: keep it stable).
enum class JobEventKind {
  kPlaced,       // "placed": the first slots are placed
  kResumeFrom,   // "resume_from": TrainJobConfig::resume_from was loaded
  kStarted,      // "started": trainers set up and grouped
  kStandby,      // "standby": standby trainers placed
  kCheckpoint,   // "checkpoint": a checkpoint was submitted
  kEpoch,        // "epoch": an epoch ended
  kFinished,     // "finished"
  kInterrupted,  // "interrupted": stopped early (stop_requested)
  kFailed,       // "failed": fit() gives up (JobFailed)
  // A failure and its recovery, in order:
  kFailure,   // "failure": seen
  kAborted,   // "aborted": group aborted in the survivors
  kReplaced,  // "replaced": replacement trainers (or loaders) placed
  kHealed,    // "healed": state sent from a live peer
  kRestored,  // "restored": state read from a checkpoint (or restart)
  kResized,   // "resized": world size changed (recovery or growth)
  kResumed,   // "resumed": training goes on after a recovery
  // Growth at a step boundary:
  kGrew,        // "grew": new trainers placed to grow
  kGrowHealed,  // "grow_healed": the newcomers took rank 0's state
  kGrowFailed,  // "grow_failed": the newcomers could not set up or join;
                // dropped, the job goes on at its old size
  kGrowPutOff,  // "grow_put_off": growing now would leave samples of the
                // epoch untrained; it waits for a boundary (said once an
                // epoch)
  // "samples_skipped": resumed mid-epoch with other steps (another batch
  // size, accumulation or worker count), the rest of that epoch does not
  // fill whole steps: how many of its samples go untrained.
  kSamplesSkipped,
};
const char* to_string(JobEventKind kind);
std::ostream& operator<<(std::ostream& os, JobEventKind kind);

struct JobEvent {
  double time = 0;  // seconds since fit() began
  JobEventKind kind = JobEventKind::kPlaced;
  std::string detail;
  int64_t step = 0;
  int64_t world_size = 0;
};

// One failure and its recovery.
struct Recovery {
  double failed_at = 0;     // seconds since fit() began, when the driver saw it
  double resumed_at = 0;    // when training went on
  double step_done_at = 0;  // when the next step completed (0 = none did)
  std::string cause;
  // kHeal (from a live peer), kCheckpoint (from disk), kRestart (from the
  // initial weights: every trainer gone and no checkpoint).
  RecoveryMode mode = RecoveryMode::kHeal;
  // Replacements taken from the standby trainers / newly placed.
  int64_t from_standby = 0;
  int64_t placed = 0;
  int64_t world_before = 0;
  int64_t world_after = 0;
  // The most steps any survivor had completed, and the step training
  // resumed at: lost_steps = reached - resumed_step (never negative).
  int64_t reached_step = 0;
  int64_t resumed_step = 0;
  int64_t lost_steps = 0;
};

struct Result {
  std::vector<EpochMetrics> history;
  std::vector<JobEvent> events;
  std::optional<CheckpointInfo> last_checkpoint;
  // Rank 0's final state (model, optimizer, cursor).
  TrainState final_state;
  int64_t steps = 0;
  std::vector<Recovery> recoveries;
  int64_t final_world_size = 0;
  // With record_indices: epoch -> the data set indices trained on.
  std::map<int64_t, std::vector<int64_t>> consumed;
  // Stopped early by TrainJobConfig::stop_requested (steps: the last step
  // boundary). Stopped while the job started, healed or grew, final_state
  // is empty, a recovery cut short is not in `recoveries`, and the newest
  // state is last_checkpoint (a survivor's may be past `steps`).
  bool interrupted = false;
};

// fit() gave up (max_failures exhausted, fewer than min_workers left, a
// failure it cannot recover from); carries what happened until then.
class JobFailed : public Error {
 public:
  JobFailed(const std::string& what, Result partial) : Error(what), result_(std::move(partial)) {}
  const Result& result() const { return result_; }

 private:
  Result result_;
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
  Runtime& rt_;
  TrainJobConfig config_;
};

// Throws ConfigError for anything a TrainJob would reject up front.
void validate(const TrainJobConfig& config);

}  // namespace troupe::trainer
