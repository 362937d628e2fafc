// The driver loop of TrainJob::fit() (class Run): it owns the job's parts
// (SlotPool, Gang, JobReporter, ConsumedRecord, the checkpoint writer),
// walks the epochs one step boundary at a time, and hands every failure to
// a FailureRecovery.
#include "troupe/trainer/train_job.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <ostream>
#include <sstream>
#include <utility>

#include <torch/torch.h>

#include "troupe/runtime/collective/actor_group.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/exception_text.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/core/random_id.h"
#include "troupe/trainer/consumed_record.h"
#include "troupe/trainer/failure_recovery.h"
#include "troupe/trainer/gang.h"
#include "troupe/trainer/job_reporter.h"
#include "troupe/trainer/slot_pool.h"

namespace troupe::trainer {

const char* to_string(RecoveryMode mode) {
  switch (mode) {
    case RecoveryMode::kHeal:
      return "heal";
    case RecoveryMode::kCheckpoint:
      return "checkpoint";
    case RecoveryMode::kRestart:
      return "restart";
  }
  return "unknown";
}

std::ostream& operator<<(std::ostream& os, RecoveryMode mode) { return os << to_string(mode); }

std::map<std::string, double> EpochMetrics::summary() const {
  std::map<std::string, double> m = {{"train_loss", train_loss}};
  if (train_metrics.count("accuracy")) m["train_accuracy"] = train_accuracy;
  if (val_count > 0) {
    m["val_loss"] = val_loss;
    if (val_metrics.count("accuracy")) m["val_accuracy"] = val_accuracy;
  }
  return m;
}

void validate(const TrainJobConfig& c) {
  validate(c.trainer);
  const auto& s = c.scaling;
  if (s.num_workers <= 0)
    throw ConfigError("scaling.num_workers must be positive, got " + std::to_string(s.num_workers));
  if (s.min_workers < 0 || s.max_workers < 0) throw ConfigError("scaling.min_workers/max_workers must not be negative");
  const int64_t lo = s.min_workers > 0 ? s.min_workers : s.num_workers;
  const int64_t hi = s.max_workers > 0 ? s.max_workers : s.num_workers;
  if (!(lo <= s.num_workers && s.num_workers <= hi))
    throw ConfigError("scaling needs min_workers <= num_workers <= max_workers, got " + std::to_string(lo) +
                      " <= " + std::to_string(s.num_workers) + " <= " + std::to_string(hi));
  if (s.grow_interval.count() < 0) throw ConfigError("scaling.grow_interval must not be negative");
  if (c.max_steps < 0)
    throw ConfigError("max_steps must be 0 (run the epochs) or positive, got " + std::to_string(c.max_steps));
  if (c.epochs <= 0 && c.max_steps <= 0) throw ConfigError("epochs must be positive, got " + std::to_string(c.epochs));
  if (c.loader_threads < 1 || c.loader_threads > 256)
    throw ConfigError("loader_threads must be between 1 and 256, got " + std::to_string(c.loader_threads));
  if (c.loader_look_ahead < 0 || c.loader_look_ahead > 64)
    throw ConfigError("loader_look_ahead must be between 0 and 64, got " + std::to_string(c.loader_look_ahead));
  if (c.checkpoint.every_steps < 0) throw ConfigError("checkpoint.every_steps must not be negative");
  if (c.failure.standby_workers < 0)
    throw ConfigError("failure.standby_workers must not be negative, got " + std::to_string(c.failure.standby_workers));
  if (c.failure.max_failures < -1)
    throw ConfigError("failure.max_failures must be -1 (no limit) or more, got " +
                      std::to_string(c.failure.max_failures));
  if (c.failure.mode == RecoveryMode::kRestart)
    throw ConfigError("failure.mode must be kHeal or kCheckpoint, got kRestart (only an outcome, in Recovery::mode)");
  if (c.failure.mode == RecoveryMode::kCheckpoint && c.checkpoint.dir.empty() && c.failure.max_failures != 0)
    throw ConfigError("failure.mode = kCheckpoint needs checkpoint.dir");
  if (!c.resume_from.empty() && !std::filesystem::exists(c.resume_from))
    throw ConfigError("resume_from: '" + c.resume_from + "' does not exist");
}

namespace {

using Clock = std::chrono::steady_clock;

// What the user's on_step threw: not a failure of the job's processes, so
// fit() passes it on as it is instead of recovering. Not a std::exception,
// so no recovery handler catches it by mistake.
struct CallbackFailed {
  std::exception_ptr error;
};

// The share of a round's train() calls spent waiting for batches: the
// largest over ranks (StepInfo::data_wait).
double wait_share(const std::vector<TrainReport>& reps) {
  double share = 0;
  for (const auto& r : reps)
    if (r.seconds > 0) share = std::max(share, std::min(1.0, r.wait_seconds / r.seconds));
  return share;
}

// Unique per fit() in this process: names the collective group and the
// placement groups.
// With a random part: a rank killed mid-rendezvous leaves its keys in the
// head's KV (a durable head keeps them), and a later job of the same name
// and pid (the default name; a container's entrypoint is pid 1) read them
// as its own peers' and failed its join.
std::string unique_group_name(const TrainJobConfig& cfg) {
  static std::atomic<int64_t> job_counter{0};
  static const std::string run = [] {
    char hex[9];
    std::snprintf(hex, sizeof hex, "%08x", static_cast<uint32_t>(core::random_id()));
    return std::string(hex);
  }();
  return cfg.name + "-" + std::to_string(::getpid()) + "-" + std::to_string(job_counter++) + "-" + run;
}

// What a step boundary leaves to do.
enum class JobStatus { kRunning, kDone };

// One fit(): the job's parts and where training stands. Destroying it
// gives every actor and placement group back.
class Run {
 public:
  Run(Runtime& rt, const TrainJobConfig& cfg);
  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;

  Result fit();

 private:
  // The running epoch's sums.
  struct EpochSums {
    int64_t epoch = -1;
    Clock::time_point start;
    double loss_sum = 0, busy = 0;
    double wait = 0;  // of busy, waiting for batches (the slowest rank's per call)
    int64_t correct = 0, samples = 0;
    std::map<std::string, double> metric_sums;
    std::vector<std::string> summed_metrics;
  };

  int64_t per_step() const { return cfg_.trainer.batch_size * cfg_.trainer.accumulation; }
  void event(JobEventKind kind, const std::string& detail) { reporter_.event(kind, detail); }

  std::optional<TrainState> load_resume_from();
  // The running epoch's sums as a checkpoint keeps them, and back: a job
  // restored mid-epoch (a --resume, a restart from a checkpoint) then ends
  // that epoch with the summary of all of it, as a run without the stop.
  std::map<std::string, double> epoch_sums() const;
  void restore_epoch_sums(const std::map<std::string, double>& saved);
  std::map<std::string, int64_t> data_order() const;
  void check_one_step() const;
  void check_data_order(const std::string& dir, const CheckpointInfo& info);
  static bool at_epoch_end(const CheckpointInfo& info);
  // Places the slots, sets the trainers up, forms the first group and
  // loads `resume` into it. A trainer that dies meanwhile is a failure
  // (counted against max_failures): nothing has trained yet, so the job
  // starts over with new trainers.
  void start(const std::optional<TrainState>& resume);
  // start()'s placement.
  void place();
  // Whether start() failed with `e` because a trainer died: `e` is a
  // death, or a trainer's worker is gone (its probe says so).
  bool start_lost_a_trainer(const std::exception& e);
  // Every failure goes through recover() and training goes on from where
  // the survivors are, until the epochs are done.
  void train();
  // One step boundary's work.
  JobStatus step_boundary();
  // A stop seen at a step boundary: a checkpoint of the step reached.
  JobStatus stop_at_boundary();
  // Steps for the next round of train() calls.
  int64_t round_steps(int64_t remaining) const;
  void run_round();
  // Adds the round's reports to the epoch's sums, the metrics file and the
  // consumed record; returns the samples trained.
  int64_t account(const std::vector<TrainReport>& reps);
  void end_epoch();
  // `consumed`: the reports' indices go to the consumed record (a healed
  // round's steps are there already, from the sampler).
  // A healed round's steps (`healed_world`: the ranks that trained them)
  // are written with what the survivors report, saying so.
  int64_t record_steps(const std::vector<TrainReport>& reps, bool consumed = true, int64_t healed_world = 0);
  void record_healed_steps(int64_t before, int64_t world_before);
  void evaluate(EpochMetrics& em);
  void checkpoint(const std::map<std::string, double>& metrics);
  void maybe_grow();
  // Base positions of the running epoch that the rest of it trains from
  // `c` at `world` ranks: whole steps only (a last short step is
  // dropped), padding repeats not counted.
  int64_t trained_rest(const actors::SamplerCursor& c, int64_t world) const {
    return trained_rest(c, world, per_step());
  }
  int64_t trained_rest(const actors::SamplerCursor& c, int64_t world, int64_t per_step) const;
  // How many of `n` more ranks the job can take now without the rest of
  // the epoch skipping a sample it trains at its size: the most of them
  // whose re-split rest still fills as many whole steps (all n before the
  // epoch's first step).
  int64_t lossless_growth(int64_t n);
  // How long after the last grow check the next may run: grow_interval, or
  // after failed grows that (at least 5 s) doubled for each, up to 64 times.
  std::chrono::milliseconds grow_wait() const;
  void refill_standby();
  void recover(const std::string& why);
  // With the head gone nothing can be placed, probed or healed: the job
  // ends at once, saying so, rather than blaming the trainer that died of it.
  void give_up_if_head_lost(const std::string& why);
  // `healed_world` > 0 (a heal cut short; the world that trained the
  // round): the survivors' steps past the last boundary are recorded too.
  std::string save_what_survives(int64_t healed_world = 0);
  // A stop asked for while the driver waited (stop_wait.h: a placement, a
  // setup, a group forming) ends the job as interrupted, with the state of
  // trainers that hold it saved as save_what_survives() does.
  // `save`: false while the job starts (nothing trained yet; a resume's
  // checkpoint stands).
  void interrupted_while_waiting(const StopRequested& s, bool save);
  // Sends the gang's generation an abort: trainers in a join or a heal that
  // will not complete leave it and answer calls again.
  void abort_generation(const std::string& reason);
  // The newest checkpoint on disk: this run's, or the one it resumed from.
  std::optional<CheckpointInfo> newest_checkpoint() const;
  Result finish();
  [[noreturn]] void give_up(const std::string& why, bool names_step = false);

  Runtime& rt_;
  const TrainJobConfig& cfg_;
  const int64_t min_, max_;
  const int64_t dataset_size_;
  const actors::DistributedSampler sampler_;
  const std::string group_name_;
  std::unique_ptr<CheckpointWriter> writer_;
  JobReporter reporter_;
  // Declared before the gang: the gang gives its slots back to the pool.
  SlotPool pool_;
  Gang gang_;
  ConsumedRecord consumed_;
  Result result_;
  int64_t last_checkpoint_step_ = -1;
  // No periodic checkpoint is owed for steps up to here: where the job
  // started (or resumed) and where a restore from disk put it.
  int64_t checkpoint_floor_ = 0;
  bool periodic_checkpoint_owed() const;
  std::optional<std::pair<int64_t, double>> nonfinite_loss_;  // the first step whose loss was not finite, and it
  int64_t failures_ = 0;
  Clock::time_point last_grow_check_;
  // Grows that failed in a row: each doubles the wait before the next try.
  int grow_failures_ = 0;
  // The epoch in which a grow was last put off (lossless_growth), said once.
  int64_t grow_put_off_epoch_ = -1;
  bool nonfinite_val_said_ = false;
  // The recovery waiting for its first completed step.
  std::optional<size_t> open_recovery_;
  // The world size before the recovery under way (0: none).
  int64_t recovering_from_world_ = 0;
  EpochSums sums_;
  bool stopped_ = false;     // max_steps reached
  bool trained_ = false;     // a step recorded by this run
  double step_seconds_ = 0;  // a step's time in the last round (0: none yet)
  // The steps (1-based, first and last) of the round of train() calls under
  // way, kept until it has ended well: a failure in it happened in one of
  // them, past gang_.step() (the last step boundary seen).
  std::optional<std::pair<int64_t, int64_t>> round_;
  std::map<std::string, double> resume_epoch_sums_;  // of the resume_from checkpoint
  // The resume_from checkpoint (its path and step): a restore from disk
  // before this job wrote a later one of its own goes back to it.
  std::optional<CheckpointInfo> resumed_;
};

Run::Run(Runtime& rt, const TrainJobConfig& cfg)
    : rt_(rt),
      cfg_(cfg),
      min_(cfg.scaling.min_workers > 0 ? cfg.scaling.min_workers : cfg.scaling.num_workers),
      max_(cfg.scaling.max_workers > 0 ? cfg.scaling.max_workers : cfg.scaling.num_workers),
      dataset_size_(actors::make_dataset(cfg.trainer.data)->size()),
      sampler_(sampler_options(cfg.trainer, dataset_size_, cfg.scaling.num_workers)),
      group_name_(unique_group_name(cfg)),
      reporter_(cfg,
                [this] {
                  return JobPosition{gang_.step(), gang_.world()};
                }),
      pool_(rt, cfg, cfg.use_loaders && cfg.trainer.validation_fraction == 0, group_name_),
      gang_(cfg, pool_, sampler_, group_name_),
      consumed_(cfg.trainer, cfg.record_indices, sampler_, dataset_size_) {}

Result Run::fit() {
  // Checks that need no trainer, and a job that can never be placed, fail
  // before anything is made (a checkpoint directory, a metrics file).
  check_one_step();
  pool_.check_can_place(min_);
  // Then the checkpoint directory's lock: a job refused because another
  // holds it leaves no trace in that job's metrics file or on the head's
  // dashboard.
  if (!cfg_.checkpoint.dir.empty())
    writer_ = std::make_unique<CheckpointWriter>(cfg_.checkpoint.dir, cfg_.checkpoint.keep, data_order());
  // Then the metrics file, so that it has every event (resume_from too).
  reporter_.open_metrics();
  std::optional<TrainState> resume = load_resume_from();
  // The head's dashboard and /metrics.
  reporter_.publish_to(&rt_.kv(), rt_.core()->client_id(),
                       [core = rt_.core()](const std::string& key, const std::string& value) {
                         return core->head().request(wire::Op::kKvPut, wire::encode_inline(wire::KvEntry{key, value}));
                       });

  try {
    start(resume);
  } catch (const StopRequested& s) {
    // Nothing trained: a resume stands where its checkpoint does.
    if (resume) gang_.set_position(resume->step, resume->cursor);
    interrupted_while_waiting(s, /*save=*/false);
    return finish();
  }
  last_grow_check_ = Clock::now();
  checkpoint_floor_ = gang_.step();
  train();
  return finish();
}

std::optional<TrainState> Run::load_resume_from() {
  if (cfg_.resume_from.empty()) return std::nullopt;
  std::string dir = cfg_.resume_from;
  if (!std::filesystem::exists(std::filesystem::path(dir) / "manifest.json")) {
    auto latest = latest_checkpoint(dir);
    if (!latest) throw ConfigError("resume_from: no valid checkpoint under '" + dir + "'");
    dir = latest->path;
  }
  CheckpointInfo info;
  TrainState resume = load_checkpoint(dir, &info);
  check_data_order(dir, info);
  // Taken at its epoch's end (in its own order): the next epoch begins,
  // in this run's order, whatever its data set's size now is.
  if (at_epoch_end(info)) resume.cursor = actors::SamplerCursor{info.cursor.epoch + 1, info.cursor.world_size, 0, 0};
  resume_epoch_sums_ = info.epoch_sums;
  resumed_ = info;
  resumed_->path = dir;
  // A checkpoint of this job's own directory stands for its step: a stop
  // there (max_steps already reached) writes it no second time.
  std::error_code ec;
  auto step_dir = std::filesystem::absolute(dir, ec).lexically_normal();
  if (step_dir.filename().empty()) step_dir = step_dir.parent_path();  // "ckpt/step-7/"
  if (!cfg_.checkpoint.dir.empty() && std::filesystem::equivalent(step_dir.parent_path(), cfg_.checkpoint.dir, ec))
    last_checkpoint_step_ = resume.step;
  event(JobEventKind::kResumeFrom, dir + " (step " + std::to_string(resume.step) + ", epoch " +
                                       std::to_string(resume.epoch) + ", " + std::to_string(resume.world_size) +
                                       " workers)");
  return resume;
}

// Data too small for one step on every worker would "train" 0 steps and
// report success. With a validation split, its training part (the check
// was left to the trainers, which made none: 0-step epochs, success).
void Run::check_one_step() const {
  const int64_t training = train_size(cfg_.trainer, dataset_size_);
  const int64_t workers = std::max(cfg_.scaling.num_workers, cfg_.scaling.max_workers);
  const int64_t per_worker = (training + workers - 1) / std::max<int64_t>(1, workers);
  const int64_t per_step = cfg_.trainer.batch_size * std::max<int64_t>(1, cfg_.trainer.accumulation);
  if (per_worker >= per_step) return;
  const std::string split =
      training == dataset_size_ ? "" : " (" + std::to_string(training) + " in its training split)";
  throw ConfigError("data " + cfg_.trainer.data.name + " has " + std::to_string(dataset_size_) + " samples" + split +
                    ", fewer than one step on each of " + std::to_string(workers) + " workers (" +
                    std::to_string(per_step) + " samples a step): no step would train");
}

// The samples a step takes from each rank (batch size x accumulation): in
// a checkpoint's data order, though not part of the order itself.
constexpr const char* kStepSamplesKey = "step_samples";

std::map<std::string, int64_t> Run::data_order() const {
  const auto& o = sampler_.options();
  std::map<std::string, int64_t> order = {{"seed", static_cast<int64_t>(o.seed)},
                                          {"dataset_size", o.dataset_size},
                                          {"shuffle", o.shuffle ? 1 : 0},
                                          {"drop_last", o.drop_last ? 1 : 0},
                                          {kStepSamplesKey, per_step()}};
  // With a validation split, which samples make the training split: a
  // sampler position names another sample under another split seed (a
  // mid-epoch resume repeated some, skipped others, trained held-out ones).
  if (cfg_.trainer.validation_fraction > 0) order["split_seed"] = cfg_.trainer.split_seed;
  return order;
}

// A checkpoint's cursor is a position in its run's data order: resumed
// mid-epoch with another order (another seed, other data), it would train
// some samples twice and skip others, silently. At an epoch's boundary
// the next epoch simply begins in the new order.
// Whether a checkpoint's cursor is at its epoch's end in the data order
// of the run that wrote it (false when the checkpoint does not say its
// order). A cursor there has consumed the epoch: it was taken for
// "mid-epoch", and a checkpoint written at an epoch's end was refused
// with another seed or grown data, as one a run stopped mid-epoch.
bool Run::at_epoch_end(const CheckpointInfo& info) {
  const auto& o = info.data_order;
  for (const char* key : {"seed", "dataset_size", "shuffle", "drop_last"})
    if (!o.contains(key)) return false;
  actors::SamplerOptions so;
  so.dataset_size = o.at("dataset_size");
  so.world_size = info.cursor.world_size;
  so.shuffle = o.at("shuffle") != 0;
  so.seed = o.at("seed");
  so.drop_last = o.at("drop_last") != 0;
  try {
    return actors::DistributedSampler(so).epoch_done(info.cursor);
  } catch (const std::exception&) {
    return false;  // a cursor that order cannot have: judged as mid-epoch
  }
}

void Run::check_data_order(const std::string& dir, const CheckpointInfo& info) {
  auto mine = data_order();
  const auto& c = info.cursor;
  const bool mid_epoch = (c.segment_start > 0 || c.segment_consumed > 0) && !at_epoch_end(info);
  if (info.data_order.empty() || !mid_epoch) return;
  auto theirs = info.data_order;
  if (theirs.contains(kStepSamplesKey)) {
    // Other steps deal the rest of the epoch out in other whole steps: what
    // a last short step would leave is said, not refused (a smaller batch
    // is how a run that ran out of memory goes on).
    const int64_t before = trained_rest(c, c.world_size, theirs[kStepSamplesKey]);
    const int64_t now = trained_rest(c, cfg_.scaling.num_workers);
    if (now < before)
      event(JobEventKind::kSamplesSkipped,
            "checkpoint " + dir + " stopped mid-epoch " + std::to_string(c.epoch + 1) + " with steps of " +
                std::to_string(theirs[kStepSamplesKey]) + " samples a worker; in this run's steps of " +
                std::to_string(per_step()) + " on " + std::to_string(cfg_.scaling.num_workers) + " worker(s), " +
                std::to_string(before - now) +
                " samples of the rest of that epoch go untrained (the next epochs train whole)");
    theirs.erase(kStepSamplesKey);
  }
  mine.erase(kStepSamplesKey);
  // A checkpoint written before the split seed was part of the order says
  // nothing of it: taken as this run's.
  if (!theirs.contains("split_seed")) mine.erase("split_seed");
  if (theirs == mine) return;
  auto text = [](const std::map<std::string, int64_t>& m) {
    std::string s;
    for (const auto& [k, v] : m) s += (s.empty() ? "" : ", ") + k + "=" + std::to_string(v);
    return s;
  };
  throw ConfigError("resume_from: checkpoint " + dir + " stopped mid-epoch " + std::to_string(c.epoch + 1) +
                    " in the data order of " + text(theirs) + "; this run's is " + text(mine) +
                    ": resuming there would repeat some samples and skip others. Resume with the same seed and "
                    "data, or from a checkpoint at an epoch's end");
}

void Run::start(const std::optional<TrainState>& resume) {
  for (;;) {
    place();
    try {
      gang_.setup_new(cfg_.setup_bound());
      gang_.form(-1, cfg_.setup_bound());
      if (resume) gang_.load_everywhere(*resume, cfg_.setup_bound());
      break;
    } catch (const ConfigError&) {
      throw;  // the trainers refuse the job: new ones would too
    } catch (const JobFailed&) {
      throw;
    } catch (const StopRequested&) {
      throw;
    } catch (const std::exception& e) {
      // Only a trainer's death: any other error (a step factory that
      // throws, a resume state a trainer refuses) new trainers would meet
      // again, so it ends the job as it is.
      if (!start_lost_a_trainer(e)) throw;
      Recovery rec;
      rec.failed_at = reporter_.now();
      rec.cause = std::string("while the job started: ") + e.what();
      rec.world_before = gang_.world();
      rec.mode = RecoveryMode::kRestart;
      ++failures_;
      event(JobEventKind::kFailure, rec.cause);
      give_up_if_head_lost(rec.cause);
      if (cfg_.failure.max_failures >= 0 && failures_ > cfg_.failure.max_failures)
        give_up("failure " + std::to_string(failures_) + " and failure.max_failures is " +
                std::to_string(cfg_.failure.max_failures) + ": " + rec.cause);
      gang_.release_all();
      event(JobEventKind::kRestored, "no trainer had trained yet: the job starts over with new trainers");
      rec.resumed_at = reporter_.now();
      result_.recoveries.push_back(rec);
    }
  }
  if (resume) restore_epoch_sums(resume_epoch_sums_);
  const TrainerInfo& info = gang_.info();
  event(JobEventKind::kStarted, std::to_string(gang_.world()) + " trainers, " + info.model + ", " +
                                    std::to_string(info.parameters) + " parameters on " + info.device);
  reporter_.started(info, dataset_size_);
  if (!resume) gang_.begin_epoch(0);
}

bool Run::start_lost_a_trainer(const std::exception& e) {
  if (dynamic_cast<const ActorDied*>(&e) != nullptr) return true;
  auto ps = gang_.call_all(&TrainerActor::progress);
  const auto until = Clock::now() + std::min(cfg_.call_timeout, std::chrono::milliseconds(10000));
  for (auto& p : ps) {
    try {
      p.get(std::max(std::chrono::milliseconds(0),
                     std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now())));
    } catch (const ActorDied&) {
      return true;
    } catch (const std::exception&) {
      // Busy or slow: not known to be dead.
    }
  }
  return false;
}

void Run::place() {
  const auto& sc = cfg_.scaling;
  gang_.add(pool_.place(sc.num_workers, sc.placement_timeout));
  if (gang_.world() < min_) {
    const int64_t got = gang_.world();
    gang_.release_all();
    throw ConfigError("placement group for " + std::to_string(min_) + " workers × " +
                      format_resources(sc.resources_per_worker) + " is still PENDING after " +
                      std::to_string(sc.placement_timeout.count()) + " ms (" + std::to_string(got) +
                      " placed): " + pool_.pending_reason());
  }
  event(JobEventKind::kPlaced, std::to_string(gang_.world()) + " bundles " + format_resources(sc.resources_per_worker));
  // Standbys start now, so their setup runs beside the trainers'.
  refill_standby();
}

void Run::train() {
  std::optional<std::string> failure;
  for (;;) {
    try {
      if (failure) {
        std::string why = std::move(*failure);
        failure.reset();
        recover(why);
      }
      if (step_boundary() == JobStatus::kRunning) continue;
      if (writer_) {
        writer_->wait();
        result_.last_checkpoint = writer_->last();
      }
      result_.final_state = gang_.state(cfg_.call_timeout);
      return;
    } catch (const CallbackFailed& c) {
      std::rethrow_exception(c.error);
    } catch (const GiveUp& g) {
      give_up(g.why + save_what_survives(), g.names_step);
    } catch (const JobFailed&) {
      throw;
    } catch (const ConfigError& e) {
      // A trainer refusing its config will refuse it again: not a failure
      // a replacement can fix (its ConfigError arrives as itself). The
      // trainers that hold the job's state are saved first: a replacement
      // refusing its setup (a file missing on its node) ended the job and
      // lost every step since the last checkpoint.
      give_up(e.what() + save_what_survives());
    } catch (const CheckpointWriteError& e) {
      // Nor is a checkpoint the disk refuses: training on would lose all
      // it does past the newest checkpoint on disk (this run's, or the
      // one it resumed from).
      const auto newest = newest_checkpoint();
      give_up(std::string(e.what()) + "; the newest checkpoint written is " +
              (newest ? newest->path + " (step " + std::to_string(newest->step) + ")" : std::string("none")));
    } catch (const StopRequested& s) {
      interrupted_while_waiting(s, /*save=*/true);
      return;
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
}

Result Run::finish() {
  result_.steps = gang_.step();
  result_.final_world_size = gang_.world();
  result_.consumed = consumed_.by_epoch();
  if (!result_.interrupted) event(JobEventKind::kFinished, "step " + std::to_string(gang_.step()));
  result_.events = reporter_.events();
  return std::move(result_);
}

void Run::give_up(const std::string& why, bool names_step) {
  event(JobEventKind::kFailed, why);
  result_.steps = gang_.step();
  result_.final_world_size = gang_.world();
  result_.events = reporter_.events();
  // Where it failed: in the round of steps under way (the trainer's error
  // names the very step where it knows it), else at the last step boundary.
  std::ostringstream at;
  // Unless `why` names the step ("the loss is inf at step 2"), which a
  // range of steps would only blur.
  if (names_step) {
  } else if (round_ && round_->first < round_->second)
    at << " between steps " << round_->first << " and " << round_->second;
  else
    at << " at step " << (round_ ? round_->first : gang_.step());
  std::ostringstream s;
  s << "[" << cfg_.name << "] training failed" << at.str() << ": " << why << "\nwhat happened:" << reporter_.history();
  throw JobFailed(s.str(), result_);
}

JobStatus Run::step_boundary() {
  // An async checkpoint that failed since the last round ends the job now,
  // not after more training that could not be saved.
  if (writer_) writer_->check();
  // Also at the start: a resume from a checkpoint at or past max_steps.
  if (cfg_.max_steps > 0 && gang_.step() >= cfg_.max_steps) stopped_ = true;
  if (stopped_ || gang_.cursor().epoch >= cfg_.epochs) {
    // max_steps reached mid-epoch: the step reached is kept, as a stop
    // asked for keeps it (an epoch's end writes its own), so a resume with
    // a higher max_steps goes on from this very step.
    if (stopped_ && !sampler_.epoch_done(gang_.cursor()))
      checkpoint({{"train_loss", sums_.samples ? sums_.loss_sum / sums_.samples : 0.0}});
    // A resume with max_steps reached already trains nothing: the epoch's
    // line was written by the run that reached it.
    if (sums_.epoch >= 0 && (trained_ || !stopped_)) end_epoch();
    return JobStatus::kDone;
  }
  if (cfg_.stop_requested && cfg_.stop_requested()) return stop_at_boundary();
  try {
    maybe_grow();
    refill_standby();
  } catch (const StopRequested&) {
    // Asked for while a grow or a standby's placement waited: the gang is
    // this boundary's still (a grow drops its newcomers), so the stop is
    // taken here, as if it had come a moment earlier.
    return stop_at_boundary();
  }
  if (sums_.epoch != gang_.cursor().epoch) {
    sums_ = EpochSums{};
    sums_.epoch = gang_.cursor().epoch;
    sums_.start = Clock::now();
  }
  if (sampler_.epoch_done(gang_.cursor())) {
    end_epoch();
    gang_.begin_epoch(gang_.cursor().epoch + 1);
    return JobStatus::kRunning;
  }
  run_round();
  return JobStatus::kRunning;
}

JobStatus Run::stop_at_boundary() {
  // Mid-epoch: no epoch summary nor evaluation; the checkpoint holds the
  // cursor, so a resume goes on from this very step.
  result_.interrupted = true;
  event(JobEventKind::kInterrupted, "at step " + std::to_string(gang_.step()) + ", epoch " +
                                        std::to_string(gang_.cursor().epoch + 1) + " of " +
                                        std::to_string(cfg_.epochs));
  checkpoint({{"train_loss", sums_.samples ? sums_.loss_sum / sums_.samples : 0.0}});
  return JobStatus::kDone;
}

int64_t Run::round_steps(int64_t remaining) const {
  const int64_t step = gang_.step();
  int64_t chunk = std::max<int64_t>(1, remaining);
  if (cfg_.checkpoint.every_steps > 0 && writer_)
    chunk = std::min(chunk, cfg_.checkpoint.every_steps - step % cfg_.checkpoint.every_steps);
  if (cfg_.progress_every_steps > 0) chunk = std::min(chunk, cfg_.progress_every_steps);
  if (cfg_.max_steps > 0) chunk = std::min(chunk, cfg_.max_steps - step);
  if (cfg_.stop_requested) {
    // One step first, while a step's time is unknown.
    const double budget = std::chrono::duration<double>(cfg_.stop_within).count();
    const double fit = step_seconds_ > 0 ? budget / step_seconds_ : 1.0;
    chunk = std::min(chunk, std::max<int64_t>(1, static_cast<int64_t>(std::min(fit, 1e12))));
  }
  return chunk;
}

// A multiple of checkpoint.every_steps was passed without its checkpoint:
// a failure cut it short (rank 0 died in it, and a heal came back to that
// step) or a heal moved the survivors past it.
bool Run::periodic_checkpoint_owed() const {
  const int64_t every = cfg_.checkpoint.every_steps;
  const int64_t step = gang_.step();
  if (every <= 0 || !writer_ || step <= 0) return false;
  return step - step % every > std::max(last_checkpoint_step_, checkpoint_floor_);
}

void Run::run_round() {
  // Owed from before the last recovery: taken before training on, so that
  // a restore loses at most every_steps steps (up to twice that, less one).
  if (periodic_checkpoint_owed()) checkpoint({{"train_loss", sums_.samples ? sums_.loss_sum / sums_.samples : 0.0}});
  const int64_t remaining = sampler_.remaining_per_rank(gang_.cursor()) / per_step();
  const int64_t chunk = round_steps(remaining);
  const int64_t steps_now = std::min(chunk, remaining);
  const bool stream = pool_.use_loaders() && steps_now > 0;
  if (steps_now > 0) round_ = std::make_pair(gang_.step() + 1, gang_.step() + steps_now);
  auto reps =
      gang_.train_round(TrainRequest{gang_.cursor(), chunk, stream, cfg_.record_indices}, steps_now, cfg_.call_timeout);
  double seconds = 0, wait = 0;
  for (const auto& r : reps) {
    seconds = std::max(seconds, r.seconds);
    wait = std::max(wait, r.wait_seconds);
  }
  sums_.busy += seconds;
  sums_.wait += std::min(wait, seconds);
  if (steps_now > 0 && seconds > 0) step_seconds_ = seconds / static_cast<double>(steps_now);
  const int64_t samples = account(reps);
  if (nonfinite_loss_ && cfg_.stop_on_nonfinite_loss) {
    // No checkpoint is written past a round with a non-finite loss (nor the
    // survivors' state, see save_what_survives).
    const auto newest = newest_checkpoint();
    std::ostringstream why;
    why << "the loss is " << nonfinite_loss_->second << " at step " << nonfinite_loss_->first
        << " (the step module's loss diverged, or its input holds NaN; try a lower trainer.optimizer.lr or a "
           "trainer.grad_clip); ";
    if (newest)
      why << "the newest checkpoint is " << newest->path << " (step " << newest->step << "), and the weights past it "
          << "are not saved";
    else
      why << "no checkpoint was written before it";
    throw GiveUp{why.str(), true};
  }
  round_.reset();
  if (open_recovery_ && reps[0].steps > 0) {
    result_.recoveries[*open_recovery_].step_done_at = reporter_.now();
    open_recovery_.reset();
  }
  if (sums_.samples > 0)
    reporter_.progress(gang_.cursor().epoch, sums_.loss_sum / sums_.samples,
                       finish_metrics(sums_.metric_sums, sums_.summed_metrics, sums_.samples),
                       sums_.samples / std::max(sums_.busy, 1e-9));
  const int64_t step = gang_.step();
  if (cfg_.on_step) {
    try {
      cfg_.on_step(
          StepInfo{step, gang_.cursor().epoch, gang_.world(), reporter_.now(), samples, seconds, wait_share(reps)});
    } catch (...) {
      throw CallbackFailed{std::current_exception()};
    }
  }
  if (cfg_.checkpoint.every_steps > 0 && step % cfg_.checkpoint.every_steps == 0)
    checkpoint({{"train_loss", sums_.samples ? sums_.loss_sum / sums_.samples : 0.0}});
  if (cfg_.max_steps > 0 && step >= cfg_.max_steps) stopped_ = true;
}

// Keeps the last `n` steps of `r` (per-step figures and their totals).
void trim_to_last(TrainReport& r, size_t n) {
  auto keep_last = [n](auto& v) {
    if (v.size() > n) v.erase(v.begin(), v.end() - static_cast<std::ptrdiff_t>(n));
  };
  keep_last(r.step_loss_sum);
  keep_last(r.step_correct);
  keep_last(r.step_samples);
  keep_last(r.step_metric_sums);
  r.steps = static_cast<int64_t>(n);
  r.samples = r.correct = 0;
  r.loss_sum = 0;
  r.metric_sums.clear();
  for (size_t i = 0; i < r.step_samples.size(); ++i) {
    r.samples += r.step_samples[i];
    r.loss_sum += r.step_loss_sum[i];
    r.correct += r.step_correct[i];
    if (i < r.step_metric_sums.size())
      for (const auto& [k, v] : r.step_metric_sums[i]) r.metric_sums[k] += v;
  }
}

int64_t Run::account(const std::vector<TrainReport>& reps) {
  gang_.set_position(reps[0].global_step, reps[0].cursor);
  return record_steps(reps);
}

// The steps the survivors of a failed round completed before it failed,
// which a heal keeps (the job goes on from the furthest): recorded from
// the survivors that reached the healed step, so that every step has its
// line and counts in its epoch's sums. A dead rank's sums of those steps
// are gone with it: their lines hold the survivors' losses and metrics and
// say so (ranks_reported), with the samples all `world_before` trained.
void Run::record_healed_steps(int64_t before, int64_t world_before) {
  const int64_t n = gang_.step() - before;
  if (n <= 0) return;
  // From the trainers that hold the job's state (all of them after a heal;
  // the survivors of one a stop cut short).
  std::vector<Future<TrainReport>> fs;
  for (auto& s : gang_.slots())
    if (s.has_state && s.trainer.valid()) fs.push_back(s.trainer.call(&TrainerActor::take_partial));
  std::vector<TrainReport> reps;
  for (auto& f : fs) {
    try {
      TrainReport r = f.get(cfg_.call_timeout);
      if (r.global_step != gang_.step() || static_cast<int64_t>(r.step_loss_sum.size()) < n) continue;
      trim_to_last(r, static_cast<size_t>(n));
      reps.push_back(std::move(r));
    } catch (const std::exception&) {
      // Not recorded from this one; a failure of its own shows next round.
    }
  }
  if (!reps.empty()) record_steps(reps, false, world_before);
}

int64_t Run::record_steps(const std::vector<TrainReport>& reps, bool consumed, int64_t healed_world) {
  const auto& first = reps[0];
  trained_ = true;
  int64_t round_samples = 0;
  double round_seconds = 0;
  for (const auto& r : reps) {
    round_samples += r.samples;
    round_seconds = std::max(round_seconds, r.seconds);
  }
  const double rate = round_seconds > 0 ? static_cast<double>(round_samples) / round_seconds : 0.0;
  const double data_wait = wait_share(reps);
  for (size_t s = 0; s < first.step_loss_sum.size(); ++s) {
    double l = 0;
    int64_t n = 0;
    std::map<std::string, double> m;
    for (const auto& r : reps) {
      l += r.step_loss_sum[s];
      n += r.step_samples[s];
      if (s < r.step_metric_sums.size())
        for (const auto& [k, v] : r.step_metric_sums[s]) m[k] += v;
    }
    const int64_t st =
        first.global_step - static_cast<int64_t>(first.step_loss_sum.size()) + static_cast<int64_t>(s) + 1;
    const JobReporter::StepShare share{healed_world, static_cast<int64_t>(reps.size()), healed_world * per_step()};
    const bool partial = healed_world > static_cast<int64_t>(reps.size());
    reporter_.step(first.cursor.epoch, st, l, n, finish_metrics(m, first.summed_metrics, n), rate, data_wait,
                   partial ? &share : nullptr);
    if (!std::isfinite(l) && !nonfinite_loss_) nonfinite_loss_ = std::make_pair(st, l);
  }
  int64_t samples = 0;
  sums_.summed_metrics = first.summed_metrics;
  for (const auto& rep : reps) {
    sums_.loss_sum += rep.loss_sum;
    sums_.correct += rep.correct;
    for (const auto& [k, v] : rep.metric_sums) sums_.metric_sums[k] += v;
    sums_.samples += rep.samples;
    samples += rep.samples;
    if (consumed) consumed_.add(rep);
  }
  return samples;
}

void Run::evaluate(EpochMetrics& em) {
  std::vector<Future<EvalReport>> fs;
  for (int64_t r = 0; r < gang_.world(); ++r)
    fs.push_back(gang_.slots()[r].trainer.call(&TrainerActor::evaluate, r, gang_.world()));
  std::map<std::string, double> sums;
  for (const auto& e : get_all(fs, cfg_.call_timeout)) {
    em.val_loss += e.loss_sum;
    em.val_accuracy += static_cast<double>(e.correct);
    em.val_count += e.count;
    for (const auto& [k, v] : e.metric_sums) sums[k] += v;
  }
  if (em.val_count) {
    em.val_loss /= em.val_count;
    em.val_accuracy /= em.val_count;
  }
  em.val_metrics = finish_metrics(sums, sums_.summed_metrics, em.val_count);
  // Training goes on (the training loss is what stop_on_nonfinite_loss
  // watches), but a run that ends with rc 0 and val_loss nan should not
  // pass unremarked: said once, with the epoch.
  if (em.val_count && !std::isfinite(em.val_loss) && !nonfinite_val_said_) {
    nonfinite_val_said_ = true;
    TROUPE_LOG_WARN(
        "[{}] the validation loss of epoch {} is {} (the model's eval mode gives a non-finite loss); "
        "training goes on",
        cfg_.name, em.epoch + 1, em.val_loss);
  }
}

void Run::end_epoch() {
  // Recorded already, and then its checkpoint failed (rank 0 died in it)
  // and a heal came back to this boundary: the checkpoint is taken now,
  // the epoch recorded once (it had a second history entry, metrics line
  // and event).
  if (!result_.history.empty() && result_.history.back().epoch == sums_.epoch &&
      result_.history.back().steps == gang_.step()) {
    if (cfg_.checkpoint.at_epoch_end && sampler_.epoch_done(gang_.cursor()))
      checkpoint(result_.history.back().summary());
    sums_ = EpochSums{};
    return;
  }
  EpochMetrics em;
  em.epoch = sums_.epoch;
  em.steps = gang_.step();
  em.train_loss = sums_.samples ? sums_.loss_sum / sums_.samples : 0;
  em.train_accuracy = sums_.samples ? double(sums_.correct) / sums_.samples : 0;
  em.train_metrics = finish_metrics(sums_.metric_sums, sums_.summed_metrics, sums_.samples);
  em.samples_per_second = sums_.busy > 0 ? sums_.samples / sums_.busy : 0;
  em.data_wait = sums_.busy > 0 ? sums_.wait / sums_.busy : 0;
  if (cfg_.evaluate) evaluate(em);
  em.seconds = std::chrono::duration<double>(Clock::now() - sums_.start).count();
  result_.history.push_back(em);
  reporter_.epoch(em);
  // Counted from 1, as the progress lines and the interrupted event count;
  // the metrics file's `epoch` numbers are 0-based.
  std::string what = "epoch " + std::to_string(em.epoch + 1);
  if (cfg_.epochs > 0) what += " of " + std::to_string(cfg_.epochs);
  event(JobEventKind::kEpoch, what + " done at step " + std::to_string(gang_.step()));
  if (cfg_.checkpoint.at_epoch_end && sampler_.epoch_done(gang_.cursor())) checkpoint(em.summary());
  sums_ = EpochSums{};
}

std::map<std::string, double> Run::epoch_sums() const {
  if (sums_.epoch < 0 || sums_.samples == 0) return {};
  std::map<std::string, double> m{{"epoch", static_cast<double>(sums_.epoch)},
                                  {"loss_sum", sums_.loss_sum},
                                  {"samples", static_cast<double>(sums_.samples)},
                                  {"correct", static_cast<double>(sums_.correct)},
                                  {"busy_s", sums_.busy},
                                  {"wait_s", sums_.wait},
                                  {"seconds", std::chrono::duration<double>(Clock::now() - sums_.start).count()}};
  for (const auto& [k, v] : sums_.metric_sums) m["metric/" + k] = v;
  for (const auto& k : sums_.summed_metrics) m["summed/" + k] = 1;
  return m;
}

// Only sums of the epoch the job now stands in count (a checkpoint made at
// an epoch's end resumes at the next one's start).
void Run::restore_epoch_sums(const std::map<std::string, double>& saved) {
  sums_ = EpochSums{};
  auto it = saved.find("epoch");
  if (it == saved.end() || static_cast<int64_t>(it->second) != gang_.cursor().epoch) return;
  auto get = [&](const char* key) {
    auto f = saved.find(key);
    return f == saved.end() ? 0.0 : f->second;
  };
  sums_.epoch = gang_.cursor().epoch;
  sums_.start =
      Clock::now() - std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(get("seconds")));
  sums_.loss_sum = get("loss_sum");
  sums_.samples = static_cast<int64_t>(get("samples"));
  sums_.correct = static_cast<int64_t>(get("correct"));
  sums_.busy = get("busy_s");
  sums_.wait = get("wait_s");
  for (const auto& [k, v] : saved) {
    if (k.rfind("metric/", 0) == 0) sums_.metric_sums[k.substr(7)] = v;
    if (k.rfind("summed/", 0) == 0) sums_.summed_metrics.push_back(k.substr(7));
  }
}

void Run::checkpoint(const std::map<std::string, double>& m) {
  if (!writer_ || last_checkpoint_step_ == gang_.step()) return;
  writer_->check();  // an earlier write that failed ends the job now, not at its end
  TrainState state = gang_.state(cfg_.call_timeout);
  state.epoch = state.cursor.epoch;
  writer_->submit(std::move(state), m, epoch_sums());
  if (!cfg_.checkpoint.async) writer_->wait();
  last_checkpoint_step_ = gang_.step();
  event(JobEventKind::kCheckpoint, "step " + std::to_string(gang_.step()));
}

std::chrono::milliseconds Run::grow_wait() const {
  if (grow_failures_ == 0) return cfg_.scaling.grow_interval;
  return std::max<std::chrono::milliseconds>(cfg_.scaling.grow_interval, std::chrono::seconds(5)) *
         (1 << std::min(grow_failures_ - 1, 6));
}

int64_t Run::trained_rest(const actors::SamplerCursor& c, int64_t world, int64_t per_step) const {
  const auto at = sampler_.resize(c, world);
  const int64_t per_rank = sampler_.remaining_per_rank(at) / per_step * per_step;
  return std::min(per_rank * world, dataset_size_ - sampler_.consumed(at));
}

int64_t Run::lossless_growth(int64_t n) {
  const auto& c = gang_.cursor();
  const int64_t world = gang_.world();
  // An epoch not begun yet is dealt out whole at the new size.
  if (c.segment_start == 0 && c.segment_consumed == 0) return n;
  const int64_t keep = trained_rest(c, world);
  int64_t ok = n;
  while (ok > 0 && trained_rest(c, world + ok) < keep) --ok;
  if (ok < n && grow_put_off_epoch_ != c.epoch) {
    grow_put_off_epoch_ = c.epoch;
    event(JobEventKind::kGrowPutOff, "growing to " + std::to_string(world + n) + " workers now would leave " +
                                         std::to_string(keep - trained_rest(c, world + n)) + " samples of epoch " +
                                         std::to_string(c.epoch + 1) +
                                         " untrained (its rest would not fill whole steps of " +
                                         std::to_string(world + n) + " x " + std::to_string(per_step()) +
                                         "); the job grows at a step boundary where none would be, at the latest "
                                         "at the epoch's end");
  }
  return ok;
}

void Run::maybe_grow() {
  if (gang_.world() >= max_) return;
  auto t = Clock::now();
  // A grow put off to spare an epoch's samples is owed at the next epoch's
  // start, whatever the wait (an epoch shorter than grow_interval went by
  // without it, twice in a row).
  const auto& c = gang_.cursor();
  const bool owed = grow_put_off_epoch_ >= 0 && grow_put_off_epoch_ < c.epoch && c.segment_start == 0 &&
                    c.segment_consumed == 0 && grow_failures_ == 0;
  // After failed grows the wait doubles: a node that cannot take part
  // would otherwise cost a setup or rendezvous timeout at every boundary.
  if (!owed && t - last_grow_check_ < grow_wait()) return;
  if (owed) grow_put_off_epoch_ = -1;
  last_grow_check_ = t;
  // Mid-epoch, the rest of the epoch is dealt out again among the new
  // ranks, and only whole steps of it train: a grow whose rest would skip
  // samples the job trains at its size waits for a boundary where it skips
  // none (at the latest, the epoch's end, where the next epoch begins
  // whole).
  const int64_t want = lossless_growth(pool_.room_to_grow(max_ - gang_.world()));
  if (want <= 0) return;
  auto added = pool_.place(want, cfg_.failure.replacement_timeout);
  if (const auto n = static_cast<size_t>(lossless_growth(static_cast<int64_t>(added.size()))); n < added.size()) {
    // Fewer placed than asked for, and that many would skip samples.
    for (size_t i = n; i < added.size(); ++i) pool_.release(added[i]);
    added.erase(added.begin() + static_cast<std::ptrdiff_t>(n), added.end());
  }
  if (added.empty()) return;
  const int64_t before = gang_.world();
  const size_t n = added.size();
  gang_.add(std::move(added));
  event(JobEventKind::kGrew, std::to_string(n) + " new trainer(s) placed to grow");
  std::optional<std::string> failed;
  try {
    gang_.setup_new(cfg_.setup_bound());
    gang_.form(0, cfg_.setup_bound());
  } catch (const StopRequested& s) {
    // The old trainers hold the state at this step boundary still (a grow
    // sends them none): out of a join that will not complete, they answer.
    gang_.drop_from(before);
    abort_generation(s.what());
    throw;
  } catch (const GiveUp& g) {
    failed = g.why;
  } catch (...) {
    failed = core::exception_text(std::current_exception());
  }
  if (failed) {
    // The job trained well at its old size: newcomers that cannot set up
    // or join the group (a node missing a file or a library, or one its
    // peers cannot reach) are dropped, not the job. The old trainers
    // re-form without them; that failing is a failure like any other.
    gang_.drop_from(before);
    last_grow_check_ = Clock::now();
    ++grow_failures_;
    event(JobEventKind::kGrowFailed, "dropped the " + std::to_string(n) + " new trainer(s), going on with " +
                                         std::to_string(before) + " (next try in " +
                                         std::to_string(grow_wait().count() / 1000) + " s): " + *failed);
    gang_.form(0, cfg_.setup_bound());
    return;
  }
  grow_failures_ = 0;
  const int64_t step = gang_.step();
  event(JobEventKind::kGrowHealed, "new trainers took rank 0's state at step " + std::to_string(step));
  event(JobEventKind::kResized,
        std::to_string(before) + " -> " + std::to_string(gang_.world()) + " workers at step " + std::to_string(step) +
            " (" + std::to_string(sampler_.remaining_per_rank(gang_.cursor())) + " samples per rank left in epoch " +
            std::to_string(gang_.cursor().epoch + 1) + ")");
}

void Run::refill_standby() {
  if (const int64_t n = pool_.refill_standby())
    event(JobEventKind::kStandby,
          std::to_string(n) + " standby trainer(s) placed, " + std::to_string(pool_.standby_count()) + " in all");
}

void Run::recover(const std::string& why) {
  Recovery rec;
  rec.failed_at = reporter_.now();
  ++failures_;
  rec.cause = why;
  rec.world_before = gang_.world();
  event(JobEventKind::kFailure, why);
  if (cfg_.failure.max_failures >= 0 && failures_ > cfg_.failure.max_failures) {
    // What was seen first may be a consequence (a loader's stream broken by
    // the rank whose step raised); a ConfigError the round ended with is
    // the reason given. Nothing else of the settling matters: it gives up.
    try {
      FailureRecovery(
          {rt_, cfg_, pool_, gang_, reporter_, consumed_, writer_.get(), min_, resumed_ ? &*resumed_ : nullptr}, rec)
          .settle();
    } catch (const ConfigError&) {
      throw;
    } catch (...) {
    }
    give_up("failure " + std::to_string(failures_) + " and failure.max_failures is " +
            std::to_string(cfg_.failure.max_failures) + ": " + why + save_what_survives());
  }
  give_up_if_head_lost(why);
  const int64_t before = gang_.step();
  FailureRecovery recovery(
      {rt_, cfg_, pool_, gang_, reporter_, consumed_, writer_.get(), min_, resumed_ ? &*resumed_ : nullptr}, rec);
  recovering_from_world_ = rec.world_before;
  try {
    recovery.run();
  } catch (const JobFailed&) {
    throw;
  } catch (...) {
    give_up_if_head_lost(why);
    throw;
  }
  recovering_from_world_ = 0;
  if (rec.mode == RecoveryMode::kHeal) record_healed_steps(before, rec.world_before);
  if (rec.mode != RecoveryMode::kHeal) {
    // Back to a checkpoint or to the start: the epoch's sums are the
    // checkpoint's, and the last checkpoint's step no longer holds.
    restore_epoch_sums(recovery.restored_epoch_sums());
    last_checkpoint_step_ = -1;
    checkpoint_floor_ = gang_.step();
    // Epochs that ended past the restored step run again: each is kept
    // once, as it runs the second time.
    std::erase_if(result_.history, [&](const EpochMetrics& em) { return em.steps > gang_.step(); });
  }
  round_.reset();  // recovered: what comes next fails at a step of its own
  result_.recoveries.push_back(rec);
  open_recovery_ = result_.recoveries.size() - 1;
  last_grow_check_ = Clock::now();
}

// A job that gives up after failures whose survivors live on: the state of
// the survivor that got furthest (the failed round settled, so its steps
// are whole ones every rank took part in) is written as a checkpoint when
// it is newer than the last one, so that --resume loses none of it. Said
// as a clause of the give-up's reason; "" when there is nothing to save.
std::string Run::save_what_survives(int64_t healed_world) {
  // Weights past a non-finite loss are not worth resuming from, and saving
  // them would prune a good checkpoint (only the newest few are kept).
  if (!writer_ || (nonfinite_loss_ && cfg_.stop_on_nonfinite_loss)) return "";
  try {
    writer_->wait();
    const auto last = writer_->last();
    // Nor again a checkpoint of this job's directory it resumed from (its
    // trainers loaded it; rewritten, it would lose its epoch sums).
    const int64_t saved = std::max<int64_t>(last ? last->step : -1, last_checkpoint_step_);
    const auto bound = std::min(cfg_.call_timeout, std::chrono::milliseconds(10000));
    // Only trainers holding the job's state are asked (a recovery or a
    // grow cut short by a stop leaves empty slots and new trainers).
    auto& slots = gang_.slots();
    std::vector<std::optional<Future<Progress>>> ps(slots.size());
    for (size_t r = 0; r < slots.size(); ++r)
      if (slots[r].has_state && slots[r].trainer.valid()) ps[r] = slots[r].trainer.call(&TrainerActor::progress);
    std::optional<std::pair<size_t, Progress>> best;
    for (size_t r = 0; r < ps.size(); ++r) {
      try {
        if (!ps[r]) continue;
        const Progress p = ps[r]->get(bound);
        if (!best || p.step > best->second.step) best = {r, p};
      } catch (const std::exception&) {
      }
    }
    if (!best || best->second.step <= saved || best->second.step <= 0) return "";
    if (healed_world > 0 && best->second.step > gang_.step()) {
      // The survivors' steps past the last boundary get their lines and
      // join the epoch's sums first, as a heal's would: the checkpoint
      // stands at their step, and a resume's epoch summary covers them.
      const int64_t before = gang_.step();
      gang_.set_position(best->second.step, best->second.cursor);
      record_healed_steps(before, healed_world);
    }
    TrainState state = gang_.slots()[best->first].trainer.call(&TrainerActor::state).get(cfg_.call_timeout);
    state.world_size = gang_.world();
    state.cursor = best->second.cursor;
    state.epoch = state.cursor.epoch;
    // With the epoch's sums to the last step boundary: a resume's epoch
    // summary then leaves out only the failed round's steps.
    writer_->submit(std::move(state), {}, epoch_sums());
    writer_->wait();
    const auto info = writer_->last();
    if (!info) return "";
    event(JobEventKind::kCheckpoint, "step " + std::to_string(info->step) + " from a survivor: " + info->path);
    return "; the survivors' state at step " + std::to_string(info->step) + " is saved in " + info->path;
  } catch (const std::exception& e) {
    return std::string("; the survivors' state could not be saved: ") + e.what();
  }
}

void Run::interrupted_while_waiting(const StopRequested& s, bool save) {
  result_.interrupted = true;
  std::string saved;
  if (save) {
    abort_generation(s.what());
    saved = save_what_survives(recovering_from_world_);
  }
  event(JobEventKind::kInterrupted, "while waiting for " + s.waiting_for + ", at step " + std::to_string(gang_.step()) +
                                        ", epoch " + std::to_string(gang_.cursor().epoch + 1) + " of " +
                                        std::to_string(cfg_.epochs) + saved);
  if (writer_) {
    writer_->wait();
    result_.last_checkpoint = writer_->last();
  }
}

void Run::abort_generation(const std::string& reason) {
  std::vector<uint64_t> ids;
  for (auto& s : gang_.slots())
    if (s.trainer.valid()) ids.push_back(s.trainer.id());
  try {
    collective::abort_group(rt_, ids, gang_.group_name(), reason, gang_.generation(), std::chrono::seconds(2));
  } catch (const std::exception&) {
    // Best effort: a trainer left in its join answers when that times out.
  }
}

std::optional<CheckpointInfo> Run::newest_checkpoint() const {
  auto newest = writer_ ? writer_->last() : std::nullopt;
  if (!newest && !cfg_.checkpoint.dir.empty()) newest = latest_checkpoint(cfg_.checkpoint.dir);
  return newest;
}

void Run::give_up_if_head_lost(const std::string& why) {
  if (rt_.valid() && rt_.core()->head_lost())
    give_up("lost the cluster's head, so nothing can be placed or healed (the failure seen: " + why + ")");
}

}  // namespace

namespace {
// A checkpoint directory that holds another run's checkpoints: this run
// would prune its own new ones (the other's steps count as newest) and,
// losing every trainer, restore the other run's weights (recovery takes
// the directory's newest). Going on from its newest checkpoint (resume_from
// that one, or the directory) is this run's own; from an older one, the
// newer ones are another run's. A directory a running job holds says so
// first. Nothing is read but names: a resume reads its checkpoint later.
void refuse_another_runs_checkpoints(const TrainJobConfig& c) {
  if (c.checkpoint.dir.empty() || !std::filesystem::is_directory(c.checkpoint.dir)) return;
  refuse_if_checkpoint_dir_in_use(c.checkpoint.dir);
  const std::string newest = newest_checkpoint_folder(c.checkpoint.dir);
  if (newest.empty()) return;
  std::error_code ec;
  const auto canonical = [&](const std::string& p) { return std::filesystem::weakly_canonical(p, ec); };
  const auto from = c.resume_from.empty() ? std::filesystem::path() : canonical(c.resume_from);
  if (!from.empty() && (from == canonical(c.checkpoint.dir) || from == canonical(newest))) return;
  const std::string name = std::filesystem::path(newest).filename().string();
  if (!from.empty() && from.parent_path() == canonical(c.checkpoint.dir)) {
    // The newer ones may be damaged (a resume passes over them, as pruning
    // and recovery do): only then, read them all to see.
    auto latest = latest_checkpoint(c.checkpoint.dir);
    if (latest && canonical(latest->path) == from) return;
    throw ConfigError("checkpoint.dir " + c.checkpoint.dir + " holds checkpoints newer than resume_from " +
                      c.resume_from + " (up to " + name +
                      "), another run's to this one: it would prune its own and, losing every trainer, restore "
                      "those; resume in another directory, or move them aside");
  }
  throw ConfigError("checkpoint.dir " + c.checkpoint.dir + " already holds a checkpoint (" + name +
                    ") of another run: set resume_from to it (or to the directory) to go on from it, or name "
                    "another directory");
}
}  // namespace

TrainJob::TrainJob(Runtime& rt, TrainJobConfig config) : rt_(rt), config_(std::move(config)) {
  validate(config_);
  refuse_another_runs_checkpoints(config_);
  // Trainers that hold part of a GPU may share it with another rank, which
  // NCCL cannot do: they reduce through host memory (Gloo).
  auto gpu = config_.scaling.resources_per_worker.find("GPU");
  const bool part_of_a_gpu = gpu != config_.scaling.resources_per_worker.end() && gpu->second > 0 && gpu->second < 1;
  if (part_of_a_gpu && config_.trainer.collective == "nccl")
    throw ConfigError("trainers holding GPU " + std::to_string(gpu->second) +
                      " each may share a GPU, which NCCL cannot: use collective 'gloo' or 'auto'");
  if (part_of_a_gpu && config_.trainer.collective == "auto") config_.trainer.collective = "gloo";
}
TrainJob::~TrainJob() = default;

Result TrainJob::fit() {
  if (!config_.ship_files) {
    Run run(rt_, config_);
    return run.fit();
  }
  // The shipped files are the driver's objects while the run holds them.
  TrainJobConfig config = config_;
  auto& shipped = config.trainer.shipped_files;
  for (const ConfigFile& file : files_read(config.trainer)) {
    auto same = [&](const ShippedFile& f) { return f.path == *file.path; };
    if (std::none_of(shipped.begin(), shipped.end(), same)) shipped.push_back(ship_file(rt_, *file.path));
  }
  Run run(rt_, config);
  return run.fit();
}

}  // namespace troupe::trainer
