#include "troupe/actors/batch_pipeline.h"

#include <tbb/parallel_pipeline.h>
#include <tbb/task_arena.h>
#include <tbb/task_group.h>

#include <mutex>
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
  Batch batch;

  void clear() {
    indices.clear();
    samples.clear();
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

PipelineStats BatchPipeline::run(const std::vector<int64_t>& indices, int64_t epoch, const BatchSink& sink) {
  TROUPE_CHECK(sink) << "BatchPipeline::run needs a sink";
  PipelineStats stats;
  max_live_ = live_.load();
  const auto n = static_cast<int64_t>(indices.size());
  const int64_t b = options_.batch_size;
  const int64_t num_batches = options_.drop_last ? n / b : (n + b - 1) / b;
  int64_t next = 0;

  tbb::task_group_context context;
  {
    std::lock_guard<std::mutex> lock(tbb_->mutex);
    tbb_->context = &context;
  }
  struct Unregister {
    Tbb* tbb;
    ~Unregister() {
      std::lock_guard<std::mutex> lock(tbb->mutex);
      tbb->context = nullptr;
    }
  } unregister{tbb_.get()};
  // A stop() that came before the context was registered is seen here or by
  // the source's check of stop_.
  if (stop_) context.cancel_group_execution();

  // Token storage. At most tokens_ are in flight, so a free list of that
  // many is never empty when the source asks; `in_use` counts those handed
  // to TBB and not yet returned by the last stage.
  std::vector<std::unique_ptr<Token>> storage;
  std::vector<Token*> free_list;
  std::mutex free_mutex;
  int64_t in_use = 0;
  for (int64_t k = 0; k < tokens_; ++k) {
    storage.push_back(std::make_unique<Token>());
    free_list.push_back(storage.back().get());
  }
  auto acquire = [&]() -> Token* {
    std::lock_guard<std::mutex> lock(free_mutex);
    TROUPE_CHECK(!free_list.empty()) << "more than " << tokens_ << " batches in flight";
    Token* t = free_list.back();
    free_list.pop_back();
    ++in_use;
    int64_t now = ++live_;
    int64_t seen = max_live_.load();
    while (now > seen && !max_live_.compare_exchange_weak(seen, now)) {
    }
    return t;
  };
  auto release = [&](Token* t) {
    t->clear();  // frees the samples and the batch before the token is reused
    std::lock_guard<std::mutex> lock(free_mutex);
    free_list.push_back(t);
    --in_use;
    --live_;
  };

  auto source = [&](tbb::flow_control& fc) -> Token* {
    if (next >= num_batches || stop_) {
      fc.stop();
      return nullptr;
    }
    Token* t = acquire();
    t->sequence = next;
    int64_t begin = next * b;
    int64_t end = std::min(begin + b, n);
    t->indices.assign(indices.begin() + begin, indices.begin() + end);
    ++next;
    return t;
  };
  auto load = [&](Token* t) -> Token* {
    t->samples.reserve(t->indices.size());
    for (int64_t index : t->indices) {
      if (stop_) break;
      t->samples.push_back(dataset_.get(index, epoch));
    }
    return t;
  };
  auto collate_stage = [&](Token* t) -> Token* {
    if (stop_) return t;
    t->batch = collate(std::move(t->samples), std::move(t->indices));
    t->batch.epoch = epoch;
    t->batch.sequence = t->sequence;
    return t;
  };
  auto push = [&](Token* t) {
    if (!stop_) {
      int64_t rows = t->batch.size();
      try {
        sink(std::move(t->batch));
      } catch (...) {
        release(t);
        throw;
      }
      ++stats.batches;
      stats.samples += rows;
    }
    release(t);
  };

  try {
    tbb_->arena.execute([&] {
      tbb::parallel_pipeline(static_cast<size_t>(tokens_),
                             tbb::make_filter<void, Token*>(tbb::filter_mode::serial_in_order, source) &
                                 tbb::make_filter<Token*, Token*>(tbb::filter_mode::parallel, load) &
                                 tbb::make_filter<Token*, Token*>(tbb::filter_mode::serial_in_order, collate_stage) &
                                 tbb::make_filter<Token*, void>(tbb::filter_mode::serial_in_order, push),
                             context);
    });
  } catch (...) {
    live_ -= in_use;  // tokens TBB abandoned; `storage` frees them
    throw;
  }
  live_ -= in_use;
  stats.max_live_batches = max_live_.load();
  stats.stopped = stop_.load();
  return stats;
}

}  // namespace troupe::actors
