// train_digits: data-parallel training of an MLP on the scikit-learn digits
// data set (1,797 real 8×8 images, shipped by Debian's python3-sklearn) with
// two trainer actors, checkpoints and a validation split. Runs on an
// embedded local cluster, or on a running one with --address HOST:PORT.
//
//   ./train_digits [--workers 2] [--epochs 12] [--out train_digits_out]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "troupe/actors/digits_dataset.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/trainer/train_job.h"

int main(int argc, char** argv) {
  troupe::Runtime rt = troupe::init(argc, argv);  // a worker process never returns from here
  int64_t workers = 2, epochs = 12;
  std::string out = "train_digits_out";
  for (int i = 1; i + 1 < argc; ++i) {
    if (!std::strcmp(argv[i], "--workers"))
      workers = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--epochs"))
      epochs = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--out"))
      out = argv[++i];
  }
  if (troupe::actors::find_digits_file().empty()) {
    std::fprintf(stderr, "digits.csv.gz not found: install python3-sklearn or set TROUPE_DIGITS_PATH\n");
    return 2;
  }

  troupe::trainer::TrainJobConfig cfg;
  cfg.name = "digits";
  cfg.scaling.num_workers = workers;
  cfg.scaling.resources_per_worker = {{"CPU", 1}};
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
  cfg.trainer.schedule.total_steps = epochs * (1438 / workers / 32);
  cfg.trainer.seed = 1;
  cfg.epochs = epochs;
  cfg.checkpoint.dir = out + "/checkpoints";
  cfg.checkpoint.keep = 2;
  cfg.checkpoint.every_steps = 50;
  cfg.metrics_path = out + "/metrics.jsonl";

  std::printf("training an MLP 64→128→128→10 on digits with %lld workers for %lld epochs\n",
              static_cast<long long>(workers), static_cast<long long>(epochs));
  auto result = troupe::trainer::TrainJob(rt, cfg).fit();
  const auto& last = result.history.back();
  std::printf("done: %lld steps, validation accuracy %.3f on %lld images (loss %.4f), %.0f samples/s\n",
              static_cast<long long>(result.steps), last.val_accuracy, static_cast<long long>(last.val_count),
              last.val_loss, last.samples_per_second);
  if (result.last_checkpoint)
    std::printf("last checkpoint: %s (python3 -c \"import torch; print(torch.load('%s/model.pt').keys())\")\n",
                result.last_checkpoint->path.c_str(), result.last_checkpoint->path.c_str());
  std::printf("metrics: %s\n", cfg.metrics_path.c_str());
  rt.shutdown();
  return last.val_accuracy >= 0.95 ? 0 : 1;
}
