#include "trainer/train_job.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "actors/tensor_codec.h"
#include "runtime/core/errors.h"

namespace troupe::trainer {

namespace {
using Clock = std::chrono::steady_clock;
using Trainer = ActorHandle<TrainerActor>;

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

}  // namespace

void validate(const TrainJobConfig& c) {
  validate(c.trainer);
  if (c.scaling.num_workers <= 0) throw ConfigError("scaling.num_workers must be positive");
  if (c.epochs <= 0 && c.max_steps <= 0) throw ConfigError("epochs must be positive");
  if (c.checkpoint.every_steps < 0) throw ConfigError("checkpoint.every_steps must not be negative");
  if (!c.resume_from.empty() && !std::filesystem::exists(c.resume_from))
    throw ConfigError("resume_from: '" + c.resume_from + "' does not exist");
}

// Everything fit() spawned; the destructor gives it back.
struct TrainJob::Impl {
  Runtime& rt;
  std::optional<PlacementGroup> pg;
  std::vector<Trainer> trainers;
  std::vector<ActorHandle<actors::DataLoaderActor>> loaders;
  explicit Impl(Runtime& r) : rt(r) {}
  ~Impl() {
    for (auto& l : loaders) {
      try {
        rt.kill(l);
      } catch (...) {
      }
    }
    for (auto& t : trainers) {
      try {
        rt.kill(t);
      } catch (...) {
      }
    }
    if (pg) {
      try {
        rt.remove_placement_group(*pg);
      } catch (...) {
      }
    }
  }
};

TrainJob::TrainJob(Runtime& rt, TrainJobConfig config) : rt_(rt), config_(std::move(config)) { validate(config_); }
TrainJob::~TrainJob() = default;

Result TrainJob::fit() {
  const auto& cfg = config_;
  const auto t0 = Clock::now();
  auto now = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  Result result;
  auto event = [&](std::string kind, std::string detail) {
    result.events.push_back(JobEvent{now(), std::move(kind), std::move(detail)});
  };
  const int64_t world = cfg.scaling.num_workers;

  // --- checks that need no trainer ---------------------------------------
  int64_t dataset_size = actors::make_dataset(cfg.trainer.data)->size();
  actors::DistributedSampler sampler(sampler_options(cfg.trainer, dataset_size, world));
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
    auto status = nlohmann::json::parse(rt_.status_json());
    std::map<std::string, double> total;
    const nlohmann::json nodes = status.value("nodes", nlohmann::json::array());
    for (const auto& n : nodes) {
      if (!n.value("alive", true)) continue;
      const nlohmann::json node_total = n.value("total", nlohmann::json::object());
      for (auto it = node_total.begin(); it != node_total.end(); ++it)
        if (it->is_number()) total[it.key()] += it->get<double>();
    }
    for (const auto& [k, v] : cfg.scaling.resources_per_worker) {
      double need = v * static_cast<double>(world);
      if (need > total[k] + 1e-9) {
        std::ostringstream s;
        s << "cannot place " << world << " workers × " << format_resources(cfg.scaling.resources_per_worker)
          << ": they need " << k << " " << need << ", the cluster has " << k << " " << total[k]
          << " in all (the placement group would stay PENDING)";
        throw ConfigError(s.str());
      }
    }
  }

  // --- placement and trainers ------------------------------------------
  Impl impl(rt_);
  std::vector<Resources> bundles(static_cast<size_t>(world), cfg.scaling.resources_per_worker);
  impl.pg = rt_.create_placement_group(bundles, cfg.scaling.strategy, cfg.name + "-" + std::to_string(::getpid()));
  if (!impl.pg->wait(cfg.scaling.placement_timeout)) {
    auto info = impl.pg->info();
    throw ConfigError("placement group for " + std::to_string(world) + " workers × " +
                      format_resources(cfg.scaling.resources_per_worker) + " is still PENDING after " +
                      std::to_string(cfg.scaling.placement_timeout.count()) + " ms: " + info.pending_reason);
  }
  event("placed", std::to_string(world) + " bundles " + format_resources(cfg.scaling.resources_per_worker));
  for (int64_t r = 0; r < world; ++r) {
    ActorOptions o;
    o.resources = cfg.scaling.resources_per_worker;
    o.placement_group = &*impl.pg;
    o.bundle_index = static_cast<int>(r);
    o.executable = cfg.executable;
    impl.trainers.push_back(rt_.spawn<TrainerActor>(o));
  }
  const bool use_loaders = cfg.use_loaders && cfg.trainer.validation_fraction == 0;
  if (use_loaders) {
    actors::LoaderConfig lc;
    lc.dataset = cfg.trainer.data;
    lc.batch_size = cfg.trainer.batch_size;
    lc.shuffle = cfg.trainer.shuffle;
    lc.seed = cfg.trainer.seed;
    lc.threads = static_cast<int32_t>(cfg.loader_threads);
    lc.credits = 4;
    for (int64_t r = 0; r < world; ++r) {
      ActorOptions o;
      o.placement_group = &*impl.pg;
      o.bundle_index = static_cast<int>(r);
      o.executable = cfg.executable;
      impl.loaders.push_back(rt_.spawn<actors::DataLoaderActor>(o, lc));
    }
  }
  std::vector<Future<TrainerInfo>> setups;
  for (auto& t : impl.trainers) setups.push_back(t.call(&TrainerActor::setup, cfg.trainer));
  auto infos = get_all(setups, cfg.call_timeout);
  std::vector<uint64_t> members;
  for (auto& t : impl.trainers) members.push_back(t.id());
  std::string group_name = cfg.name + "-" + std::to_string(::getpid()) + "-" + std::to_string(impl.pg->id());
  std::vector<Future<void>> joins;
  for (int64_t r = 0; r < world; ++r)
    joins.push_back(impl.trainers[r].call(&TrainerActor::join, JoinSpec{group_name, 1, r, world, members}));
  get_all(joins, cfg.call_timeout);
  event("started", std::to_string(world) + " trainers, " + infos[0].model + ", " +
                       std::to_string(infos[0].parameters) + " parameters on " + infos[0].device);
  if (cfg.verbose)
    std::printf("[%s] %lld trainer(s) (%s, %lld parameters, %s), %lld samples\n", cfg.name.c_str(),
                static_cast<long long>(world), infos[0].model.c_str(), static_cast<long long>(infos[0].parameters),
                infos[0].device.c_str(), static_cast<long long>(dataset_size));

  int64_t step = 0;
  actors::SamplerCursor cursor = sampler.begin_epoch(0);
  if (resume) {
    std::vector<Future<void>> loads;
    for (auto& t : impl.trainers) loads.push_back(t.call(&TrainerActor::load_state, *resume));
    get_all(loads, cfg.call_timeout);
    step = resume->step;
    cursor = sampler.resize(resume->cursor, world);
    if (sampler.epoch_done(cursor)) cursor = sampler.begin_epoch(cursor.epoch + 1);
  }

  std::unique_ptr<std::ofstream> metrics;
  if (!cfg.metrics_path.empty()) {
    auto parent = std::filesystem::path(cfg.metrics_path).parent_path();
    std::error_code ec;
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    metrics = std::make_unique<std::ofstream>(cfg.metrics_path, std::ios::app);
    if (!*metrics) throw ConfigError("cannot open metrics file " + cfg.metrics_path);
  }
  auto write_metrics = [&](const nlohmann::json& j) {
    if (metrics) *metrics << j.dump() << "\n" << std::flush;
  };

  std::unique_ptr<CheckpointWriter> writer;
  if (!cfg.checkpoint.dir.empty()) writer = std::make_unique<CheckpointWriter>(cfg.checkpoint.dir, cfg.checkpoint.keep);
  int64_t last_checkpoint_step = -1;
  auto checkpoint = [&](const std::map<std::string, double>& m) {
    if (!writer || last_checkpoint_step == step) return;
    auto state = impl.trainers[0].call(&TrainerActor::state).get(cfg.call_timeout);
    state.world_size = world;
    state.cursor = cursor;
    state.epoch = cursor.epoch;
    writer->submit(std::move(state), m);
    if (!cfg.checkpoint.async) writer->wait();
    last_checkpoint_step = step;
    event("checkpoint", "step " + std::to_string(step));
  };

  const int64_t per_step = cfg.trainer.batch_size * cfg.trainer.accumulation;
  bool tty = ::isatty(1);
  bool stop = false;
  for (int64_t epoch = cursor.epoch; epoch < cfg.epochs && !stop; ++epoch) {
    if (cursor.epoch != epoch) cursor = sampler.begin_epoch(epoch);
    auto e0 = Clock::now();
    const int64_t epoch_steps = sampler.remaining_per_rank(cursor) / per_step;
    double loss_sum = 0, busy = 0;
    int64_t correct = 0, samples = 0, done = 0;
    while (!sampler.epoch_done(cursor)) {
      int64_t chunk = std::max<int64_t>(1, epoch_steps - done);
      if (cfg.checkpoint.every_steps > 0 && writer)
        chunk = std::min(chunk, cfg.checkpoint.every_steps - step % cfg.checkpoint.every_steps);
      if (cfg.progress_every_steps > 0) chunk = std::min(chunk, cfg.progress_every_steps);
      if (cfg.max_steps > 0) chunk = std::min(chunk, cfg.max_steps - step);
      if (chunk <= 0) {
        stop = true;
        break;
      }
      std::vector<Future<TrainReport>> fs;
      std::vector<Future<int64_t>> feeds;
      const int64_t steps_now = std::min(chunk, sampler.remaining_per_rank(cursor) / per_step);
      if (use_loaders && steps_now > 0) {
        // A fresh stream per call: the loader closes it after the batches
        // of `chunk` steps (fewer at the epoch's end).
        std::vector<Future<StreamRef>> refs;
        for (auto& t : impl.trainers) refs.push_back(t.call(&TrainerActor::open_stream, int64_t{4}));
        auto rs = get_all(refs, cfg.call_timeout);
        for (int64_t r = 0; r < world; ++r)
          feeds.push_back(impl.loaders[r].call(&actors::DataLoaderActor::feed, rs[r], cursor, static_cast<int32_t>(r),
                                               steps_now * cfg.trainer.accumulation));
      }
      for (auto& t : impl.trainers)
        fs.push_back(t.call(&TrainerActor::train, TrainRequest{cursor, chunk, use_loaders && steps_now > 0}));
      auto reps = get_all(fs, cfg.call_timeout);
      if (use_loaders) get_all(feeds, cfg.call_timeout);
      cursor = reps[0].cursor;
      double chunk_seconds = 0;
      for (const auto& r : reps) chunk_seconds = std::max(chunk_seconds, r.seconds);
      busy += chunk_seconds;
      for (size_t s = 0; s < reps[0].step_loss_sum.size(); ++s) {
        double l = 0;
        int64_t c = 0, n = 0;
        for (const auto& r : reps) {
          l += r.step_loss_sum[s];
          c += r.step_correct[s];
          n += r.step_samples[s];
        }
        int64_t st = reps[0].global_step - static_cast<int64_t>(reps[0].step_loss_sum.size()) + static_cast<int64_t>(s) + 1;
        write_metrics({{"kind", "step"}, {"job", cfg.name}, {"epoch", epoch}, {"step", st}, {"loss", l / n},
                       {"accuracy", double(c) / n}, {"samples", n}});
      }
      for (const auto& r : reps) {
        loss_sum += r.loss_sum;
        correct += r.correct;
        samples += r.samples;
      }
      step = reps[0].global_step;
      done += reps[0].steps;
      if (cfg.verbose && tty && samples > 0)
        std::printf("\r[%s] epoch %lld/%lld  step %lld/%lld  loss %.4f  acc %.3f  %.0f samples/s   ", cfg.name.c_str(),
                    static_cast<long long>(epoch + 1), static_cast<long long>(cfg.epochs),
                    static_cast<long long>(done), static_cast<long long>(epoch_steps), loss_sum / samples,
                    double(correct) / samples, samples / std::max(busy, 1e-9));
      if (cfg.verbose && tty) std::fflush(stdout);
      if (cfg.checkpoint.every_steps > 0 && step % cfg.checkpoint.every_steps == 0)
        checkpoint({{"train_loss", samples ? loss_sum / samples : 0.0}});
      if (cfg.max_steps > 0 && step >= cfg.max_steps) stop = true;
      if (reps[0].steps == 0 || stop) break;
    }
    EpochMetrics em;
    em.epoch = epoch;
    em.steps = step;
    em.train_loss = samples ? loss_sum / samples : 0;
    em.train_accuracy = samples ? double(correct) / samples : 0;
    em.samples_per_second = busy > 0 ? samples / busy : 0;
    if (cfg.evaluate) {
      std::vector<Future<EvalReport>> fs;
      for (int64_t r = 0; r < world; ++r) fs.push_back(impl.trainers[r].call(&TrainerActor::evaluate, r, world));
      for (const auto& e : get_all(fs, cfg.call_timeout)) {
        em.val_loss += e.loss_sum;
        em.val_accuracy += static_cast<double>(e.correct);
        em.val_count += e.count;
      }
      if (em.val_count) {
        em.val_loss /= em.val_count;
        em.val_accuracy /= em.val_count;
      }
    }
    em.seconds = std::chrono::duration<double>(Clock::now() - e0).count();
    result.history.push_back(em);
    write_metrics({{"kind", "epoch"}, {"job", cfg.name}, {"epoch", epoch}, {"step", step}, {"workers", world},
                   {"train_loss", em.train_loss}, {"train_accuracy", em.train_accuracy},
                   {"samples_per_second", em.samples_per_second}, {"val_loss", em.val_loss},
                   {"val_accuracy", em.val_accuracy}, {"val_count", em.val_count}, {"seconds", em.seconds}});
    if (cfg.verbose) {
      char val[96] = "";
      if (cfg.evaluate) std::snprintf(val, sizeof val, "  val_loss %.4f  val_acc %.3f", em.val_loss, em.val_accuracy);
      std::printf("%s[%s] epoch %lld/%lld  step %lld  loss %.4f  acc %.3f%s  %.0f samples/s  %.2fs\n",
                  tty ? "\r" : "", cfg.name.c_str(), static_cast<long long>(epoch + 1),
                  static_cast<long long>(cfg.epochs), static_cast<long long>(step), em.train_loss, em.train_accuracy,
                  val, em.samples_per_second, em.seconds);
      std::fflush(stdout);
    }
    event("epoch", "epoch " + std::to_string(epoch) + " done at step " + std::to_string(step));
    if (cfg.checkpoint.at_epoch_end && sampler.epoch_done(cursor))
      checkpoint({{"train_loss", em.train_loss}, {"train_accuracy", em.train_accuracy}, {"val_loss", em.val_loss},
                  {"val_accuracy", em.val_accuracy}});
  }
  if (writer) {
    writer->wait();
    result.last_checkpoint = writer->last();
  }
  result.final_state = impl.trainers[0].call(&TrainerActor::state).get(cfg.call_timeout);
  result.final_state.world_size = world;
  result.final_state.cursor = cursor;
  result.steps = step;
  event("finished", "step " + std::to_string(step));
  return result;
}

}  // namespace troupe::trainer
