// DataLoaderActor in real worker processes on a two-node LocalCluster:
// exactly-once delivery of an epoch across two trainers (one loader per
// trainer, and one shared loader), deterministic transforms, errors that name
// the file, bounded memory under a slow reader, a killed loader, and stop.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/temp_dir.h"
#include "tests/support/wait.h"
#include "troupe/actors/data_loader_actor.h"
#include "troupe/runtime/core/files.h"
#include "troupe/runtime/testing/local_cluster.h"

using namespace std::chrono_literals;
using troupe::ActorHandle;
using troupe::StreamReader;
using troupe::actors::Batch;
using troupe::actors::DataLoaderActor;
using troupe::actors::DatasetSpec;
using troupe::actors::DistributedSampler;
using troupe::actors::LoaderConfig;
using troupe::actors::SamplerCursor;
using troupe::test::kWaitBound;
using Loader = ActorHandle<DataLoaderActor>;

namespace {

namespace fs = std::filesystem;

using troupe::test::eventually;

LoaderConfig classification(int64_t size) {
  LoaderConfig c;
  c.dataset = DatasetSpec("synthetic_classification").set("size", size).set("num_features", 4).set("seed", 7);
  c.batch_size = 32;
  c.seed = 5;
  c.threads = 2;
  return c;
}

// Image records with every random transform on.
LoaderConfig images(int64_t size, int64_t side, int64_t crop) {
  LoaderConfig c;
  c.dataset = DatasetSpec("image_records")
                  .set("size", size)
                  .set("channels", 3)
                  .set("height", side)
                  .set("width", side)
                  .set("seed", 11)
                  .set("flip", 1)
                  .set("mean", {0.485, 0.456, 0.406})
                  .set("std", {0.229, 0.224, 0.225});
  if (crop) c.dataset.set("crop", crop);
  c.batch_size = 16;
  c.seed = 3;
  return c;
}

// Reads a stream to its end on another thread (as a trainer would).
class Drain {
 public:
  explicit Drain(StreamReader<Batch>& r)
      : thread_([this, &r] {
          try {
            while (auto b = r.read(kWaitBound)) batches_.push_back(std::move(*b));
          } catch (...) {
            error_ = std::current_exception();
          }
        }) {}
  std::vector<Batch> get() {
    thread_.join();
    if (error_) std::rethrow_exception(error_);
    return std::move(batches_);
  }

 private:
  std::vector<Batch> batches_;
  std::exception_ptr error_;
  std::thread thread_;
};

// Each rank got exactly its DistributedSampler indices, in order, in
// consecutive batches of `epoch`, with the data set's rows; together the
// ranks cover the data set exactly once.
void expect_epoch_once(const std::vector<std::vector<Batch>>& per_rank, const LoaderConfig& config, int64_t epoch) {
  auto dataset = troupe::actors::make_dataset(config.dataset);
  const int64_t n = dataset->size();
  DistributedSampler sampler({.dataset_size = n,
                              .world_size = static_cast<int64_t>(per_rank.size()),
                              .shuffle = config.shuffle,
                              .seed = config.seed});
  std::vector<int> seen(n, 0);
  for (size_t rank = 0; rank < per_rank.size(); ++rank) {
    std::vector<int64_t> got;
    for (size_t s = 0; s < per_rank[rank].size(); ++s) {
      const Batch& b = per_rank[rank][s];
      EXPECT_EQ(b.sequence, static_cast<int64_t>(s));
      EXPECT_EQ(b.epoch, epoch);
      ASSERT_EQ(b.size(), static_cast<int64_t>(b.indices.size()));
      for (size_t row = 0; row < b.indices.size(); ++row) {
        int64_t i = b.indices[row];
        ASSERT_TRUE(i >= 0 && i < n) << i;
        ++seen[i];
        got.push_back(i);
        ASSERT_TRUE(torch::equal(b.tensors.at("input")[row], dataset->get(i, epoch).at("input")))
            << "row of sample " << i;
        ASSERT_EQ(b.tensors.get("target")[row].item<int64_t>(), dataset->get(i, epoch).get("target").item<int64_t>());
      }
    }
    EXPECT_EQ(got, sampler.indices(epoch, static_cast<int64_t>(rank))) << "rank " << rank;
  }
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(seen[i], 1) << "sample " << i;
}

class DataLoaderTest : public ::testing::Test {
 protected:
  DataLoaderTest() : rt_(cluster_.connect()) {}

  Loader spawn(const LoaderConfig& config, int max_concurrency = 1) {
    auto h = rt_.spawn<DataLoaderActor>({.resources = {{"CPU", 1}}, .max_concurrency = max_concurrency}, config);
    EXPECT_TRUE(h.wait_ready(kWaitBound));
    return h;
  }

  troupe::testing::LocalCluster cluster_;  // two nodes with 2 CPUs each
  troupe::Runtime rt_;
};

TEST_F(DataLoaderTest, OneLoaderPerTrainerDeliversTheEpochExactlyOnce) {
  const LoaderConfig config = classification(1000);
  Loader l0 = spawn(config), l1 = spawn(config);
  const SamplerCursor cursor{.epoch = 3, .world_size = 2};
  StreamReader<Batch> r0(rt_, config.credits), r1(rt_, config.credits);
  auto f0 = l0.call(&DataLoaderActor::feed, r0.ref(), cursor, 0, 0);
  auto f1 = l1.call(&DataLoaderActor::feed, r1.ref(), cursor, 1, 0);
  Drain d0(r0), d1(r1);
  std::vector<std::vector<Batch>> got{d0.get(), d1.get()};
  EXPECT_EQ(f0.get(kWaitBound), 16);  // 500 samples per rank in batches of 32
  EXPECT_EQ(f1.get(kWaitBound), 16);
  expect_epoch_once(got, config, 3);
}

TEST_F(DataLoaderTest, SharedLoaderFeedsTwoTrainersAtOnce) {
  const LoaderConfig config = classification(1000);
  Loader loader = spawn(config, /*max_concurrency=*/2);
  const SamplerCursor cursor{.epoch = 1, .world_size = 2};
  StreamReader<Batch> r0(rt_, config.credits), r1(rt_, config.credits);
  auto f0 = loader.call(&DataLoaderActor::feed, r0.ref(), cursor, 0, 0);
  auto f1 = loader.call(&DataLoaderActor::feed, r1.ref(), cursor, 1, 0);
  // Neither feed can finish while its reader holds back, so a first batch on
  // both streams means both pipelines run at once in the one actor.
  std::vector<std::vector<Batch>> got(2);
  got[0].push_back(std::move(*r0.read(kWaitBound)));
  got[1].push_back(std::move(*r1.read(kWaitBound)));
  EXPECT_EQ(troupe::actors::loader_stats(loader).feeds_running, 2);
  Drain d0(r0), d1(r1);
  for (int rank = 0; rank < 2; ++rank) {
    for (auto& b : (rank == 0 ? d0 : d1).get()) got[rank].push_back(std::move(b));
  }
  EXPECT_EQ(f0.get(kWaitBound), 16);
  EXPECT_EQ(f1.get(kWaitBound), 16);
  expect_epoch_once(got, config, 1);
}

TEST_F(DataLoaderTest, TransformsAreDeterministicUnderASeed) {
  const LoaderConfig config = images(96, 20, 16);
  Loader a = spawn(config), b = spawn(config);
  auto run = [&](const Loader& l, int64_t epoch) {
    StreamReader<Batch> r(rt_, config.credits);
    auto f = l.call(&DataLoaderActor::feed, r.ref(), SamplerCursor{.epoch = epoch}, 0, 0);
    auto batches = Drain(r).get();
    EXPECT_EQ(f.get(kWaitBound), 6);
    return batches;
  };
  auto first = run(a, 2), second = run(b, 2), next_epoch = run(a, 3);
  ASSERT_EQ(first.size(), second.size());
  for (size_t s = 0; s < first.size(); ++s) {
    EXPECT_EQ(first[s].indices, second[s].indices);
    ASSERT_EQ(first[s].tensors.at("input").sizes(), (std::vector<int64_t>{16, 3, 16, 16}));
    EXPECT_TRUE(torch::equal(first[s].tensors.at("input"), second[s].tensors.at("input"))) << "batch " << s;
    EXPECT_TRUE(torch::equal(first[s].tensors.get("target"), second[s].tensors.get("target"))) << "batch " << s;
  }
  // Two processes agree with each other and with this one; another epoch
  // draws other crops and flips.
  expect_epoch_once({first}, config, 2);
  auto sample0 = [](const std::vector<Batch>& bs, int64_t index) {
    for (const auto& b : bs)
      for (size_t row = 0; row < b.indices.size(); ++row)
        if (b.indices[row] == index) return b.tensors.at("input")[row];
    return torch::Tensor();
  };
  EXPECT_FALSE(torch::equal(sample0(first, 0), sample0(next_epoch, 0)));
}

TEST_F(DataLoaderTest, CorruptOrMissingNpyFailsTheCallAndTheStreamNamingTheFile) {
  std::string tmpl = (fs::temp_directory_path() / "troupe_loader_XXXXXX").string();
  ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
  const fs::path dir = tmpl;
  const std::string corrupt = (dir / "corrupt.npy").string();
  const std::string missing = (dir / "missing.npy").string();
  {
    std::ofstream f(corrupt, std::ios::binary);
    f << "\x93NUMPY\x01\x00garbage that is not a header";
  }
  for (const std::string& path : {corrupt, missing}) {
    LoaderConfig config;
    config.dataset = DatasetSpec("npy").set("inputs", path);
    Loader loader = spawn(config);
    StreamReader<Batch> r(rt_, 4);
    auto f = loader.call(&DataLoaderActor::feed, r.ref(), SamplerCursor{}, 0, 0);
    try {
      r.read(kWaitBound);
      ADD_FAILURE() << "read did not throw for " << path;
    } catch (const troupe::StreamError& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
    try {
      f.get(kWaitBound);
      ADD_FAILURE() << "feed did not throw for " << path;
    } catch (const troupe::RemoteError& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
    // The loader survives its error and answers the next call the same way.
    EXPECT_THROW(loader.call(&DataLoaderActor::dataset_size).get(kWaitBound), troupe::RemoteError);
  }
  troupe::core::remove_tree(dir);
}

// A shipped file is read from its host's copy, but what the loader says
// names the driver's path (the copy's name, SESSION/shipped/DIGEST-NAME,
// means nothing to the user): the stream's error, the feed's and a later
// call's.
TEST_F(DataLoaderTest, AShippedFilesErrorsNameTheDriversPath) {
  const fs::path dir = troupe::test::fresh_dir("loader-shipped");
  const fs::path session = dir / "session";
  fs::create_directories(session);
  fs::permissions(session, fs::perms::owner_all, fs::perm_options::replace);
  const std::string corrupt = (dir / "corrupt.npy").string();
  std::ofstream(corrupt, std::ios::binary) << "\x93NUMPY\x01\x00garbage that is not a header";
  LoaderConfig config;
  config.dataset = DatasetSpec("npy").set("inputs", corrupt);
  config.shipped_files = {troupe::ship_file(rt_, corrupt)};
  Loader loader = rt_.spawn<DataLoaderActor>(
      {.resources = {{"CPU", 1}}, .env = {"TROUPE_SESSION_DIR=" + session.string()}}, config);
  StreamReader<Batch> r(rt_, 4);
  auto f = loader.call(&DataLoaderActor::feed, r.ref(), SamplerCursor{}, 0, 0);
  auto names_the_drivers_path = [&](const std::string& what) {
    EXPECT_NE(what.find(corrupt), std::string::npos) << what;
    EXPECT_EQ(what.find("/shipped/"), std::string::npos) << what;
  };
  try {
    r.read(kWaitBound);
    ADD_FAILURE() << "read did not throw";
  } catch (const troupe::StreamError& e) {
    names_the_drivers_path(e.what());
  }
  try {
    f.get(kWaitBound);
    ADD_FAILURE() << "feed did not throw";
  } catch (const troupe::RemoteError& e) {
    names_the_drivers_path(e.what());
  }
  try {
    loader.call(&DataLoaderActor::dataset_size).get(kWaitBound);
    ADD_FAILURE() << "dataset_size did not throw";
  } catch (const troupe::RemoteError& e) {
    names_the_drivers_path(e.what());
  }
  // It read the copy.
  EXPECT_FALSE(fs::is_empty(session / "shipped"));
  rt_.kill(loader);
  troupe::core::remove_tree(dir);
}

TEST_F(DataLoaderTest, SlowReaderKeepsTheLoadersMemoryBounded) {
  // 3×64×64 float batches of 64: 3.1 MB each, 200 MB over the epoch.
  LoaderConfig config = images(4096, 64, 0);
  config.batch_size = 64;
  config.credits = 2;
  const int64_t total = 4096 / 64;
  const int64_t batch_bytes = 64 * 3 * 64 * 64 * 4;
  Loader loader = spawn(config);
  StreamReader<Batch> r(rt_, config.credits);
  auto f = loader.call(&DataLoaderActor::feed, r.ref(), SamplerCursor{}, 0, 0);
  ASSERT_TRUE(r.read(kWaitBound).has_value());
  const auto base = troupe::actors::loader_stats(loader);  // data set open, pipeline under way
  int64_t most_live = 0;
  size_t most_buffered = 0;
  for (int64_t i = 1; i < total; ++i) {
    // Read only once the loader has filled the window and must wait.
    ASSERT_TRUE(eventually([&] { return r.buffered() >= std::min<size_t>(config.credits, total - i); }));
    most_buffered = std::max(most_buffered, r.buffered());
    if (i % 8 == 0) {
      auto s = troupe::actors::loader_stats(loader);
      most_live = std::max(most_live, s.live_batches);
      ASSERT_LE(s.live_batches, s.token_bound);
    }
    ASSERT_TRUE(r.read(kWaitBound).has_value());
  }
  EXPECT_FALSE(r.read(10s).has_value());
  EXPECT_EQ(f.get(kWaitBound), total);
  const auto end = troupe::actors::loader_stats(loader);
  const int64_t growth = end.peak_rss_bytes - base.peak_rss_bytes;
  std::printf(
      "[measured] %lld batches of %.1f MB, credits %d, token bound %lld: writer max in flight %lld, pipeline max live "
      "%lld (sampled %lld), reader max buffered %zu, loader peak RSS %.1f MB -> %.1f MB (+%.1f MB)\n",
      static_cast<long long>(total), batch_bytes / 1e6, config.credits, static_cast<long long>(end.token_bound),
      static_cast<long long>(end.max_in_flight), static_cast<long long>(end.max_live_batches),
      static_cast<long long>(most_live), most_buffered, base.peak_rss_bytes / 1e6, end.peak_rss_bytes / 1e6,
      growth / 1e6);
  EXPECT_LE(end.max_in_flight, config.credits);
  EXPECT_LE(end.max_live_batches, end.token_bound);
  EXPECT_LE(most_buffered, static_cast<size_t>(config.credits));
  // Unbounded buffering would add the epoch's 200 MB; the bound is
  // (tokens + credits) batches, about 20 MB.
  EXPECT_LT(growth, 20 * batch_bytes);
}

TEST_F(DataLoaderTest, KilledLoaderFailsTheReaderPromptly) {
  LoaderConfig config = classification(20000);
  config.credits = 2;
  Loader loader = spawn(config);
  StreamReader<Batch> r(rt_, config.credits);
  auto f = loader.call(&DataLoaderActor::feed, r.ref(), SamplerCursor{}, 0, 0);
  ASSERT_TRUE(r.read(kWaitBound).has_value());
  // SIGKILL right here (a kill request through the head takes a moment, in
  // which the reader would keep granting credit).
  pid_t pid = loader.info().pid;
  ASSERT_GT(pid, 0);
  auto killed = std::chrono::steady_clock::now();
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  std::string error;
  int64_t after_kill = 0;
  try {
    while (r.read(kWaitBound)) ++after_kill;  // what was already buffered, then the error
    ADD_FAILURE() << "the stream ended cleanly";
  } catch (const troupe::StreamError& e) {
    error = e.what();
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  std::printf("[measured] reader failed %.3f s after the kill, %lld buffered batches read first: %s\n", seconds,
              static_cast<long long>(after_kill), error.c_str());
  EXPECT_NE(error.find("writer disconnected"), std::string::npos) << error;
  EXPECT_LE(after_kill, config.credits);
  EXPECT_LT(seconds, 5.0);
  EXPECT_THROW(f.get(kWaitBound), troupe::ActorDied);
}

// The stand-alone troupe-worker binary serves the loader too (what the
// Python shim and YAML jobs use). Its path comes from TROUPE_WORKER_BINARY.
TEST(DataLoaderWorkerBinary, ServesTheLoader) {
  const char* worker = std::getenv("TROUPE_WORKER_BINARY");
#ifdef TROUPE_WORKER_BINARY_BUILT
  if (!worker || !*worker) worker = TROUPE_WORKER_BINARY_BUILT;
#endif
  if (!worker || !*worker) GTEST_SKIP() << "TROUPE_WORKER_BINARY (the troupe-worker executable) is not set";
  troupe::testing::LocalCluster cluster;
  troupe::Runtime rt = cluster.connect();
  const LoaderConfig config = classification(1000);
  auto loader = rt.spawn<DataLoaderActor>({.resources = {{"CPU", 1}}, .executable = worker}, config);
  ASSERT_TRUE(loader.wait_ready(kWaitBound));
  StreamReader<Batch> r(rt, config.credits);
  auto f = loader.call(&DataLoaderActor::feed, r.ref(), SamplerCursor{}, 0, 0);
  std::vector<std::vector<Batch>> got{Drain(r).get()};
  EXPECT_EQ(f.get(kWaitBound), 32);
  expect_epoch_once(got, config, 0);
}

namespace {
// Samples of epoch 0 at once; from epoch 1 on, the first load says it began
// (GATE.entered) and waits, at most two minutes, for the file GATE.
class GatedEpochs final : public troupe::actors::Dataset {
 public:
  GatedEpochs(int64_t n, std::string gate) : n_(n), gate_(std::move(gate)) {}
  int64_t size() const override { return n_; }
  std::string describe() const override { return "gated_epochs"; }

 protected:
  troupe::actors::Sample load(int64_t index, int64_t epoch) const override {
    if (epoch >= 1) {
      std::ofstream(gate_ + ".entered") << "1";
      const auto until = std::chrono::steady_clock::now() + std::chrono::minutes(2);
      while (!std::filesystem::exists(gate_) && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(10ms);
    }
    return {{"input", torch::full({4}, static_cast<double>(index))}, {"target", torch::scalar_tensor(index % 2)}};
  }

 private:
  int64_t n_;
  std::string gate_;
};
}  // namespace

TROUPE_DATASET("test_gated_epochs", [](const DatasetSpec& s) {
  return std::make_unique<GatedEpochs>(s.get_int("size", 64), s.get_string("gate"));
});

// StopFeeds is a control message: it runs on the loader's I/O thread, which
// joined the stopped look-ahead there and so waited out a load in
// progress (a slow data set's: the recovery's 5 s stats probe timed out
// and a healthy loader was killed; one whose load() calls the runtime
// deadlocked). It answers while the load goes on.
TEST_F(DataLoaderTest, StopFeedsAnswersWhileALookAheadsLoadRuns) {
  auto dir = troupe::test::fresh_dir("loader-gate");
  const std::string gate = (dir / "gate").string();
  LoaderConfig config;
  config.dataset = DatasetSpec("test_gated_epochs").set("size", int64_t{64}).set("gate", gate);
  config.batch_size = 32;
  config.threads = 2;
  config.look_ahead = 1;
  Loader loader = spawn(config);
  {
    StreamReader<Batch> r(rt_, config.credits);
    auto f = loader.call(&DataLoaderActor::feed, r.ref(), SamplerCursor{}, 0, 0);
    EXPECT_EQ(Drain(r).get().size(), 2u);
    EXPECT_EQ(f.get(kWaitBound), 2);
  }
  // Epoch 1's look-ahead has begun its first load, which waits.
  ASSERT_TRUE(troupe::test::eventually([&] { return std::filesystem::exists(gate + ".entered"); }));
  struct Release {
    std::string gate;
    ~Release() { std::ofstream(gate) << "go"; }
  } release{gate};
  auto stopped = std::async(std::launch::async, [&] { return troupe::actors::stop_feeds(loader, -1, 60s); });
  ASSERT_EQ(stopped.wait_for(30s), std::future_status::ready) << "StopFeeds waited for the look-ahead's load";
  EXPECT_EQ(stopped.get(), 0);
  EXPECT_EQ(troupe::actors::loader_stats(loader).feeds_running, 0);
}

TEST_F(DataLoaderTest, StopCancelsRunningFeeds) {
  const LoaderConfig config = classification(20000);
  // A single-threaded loader is busy in feed(): stop goes as a control message.
  Loader single = spawn(config);
  {
    StreamReader<Batch> r(rt_, config.credits);
    auto f = single.call(&DataLoaderActor::feed, r.ref(), SamplerCursor{}, 0, 0);
    ASSERT_TRUE(r.read(kWaitBound).has_value());
    EXPECT_EQ(troupe::actors::stop_feeds(single), 1);
    int64_t sent = f.get(kWaitBound);
    EXPECT_LT(sent, 20000 / 32);
    int64_t read = 1;
    try {
      while (r.read(kWaitBound)) ++read;
      ADD_FAILURE() << "a stopped feed ended its stream cleanly";
    } catch (const troupe::StreamError& e) {
      EXPECT_NE(std::string(e.what()).find("stopped"), std::string::npos) << e.what();
    }
    EXPECT_EQ(read, sent);
    // Stopping is not sticky: the next feed runs to its end.
    StreamReader<Batch> again(rt_, config.credits);
    auto g = single.call(&DataLoaderActor::feed, again.ref(), SamplerCursor{}, 0, 3);
    EXPECT_EQ(Drain(again).get().size(), 3u);
    EXPECT_EQ(g.get(kWaitBound), 3);
  }
  // A shared loader also takes stop() as a method, per rank.
  Loader shared = spawn(config, /*max_concurrency=*/3);
  const SamplerCursor cursor{.world_size = 2};
  StreamReader<Batch> r0(rt_, config.credits), r1(rt_, config.credits);
  auto f0 = shared.call(&DataLoaderActor::feed, r0.ref(), cursor, 0, 0);
  auto f1 = shared.call(&DataLoaderActor::feed, r1.ref(), cursor, 1, 0);
  ASSERT_TRUE(r0.read(kWaitBound).has_value());
  ASSERT_TRUE(r1.read(kWaitBound).has_value());
  EXPECT_EQ(shared.call(&DataLoaderActor::stop, 1).get(kWaitBound), 1);
  EXPECT_LT(f1.get(kWaitBound), 10000 / 32);
  EXPECT_THROW(Drain(r1).get(), troupe::StreamError);
  EXPECT_EQ(troupe::actors::loader_stats(shared).feeds_running, 1);  // rank 0 still runs
  EXPECT_EQ(shared.call(&DataLoaderActor::stop, -1).get(kWaitBound), 1);
  EXPECT_LT(f0.get(kWaitBound), 10000 / 32);
}

// A loader makes the first batches of a rank's next feed as soon as a feed
// ends (LoaderConfig::look_ahead): a feed at the predicted cursor (the end
// of the last, or the next epoch's start) begins with them, a feed elsewhere
// drops them. Either way every feed sends exactly the batches of a loader
// without look-ahead: the same indices, rows, epoch and sequence.
TEST_F(DataLoaderTest, NextFeedBeginsWithBatchesMadeAheadAndTheSameBatches) {
  LoaderConfig config = classification(200);  // 6 batches of 32 and one of 8
  config.look_ahead = 2;
  LoaderConfig plain = config;
  plain.look_ahead = 0;
  Loader ahead = spawn(config), reference = spawn(plain);
  auto feed = [&](Loader& l, const SamplerCursor& cursor, int64_t max_batches) {
    StreamReader<Batch> r(rt_, config.credits);
    auto f = l.call(&DataLoaderActor::feed, r.ref(), cursor, 0, max_batches);
    auto got = Drain(r).get();
    EXPECT_EQ(f.get(kWaitBound), static_cast<int64_t>(got.size()));
    return got;
  };
  DistributedSampler sampler({.dataset_size = 200, .world_size = 1, .shuffle = true, .seed = config.seed});
  const SamplerCursor start = sampler.begin_epoch(0, 1);
  const struct {
    SamplerCursor cursor;
    int64_t max_batches;
    int64_t hits, misses;  // the loader's counts after this feed
  } feeds[] = {
      {start, 3, 0, 0},                       // nothing made ahead yet
      {sampler.advance(start, 96), 0, 1, 0},  // where the first ended: the rest of the epoch
      {sampler.begin_epoch(1, 1), 1, 2, 0},   // the next epoch's start
      {sampler.begin_epoch(7, 1), 2, 2, 1},   // not where the last ended
      {sampler.advance(sampler.begin_epoch(7, 1), 64), 1, 3, 1},
  };
  for (const auto& f : feeds) {
    const auto got = feed(ahead, f.cursor, f.max_batches);
    const auto want = feed(reference, f.cursor, f.max_batches);
    ASSERT_EQ(got.size(), want.size()) << troupe::actors::to_string(f.cursor);
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].indices, want[i].indices) << "batch " << i;
      EXPECT_EQ(got[i].sequence, static_cast<int64_t>(i));
      EXPECT_EQ(got[i].epoch, want[i].epoch);
      EXPECT_TRUE(torch::equal(got[i].tensors.at("input"), want[i].tensors.at("input"))) << "batch " << i;
    }
    const auto stats = troupe::actors::loader_stats(ahead);
    EXPECT_EQ(stats.ahead_hits, f.hits) << troupe::actors::to_string(f.cursor);
    EXPECT_EQ(stats.ahead_misses, f.misses) << troupe::actors::to_string(f.cursor);
  }
  EXPECT_EQ(troupe::actors::loader_stats(reference).ahead_hits, 0);
}

// The prediction follows the trainers: with two batches a step an epoch
// ends when less than a step is left (here 32 samples, a whole batch), and
// nothing is made for an epoch past the job's last.
TEST_F(DataLoaderTest, LookAheadFollowsStepsOfSeveralBatchesAndStopsAtTheLastEpoch) {
  LoaderConfig config = classification(224);  // 7 batches of 32: 3 steps of 64 and 32 left
  config.step_batches = 2;
  config.epochs = 2;
  Loader loader = spawn(config);
  auto feed = [&](const SamplerCursor& cursor, int64_t max_batches) {
    StreamReader<Batch> r(rt_, config.credits);
    auto f = loader.call(&DataLoaderActor::feed, r.ref(), cursor, 0, max_batches);
    const auto got = Drain(r).get();
    EXPECT_EQ(f.get(kWaitBound), max_batches);
    EXPECT_EQ(static_cast<int64_t>(got.size()), max_batches);
  };
  auto hits = [&] { return troupe::actors::loader_stats(loader).ahead_hits; };
  auto misses = [&] { return troupe::actors::loader_stats(loader).ahead_misses; };
  DistributedSampler sampler({.dataset_size = 224, .world_size = 1, .shuffle = true, .seed = config.seed});
  feed(sampler.begin_epoch(0, 1), 6);  // 3 steps: the epoch is done
  feed(sampler.begin_epoch(1, 1), 2);
  EXPECT_EQ(hits(), 1);
  feed(sampler.advance(sampler.begin_epoch(1, 1), 64), 4);
  EXPECT_EQ(hits(), 2);
  feed(sampler.begin_epoch(2, 1), 1);  // past the last epoch: nothing was made for it
  EXPECT_EQ(hits(), 2);
  EXPECT_EQ(misses(), 0);
}

}  // namespace

// Settings past their bounds are refused naming them: the token pool is
// made up front, and a prefetch depth of 2^30 ran the loader out of memory
// with nothing named.
TEST(DataLoaderConfig, SettingsPastTheirBoundsAreRefusedNamingThem) {
  auto refused = [](LoaderConfig c) -> std::string {
    try {
      DataLoaderActor loader(c);
    } catch (const troupe::ConfigError& e) {
      return e.what();
    }
    return "accepted";
  };
  LoaderConfig c;
  c.prefetch_depth = 1 << 30;
  EXPECT_NE(refused(c).find("prefetch_depth must be between 0 and 4096, got 1073741824"), std::string::npos)
      << refused(c);
  c = {};
  c.look_ahead = 1000;
  EXPECT_NE(refused(c).find("look_ahead must be between 0 and 64, got 1000"), std::string::npos) << refused(c);
  c = {};
  c.credits = 100000;
  EXPECT_NE(refused(c).find("credits must be between 1 and 4096"), std::string::npos) << refused(c);
}
