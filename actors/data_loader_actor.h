// DataLoaderActor: the actor that keeps trainers fed (DESIGN.md §6). It is
// constructed from a LoaderConfig (a plain value: the data set's spec and
// the pipeline's knobs), opens the data set on first use, and serves feed()
// calls: each runs a BatchPipeline over one rank's remaining indices of an
// epoch (DistributedSampler + SamplerCursor) and writes the batches, in
// order, into a stream the trainer reads. Back-pressure is the stream's: a
// writer without credit blocks the pipeline's push stage, so a slow trainer
// bounds the loader's memory at the pipeline's tokens plus the credits.
//
// One loader per trainer: spawn one per rank, max_concurrency 1. One loader
// per node feeding several trainers: spawn one with max_concurrency >= the
// number of trainers; concurrent feed() calls run their own pipelines over
// the one shared data set.
//
//   StreamReader<Batch> r(rt, config.credits);                 // trainer side
//   auto sent = loader.call(&DataLoaderActor::feed, r.ref(), cursor, rank, 0);
//   while (auto b = r.read()) ...                              // then sent.get()
//
// A driver cancels running feeds with stop_feeds() (a control message, so it
// works while feed() occupies a single-threaded actor) or, when
// max_concurrency > 1, with the stop() method.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "troupe/actors/batch.h"
#include "troupe/actors/batch_pipeline.h"
#include "troupe/actors/dataset.h"
#include "troupe/actors/distributed_sampler.h"
#include "troupe/actors/tensor_codec.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/client/shipped_file.h"
#include "troupe/runtime/client/stream.h"

namespace troupe::actors {

// What a loader is built from; crosses the wire as its constructor argument.
struct LoaderConfig {
  DatasetSpec dataset{};
  int64_t batch_size = 32;
  // Drop a final batch smaller than batch_size (DataLoader's drop_last).
  bool drop_last = false;
  // DistributedSampler's drop_last: truncate rather than pad the epoch to a
  // multiple of the world size.
  bool sampler_drop_last = false;
  bool shuffle = true;
  // Sampler seed (the permutation of epoch e comes from seed + e). Random
  // transforms take their seed from the data set's spec.
  int64_t seed = 0;
  // Threads of each feed's pipeline (counting the thread running feed()).
  int32_t threads = 2;
  // Finished batches allowed to wait ahead of the stream.
  int32_t prefetch_depth = 2;
  // Bound on batches alive in one pipeline; 0 = threads + prefetch_depth.
  int32_t max_live_tokens = 0;
  // The credit window readers should open (StreamReader<Batch>(rt, credits)):
  // batches sent and not yet read, on top of the pipeline's tokens.
  int32_t credits = 4;
  // Intra-op threads of the loader's process (at::set_num_threads); 1 keeps
  // collate from competing with the pipeline threads. 0 leaves it alone.
  int32_t intra_op_threads = 1;
  // Batches of a rank's next feed made as soon as its feed ends, while the
  // trainer still works through what was sent: the next feed starts with
  // them instead of waiting for its pipeline's first batch. Its cursor is
  // predicted (this feed's end, or the next epoch's start); a feed that
  // asks for another drops them. 0 = none.
  int32_t look_ahead = 2;
  // What the look-ahead predicts from: batches per trainer step (its
  // gradient accumulation; an epoch ends with less than a step left), and
  // the epochs the job runs (none is made for epoch `epochs`; 0 = no end).
  int64_t step_batches = 1;
  int64_t epochs = 0;

  // Files the driver sent: a file of the data set's that one of them ships
  // is read from this host's copy (shipped_file.h), fetched when the data
  // set is first opened.
  std::vector<ShippedFile> shipped_files;
  TROUPE_FIELDS(dataset, batch_size, drop_last, sampler_drop_last, shuffle, seed, threads, prefetch_depth,
                max_live_tokens, credits, intra_op_threads, look_ahead, step_batches, epochs, shipped_files);
};

// Counters of one loader, for tests, metrics and the benchmarks. The max_*
// fields are the most seen in any one feed since the loader started.
struct LoaderStats {
  int64_t feeds_running = 0;
  int64_t feeds_done = 0;
  int64_t batches_sent = 0;
  int64_t samples_sent = 0;
  // Batches alive in the running pipelines now, and their bound per feed.
  int64_t live_batches = 0;
  int64_t max_live_batches = 0;
  int64_t token_bound = 0;
  // Batches written and not yet credited back by a reader.
  int64_t max_in_flight = 0;
  // The loader process's resident and peak resident memory (bytes).
  int64_t rss_bytes = 0;
  int64_t peak_rss_bytes = 0;
  // Feeds that began with look-ahead batches, and feeds whose look-ahead
  // was for another cursor (or failed) and was dropped.
  int64_t ahead_hits = 0;
  int64_t ahead_misses = 0;

  TROUPE_FIELDS(feeds_running, feeds_done, batches_sent, samples_sent, live_batches, max_live_batches, token_bound,
                max_in_flight, rss_bytes, peak_rss_bytes, ahead_hits, ahead_misses);
};

// Control message: cancel the running feeds of `rank` (-1 = all); the
// reply is how many were cancelled.
struct StopFeeds {
  static constexpr const char* kControlTag = "data_loader.stop";
  using Reply = int32_t;
  int32_t rank = -1;
  TROUPE_FIELDS(rank)
};

// Control message: the loader's stats (served while feed() runs).
struct GetLoaderStats {
  static constexpr const char* kControlTag = "data_loader.stats";
  using Reply = LoaderStats;
  TROUPE_FIELDS()
};

// A resource (one per worker process); see the file comment.
class DataLoaderActor {
 public:
  // Checks the config (ConfigError); the data set opens on the first call
  // that needs it, so a bad spec or file fails that call and its stream.
  explicit DataLoaderActor(LoaderConfig config);
  ~DataLoaderActor();
  DataLoaderActor(const DataLoaderActor&) = delete;
  DataLoaderActor& operator=(const DataLoaderActor&) = delete;

  // Writes the batches of `rank`'s remaining indices at `cursor` (at most
  // max_batches of them; <= 0 = all) to the stream `ref`, then closes it.
  // Returns the batches sent. A data set, sampler or load error fails the
  // stream with the error's text (which names the file) and is rethrown; a
  // reader that goes away ends the feed with StreamError. A batch over the
  // frame limits (wire/frame.h: over 4096 tensors of 16 KiB or more, say) fails the stream
  // and the call with a ConfigError naming it. A feed cancelled
  // by stop fails its stream with "stopped" and returns what it had sent.
  int64_t feed(StreamRef ref, SamplerCursor cursor, int32_t rank, int64_t max_batches);

  // Cancels the running feeds of `rank` (-1 = all); returns how many. Only
  // reachable while a feed runs when max_concurrency > 1; stop_feeds() is.
  int32_t stop(int32_t rank);

  LoaderStats stats() const;

  // The data set's size (opens it); what a driver needs to build a sampler.
  int64_t dataset_size();

 private:
  struct Feed;
  class FeedRegistration;
  struct State;
  // Shared with the control handlers, which may outlive nothing but must
  // never dangle: they hold the state, not the actor.
  std::shared_ptr<State> state_;
};

// Cancels running feeds of `rank` (-1 = all) through a control message,
// whatever the actor's max_concurrency; returns how many were cancelled.
int32_t stop_feeds(const ActorHandle<DataLoaderActor>& loader, int32_t rank = -1,
                   std::chrono::milliseconds timeout = std::chrono::seconds(10));

// The loader's stats through a control message (works while feed() runs).
LoaderStats loader_stats(const ActorHandle<DataLoaderActor>& loader,
                         std::chrono::milliseconds timeout = std::chrono::seconds(10));

}  // namespace troupe::actors

TROUPE_ACTOR(troupe::actors::DataLoaderActor, &troupe::actors::DataLoaderActor::feed,
             &troupe::actors::DataLoaderActor::stop, &troupe::actors::DataLoaderActor::stats,
             &troupe::actors::DataLoaderActor::dataset_size)
