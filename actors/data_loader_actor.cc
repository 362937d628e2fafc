#include "troupe/actors/data_loader_actor.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "troupe/runtime/core/check.h"
#include "troupe/runtime/core/errors.h"

namespace troupe::actors {

namespace {

// How long a blocked write waits before it looks for a stop again: the
// latency of cancelling a feed whose reader grants no credit.
constexpr std::chrono::milliseconds kWriteSlice{50};

// VmRSS and VmHWM of this process, in bytes (0 where /proc is unavailable).
std::pair<int64_t, int64_t> resident_memory() {
  std::ifstream f("/proc/self/status");
  std::string line;
  int64_t rss = 0, hwm = 0;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) rss = std::strtoll(line.c_str() + 6, nullptr, 10) * 1024;
    if (line.rfind("VmHWM:", 0) == 0) hwm = std::strtoll(line.c_str() + 6, nullptr, 10) * 1024;
  }
  return {rss, hwm};
}

// Batch tensors a loader keeps per key for its feeds to stack into again:
// enough for a few ranks' batches in flight (tokens, frames queued on their
// streams); beyond that, batches are fresh memory as before.
constexpr size_t kCollateBuffersPerKey = 16;

void raise_max(std::atomic<int64_t>& m, int64_t v) {
  int64_t seen = m.load();
  while (v > seen && !m.compare_exchange_weak(seen, v)) {
  }
}

}  // namespace

// One running feed(), registered while its pipeline exists.
struct DataLoaderActor::Feed {
  int32_t rank = 0;
  BatchPipeline* pipeline = nullptr;
  std::atomic<bool> cancelled{false};
};

// Lock order: feeds_mutex, then a pipeline's own lock (taken by
// BatchPipeline::stop); the pipeline never calls back into State while
// holding it. dataset_mutex is never held together with feeds_mutex.
struct DataLoaderActor::State {
  explicit State(LoaderConfig c) : config(std::move(c)) {}

  const LoaderConfig config;

  // Opened by the first call that needs it, then shared by every feed. A
  // failure is not cached: the next call tries again (the file may appear).
  std::mutex dataset_mutex;
  std::shared_ptr<const Dataset> dataset;

  mutable std::mutex feeds_mutex;
  std::map<uint64_t, Feed*> feeds;
  uint64_t next_feed = 0;

  std::atomic<int64_t> feeds_done{0};
  std::atomic<int64_t> batches_sent{0};
  std::atomic<int64_t> samples_sent{0};
  std::atomic<int64_t> max_live_batches{0};
  std::atomic<int64_t> max_in_flight{0};

  // Batch tensors every feed's pipeline stacks into again (the working set
  // of batches in flight, kept across epochs).
  CollateBuffers collate_buffers{kCollateBuffersPerKey};

  std::shared_ptr<const Dataset> open_dataset() {
    std::lock_guard lock(dataset_mutex);
    if (!dataset) dataset = make_dataset(config.dataset);
    return dataset;
  }

  int64_t token_bound() const {
    return config.max_live_tokens > 0 ? config.max_live_tokens : config.threads + config.prefetch_depth;
  }

  int32_t stop(int32_t rank) {
    std::lock_guard lock(feeds_mutex);
    int32_t n = 0;
    for (auto& [id, f] : feeds) {
      if (rank >= 0 && f->rank != rank) continue;
      f->cancelled = true;
      f->pipeline->stop();
      ++n;
    }
    return n;
  }

  LoaderStats stats() const {
    LoaderStats s;
    {
      std::lock_guard lock(feeds_mutex);
      s.feeds_running = static_cast<int64_t>(feeds.size());
      for (const auto& [id, f] : feeds) s.live_batches += f->pipeline->live_batches();
    }
    s.feeds_done = feeds_done.load();
    s.batches_sent = batches_sent.load();
    s.samples_sent = samples_sent.load();
    s.max_live_batches = max_live_batches.load();
    s.token_bound = token_bound();
    s.max_in_flight = max_in_flight.load();
    std::tie(s.rss_bytes, s.peak_rss_bytes) = resident_memory();
    return s;
  }
};

DataLoaderActor::DataLoaderActor(LoaderConfig config) : state_(std::make_shared<State>(std::move(config))) {
  const LoaderConfig& c = state_->config;
  if (c.batch_size < 1)
    throw ConfigError("DataLoaderActor: batch_size must be >= 1, got " + std::to_string(c.batch_size));
  if (c.threads < 1) throw ConfigError("DataLoaderActor: threads must be >= 1, got " + std::to_string(c.threads));
  if (c.prefetch_depth < 0) throw ConfigError("DataLoaderActor: prefetch_depth must be >= 0");
  if (c.max_live_tokens < 0) throw ConfigError("DataLoaderActor: max_live_tokens must be >= 0");
  if (c.credits < 1) throw ConfigError("DataLoaderActor: credits must be >= 1");
  if (c.intra_op_threads < 0) throw ConfigError("DataLoaderActor: intra_op_threads must be >= 0");
  // A worker hosts exactly one actor, so the process-wide setting is ours.
  if (c.intra_op_threads > 0) at::set_num_threads(c.intra_op_threads);
  if (this_actor::in_worker()) {
    std::weak_ptr<State> weak = state_;
    this_actor::on_control<StopFeeds>([weak](const StopFeeds& m) {
      auto st = weak.lock();
      return st ? st->stop(m.rank) : 0;
    });
    this_actor::on_control<GetLoaderStats>([weak](const GetLoaderStats&) {
      auto st = weak.lock();
      return st ? st->stats() : LoaderStats{};
    });
  }
}

DataLoaderActor::~DataLoaderActor() = default;

namespace {

// The indices a feed sends: `rank`'s share of what `cursor` leaves of the
// epoch, cut to `max_batches` batches (0 = all).
std::vector<int64_t> feed_indices(int64_t dataset_size, const LoaderConfig& c, const SamplerCursor& cursor,
                                  int32_t rank, int64_t max_batches) {
  DistributedSampler sampler({.dataset_size = dataset_size,
                              .world_size = cursor.world_size,
                              .shuffle = c.shuffle,
                              .seed = c.seed,
                              .drop_last = c.sampler_drop_last});
  if (rank < 0 || rank >= cursor.world_size) {
    throw ConfigError("DataLoaderActor::feed: rank " + std::to_string(rank) + " outside world size " +
                      std::to_string(cursor.world_size));
  }
  std::vector<int64_t> indices = sampler.remaining(cursor, rank);
  if (max_batches > 0 && static_cast<int64_t>(indices.size()) > max_batches * c.batch_size)
    indices.resize(static_cast<size_t>(max_batches * c.batch_size));
  return indices;
}

}  // namespace

// Makes a running feed visible to stop() (by rank) for as long as it runs.
class DataLoaderActor::FeedRegistration {
 public:
  FeedRegistration(State& st, Feed& feed) : st_(st) {
    std::lock_guard lock(st_.feeds_mutex);
    id_ = st_.next_feed++;
    st_.feeds[id_] = &feed;
  }
  ~FeedRegistration() {
    std::lock_guard lock(st_.feeds_mutex);
    st_.feeds.erase(id_);
  }

 private:
  State& st_;
  uint64_t id_ = 0;
};

int64_t DataLoaderActor::feed(StreamRef ref, SamplerCursor cursor, int32_t rank, int64_t max_batches) {
  State& st = *state_;
  const LoaderConfig& c = st.config;
  // Connect first, so that every later error reaches the reader too.
  StreamWriter<Batch> writer(this_actor::runtime(), ref);

  Feed feed;
  feed.rank = rank;
  int64_t sent = 0;  // written to the stream (a cancelled sink call writes nothing)
  try {
    auto dataset = st.open_dataset();
    std::vector<int64_t> indices = feed_indices(dataset->size(), c, cursor, rank, max_batches);
    BatchPipeline pipeline(*dataset, {.batch_size = c.batch_size,
                                      .num_threads = c.threads,
                                      .prefetch_depth = c.prefetch_depth,
                                      .max_live_tokens = c.max_live_tokens,
                                      .drop_last = c.drop_last,
                                      .collate_buffers = &st.collate_buffers});
    feed.pipeline = &pipeline;
    FeedRegistration registration(st, feed);
    // The sink blocks while the reader grants no credit; that is the
    // back-pressure. It wakes every kWriteSlice to notice a stop, since a
    // blocked write cannot be interrupted otherwise.
    auto sink = [&](Batch&& b) {
      const int64_t rows = b.size();
      for (;;) {
        if (feed.cancelled) return;
        try {
          writer.write(b, kWriteSlice);
          break;
        } catch (const Timeout&) {
        }
      }
      raise_max(st.max_in_flight, static_cast<int64_t>(writer.in_flight()));
      raise_max(st.max_live_batches, pipeline.live_batches());
      ++sent;
      st.batches_sent += 1;
      st.samples_sent += rows;
    };
    PipelineStats run = pipeline.run(indices, cursor.epoch, sink);
    raise_max(st.max_live_batches, run.max_live_batches);
  } catch (const StreamError&) {
    // The reader is gone (or refused the stream): nobody to tell.
    st.feeds_done += 1;
    throw;
  } catch (const std::exception& e) {
    st.feeds_done += 1;
    writer.fail(e.what());
    throw;
  }
  st.feeds_done += 1;
  if (feed.cancelled) {
    writer.fail("data loader feed for rank " + std::to_string(rank) + " stopped after " + std::to_string(sent) +
                " batches");
  } else {
    writer.close();
  }
  return sent;
}

int32_t DataLoaderActor::stop(int32_t rank) { return state_->stop(rank); }

LoaderStats DataLoaderActor::stats() const { return state_->stats(); }

int64_t DataLoaderActor::dataset_size() { return state_->open_dataset()->size(); }

int32_t stop_feeds(const ActorHandle<DataLoaderActor>& loader, int32_t rank, std::chrono::milliseconds timeout) {
  return loader.control(StopFeeds{.rank = rank}).get(timeout);
}

LoaderStats loader_stats(const ActorHandle<DataLoaderActor>& loader, std::chrono::milliseconds timeout) {
  return loader.control(GetLoaderStats{}).get(timeout);
}

}  // namespace troupe::actors
