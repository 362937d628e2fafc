// bench/run soak — does a long-running cluster stay flat, and how much
// training survives a trainer SIGKILLed every 30 s?
//
// Cycles: --cycles spawn → call → kill actor cycles (and --tasks task
// cycles spread among them) against one LocalCluster of 2 node agents, run
// by troupe_bench_soak_worker (soak_echo.h),
// after a warm-up of 5% of the cycles (at least 50). Every cycle's call is
// answered or fails with a documented troupe error (counted; anything else
// ends the run). The head's and the agents' resident memory
// (/proc/PID/status VmRSS) and open descriptors (/proc/PID/fd) are read
// after the warm-up and at the end:
//   head_rss_growth, head_fd_growth    (end - start) / start
//   agent_rss_growth, agent_fd_growth  the same, the larger of the agents
//   soak_cycles_per_s                  actor and task cycles together
//   soak_failed_cycles                 cycles whose call failed (documented)
//   soak_fd_growth, soak_rss_growth_mib  the driver's own, end - start
// Training (built with LibTorch): the same data-parallel job (2 trainers,
// an MLP on synthetic data) for as many steps as --train-seconds of a
// failure-free run take, run without failures and then with a trainer
// SIGKILLed every --kill-every seconds (max_failures unlimited: each heals
// from its live peer), on the same cluster:
//   goodput  steps/s with the kills ÷ steps/s without (same steps)
//   soak_kills, soak_lost_steps
//
//   troupe_bench_soak [--cycles 10000] [--tasks 20000] [--train-seconds 600]
//                     [--kill-every 30] [--no-train]
#include <signal.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/json_row.h"
#include "bench/soak_echo.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/testing/local_cluster.h"
#ifdef TROUPE_SOAK_TRAINING
#include "troupe/trainer/train_job.h"
#endif

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;
constexpr auto kTimeout = 120s;

namespace {

// The cycles' worker binary, beside this one (soak_echo.h says why).
const std::string& cycle_worker() {
  static const std::string path = [] {
    auto p = std::filesystem::read_symlink("/proc/self/exe").parent_path() / "troupe_bench_soak_worker";
    if (!std::filesystem::exists(p)) throw std::runtime_error("the soak's worker binary is missing: " + p.string());
    return p.string();
  }();
  return path;
}

struct Args {
  int cycles = 10000;
  int tasks = 20000;
  double train_seconds = 600;
  double kill_every = 30;
  bool train = true;
};

struct Usage {
  double rss_kib = 0;
  double fds = 0;
};

// /proc/PID/status VmRSS and the entries of /proc/PID/fd.
Usage usage_of(const std::string& pid) {
  Usage u;
  std::ifstream status("/proc/" + pid + "/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmRSS:", 0) == 0) u.rss_kib = std::stod(line.substr(6));
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator("/proc/" + pid + "/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec))
    ++u.fds;
  return u;
}
Usage usage_of(pid_t pid) { return usage_of(std::to_string(pid)); }

// At the start and the end alike: the fewest descriptors of 20 readings
// 50 ms apart, so that a connection closing or a pooled worker being
// started at the moment of one reading is not taken for growth.
Usage settled_usage(const std::string& pid) {
  Usage u = usage_of(pid);
  for (int i = 1; i < 20; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    u.fds = std::min(u.fds, usage_of(pid).fds);
  }
  return u;
}
Usage settled_usage(pid_t pid) { return settled_usage(std::to_string(pid)); }

double growth(double start, double end) { return start > 0 ? (end - start) / start : 0; }

void print(nlohmann::ordered_json base, const std::string& c, double v, const std::string& unit,
           nlohmann::ordered_json extra = {}) {
  base["case"] = c;
  base["value"] = v;
  base["unit"] = unit;
  for (auto& [k, x] : extra.items()) base[k] = x;
  troupe::bench::print_row(base);
}

// One actor cycle: spawn, one call, kill (no restart). False when the call
// failed with a documented error (the actor or its worker died, a timeout).
bool actor_cycle(troupe::Runtime& rt, int i) {
  try {
    auto a = rt.spawn<Echo>({.resources = {{"CPU", 1}}, .executable = cycle_worker()});
    if (a.call(&Echo::echo, i).get(kTimeout) != i) throw std::runtime_error("actor echoed a wrong value");
    rt.kill(a);
    return true;
  } catch (const troupe::ActorDied&) {
    return false;
  } catch (const troupe::Timeout&) {
    return false;
  }
}

void cycles_phase(troupe::testing::LocalCluster& cluster, troupe::Runtime& rt, const Args& a, size_t agents) {
  const int warm = std::max(50, a.cycles / 20);
  const int tasks_per_cycle = a.cycles > 0 ? a.tasks / a.cycles : 0;
  int failed = 0;
  // One cycle: an actor, then its share of the tasks. The warm-up runs the
  // same cycles, so that the start is read in the state the end is (the
  // task worker connected, the pools as they run).
  auto cycle = [&](int i) {
    if (!actor_cycle(rt, i)) ++failed;
    for (int k = 0; k < tasks_per_cycle; ++k)
      if (rt.submit(&twice, {.executable = cycle_worker()}, k).get(kTimeout) != 2 * k)
        throw std::runtime_error("task returned a wrong value");
  };
  for (int i = 0; i < warm; ++i) cycle(i);
  failed = 0;
  auto head0 = settled_usage(cluster.head_pid());
  std::vector<Usage> agent0;
  for (size_t n = 0; n < agents; ++n) agent0.push_back(settled_usage(cluster.node_pid(n)));
  auto self0 = settled_usage("self");
  auto t0 = Clock::now();
  for (int i = 0; i < a.cycles; ++i) {
    cycle(i);
    if ((i + 1) % 1000 == 0) {
      auto h = usage_of(cluster.head_pid());
      std::string nodes;
      for (size_t n = 0; n < agents; ++n) {
        auto u = usage_of(cluster.node_pid(n));
        nodes += ", agent " + std::to_string(n) + " " + std::to_string(static_cast<int>(u.rss_kib / 1024)) + " MiB " +
                 std::to_string(static_cast<int>(u.fds)) + " fds";
      }
      std::fprintf(stderr, "soak: %d/%d cycles, head %.1f MiB %.0f fds, driver %.1f MiB %.0f fds%s\n", i + 1, a.cycles,
                   h.rss_kib / 1024, h.fds, usage_of("self").rss_kib / 1024, usage_of("self").fds, nodes.c_str());
    }
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  auto head1 = settled_usage(cluster.head_pid());
  // The agent that grew most, with its own start and end.
  double agent_rss = -1e9, agent_fds = -1e9;
  nlohmann::ordered_json agent_rss_at, agent_fds_at;
  for (size_t n = 0; n < agents; ++n) {
    auto u = settled_usage(cluster.node_pid(n));
    if (double g = growth(agent0[n].rss_kib, u.rss_kib); g > agent_rss) {
      agent_rss = g;
      agent_rss_at = {{"agent", n}, {"start_kib", agent0[n].rss_kib}, {"end_kib", u.rss_kib}};
    }
    if (double g = growth(agent0[n].fds, u.fds); g > agent_fds) {
      agent_fds = g;
      agent_fds_at = {{"agent", n}, {"start", agent0[n].fds}, {"end", u.fds}};
    }
  }
  auto self1 = settled_usage("self");
  nlohmann::ordered_json base = {{"bench", "soak"}, {"cycles", a.cycles}, {"tasks", tasks_per_cycle * a.cycles}};
  print(base, "head_rss_growth", growth(head0.rss_kib, head1.rss_kib), "fraction",
        {{"start_kib", head0.rss_kib}, {"end_kib", head1.rss_kib}});
  print(base, "head_fd_growth", growth(head0.fds, head1.fds), "fraction", {{"start", head0.fds}, {"end", head1.fds}});
  print(base, "agent_rss_growth", agent_rss, "fraction", agent_rss_at);
  print(base, "agent_fd_growth", agent_fds, "fraction", agent_fds_at);
  print(base, "soak_cycles_per_s", (a.cycles + tasks_per_cycle * a.cycles) / secs, "cycles/s");
  print(base, "soak_failed_cycles", failed, "cycles");
  print(base, "soak_fd_growth", self1.fds - self0.fds, "fds");
  print(base, "soak_rss_growth_mib", (self1.rss_kib - self0.rss_kib) / 1024, "MiB");
}

#ifdef TROUPE_SOAK_TRAINING
troupe::trainer::TrainJobConfig soak_job(int64_t max_steps) {
  troupe::trainer::TrainJobConfig c;
  c.name = "soak";
  c.scaling.num_workers = 2;
  c.trainer.model.name = "mlp";
  c.trainer.model.input_dim = 64;
  c.trainer.model.hidden = 256;
  c.trainer.model.num_classes = 10;
  c.trainer.data = troupe::actors::DatasetSpec("synthetic_classification")
                       .set("size", 1 << 16)
                       .set("num_features", 64)
                       .set("num_classes", 10);
  c.trainer.batch_size = 64;
  c.trainer.optimizer.name = "sgd";
  c.trainer.optimizer.lr = 0.01;
  c.trainer.seed = 1;
  c.epochs = 1000000;
  c.max_steps = max_steps;
  c.evaluate = false;
  c.verbose = false;
  c.failure.max_failures = -1;
  return c;
}

// The live trainers' pids, from the head's status.
std::vector<int> trainer_pids(troupe::Runtime& rt) {
  std::vector<int> pids;
  auto status = nlohmann::json::parse(rt.status_json());
  for (const auto& actor : status["actors"])
    if (actor["class"] == "troupe::trainer::TrainerActor" && actor["state"] == "ALIVE")
      pids.push_back(actor["pid"].get<int>());
  return pids;
}

void training_phase(troupe::Runtime& rt, const Args& a) {
  // Calibration: the failure-free rate between steps 500 and 2,500 (the
  // first steps are slower: the job would end well short of
  // --train-seconds if they set the rate).
  double t_from = 0, t_to = 0;
  auto calib = soak_job(2500);
  calib.progress_every_steps = 100;
  calib.on_step = [&](const troupe::trainer::StepInfo& s) {
    if (s.step == 500) t_from = s.time;
    if (s.step == 2500) t_to = s.time;
  };
  troupe::trainer::TrainJob(rt, calib).fit();
  const double rate = (t_to > t_from) ? 2000 / (t_to - t_from) : 10;
  const int64_t steps = std::max<int64_t>(100, static_cast<int64_t>(rate * a.train_seconds));
  std::fprintf(stderr, "soak: training %lld steps (%.0f steps/s failure-free)\n", static_cast<long long>(steps), rate);

  auto t0 = Clock::now();
  auto clean = troupe::trainer::TrainJob(rt, soak_job(steps)).fit();
  const double clean_s = std::chrono::duration<double>(Clock::now() - t0).count();

  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::atomic<int> kills{0};
  std::thread killer([&] {
    std::unique_lock lock(mu);
    while (!cv.wait_for(lock, std::chrono::duration<double>(a.kill_every), [&] { return done; })) {
      lock.unlock();
      auto pids = trainer_pids(rt);
      const int victim = pids.empty() ? 0 : pids[kills % pids.size()];
      if (victim > 0 && ::kill(victim, SIGKILL) == 0)
        std::fprintf(stderr, "soak: SIGKILL %d to trainer pid %d\n", ++kills, victim);
      lock.lock();
    }
  });
  t0 = Clock::now();
  troupe::trainer::Result hurt;
  try {
    hurt = troupe::trainer::TrainJob(rt, soak_job(steps)).fit();
  } catch (...) {
    {
      std::lock_guard lock(mu);
      done = true;
    }
    cv.notify_all();
    killer.join();
    throw;
  }
  const double hurt_s = std::chrono::duration<double>(Clock::now() - t0).count();
  {
    std::lock_guard lock(mu);
    done = true;
  }
  cv.notify_all();
  killer.join();
  int64_t lost = 0;
  for (const auto& r : hurt.recoveries) lost += r.lost_steps;
  nlohmann::ordered_json base = {{"bench", "soak"}, {"steps", steps}, {"kill_every_s", a.kill_every}};
  print(base, "goodput", clean_s / hurt_s, "fraction",
        {{"ratio", clean_s / hurt_s},
         {"clean_s", clean_s},
         {"with_kills_s", hurt_s},
         {"clean_steps", clean.steps},
         {"steps_with_kills", hurt.steps}});
  print(base, "soak_kills", kills.load(), "kills", {{"recoveries", hurt.recoveries.size()}});
  print(base, "soak_lost_steps", static_cast<double>(lost), "steps");
}
#endif

int run(const Args& a) {
  troupe::testing::LocalClusterOptions o;
  o.nodes = {{{"CPU", 2}}, {{"CPU", 2}}};
  troupe::testing::LocalCluster cluster(o);
  troupe::Runtime rt = cluster.connect();
  cycles_phase(cluster, rt, a, o.nodes.size());
  if (a.train) {
#ifdef TROUPE_SOAK_TRAINING
    training_phase(rt, a);
#else
    troupe::bench::print_error_row("soak", "goodput", "this build has no LibTorch (TROUPE_WITH_TORCH=OFF)");
#endif
  }
  rt.shutdown();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  troupe::run_role_if_requested(argc, argv);
  troupe::core::init_logging("bench");
  spdlog::set_level(spdlog::level::warn);
  Args a;
  CLI::App app{"soak: a cluster's head and agents through many actor cycles, and training goodput under kills"};
  app.add_option("--cycles", a.cycles, "actor cycles (spawn, call, kill)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--tasks", a.tasks, "task cycles (submit + get) spread among them")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--train-seconds", a.train_seconds, "length of the failure-free training run")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--kill-every", a.kill_every, "seconds between trainer SIGKILLs")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_flag(
      "--no-train", [&](int64_t) { a.train = false; }, "only the cycles");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(a);
  } catch (const std::exception& e) {
    troupe::bench::print_error_row("soak", "run", e.what());
    return 1;
  }
}
