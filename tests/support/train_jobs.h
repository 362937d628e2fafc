// The job the trainer tests build on (header-only: it needs LibTorch, so
// only trainer tests include it). One definition, so that the jobs of
// different test files differ only where a test says so.
#pragma once

#include <cstdint>
#include <string>

#include "troupe/actors/dataset.h"
#include "troupe/trainer/train_job.h"

namespace troupe::test {

// A small, deterministic job: an MLP (16 -> 32 -> 4) on `size` samples of
// synthetic 4-class data with 16 features, fixed seeds, `workers` workers
// of batch `batch`, one epoch, no evaluation, no console output. The
// optimizer is left at its defaults.
inline trainer::TrainJobConfig small_mlp_job(const std::string& name, int64_t workers, int64_t batch, int64_t size) {
  trainer::TrainJobConfig c;
  c.name = name;
  c.scaling.num_workers = workers;
  c.trainer.model.name = "mlp";
  c.trainer.model.input_dim = 16;
  c.trainer.model.hidden = 32;
  c.trainer.model.num_classes = 4;
  c.trainer.data = actors::DatasetSpec("synthetic_classification")
                       .set("size", size)
                       .set("num_features", 16)
                       .set("num_classes", 4)
                       .set("seed", 5);
  c.trainer.batch_size = batch;
  c.trainer.seed = 42;
  c.epochs = 1;
  c.evaluate = false;
  c.verbose = false;
  return c;
}

}  // namespace troupe::test
