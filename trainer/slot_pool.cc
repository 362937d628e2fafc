#include "troupe/trainer/slot_pool.h"

#include <algorithm>
#include <sstream>

#include "troupe/runtime/core/errors.h"

namespace troupe::trainer {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

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

SlotPool::SlotPool(Runtime& rt, const TrainJobConfig& cfg, bool use_loaders, std::string name)
    : rt_(rt), cfg_(cfg), use_loaders_(use_loaders), name_(std::move(name)) {}

SlotPool::~SlotPool() {
  for (auto& s : standby_) release(s);
}

// From the head's typed node query; nothing else in the trainer looks at
// the cluster's resources.
std::vector<wire::NodeInfo> SlotPool::live_nodes() {
  std::vector<wire::NodeInfo> out;
  for (auto& n : rt_.nodes())
    if (n.alive) out.push_back(std::move(n));
  return out;
}

void SlotPool::check_can_place(int64_t n) {
  std::map<std::string, double> total;
  for (const auto& node : live_nodes())
    for (const auto& [k, v] : node.total) total[k] += v;
  for (const auto& [k, v] : cfg_.scaling.resources_per_worker) {
    double need = v * static_cast<double>(n);
    if (need > total[k] + 1e-9) {
      std::ostringstream s;
      s << "cannot place " << n << (n == 1 ? " worker × " : " workers × ")
        << format_resources(cfg_.scaling.resources_per_worker) << ": they need " << k << " " << need
        << ", the cluster has " << k << " " << total[k] << " in all (the placement group would stay PENDING)";
      throw ConfigError(s.str());
    }
  }
}

int64_t SlotPool::room_to_grow(int64_t limit) {
  // Counted from the live nodes' free resources, so a job at its limit
  // costs one status call, not a placement attempt.
  int64_t room = 0;
  for (const auto& n : live_nodes()) {
    int64_t fit = limit;
    for (const auto& [k, v] : cfg_.scaling.resources_per_worker) {
      if (v <= 0) continue;
      auto it = n.available.find(k);
      const double have = it == n.available.end() ? 0.0 : it->second;
      fit = std::min<int64_t>(fit, static_cast<int64_t>(have / v + 1e-9));
    }
    room += fit;
  }
  return std::min(room, limit);
}

void SlotPool::kill_actors(Slot& s) {
  for (uint64_t id : {s.loader.valid() ? s.loader.id() : 0, s.trainer.valid() ? s.trainer.id() : 0}) {
    if (!id) continue;
    try {
      rt_.kill_actor(id, true);
    } catch (...) {
    }
  }
  s.trainer = TrainerHandle();
  s.loader = LoaderHandle();
}

void SlotPool::release(Slot& s) {
  kill_actors(s);
  if (s.pg) {
    try {
      rt_.remove_placement_group(*s.pg);
    } catch (...) {
    }
    s.pg.reset();
  }
}

std::vector<Slot> SlotPool::respawn(std::vector<Slot> dead, std::chrono::milliseconds timeout) {
  // The new trainer waits in the bundle until the old one's exit gives its
  // share back; queued work outside the group cannot take it.
  for (auto& s : dead) {
    kill_actors(s);
    s.ready = false;
    s.has_state = false;
    s.setting_up.reset();
  }
  const auto deadline = Clock::now() + timeout;
  std::vector<Slot> out;
  size_t i = 0;
  try {
    for (; i < dead.size(); ++i) {
      Slot& s = dead[i];
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (s.pg && wait_or_stop([&](std::chrono::milliseconds d) { return s.pg->wait(d); },
                               std::max(left, std::chrono::milliseconds(1)), cfg_.stop_requested,
                               "a replacement's placement")) {
        spawn_actors(s);
        out.push_back(std::move(s));
        continue;
      }
      if (s.pg) pending_reason_ = s.pg->info().pending_reason;
      release(s);
    }
  } catch (...) {
    // Nothing half-made stays behind.
    for (auto& s : out) release(s);
    for (; i < dead.size(); ++i) release(dead[i]);
    throw;
  }
  return out;
}

ActorOptions SlotPool::slot_options(const Slot& s) const {
  ActorOptions o;
  o.placement_group = &*s.pg;
  o.bundle_index = 0;
  o.executable = cfg_.executable;
  return o;
}

void SlotPool::spawn_loader(Slot& s) {
  actors::LoaderConfig lc;
  lc.dataset = cfg_.trainer.data;
  lc.shipped_files = cfg_.trainer.shipped_files;
  lc.batch_size = cfg_.trainer.batch_size;
  lc.shuffle = cfg_.trainer.shuffle;
  lc.seed = cfg_.trainer.seed;
  lc.threads = static_cast<int32_t>(cfg_.loader_threads);
  lc.look_ahead = static_cast<int32_t>(cfg_.loader_look_ahead);
  lc.step_batches = cfg_.trainer.accumulation;
  lc.epochs = cfg_.epochs;
  lc.credits = 4;
  s.loader = rt_.spawn<actors::DataLoaderActor>(slot_options(s), lc);
}

void SlotPool::spawn_actors(Slot& s) {
  ActorOptions o = slot_options(s);
  o.resources = cfg_.scaling.resources_per_worker;
  s.trainer = rt_.spawn<TrainerActor>(o);
  if (use_loaders_) spawn_loader(s);
}

std::vector<Slot> SlotPool::place(int64_t n, std::chrono::milliseconds timeout) {
  std::vector<Slot> out;
  std::vector<PlacementGroup> pgs;
  for (int64_t i = 0; i < n; ++i)
    pgs.push_back(rt_.create_placement_group({cfg_.scaling.resources_per_worker}, cfg_.scaling.strategy,
                                             name_ + "-pg" + std::to_string(pg_count_++)));
  const auto deadline = Clock::now() + timeout;
  size_t i = 0;
  try {
    for (; i < pgs.size(); ++i) {
      auto& pg = pgs[i];
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (wait_or_stop([&](std::chrono::milliseconds d) { return pg.wait(d); },
                       std::max(left, std::chrono::milliseconds(1)), cfg_.stop_requested, "the placement")) {
        // The slot holds the group (and what is spawned) from here on, so
        // release() below finds it all if a spawn fails.
        Slot& s = out.emplace_back();
        s.pg = pg;
        spawn_actors(s);
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

int64_t SlotPool::refill_standby() {
  const auto want = cfg_.failure.standby_workers - static_cast<int64_t>(standby_.size());
  if (want <= 0) return 0;
  auto t = Clock::now();
  if (t - last_standby_check_ < cfg_.scaling.grow_interval) return 0;
  last_standby_check_ = t;
  const auto reason = pending_reason_;
  auto more = place(want, std::chrono::milliseconds(50));
  pending_reason_ = reason;  // a full cluster is no news for standbys
  for (auto& s : more) {
    s.setting_up = s.trainer.call(&TrainerActor::setup, cfg_.trainer);
    standby_.push_back(std::move(s));
  }
  return static_cast<int64_t>(more.size());
}

std::vector<Slot> SlotPool::take_standby(size_t n, Clock::time_point deadline) {
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
    } catch (const Timeout&) {
      // Still setting up (a large model, a GPU's start): it is further
      // along than a slot placed now would be, so it stands in all the
      // same, and Gang::setup_new waits for its setup() to answer.
      alive = s.setting_up && !s.setting_up->ready();
    } catch (...) {
      alive = false;
    }
    if (!alive) {
      release(s);
      continue;
    }
    if (s.setting_up && s.setting_up->ready()) s.setting_up.reset();
    s.ready = !s.setting_up;
    s.has_state = false;
    out.push_back(std::move(s));
  }
  standby_ = std::move(keep);
  return out;
}

}  // namespace troupe::trainer
