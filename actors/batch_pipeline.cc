#include "troupe/actors/batch_pipeline.h"

#include <tbb/parallel_pipeline.h>
#include <tbb/task_arena.h>
#include <tbb/task_group.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

#include "troupe/runtime/core/check.h"
#include "troupe/runtime/core/errors.h"

namespace troupe::actors {

struct BatchPipeline::Tbb {
  explicit Tbb(int threads) : arena(threads) {}
  tbb::task_arena arena;
  // Guards context between run() and stop().
  std::mutex mutex;
  tbb::task_group_context* context = nullptr;
};

// One batch on its way through the stages. TBB passes only pointers to
// tokens; run() owns them. That matters on cancellation (stop(), or an
// exception in a stage): TBB then drops items it has not finished without
// running any destructor, so whatever they hold must be owned elsewhere to
// be freed.
struct BatchPipeline::Token {
  int64_t sequence = 0;
  std::vector<int64_t> indices;
  std::vector<Sample> samples;
  // The whole batch, when the data set wrote it at once (load_batch).
  std::optional<TensorDict> loaded;
  Batch batch;

  void clear() {
    indices.clear();
    samples.clear();
    loaded.reset();
    batch = Batch();
  }
};

BatchPipeline::BatchPipeline(const Dataset& dataset, PipelineOptions options) : dataset_(dataset), options_(options) {
  if (options_.batch_size < 1) throw ConfigError("BatchPipeline: batch_size must be >= 1");
  if (options_.num_threads < 1) throw ConfigError("BatchPipeline: num_threads must be >= 1");
  if (options_.prefetch_depth < 0) throw ConfigError("BatchPipeline: prefetch_depth must be >= 0");
  if (options_.max_live_tokens < 0) throw ConfigError("BatchPipeline: max_live_tokens must be >= 0");
  tokens_ = options_.max_live_tokens > 0 ? options_.max_live_tokens : options_.num_threads + options_.prefetch_depth;
  tbb_ = std::make_unique<Tbb>(options_.num_threads);
}

BatchPipeline::~BatchPipeline() = default;

void BatchPipeline::stop() {
  stop_ = true;
  std::lock_guard<std::mutex> lock(tbb_->mutex);
  if (tbb_->context) tbb_->context->cancel_group_execution();
}

namespace {

// Batches a run keeps buffers for beyond its own tokens: those handed on
// and still held (frames queued on a stream, a consumer's batch in hand).
constexpr size_t kReusedInFlight = 8;

// The tokens of one run(). At most `count` are in flight, so the free list
// is never empty when the source asks; `in_use` counts those handed to TBB
// and not yet returned by the last stage. `live` and `max_live` are the
// pipeline's counters, which stop() and stats read from other threads.
template <class Token>
class TokenPool {
 public:
  TokenPool(int64_t count, std::atomic<int64_t>& live, std::atomic<int64_t>& max_live)
      : count_(count), live_(live), max_live_(max_live) {
    for (int64_t k = 0; k < count; ++k) {
      storage_.push_back(std::make_unique<Token>());
      free_.push_back(storage_.back().get());
    }
  }
  Token* acquire() {
    std::lock_guard<std::mutex> lock(mutex_);
    TROUPE_CHECK(!free_.empty()) << "more than " << count_ << " batches in flight";
    Token* t = free_.back();
    free_.pop_back();
    ++in_use_;
    int64_t now = ++live_;
    int64_t seen = max_live_.load();
    while (now > seen && !max_live_.compare_exchange_weak(seen, now)) {
    }
    return t;
  }
  void release(Token* t) {
    t->clear();  // frees the samples and the batch before the token is reused
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(t);
    --in_use_;
    --live_;
  }
  // Tokens TBB abandoned (cancelled or failed run) are no longer live;
  // storage_ frees them.
  void forget_in_flight() { live_ -= in_use_; }

 private:
  int64_t count_;
  std::atomic<int64_t>& live_;
  std::atomic<int64_t>& max_live_;
  std::vector<std::unique_ptr<Token>> storage_;
  std::vector<Token*> free_;
  std::mutex mutex_;
  int64_t in_use_ = 0;
};

}  // namespace

// Makes the run's TBB context visible to stop() for as long as run() lasts.
class BatchPipeline::ContextRegistration {
 public:
  ContextRegistration(Tbb& tbb, tbb::task_group_context& context) : tbb_(tbb) {
    std::lock_guard<std::mutex> lock(tbb_.mutex);
    tbb_.context = &context;
  }
  ~ContextRegistration() {
    std::lock_guard<std::mutex> lock(tbb_.mutex);
    tbb_.context = nullptr;
  }

 private:
  Tbb& tbb_;
};

void BatchPipeline::load(Token& t, int64_t epoch, CollateBuffers* buffers) const {
  if (stop_) return;
  // The data set failing on a batch fails on it again at every retry: a
  // ConfigError naming the batch, which TrainJob does not retry.
  try {
    CollateBuffers::Scope scope(buffers);
    t.loaded = dataset_.load_batch(t.indices, epoch);
  } catch (const ConfigError&) {
    throw;
  } catch (const std::exception& e) {
    throw ConfigError(dataset_.describe() + ": loading the batch starting at index " +
                      std::to_string(t.indices.empty() ? -1 : t.indices.front()) + " (epoch " + std::to_string(epoch) +
                      ") failed: " + e.what());
  }
  if (t.loaded) return;
  t.samples.reserve(t.indices.size());
  for (int64_t index : t.indices) {
    if (stop_) break;
    t.samples.push_back(dataset_.get(index, epoch));  // a ConfigError naming the sample when it fails
  }
}

void BatchPipeline::collate(Token& t, int64_t epoch, CollateBuffers* buffers) const {
  if (stop_) return;
  CollateBuffers::Scope scope(buffers);
  t.batch = t.loaded ? loaded_batch(std::move(*t.loaded), std::move(t.indices))
                     : actors::collate(dataset_, std::move(t.samples), std::move(t.indices));
  t.batch.epoch = epoch;
  t.batch.sequence = t.sequence;
}

PipelineStats BatchPipeline::run(const std::vector<int64_t>& indices, int64_t epoch, const BatchSink& sink) {
  TROUPE_CHECK(sink) << "BatchPipeline::run needs a sink";
  PipelineStats stats;
  max_live_ = live_.load();
  const auto n = static_cast<int64_t>(indices.size());
  const int64_t b = options_.batch_size;
  const int64_t num_batches = options_.drop_last ? n / b : (n + b - 1) / b;
  int64_t next = 0;

  tbb::task_group_context context;
  ContextRegistration registration(*tbb_, context);
  // A stop() that came before the context was registered is seen here or by
  // the source's check of stop_.
  if (stop_) context.cancel_group_execution();
  TokenPool<Token> pool(tokens_, live_, max_live_);

  auto source = [&](tbb::flow_control& fc) -> Token* {
    if (next >= num_batches || stop_) {
      fc.stop();
      return nullptr;
    }
    Token* t = pool.acquire();
    t->sequence = next;
    int64_t begin = next * b;
    t->indices.assign(indices.begin() + begin, indices.begin() + std::min(begin + b, n));
    ++next;
    return t;
  };
  // This run's batch tensors, written again once their batches are gone.
  CollateBuffers own_buffers(static_cast<size_t>(tokens_) + kReusedInFlight);
  CollateBuffers* buffers = options_.collate_buffers ? options_.collate_buffers : &own_buffers;
  auto load_stage = [&](Token* t) -> Token* {
    load(*t, epoch, buffers);
    return t;
  };
  auto collate_stage = [&](Token* t) -> Token* {
    collate(*t, epoch, buffers);
    return t;
  };
  auto push = [&](Token* t) {
    if (!stop_) {
      int64_t rows = t->batch.size();
      try {
        sink(std::move(t->batch));
      } catch (...) {
        pool.release(t);
        throw;
      }
      ++stats.batches;
      stats.samples += rows;
    }
    pool.release(t);
  };

  try {
    tbb_->arena.execute([&] {
      tbb::parallel_pipeline(static_cast<size_t>(tokens_),
                             tbb::make_filter<void, Token*>(tbb::filter_mode::serial_in_order, source) &
                                 tbb::make_filter<Token*, Token*>(tbb::filter_mode::parallel, load_stage) &
                                 tbb::make_filter<Token*, Token*>(tbb::filter_mode::parallel, collate_stage) &
                                 tbb::make_filter<Token*, void>(tbb::filter_mode::serial_in_order, push),
                             context);
    });
  } catch (...) {
    pool.forget_in_flight();
    throw;
  }
  pool.forget_in_flight();
  stats.max_live_batches = max_live_.load();
  stats.stopped = stop_.load();
  return stats;
}

}  // namespace troupe::actors
