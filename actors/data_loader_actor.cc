#include "troupe/actors/data_loader_actor.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
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

// The sampler of `c` over `dataset_size` samples and `world_size` ranks.
DistributedSampler sampler_of(int64_t dataset_size, const LoaderConfig& c, int64_t world_size) {
  return DistributedSampler({.dataset_size = dataset_size,
                             .world_size = world_size,
                             .shuffle = c.shuffle,
                             .seed = c.seed,
                             .drop_last = c.sampler_drop_last});
}

// The indices a feed sends: `rank`'s share of what `cursor` leaves of the
// epoch, cut to `max_batches` batches (0 = all).
std::vector<int64_t> feed_indices(int64_t dataset_size, const LoaderConfig& c, const SamplerCursor& cursor,
                                  int32_t rank, int64_t max_batches) {
  const DistributedSampler sampler = sampler_of(dataset_size, c, cursor.world_size);
  if (rank < 0 || rank >= cursor.world_size) {
    throw ConfigError("DataLoaderActor::feed: rank " + std::to_string(rank) + " outside world size " +
                      std::to_string(cursor.world_size));
  }
  std::vector<int64_t> indices = sampler.remaining(cursor, rank);
  // Compared by division: max_batches x batch_size may overflow.
  if (max_batches > 0 && max_batches < (static_cast<int64_t>(indices.size()) + c.batch_size - 1) / c.batch_size)
    indices.resize(static_cast<size_t>(max_batches * c.batch_size));
  return indices;
}

// Where the feed after one that began at `cursor` and sent `samples` of
// its rank's samples begins, as the driver's TrainJob will ask: the trainers
// end an epoch that has less than a step (step_batches batches) left, and
// the driver then begins the next one.
SamplerCursor next_feed_cursor(int64_t dataset_size, const LoaderConfig& c, const SamplerCursor& cursor,
                               int64_t samples) {
  const DistributedSampler sampler = sampler_of(dataset_size, c, cursor.world_size);
  SamplerCursor next = sampler.advance(cursor, samples);
  const int64_t left = sampler.remaining_per_rank(next);
  if (left > 0 && left < c.batch_size * c.step_batches) next = sampler.advance(next, left);
  if (sampler.epoch_done(next)) next = sampler.begin_epoch(next.epoch + 1, next.world_size);
  return next;
}

// next_feed_cursor, or none where it cannot say (no look-ahead then; the
// feed is whole all the same).
std::optional<SamplerCursor> predict_next_feed(int64_t dataset_size, const LoaderConfig& c, const SamplerCursor& cursor,
                                               int64_t samples) {
  try {
    return next_feed_cursor(dataset_size, c, cursor, samples);
  } catch (const std::exception&) {
    return std::nullopt;
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
  // The shipped files' copies it reads: its messages name the driver's paths.
  DriverPaths driver_paths;

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

  // A rank's look-ahead: the first config.look_ahead batches of the feed
  // predicted to come next, made on a thread of its own.
  struct Ahead {
    SamplerCursor cursor;  // where the feed they begin starts
    std::vector<Batch> batches;
    std::mutex mutex;                   // guards the three below
    BatchPipeline* pipeline = nullptr;  // while it runs
    bool stopped = false;
    bool failed = false;            // or stopped: nothing to use
    std::atomic<bool> done{false};  // make_ahead returned: a join is at once
    std::thread thread;
  };
  std::mutex ahead_mutex;  // never held with feeds_mutex
  std::map<int32_t, std::shared_ptr<Ahead>> ahead;
  std::atomic<int64_t> ahead_hits{0};
  std::atomic<int64_t> ahead_misses{0};

  // Stopped look-aheads whose threads are joined later (stop() runs on the
  // worker's I/O thread, which must not wait out a load in progress).
  std::mutex retired_mutex;  // never held with ahead_mutex
  std::vector<std::shared_ptr<Ahead>> retired;

  ~State() { drop_ahead(-1, true); }

  static void stop_ahead(Ahead& a) {
    std::lock_guard lock(a.mutex);
    a.stopped = true;
    if (a.pipeline) a.pipeline->stop();
  }
  static void finish_ahead(Ahead& a) {
    if (a.thread.joinable()) a.thread.join();
  }

  // The look-ahead thread's work: a's batches, or a.failed.
  void make_ahead(Ahead& a, int32_t rank) {
    try {
      auto data = open_dataset();
      const std::vector<int64_t> indices = feed_indices(data->size(), config, a.cursor, rank, config.look_ahead);
      BatchPipeline pipeline(*data, pipeline_options());
      // Visible to stop_ahead() while it runs; hidden again before the
      // pipeline is destroyed, however run() ends.
      struct Visible {
        Ahead& a;
        Visible(Ahead& a, BatchPipeline& p) : a(a) {
          std::lock_guard lock(a.mutex);
          if (a.stopped) throw Error("look-ahead stopped");
          a.pipeline = &p;
        }
        ~Visible() {
          std::lock_guard lock(a.mutex);
          a.pipeline = nullptr;
        }
      } visible(a, pipeline);
      const PipelineStats run =
          pipeline.run(indices, a.cursor.epoch, [&](Batch&& b) { a.batches.push_back(std::move(b)); });
      if (run.stopped) throw Error("look-ahead stopped");
    } catch (...) {  // the feed makes its batches itself, and reports what fails
      std::lock_guard lock(a.mutex);
      a.failed = true;
      // Nothing will use them (a stopped look-ahead waits, retired, for its
      // join): their memory goes now.
      a.batches.clear();
    }
    a.done = true;
  }

  // Starts making the first batches of `rank`'s feed at `next`, replacing
  // any look-ahead of that rank. Never throws: a look-ahead that cannot
  // start is none.
  void start_ahead(int32_t rank, const SamplerCursor& next) {
    if (config.look_ahead <= 0) return;
    if (config.epochs > 0 && next.epoch >= config.epochs) return;  // the job ends before it
    std::shared_ptr<Ahead> a, old;
    try {
      a = std::make_shared<Ahead>();
      a->cursor = next;
      // Every owner stops and joins the thread before letting go of `a`.
      a->thread = std::thread([this, p = a.get(), rank] { make_ahead(*p, rank); });
      std::lock_guard lock(ahead_mutex);
      old = std::exchange(ahead[rank], a);
    } catch (...) {
      if (a) {
        stop_ahead(*a);
        finish_ahead(*a);
      }
      return;
    }
    if (old) {
      stop_ahead(*old);
      finish_ahead(*old);
    }
  }

  // The look-ahead of `rank` when it was made for a feed at `cursor` (then
  // its batches begin that feed), else nothing; either way it is used up.
  // One for another cursor is stopped rather than waited for.
  std::vector<Batch> take_ahead(int32_t rank, const SamplerCursor& cursor) {
    std::shared_ptr<Ahead> a;
    {
      std::lock_guard lock(ahead_mutex);
      auto it = ahead.find(rank);
      if (it == ahead.end()) return {};
      a = std::move(it->second);
      ahead.erase(it);
    }
    const bool same = a->cursor == cursor;
    if (!same) stop_ahead(*a);
    finish_ahead(*a);
    if (!same || a->failed) {
      ahead_misses += 1;
      return {};
    }
    ahead_hits += 1;
    return std::move(a->batches);
  }

  // The batches made ahead for the feed of `rank` at `cursor` that fit its
  // `max_batches` (0 = all); `indices` loses theirs, leaving what the
  // pipeline makes. They are the same batches (a batch is a function of
  // its indices and epoch), only sooner.
  std::vector<Batch> ready_batches(int32_t rank, const SamplerCursor& cursor, int64_t max_batches,
                                   std::vector<int64_t>& indices) {
    std::vector<Batch> ready = take_ahead(rank, cursor);
    const int64_t wanted = max_batches > 0 ? max_batches : std::numeric_limits<int64_t>::max();
    if (static_cast<int64_t>(ready.size()) > wanted) ready.resize(static_cast<size_t>(wanted));
    size_t rows = 0;
    for (const auto& b : ready) rows += static_cast<size_t>(b.size());
    TROUPE_CHECK(rows <= indices.size()) << "look-ahead of " << rows << " samples for a feed of " << indices.size();
    indices.erase(indices.begin(), indices.begin() + static_cast<std::ptrdiff_t>(rows));
    return ready;
  }

  // Stops and forgets `rank`'s look-ahead (-1: every rank's); with `wait`
  // joins its thread (and those stopped before without waiting), else
  // leaves that to the next drop that waits.
  void drop_ahead(int32_t rank, bool wait) {
    std::vector<std::shared_ptr<Ahead>> gone;
    {
      std::lock_guard lock(ahead_mutex);
      for (auto it = ahead.begin(); it != ahead.end();) {
        if (rank >= 0 && it->first != rank) {
          ++it;
          continue;
        }
        gone.push_back(std::move(it->second));
        it = ahead.erase(it);
      }
    }
    for (auto& a : gone) stop_ahead(*a);
    {
      std::lock_guard lock(retired_mutex);
      retired.insert(retired.end(), gone.begin(), gone.end());
      gone.clear();
      if (wait) {
        gone.swap(retired);
      } else {
        // Those whose thread has ended are joined at once, their batches
        // (a look-ahead done before the stop holds them all) freed now.
        for (auto it = retired.begin(); it != retired.end();) {
          if ((*it)->done) {
            gone.push_back(std::move(*it));
            it = retired.erase(it);
          } else {
            ++it;
          }
        }
      }
    }
    for (auto& a : gone) finish_ahead(*a);
  }

  // stop() calls so far that reach `rank`: a feed that sees the count move
  // between its start and its registration (or its end) was stopped.
  int64_t stops_of(int32_t rank) const {
    std::lock_guard lock(feeds_mutex);
    auto it = stops_by_rank.find(rank);
    return stops_of_all + (it == stops_by_rank.end() ? 0 : it->second);
  }
  std::map<int32_t, int64_t> stops_by_rank;  // guarded by feeds_mutex
  int64_t stops_of_all = 0;                  // guarded by feeds_mutex

  std::shared_ptr<const Dataset> open_dataset() {
    std::lock_guard lock(dataset_mutex);
    if (!dataset) {
      DatasetSpec spec = config.dataset;
      for (const auto& key : file_keys(spec))
        spec.strings[key] = driver_paths.use(config.shipped_files, spec.strings[key]);
      try {
        dataset = make_dataset(spec);
      } catch (const std::exception& e) {
        driver_paths.rethrow(e);
      }
    }
    return dataset;
  }

  // Every feed's (and look-ahead's) pipeline.
  PipelineOptions pipeline_options() {
    return {.batch_size = config.batch_size,
            .num_threads = config.threads,
            .prefetch_depth = config.prefetch_depth,
            .max_live_tokens = config.max_live_tokens,
            .drop_last = config.drop_last,
            .collate_buffers = &collate_buffers};
  }

  int64_t token_bound() const {
    return config.max_live_tokens > 0 ? config.max_live_tokens : config.threads + config.prefetch_depth;
  }

  int32_t stop(int32_t rank) {
    int32_t n = 0;
    {
      std::lock_guard lock(feeds_mutex);
      if (rank >= 0) {
        stops_by_rank[rank] += 1;
      } else {
        stops_of_all += 1;
      }
      for (auto& [id, f] : feeds) {
        if (rank >= 0 && f->rank != rank) continue;
        f->cancelled = true;
        f->pipeline->stop();
        ++n;
      }
    }
    // Stopped, not joined: this runs on the worker's I/O thread (a control
    // message), and the join waited out a load in progress (a slow data
    // set: the recovery's 5 s stats probe timed out and a healthy loader
    // was killed; one whose load() calls the runtime: a deadlock).
    drop_ahead(rank, false);
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
    s.ahead_hits = ahead_hits.load();
    s.ahead_misses = ahead_misses.load();
    std::tie(s.rss_bytes, s.peak_rss_bytes) = resident_memory();
    return s;
  }
};

DataLoaderActor::DataLoaderActor(LoaderConfig config) : state_(std::make_shared<State>(std::move(config))) {
  const LoaderConfig& c = state_->config;
  if (c.batch_size < 1)
    throw ConfigError("DataLoaderActor: batch_size must be >= 1, got " + std::to_string(c.batch_size));
  if (c.threads < 1) throw ConfigError("DataLoaderActor: threads must be >= 1, got " + std::to_string(c.threads));
  // Upper bounds as well: the token pool is made up front, so a prefetch
  // depth of 2^30 ran the loader out of memory with no setting named.
  auto within = [](const char* name, int64_t v, int64_t lo, int64_t hi) {
    if (v < lo || v > hi)
      throw ConfigError(std::string("DataLoaderActor: ") + name + " must be between " + std::to_string(lo) + " and " +
                        std::to_string(hi) + ", got " + std::to_string(v));
  };
  within("threads", c.threads, 1, 256);
  within("prefetch_depth", c.prefetch_depth, 0, 4096);
  within("max_live_tokens", c.max_live_tokens, 0, 4096);
  within("credits", c.credits, 1, 4096);
  within("intra_op_threads", c.intra_op_threads, 0, 1024);
  within("look_ahead", c.look_ahead, 0, 64);
  if (c.step_batches < 1)
    throw ConfigError("DataLoaderActor: step_batches must be >= 1, got " + std::to_string(c.step_batches));
  if (c.epochs < 0) throw ConfigError("DataLoaderActor: epochs must be >= 0, got " + std::to_string(c.epochs));
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

// Writes `b` (batch b.sequence of `rank`'s feed), in slices of kWriteSlice
// so that a stop (`cancelled`) is seen while the reader grants no credit;
// false when cancelled first.
bool write_batch(StreamWriter<Batch>& writer, const Batch& b, const std::atomic<bool>& cancelled, int32_t rank) {
  for (;;) {
    if (cancelled) return false;
    try {
      writer.write(b, kWriteSlice);
      return true;
    } catch (const Timeout&) {
    } catch (const StreamValueRefused& e) {
      // Not the reader's going (which ends the feed quietly): this batch
      // is too large to send, at every retry, so it ends the job (TrainJob
      // does not retry a ConfigError).
      throw ConfigError("data loader of rank " + std::to_string(rank) + ": batch " + std::to_string(b.sequence) + " (" +
                        std::to_string(b.size()) + " samples) cannot be sent to its trainer: " + e.what() +
                        "; a batch must fit one frame: fewer samples per batch (batch_size) or fewer tensors per "
                        "sample");
    }
  }
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
  // A stop() from here on reaches this feed, also one that comes before it
  // is registered (while it waits for its look-ahead, say).
  const int64_t stops = st.stops_of(rank);
  int64_t sent = 0;  // written to the stream (a cancelled sink call writes nothing)
  int64_t sent_rows = 0;
  std::optional<SamplerCursor> next;  // where the next feed should begin, once this one is whole
  try {
    auto dataset = st.open_dataset();
    std::vector<int64_t> indices = feed_indices(dataset->size(), c, cursor, rank, max_batches);
    std::vector<Batch> ready = st.ready_batches(rank, cursor, max_batches, indices);
    BatchPipeline pipeline(*dataset, st.pipeline_options());
    feed.pipeline = &pipeline;
    FeedRegistration registration(st, feed);
    if (st.stops_of(rank) != stops) feed.cancelled = true;
    // The sink blocks while the reader grants no credit; that is the
    // back-pressure. It wakes every kWriteSlice to notice a stop, since a
    // blocked write cannot be interrupted otherwise.
    auto sink = [&](Batch&& b) {
      const int64_t rows = b.size();
      b.sequence = sent;  // batches made ahead and the pipeline's, numbered as one feed
      if (!write_batch(writer, b, feed.cancelled, rank)) return;
      raise_max(st.max_in_flight, static_cast<int64_t>(writer.in_flight()));
      raise_max(st.max_live_batches, pipeline.live_batches());
      ++sent;
      sent_rows += rows;
      st.batches_sent += 1;
      st.samples_sent += rows;
    };
    for (auto& b : ready) {
      if (feed.cancelled) break;
      sink(std::move(b));
    }
    ready.clear();
    if (!feed.cancelled && !indices.empty()) {
      PipelineStats run = pipeline.run(indices, cursor.epoch, sink);
      raise_max(st.max_live_batches, run.max_live_batches);
    }
    if (!feed.cancelled && sent > 0) next = predict_next_feed(dataset->size(), c, cursor, sent_rows);
  } catch (const StreamError&) {
    // The reader is gone (or refused the stream): nobody to tell.
    st.feeds_done += 1;
    throw;
  } catch (const std::exception& e) {
    st.feeds_done += 1;
    writer.fail(st.driver_paths.named(e.what()));
    st.driver_paths.rethrow(e);
  }
  st.feeds_done += 1;
  if (feed.cancelled) {
    writer.fail("data loader feed for rank " + std::to_string(rank) + " stopped after " + std::to_string(sent) +
                " batches");
    return sent;
  }
  writer.close();
  // A whole feed sent: make the next one's first batches while the reader
  // works through these (unless a stop came meanwhile).
  if (next && st.stops_of(rank) == stops) st.start_ahead(rank, *next);
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
