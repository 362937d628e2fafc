// Head failover benchmark: a 2-worker CPU TrainJob on a LocalCluster whose
// head writes its tables through to SQLite; at --kill-step the head is
// SIGKILLed and at once started again (the restart command), while training
// goes on. Measured, as JSON lines (median of --trials runs, each listed):
//   head_recovery_s   seconds from the restart command to the first training
//                     step completed after the driver had the restarted head
//                     back (everything the job needs from the head works again);
//   head_recovery_from_kill_s  the same from the SIGKILL;
//   lost_steps        steps done again because of the head's death (the
//                     job's recoveries), which should be none;
//   steps_while_head_down      steps completed with no head at all;
//   same_weights      1 when the final weights are bitwise equal to the same
//                     job's without the kill, measured in the same run.
//
//   bench/run head_failover [--trials 3] [--kill-step 20] [--steps 600]
//
// --steps leaves room for the head to come back: training goes on while it
// is down, and a job that ended first measures nothing (with 60, since
// the job reporter stopped holding steps up, it did).
#include <signal.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/json_row.h"
#include "troupe/runtime/client/core.h"
#include "troupe/runtime/testing/local_cluster.h"
#include "troupe/trainer/train_job.h"

using namespace std::chrono_literals;
using namespace troupe;
using namespace troupe::trainer;
using Clock = std::chrono::steady_clock;

namespace {

TrainJobConfig job(int64_t steps) {
  TrainJobConfig c;
  c.name = "head-failover";
  c.scaling.num_workers = 2;
  c.trainer.model.name = "mlp";
  c.trainer.model.input_dim = 64;
  c.trainer.model.hidden = 512;
  c.trainer.model.num_classes = 10;
  c.trainer.data = actors::DatasetSpec("synthetic_classification")
                       .set("size", 16384)
                       .set("num_features", 64)
                       .set("num_classes", 10)
                       .set("seed", 1);
  c.trainer.batch_size = 64;
  c.trainer.seed = 5;
  c.trainer.optimizer.name = "adamw";
  c.trainer.optimizer.lr = 1e-3;
  c.epochs = 8;  // 128 steps an epoch: max_steps ends the job
  c.max_steps = steps;
  c.evaluate = false;
  c.verbose = false;
  c.progress_every_steps = 1;
  c.failure.max_failures = 2;
  return c;
}

bool same_weights(const TrainState& a, const TrainState& b) {
  if (a.model.size() != b.model.size()) return false;
  for (const auto& [name, t] : a.model) {
    auto it = b.model.find(name);
    if (it == b.model.end() || !torch::equal(t, it->second)) return false;
  }
  return true;
}

struct Trial {
  double recovery_s = 0, from_kill_s = 0;
  int64_t lost_steps = 0, steps_down = 0, steps = 0;
  bool same = false;
};

// The restart command, beside the training loop (as an operator's or a
// supervisor's would be), on a thread that lives as long as the cluster: a
// role process dies with the thread that started it (PR_SET_PDEATHSIG).
class Restarter {
 public:
  explicit Restarter(troupe::testing::LocalCluster& cluster) : cluster_(cluster), thread_([this] { loop(); }) {}
  ~Restarter() {
    {
      std::lock_guard lock(mu_);
      over_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void request() {
    {
      std::lock_guard lock(mu_);
      wanted_ = true;
      done_ = false;
    }
    cv_.notify_all();
  }
  void wait_done() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return done_ || !wanted_; });
    if (!error_.empty()) throw Error("restarting the head: " + error_);
  }
  Clock::time_point restart_at() {
    std::lock_guard lock(mu_);
    return restart_at_;
  }

 private:
  void loop() {
    std::unique_lock lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return over_ || (wanted_ && !done_); });
      if (over_) return;
      restart_at_ = Clock::now();
      lock.unlock();
      std::string error;
      try {
        cluster_.restart_head();
      } catch (const std::exception& e) {
        error = e.what();
      }
      lock.lock();
      error_ = error;
      done_ = true;
      wanted_ = false;
      cv_.notify_all();
    }
  }

  troupe::testing::LocalCluster& cluster_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool wanted_ = false, done_ = false, over_ = false;
  std::string error_;
  Clock::time_point restart_at_;
  std::thread thread_;
};

Trial run_trial(troupe::testing::LocalCluster& cluster, Restarter& restarter, int64_t kill_step, int64_t steps,
                const TrainState& clean) {
  Runtime rt = cluster.connect();
  auto c = job(steps);
  std::atomic<bool> killed{false};
  Clock::time_point kill_at, back_at;
  int64_t steps_down = 0;
  c.on_step = [&](const StepInfo& s) {
    if (killed && back_at == Clock::time_point{}) {
      if (rt.core()->head().is_open())
        back_at = Clock::now();
      else
        ++steps_down;
    }
    if (s.step == kill_step && !killed) {
      kill_at = Clock::now();
      cluster.kill_head(SIGKILL);
      killed = true;
      restarter.request();
    }
  };
  Result r = TrainJob(rt, c).fit();
  restarter.wait_done();
  if (back_at == Clock::time_point{}) throw Error("the driver never had the head back before the job ended");
  Trial t;
  t.recovery_s = std::chrono::duration<double>(back_at - restarter.restart_at()).count();
  t.from_kill_s = std::chrono::duration<double>(back_at - kill_at).count();
  for (const auto& rec : r.recoveries) t.lost_steps += rec.lost_steps;
  t.steps_down = steps_down;
  t.steps = r.steps;
  t.same = same_weights(clean, r.final_state);
  return t;
}

}  // namespace

using troupe::bench::median;

int main(int argc, char** argv) {
  run_role_if_requested(argc, argv);
  int trials = 3;
  int64_t kill_step = 20, steps = 600;
  CLI::App app{"head_failover: the head SIGKILLed mid-training and restarted; training goes on"};
  app.add_option("--trials", trials, "runs (the median is reported)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--kill-step", kill_step, "step after which the head is killed")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "steps of each job")->capture_default_str()->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  if (kill_step >= steps) {
    std::fprintf(stderr, "--kill-step %lld must be below --steps %lld\n", static_cast<long long>(kill_step),
                 static_cast<long long>(steps));
    return 2;
  }
  try {
    troupe::testing::LocalClusterOptions co{.nodes = {{{"CPU", 2}}}};
    co.durable_head = true;
    troupe::testing::LocalCluster cluster(co);
    Restarter restarter(cluster);
    TrainState clean;
    {
      Runtime rt = cluster.connect();
      clean = TrainJob(rt, job(steps)).fit().final_state;
    }
    std::vector<double> rs, from_kill;
    std::vector<int64_t> lost, down;
    bool all_same = true;
    nlohmann::ordered_json each = nlohmann::ordered_json::array();
    for (int i = 0; i < trials; ++i) {
      auto t = run_trial(cluster, restarter, kill_step, steps, clean);
      rs.push_back(t.recovery_s);
      from_kill.push_back(t.from_kill_s);
      lost.push_back(t.lost_steps);
      down.push_back(t.steps_down);
      all_same = all_same && t.same;
      each.push_back({{"head_recovery_s", t.recovery_s},
                      {"from_kill_s", t.from_kill_s},
                      {"lost_steps", t.lost_steps},
                      {"steps_while_head_down", t.steps_down},
                      {"steps", t.steps},
                      {"same_weights", t.same}});
    }
    nlohmann::ordered_json base = {
        {"bench", "head_failover"}, {"workers", 2}, {"kill_step", kill_step}, {"steps", steps}};
    auto row = [&](const char* name, double v, const char* unit, bool with_trials = false) {
      auto j = base;
      j["case"] = name;
      j["value"] = v;
      j["unit"] = unit;
      if (with_trials) j["trials"] = each;
      troupe::bench::print_row(j);
    };
    row("head_recovery_s", median(rs), "s", true);
    row("head_recovery_from_kill_s", median(from_kill), "s");
    row("lost_steps", static_cast<double>(*std::max_element(lost.begin(), lost.end())), "steps");
    row("steps_while_head_down", static_cast<double>(median(down)), "steps");
    row("same_weights", all_same ? 1 : 0, "bool");
  } catch (const std::exception& e) {
    troupe::bench::print_error_row("head_failover", "head_recovery_s", e.what());
    return 1;
  }
  return 0;
}
