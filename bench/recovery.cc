// Recovery benchmark: a 2-worker CPU TrainJob on a LocalCluster with room
// for a replacement; a trainer's process is SIGKILLed in the middle of the
// run. Measured, as JSON lines (median of --trials runs, each trial listed):
//   recovery_s       seconds from the SIGKILL to the next completed step,
//                    healing the replacement from a live peer;
//   lost_steps       completed steps that had to be done again;
//   recovery_s_disk, lost_steps_disk
//                    the same when every failure goes back to the last
//                    checkpoint (RecoveryMode::kCheckpoint, every
//                    --ckpt-every steps), measured in the same run: troupe's
//                    own checkpoint mode, with warm worker pools, so the
//                    steps lost are what a restart-from-disk runtime
//                    (torchrun, Ray Train) loses, but not its restart time
//                    (bench/run py_train --case torchrun_restart measures
//                    torchrun's);
//   recovery_s_standby, lost_steps_standby
//                    healing a standby trainer (failure.standby_workers =
//                    1: started and set up ahead, no process start).
//
// Each trial starts once every node's warm pool is full again, and the
// kill waits until the pool has refilled after the job's own four spawns
// (the steady state of a cluster that has been up a while): otherwise the
// replacement races those refills, processes loading LibTorch on the same
// cores, and the trial measures that instead. A trial that found the pool
// not refilled within 60 s says so ("pool_full": false).
//
//   bench/run recovery [--trials 3] [--kill-step 23] [--ckpt-every 10]
#include <signal.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/json_row.h"
#include "troupe/runtime/core/files.h"
#include "troupe/runtime/testing/fault_injector.h"
#include "troupe/runtime/testing/local_cluster.h"
#include "troupe/trainer/train_job.h"

using namespace std::chrono_literals;
using namespace troupe;
using namespace troupe::trainer;
using Clock = std::chrono::steady_clock;

namespace {

struct Trial {
  double recovery_s = 0;
  int64_t lost_steps = 0;
  double heal_s = 0;      // failure seen -> training resumed, inside the driver
  bool pool_full = true;  // the pool had refilled after the job's own spawns
};

enum class Mode { kHeal, kDisk, kStandby };

// Waits (bounded) until every live node has `size` idle pooled workers.
bool wait_pool_full(Runtime& rt, uint32_t size, std::chrono::seconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    bool full = true;
    for (const auto& n : rt.nodes())
      if (n.alive && n.idle_workers < size) full = false;
    if (full) return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

Trial run_trial(troupe::testing::LocalCluster& cluster, Mode mode, int64_t kill_step, int64_t ckpt_every, int trial,
                uint32_t pool_size) {
  const bool disk = mode == Mode::kDisk;
  Runtime rt = cluster.connect();
  TrainJobConfig c;
  c.name = disk ? "recovery-disk" : mode == Mode::kStandby ? "recovery-standby" : "recovery";
  c.scaling.num_workers = 2;
  c.trainer.model.name = "mlp";
  c.trainer.model.input_dim = 64;
  c.trainer.model.hidden = 512;
  c.trainer.model.num_classes = 10;
  c.trainer.data = actors::DatasetSpec("synthetic_classification")
                       .set("size", 8192)
                       .set("num_features", 64)
                       .set("num_classes", 10)
                       .set("seed", 1);
  c.trainer.batch_size = 64;
  c.trainer.optimizer.name = "adamw";
  c.trainer.optimizer.lr = 1e-3;
  c.epochs = 1;
  c.max_steps = kill_step + 15;
  c.evaluate = false;
  c.verbose = false;
  c.progress_every_steps = 1;
  c.failure.max_failures = 1;
  auto dir = std::filesystem::temp_directory_path() /
             ("troupe-bench-recovery-" + std::to_string(::getpid()) + "-" + std::to_string(trial));
  troupe::core::remove_tree(dir);
  c.checkpoint.dir = dir.string();
  c.checkpoint.every_steps = ckpt_every;
  c.checkpoint.at_epoch_end = false;
  if (disk) c.failure.mode = RecoveryMode::kCheckpoint;
  if (mode == Mode::kStandby) c.failure.standby_workers = 1;

  troupe::testing::FaultInjector faults(rt);
  const uint64_t before = faults.last_actor_id();
  std::atomic<bool> killed{false};
  Clock::time_point kill_at, done_at;
  bool pool_full = true;
  // The job's clock (StepInfo::time, Recovery's times: seconds since its
  // fit() began) on this one: taken at a step's report, so at most that
  // report's delay late.
  std::optional<Clock::time_point> job_start;
  c.on_step = [&](const StepInfo& s) {
    if (!job_start)
      job_start = Clock::now() - std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s.time));
    if (killed && done_at == Clock::time_point{}) done_at = Clock::now();
    if (s.step == kill_step && !killed) {
      // The job's own spawns took the pooled workers; the kill waits until
      // the pool has refilled, as it would have in a job that has run for a
      // while (else the replacement waits for a worker still loading
      // LibTorch, and the trial measures the job's start, not a recovery).
      pool_full = wait_pool_full(rt, pool_size, std::chrono::seconds(60));
      auto trainers = faults.live_actors("troupe::trainer::TrainerActor", before);
      // Ranks 0 and 1 are the oldest; a standby (if any) comes after them.
      if (trainers.size() < 2) throw Error("expected 2 live trainers, found " + std::to_string(trainers.size()));
      uint64_t id = trainers[1].id;
      // Mid-step: the kill lands while the next round runs.
      faults.after(2ms, [&, id] {
        kill_at = Clock::now();
        faults.kill_actor(id);
        killed = true;
      });
    }
  };
  auto r = TrainJob(rt, c).fit();
  troupe::core::remove_tree(dir);
  if (std::getenv("TROUPE_BENCH_EVENTS"))  // the job's timeline, to see where recovery time goes
    for (const auto& e : r.events)
      std::fprintf(stderr, "  %8.3fs %-10s %s\n", e.time, to_string(e.kind), e.detail.c_str());
  if (r.recoveries.size() != 1) throw Error("expected one recovery, saw " + std::to_string(r.recoveries.size()));
  Trial t;
  // The step the job itself says completed after the failure: the first
  // on_step after the kill could be a step that finished before it (its
  // reply read just after), which read as a recovery of about 0 s.
  if (r.recoveries[0].step_done_at > 0 && job_start)
    done_at = *job_start +
              std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(r.recoveries[0].step_done_at));
  t.recovery_s = std::chrono::duration<double>(done_at - kill_at).count();
  t.lost_steps = r.recoveries[0].lost_steps;
  t.heal_s = r.recoveries[0].resumed_at - r.recoveries[0].failed_at;
  t.pool_full = pool_full;
  return t;
}

}  // namespace

using troupe::bench::median;

int main(int argc, char** argv) {
  run_role_if_requested(argc, argv);
  int trials = 3;
  int64_t kill_step = 23, ckpt_every = 10;
  CLI::App app{"recovery: a trainer SIGKILLed mid-step, healed from a peer vs from the last checkpoint"};
  app.add_option("--trials", trials, "runs per mode (the median is reported)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--kill-step", kill_step, "step at whose boundary the kill is armed")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--ckpt-every", ckpt_every, "checkpoint interval of the disk mode, in steps")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  uint32_t pool_size = 2;
  app.add_option("--worker-pool-size", pool_size, "idle workers each node agent keeps warm (0 = every spawn cold)")
      ->capture_default_str();
  std::string only;
  app.add_option("--mode", only, "run one mode only")->check(CLI::IsMember({"heal", "disk", "standby"}));
  CLI11_PARSE(app, argc, argv);
  try {
    // Two nodes of two CPUs: the two trainers, and room for a replacement
    // (or the standby).
    troupe::testing::LocalClusterOptions co{.nodes = {{{"CPU", 2}}, {{"CPU", 2}}}};
    co.worker_pool_size = pool_size;
    troupe::testing::LocalCluster cluster(co);
    for (Mode mode : {Mode::kHeal, Mode::kDisk, Mode::kStandby}) {
      const char* mode_name = mode == Mode::kHeal ? "heal" : mode == Mode::kDisk ? "disk" : "standby";
      if (!only.empty() && only != mode_name) continue;
      const bool disk = mode == Mode::kDisk;
      std::vector<double> rs, heal;
      std::vector<int64_t> lost;
      nlohmann::ordered_json each = nlohmann::ordered_json::array();
      for (int t = 0; t < trials; ++t) {
        bool pool_full = true;
        {
          Runtime rt = cluster.connect();
          pool_full = wait_pool_full(rt, pool_size, std::chrono::seconds(60));
        }
        auto tr = run_trial(cluster, mode, kill_step, ckpt_every, t, pool_size);
        rs.push_back(tr.recovery_s);
        lost.push_back(tr.lost_steps);
        heal.push_back(tr.heal_s);
        each.push_back({{"recovery_s", tr.recovery_s},
                        {"lost_steps", tr.lost_steps},
                        {"driver_recovery_s", tr.heal_s},
                        {"pool_full", pool_full && tr.pool_full}});
      }
      const std::string sfx = disk ? "_disk" : mode == Mode::kStandby ? "_standby" : "";
      nlohmann::ordered_json common = {
          {"bench", "recovery"}, {"workers", 2}, {"kill_step", kill_step}, {"trials", each}};
      if (disk) common["checkpoint_every"] = ckpt_every;
      auto a = common;
      a["case"] = "recovery_s" + sfx;
      a["value"] = median(rs);
      a["unit"] = "s";
      a["driver_recovery_s"] = median(heal);
      troupe::bench::print_row(a);
      auto b = common;
      b["case"] = "lost_steps" + sfx;
      b["value"] = median(lost);
      b["unit"] = "steps";
      troupe::bench::print_row(b);
    }
  } catch (const std::exception& e) {
    troupe::bench::print_error_row("recovery", "recovery_s", e.what());
    return 1;
  }
  return 0;
}
