// elastic_experiment: an elastic data-parallel job living through a node
// joining and a node dying. A local cluster of two one-CPU nodes runs a
// TrainJob with 2 workers (elastic range 1..3) on synthetic data; from the
// job's on_step hook, a third node is added at --grow-at seconds (the job
// grows to 3 workers at a later step boundary) and node --kill-node is
// SIGKILLed at --kill-at seconds (its trainer dies; with no spare node the
// job heals the survivors by broadcast and shrinks to 2).
//
// The run is sized by time: a short calibration job (the same model on 2
// workers: --warmup seconds untimed, then --calibrate seconds timed)
// measures this machine's steps per second, and the experiment trains for
// about --seconds after its first step; --grow-at and --kill-at count from
// that first step too, so placement and process start-up are left out. Writes
// timeline.csv (one row per step boundary) and events.csv (the job's events
// and the scenario's actions), prints the recoveries, and plots throughput
// and world size over time to elastic.png with /usr/bin/python3's
// matplotlib (plot.py next to this file). Nodes are named by their
// LocalCluster index: 0 and 1 from the start, 2 the one that joins.
//
//   ./elastic_experiment [--seconds 30] [--grow-at S] [--kill-at S] [--kill-node 0]
//                        [--warmup 1] [--calibrate 2] [--out elastic_experiment_out]
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "examples/common/cli_checks.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/testing/local_cluster.h"
#include "troupe/trainer/train_job.h"

#ifndef ELASTIC_PLOT_SCRIPT
#define ELASTIC_PLOT_SCRIPT "examples/elastic_experiment/plot.py"
#endif

namespace {

struct Args {
  double seconds = 30;  // training time after the first step
  double grow_at = -1;  // default seconds / 3
  double kill_at = -1;  // default 2 * seconds / 3
  size_t kill_node = 0;
  double warmup = 1;     // calibration: untimed seconds after its first step
  double calibrate = 2;  // calibration: timed seconds
  std::string out = "elastic_experiment_out";
};

constexpr int64_t kRoundSteps = 5;

// Thrown from the calibration job's on_step when it has measured enough:
// fit() passes it on as it is and releases the trainers.
struct Calibrated {};

struct Sample {
  double time = 0;
  int64_t step = 0;
  int64_t world_size = 0;
  double samples_per_s = 0;       // the round's samples over its train() seconds
  double wall_samples_per_s = 0;  // the round's samples over the time since the last boundary
};

// A row of events.csv: the job's events (kind spelled by to_string) and the
// scenario's own ("scenario").
struct EventRow {
  double time = 0;
  std::string kind;
  std::string detail;
  int64_t step = 0;
  int64_t world_size = 0;
};

// CSV fields are free text (a failure's cause): quote them.
std::string quoted(const std::string& s) {
  std::string q = "\"";
  for (char c : s) {
    if (c == '"') q += '"';
    q += c == '\n' ? ' ' : c;
  }
  return q + "\"";
}

// The experiment's job, before its scenario hook.
troupe::trainer::TrainJobConfig job_config() {
  troupe::trainer::TrainJobConfig cfg;
  cfg.name = "elastic";
  cfg.scaling.num_workers = 2;
  cfg.scaling.min_workers = 1;
  cfg.scaling.max_workers = 3;
  cfg.scaling.resources_per_worker = {{"CPU", 1}};
  cfg.scaling.grow_interval = std::chrono::milliseconds(250);
  cfg.failure.max_failures = 5;
  cfg.failure.replacement_timeout = std::chrono::milliseconds(500);
  cfg.trainer.model.name = "mlp";
  cfg.trainer.model.input_dim = 256;
  cfg.trainer.model.hidden = 1024;
  cfg.trainer.model.num_classes = 10;
  cfg.trainer.data = troupe::actors::DatasetSpec("synthetic_classification")
                         .set("size", 8192)
                         .set("num_features", 256)
                         .set("num_classes", 10)
                         .set("noise", 24.0)
                         .set("seed", 7);
  cfg.trainer.batch_size = 32;
  cfg.trainer.seed = 42;
  cfg.trainer.optimizer.lr = 0.002;
  cfg.trainer.threads = 1;
  cfg.epochs = 1000;  // bounded by max_steps
  cfg.progress_every_steps = kRoundSteps;
  cfg.evaluate = false;
  return cfg;
}

// Steps per second of the job on 2 workers on this machine, warm.
double steps_per_second(troupe::Runtime& rt, const Args& a) {
  auto cfg = job_config();
  cfg.name = "elastic-calibration";
  cfg.scaling.max_workers = 2;  // no growing
  cfg.verbose = false;
  double first = -1, window_start = -1, rate = 0;
  int64_t start_step = 0;
  cfg.on_step = [&](const troupe::trainer::StepInfo& s) {
    if (first < 0) first = s.time;
    if (window_start < 0) {
      if (s.time - first >= a.warmup) {
        window_start = s.time;
        start_step = s.step;
      }
      return;
    }
    if (s.time - window_start >= a.calibrate) {
      rate = (s.step - start_step) / (s.time - window_start);
      throw Calibrated{};
    }
  };
  try {
    troupe::trainer::TrainJob(rt, cfg).fit();
  } catch (const Calibrated&) {
  }
  if (rate <= 0) throw troupe::Error("calibration ended before its timed window");
  return rate;
}

}  // namespace

int main(int argc, char** argv) {
  troupe::run_role_if_requested(argc, argv);
  Args a;
  CLI::App app{"elastic_experiment: an elastic training job through a node joining and a node dying"};
  app.add_option("--seconds", a.seconds, "training seconds after the first step")
      ->capture_default_str()
      ->check(troupe::examples::kPositive)
      ->check(troupe::examples::kFinite);
  app.add_option("--grow-at", a.grow_at, "seconds after the first step to add a node (default: seconds / 3)")
      ->check(troupe::examples::kFinite);
  app.add_option("--kill-at", a.kill_at, "seconds after the first step to SIGKILL a node (default: 2 seconds / 3)")
      ->check(troupe::examples::kFinite);
  app.add_option("--kill-node", a.kill_node, "the node to kill")->capture_default_str()->check(CLI::Range(0, 1));
  app.add_option("--warmup", a.warmup, "calibration: untimed seconds")
      ->capture_default_str()
      ->check(troupe::examples::kNonNegative)
      ->check(troupe::examples::kFinite);
  app.add_option("--calibrate", a.calibrate, "calibration: timed seconds")
      ->capture_default_str()
      ->check(troupe::examples::kPositive)
      ->check(troupe::examples::kFinite);
  app.add_option("--out", a.out, "output directory")->capture_default_str();
  TROUPE_EXAMPLE_PARSE(app, argc, argv);
  if (a.grow_at < 0) a.grow_at = a.seconds / 3;
  if (a.kill_at < 0) a.kill_at = 2 * a.seconds / 3;
  std::error_code made;
  std::filesystem::create_directories(a.out, made);
  if (made) {
    std::fprintf(stderr, "elastic_experiment: --out %s: cannot make the folder: %s\n", a.out.c_str(),
                 made.message().c_str());
    return 2;
  }

  troupe::testing::LocalClusterOptions lo;
  lo.nodes = {{{"CPU", 1}}, {{"CPU", 1}}};
  troupe::testing::LocalCluster cluster(lo);
  troupe::Runtime rt = cluster.connect();

  double rate = 0;
  try {
    rate = steps_per_second(rt, a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "calibration failed: %s\n", e.what());
    rt.shutdown();
    return 1;
  }
  auto cfg = job_config();
  cfg.verbose = true;
  cfg.max_steps = kRoundSteps + static_cast<int64_t>(std::ceil(a.seconds * rate));
  std::printf("calibrated: %.1f steps/s on 2 workers; %lld steps for about %.0f s of training\n", rate,
              static_cast<long long>(cfg.max_steps), a.seconds);

  std::vector<Sample> timeline;
  std::vector<EventRow> scenario;
  bool grown = false, killed = false;
  double last_time = 0;
  double first = -1;  // the first step boundary: the scenario's clock starts
  // On a terminal the job's live progress line has no newline yet.
  const char* nl = ::isatty(STDOUT_FILENO) ? "\n" : "";
  cfg.on_step = [&](const troupe::trainer::StepInfo& s) {
    // The first round's wall time includes placement and setup: left out (0).
    Sample row{s.time, s.step, s.world_size, s.seconds > 0 ? s.samples / s.seconds : 0.0,
               last_time > 0 && s.time > last_time ? s.samples / (s.time - last_time) : 0.0};
    last_time = s.time;
    timeline.push_back(row);
    if (first < 0) first = s.time;
    // The driver's thread, between rounds: blocking here is fine.
    if (!grown && s.time - first >= a.grow_at) {
      grown = true;
      size_t i = cluster.add_node({{"CPU", 1}});
      std::printf("%s[scenario] %.2fs step %lld: node %zu added\n", nl, s.time, static_cast<long long>(s.step), i);
      scenario.push_back({s.time, "scenario", "node " + std::to_string(i) + " added", s.step, s.world_size});
    }
    if (!killed && s.time - first >= a.kill_at) {
      killed = true;
      cluster.kill_node(a.kill_node);
      std::printf("%s[scenario] %.2fs step %lld: node %zu SIGKILLed\n", nl, s.time, static_cast<long long>(s.step),
                  a.kill_node);
      scenario.push_back({s.time, "scenario", "node " + std::to_string(a.kill_node) + " killed", s.step, s.world_size});
    }
  };

  troupe::trainer::Result r;
  try {
    r = troupe::trainer::TrainJob(rt, cfg).fit();
  } catch (const troupe::trainer::JobFailed& e) {
    std::printf("\njob failed: %s\n", e.what());
    rt.shutdown();
    return 1;
  }
  std::printf("\n");
  if (!grown) std::printf("warning: the run ended before --grow-at %.1fs; raise --seconds\n", a.grow_at);
  if (!killed) std::printf("warning: the run ended before --kill-at %.1fs; raise --seconds\n", a.kill_at);

  std::ofstream tl(a.out + "/timeline.csv");
  tl << "time_s,step,world_size,samples_per_s,wall_samples_per_s\n";
  for (const auto& s : timeline)
    tl << s.time << "," << s.step << "," << s.world_size << "," << s.samples_per_s << "," << s.wall_samples_per_s
       << "\n";
  tl.close();
  std::vector<EventRow> events;
  for (const auto& e : r.events) events.push_back({e.time, to_string(e.kind), e.detail, e.step, e.world_size});
  events.insert(events.end(), scenario.begin(), scenario.end());
  std::stable_sort(events.begin(), events.end(), [](const auto& x, const auto& y) { return x.time < y.time; });
  std::ofstream ev(a.out + "/events.csv");
  ev << "time_s,kind,detail,step,world_size\n";
  for (const auto& e : events)
    ev << e.time << "," << e.kind << "," << quoted(e.detail) << "," << e.step << "," << e.world_size << "\n";
  ev.close();

  std::printf("steps %lld, final world size %lld, %zu recover%s\n", static_cast<long long>(r.steps),
              static_cast<long long>(r.final_world_size), r.recoveries.size(), r.recoveries.size() == 1 ? "y" : "ies");
  for (const auto& rec : r.recoveries)
    std::printf(
        "  recovery at %.2fs: mode %s, world %lld -> %lld, lost %lld step(s), resumed after %.2fs, "
        "next step done after %.2fs\n    cause: %s\n",
        rec.failed_at, to_string(rec.mode), static_cast<long long>(rec.world_before),
        static_cast<long long>(rec.world_after), static_cast<long long>(rec.lost_steps), rec.resumed_at - rec.failed_at,
        rec.step_done_at > 0 ? rec.step_done_at - rec.failed_at : 0.0, rec.cause.c_str());
  for (const auto& e : r.events)
    if (e.kind == troupe::trainer::JobEventKind::kResized)
      std::printf("  resized at %.2fs: %s\n", e.time, e.detail.c_str());

  std::string plot = std::string("/usr/bin/python3 ") + ELASTIC_PLOT_SCRIPT + " '" + a.out + "'";
  int rc = std::system(plot.c_str());
  if (rc == 0)
    std::printf("wrote %s/timeline.csv, %s/events.csv and %s/elastic.png\n", a.out.c_str(), a.out.c_str(),
                a.out.c_str());
  else
    std::printf("warning: no plot (%s failed); wrote %s/timeline.csv and %s/events.csv\n", plot.c_str(), a.out.c_str(),
                a.out.c_str());
  rt.shutdown();
  return 0;
}
