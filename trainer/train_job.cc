#include "troupe/trainer/train_job.h"

#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include "troupe/actors/tensor_codec.h"
#include "troupe/runtime/collective/actor_group.h"
#include "troupe/runtime/core/errors.h"

namespace troupe::trainer {

namespace {
using Clock = std::chrono::steady_clock;
using Trainer = ActorHandle<TrainerActor>;
using Loader = ActorHandle<actors::DataLoaderActor>;
using StatePtr = std::shared_ptr<core::FutureStateBase>;

std::string format_resources(const Resources& r) {
  std::ostringstream s;
  s << "{";
  bool first = true;
  for (const auto& [k, v] : r) {
    s << (first ? "" : ", ") << k << ": " << v;
    first = false;
  }
  s << "}";
  return s.str();
}

// Each live node's total and free resources, from the head's status.
struct NodeResources {
  Resources total, free;
};
std::vector<NodeResources> live_nodes(Runtime& rt) {
  std::vector<NodeResources> out;
  const auto status = nlohmann::json::parse(rt.status_json());
  for (const auto& n : status.value("nodes", nlohmann::json::array())) {
    if (!n.value("alive", true)) continue;
    NodeResources r;
    const nlohmann::json total = n.value("total", nlohmann::json::object());
    const nlohmann::json used = n.value("used", nlohmann::json::object());
    for (auto it = total.begin(); it != total.end(); ++it) {
      if (!it->is_number()) continue;
      r.total[it.key()] = it->get<double>();
      const double u = used.contains(it.key()) && used[it.key()].is_number() ? used[it.key()].get<double>() : 0.0;
      r.free[it.key()] = it->get<double>() - u;
    }
    out.push_back(std::move(r));
  }
  return out;
}

// Waits for every future; rethrows the first failure after all settled, so
// no call is left running unobserved.
template <class R>
std::vector<R> get_all(std::vector<Future<R>>& fs, std::chrono::milliseconds timeout) {
  std::vector<R> out;
  std::exception_ptr first;
  for (auto& f : fs) {
    try {
      out.push_back(f.get(timeout));
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
  return out;
}
void get_all(std::vector<Future<void>>& fs, std::chrono::milliseconds timeout) {
  std::exception_ptr first;
  for (auto& f : fs) {
    try {
      f.get(timeout);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown error";
  }
}

// A round of calls that fails as soon as one of them fails: the driver must
// not wait for survivors stuck in a collective with a dead peer.
class Round {
 public:
  template <class T>
  void add(const Future<T>& f) {
    states_.push_back(f.state());
    f.on_ready([s = signal_] {
      {
        std::lock_guard lock(s->mu);
        ++s->ready;
      }
      s->cv.notify_all();
    });
  }
  // "" when every call succeeded; otherwise why the first failed one did
  // (or that the round ran out of time).
  std::string wait(std::chrono::milliseconds timeout) {
    std::unique_lock lock(signal_->mu);
    std::string why;
    auto failed = [&] {
      for (auto& st : states_)
        if (st->ready())
          if (auto e = st->error()) {
            why = what_of(e);
            return true;
          }
      return false;
    };
    bool done = signal_->cv.wait_for(
        lock, timeout, [&] { return failed() || signal_->ready == static_cast<int64_t>(states_.size()); });
    if (!done) return "no answer within " + std::to_string(timeout.count()) + " ms";
    return why;
  }
  const std::vector<StatePtr>& states() const { return states_; }

 private:
  struct Signal {
    std::mutex mu;
    std::condition_variable cv;
    int64_t ready = 0;
  };
  std::shared_ptr<Signal> signal_ = std::make_shared<Signal>();
  std::vector<StatePtr> states_;
};

// What the user's on_step threw: not a failure of the job's processes, so
// fit() passes it on as it is instead of recovering. Not a std::exception,
// so no recovery handler catches it by mistake.
struct CallbackFailed {
  std::exception_ptr error;
};

// A failure the job may recover from (a call failed, a peer died).
class StepFailed : public Error {
 public:
  using Error::Error;
};

}  // namespace

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
  if (c.epochs <= 0 && c.max_steps <= 0) throw ConfigError("epochs must be positive");
  if (c.checkpoint.every_steps < 0) throw ConfigError("checkpoint.every_steps must not be negative");
  if (c.failure.standby_workers < 0)
    throw ConfigError("failure.standby_workers must not be negative, got " + std::to_string(c.failure.standby_workers));
  if (c.failure.max_failures < -1)
    throw ConfigError("failure.max_failures must be -1 (no limit) or more, got " +
                      std::to_string(c.failure.max_failures));
  if (c.failure.mode == RecoveryMode::kCheckpoint && c.checkpoint.dir.empty() && c.failure.max_failures != 0)
    throw ConfigError("failure.mode = kCheckpoint needs checkpoint.dir");
  if (!c.resume_from.empty() && !std::filesystem::exists(c.resume_from))
    throw ConfigError("resume_from: '" + c.resume_from + "' does not exist");
}

namespace {

// One fit(): every actor and placement group it made, and where training
// stands. The destructor gives everything back.
class Run {
 public:
  Run(Runtime& rt, const TrainJobConfig& cfg) : rt_(rt), cfg_(cfg), t0_(Clock::now()) {}
  ~Run() {
    for (auto& s : slots_) release(s);
    for (auto& s : standby_) release(s);
  }
  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;

  Result fit();

 private:
  // One trainer with its loader, in a one-bundle placement group of its own.
  struct Slot {
    std::optional<PlacementGroup> pg;
    Trainer trainer;
    Loader loader;
    bool ready = false;  // setup() done
    // Holds the job's training state (joined a formed group that synced
    // or healed it, or loaded a checkpoint): may be a heal source.
    bool has_state = false;
    // A standby's setup() call, until it has answered.
    std::optional<Future<TrainerInfo>> setting_up;
  };
  // The running epoch's sums.
  struct EpochSums {
    int64_t epoch = -1;
    Clock::time_point start;
    double loss_sum = 0, busy = 0;
    int64_t correct = 0, samples = 0;
  };

  double now() const { return std::chrono::duration<double>(Clock::now() - t0_).count(); }
  int64_t world() const { return static_cast<int64_t>(slots_.size()); }
  int64_t per_step() const { return cfg_.trainer.batch_size * cfg_.trainer.accumulation; }

  void event(const std::string& kind, const std::string& detail);
  void write_metrics(const nlohmann::json& j) {
    if (metrics_) *metrics_ << j.dump() << "\n" << std::flush;
  }
  void release(Slot& s);
  // Places up to n new slots within `timeout`; those that fit are returned
  // with their actors spawned (not set up).
  std::vector<Slot> place(int64_t n, std::chrono::milliseconds timeout);
  void spawn_loader(Slot& s);
  // Options for an actor in the slot's bundle (resources: none).
  ActorOptions slot_options(const Slot& s) const;
  void setup_new(std::chrono::milliseconds timeout);
  // Joins every slot's trainer to the next generation of the group; with
  // heal_src >= 0, heals every rank from that rank and adopts its progress.
  void form(int64_t heal_src, std::chrono::milliseconds timeout);
  void load_everywhere(const TrainState& state, std::chrono::milliseconds timeout);
  // One step boundary's work; true when training is over.
  bool advance();
  void run_round();
  void end_epoch();
  void checkpoint(const std::map<std::string, double>& metrics);
  void maybe_grow();
  // Tops the standby trainers up to failure.standby_workers, where there is
  // room (their setup runs while training goes on).
  void refill_standby();
  // Up to n live, set-up standby trainers, taken out of standby_ (dead ones
  // are released), waiting for each at most until `deadline`.
  std::vector<Slot> take_standby(size_t n, Clock::time_point deadline);
  void recover(const std::string& why);
  void record(const TrainReport& r);
  // With record_indices: the indices every rank of `cursor`'s world read in
  // steps (from, to] that began at `cursor` (steps of a failed round).
  void record_from_sampler(const actors::SamplerCursor& cursor, int64_t from, int64_t to);
  [[noreturn]] void give_up(const std::string& why);

  Runtime& rt_;
  const TrainJobConfig& cfg_;
  Clock::time_point t0_;
  Result result_;
  std::vector<Slot> slots_;
  std::vector<Slot> standby_;
  Clock::time_point last_standby_check_;
  int64_t min_ = 1, max_ = 1;
  bool use_loaders_ = false;
  int64_t dataset_size_ = 0;
  std::optional<actors::DistributedSampler> sampler_;
  actors::SamplerCursor cursor_;
  int64_t step_ = 0;
  int64_t generation_ = 0;
  std::string group_name_;
  int64_t pg_count_ = 0;
  std::string pending_reason_;
  std::unique_ptr<std::ofstream> metrics_;
  std::unique_ptr<CheckpointWriter> writer_;
  int64_t last_checkpoint_step_ = -1;
  int64_t failures_ = 0;
  Clock::time_point last_grow_check_;
  // The recovery waiting for its first completed step.
  std::optional<size_t> open_recovery_;
  // Calls of the round that failed, still to settle.
  std::vector<StatePtr> inflight_;
  TrainerInfo info_;
  EpochSums sums_;
  bool stopped_ = false;  // max_steps reached
  // With record_indices: global step -> (epoch, indices of every rank).
  std::map<int64_t, std::pair<int64_t, std::vector<int64_t>>> consumed_;
  bool tty_ = false;
};

void Run::event(const std::string& kind, const std::string& detail) {
  JobEvent e{now(), kind, detail, step_, world()};
  result_.events.push_back(e);
  write_metrics({{"kind", "event"},
                 {"job", cfg_.name},
                 {"event", kind},
                 {"detail", detail},
                 {"time", e.time},
                 {"step", step_},
                 {"workers", world()}});
  static const char* const kShown[] = {"failure", "aborted", "replaced", "healed", "restored", "resized", "resumed"};
  if (cfg_.verbose && std::find(std::begin(kShown), std::end(kShown), kind) != std::end(kShown)) {
    std::printf("%s[%s] %7.3fs %-8s %s\n", tty_ ? "\r" : "", cfg_.name.c_str(), e.time, kind.c_str(), detail.c_str());
    std::fflush(stdout);
  }
}

void Run::release(Slot& s) {
  for (uint64_t id : {s.loader.valid() ? s.loader.id() : 0, s.trainer.valid() ? s.trainer.id() : 0}) {
    if (!id) continue;
    try {
      rt_.kill_actor(id, true);
    } catch (...) {
    }
  }
  if (s.pg) {
    try {
      rt_.remove_placement_group(*s.pg);
    } catch (...) {
    }
    s.pg.reset();
  }
  s.trainer = Trainer();
  s.loader = Loader();
}

ActorOptions Run::slot_options(const Slot& s) const {
  ActorOptions o;
  o.placement_group = &*s.pg;
  o.bundle_index = 0;
  o.executable = cfg_.executable;
  return o;
}

void Run::spawn_loader(Slot& s) {
  actors::LoaderConfig lc;
  lc.dataset = cfg_.trainer.data;
  lc.batch_size = cfg_.trainer.batch_size;
  lc.shuffle = cfg_.trainer.shuffle;
  lc.seed = cfg_.trainer.seed;
  lc.threads = static_cast<int32_t>(cfg_.loader_threads);
  lc.credits = 4;
  s.loader = rt_.spawn<actors::DataLoaderActor>(slot_options(s), lc);
}

std::vector<Run::Slot> Run::place(int64_t n, std::chrono::milliseconds timeout) {
  std::vector<Slot> out;
  std::vector<PlacementGroup> pgs;
  for (int64_t i = 0; i < n; ++i)
    pgs.push_back(rt_.create_placement_group({cfg_.scaling.resources_per_worker}, cfg_.scaling.strategy,
                                             group_name_ + "-pg" + std::to_string(pg_count_++)));
  const auto deadline = Clock::now() + timeout;
  size_t i = 0;
  try {
    for (; i < pgs.size(); ++i) {
      auto& pg = pgs[i];
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (pg.wait(std::max(left, std::chrono::milliseconds(1)))) {
        out.emplace_back();
        Slot& s = out.back();
        s.pg = pg;
        ActorOptions o = slot_options(s);
        o.resources = cfg_.scaling.resources_per_worker;
        s.trainer = rt_.spawn<TrainerActor>(o);
        if (use_loaders_) spawn_loader(s);
      } else {
        pending_reason_ = pg.info().pending_reason;
        rt_.remove_placement_group(pg);
      }
    }
  } catch (...) {
    // Nothing half-made stays behind.
    const bool held = !out.empty() && i < pgs.size() && out.back().pg && out.back().pg->id() == pgs[i].id();
    for (auto& s : out) release(s);
    for (i += held ? 1 : 0; i < pgs.size(); ++i) {
      try {
        rt_.remove_placement_group(pgs[i]);
      } catch (...) {
      }
    }
    throw;
  }
  return out;
}

void Run::setup_new(std::chrono::milliseconds timeout) {
  std::vector<Future<TrainerInfo>> fs;
  std::vector<size_t> which;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].ready) continue;
    fs.push_back(slots_[i].trainer.call(&TrainerActor::setup, cfg_.trainer));
    which.push_back(i);
  }
  auto infos = get_all(fs, timeout);
  for (size_t k = 0; k < which.size(); ++k) slots_[which[k]].ready = true;
  if (!infos.empty()) info_ = infos[0];
}

void Run::form(int64_t heal_src, std::chrono::milliseconds timeout) {
  ++generation_;
  std::vector<uint64_t> members;
  for (auto& s : slots_) members.push_back(s.trainer.id());
  std::vector<Future<void>> joins;
  for (int64_t r = 0; r < world(); ++r)
    joins.push_back(slots_[r].trainer.call(&TrainerActor::join,
                                           JoinSpec{group_name_, generation_, r, world(), members, heal_src < 0}));
  get_all(joins, timeout);
  if (heal_src >= 0) {
    std::vector<Future<Progress>> heals;
    for (auto& s : slots_) heals.push_back(s.trainer.call(&TrainerActor::heal, heal_src));
    auto ps = get_all(heals, timeout);
    // At the driver's own step its cursor is the truth (it may already
    // stand at the next epoch's start, which the trainers have not seen);
    // past it, the survivors completed steps of a failed round.
    if (ps[0].step != step_) {
      step_ = ps[0].step;
      cursor_ = ps[0].cursor;
    }
  }
  cursor_ = sampler_->resize(cursor_, world());
  for (auto& s : slots_) s.has_state = true;
}

void Run::load_everywhere(const TrainState& state, std::chrono::milliseconds timeout) {
  std::vector<Future<void>> loads;
  for (auto& s : slots_) loads.push_back(s.trainer.call(&TrainerActor::load_state, state));
  get_all(loads, timeout);
  for (auto& s : slots_) s.has_state = true;
  step_ = state.step;
  cursor_ = sampler_->resize(state.cursor, world());
  if (sampler_->epoch_done(cursor_)) cursor_ = sampler_->begin_epoch(cursor_.epoch + 1, world());
}

void Run::give_up(const std::string& why) {
  event("failed", why);
  result_.steps = step_;
  result_.final_world_size = world();
  std::ostringstream s;
  s << "[" << cfg_.name << "] training failed at step " << step_ << ": " << why << "\nwhat happened:";
  for (const auto& e : result_.events) {
    char t[32];
    std::snprintf(t, sizeof t, "%.3fs", e.time);
    s << "\n  " << t << " " << e.kind << ": " << e.detail;
  }
  throw JobFailed(s.str(), result_);
}

void Run::record(const TrainReport& r) {
  if (!cfg_.record_indices || r.step_samples.empty()) return;
  // Split the report's indices into its steps.
  size_t pos = 0;
  const int64_t first = r.global_step - static_cast<int64_t>(r.step_samples.size()) + 1;
  for (size_t k = 0; k < r.step_samples.size(); ++k) {
    auto& [epoch, idx] = consumed_[first + static_cast<int64_t>(k)];
    const size_t n = std::min(static_cast<size_t>(r.step_samples[k]), r.consumed.size() - pos);
    epoch = r.cursor.epoch;
    idx.insert(idx.end(), r.consumed.begin() + pos, r.consumed.begin() + pos + n);
    pos += n;
  }
}

void Run::record_from_sampler(const actors::SamplerCursor& cursor, int64_t from, int64_t to) {
  if (!cfg_.record_indices || to <= from) return;
  const auto split = split_order(cfg_.trainer, dataset_size_);
  for (int64_t r = 0; r < cursor.world_size; ++r) {
    const auto idx = sampler_->remaining(cursor, r);
    for (int64_t st = from; st < to; ++st) {
      auto& [epoch, out] = consumed_[st + 1];
      epoch = cursor.epoch;
      const size_t b = static_cast<size_t>((st - from) * per_step());
      for (size_t k = b; k < std::min(idx.size(), b + static_cast<size_t>(per_step())); ++k)
        out.push_back(split.empty() ? idx[k] : split[static_cast<size_t>(idx[k])]);
    }
  }
}

void Run::checkpoint(const std::map<std::string, double>& m) {
  if (!writer_ || last_checkpoint_step_ == step_) return;
  auto state = slots_[0].trainer.call(&TrainerActor::state).get(cfg_.call_timeout);
  state.world_size = world();
  state.cursor = cursor_;
  state.epoch = cursor_.epoch;
  writer_->submit(std::move(state), m);
  if (!cfg_.checkpoint.async) writer_->wait();
  last_checkpoint_step_ = step_;
  event("checkpoint", "step " + std::to_string(step_));
}

void Run::run_round() {
  const int64_t remaining = sampler_->remaining_per_rank(cursor_) / per_step();
  int64_t chunk = std::max<int64_t>(1, remaining);
  if (cfg_.checkpoint.every_steps > 0 && writer_)
    chunk = std::min(chunk, cfg_.checkpoint.every_steps - step_ % cfg_.checkpoint.every_steps);
  if (cfg_.progress_every_steps > 0) chunk = std::min(chunk, cfg_.progress_every_steps);
  if (cfg_.max_steps > 0) chunk = std::min(chunk, cfg_.max_steps - step_);
  const int64_t steps_now = std::min(chunk, remaining);
  const bool stream = use_loaders_ && steps_now > 0;
  inflight_.clear();

  Round round;
  std::vector<Future<int64_t>> feeds;
  if (stream) {
    // A fresh stream per call: the loader closes it after the batches of
    // `chunk` steps (fewer at the epoch's end).
    std::vector<Future<StreamRef>> refs;
    Round opening;
    for (auto& s : slots_) {
      refs.push_back(s.trainer.call(&TrainerActor::open_stream, int64_t{4}));
      opening.add(refs.back());
    }
    auto why = opening.wait(cfg_.call_timeout);
    if (!why.empty()) {
      inflight_ = opening.states();
      throw StepFailed("opening the batch streams: " + why);
    }
    for (int64_t r = 0; r < world(); ++r) {
      feeds.push_back(slots_[r].loader.call(&actors::DataLoaderActor::feed, refs[r].get(), cursor_,
                                            static_cast<int32_t>(r), steps_now * cfg_.trainer.accumulation));
      round.add(feeds.back());
    }
  }
  std::vector<Future<TrainReport>> fs;
  for (auto& s : slots_) {
    fs.push_back(s.trainer.call(&TrainerActor::train, TrainRequest{cursor_, chunk, stream, cfg_.record_indices}));
    round.add(fs.back());
  }
  auto why = round.wait(cfg_.call_timeout);
  if (!why.empty()) {
    inflight_ = round.states();
    throw StepFailed(why);
  }
  std::vector<TrainReport> reps;
  for (auto& f : fs) reps.push_back(f.get());
  for (auto& f : feeds) f.get();

  cursor_ = reps[0].cursor;
  double seconds = 0;
  for (const auto& r : reps) seconds = std::max(seconds, r.seconds);
  sums_.busy += seconds;
  for (size_t s = 0; s < reps[0].step_loss_sum.size(); ++s) {
    double l = 0;
    int64_t c = 0, n = 0;
    for (const auto& r : reps) {
      l += r.step_loss_sum[s];
      c += r.step_correct[s];
      n += r.step_samples[s];
    }
    int64_t st = reps[0].global_step - static_cast<int64_t>(reps[0].step_loss_sum.size()) + static_cast<int64_t>(s) + 1;
    write_metrics({{"kind", "step"},
                   {"job", cfg_.name},
                   {"epoch", cursor_.epoch},
                   {"step", st},
                   {"loss", l / n},
                   {"accuracy", double(c) / n},
                   {"samples", n},
                   {"workers", world()},
                   {"time", now()}});
  }
  int64_t samples = 0;
  for (int64_t r = 0; r < world(); ++r) {
    const auto& rep = reps[r];
    sums_.loss_sum += rep.loss_sum;
    sums_.correct += rep.correct;
    sums_.samples += rep.samples;
    samples += rep.samples;
    record(rep);
  }
  step_ = reps[0].global_step;
  if (open_recovery_ && reps[0].steps > 0) {
    result_.recoveries[*open_recovery_].step_done_at = now();
    open_recovery_.reset();
  }
  if (cfg_.verbose && tty_ && sums_.samples > 0) {
    std::printf("\r[%s] epoch %lld/%lld  step %lld  %lld workers  loss %.4f  acc %.3f  %.0f samples/s   ",
                cfg_.name.c_str(), static_cast<long long>(cursor_.epoch + 1), static_cast<long long>(cfg_.epochs),
                static_cast<long long>(step_), static_cast<long long>(world()), sums_.loss_sum / sums_.samples,
                double(sums_.correct) / sums_.samples, sums_.samples / std::max(sums_.busy, 1e-9));
    std::fflush(stdout);
  }
  if (cfg_.on_step) {
    try {
      cfg_.on_step(StepInfo{step_, cursor_.epoch, world(), now(), samples, seconds});
    } catch (...) {
      throw CallbackFailed{std::current_exception()};
    }
  }
  if (cfg_.checkpoint.every_steps > 0 && step_ % cfg_.checkpoint.every_steps == 0)
    checkpoint({{"train_loss", sums_.samples ? sums_.loss_sum / sums_.samples : 0.0}});
  if (cfg_.max_steps > 0 && step_ >= cfg_.max_steps) stopped_ = true;
}

void Run::end_epoch() {
  EpochMetrics em;
  em.epoch = sums_.epoch;
  em.steps = step_;
  em.train_loss = sums_.samples ? sums_.loss_sum / sums_.samples : 0;
  em.train_accuracy = sums_.samples ? double(sums_.correct) / sums_.samples : 0;
  em.samples_per_second = sums_.busy > 0 ? sums_.samples / sums_.busy : 0;
  if (cfg_.evaluate) {
    std::vector<Future<EvalReport>> fs;
    for (int64_t r = 0; r < world(); ++r) fs.push_back(slots_[r].trainer.call(&TrainerActor::evaluate, r, world()));
    for (const auto& e : get_all(fs, cfg_.call_timeout)) {
      em.val_loss += e.loss_sum;
      em.val_accuracy += static_cast<double>(e.correct);
      em.val_count += e.count;
    }
    if (em.val_count) {
      em.val_loss /= em.val_count;
      em.val_accuracy /= em.val_count;
    }
  }
  em.seconds = std::chrono::duration<double>(Clock::now() - sums_.start).count();
  result_.history.push_back(em);
  write_metrics({{"kind", "epoch"},
                 {"job", cfg_.name},
                 {"epoch", em.epoch},
                 {"step", step_},
                 {"workers", world()},
                 {"train_loss", em.train_loss},
                 {"train_accuracy", em.train_accuracy},
                 {"samples_per_second", em.samples_per_second},
                 {"val_loss", em.val_loss},
                 {"val_accuracy", em.val_accuracy},
                 {"val_count", em.val_count},
                 {"seconds", em.seconds}});
  if (cfg_.verbose) {
    char val[96] = "";
    if (cfg_.evaluate) std::snprintf(val, sizeof val, "  val_loss %.4f  val_acc %.3f", em.val_loss, em.val_accuracy);
    std::printf("%s[%s] epoch %lld/%lld  step %lld  loss %.4f  acc %.3f%s  %.0f samples/s  %.2fs\n", tty_ ? "\r" : "",
                cfg_.name.c_str(), static_cast<long long>(em.epoch + 1), static_cast<long long>(cfg_.epochs),
                static_cast<long long>(step_), em.train_loss, em.train_accuracy, val, em.samples_per_second,
                em.seconds);
    std::fflush(stdout);
  }
  event("epoch", "epoch " + std::to_string(em.epoch) + " done at step " + std::to_string(step_));
  if (cfg_.checkpoint.at_epoch_end && sampler_->epoch_done(cursor_))
    checkpoint({{"train_loss", em.train_loss},
                {"train_accuracy", em.train_accuracy},
                {"val_loss", em.val_loss},
                {"val_accuracy", em.val_accuracy}});
  sums_ = EpochSums{};
}

void Run::maybe_grow() {
  if (world() >= max_) return;
  auto t = Clock::now();
  if (t - last_grow_check_ < cfg_.scaling.grow_interval) return;
  last_grow_check_ = t;
  // Room for how many more? Counted from the live nodes' free resources,
  // so a job at its limit costs one status call, not a placement attempt.
  int64_t room = 0;
  for (const auto& n : live_nodes(rt_)) {
    int64_t fit = max_;
    for (const auto& [k, v] : cfg_.scaling.resources_per_worker) {
      if (v <= 0) continue;
      auto it = n.free.find(k);
      const double have = it == n.free.end() ? 0.0 : it->second;
      fit = std::min<int64_t>(fit, static_cast<int64_t>(have / v + 1e-9));
    }
    room += fit;
  }
  const int64_t want = std::min(room, max_ - world());
  if (want <= 0) return;
  auto added = place(want, cfg_.failure.replacement_timeout);
  if (added.empty()) return;
  const int64_t before = world();
  for (auto& s : added) slots_.push_back(std::move(s));
  event("replaced", std::to_string(added.size()) + " new trainer(s) placed to grow");
  setup_new(cfg_.call_timeout);
  form(0, cfg_.call_timeout);
  event("healed", "new trainers took rank 0's state at step " + std::to_string(step_));
  event("resized", std::to_string(before) + " -> " + std::to_string(world()) + " workers at step " +
                       std::to_string(step_) + " (" + std::to_string(sampler_->remaining_per_rank(cursor_)) +
                       " samples per rank left in epoch " + std::to_string(cursor_.epoch) + ")");
}

void Run::refill_standby() {
  const auto want = cfg_.failure.standby_workers - static_cast<int64_t>(standby_.size());
  if (want <= 0) return;
  auto t = Clock::now();
  if (t - last_standby_check_ < cfg_.scaling.grow_interval) return;
  last_standby_check_ = t;
  const auto reason = pending_reason_;
  auto more = place(want, std::chrono::milliseconds(50));
  pending_reason_ = reason;  // a full cluster is no news for standbys
  for (auto& s : more) {
    s.setting_up = s.trainer.call(&TrainerActor::setup, cfg_.trainer);
    standby_.push_back(std::move(s));
  }
  if (!more.empty())
    event("standby",
          std::to_string(more.size()) + " standby trainer(s) placed, " + std::to_string(standby_.size()) + " in all");
}

std::vector<Run::Slot> Run::take_standby(size_t n, Clock::time_point deadline) {
  std::vector<Slot> out;
  std::vector<Future<Progress>> probes;
  for (auto& s : standby_) probes.push_back(s.trainer.call(&TrainerActor::progress));
  std::vector<Slot> keep;
  for (size_t i = 0; i < standby_.size(); ++i) {
    auto& s = standby_[i];
    if (out.size() == n) {
      keep.push_back(std::move(s));
      continue;
    }
    auto left = std::max(std::chrono::milliseconds(1),
                         std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
    bool alive = true;
    try {
      if (s.setting_up) s.setting_up->get(left);
      probes[i].get(left);
    } catch (...) {
      alive = false;
    }
    if (!alive) {
      release(s);
      continue;
    }
    s.setting_up.reset();
    s.ready = true;
    s.has_state = false;
    out.push_back(std::move(s));
  }
  standby_ = std::move(keep);
  return out;
}

bool Run::advance() {
  if (stopped_ || cursor_.epoch >= cfg_.epochs) {
    if (sums_.epoch >= 0) end_epoch();
    return true;
  }
  maybe_grow();
  refill_standby();
  if (sums_.epoch != cursor_.epoch) {
    sums_ = EpochSums{};
    sums_.epoch = cursor_.epoch;
    sums_.start = Clock::now();
  }
  if (sampler_->epoch_done(cursor_)) {
    end_epoch();
    cursor_ = sampler_->begin_epoch(cursor_.epoch + 1, world());
    return false;
  }
  run_round();
  return false;
}

void Run::recover(const std::string& why) {
  const double failed_at = now();
  ++failures_;
  Recovery rec;
  rec.failed_at = failed_at;
  rec.cause = why;
  rec.world_before = world();
  event("failure", why);
  if (cfg_.failure.max_failures >= 0 && failures_ > cfg_.failure.max_failures)
    give_up("failure " + std::to_string(failures_) + " and failure.max_failures is " +
            std::to_string(cfg_.failure.max_failures) + ": " + why);
  const auto& fc = cfg_.failure;
  // Every wait below shares one deadline, so a recovery's probing is
  // bounded by abort_timeout whatever the number of ranks.
  const auto deadline = Clock::now() + fc.abort_timeout;
  auto left = [&] {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
  };

  // 1. No survivor may stay inside a collective with a dead peer (abort,
  //    by control message: it bypasses the mailbox), wait for batches from
  //    a loader that died before it connected (interrupt its stream), and
  //    no loader may keep writing into a stream nobody reads (stop feeds).
  std::vector<uint64_t> ids;
  for (auto& s : slots_) ids.push_back(s.trainer.id());
  int acked = collective::abort_group(rt_, ids, group_name_, why, generation_,
                                      std::min(left(), std::chrono::milliseconds(2000)));
  {
    std::vector<std::shared_ptr<core::FutureStateBase>> controls;
    for (auto& s : slots_) {
      try {
        controls.push_back(s.trainer.control(InterruptBatches{.generation = generation_, .reason = why}).state());
        if (s.loader.valid()) controls.push_back(s.loader.control(actors::StopFeeds{.rank = -1}).state());
      } catch (...) {
      }
    }
    for (auto& f : controls) f->wait_for(std::min(left(), std::chrono::milliseconds(1000)));
  }
  event("aborted", "generation " + std::to_string(generation_) + " aborted in " + std::to_string(acked) + " of " +
                       std::to_string(ids.size()) + " trainers");
  for (auto& st : inflight_) st->wait_for(left());
  inflight_.clear();

  // 2. Who is alive: a trainer that answers progress() (it left the
  //    aborted step; calls queue behind a running one) and a loader that
  //    answers a stats control message (served beside a running feed).
  //    Anything else is gone: killed for good and its slot emptied.
  std::vector<std::optional<Progress>> progress(slots_.size());
  {
    std::vector<Future<Progress>> ps;
    std::vector<std::optional<Future<actors::LoaderStats>>> ls(slots_.size());
    for (size_t i = 0; i < slots_.size(); ++i) {
      ps.push_back(slots_[i].trainer.call(&TrainerActor::progress));
      if (slots_[i].loader.valid()) ls[i] = slots_[i].loader.control(actors::GetLoaderStats{});
    }
    for (size_t i = 0; i < slots_.size(); ++i) {
      auto& s = slots_[i];
      try {
        progress[i] = ps[i].get(left());
      } catch (const std::exception&) {
        progress[i].reset();
      }
      if (!ls[i]) continue;
      bool alive = true;
      try {
        ls[i]->get(left());
      } catch (...) {
        alive = false;
      }
      if (!alive && progress[i]) {
        try {
          rt_.kill_actor(s.loader.id(), true);
        } catch (...) {
        }
        s.loader = Loader();
      }
    }
  }
  // A trainer that never received the job's state (a replacement whose
  // heal failed) is no source: it holds the initial weights.
  std::vector<size_t> dead;
  int64_t reached = step_;
  bool any_state = false;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (!progress[i]) {
      dead.push_back(i);
      continue;
    }
    if (!slots_[i].has_state) continue;
    any_state = true;
    reached = std::max(reached, progress[i]->step);
  }
  rec.reached_step = reached;

  // 3. Replace what died: loaders of live trainers in their trainers'
  //    bundles, dead trainers in fresh slots at the same ranks (the same
  //    data shard and reduction order as before); what cannot be placed in
  //    time is dropped (the job shrinks).
  for (size_t i = 0; i < slots_.size(); ++i)
    if (progress[i] && use_loaders_ && !slots_[i].loader.valid()) {
      spawn_loader(slots_[i]);
      event("replaced", "the loader of rank " + std::to_string(i) + " died; a new one resumes from the cursor");
    }
  const bool from_disk = !any_state || fc.mode == RecoveryMode::kCheckpoint;
  for (size_t i : dead) release(slots_[i]);
  auto fresh = take_standby(dead.size(), deadline + std::chrono::seconds(2));
  rec.from_standby = static_cast<int64_t>(fresh.size());
  if (fresh.size() < dead.size()) {
    auto placed = place(static_cast<int64_t>(dead.size() - fresh.size()),
                        dead.size() == slots_.size() ? cfg_.scaling.placement_timeout : fc.replacement_timeout);
    rec.placed = static_cast<int64_t>(placed.size());
    for (auto& p : placed) fresh.push_back(std::move(p));
  }
  // The new slot order (survivors and replacements at their old ranks,
  // dropped ranks closing the gaps) and the heal source: the survivor
  // holding state with the most completed steps.
  int64_t src = -1;
  {
    std::vector<Slot> next;
    int64_t best = -1;
    size_t k = 0;
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (progress[i]) {
        if (slots_[i].has_state && progress[i]->step > best) {
          best = progress[i]->step;
          src = static_cast<int64_t>(next.size());
        }
        next.push_back(std::move(slots_[i]));
      } else if (k < fresh.size()) {
        next.push_back(std::move(fresh[k++]));
      }
    }
    slots_ = std::move(next);
  }
  if (!dead.empty())
    event("replaced", std::to_string(fresh.size()) + " of " + std::to_string(dead.size()) +
                          " dead trainer(s) replaced" +
                          (rec.from_standby ? " (" + std::to_string(rec.from_standby) + " from standby)" : "") +
                          (fresh.size() < dead.size() ? " (no room: " + pending_reason_ + ")" : ""));
  if (world() < min_)
    give_up("only " + std::to_string(world()) + " trainer(s) could be placed, scaling.min_workers is " +
            std::to_string(min_) + (pending_reason_.empty() ? "" : " (" + pending_reason_ + ")"));

  // 4. A new generation, and one state everywhere.
  setup_new(cfg_.call_timeout);
  if (from_disk) {
    std::optional<TrainState> disk;
    if (writer_) writer_->wait();
    if (!cfg_.checkpoint.dir.empty())
      if (auto latest = latest_checkpoint(cfg_.checkpoint.dir)) disk = load_checkpoint(latest->path);
    if (!disk) {
      // Back to the initial weights: survivors set up afresh too.
      for (auto& s : slots_) s.ready = false;
      setup_new(cfg_.call_timeout);
    }
    form(-1, cfg_.call_timeout);
    if (disk) {
      for (auto& s : slots_) s.has_state = false;  // until the load succeeds
      load_everywhere(*disk, cfg_.call_timeout);
      rec.mode = "checkpoint";
      event("restored", "every trainer took the checkpoint of step " + std::to_string(disk->step));
    } else {
      // No checkpoint: every trainer holds the initial weights.
      step_ = 0;
      cursor_ = sampler_->begin_epoch(0, world());
      rec.mode = "restart";
      event("restored", "no checkpoint: training starts over from the initial weights");
    }
    // Steps after the restored one are done again: forget their records.
    consumed_.erase(consumed_.upper_bound(step_), consumed_.end());
    sums_ = EpochSums{};
    last_checkpoint_step_ = -1;
  } else {
    const int64_t before = step_;
    const auto before_cursor = cursor_;
    form(src, cfg_.call_timeout);
    // Steps the survivors completed inside the failed round count as
    // consumed: what each old rank read in them follows from the cursor
    // the round started at (the dead ranks' share included).
    record_from_sampler(before_cursor, before, step_);
    rec.mode = "heal";
    event("healed", "rank " + std::to_string(src) + " sent its state (step " + std::to_string(step_) + ") to " +
                        std::to_string(world()) + " ranks by broadcast");
  }
  if (world() != rec.world_before)
    event("resized", std::to_string(rec.world_before) + " -> " + std::to_string(world()) + " workers at step " +
                         std::to_string(step_));
  rec.world_after = world();
  rec.resumed_step = step_;
  rec.lost_steps = std::max<int64_t>(0, rec.reached_step - step_);
  rec.resumed_at = now();
  char took[32];
  std::snprintf(took, sizeof took, "%.3f", rec.resumed_at - rec.failed_at);
  event("resumed", "at step " + std::to_string(step_) + " with " + std::to_string(world()) + " workers, " +
                       std::to_string(rec.lost_steps) + " step(s) lost, " + rec.mode + " in " + took + " s");
  result_.recoveries.push_back(rec);
  open_recovery_ = result_.recoveries.size() - 1;
  last_grow_check_ = Clock::now();
}

Result Run::fit() {
  const auto& cfg = cfg_;
  const auto& sc = cfg.scaling;
  min_ = sc.min_workers > 0 ? sc.min_workers : sc.num_workers;
  max_ = sc.max_workers > 0 ? sc.max_workers : sc.num_workers;
  tty_ = ::isatty(1);

  // --- checks that need no trainer ---------------------------------------
  dataset_size_ = actors::make_dataset(cfg.trainer.data)->size();
  sampler_.emplace(sampler_options(cfg.trainer, dataset_size_, sc.num_workers));
  std::optional<TrainState> resume;
  if (!cfg.resume_from.empty()) {
    std::string dir = cfg.resume_from;
    if (!std::filesystem::exists(std::filesystem::path(dir) / "manifest.json")) {
      auto latest = latest_checkpoint(dir);
      if (!latest) throw ConfigError("resume_from: no valid checkpoint under '" + dir + "'");
      dir = latest->path;
    }
    resume = load_checkpoint(dir);
    event("resumed", dir + " (step " + std::to_string(resume->step) + ", epoch " + std::to_string(resume->epoch) +
                         ", " + std::to_string(resume->world_size) + " workers)");
  }
  {
    // Total resources of the live nodes: a job that can never be placed
    // fails now, naming the resource.
    std::map<std::string, double> total;
    for (const auto& n : live_nodes(rt_))
      for (const auto& [k, v] : n.total) total[k] += v;
    for (const auto& [k, v] : sc.resources_per_worker) {
      double need = v * static_cast<double>(min_);
      if (need > total[k] + 1e-9) {
        std::ostringstream s;
        s << "cannot place " << min_ << " workers × " << format_resources(sc.resources_per_worker) << ": they need "
          << k << " " << need << ", the cluster has " << k << " " << total[k]
          << " in all (the placement group would stay PENDING)";
        throw ConfigError(s.str());
      }
    }
  }
  if (!cfg.metrics_path.empty()) {
    auto parent = std::filesystem::path(cfg.metrics_path).parent_path();
    std::error_code ec;
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    metrics_ = std::make_unique<std::ofstream>(cfg.metrics_path, std::ios::app);
    if (!*metrics_) throw ConfigError("cannot open metrics file " + cfg.metrics_path);
  }
  if (!cfg.checkpoint.dir.empty())
    writer_ = std::make_unique<CheckpointWriter>(cfg.checkpoint.dir, cfg.checkpoint.keep);
  use_loaders_ = cfg.use_loaders && cfg.trainer.validation_fraction == 0;
  static std::atomic<int64_t> job_counter{0};
  group_name_ = cfg.name + "-" + std::to_string(::getpid()) + "-" + std::to_string(job_counter++);

  // --- placement and trainers ------------------------------------------
  slots_ = place(sc.num_workers, sc.placement_timeout);
  if (world() < min_) {
    const int64_t got = world();
    for (auto& s : slots_) release(s);
    slots_.clear();
    throw ConfigError("placement group for " + std::to_string(min_) + " workers × " +
                      format_resources(sc.resources_per_worker) + " is still PENDING after " +
                      std::to_string(sc.placement_timeout.count()) + " ms (" + std::to_string(got) +
                      " placed): " + pending_reason_);
  }
  event("placed", std::to_string(world()) + " bundles " + format_resources(sc.resources_per_worker));
  // Standbys start now, so their setup runs beside the trainers'.
  refill_standby();
  setup_new(cfg.call_timeout);
  form(-1, cfg.call_timeout);
  event("started", std::to_string(world()) + " trainers, " + info_.model + ", " + std::to_string(info_.parameters) +
                       " parameters on " + info_.device);
  if (cfg.verbose)
    std::printf("[%s] %lld trainer(s) (%s, %lld parameters, %s), %lld samples\n", cfg.name.c_str(),
                static_cast<long long>(world()), info_.model.c_str(), static_cast<long long>(info_.parameters),
                info_.device.c_str(), static_cast<long long>(dataset_size_));
  cursor_ = sampler_->begin_epoch(0, world());
  if (resume) load_everywhere(*resume, cfg.call_timeout);
  last_grow_check_ = Clock::now();

  // --- training: every failure goes through recover() and training goes
  //     on from where the survivors are --------------------------------
  std::optional<std::string> failure;
  for (;;) {
    try {
      if (failure) {
        std::string why = std::move(*failure);
        failure.reset();
        recover(why);
      }
      if (!advance()) continue;
      if (writer_) {
        writer_->wait();
        result_.last_checkpoint = writer_->last();
      }
      result_.final_state = slots_[0].trainer.call(&TrainerActor::state).get(cfg.call_timeout);
      break;
    } catch (const CallbackFailed& c) {
      std::rethrow_exception(c.error);
    } catch (const JobFailed&) {
      throw;
    } catch (const ConfigError& e) {
      // A trainer refusing its config will refuse it again: not a failure
      // a replacement can fix.
      give_up(e.what());
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  result_.final_state.world_size = world();
  result_.final_state.cursor = cursor_;
  result_.steps = step_;
  result_.final_world_size = world();
  for (auto& [st, entry] : consumed_) {
    auto& v = result_.consumed[entry.first];
    v.insert(v.end(), entry.second.begin(), entry.second.end());
  }
  event("finished", "step " + std::to_string(step_));
  return std::move(result_);
}

}  // namespace

TrainJob::TrainJob(Runtime& rt, TrainJobConfig config) : rt_(rt), config_(std::move(config)) { validate(config_); }
TrainJob::~TrainJob() = default;

Result TrainJob::fit() {
  Run run(rt_, config_);
  return run.fit();
}

}  // namespace troupe::trainer
