// Checkpoints on disk. TrainState is the full state of a data-parallel run
// as one value (model, optimizer, schedule position, RNG, sampler cursor);
// it crosses the wire through Codec (tensors as attachments) from rank 0 to
// the driver, which writes it here:
//
//   <root>/step-00000120/manifest.json   step, epoch, world size, cursor,
//                                        metrics, SHA-256 of every file
//   <root>/step-00000120/model.pt        {name: tensor}  (torch.load reads it)
//   <root>/step-00000120/optimizer.pt    {name: tensor}
//   <root>/step-00000120/rng.pt          {"cpu": uint8 generator state}
//   <root>/step-00000120/step.pt         {name: tensor}: the train step's
//                                        own state, when it keeps any
//
// A checkpoint is written under "<root>/.tmp-…" and renamed into place once
// complete (and fsync'd), so a crash never leaves a directory that looks
// like a checkpoint; latest_checkpoint() also skips any step directory
// whose manifest is missing or whose files fail their checksums.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <torch/types.h>

#include "troupe/actors/distributed_sampler.h"
#include "troupe/actors/tensor_codec.h"
#include "troupe/runtime/wire/codec.h"

namespace troupe::trainer {

struct TrainState {
  // Optimizer steps taken so far (the schedule's position) and the epoch the
  // cursor is in.
  int64_t step = 0;
  int64_t epoch = 0;
  int64_t world_size = 1;
  // Parameters and buffers by name.
  std::map<std::string, torch::Tensor> model;
  std::map<std::string, torch::Tensor> optimizer;
  // torch's default CPU generator (get_state()).
  torch::Tensor rng;
  actors::SamplerCursor cursor;
  // The train step's own state (TrainStep::state()); empty for most steps.
  std::map<std::string, torch::Tensor> step_state;

  TROUPE_FIELDS(step, epoch, world_size, model, optimizer, rng, cursor, step_state);
};

struct CheckpointInfo {
  std::string path;
  int64_t step = 0;
  int64_t epoch = 0;
  int64_t world_size = 0;
  actors::SamplerCursor cursor;
  std::map<std::string, double> metrics;
  // What the data order was made from (CheckpointManifest::data_order).
  std::map<std::string, int64_t> data_order;
  // The running epoch's sums at `step` (CheckpointManifest::epoch_sums).
  std::map<std::string, double> epoch_sums;

  TROUPE_FIELDS(path, step, epoch, world_size, cursor, metrics, data_order, epoch_sums);
};

// A checkpoint could not be written (a full disk, a read-only directory):
// not a trainer's failure that a replacement could heal. TrainJob fails
// with it, naming the newest checkpoint that was written.
class CheckpointWriteError : public Error {
 public:
  using Error::Error;
};

// Throws ConfigError naming the holder when another running job holds
// `root` (its ROOT/.lock flocked by a CheckpointWriter); a no-op when none
// does, or the directory has no lock file.
void refuse_if_checkpoint_dir_in_use(const std::string& root);

// The newest complete checkpoint folder under `root` (step-N holding a
// manifest.json; nothing read or verified), or "" when there is none.
std::string newest_checkpoint_folder(const std::string& root);

// Writes `state` as <root>/step-NNNNNNNN atomically; returns its info.
// Throws CheckpointWriteError on I/O failure (the temporary directory is
// removed).
CheckpointInfo save_checkpoint(const std::string& root, const TrainState& state,
                               const std::map<std::string, double>& metrics = {},
                               const std::map<std::string, int64_t>& data_order = {},
                               const std::map<std::string, double>& epoch_sums = {});
// Reads a checkpoint directory (verifying checksums). Throws troupe::Error
// naming the file when something is missing or corrupt.
TrainState load_checkpoint(const std::string& dir, CheckpointInfo* info = nullptr);
// A step directory that is not a valid checkpoint, and why (a file that
// fails its checksum, a missing manifest, ...).
struct SkippedCheckpoint {
  std::string path;
  std::string why;
};
// The valid checkpoint with the highest step under `root` (nullopt when
// none). Temporary directories and incomplete ones are never chosen; those
// skipped are added to `skipped` when given.
std::optional<CheckpointInfo> latest_checkpoint(const std::string& root,
                                                std::vector<SkippedCheckpoint>* skipped = nullptr);
// Valid checkpoints under root, by step (the others to `skipped`).
std::vector<CheckpointInfo> list_checkpoints(const std::string& root,
                                             std::vector<SkippedCheckpoint>* skipped = nullptr);
// Removes all but the newest `keep` valid checkpoints and any stale
// temporary directory. keep <= 0 keeps everything.
void prune_checkpoints(const std::string& root, int keep);

// Writes checkpoints on its own thread, so training does not wait for the
// disk. One write at a time, in submission order; wait() drains the queue
// and rethrows the first failure.
class CheckpointWriter {
 public:
  // `data_order` goes into every manifest (CheckpointManifest::data_order).
  // Makes `root` if need be and holds ROOT/.lock (flock) while it lives:
  // a second writer of the same directory, in this process or another job,
  // is a ConfigError naming the directory and the pid that holds it.
  CheckpointWriter(std::string root, int keep, std::map<std::string, int64_t> data_order = {});
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // `epoch_sums`: CheckpointManifest::epoch_sums.
  void submit(TrainState state, std::map<std::string, double> metrics, std::map<std::string, double> epoch_sums = {});
  // Blocks until every submitted checkpoint is on disk; rethrows a failure.
  void wait();
  // Rethrows a failure of a write that already ended, without waiting.
  void check();
  std::optional<CheckpointInfo> last() const;

 private:
  void run();
  std::string root_;
  int lock_fd_;  // ROOT/.lock, locked
  int keep_;
  std::map<std::string, int64_t> data_order_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  struct Item {
    TrainState state;
    std::map<std::string, double> metrics, epoch_sums;
  };
  std::deque<Item> queue_;
  bool busy_ = false;
  bool stop_ = false;
  std::exception_ptr error_;
  std::optional<CheckpointInfo> last_;
  std::thread thread_;
};

}  // namespace troupe::trainer
