// train_digits: data-parallel training of an MLP on the scikit-learn digits
// data set (1,797 real 8×8 images, shipped by Debian's python3-sklearn) with
// two trainer actors, checkpoints and a validation split. Runs on an
// embedded local cluster, or on a running one with --address HOST:PORT
// (--address auto: the one `troupe start` left in the session directory).
//
// It survives --max-failures trainer deaths: at the first step it prints the
// trainers' pids; `kill -9` one and the job heals (a replacement, or the
// survivors when the cluster has no room) and goes on. When it cannot go
// on it says why and exits with status 1.
//
//   ./train_digits [--workers 2] [--epochs 12] [--max-failures 3] [--out train_digits_out]
//                  [--address HOST:PORT|auto]
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "examples/common/cli_checks.h"
#include "troupe/actors/digits_dataset.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/trainer/checkpoint.h"
#include "troupe/trainer/train_job.h"

namespace {

struct Args {
  int64_t workers = 2;
  int64_t epochs = 12;
  int64_t max_failures = 3;
  std::string out = "train_digits_out";
  std::string address;  // read by troupe::init
};

troupe::trainer::TrainJobConfig job_config(const Args& a) {
  troupe::trainer::TrainJobConfig cfg;
  cfg.name = "digits";
  cfg.scaling.num_workers = a.workers;
  // An elastic range: with no room for a replacement the survivors go on.
  cfg.scaling.min_workers = 1;
  cfg.scaling.resources_per_worker = {{"CPU", 1}};
  cfg.failure.max_failures = a.max_failures;
  cfg.trainer.model.name = "mlp";
  cfg.trainer.model.input_dim = 64;
  cfg.trainer.model.hidden = 128;
  cfg.trainer.model.num_classes = 10;
  cfg.trainer.data = troupe::actors::DatasetSpec("digits").set("normalize", 1);
  cfg.trainer.validation_fraction = 0.2;
  cfg.trainer.batch_size = 32;  // per worker
  cfg.trainer.optimizer.name = "sgd";
  cfg.trainer.optimizer.lr = 0.02;
  cfg.trainer.optimizer.momentum = 0.9;
  cfg.trainer.optimizer.weight_decay = 1e-4;
  cfg.trainer.schedule.warmup_steps = 10;
  cfg.trainer.schedule.scale_with_world = true;  // lr × workers: the global batch grows with them
  cfg.trainer.schedule.decay = "cosine";
  // 1,438 training images (80%) in global batches of 32 × workers.
  cfg.trainer.schedule.total_steps = a.epochs * (1438 / a.workers / 32);
  cfg.trainer.seed = 1;
  cfg.epochs = a.epochs;
  cfg.checkpoint.dir = a.out + "/checkpoints";
  cfg.checkpoint.keep = 2;
  cfg.checkpoint.every_steps = 50;
  cfg.metrics_path = a.out + "/metrics.jsonl";
  return cfg;
}

// "pid 4242 (actor 3), pid 4243 (actor 4)": the live trainers, from the
// head's status, so a reader can kill one and watch the job heal.
std::string trainer_pids(troupe::Runtime& rt) {
  std::string pids;
  auto status = nlohmann::json::parse(rt.status_json());
  for (const auto& actor : status["actors"]) {
    if (actor["class"] != "troupe::trainer::TrainerActor" || actor["state"] != "ALIVE") continue;
    if (!pids.empty()) pids += ", ";
    pids += "pid " + std::to_string(actor["pid"].get<int>()) + " (actor " +
            std::to_string(actor["id"].get<uint64_t>()) + ")";
  }
  return pids;
}

// Why the job stopped, in words: a lost head explains every failure after
// it, so it is named first.
int report_failure(troupe::Runtime& rt, const std::string& what) {
  if (rt.core()->head_lost())
    std::fprintf(stderr, "train_digits: lost the cluster's head at %s; the job cannot go on without it.\n%s\n",
                 rt.address().c_str(), what.c_str());
  else
    std::fprintf(stderr, "train_digits: %s\n", what.c_str());
  return 1;
}

// What the job must reach for the example to count as a success (exit 0).
constexpr double kTargetAccuracy = 0.95;

int train(troupe::Runtime& rt, const Args& a) {
  auto cfg = job_config(a);
  bool shown = false;
  cfg.on_step = [&](const troupe::trainer::StepInfo&) {
    if (shown) return;
    shown = true;
    std::printf("\ntrainers: %s; kill -9 one to watch the job heal (--max-failures %lld)\n", trainer_pids(rt).c_str(),
                static_cast<long long>(a.max_failures));
    std::fflush(stdout);
  };
  // Elastic (min_workers 1): as many of --workers as the cluster holds;
  // the job's first line says how many it placed.
  std::printf("training an MLP 64→128→128→10 on digits with up to %lld workers for %lld epochs\n",
              static_cast<long long>(a.workers), static_cast<long long>(a.epochs));
  // The example's own output: a run again starts afresh (a TrainJob does
  // not write into a directory that holds another run's checkpoints),
  // unless a running one holds it (ConfigError).
  troupe::trainer::refuse_if_checkpoint_dir_in_use(cfg.checkpoint.dir);
  std::error_code ec;
  if (std::filesystem::remove_all(cfg.checkpoint.dir, ec) > 0)
    std::printf("(removed the previous run's checkpoints in %s)\n", cfg.checkpoint.dir.c_str());
  auto result = troupe::trainer::TrainJob(rt, cfg).fit();
  const auto& last = result.history.back();
  std::printf("done: %lld steps, validation accuracy %.3f on %lld images (loss %.4f), %.0f samples/s\n",
              static_cast<long long>(result.steps), last.val_accuracy, static_cast<long long>(last.val_count),
              last.val_loss, last.samples_per_second);
  for (const auto& r : result.recoveries)
    std::printf("survived a failure at %.2fs: %lld -> %lld workers, %lld step(s) lost, trained on after %.2fs (%s)\n",
                r.failed_at, static_cast<long long>(r.world_before), static_cast<long long>(r.world_after),
                static_cast<long long>(r.lost_steps), r.resumed_at - r.failed_at, r.cause.c_str());
  if (result.last_checkpoint)
    std::printf("last checkpoint: %s (python3 -c \"import torch; print(torch.load('%s/model.pt').keys())\")\n",
                result.last_checkpoint->path.c_str(), result.last_checkpoint->path.c_str());
  std::printf("metrics: %s\n", cfg.metrics_path.c_str());
  if (last.val_accuracy >= kTargetAccuracy) return 0;
  std::fprintf(stderr,
               "train_digits: validation accuracy %.3f is below the %.2f this example checks for (it exits 1 then); "
               "train for more epochs (--epochs, now %lld)\n",
               last.val_accuracy, kTargetAccuracy, static_cast<long long>(a.epochs));
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  troupe::run_role_if_requested(argc, argv);  // a worker process never returns from here
  Args a;
  CLI::App app{"train_digits: an MLP on the scikit-learn digits data set with 2 trainer actors"};
  app.add_option("--workers", a.workers, "trainer actors (as many of them as the cluster holds, at least 1)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("--epochs", a.epochs, "passes over the training split")
      ->capture_default_str()
      ->check(troupe::examples::kPositive);
  app.add_option("--max-failures", a.max_failures, "trainer deaths survived before the job fails (-1 = no limit)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{-1}, int64_t{1000}));
  app.add_option("--out", a.out, "checkpoints and metrics go here")->capture_default_str();
  app.add_option("--address", a.address, "HOST:PORT of a running cluster, or auto (default: an embedded one)");
  TROUPE_EXAMPLE_PARSE(app, argc, argv);
  if (troupe::actors::find_digits_file().empty()) {
    std::fprintf(stderr, "digits.csv.gz not found: install python3-sklearn or set TROUPE_DIGITS_PATH\n");
    return 2;
  }
  try {
    troupe::Runtime rt = troupe::init(argc, argv);
    int code = 1;
    try {
      code = train(rt, a);
    } catch (const troupe::Error& e) {  // JobFailed, and any other troupe error
      code = report_failure(rt, e.what());
    }
    rt.shutdown();
    return code;
  } catch (const troupe::Error& e) {  // no cluster to connect to, a bad --address
    std::fprintf(stderr, "train_digits: %s\n", e.what());
    return 1;
  }
}
