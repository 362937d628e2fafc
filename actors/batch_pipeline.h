// BatchPipeline: the engine of a data-loading actor. A tbb::parallel_pipeline
//
//   source (serial, in order)        cut the index list into batches
//   load (parallel)                  Dataset::get + transforms, per batch
//   collate (parallel)               Dataset::collate (by default stacking each
//                                    key) makes the samples a Batch; several
//                                    batches' collates may run at once
//   push (serial, in order)          hand the Batch to the sink
//
// runs inside its own tbb::task_arena, so the loader's thread count is its
// own and not the process-wide TBB default. At most max_live_tokens batches
// exist at once (being loaded, collated, waiting or being pushed), which is
// what keeps memory flat: when the sink blocks — a stream writer without
// credit, a slow trainer — the pipeline stops drawing indices instead of
// piling batches up. Batches reach the sink one at a time, in index order.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "troupe/actors/batch.h"
#include "troupe/actors/dataset.h"

namespace troupe::actors {

struct PipelineOptions {
  int64_t batch_size = 32;
  // Concurrency of the pipeline's arena, counting the thread calling run().
  // TBB caps it at the process's TBB worker limit (cores − 1 workers).
  int num_threads = 2;
  // Finished batches allowed to wait ahead of the sink, on top of the ones
  // being worked on: the default token bound is num_threads + prefetch_depth.
  int prefetch_depth = 2;
  // Bound on batches alive at once; 0 means num_threads + prefetch_depth.
  int max_live_tokens = 0;
  // Drop a final batch smaller than batch_size.
  bool drop_last = false;
  // Where stacked batches are written again once released (shared by a
  // loader's feeds, so its epochs reuse them too); none: each run() keeps
  // its own.
  CollateBuffers* collate_buffers = nullptr;
};

// Receives each batch. May block (that is how back-pressure arrives); may
// throw to abort the run (the exception comes out of run()).
using BatchSink = std::function<void(Batch&&)>;

struct PipelineStats {
  int64_t batches = 0;  // delivered to the sink
  int64_t samples = 0;
  // Most batches alive at once during the run; never above the token bound.
  int64_t max_live_batches = 0;
  bool stopped = false;  // run ended by stop()
};

// A resource: owns a task arena. One run() at a time; stop() from any thread.
class BatchPipeline {
 public:
  BatchPipeline(const Dataset& dataset, PipelineOptions options);
  ~BatchPipeline();
  BatchPipeline(const BatchPipeline&) = delete;
  BatchPipeline& operator=(const BatchPipeline&) = delete;

  // Loads dataset[indices] (as seen in `epoch`) in batches and pushes them to
  // `sink` in order. Returns when every batch was delivered or after stop();
  // rethrows the first exception of a load, collate or the sink, after the
  // pipeline has wound down (batches in flight are freed, not delivered).
  PipelineStats run(const std::vector<int64_t>& indices, int64_t epoch, const BatchSink& sink);

  // Ends the current run and every later one: no new batch starts and
  // batches in flight are dropped. A sink call already under way (or just
  // starting) finishes; no other follows. A sink blocked forever must be
  // unblocked by its owner (e.g. by closing the stream it writes to).
  void stop();
  bool stopped() const { return stop_.load(); }

  // Batches alive right now (for tests and metrics).
  int64_t live_batches() const { return live_.load(); }
  int64_t max_live_tokens() const { return tokens_; }
  const PipelineOptions& options() const { return options_; }

 private:
  struct Token;
  // The load stage: the whole batch from Dataset::load_batch, else each
  // sample's get(); the collate stage: the Batch made of either.
  void load(Token& t, int64_t epoch, CollateBuffers* buffers) const;
  void collate(Token& t, int64_t epoch, CollateBuffers* buffers) const;
  // The TBB objects (arena, the running pipeline's context), kept out of
  // this header.
  struct Tbb;
  class ContextRegistration;

  const Dataset& dataset_;
  PipelineOptions options_;
  int64_t tokens_;
  std::unique_ptr<Tbb> tbb_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> max_live_{0};
};

}  // namespace troupe::actors
