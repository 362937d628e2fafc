// elastic_experiment: an elastic data-parallel job living through a node
// joining and a node dying. A local cluster of two one-CPU nodes runs a
// TrainJob with 2 workers (elastic range 1..3) on synthetic data; from the
// job's on_step hook, a third node is added at --grow-at seconds (the job
// grows to 3 workers at a later step boundary) and node --kill-node is
// SIGKILLed at --kill-at seconds (its trainer dies; with no spare node the
// job heals the survivors by broadcast and shrinks to 2). Writes
// timeline.csv (one row per step boundary) and events.csv (the job's events
// and the scenario's actions), prints the recoveries, and plots throughput
// and world size over time to elastic.png with /usr/bin/python3's
// matplotlib (plot.py next to this file). Nodes are named by their
// LocalCluster index: 0 and 1 from the start, 2 the one that joins.
//
//   ./elastic_experiment [--seconds 30] [--grow-at S] [--kill-at S]
//                        [--kill-node 0] [--steps N] [--out elastic_experiment_out]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/testing/local_cluster.h"
#include "troupe/trainer/train_job.h"

#ifndef ELASTIC_PLOT_SCRIPT
#define ELASTIC_PLOT_SCRIPT "examples/elastic_experiment/plot.py"
#endif

namespace {

struct Args {
  double seconds = 30;  // the run length the steps are sized for
  double grow_at = -1;  // default seconds / 3
  double kill_at = -1;  // default 2 * seconds / 3
  size_t kill_node = 0;
  int64_t steps = 0;  // default: sized from seconds
  std::string out = "elastic_experiment_out";
};

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

int usage(const char* argv0) {
  std::fprintf(
      stderr, "usage: %s [--seconds S] [--grow-at S] [--kill-at S] [--kill-node 0|1] [--steps N] [--out DIR]\n", argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  troupe::run_role_if_requested(argc, argv);
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string f = argv[i];
    if (i + 1 >= argc) return usage(argv[0]);
    const char* v = argv[++i];
    if (f == "--seconds")
      a.seconds = std::atof(v);
    else if (f == "--grow-at")
      a.grow_at = std::atof(v);
    else if (f == "--kill-at")
      a.kill_at = std::atof(v);
    else if (f == "--kill-node")
      a.kill_node = static_cast<size_t>(std::atoll(v));
    else if (f == "--steps")
      a.steps = std::atoll(v);
    else if (f == "--out")
      a.out = v;
    else
      return usage(argv[0]);
  }
  if (a.grow_at < 0) a.grow_at = a.seconds / 3;
  if (a.kill_at < 0) a.kill_at = 2 * a.seconds / 3;
  // 50 steps a second: 25-45 s on a 2-core machine (MLP 256-1024-1024-10,
  // batch 32 per worker, 2 then 3 then 2 workers), with room to spare so
  // that a fast machine still reaches --kill-at.
  if (a.steps <= 0) a.steps = static_cast<int64_t>(a.seconds * 50);
  if (a.kill_node > 1) return usage(argv[0]);
  std::filesystem::create_directories(a.out);

  troupe::testing::LocalClusterOptions lo;
  lo.nodes = {{{"CPU", 1}}, {{"CPU", 1}}};
  troupe::testing::LocalCluster cluster(lo);
  troupe::Runtime rt = cluster.connect();

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
  cfg.max_steps = a.steps;
  cfg.progress_every_steps = 5;
  cfg.evaluate = false;
  cfg.verbose = true;

  std::vector<Sample> timeline;
  std::vector<EventRow> scenario;
  bool grown = false, killed = false;
  double last_time = 0;
  // On a terminal the job's live progress line has no newline yet.
  const char* nl = ::isatty(STDOUT_FILENO) ? "\n" : "";
  cfg.on_step = [&](const troupe::trainer::StepInfo& s) {
    // The first round's wall time includes placement and setup: left out (0).
    Sample row{s.time, s.step, s.world_size, s.seconds > 0 ? s.samples / s.seconds : 0.0,
               last_time > 0 && s.time > last_time ? s.samples / (s.time - last_time) : 0.0};
    last_time = s.time;
    timeline.push_back(row);
    // The driver's thread, between rounds: blocking here is fine.
    if (!grown && s.time >= a.grow_at) {
      grown = true;
      size_t i = cluster.add_node({{"CPU", 1}});
      std::printf("%s[scenario] %.2fs step %lld: node %zu added\n", nl, s.time, static_cast<long long>(s.step), i);
      scenario.push_back({s.time, "scenario", "node " + std::to_string(i) + " added", s.step, s.world_size});
    }
    if (!killed && s.time >= a.kill_at) {
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
  if (!grown) std::printf("warning: the run ended before --grow-at %.1fs; raise --steps\n", a.grow_at);
  if (!killed) std::printf("warning: the run ended before --kill-at %.1fs; raise --steps\n", a.kill_at);

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
