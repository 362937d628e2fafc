// TrainerActor: one data-parallel trainer, one per GPU (or per CPU slot).
// The driver (TrainJob) spawns N of them, sets each up from the same
// TrainerConfig, has them join a collective group, and then drives them in
// lock step: train(cursor, steps) on every rank, evaluate, state/load_state
// for checkpoints. Every rank reads its own part of the epoch, as
// DistributedSampler assigns it, from the SamplerCursor the driver passes,
// either from its own copy of the data set or from a StreamReader<Batch>
// fed by a DataLoaderActor (open_stream()).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "troupe/actors/batch.h"
#include "troupe/actors/dataset.h"
#include "troupe/actors/distributed_sampler.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/client/shipped_file.h"
#include "troupe/runtime/client/stream.h"
#include "troupe/trainer/checkpoint.h"
#include "troupe/trainer/model.h"
#include "troupe/trainer/optimizer.h"
#include "troupe/trainer/train_step.h"

namespace troupe::collective {
class Group;
}

namespace troupe::trainer {

class GradientReducer;
class ShmGroup;

// Everything a trainer needs to build itself; the same value on every rank.
struct TrainerConfig {
  ModelSpec model;
  // What a step computes from a batch (loss and metrics); see train_step.h.
  StepSpec step;
  OptimizerConfig optimizer;
  ScheduleConfig schedule;
  // Seeds torch's generator before the model is built (identical initial
  // weights on every rank) and the sampler's shuffle.
  int64_t seed = 0;
  // Per worker, per micro-step.
  int64_t batch_size = 32;
  // Micro-steps per optimizer step; gradients are reduced on the last.
  int64_t accumulation = 1;
  // "none", "bf16", "fp16": how gradient buckets travel.
  std::string compression = "none";
  int64_t bucket_mb = 25;
  // The training data. With validation_fraction > 0 a random (split_seed)
  // validation_fraction of it is held out for evaluate(); the sampler then
  // draws from the remaining training split.
  actors::DatasetSpec data;
  double validation_fraction = 0.0;
  int64_t split_seed = 0;
  bool shuffle = true;
  // torch intra-op threads in the worker (0 = leave torch's default).
  int64_t threads = 1;
  // "auto" (cuda:0 when this actor was given a GPU, else cpu), "cpu", or
  // "cuda" (cuda:0 whatever the actor was given; a ConfigError where
  // LibTorch sees no CUDA device).
  std::string device = "auto";
  // Autocast for the forward pass in amp_dtype: "fp16" (CUDA only) or
  // "bf16" (CUDA, or the CPU, where it pays on CPUs with AVX512-BF16 or
  // AMX: oneDNN's bf16 matmuls). fp16 adds dynamic loss scaling (as
  // torch.amp.GradScaler), starting at initial_loss_scale. bf16 has fp32's
  // range and needs none. Parameters, gradients and optimizer state stay
  // fp32.
  bool mixed_precision = false;
  std::string amp_dtype = "fp16";
  double initial_loss_scale = 65536.0;
  // How ranks reduce: "auto" (NCCL for CUDA trainers, Gloo for CPU ones),
  // "nccl", or "gloo" (a CUDA trainer's gradients, buffers and heal state
  // go through host memory: for trainers that share one GPU, which NCCL
  // cannot put two ranks on; TrainJob picks it for a fractional GPU).
  std::string collective = "auto";
  // Ranks on one host reduce float32 CPU gradients through shared memory
  // (ShmGroup) rather than TCP.
  bool shared_memory = true;
  // Exponential moving average of the weights, updated after every
  // optimizer step (ema = decay * ema + (1 - decay) * weights); 0 = off.
  // evaluate() then scores the averaged weights. Kept in the state (and in
  // checkpoints) under the optimizer's "ema/<parameter>" entries.
  double ema_decay = 0.0;
  // A data set of its own for evaluate() (name "" = none): scored whole,
  // and the training data is not split (validation_fraction must be 0).
  actors::DatasetSpec validation_data;
  // BatchNorm layers of C++ models (the built-in cnn; the user's through
  // trainer::batch_norm, sync_batch_norm.h) normalise with the statistics
  // of the whole batch over all ranks, as torch.nn.SyncBatchNorm.
  bool sync_batchnorm = false;
  // Gradient clipping: the global L2 norm of all gradients is scaled down to
  // at most grad_clip (torch.nn.utils.clip_grad_norm_); 0 = off. Applied to
  // the reduced gradients, which every rank holds alike, so every rank
  // clips identically and recovery stays bitwise.
  double grad_clip = 0.0;
  // The fp32 matrix products of a CPU trainer's linear layers (cpu_gemm.h):
  // "auto" computes those of a TorchScript model, of the built-in mlp and
  // cnn and of a module that defines use_cpu_gemm() with oneDNN where
  // LibTorch links libdnnl.so.2 and with ATen otherwise, "onednn" the same but a
  // ConfigError without it, "aten" always ATen (torch's own BLAS).
  std::string cpu_gemm = "auto";
  // Files the driver sent (TrainJobConfig::ship_files): a path of the
  // model's or a data set's that one of them ships is read from this host's
  // copy of it (shipped_file.h), fetched from the driver at setup.
  std::vector<ShippedFile> shipped_files;

  TROUPE_FIELDS(model, step, optimizer, schedule, seed, batch_size, accumulation, compression, bucket_mb, data,
                validation_fraction, split_seed, shuffle, threads, device, mixed_precision, amp_dtype,
                initial_loss_scale, collective, shared_memory, ema_decay, validation_data, sync_batchnorm, grad_clip,
                cpu_gemm, shipped_files);
};

// A file a trainer reads at a path its config names: the TorchScript
// model, the files of the data sets' built-in readers (actors::file_keys).
struct ConfigFile {
  std::string what;   // "the model", "the data", "the validation data"
  std::string* path;  // its place in the config
};
std::vector<ConfigFile> files_read(TrainerConfig& config);

// Throws troupe::ConfigError naming the first bad field (no data set is
// opened, no model built).
void validate(const TrainerConfig& config);
// Has a CPU model's fp32 linear layers computed as config.cpu_gemm says
// (cpu_gemm.h), before its first forward; returns how many call sites now
// use oneDNN. A ConfigError for "onednn" where oneDNN is not found.
int apply_cpu_gemm(const TrainerConfig& config, Model& model);
// Sampler options for the training split of a data set of `dataset_size`.
actors::SamplerOptions sampler_options(const TrainerConfig& config, int64_t dataset_size, int64_t world_size);
// Samples in the training split.
int64_t train_size(const TrainerConfig& config, int64_t dataset_size);
// Data set indices in split order: the first train_size() are the training
// split (sampler position i reads data set index split[i]), the rest the
// validation split. Empty without a validation split (identity).
std::vector<int64_t> split_order(const TrainerConfig& config, int64_t dataset_size);

struct TrainerInfo {
  std::string device;
  std::string model;
  int64_t parameters = 0;
  int64_t dataset_size = 0;
  int64_t pid = 0;
  TROUPE_FIELDS(device, model, parameters, dataset_size, pid);
};

// The group a trainer joins (GroupSpec without the parts that are not
// values).
struct JoinSpec {
  std::string name;
  int64_t generation = 1;
  int64_t rank = 0;
  int64_t world_size = 1;
  std::vector<uint64_t> members;
  // Take rank 0's parameters and buffers after joining. A driver that heals
  // the group right after (heal()) skips this: the heal sends everything.
  bool sync_params = true;
  TROUPE_FIELDS(name, generation, rank, world_size, members, sync_params);
};

struct TrainRequest {
  actors::SamplerCursor cursor;
  // Optimizer steps to run at most (the epoch's end may come first).
  int64_t max_steps = 0;
  // Read batches from the stream opened with open_stream() instead of the
  // trainer's own copy of the data set.
  bool from_stream = false;
  // Report the data set indices of every completed step (TrainReport::consumed).
  bool record_indices = false;
  TROUPE_FIELDS(cursor, max_steps, from_stream, record_indices);
};

// One rank's account of a train() call; the driver sums over ranks.
struct TrainReport {
  int64_t steps = 0;
  int64_t samples = 0;
  double loss_sum = 0;  // per-sample loss summed
  // Samples classified right: the `accuracy` metric times the samples (0
  // for steps without one).
  int64_t correct = 0;
  // The step's metrics: per-sample value summed (a mean metric times its
  // batch's samples), or the plain sum for the metrics in summed_metrics.
  std::map<std::string, double> metric_sums;
  std::vector<std::string> summed_metrics;
  double seconds = 0;
  // Of those, the time spent getting micro-batches: waiting on the batch
  // stream, or collating from the trainer's own data set. Near `seconds`,
  // the step waits on its input; near 0, on its model.
  double wait_seconds = 0;
  // Per optimizer step: summed loss, correct and samples on this rank.
  std::vector<double> step_loss_sum;
  std::vector<int64_t> step_correct;
  std::vector<int64_t> step_samples;
  std::vector<std::map<std::string, double>> step_metric_sums;
  actors::SamplerCursor cursor;  // after the steps
  int64_t global_step = 0;
  double lr = 0;
  // With record_indices: the data set indices this rank trained on, in order.
  std::vector<int64_t> consumed;
  TROUPE_FIELDS(steps, samples, loss_sum, correct, metric_sums, summed_metrics, seconds, step_loss_sum, step_correct,
                step_samples, step_metric_sums, cursor, global_step, lr, consumed, wait_seconds);
};

// Where a trainer stands: the optimizer steps it has completed and the
// sampler cursor just after them. After a failed train() this is the last
// completed step (a step cut short by a failure is rolled back).
struct Progress {
  int64_t step = 0;
  int64_t epoch = 0;
  actors::SamplerCursor cursor;
  TROUPE_FIELDS(step, epoch, cursor);
};

struct EvalReport {
  double loss_sum = 0;
  int64_t correct = 0;
  int64_t count = 0;
  // As TrainReport::metric_sums, from the step's eval().
  std::map<std::string, double> metric_sums;
  TROUPE_FIELDS(loss_sum, correct, count, metric_sums);
};

struct BenchReport {
  int64_t steps = 0;
  int64_t samples = 0;
  double seconds = 0;
  double final_loss = 0;
  TROUPE_FIELDS(steps, samples, seconds, final_loss);
};

// Control message to a trainer: fails the batch stream a train() call may
// be waiting on (its loader died before it connected), so the call ends at
// once. Only a stream opened while the group was at `generation` or an
// older one is failed, so an interrupt that arrives late never hits the
// next round's stream. The reply says whether a stream was failed.
struct InterruptBatches {
  static constexpr const char* kControlTag = "trainer.interrupt";
  using Reply = bool;
  int64_t generation = 0;
  std::string reason = "interrupted by the driver";
  TROUPE_FIELDS(generation, reason)
};

class TrainerActor {
 public:
  TrainerActor();
  ~TrainerActor();

  // Builds model, optimizer and data set. Throws ConfigError for a bad
  // config (the driver sees RemoteError("troupe::ConfigError", ...)).
  TrainerInfo setup(TrainerConfig config);
  // Joins the data-parallel group (blocks until every rank joined), then
  // takes rank 0's parameters and buffers.
  void join(JoinSpec spec);
  // A stream a DataLoaderActor writes this rank's batches to.
  StreamRef open_stream(int64_t credits);
  // Runs up to max_steps optimizer steps of the cursor's epoch.
  TrainReport train(TrainRequest request);
  // Loss and accuracy on this rank's shard (rank::world) of the validation
  // data set, else of the validation split (or of the whole data set when
  // there is no split).
  EvalReport evaluate(int64_t rank, int64_t world_size);
  TrainState state();
  void load_state(TrainState state);
  // Steps completed and the cursor after them (cheap; no tensors).
  Progress progress();
  // The steps the last train() completed (their losses and metrics, no
  // consumed indices; of one that failed, those before the failure), once:
  // the driver records them when a failed round heals past them. Empty
  // (steps 0) when there are none.
  TrainReport take_partial();
  // Collective over the joined group: every rank takes rank `src`'s whole
  // training state (parameters, buffers, optimizer, schedule position, loss
  // scale, EMA, RNG, cursor) by broadcast, so a replacement continues
  // exactly where the survivors are, with no disk read. Returns the state's
  // progress.
  Progress heal(int64_t src);
  // Throughput probe: `steps` steps on one in-memory batch of `batch`
  // samples of the data set (no data loading), after `warmup` steps that
  // are not timed.
  BenchReport benchmark(int64_t steps, int64_t batch, int64_t warmup);
  int64_t pid();
  // Allreduces this rank served through shared memory so far.
  int64_t shm_allreduces();

 private:
  // A micro-step's (or an evaluation chunk's) contribution: per-sample loss
  // summed and the metric sums (see TrainReport::metric_sums).
  struct StepSums {
    double loss_sum = 0;
    std::map<std::string, double> metric_sums;
    void add(const StepSums& o);
  };
  // A step output's loss and metrics as the step left them (detached, on
  // the device that computed them), not yet read back to the host.
  struct PendingSums {
    torch::Tensor loss;
    std::map<std::string, torch::Tensor> metrics;
    int64_t samples = 0;
  };
  static PendingSums pending_of(const StepOutput& out, int64_t samples);
  // What each pending output adds up to over its samples, read back in one
  // device-to-host copy: on a GPU, a train() call waits for the device
  // once rather than after every step, so the next batch is read, pinned
  // and copied while the device still runs the last step. That one wait
  // comes after the call's last forward, before its backward: the device
  // runs the last backward and optimizer step while the report goes back
  // to the driver and the next call comes in, where it used to sit idle.
  std::vector<StepSums> resolve(const std::vector<PendingSums>& pending) const;
  // Each step's sums of `rep` from its micro-steps' resolved sums.
  void sum_steps(TrainReport& rep, const std::vector<StepSums>& micro);
  // After a failed train(), the `done` steps it completed, for take_partial.
  // Aborts the group of a round that failed on this rank.
  void abort_round(const std::string& why);
  void keep_partial(TrainReport rep, std::vector<PendingSums>& pending, int64_t done,
                    std::chrono::steady_clock::time_point t0);
  // The step's forward (under autocast when mixed precision is on).
  StepOutput run_step(const actors::TensorDict& tensors);
  // One micro-step forward + backward; `before_backward`, when given, is
  // called between the two with this micro-step's pending sums.
  // `context` is the step's (StepContext) less the step number, which is
  // step_'s.
  PendingSums micro_step(const actors::Batch& batch, bool sync, StepContext context,
                         const std::function<void(const PendingSums&)>* before_backward = nullptr);
  // The next micro-batch of a train() call: read from the batch stream, or
  // collated from this trainer's own data set at indices[pos...]; advances
  // pos past it.
  actors::Batch next_batch(bool from_stream, const std::vector<int64_t>& indices, size_t& pos, int64_t epoch);
  void optimizer_step();
  // Makes the state as it was before a step that failed part way: buffers
  // (BatchNorm statistics) and RNG from the step's start, no gradients.
  struct StepSnapshot {
    std::vector<torch::Tensor> buffers;
    torch::Tensor rng;
    std::map<std::string, torch::Tensor> step_state;
    bool taken = false;
  };
  // The step's context at step_ (micro_step 0).
  StepContext step_context(int64_t epoch, int64_t rank, int64_t world, bool training) const;
  // The step's state() copied (it may change it in place), to `to` or
  // where it is.
  std::map<std::string, torch::Tensor> step_state_copy(std::optional<torch::Device> to) const;
  StepSnapshot snapshot();
  void roll_back(const StepSnapshot& s);

  TrainerConfig config_;
  // Each shipped file's local copy and the driver's path it stands for:
  // messages name the driver's.
  DriverPaths driver_paths_;
  TrainerInfo set_up(TrainerConfig config);
  bool ready_ = false;
  torch::Device device_{torch::kCPU};
  std::unique_ptr<Model> model_;
  std::unique_ptr<TrainStep> step_fn_;
  // EMA of the parameters, in named_parameters() order (empty when off).
  std::vector<torch::Tensor> ema_;
  void update_ema();
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<actors::Dataset> dataset_;
  // TrainerConfig::validation_data, opened (null when none).
  std::unique_ptr<actors::Dataset> val_dataset_;
  std::vector<int64_t> split_;
  std::unique_ptr<collective::Group> group_;  // the joined group, or a ShmGroup that owns it
  ShmGroup* shm_ = nullptr;                   // group_ itself when it is one
  std::unique_ptr<GradientReducer> reducer_;
  // The current batch stream, shared with the InterruptBatches handler
  // (which runs on the worker's I/O thread). Replaced only by the call
  // thread, under mu; the handler reads it under mu.
  struct ReaderSlot {
    std::mutex mu;
    std::shared_ptr<StreamReader<actors::Batch>> reader;
    int64_t generation = 0;  // of the group when the reader was opened
  };
  std::shared_ptr<ReaderSlot> stream_ = std::make_shared<ReaderSlot>();
  void set_reader(std::shared_ptr<StreamReader<actors::Batch>> r);
  int64_t step_ = 0;
  int64_t epoch_ = 0;
  actors::SamplerCursor cursor_;
  TrainReport partial_;  // take_partial()
  double loss_scale_ = 65536.0;
  // The joined group moves device memory (NCCL): heal() broadcasts on the
  // GPU; otherwise through host memory.
  bool group_on_device_ = false;
  // Loss scaling is on: CUDA, mixed precision, fp16.
  bool scales_loss() const;
  int64_t good_steps_ = 0;
  bool skip_step_ = false;
};

}  // namespace troupe::trainer

TROUPE_ACTOR(troupe::trainer::TrainerActor, &troupe::trainer::TrainerActor::setup, &troupe::trainer::TrainerActor::join,
             &troupe::trainer::TrainerActor::open_stream, &troupe::trainer::TrainerActor::train,
             &troupe::trainer::TrainerActor::evaluate, &troupe::trainer::TrainerActor::state,
             &troupe::trainer::TrainerActor::load_state, &troupe::trainer::TrainerActor::progress,
             &troupe::trainer::TrainerActor::heal, &troupe::trainer::TrainerActor::benchmark,
             &troupe::trainer::TrainerActor::pid, &troupe::trainer::TrainerActor::shm_allreduces,
             &troupe::trainer::TrainerActor::take_partial)
