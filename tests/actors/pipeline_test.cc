// BatchPipeline: every index exactly once and in order, identical results for
// any thread count, memory bounded by the token count under a slow sink,
// stop(), and errors from loading or from the sink.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <numeric>
#include <set>
#include <stdexcept>
#include <thread>

#include "troupe/actors/batch_pipeline.h"
#include "troupe/actors/distributed_sampler.h"
#include "troupe/actors/image_dataset.h"
#include "troupe/actors/synthetic_dataset.h"
#include "troupe/runtime/core/errors.h"

namespace troupe::actors {
namespace {

// A tensor's values as int64s, for readable EXPECT_EQs.
std::vector<int64_t> to_longs(const torch::Tensor& t) {
  auto c = t.to(torch::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// A data set whose samples count themselves: the input tensor's deleter
// decrements `live`, so the test sees how many samples exist at any moment.
class CountingDataset final : public Dataset {
 public:
  explicit CountingDataset(int64_t n, int64_t fail_at = -1) : n_(n), fail_at_(fail_at) {}
  int64_t size() const override { return n_; }
  std::string describe() const override { return "counting"; }

  mutable std::atomic<int64_t> live{0};
  mutable std::atomic<int64_t> max_live{0};
  mutable std::atomic<int64_t> loads{0};

 protected:
  Sample load(int64_t index, int64_t epoch) const override {
    if (index == fail_at_) throw std::runtime_error("cannot load sample " + std::to_string(index));
    ++loads;
    int64_t now = ++live;
    int64_t seen = max_live.load();
    while (now > seen && !max_live.compare_exchange_weak(seen, now)) {
    }
    auto* data = new float[256];
    for (int k = 0; k < 256; ++k) data[k] = float(index);
    auto* counter = &live;
    auto input = torch::from_blob(
        data, {256},
        [counter](void* p) {
          delete[] static_cast<float*>(p);
          --*counter;
        },
        torch::kFloat);
    return {{"input", input}, {"target", torch::scalar_tensor(index + 1000 * epoch, torch::kLong)}};
  }

 private:
  int64_t n_;
  int64_t fail_at_;
};

std::vector<int64_t> shuffled(int64_t n, int64_t seed) {
  return DistributedSampler({.dataset_size = n, .world_size = 1, .seed = seed}).indices(0, 0);
}

TEST(BatchPipeline, DeliversEveryIndexOnceInOrder) {
  SyntheticClassification ds({.size = 1000, .num_features = 6, .num_classes = 5, .seed = 2});
  auto indices = shuffled(1000, 8);
  for (bool drop_last : {false, true}) {
    BatchPipeline pipe(ds, {.batch_size = 32, .num_threads = 2, .drop_last = drop_last});
    std::vector<int64_t> got;
    int64_t expect_sequence = 0;
    auto stats = pipe.run(indices, 4, [&](Batch&& b) {
      EXPECT_EQ(b.sequence, expect_sequence++);
      EXPECT_EQ(b.epoch, 4);
      EXPECT_EQ(b.tensors.at("input").sizes(), (std::vector<int64_t>{b.size(), 6}));
      EXPECT_EQ(b.tensors.get("target").sizes(), (std::vector<int64_t>{b.size()}));
      // Rows are the samples of the listed indices.
      for (int64_t r = 0; r < b.size(); r += 7) {
        EXPECT_TRUE(b.tensors.at("input")[r].equal(ds.get(b.indices[r]).at("input")));
        EXPECT_EQ(b.tensors.get("target")[r].item<int64_t>(), ds.get(b.indices[r]).get("target").item<int64_t>());
      }
      got.insert(got.end(), b.indices.begin(), b.indices.end());
    });
    if (drop_last) {
      EXPECT_EQ(stats.batches, 31);
      EXPECT_EQ(got, std::vector<int64_t>(indices.begin(), indices.begin() + 31 * 32));
    } else {
      EXPECT_EQ(stats.batches, 32);  // the last one has 8 rows
      EXPECT_EQ(got, indices);
    }
    EXPECT_EQ(stats.samples, static_cast<int64_t>(got.size()));
    EXPECT_FALSE(stats.stopped);
    EXPECT_EQ(pipe.live_batches(), 0);
  }
}

TEST(BatchPipeline, SameBatchesForAnyThreadCount) {
  auto ds = ImageRecordDataset::synthetic(
      {.size = 300, .channels = 3, .height = 20, .width = 20, .seed = 5},
      {.crop = 16, .flip = true, .mean = {0.5, 0.4, 0.3}, .std = {0.2, 0.2, 0.2}, .seed = 6});
  auto indices = shuffled(300, 1);
  std::vector<Batch> reference;
  BatchPipeline one(*ds, {.batch_size = 16, .num_threads = 1});
  one.run(indices, 2, [&](Batch&& b) { reference.push_back(std::move(b)); });
  ASSERT_EQ(reference.size(), 19u);
  for (int threads : {2, 4}) {
    BatchPipeline many(*ds, {.batch_size = 16, .num_threads = threads, .prefetch_depth = 3});
    size_t k = 0;
    many.run(indices, 2, [&](Batch&& b) {
      ASSERT_LT(k, reference.size());
      EXPECT_TRUE(b.tensors.at("input").equal(reference[k].tensors.at("input")))
          << "batch " << k << " with " << threads << " threads";
      EXPECT_TRUE(b.tensors.get("target").equal(reference[k].tensors.get("target")));
      ++k;
    });
    EXPECT_EQ(k, reference.size());
  }
  // Another epoch: other augmentations.
  std::vector<Batch> epoch3;
  one.run(indices, 3, [&](Batch&& b) { epoch3.push_back(std::move(b)); });
  EXPECT_FALSE(epoch3[0].tensors.at("input").equal(reference[0].tensors.at("input")));
}

TEST(BatchPipeline, MemoryStaysBoundedWithSlowSink) {
  CountingDataset ds(4000);
  const int64_t batch = 8;
  BatchPipeline pipe(ds, {.batch_size = batch, .num_threads = 2, .prefetch_depth = 2});
  ASSERT_EQ(pipe.max_live_tokens(), 4);
  std::vector<int64_t> indices(4000);
  std::iota(indices.begin(), indices.end(), 0);
  int64_t max_seen_in_sink = 0;
  int64_t delivered = 0;
  auto stats = pipe.run(indices, 0, [&](Batch&& b) {
    // A slow consumer: while it works, the loaders must not race ahead.
    max_seen_in_sink = std::max(max_seen_in_sink, pipe.live_batches());
    if (delivered++ % 10 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  });
  EXPECT_EQ(stats.batches, 500);
  EXPECT_LE(stats.max_live_batches, pipe.max_live_tokens());
  EXPECT_LE(max_seen_in_sink, pipe.max_live_tokens());
  // Samples exist only inside tokens: at most one batch's worth per token.
  EXPECT_LE(ds.max_live.load(), pipe.max_live_tokens() * batch);
  EXPECT_EQ(ds.live.load(), 0);
  EXPECT_EQ(ds.loads.load(), 4000);

  // A tighter explicit bound holds too.
  CountingDataset ds2(800);
  BatchPipeline tight(ds2, {.batch_size = batch, .num_threads = 2, .max_live_tokens = 1});
  std::vector<int64_t> idx2(indices.begin(), indices.begin() + 800);
  auto s2 = tight.run(idx2, 0, [&](Batch&&) { std::this_thread::sleep_for(std::chrono::microseconds(300)); });
  EXPECT_EQ(s2.batches, 100);
  EXPECT_EQ(s2.max_live_batches, 1);
  EXPECT_LE(ds2.max_live.load(), batch);
}

TEST(BatchPipeline, StopEndsTheRunFromAnotherThread) {
  CountingDataset ds(100000);
  std::vector<int64_t> indices(100000);
  std::iota(indices.begin(), indices.end(), 0);
  BatchPipeline pipe(ds, {.batch_size = 10, .num_threads = 2});
  std::mutex m;
  std::condition_variable cv;
  int64_t delivered = 0;
  std::thread stopper([&] {
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return delivered >= 5; });
    lock.unlock();
    pipe.stop();
  });
  auto stats = pipe.run(indices, 0, [&](Batch&&) {
    std::lock_guard<std::mutex> lock(m);
    ++delivered;
    cv.notify_all();
  });
  stopper.join();
  EXPECT_TRUE(stats.stopped);
  EXPECT_GE(stats.batches, 5);
  EXPECT_LT(stats.batches, 10000);
  EXPECT_EQ(pipe.live_batches(), 0);
  EXPECT_EQ(ds.live.load(), 0);
  // Stopped for good: a later run delivers nothing.
  auto again = pipe.run(indices, 1, [&](Batch&&) { ADD_FAILURE() << "sink called after stop"; });
  EXPECT_TRUE(again.stopped);
  EXPECT_EQ(again.batches, 0);
}

// Collates of different batches run side by side (a collate that copies
// megabytes must not make the loader one thread wide), while batches still
// reach the sink in order. Each collate waits, for at most 10 s in all,
// until another one runs beside it; a pipeline that collated one batch at a
// time would never let two meet.
TEST(BatchPipeline, CollatesOfDifferentBatchesRunAtOnce) {
  class MeetingCollates final : public Dataset {
   public:
    int64_t size() const override { return 64; }
    std::string describe() const override { return "meeting_collates"; }
    TensorDict collate(std::vector<Sample>&& samples) const override {
      {
        std::unique_lock lock(mu_);
        if (++inside_ >= 2) met_ = true;
        cv_.notify_all();
        if (!gave_up_ && !cv_.wait_until(lock, deadline_, [&] { return met_; })) gave_up_ = true;
        --inside_;
      }
      return stack_collate(samples);
    }
    bool met() const {
      std::lock_guard lock(mu_);
      return met_;
    }

   protected:
    Sample load(int64_t index, int64_t) const override {
      return {{"input", torch::full({4}, float(index))}, {"target", torch::scalar_tensor(index, torch::kLong)}};
    }

   private:
    mutable std::mutex mu_;
    mutable std::condition_variable cv_;
    mutable int inside_ = 0;
    mutable bool met_ = false, gave_up_ = false;
    const std::chrono::steady_clock::time_point deadline_ = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  };
  MeetingCollates ds;
  std::vector<int64_t> indices(64);
  std::iota(indices.begin(), indices.end(), 0);
  BatchPipeline pipe(ds, {.batch_size = 8, .num_threads = 2});
  std::vector<int64_t> firsts;
  pipe.run(indices, 0, [&](Batch&& b) { firsts.push_back(to_longs(b.tensors.at("target"))[0]); });
  EXPECT_TRUE(ds.met()) << "no two collates ever ran at once";
  EXPECT_EQ(firsts, (std::vector<int64_t>{0, 8, 16, 24, 32, 40, 48, 56}));
}

TEST(BatchPipeline, ErrorsFromSinkAndLoadComeOutOfRun) {
  std::vector<int64_t> indices(2000);
  std::iota(indices.begin(), indices.end(), 0);
  {
    CountingDataset ds(2000);
    BatchPipeline pipe(ds, {.batch_size = 10, .num_threads = 2});
    int64_t calls = 0;
    EXPECT_THROW(pipe.run(indices, 0,
                          [&](Batch&&) {
                            if (++calls == 3) throw Aborted("consumer went away");
                          }),
                 Aborted);
    EXPECT_EQ(calls, 3);
    EXPECT_EQ(pipe.live_batches(), 0);
    EXPECT_EQ(ds.live.load(), 0);  // batches in flight were freed
  }
  {
    CountingDataset ds(2000, /*fail_at=*/555);
    BatchPipeline pipe(ds, {.batch_size = 10, .num_threads = 2});
    int64_t last = -1;
    try {
      pipe.run(indices, 0, [&](Batch&& b) { last = b.indices.back(); });
      ADD_FAILURE() << "no exception";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("555"), std::string::npos);
    }
    EXPECT_LT(last, 555);  // nothing after the failed batch was delivered
    EXPECT_EQ(ds.live.load(), 0);
  }
  CountingDataset ds(10);
  EXPECT_THROW(BatchPipeline(ds, {.batch_size = 0}), ConfigError);
  EXPECT_THROW(BatchPipeline(ds, {.num_threads = 0}), ConfigError);
}

TEST(Collate, StacksAndNamesMismatches) {
  std::vector<Sample> s = {{{"input", torch::ones({2, 3})}, {"target", torch::scalar_tensor(1, torch::kLong)}},
                           {{"input", torch::zeros({2, 3})}, {"target", torch::scalar_tensor(2, torch::kLong)}}};
  auto b = collate(std::move(s), {7, 9});
  EXPECT_EQ(b.tensors.at("input").sizes(), (std::vector<int64_t>{2, 2, 3}));
  EXPECT_EQ(to_longs(b.tensors.get("target")), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(b.indices, (std::vector<int64_t>{7, 9}));
  std::vector<Sample> bad = {
      {{"input", torch::ones({3})}}, {{"input", torch::ones({3})}}, {{"input", torch::ones({4})}}};
  try {
    collate(std::move(bad));
    ADD_FAILURE() << "no exception";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sample 2"), std::string::npos) << e.what();
  }
  std::vector<Sample> no_target = {{{"input", torch::ones({3})}}, {{"input", torch::ones({3})}}};
  EXPECT_FALSE(collate(std::move(no_target)).tensors.get("target").defined());
  // Samples with different keys are named, not stacked.
  std::vector<Sample> ragged_keys = {{{"input", torch::ones({3})}}, {{"x", torch::ones({3})}}};
  try {
    collate(std::move(ragged_keys));
    ADD_FAILURE() << "no exception";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sample 1"), std::string::npos) << e.what();
  }
}

// Stacked batches go into kept tensors only once nothing holds them: a
// batch in hand, a view of it or a detached handle (an encoded frame's
// owner) keeps its memory from being written over.
TEST(Collate, BuffersAreWrittenAgainOnlyOnceReleased) {
  auto samples = [](float v) {
    return std::vector<Sample>{{{"input", torch::full({4}, v)}}, {{"input", torch::full({4}, v + 1)}}};
  };
  CollateBuffers buffers(2);
  CollateBuffers::Scope scope(&buffers);
  auto first = stack_collate(samples(1)).at("input");
  const void* memory = first.data_ptr();
  auto held = stack_collate(samples(10)).at("input");  // `first` is still held
  EXPECT_NE(held.data_ptr(), memory);
  EXPECT_EQ(first[0][0].item<float>(), 1);
  auto view = first.view({8});
  auto detached = first.detach();
  first = torch::Tensor();
  auto third = stack_collate(samples(20)).at("input");  // `first`'s memory still viewed
  EXPECT_NE(third.data_ptr(), memory);
  EXPECT_EQ(view[0].item<float>(), 1);
  view = torch::Tensor();
  auto fourth = stack_collate(samples(30)).at("input");  // a detached handle remains
  EXPECT_NE(fourth.data_ptr(), memory);
  EXPECT_EQ(detached[0][0].item<float>(), 1);
  detached = torch::Tensor();
  auto reused = stack_collate(samples(40)).at("input");
  EXPECT_EQ(reused.data_ptr(), memory);
  EXPECT_EQ(to_longs(reused), (std::vector<int64_t>{40, 40, 40, 40, 41, 41, 41, 41}));
  EXPECT_LE(buffers.kept(), 2u);
  // Another shape (the short last batch) is a tensor of its own.
  std::vector<Sample> one = {{{"input", torch::full({4}, 5.0f)}}};
  EXPECT_EQ(stack_collate(one).at("input").sizes(), (std::vector<int64_t>{1, 4}));
}

// A loader's runs share one set: later epochs stack into the first one's
// memory while the consumer drops each batch, and a consumer that keeps
// every batch still sees each one's own values.
TEST(BatchPipeline, RunsSharingCollateBuffersReuseReleasedBatches) {
  SyntheticClassification ds({.size = 256, .num_features = 6, .num_classes = 5, .seed = 2});
  auto indices = shuffled(256, 8);
  CollateBuffers buffers(8);
  BatchPipeline pipe(ds, {.batch_size = 32, .num_threads = 2, .collate_buffers = &buffers});
  std::set<const void*> first_run, second_run;
  pipe.run(indices, 0, [&](Batch&& b) { first_run.insert(b.tensors.at("input").data_ptr()); });
  pipe.run(indices, 1, [&](Batch&& b) { second_run.insert(b.tensors.at("input").data_ptr()); });
  // Batches alive at once are bounded by the tokens (2 threads + prefetch
  // 2), and memory is fresh only when every kept buffer is taken: 4
  // addresses at most over both runs' 16 batches.
  std::set<const void*> both(first_run);
  both.insert(second_run.begin(), second_run.end());
  EXPECT_LE(both.size(), 4u) << "the runs took fresh memory";
  std::vector<Batch> kept;
  pipe.run(indices, 2, [&](Batch&& b) { kept.push_back(std::move(b)); });
  ASSERT_EQ(kept.size(), 8u);
  for (const Batch& b : kept)
    for (int64_t r = 0; r < b.size(); ++r)
      ASSERT_TRUE(b.tensors.at("input")[r].equal(ds.get(b.indices[r]).at("input"))) << "batch " << b.sequence;
}

// Batches cross the wire as dtype + shape + bytes; large tensors as
// attachments that the decoded tensor views without a copy.
TEST(BatchCodec, RoundTripsTensorsThroughAttachments) {
  Batch b;
  b.tensors.set("input", torch::randn({64, 3, 8, 8}));       // 48 KiB: an attachment
  b.tensors.set("target", torch::arange(64, torch::kLong));  // 512 B: inline
  b.samples = 64;
  b.indices = {5, 3, 1};
  b.epoch = 2;
  b.sequence = 9;
  auto enc = wire::encode_value(b);
  ASSERT_EQ(enc.attachments().size(), 1u);
  EXPECT_LT(enc.bytes().size(), 1024u);
  // Encoding shares the tensor's memory instead of copying it.
  EXPECT_EQ(static_cast<const void*>(enc.attachments()[0].data()), b.tensors.at("input").data_ptr());
  auto back = wire::decode_value<Batch>(enc.bytes().data(), enc.bytes().size(), &enc.attachments());
  EXPECT_TRUE(back.tensors.at("input").equal(b.tensors.at("input")));
  EXPECT_TRUE(back.tensors.get("target").equal(b.tensors.get("target")));
  EXPECT_EQ(back.indices, b.indices);
  EXPECT_EQ(back.epoch, 2);
  EXPECT_EQ(back.sequence, 9);
  EXPECT_EQ(back.tensors.at("input").data_ptr(), static_cast<const void*>(enc.attachments()[0].data()));

  // Non-contiguous, half, bool, empty and undefined tensors.
  Sample s{{"input", torch::arange(12, torch::kFloat).reshape({3, 4}).t().to(torch::kHalf)},
           {"target", torch::Tensor()}};
  auto s_enc = wire::encode_value(s);
  auto s_back = wire::decode_value<Sample>(s_enc.bytes().data(), s_enc.bytes().size(), &s_enc.attachments());
  EXPECT_TRUE(s_back.at("input").equal(s.at("input").contiguous()));
  EXPECT_FALSE(s_back.get("target").defined());
  for (auto t : {torch::eye(3, torch::kBool), torch::empty({0, 5}), torch::scalar_tensor(7, torch::kLong)}) {
    auto e = wire::encode_value(t);
    auto r = wire::decode_value<torch::Tensor>(e.bytes().data(), e.bytes().size(), &e.attachments());
    EXPECT_TRUE(r.equal(t));
  }
  // Damaged bytes are a DecodeError, never a crash.
  auto bytes = enc.bytes();
  EXPECT_THROW(wire::decode_value<Batch>(bytes.data(), 10, &enc.attachments()), DecodeError);
  EXPECT_THROW(wire::decode_value<Batch>(bytes.data(), bytes.size(), nullptr), DecodeError);
  bytes[1] = 99;  // dtype
  EXPECT_THROW(wire::decode_value<Batch>(bytes.data(), bytes.size(), &enc.attachments()), DecodeError);
}

}  // namespace
}  // namespace troupe::actors
