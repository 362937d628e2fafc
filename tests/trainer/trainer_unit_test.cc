// Unit tests of the trainer layer, in one process: model factory, the
// optimizers against torch.optim's rules, the LR schedule, and the
// GradientReducer on a world-size-1 group and on two ranks (two threads,
// each a GlooGroup member over an in-memory KV store), and SyncBatchNorm
// against one process on the concatenated batch; bf16 autocast on the CPU.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <torch/torch.h>

#include "tests/support/rank_threads.h"
#include "tests/support/temp_dir.h"
#include "tests/support/train_jobs.h"
#include "troupe/runtime/collective/gloo_group.h"
#include "troupe/runtime/core/kv_store.h"
#include "troupe/trainer/checkpoint.h"
#include "troupe/trainer/cpu_gemm.h"
#include "troupe/trainer/gradient_reducer.h"
#include "troupe/trainer/job_reporter.h"
#include "troupe/trainer/model.h"
#include "troupe/trainer/optimizer.h"
#include "troupe/trainer/shm_group.h"
#include "troupe/trainer/sync_batch_norm.h"
#include "troupe/trainer/trainer_actor.h"

using namespace troupe;
using namespace troupe::trainer;

namespace {

// Delegates to a real group and counts the allreduces it was asked for.
class CountingGroup final : public collective::Group {
 public:
  explicit CountingGroup(collective::Group& g) : g_(g) {}
  int rank() const override { return g_.rank(); }
  int world_size() const override { return g_.world_size(); }
  const std::string& name() const override { return g_.name(); }
  int64_t generation() const override { return g_.generation(); }
  collective::WorkPtr allreduce(void* d, size_t n, collective::DType t,
                                const collective::AllreduceOptions& o) override {
    ++allreduces;
    return g_.allreduce(d, n, t, o);
  }
  collective::WorkPtr broadcast(void* d, size_t n, collective::DType t, int root,
                                const collective::BroadcastOptions& o) override {
    return g_.broadcast(d, n, t, root, o);
  }
  collective::WorkPtr allgather(const void* i, void* o, size_t n, collective::DType t,
                                const collective::AllgatherOptions& op) override {
    return g_.allgather(i, o, n, t, op);
  }
  collective::WorkPtr reduce_scatter(const void* i, void* o, size_t n, collective::DType t,
                                     const collective::ReduceScatterOptions& op) override {
    return g_.reduce_scatter(i, o, n, t, op);
  }
  collective::WorkPtr barrier(const collective::BarrierOptions& o) override { return g_.barrier(o); }
  collective::WorkPtr send(const void* d, size_t n, collective::DType t, int dst,
                           const collective::SendOptions& o) override {
    return g_.send(d, n, t, dst, o);
  }
  collective::WorkPtr recv(void* d, size_t n, collective::DType t, int src, const collective::RecvOptions& o) override {
    return g_.recv(d, n, t, src, o);
  }
  void abort(const std::string& r) override { g_.abort(r); }
  bool is_aborted() const override { return g_.is_aborted(); }
  std::atomic<int> allreduces{0};

 private:
  collective::Group& g_;
};

ModelSpec mlp(int64_t in, int64_t hidden, int64_t classes) {
  ModelSpec s;
  s.name = "mlp";
  s.input_dim = in;
  s.hidden = hidden;
  s.num_classes = classes;
  return s;
}

// Rank threads share torch's default generator: seed and build under a lock.
std::unique_ptr<Model> seeded_model(const ModelSpec& spec, uint64_t seed) {
  static std::mutex mu;
  std::lock_guard lock(mu);
  torch::manual_seed(seed);
  return make_model(spec);
}

torch::Tensor loss_of(Model& m, const torch::Tensor& x, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(m.forward(x), y);
}

// A step's metric named as a field of the metrics file's step line
// ("samples", "step", ...) was dropped without a word: it is written as
// "metric_<name>", and the others under their own names.
TEST(JobReporterTest, AStepMetricNamedAsALineFieldIsKeptUnderAnotherName) {
  const auto dir = troupe::test::fresh_dir("reporter");
  TrainJobConfig cfg;
  cfg.name = "metrics";
  cfg.metrics_path = (dir / "m.jsonl").string();
  {
    JobReporter reporter(cfg, [] { return JobPosition{1, 2}; });
    reporter.open_metrics();
    reporter.step(0, 1, 8.0, 4, {{"samples", 3.0}, {"metric_samples", 5.0}, {"correct", 2.0}}, 100.0, 0.0);
  }
  std::ifstream in(cfg.metrics_path);
  std::string line, step_line;
  while (std::getline(in, line))
    if (line.find("\"kind\":\"step\"") != std::string::npos) step_line = line;
  ASSERT_FALSE(step_line.empty());
  const auto j = nlohmann::json::parse(step_line);
  EXPECT_EQ(j.at("samples").get<int64_t>(), 4) << step_line;
  EXPECT_EQ(j.at("metric_samples").get<double>(), 5.0) << step_line;  // the step's own, kept
  EXPECT_EQ(j.at("metric_metric_samples").get<double>(), 3.0) << step_line;
  EXPECT_EQ(j.at("correct").get<double>(), 2.0) << step_line;
}

// The job document's recoveries are those completed, and never go down:
// a job that gave up without a failure showed -1, and one that gave up
// after failures took one back (a Prometheus counter that went down).
TEST(JobReporterTest, RecoveriesCountThoseCompletedAndNeverGoDown) {
  for (const bool failed_before : {false, true}) {
    SCOPED_TRACE(failed_before ? "after two recoveries and a failure" : "without a failure");
    TrainJobConfig cfg;
    cfg.name = "counted";
    troupe::MemoryKvStore kv;
    std::mutex mu;
    std::vector<int64_t> seen;
    {
      JobReporter reporter(cfg, [] { return JobPosition{1, 2}; });
      reporter.publish_to(&kv, 1, [&](const std::string&, const std::string& value) {
        {
          std::lock_guard lock(mu);
          seen.push_back(nlohmann::json::parse(value).at("recoveries").get<int64_t>());
        }
        auto state = std::make_shared<troupe::core::FutureState<troupe::wire::Message>>();
        state->set_value(troupe::wire::Message{});
        return troupe::Future<troupe::wire::Message>(state);
      });
      if (failed_before) {
        // One while the job starts (it ends at "restored"), one later.
        reporter.event(JobEventKind::kFailure, "while the job started: rank 1 died");
        reporter.event(JobEventKind::kRestored, "the job starts over with new trainers");
        reporter.event(JobEventKind::kStarted, "2 trainers");
        reporter.event(JobEventKind::kFailure, "rank 1 died");
        reporter.event(JobEventKind::kRestored, "from the checkpoint of step 2");
        reporter.event(JobEventKind::kResumed, "at step 3");
        reporter.event(JobEventKind::kFailure, "rank 1 died");
      }
      reporter.event(JobEventKind::kFailed, "the loss is inf at step 4");
    }
    std::lock_guard lock(mu);
    ASSERT_FALSE(seen.empty());
    for (size_t i = 1; i < seen.size(); ++i) EXPECT_GE(seen[i], seen[i - 1]) << i;
    EXPECT_EQ(seen.back(), failed_before ? 2 : 0);
  }
}

TEST(ModelTest, FactoryBuildsByNameAndRejectsBadSpecs) {
  auto m = make_model(mlp(64, 32, 10));
  EXPECT_EQ(m->parameter_count(), 64 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10);
  EXPECT_EQ(m->forward(torch::randn({5, 64})).sizes(), (std::vector<int64_t>{5, 10}));
  ModelSpec cnn;
  cnn.name = "cnn";
  cnn.hidden = 8;
  auto c = make_model(cnn);
  EXPECT_EQ(c->forward(torch::randn({4, 64})).sizes(), (std::vector<int64_t>{4, 10}));
  EXPECT_EQ(c->named_buffers().size(), 6u);  // two BatchNorms: mean, var, count

  ModelSpec bad;
  bad.name = "resnet9000";
  try {
    make_model(bad);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown model 'resnet9000'"), std::string::npos) << e.what();
  }
  ModelSpec ts;
  ts.name = "torchscript";
  ts.path = "/nonexistent/model.pt";
  try {
    validate(ts);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/model.pt"), std::string::npos) << e.what();
  }
}

TEST(ModelTest, SameSeedSameWeights) {
  auto a = seeded_model(mlp(16, 8, 3), 7);
  auto b = seeded_model(mlp(16, 8, 3), 7);
  auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i]));
}

// Our optimizers against torch::optim (which implements torch.optim's
// rules) on the same gradients.
TEST(OptimizerTest, MatchesTorchOptim) {
  for (std::string name : {"sgd", "adamw"}) {
    auto a = seeded_model(mlp(16, 8, 3), 1);
    auto b = seeded_model(mlp(16, 8, 3), 1);
    OptimizerConfig cfg;
    cfg.name = name;
    cfg.lr = name == "sgd" ? 0.1 : 0.01;
    cfg.weight_decay = 0.01;
    Optimizer ours(cfg, a->named_parameters());
    std::unique_ptr<torch::optim::Optimizer> ref;
    if (name == "sgd")
      ref = std::make_unique<torch::optim::SGD>(b->parameters(),
                                                torch::optim::SGDOptions(cfg.lr).momentum(0.9).weight_decay(0.01));
    else
      ref =
          std::make_unique<torch::optim::AdamW>(b->parameters(), torch::optim::AdamWOptions(cfg.lr).weight_decay(0.01));
    torch::manual_seed(3);
    for (int step = 0; step < 5; ++step) {
      auto x = torch::randn({8, 16});
      auto y = torch::randint(0, 3, {8});
      ours.zero_grad();
      ref->zero_grad();
      loss_of(*a, x, y).backward();
      loss_of(*b, x, y).backward();
      ours.step(cfg.lr);
      ref->step();
    }
    auto pa = a->parameters(), pb = b->parameters();
    for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::allclose(pa[i], pb[i], 1e-5, 1e-6)) << name << " " << i;
  }
}

TEST(OptimizerTest, StateRoundTripContinuesBitwise) {
  auto a = seeded_model(mlp(16, 8, 3), 1);
  OptimizerConfig cfg;
  cfg.name = "adamw";
  cfg.lr = 0.01;
  Optimizer oa(cfg, a->named_parameters());
  auto x = torch::randn({8, 16});
  auto y = torch::randint(0, 3, {8});
  loss_of(*a, x, y).backward();
  oa.step(0.01);
  auto b = seeded_model(mlp(16, 8, 3), 2);
  {
    torch::NoGradGuard g;
    auto pa = a->parameters(), pb = b->parameters();
    for (size_t i = 0; i < pa.size(); ++i) pb[i].copy_(pa[i]);
  }
  Optimizer ob(cfg, b->named_parameters());
  ob.load_state(oa.state());
  for (auto* pair : {&oa, &ob}) pair->zero_grad();
  loss_of(*a, x, y).backward();
  loss_of(*b, x, y).backward();
  oa.step(0.01);
  ob.step(0.01);
  auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i]));
}

TEST(ScheduleTest, WarmupScalingAndCosine) {
  OptimizerConfig o;
  o.lr = 0.1;
  ScheduleConfig s;
  s.warmup_steps = 4;
  s.scale_with_world = true;
  EXPECT_DOUBLE_EQ(learning_rate(o, s, 0, 2), 0.2 * 0.25);
  EXPECT_DOUBLE_EQ(learning_rate(o, s, 3, 2), 0.2);
  EXPECT_DOUBLE_EQ(learning_rate(o, s, 100, 2), 0.2);
  s.decay = "cosine";
  s.total_steps = 14;
  s.scale_with_world = false;
  EXPECT_NEAR(learning_rate(o, s, 9, 1), 0.05, 1e-12);
  EXPECT_NEAR(learning_rate(o, s, 14, 1), 0.0, 1e-12);
  s.decay = "linear-ish";
  EXPECT_THROW(validate(s), ConfigError);
}

// Runs `body(rank, group)` on `world` threads, each a member of a fresh
// GlooGroup named `name` over one in-memory KV store; `body` may take the
// group over.
void run_ranks_owned(int world, const std::function<void(int, std::unique_ptr<collective::Group>&)>& body,
                     const std::string& name = "shm-test") {
  static std::atomic<int> generation{0};
  int gen = ++generation;
  MemoryKvStore kv;
  troupe::test::run_rank_threads(world, [&](int r) {
    collective::GlooGroupOptions go;
    go.rendezvous_timeout = std::chrono::seconds(30);
    std::unique_ptr<collective::Group> g = collective::GlooGroup::create(kv, name, gen, r, world, go);
    body(r, g);
  });
}

void run_ranks(int world, const std::function<void(int, collective::Group&)>& body) {
  run_ranks_owned(
      world, [&](int r, std::unique_ptr<collective::Group>& g) { body(r, *g); }, "reducer-test");
}

TEST(GradientReducerTest, BucketsAreInReverseOrderAndBounded) {
  auto m = seeded_model(mlp(64, 64, 10), 1);
  ReducerOptions o;
  o.bucket_bytes = 64 * 64 * 4 + 64 * 4;  // one hidden layer per bucket
  GradientReducer r(m->parameters(), nullptr, o);
  // params: fc1.w fc1.b fc2.w fc2.b fc3.w fc3.b → buckets {5,4,3,2} {1,0}? check reverse and bounded
  ASSERT_GE(r.bucket_count(), 2u);
  std::vector<size_t> order;
  for (size_t b = 0; b < r.bucket_count(); ++b)
    for (size_t i : r.bucket_params(b)) order.push_back(i);
  EXPECT_EQ(order, (std::vector<size_t>{5, 4, 3, 2, 1, 0}));
}

TEST(GradientReducerTest, FirstBucketIsSmallSoReducingStartsEarly) {
  auto m = seeded_model(mlp(64, 64, 10), 1);
  ReducerOptions o;                             // 25 MiB buckets: the rest fits in one
  o.first_bucket_bytes = 64 * 10 * 4 + 10 * 4;  // the output layer
  GradientReducer r(m->parameters(), nullptr, o);
  ASSERT_EQ(r.bucket_count(), 2u);
  EXPECT_EQ(r.bucket_params(0), (std::vector<size_t>{5, 4}));
  EXPECT_EQ(r.bucket_params(1), (std::vector<size_t>{3, 2, 1, 0}));
  o.first_bucket_bytes = 0;  // off: one bucket
  EXPECT_EQ(GradientReducer(m->parameters(), nullptr, o).bucket_count(), 1u);
}

TEST(GradientReducerTest, WorldOfOneKeepsGradients) {
  run_ranks(1, [](int rank, collective::Group& g) {
    auto m = seeded_model(mlp(16, 8, 3), 1);
    auto ref = seeded_model(mlp(16, 8, 3), 1);
    CountingGroup counting(g);
    GradientReducer r(m->parameters(), &counting);
    auto x = torch::randn({8, 16});
    auto y = torch::randint(0, 3, {8});
    r.prepare(true);
    loss_of(*m, x, y).backward();
    r.finish();
    loss_of(*ref, x, y).backward();
    auto pa = m->parameters(), pb = ref->parameters();
    for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i].grad(), pb[i].grad()));
    EXPECT_EQ(counting.allreduces.load(), static_cast<int>(r.bucket_count()));
  });
}

// Two ranks, each on half of a batch, reduce to the gradient of the whole
// batch; with accumulation nothing moves until the last micro-step; small
// buckets launch during backward; bf16 buckets stay close.
TEST(GradientReducerTest, TwoRanksAverageOverlapAndAccumulate) {
  torch::manual_seed(11);
  auto x = torch::randn({4, 8, 32});  // 4 micro-batches of 8
  auto y = torch::randint(0, 5, {4, 8});
  // Reference: one model on the full micro-batches, accumulated, / 4.
  auto ref = seeded_model(mlp(32, 64, 5), 3);
  for (int k = 0; k < 4; ++k) (loss_of(*ref, x[k], y[k]) / 4).backward();
  for (auto comp : {Compression::kNone, Compression::kBFloat16}) {
    run_ranks(2, [&](int rank, collective::Group& g) {
      auto m = seeded_model(mlp(32, 64, 5), 3);
      CountingGroup counting(g);
      ReducerOptions o;
      o.bucket_bytes = 64 * 64 * 4;  // several buckets
      o.compression = comp;
      GradientReducer r(m->parameters(), &counting, o);
      for (int k = 0; k < 4; ++k) {
        bool sync = k == 3;
        r.prepare(sync);
        auto xs = x[k].narrow(0, rank * 4, 4), ys = y[k].narrow(0, rank * 4, 4);
        (loss_of(*m, xs, ys) / 4).backward();
        r.finish();
        if (!sync) {
          EXPECT_EQ(counting.allreduces.load(), 0);
        }
      }
      EXPECT_EQ(counting.allreduces.load(), static_cast<int>(r.bucket_count()));
      EXPECT_GE(r.bucket_count(), 3u);
      EXPECT_GE(r.launched_during_backward(), 1);
      double tol = comp == Compression::kNone ? 1e-6 : 2e-2;
      auto pa = m->parameters(), pb = ref->parameters();
      for (size_t i = 0; i < pa.size(); ++i)
        EXPECT_TRUE(torch::allclose(pa[i].grad(), pb[i].grad(), tol, tol))
            << "param " << i << " max diff " << (pa[i].grad() - pb[i].grad()).abs().max().item<float>();
      // A second window reuses the bucket views as .grad.
      for (auto& p : pa) p.mutable_grad().zero_();
      r.prepare(true);
      loss_of(*m, x[0].narrow(0, rank * 4, 4), y[0].narrow(0, rank * 4, 4)).backward();
      r.finish();
    });
  }
}

// A 16-bit wire is averaged by the group, not summed and then divided:
// two ranks' gradients of 40000 summed to inf in fp16 (65504 at most),
// where their average is exact.
TEST(GradientReducerTest, ASixteenBitWireAveragesWithoutOverflowing) {
  run_ranks(2, [&](int rank, collective::Group& g) {
    auto p = torch::zeros({4}, torch::requires_grad());
    ReducerOptions o;
    o.compression = Compression::kFloat16;
    GradientReducer r({p}, &g, o);
    r.prepare(true);
    (p * 40000).sum().backward();
    r.finish();
    EXPECT_TRUE(torch::equal(p.grad(), torch::full({4}, 40000.0f))) << "rank " << rank << ": " << p.grad();
  });
}

TEST(GradientReducerTest, BroadcastMakesRanksEqual) {
  run_ranks(2, [](int rank, collective::Group& g) {
    auto m = seeded_model(mlp(16, 8, 3), 100 + rank);
    GradientReducer r(m->parameters(), &g);
    r.broadcast_from_rank0(m->parameters());
    auto ref = seeded_model(mlp(16, 8, 3), 100);
    auto pa = m->parameters(), pb = ref->parameters();
    for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i]));
  });
}

}  // namespace

namespace {

// Three ranks sum through shared memory: bitwise equal everywhere, equal
// to the sum in rank order; memory outside the arena goes to the inner group.
TEST(ShmGroupTest, AllreduceSumsInPlaceAndFallsBack) {
  run_ranks_owned(3, [](int rank, std::unique_ptr<collective::Group>& inner) {
    auto shm = ShmGroup::create(inner, 1 << 20, std::chrono::seconds(30));
    const size_t n = 1001;  // not a multiple of the world size
    auto* data = static_cast<float*>(shm->allocate(n * sizeof(float)));
    ASSERT_NE(data, nullptr);
    for (int round = 0; round < 3; ++round) {
      for (size_t i = 0; i < n; ++i) data[i] = 0.1f * static_cast<float>(i) + static_cast<float>(rank + round);
      shm->allreduce(data, n, collective::DType::kFloat32)->wait();
      for (size_t i = 0; i < n; ++i) {
        float expect = (0.1f * i + round) + (0.1f * i + 1 + round);
        expect += 0.1f * i + 2 + round;
        ASSERT_EQ(data[i], expect) << i;
      }
    }
    EXPECT_EQ(shm->shm_allreduces(), 3);
    std::vector<float> outside(10, 1.0f);
    shm->allreduce(outside.data(), outside.size(), collective::DType::kFloat32)->wait();
    EXPECT_EQ(outside[3], 3.0f);
    EXPECT_EQ(shm->shm_allreduces(), 3);
  });
}

// A rank's abort says why to every rank: the peers' Aborted names the
// first abort's reason (a rank's step that raised), not only "aborted".
TEST(ShmGroupTest, AnAbortsReasonReachesThePeers) {
  run_ranks_owned(2, [](int rank, std::unique_ptr<collective::Group>& inner) {
    auto shm = ShmGroup::create(inner, 1 << 20, std::chrono::seconds(30));
    auto* data = static_cast<float*>(shm->allocate(16 * sizeof(float)));
    if (rank == 0) {
      shm->abort("rank 0: the user's step raised: boom");
      return;
    }
    try {
      shm->allreduce(data, 16, collective::DType::kFloat32)->wait();
      ADD_FAILURE() << "the allreduce of an aborted group went through";
    } catch (const Aborted& e) {
      EXPECT_NE(std::string(e.what()).find("aborted: rank 0: the user's step raised: boom"), std::string::npos)
          << e.what();
    }
  });
}

// A create cut short by a peer (a replacement killed, or the group aborted,
// while the gang forms) leaves neither its segment in /dev/shm nor its
// mapping in the process: they stayed until reboot, one more each time.
TEST(ShmGroupTest, ACreateCutShortLeavesNoSegmentAndNoMapping) {
  std::string name;
  run_ranks_owned(2, [&](int rank, std::unique_ptr<collective::Group>& inner) {
    if (rank == 0) {
      EXPECT_ANY_THROW(ShmGroup::create(inner, 1 << 20, std::chrono::seconds(30)));
      return;
    }
    // Rank 1 takes part as far as the segment's making, then leaves.
    uint64_t nonce = 0;
    int64_t ok = 0;
    inner->broadcast(&nonce, 1, collective::DType::kInt64, 0)->wait(std::chrono::seconds(30));
    inner->broadcast(&ok, 1, collective::DType::kInt64, 0)->wait(std::chrono::seconds(30));
    EXPECT_EQ(ok, 1);
    name = "troupe-" + std::to_string(nonce);
    inner->abort("rank 1 died");
  });
  ASSERT_FALSE(name.empty());
  EXPECT_FALSE(std::filesystem::exists("/dev/shm/" + name)) << name << " left in /dev/shm";
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);)
    EXPECT_EQ(line.find(name), std::string::npos) << "still mapped: " << line;
}

// The reducer with buckets in the shared arena gives the averaged gradient.
TEST(ShmGroupTest, ReducerBucketsInSharedMemory) {
  torch::manual_seed(11);
  auto x = torch::randn({8, 32});
  auto y = torch::randint(0, 5, {8});
  auto ref = seeded_model(mlp(32, 64, 5), 3);
  loss_of(*ref, x, y).backward();
  run_ranks_owned(2, [&](int rank, std::unique_ptr<collective::Group>& inner) {
    auto m = seeded_model(mlp(32, 64, 5), 3);
    auto shm = ShmGroup::create(inner, 1 << 20, std::chrono::seconds(30));
    ReducerOptions o;
    o.bucket_bytes = 64 * 64 * 4;
    o.allocate = [&](size_t bytes) { return shm->allocate(bytes); };
    {
      GradientReducer r(m->parameters(), shm.get(), o);
      for (int step = 0; step < 2; ++step) {
        for (auto& p : m->parameters())
          if (p.grad().defined()) p.mutable_grad().zero_();
        r.prepare(true);
        loss_of(*m, x.narrow(0, rank * 4, 4), y.narrow(0, rank * 4, 4)).backward();
        r.finish();
      }
      EXPECT_EQ(shm->shm_allreduces(), 2 * static_cast<int64_t>(r.bucket_count()));
      auto pa = m->parameters(), pb = ref->parameters();
      for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::allclose(pa[i].grad(), pb[i].grad(), 1e-5, 1e-6)) << i;
      for (auto& p : pa) p.mutable_grad() = torch::Tensor();  // the arena goes with shm
    }
  });
}

// grad_clip bounds the gradient's global L2 norm: one plain SGD step (no
// momentum) then moves the weights by exactly lr * grad_clip, where the
// unclipped step moves them much further. A TrainerActor in-process, world 1.
TEST(GradClipTest, BoundsTheStepToLrTimesClip) {
  auto step_length = [](double clip) {
    TrainerConfig c;
    c.model.name = "mlp";
    c.model.input_dim = 16;
    c.model.hidden = 32;
    c.model.num_classes = 4;
    c.data =
        actors::DatasetSpec("synthetic_classification").set("size", 64).set("num_features", 16).set("num_classes", 4);
    c.batch_size = 16;
    c.seed = 3;
    c.optimizer.lr = 0.1;
    c.optimizer.momentum = 0;
    c.grad_clip = clip;
    TrainerActor t;
    t.setup(c);
    auto before = t.state().model;
    TrainRequest r;
    r.max_steps = 1;
    EXPECT_EQ(t.train(r).steps, 1);
    double sq = 0;
    for (const auto& [name, w] : t.state().model)
      sq += (w - before.at(name)).to(torch::kFloat64).pow(2).sum().item<double>();
    return std::sqrt(sq);
  };
  const double clip = 1e-3, lr = 0.1;
  EXPECT_GT(step_length(0), 10 * lr * clip);
  EXPECT_NEAR(step_length(clip), lr * clip, 1e-3 * lr * clip);
  TrainerConfig bad;
  bad.data = actors::DatasetSpec("synthetic_classification");
  bad.grad_clip = -1;
  EXPECT_THROW(validate(bad), ConfigError);
}

}  // namespace

namespace {

ModelSpec small_cnn() {
  ModelSpec s;
  s.name = "cnn";
  s.channels = 2;
  s.image_size = 5;
  s.hidden = 6;
  s.num_classes = 3;
  return s;
}

std::map<std::string, torch::Tensor> buffers_of(Model& m) {
  std::map<std::string, torch::Tensor> out;
  for (auto& [k, v] : m.named_buffers()) out[k] = v.detach().clone();
  return out;
}

}  // namespace

// Two ranks with SyncBatchNorm, each on half of a batch, compute what one
// process computes on the whole batch: the outputs, the BatchNorm running
// statistics and (after the reducer's average) the gradients; without it
// each rank's statistics are its own half's.
TEST(SyncBatchNormTest, TwoRanksEqualOneProcessOnTheConcatenatedBatch) {
  torch::manual_seed(21);
  auto x = torch::randn({12, 2 * 5 * 5}) * 2 + 0.5;
  auto y = torch::randint(0, 3, {12});
  auto ref = seeded_model(small_cnn(), 4);
  auto ref_out = ref->forward(x);
  torch::nn::functional::cross_entropy(ref_out, y).backward();
  const auto ref_buffers = buffers_of(*ref);
  run_ranks(2, [&](int rank, collective::Group& g) {
    auto m = seeded_model(small_cnn(), 4);
    GradientReducer reducer(m->parameters(), &g);
    auto xs = x.narrow(0, rank * 6, 6), ys = y.narrow(0, rank * 6, 6);
    torch::Tensor out;
    {
      SyncBatchNormScope scope(&g);
      out = m->forward(xs);
      reducer.prepare(true);
      torch::nn::functional::cross_entropy(out, ys).backward();
    }
    reducer.finish();
    EXPECT_TRUE(torch::allclose(out, ref_out.narrow(0, rank * 6, 6), 1e-5, 1e-5))
        << "rank " << rank << " outputs differ by " << (out - ref_out.narrow(0, rank * 6, 6)).abs().max().item<float>();
    for (auto& [k, v] : buffers_of(*m))
      EXPECT_TRUE(torch::allclose(v.to(torch::kDouble), ref_buffers.at(k).to(torch::kDouble), 1e-5, 1e-6))
          << "rank " << rank << " buffer " << k;
    auto pa = m->named_parameters(), pb = ref->named_parameters();
    for (size_t i = 0; i < pa.size(); ++i)
      EXPECT_TRUE(torch::allclose(pa[i].second.grad(), pb[i].second.grad(), 1e-4, 1e-5))
          << "rank " << rank << " gradient of " << pa[i].first << " differs by "
          << (pa[i].second.grad() - pb[i].second.grad()).abs().max().item<float>();
    // Outside a scope the layers use this rank's own statistics.
    auto local = seeded_model(small_cnn(), 4);
    EXPECT_FALSE(torch::allclose(local->forward(xs), ref_out.narrow(0, rank * 6, 6), 1e-3, 1e-3));
  });
}

// trainer::batch_norm() outside a scope (or in eval mode) is the layer's own
// forward, bit for bit; in a scope of one rank too.
// A 16-bit input (autocast's conv output) has its statistics taken in
// float32, as ATen's batch_norm does: in bf16 the count and sums were
// rounded to 8 bits (mean and variance off by up to ~0.4 %), in fp16 a
// count over 65504 threw on every step. The output keeps the input's type.
TEST(SyncBatchNormTest, SixteenBitInputsHaveFloat32Statistics) {
  torch::manual_seed(8);
  const auto x = (torch::randn({14, 1, 28, 28}) * 3 + 1).to(torch::kBFloat16);  // 10,976 values, 7 a rank
  const auto all = x.to(torch::kDouble);
  const double mean = all.mean().item<double>();
  const double var = all.var(/*unbiased=*/true).item<double>();
  run_ranks(2, [&](int rank, collective::Group& g) {
    auto rm = torch::zeros({1}), rv = torch::ones({1});
    auto out = sync_batch_norm(x.narrow(0, rank * 7, 7), {}, {}, rm, rv, 1.0, 1e-5, g);
    EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
    EXPECT_NEAR(rm.item<double>(), mean, 1e-4 * std::abs(mean)) << "rank " << rank;
    EXPECT_NEAR(rv.item<double>(), var, 1e-4 * var) << "rank " << rank;
  });
}

TEST(SyncBatchNormTest, LocalPathIsTheLayersOwnForward) {
  torch::manual_seed(5);
  auto x = torch::randn({7, 4, 3});
  torch::nn::BatchNorm1d a(4), b(4);
  EXPECT_TRUE(torch::equal(batch_norm(a, x), b->forward(x)));
  run_ranks(1, [&](int, collective::Group& g) {
    SyncBatchNormScope scope(&g);
    EXPECT_TRUE(torch::equal(batch_norm(a, x), b->forward(x)));
  });
  EXPECT_TRUE(torch::equal(a->running_mean, b->running_mean));
  a->eval();
  b->eval();
  run_ranks(2, [&](int, collective::Group& g) {
    SyncBatchNormScope scope(&g);
    EXPECT_TRUE(torch::equal(batch_norm(a, x), b->forward(x)));
  });
}

// Image records with defer_normalize reach the model as the same floats
// as with normalisation in the loader: training steps land on the same
// weights, and benchmark() (which reuses one collated batch) finishes the
// batch once per step, never twice.
TEST(DeferredNormalisationTest, TrainAndBenchmarkSeeTheSameFloats) {
  auto config = [](bool defer) {
    TrainerConfig c;
    c.model = small_cnn();  // 2 channels, 5×5 images, 3 classes
    c.data = actors::DatasetSpec("image_records")
                 .set("size", 32)
                 .set("channels", 2)
                 .set("height", 7)
                 .set("width", 7)
                 .set("num_classes", 3)
                 .set("crop", 5)
                 .set("flip", 1)
                 .set("mean", {0.5, 0.4})
                 .set("std", {0.2, 0.25})
                 .set("defer_normalize", defer ? 1 : 0);
    c.batch_size = 8;
    c.seed = 4;
    return c;
  };
  auto train = [&](bool defer) {
    TrainerActor t;
    t.setup(config(defer));
    TrainRequest r;
    r.max_steps = 3;
    EXPECT_EQ(t.train(r).steps, 3);
    return t.state().model;
  };
  auto in_loader = train(false), on_trainer = train(true);
  for (const auto& [name, w] : in_loader) EXPECT_TRUE(torch::equal(w, on_trainer.at(name))) << name;
  TrainerActor t;
  t.setup(config(true));
  auto r = t.benchmark(2, 8, 1);
  EXPECT_EQ(r.steps, 2);
  EXPECT_TRUE(std::isfinite(r.final_loss));
}

namespace {

// Six AdamW steps of the tests' small MLP in one in-process trainer.
TrainState six_cpu_steps(bool bf16) {
  TrainerConfig c = troupe::test::small_mlp_job("amp", 1, 32, 256).trainer;
  c.device = "cpu";
  c.optimizer.name = "adamw";
  c.optimizer.lr = 0.005;
  c.mixed_precision = bf16;
  c.amp_dtype = "bf16";
  TrainerActor t;
  t.setup(c);
  TrainRequest r;
  r.max_steps = 6;
  EXPECT_EQ(t.train(r).steps, 6);
  return t.state();
}

}  // namespace

// bf16 autocast on the CPU: the forward runs in bf16 (the weights differ
// from the fp32 run's, yet stay near them), parameters stay fp32, and a
// second run lands on the same bits (what a healed trainer relies on).
// fp16 has no CPU autocast here and is refused, naming it.
TEST(CpuAutocastTest, Bf16TrainsNearFp32RepeatablyAndFp16IsRefused) {
  auto fp32 = six_cpu_steps(false);
  auto bf16 = six_cpu_steps(true);
  auto again = six_cpu_steps(true);
  double furthest = 0;
  for (const auto& [name, w] : bf16.model) {
    EXPECT_EQ(w.scalar_type(), torch::kFloat32) << name;
    EXPECT_TRUE(torch::equal(w, again.model.at(name))) << name << ": two bf16 runs differ";
    furthest = std::max(furthest, (w - fp32.model.at(name)).abs().max().item<double>());
  }
  EXPECT_GT(furthest, 0.0) << "bf16 autocast changed nothing: did it run?";
  EXPECT_LT(furthest, 0.05);

  TrainerConfig c = troupe::test::small_mlp_job("amp", 1, 32, 256).trainer;
  c.device = "cpu";
  c.mixed_precision = true;
  c.amp_dtype = "fp16";
  TrainerActor t;
  try {
    t.setup(c);
    FAIL() << "fp16 autocast accepted on the CPU";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'fp16'"), std::string::npos) << e.what();
  }
}

namespace {

// Samples that take 4 ms each to load (a slow disk), 16 features, 4 classes.
class SlowSamples final : public actors::Dataset {
 public:
  int64_t size() const override { return 64; }
  std::string describe() const override { return "slow_samples"; }

 protected:
  actors::Sample load(int64_t index, int64_t /*epoch*/) const override {
    std::this_thread::sleep_for(std::chrono::milliseconds(4));
    return {{"input", torch::sin(torch::arange(16, torch::kFloat) * double(index + 1))},
            {"target", torch::tensor(index % 4, torch::kLong)}};
  }
};

// An mlp(16→8→4) on a data set registered here.
TrainerConfig small_mlp_on(const std::string& data, int64_t batch_size) {
  TrainerConfig c;
  c.model.name = "mlp";
  c.model.input_dim = 16;
  c.model.hidden = 8;
  c.model.num_classes = 4;
  c.data = actors::DatasetSpec(data);
  c.batch_size = batch_size;
  return c;
}

TROUPE_DATASET("trainer_unit_slow_samples", [](const actors::DatasetSpec&) { return std::make_unique<SlowSamples>(); });

}  // namespace

// A data set that cannot give a sample fails the same way at every retry:
// the trainer's call fails with a ConfigError naming the data set and the
// sample (TrainJob does not retry those), not an anonymous error.
class BrokenSample final : public actors::Dataset {
 public:
  int64_t size() const override { return 64; }
  std::string describe() const override { return "broken_sample"; }

 protected:
  actors::Sample load(int64_t index, int64_t /*epoch*/) const override {
    if (index == 37) throw std::runtime_error("cannot decode this record");
    return {{"input", torch::full({16}, static_cast<float>(index))},
            {"target", torch::tensor(index % 4, torch::kLong)}};
  }
};

TROUPE_DATASET("trainer_unit_broken_sample",
               [](const actors::DatasetSpec&) { return std::make_unique<BrokenSample>(); });

TEST(TrainReportTest, ASampleTheDataSetCannotGiveIsAConfigErrorNamingIt) {
  TrainerConfig c = small_mlp_on("trainer_unit_broken_sample", 8);
  c.shuffle = false;
  TrainerActor t;
  t.setup(c);
  TrainRequest r;
  r.max_steps = 8;
  try {
    t.train(r);
    ADD_FAILURE() << "sample 37 was trained";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("broken_sample: sample 37 (epoch 0) failed: cannot decode this record"),
              std::string::npos)
        << e.what();
  }
}

// TrainReport::wait_seconds is the part of a call spent getting batches:
// with samples that are slow to load, at least their loading time, and no
// more than the call. (Not a share of the call: how long the steps take
// beside it depends on the machine's load.)
TEST(TrainReportTest, WaitSecondsAreTheTimeSpentGettingBatches) {
  TrainerConfig c = small_mlp_on("trainer_unit_slow_samples", 4);
  TrainerActor t;
  t.setup(c);
  TrainRequest r;
  r.max_steps = 3;
  const auto rep = t.train(r);
  EXPECT_EQ(rep.steps, 3);
  // 3 batches of 4 samples of at least 4 ms each.
  EXPECT_GE(rep.wait_seconds, 0.048);
  EXPECT_LE(rep.wait_seconds, rep.seconds);
}

// A train() call reads its steps' losses and metrics back from the device
// all at once, at its end. Six steps of two micro-steps each in one call
// must report what six one-step calls report, step by step, to the bit:
// the values land on the right step and micro-step.
TEST(TrainReportTest, OneCallReportsEveryStepAsOneStepCallsDo) {
  TrainerConfig c = troupe::test::small_mlp_job("report", 1, 16, 256).trainer;
  c.accumulation = 2;
  auto run = [&](int64_t per_call) {
    TrainerActor t;
    t.setup(c);
    TrainReport all;
    while (all.steps < 6) {
      TrainRequest r;
      r.cursor = t.progress().cursor;
      r.max_steps = per_call;
      auto rep = t.train(r);
      EXPECT_EQ(rep.steps, per_call);
      EXPECT_EQ(rep.step_loss_sum.size(), static_cast<size_t>(per_call));
      all.steps += rep.steps;
      all.loss_sum += rep.loss_sum;
      all.correct += rep.correct;
      for (size_t i = 0; i < rep.step_loss_sum.size(); ++i) {
        all.step_loss_sum.push_back(rep.step_loss_sum[i]);
        all.step_correct.push_back(rep.step_correct[i]);
        all.step_samples.push_back(rep.step_samples[i]);
        all.step_metric_sums.push_back(rep.step_metric_sums[i]);
      }
    }
    return all;
  };
  const auto one_call = run(6), stepwise = run(1);
  ASSERT_EQ(one_call.step_loss_sum.size(), 6u);
  std::set<double> distinct;
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(one_call.step_loss_sum[i], stepwise.step_loss_sum[i]) << "step " << i;
    EXPECT_EQ(one_call.step_correct[i], stepwise.step_correct[i]) << "step " << i;
    EXPECT_EQ(one_call.step_samples[i], 32) << "step " << i;
    EXPECT_EQ(one_call.step_metric_sums[i], stepwise.step_metric_sums[i]) << "step " << i;
    EXPECT_GT(one_call.step_loss_sum[i], 0) << "step " << i;
    distinct.insert(one_call.step_loss_sum[i]);
  }
  EXPECT_EQ(distinct.size(), 6u) << "every step has its own loss";
  EXPECT_EQ(one_call.correct, stepwise.correct);
}

namespace {

struct LinearResult {
  torch::Tensor y, dx, dw, db;
};

LinearResult run_linear(bool onednn, const torch::Tensor& x0, const torch::Tensor& w0, const torch::Tensor& b0) {
  auto x = x0.clone().requires_grad_(true);
  auto w = w0.clone().requires_grad_(true);
  auto b = b0.defined() ? b0.clone().requires_grad_(true) : torch::Tensor();
  auto y = onednn ? trainer::linear(x, w, b.defined() ? std::optional<torch::Tensor>(b) : std::nullopt)
                  : torch::nn::functional::linear(x, w, b);
  (y * torch::cos(y)).sum().backward();
  return {y.detach(), x.grad(), w.grad(), b.defined() ? b.grad() : torch::Tensor()};
}

void expect_close(const torch::Tensor& got, const torch::Tensor& want, const char* what) {
  ASSERT_EQ(got.defined(), want.defined()) << what;
  if (!want.defined()) return;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  // float32 products summed in another order: equal to a few units in the
  // last place of the largest entry.
  const double scale = want.abs().max().item<double>();
  EXPECT_TRUE(torch::allclose(got, want, 1e-4, 1e-5 * scale))
      << what << ": furthest apart by " << (got - want).abs().max().item<double>() << " at scale " << scale;
}

}  // namespace

// trainer::linear computes what torch's linear does, forward and all three
// gradients, for a batch of sequences, a plain matrix, no bias, and an input
// that is a transposed (non-contiguous) view; and the same bits twice.
TEST(CpuGemmTest, LinearEqualsTorchsForwardAndGradients) {
  std::string why_not;
  if (!onednn_available(&why_not)) GTEST_SKIP() << "no oneDNN here: " << why_not;
  torch::manual_seed(3);
  struct Case {
    torch::Tensor x, w, b;
    const char* name;
  };
  const std::vector<Case> cases = {
      {torch::randn({3, 17, 24}), torch::randn({40, 24}), torch::randn({40}), "3-d input"},
      {torch::randn({65, 31}), torch::randn({9, 31}), torch::randn({9}), "2-d input"},
      {torch::randn({5, 12, 8}), torch::randn({6, 8}), torch::Tensor(), "no bias"},
      {torch::randn({24, 10}).t(), torch::randn({7, 24}), torch::randn({7}), "transposed input"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const auto ours = run_linear(true, c.x, c.w, c.b);
    const auto torchs = run_linear(false, c.x, c.w, c.b);
    expect_close(ours.y, torchs.y, "output");
    expect_close(ours.dx, torchs.dx, "input gradient");
    expect_close(ours.dw, torchs.dw, "weight gradient");
    expect_close(ours.db, torchs.db, "bias gradient");
    const auto again = run_linear(true, c.x, c.w, c.b);
    EXPECT_TRUE(torch::equal(ours.y, again.y) && torch::equal(ours.dw, again.dw)) << "two runs differ";
  }
  // Its output may be changed in place (ReLU(inplace=True), a residual +=):
  // it is no view autograd would refuse to let change.
  {
    auto x = torch::randn({4, 3, 8}).requires_grad_(true);
    auto w = torch::randn({5, 8}).requires_grad_(true);
    auto y = trainer::linear(x, w);
    y.add_(1.0);
    y.relu_();
    y.sum().backward();
    auto x2 = x.detach().clone().requires_grad_(true);
    auto w2 = w.detach().clone().requires_grad_(true);
    auto y2 = torch::nn::functional::linear(x2, w2);
    y2.add_(1.0);
    y2.relu_();
    y2.sum().backward();
    expect_close(w.grad(), w2.grad(), "weight gradient after in-place relu");
  }
  // A gradient of a gradient (a gradient penalty: backward with
  // create_graph) is torch's.
  {
    auto second = [](bool ours) {
      torch::manual_seed(5);
      auto x = torch::randn({6, 7}).requires_grad_(true);
      auto w = torch::randn({3, 7}).requires_grad_(true);
      auto b = torch::randn({3}).requires_grad_(true);
      auto y = ours ? trainer::linear(x, w, b) : torch::nn::functional::linear(x, w, b);
      auto gx = torch::autograd::grad({(y * y).sum()}, {x}, {}, true, true)[0];
      (gx * gx).sum().backward();
      return w.grad();
    };
    expect_close(second(true), second(false), "weight gradient of a gradient penalty");
  }
  // What oneDNN does not take goes to torch unchanged: bitwise its result.
  const auto x = torch::randn({4, 6}, torch::kDouble), w = torch::randn({3, 6}, torch::kDouble);
  EXPECT_TRUE(torch::equal(trainer::linear(x, w), torch::nn::functional::linear(x, w)));
  // A shape torch rejects is rejected with torch's error.
  EXPECT_THROW(trainer::linear(torch::randn({2, 5}), torch::randn({3, 4})), c10::Error);
}

// A scripted module's aten::linear calls, its own and its submodules', are
// rewritten to troupe::linear, and the module computes what it did before.
// Without oneDNN (a LibTorch with it built in) troupe::linear is ATen's: the
// rewrite is checked there too.
TEST(CpuGemmTest, ScriptedModulesLinearsAreRouted) {
  torch::manual_seed(4);
  auto build = [] {
    torch::jit::Module inner("Inner");
    inner.register_parameter("w", torch::randn({16, 8}), false);
    inner.register_parameter("b", torch::randn({16}), false);
    inner.define("def forward(self, x):\n  return torch.relu(torch.linear(x, self.w, self.b))\n");
    torch::jit::Module outer("Outer");
    outer.register_module("inner", inner);
    outer.register_parameter("w", torch::randn({4, 16}), false);
    outer.define("def forward(self, x):\n  return torch.linear(self.inner.forward(x), self.w, None)\n");
    return outer;
  };
  torch::manual_seed(4);
  auto plain = build();
  torch::manual_seed(4);
  auto routed = build();
  EXPECT_EQ(route_linear(routed), 2);
  const auto graph = routed.get_method("forward").graph()->toString();
  EXPECT_NE(graph.find("troupe::linear"), std::string::npos) << graph;
  EXPECT_EQ(graph.find("aten::linear"), std::string::npos) << graph;
  const auto x = torch::randn({5, 8});
  const auto want = plain.forward({x}).toTensor();
  const auto got = routed.forward({x}).toTensor();
  EXPECT_TRUE(torch::allclose(got, want, 1e-4, 1e-5)) << (got - want).abs().max().item<double>();
}

// The built-in models' linear layers go to oneDNN when routed (the mlp's
// three, the cnn's one), computing what they did.
TEST(CpuGemmTest, BuiltInModelsRouteTheirLinearLayers) {
  std::string why_not;
  if (!onednn_available(&why_not)) GTEST_SKIP() << "no oneDNN here: " << why_not;
  ModelSpec mlp;
  mlp.input_dim = 12;
  mlp.hidden = 32;
  ModelSpec cnn;
  cnn.name = "cnn";
  cnn.hidden = 8;
  for (const auto& [spec, routed_count] : {std::pair{mlp, 3}, std::pair{cnn, 1}}) {
    SCOPED_TRACE(spec.name);
    torch::manual_seed(6);
    auto plain = make_model(spec);
    torch::manual_seed(6);
    auto routed = make_model(spec);
    EXPECT_EQ(routed->route_cpu_gemm(), routed_count);
    plain->train(false);
    routed->train(false);
    const auto x = spec.name == "mlp" ? torch::randn({5, 12}) : torch::randn({5, 1, 8, 8});
    expect_close(routed->forward(x), plain->forward(x), "output");
  }
}

// Two jobs given one checkpoint directory (two `troupe train` started at
// once, before either wrote a checkpoint) used to interleave their files:
// one failed, or the other's weights replaced its own. A writer holds
// DIR/.lock; a second one is refused, naming the holder's pid.
TEST(CheckpointWriterTest, ASecondWriterOfOneDirectoryIsRefusedNamingTheHolder) {
  const auto dir = troupe::test::fresh_dir("ckpt-lock") / "ckpt";
  {
    CheckpointWriter first(dir.string(), 3);
    try {
      CheckpointWriter second(dir.string(), 3);
      ADD_FAILURE() << "a second writer of " << dir << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(
          std::string(e.what()).find("checkpoint directory " + dir.string() +
                                     " is in use by another running job (pid " + std::to_string(::getpid()) + ")"),
          std::string::npos)
          << e.what();
    }
  }
  EXPECT_FALSE(std::filesystem::exists(dir / ".lock"));  // removed by the writer that held it
  CheckpointWriter again(dir.string(), 3);
  EXPECT_TRUE(std::filesystem::exists(dir / ".lock"));
  EXPECT_FALSE(latest_checkpoint(dir.string()).has_value());  // .lock is no checkpoint
}

// A trainer on a node that does not have the driver's model or data file
// says so, naming the file and this host (it said the file "does not
// exist", which the driver had just checked it did).
TEST(TrainerSetupTest, AFileMissingOnTheTrainersNodeIsNamedWithItsHost) {
  TrainerConfig c = troupe::test::small_mlp_job("files", 1, 32, 256).trainer;
  c.device = "cpu";
  c.model.name = "torchscript";
  c.model.path = "/nonexistent/troupe-test/step.pt";
  TrainerActor t;
  try {
    t.setup(c);
    ADD_FAILURE() << "a missing model file was taken";
  } catch (const troupe::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("the model /nonexistent/troupe-test/step.pt is not on "), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("put it on storage every node shares"), std::string::npos) << e.what();
  }
}
