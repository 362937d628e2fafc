// train_graphs: a message-passing graph network trained on ragged batches of
// molecule-like graphs, with a custom collate running in the loaders' TBB
// pipelines, a regression loss and an MAE metric, by data-parallel trainer
// actors that survive being killed. The data set is generated, not real:
// molecules.h says what it is and how the target is made.
//
// --kill-at-step N SIGKILLs one trainer when the job reaches step N (at
// the end of the round of steps that reaches it: the driver hears of steps
// a round at a time, TrainJobConfig::log_every); the
// job heals from the live peer and ends with the weights the run without
// the kill would have had (tests/trainer/graphs_example_test.cc checks it
// bitwise). Runs on an embedded local cluster, or on a running one with
// --address HOST:PORT (auto: the session's).
//
//   ./train_graphs [--workers 2] [--epochs 8] [--graphs 4000] [--hidden 64]
//                  [--layers 3] [--batch-size 32] [--lr 0.003]
//                  [--kill-at-step N] [--max-failures 3] [--out train_graphs_out]
//                  [--address HOST:PORT|auto]
#include <CLI/CLI.hpp>

#include <signal.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "examples/common/cli_checks.h"
#include "examples/train_graphs/molecules.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/trainer/checkpoint.h"
#include "troupe/trainer/train_job.h"

namespace {

struct Args {
  int64_t workers = 2;
  int64_t epochs = 8;
  int64_t graphs = 4000;
  int64_t hidden = 64;
  int64_t layers = 3;
  int64_t batch_size = 32;
  double lr = 3e-3;
  int64_t kill_at_step = -1;
  int64_t max_failures = 3;
  std::string out = "train_graphs_out";
  std::string address;  // read by troupe::init
};

troupe::trainer::TrainJobConfig job_config(const Args& a) {
  troupe::trainer::TrainJobConfig cfg;
  cfg.name = "graphs";
  cfg.scaling.num_workers = a.workers;
  cfg.scaling.resources_per_worker = {{"CPU", 1}};
  cfg.failure.max_failures = a.max_failures;
  cfg.trainer.model.name = "molecule_gnn";
  cfg.trainer.model.hidden = a.hidden;
  cfg.trainer.model.config = std::to_string(a.layers);
  cfg.trainer.data = troupe::actors::DatasetSpec("molecules").set("size", a.graphs).set("seed", 0);
  cfg.trainer.validation_fraction = 0.1;
  cfg.trainer.batch_size = a.batch_size;  // graphs per worker per step
  cfg.trainer.optimizer.name = "adamw";
  cfg.trainer.optimizer.lr = a.lr;
  cfg.trainer.optimizer.weight_decay = 1e-4;
  cfg.trainer.schedule.warmup_steps = 20;
  cfg.trainer.schedule.decay = "cosine";
  const int64_t train_graphs = a.graphs - a.graphs / 10;
  cfg.trainer.schedule.total_steps = a.epochs * (train_graphs / (a.workers * a.batch_size));
  cfg.trainer.grad_clip = 1.0;
  cfg.trainer.seed = 1;
  cfg.epochs = a.epochs;
  cfg.evaluate = true;
  cfg.checkpoint.dir = a.out + "/checkpoints";
  cfg.checkpoint.keep = 2;
  cfg.checkpoint.at_epoch_end = true;
  cfg.metrics_path = a.out + "/metrics.jsonl";
  return cfg;
}

// The pid of one live trainer, from the head's status; 0 if none.
int live_trainer_pid(troupe::Runtime& rt) {
  auto status = nlohmann::json::parse(rt.status_json());
  for (const auto& actor : status["actors"])
    if (actor["class"] == "troupe::trainer::TrainerActor" && actor["state"] == "ALIVE") return actor["pid"].get<int>();
  return 0;
}

int train(troupe::Runtime& rt, const Args& a) {
  auto cfg = job_config(a);
  bool killed = false;
  cfg.on_step = [&](const troupe::trainer::StepInfo& s) {
    if (killed || a.kill_at_step < 0 || s.step < a.kill_at_step) return;
    killed = true;
    if (const int pid = live_trainer_pid(rt); pid > 0) {
      std::printf("\nstep %lld: SIGKILL to trainer pid %d; the job heals from its live peer\n",
                  static_cast<long long>(s.step), pid);
      std::fflush(stdout);
      ::kill(pid, SIGKILL);
    }
  };
  std::printf(
      "training a %lld-layer message-passing network (width %lld) on %lld generated molecules, %lld workers, "
      "%lld epochs\n",
      static_cast<long long>(a.layers), static_cast<long long>(a.hidden), static_cast<long long>(a.graphs),
      static_cast<long long>(a.workers), static_cast<long long>(a.epochs));
  // The example's own output: a run again starts afresh (a TrainJob does
  // not write into a directory that holds another run's checkpoints),
  // unless a running one holds it (ConfigError).
  troupe::trainer::refuse_if_checkpoint_dir_in_use(cfg.checkpoint.dir);
  std::error_code ec;
  if (std::filesystem::remove_all(cfg.checkpoint.dir, ec) > 0)
    std::printf("(removed the previous run's checkpoints in %s)\n", cfg.checkpoint.dir.c_str());
  auto result = troupe::trainer::TrainJob(rt, cfg).fit();
  const auto& first = result.history.front();
  const auto& last = result.history.back();
  const double mae0 = first.val_metrics.count("mae") ? first.val_metrics.at("mae") : 0;
  const double mae1 = last.val_metrics.count("mae") ? last.val_metrics.at("mae") : 0;
  std::printf(
      "validation MAE (energy per heavy atom): %.4f after epoch 1, %.4f after epoch %lld; %lld steps, %.0f "
      "graphs/s\n",
      mae0, mae1, static_cast<long long>(result.history.size()), static_cast<long long>(result.steps),
      last.samples_per_second);
  for (const auto& r : result.recoveries)
    std::printf("survived a failure at %.2fs: %lld -> %lld workers, %lld step(s) lost, trained on after %.2fs (%s)\n",
                r.failed_at, static_cast<long long>(r.world_before), static_cast<long long>(r.world_after),
                static_cast<long long>(r.lost_steps), r.resumed_at - r.failed_at, r.cause.c_str());
  if (result.last_checkpoint) std::printf("last checkpoint: %s\n", result.last_checkpoint->path.c_str());
  std::printf("metrics: %s\n", cfg.metrics_path.c_str());
  // With one epoch there is no "after" to compare: trained is success.
  if (result.history.size() < 2) return 0;
  if (mae1 < mae0) return 0;
  std::printf("validation MAE did not fall (%.4f -> %.4f): exit 1\n", mae0, mae1);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  troupe::run_role_if_requested(argc, argv);  // a worker process never returns from here
  Args a;
  CLI::App app{"train_graphs: a message-passing network on ragged batches of generated molecules"};
  app.add_option("--workers", a.workers, "trainer actors")->capture_default_str()->check(CLI::Range(1, 64));
  app.add_option("--epochs", a.epochs, "passes over the training split")
      ->capture_default_str()
      ->check(troupe::examples::kPositive);
  app.add_option("--graphs", a.graphs, "molecules generated (10% for validation)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{100}, int64_t{10000000}));
  app.add_option("--hidden", a.hidden, "width of the node states")
      ->capture_default_str()
      ->check(troupe::examples::kPositive);
  app.add_option("--layers", a.layers, "rounds of message passing")->capture_default_str()->check(CLI::Range(1, 16));
  app.add_option("--batch-size", a.batch_size, "graphs per worker per step")
      ->capture_default_str()
      ->check(troupe::examples::kPositive);
  app.add_option("--lr", a.lr, "AdamW learning rate (warmup 20 steps, cosine decay)")
      ->capture_default_str()
      ->check(troupe::examples::kPositive);
  app.add_option("--kill-at-step", a.kill_at_step,
                 "SIGKILL one trainer once the job reaches this step (at the end of that round of steps; -1: never)")
      ->capture_default_str();
  app.add_option("--max-failures", a.max_failures, "trainer deaths survived before the job fails (-1 = no limit)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{-1}, int64_t{1000}));
  app.add_option("--out", a.out, "checkpoints and metrics go here")->capture_default_str();
  app.add_option("--address", a.address, "HOST:PORT of a running cluster, or auto (default: an embedded one)");
  TROUPE_EXAMPLE_PARSE(app, argc, argv);
  // The cosine schedule runs over the job's steps: there must be one.
  const int64_t train_split = a.graphs - a.graphs / 10;
  if (train_split < a.workers * a.batch_size) {
    std::fprintf(stderr,
                 "train_graphs: --graphs %lld leaves %lld for training (a tenth validates), fewer than one step of "
                 "--workers %lld × --batch-size %lld = %lld\n",
                 static_cast<long long>(a.graphs), static_cast<long long>(train_split),
                 static_cast<long long>(a.workers), static_cast<long long>(a.batch_size),
                 static_cast<long long>(a.workers * a.batch_size));
    return 2;
  }
  try {
    troupe::Runtime rt = troupe::init(argc, argv);
    int code = 1;
    try {
      code = train(rt, a);
    } catch (const troupe::Error& e) {  // JobFailed, and any other troupe error
      std::fprintf(stderr, "train_graphs: %s\n", e.what());
    }
    rt.shutdown();
    return code;
  } catch (const troupe::Error& e) {  // no cluster to connect to, a bad --address
    std::fprintf(stderr, "train_graphs: %s\n", e.what());
    return 1;
  }
}
