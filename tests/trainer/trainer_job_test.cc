// TrainJob on a LocalCluster, with TrainerActors in real worker processes:
// data-parallel equivalence with a single worker, bitwise resume from a
// checkpoint, checkpoints that Python's torch.load reads, a checkpoint
// directory killed half-written is never taken as the latest, a
// TorchScript model from Python trains, and bad input fails up front; a
// step that raises mid-run fails the job with one line naming the step it
// raised at.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "tests/support/python.h"
#include "tests/support/temp_dir.h"
#include "tests/support/train_jobs.h"
#include "tests/support/wait.h"
#include "troupe/runtime/collective/group.h"
#include "troupe/runtime/core/files.h"
#include "troupe/runtime/testing/local_cluster.h"
#include "troupe/trainer/checkpoint.h"
#include "troupe/trainer/sync_batch_norm.h"
#include "troupe/trainer/train_job.h"
#include "troupe/trainer/train_step.h"

using namespace std::chrono_literals;
using troupe::test::kWaitBound;
using namespace troupe;
using namespace troupe::trainer;
namespace fs = std::filesystem;

// Writes checkpoints of a few MB in a loop until killed.
class CheckpointLoop {
 public:
  int64_t pid() { return ::getpid(); }
  void write_forever(std::string root) {
    TrainState s;
    s.model["w"] = torch::randn({4 << 20});  // 16 MB: a write takes a while
    for (int64_t step = 1;; ++step) {
      s.step = step;
      save_checkpoint(root, s);
    }
  }
};
TROUPE_ACTOR(CheckpointLoop, &CheckpointLoop::pid, &CheckpointLoop::write_forever)

namespace {

// Classification that raises at its `at`-th training call (config
// "MODE:AT"): MODE "raise" throws a plain error on every rank, "raise1"
// on rank 1 only (needs sync_batchnorm, below, to know its rank); "abort"
// has rank 1 abort the group, and every rank, once it sees the group
// aborted, throws a c10::Error (whose what() carries LibTorch's C++
// backtrace), as a torch op failing under a peer's abort does. Needs
// sync_batchnorm, whose scope hands the step the trainer's group.
class RaisingStep : public TrainStep {
 public:
  explicit RaisingStep(const std::string& config)
      : abort_(config.rfind("abort:", 0) == 0),
        rank1_only_(config.rfind("raise1:", 0) == 0),
        at_(std::stoll(config.substr(config.find(':') + 1))) {}
  StepOutput train(Model& model, const actors::TensorDict& batch) override {
    if (++calls_ == at_) {
      collective::Group* g = SyncBatchNormScope::current();
      const int rank = g ? g->rank() : 0;
      if (!abort_ && (!rank1_only_ || rank == 1)) throw std::runtime_error("boom at call " + std::to_string(calls_));
      if (abort_) {
        if (g && rank == 1) g->abort("the test's rank 1 aborts");
        const auto until = std::chrono::steady_clock::now() + 60s;
        while (g && !g->is_aborted() && std::chrono::steady_clock::now() < until)
          std::this_thread::sleep_for(1ms);  // polls a condition, bounded
        TORCH_CHECK(false, "rank ", rank, " raised under the abort");
      }
    }
    StepOutput out;
    out.loss = torch::nn::functional::cross_entropy(model.forward(batch.at("input")), batch.at("target"));
    return out;
  }
  StepOutput eval(Model& model, const actors::TensorDict& batch) override {
    StepOutput out;
    out.loss = torch::nn::functional::cross_entropy(model.forward(batch.at("input")), batch.at("target"));
    return out;
  }
  std::string describe() const override { return "raising"; }

 private:
  const bool abort_;
  const bool rank1_only_;
  const int64_t at_;
  int64_t calls_ = 0;
};

}  // namespace

TROUPE_STEP("test_raising", [](const std::string& config) { return std::make_unique<RaisingStep>(config); });

namespace {

// Classification whose evaluation fails: config "user" raises the user's
// own error on every call; "runtime:DIR" throws a troupe::Error (a failure
// of the runtime's, which a replacement may mend) once in all, marked by
// DIR/raised.
class EvalFailingStep : public RaisingStep {
 public:
  explicit EvalFailingStep(std::string config) : RaisingStep("raise:-1"), config_(std::move(config)) {}
  StepOutput eval(Model& model, const actors::TensorDict& batch) override {
    if (config_ == "user") throw std::runtime_error("eval bug");
    const std::string mark = config_.substr(config_.find(':') + 1) + "/raised";
    if (!fs::exists(mark)) {
      std::ofstream(mark) << "";
      throw troupe::Error("a runtime failure during evaluation");
    }
    return RaisingStep::eval(model, batch);
  }

 private:
  const std::string config_;
};

}  // namespace

TROUPE_STEP("test_eval_failing", [](const std::string& config) { return std::make_unique<EvalFailingStep>(config); });

// A step that cannot be made anywhere: its factory throws on every
// trainer, an error of troupe's own kind (not a ConfigError, which the
// start rethrows anyway), that new trainers would meet again.
TROUPE_STEP("test_unmakeable", [](const std::string&) -> std::unique_ptr<TrainStep> {
  throw troupe::Error("this step needs a file no node has");
});
// Classification whose trainer, while it is set up, writes DIR/started-PID
// and waits for DIR/go (config "DIR"; up to two minutes): a test kills a
// trainer while the job starts.
TROUPE_STEP("test_gated", [](const std::string& dir) {
  std::ofstream(dir + "/started-" + std::to_string(::getpid())) << "";
  troupe::test::eventually([&] { return fs::exists(dir + "/go"); }, 120s);
  return std::make_unique<RaisingStep>("raise:-1");
});

// Classification samples that carry 4200 tensors each besides their input
// and target: a batch of 4 makes each a 32 KiB tensor, sent beside the
// message (as every tensor of 16 KiB or more is), and one frame carries
// 4096 of those: no loader can stream the batch to its trainer.
class ManyTensors final : public actors::Dataset {
 public:
  int64_t size() const override { return 64; }
  std::string describe() const override { return "many_tensors"; }

 protected:
  actors::Sample load(int64_t index, int64_t /*epoch*/) const override {
    actors::TensorDict::Map m{{"input", torch::full({16}, static_cast<float>(index))},
                              {"target", torch::tensor(index % 4, torch::kLong)}};
    for (int i = 0; i < 4200; ++i) m.emplace("extra" + std::to_string(i), torch::zeros({2048}));
    return actors::Sample(std::move(m));
  }
};
TROUPE_DATASET("test_many_tensors", [](const actors::DatasetSpec&) { return std::make_unique<ManyTensors>(); });

namespace {

using troupe::test::eventually;
using troupe::test::fresh_dir;

TrainJobConfig small_job(int64_t workers, int64_t batch) {
  TrainJobConfig c = troupe::test::small_mlp_job("test", workers, batch, 256);
  c.trainer.optimizer.lr = 0.05;
  return c;
}

void expect_close(const TrainState& a, const TrainState& b, double tol, const std::string& what) {
  ASSERT_EQ(a.model.size(), b.model.size()) << what;
  for (const auto& [name, t] : a.model) {
    const auto& u = b.model.at(name);
    double diff = (t - u).abs().max().item<double>();
    EXPECT_LE(diff, tol) << what << ": " << name;
  }
}

class TrainJobTest : public ::testing::Test {
 protected:
  TrainJobTest()
      : cluster_(troupe::testing::LocalClusterOptions{.nodes = {{{"CPU", 2}}, {{"CPU", 2}}}}),
        rt_(cluster_.connect()) {}
  troupe::testing::LocalCluster cluster_;
  Runtime rt_;
};

// 2 workers × batch b reach the weights of 1 worker × batch 2b: SGD and
// AdamW, with and without gradient accumulation.
TEST_F(TrainJobTest, TwoWorkersMatchOneWorkerWithTheDoubleBatch) {
  for (std::string opt : {"sgd", "adamw"}) {
    for (int64_t accumulation : {1, 2}) {
      auto one = small_job(1, 32);
      auto two = small_job(2, 16);
      for (auto* c : {&one, &two}) {
        c->trainer.optimizer.name = opt;
        c->trainer.optimizer.lr = opt == "sgd" ? 0.05 : 0.005;
        c->trainer.accumulation = accumulation;
        c->epochs = 2;
      }
      auto r1 = TrainJob(rt_, one).fit();
      auto r2 = TrainJob(rt_, two).fit();
      std::string what = opt + " accumulation " + std::to_string(accumulation);
      EXPECT_EQ(r1.steps, 2 * 256 / (32 * accumulation)) << what;
      EXPECT_EQ(r1.steps, r2.steps) << what;
      expect_close(r1.final_state, r2.final_state, 2e-5, what);
      // The same through TCP (Gloo) rather than shared memory.
      two.trainer.shared_memory = false;
      if (opt == "sgd" && accumulation == 2)
        expect_close(r1.final_state, TrainJob(rt_, two).fit().final_state, 2e-5, what + " gloo");
      EXPECT_GT(r1.history.back().train_loss, 0.0);
    }
  }
}

// The EMA of the weights follows ema = d * ema + (1 - d) * w after each
// step (starting from the first step's weights) and travels in the state.
TEST_F(TrainJobTest, EmaOfWeightsFollowsTheRecurrence) {
  auto c = small_job(1, 32);
  c.trainer.ema_decay = 0.75;
  c.max_steps = 1;
  auto r1 = TrainJob(rt_, c).fit();
  c.max_steps = 2;
  auto r2 = TrainJob(rt_, c).fit();
  ASSERT_EQ(r2.steps, 2);
  int checked = 0;
  for (const auto& [name, w2] : r2.final_state.model) {
    auto e = r2.final_state.optimizer.find("ema/" + name);
    if (e == r2.final_state.optimizer.end()) continue;  // buffers have no EMA
    auto e1 = r1.final_state.optimizer.at("ema/" + name);
    EXPECT_TRUE(torch::equal(e1, r1.final_state.model.at(name))) << name;  // starts at the first step's weights
    auto expect = 0.75 * r1.final_state.model.at(name) + 0.25 * w2;
    EXPECT_LE((e->second - expect).abs().max().item<double>(), 1e-6) << name;
    EXPECT_FALSE(torch::equal(e->second, w2)) << name;
    ++checked;
  }
  EXPECT_GT(checked, 0);
  c.trainer.ema_decay = 1.5;
  EXPECT_THROW(TrainJob(rt_, c), troupe::ConfigError);
  // A negative step limit is refused, not taken as "no limit".
  c.trainer.ema_decay = 0.5;
  c.max_steps = -3;
  try {
    TrainJob(rt_, c);
    ADD_FAILURE() << "max_steps = -3 accepted";
  } catch (const troupe::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("max_steps must be 0 (run the epochs) or positive, got -3"), std::string::npos)
        << e.what();
  }
}

// 2 epochs + checkpoint + 1 more == 3 epochs, bitwise; the checkpoint is
// readable by Python's torch.load; resuming with another worker count works.
TEST_F(TrainJobTest, ResumeFromCheckpointIsBitwiseEqual) {
  auto dir = fresh_dir("resume");
  auto full = small_job(2, 16);
  full.epochs = 3;
  full.trainer.optimizer.name = "adamw";
  full.trainer.optimizer.lr = 0.005;
  auto rf = TrainJob(rt_, full).fit();

  auto first = full;
  first.epochs = 2;
  first.checkpoint.dir = dir.string();
  first.checkpoint.keep = 1;
  auto r1 = TrainJob(rt_, first).fit();
  ASSERT_TRUE(r1.last_checkpoint.has_value());
  EXPECT_EQ(r1.last_checkpoint->step, r1.steps);
  EXPECT_EQ(list_checkpoints(dir.string()).size(), 1u);  // pruned to keep = 1

  auto second = full;
  second.resume_from = dir.string();
  auto r2 = TrainJob(rt_, second).fit();
  EXPECT_EQ(r2.steps, rf.steps);
  ASSERT_EQ(r2.history.size(), 1u);
  for (const auto& [name, t] : rf.final_state.model)
    EXPECT_TRUE(torch::equal(t, r2.final_state.model.at(name))) << name;
  for (const auto& [name, t] : rf.final_state.optimizer)
    EXPECT_TRUE(torch::equal(t, r2.final_state.optimizer.at(name))) << name;

  // Python reads the state dict, with the weights-only unpickler that is
  // torch.load's default from PyTorch 2.6 on.
  std::string cmd = troupe::test::python() + " -c \"import torch,sys; d=torch.load('" + r1.last_checkpoint->path +
                    "/model.pt', weights_only=True); o=torch.load('" + r1.last_checkpoint->path +
                    "/optimizer.pt', weights_only=True); sys.exit(0 if "
                    "sorted(d)==['fc1.bias','fc1.weight','fc2.bias','fc2.weight','fc3.bias','fc3.weight'] and "
                    "d['fc1.weight'].shape==(32,16) and 'step' in o else 1)\"";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;

  // Written at an epoch's end, it takes another data order too: the next
  // epoch begins in it. It was refused as "stopped mid-epoch 2" (its
  // cursor at the end of the epoch was taken for one inside it).
  auto reseeded = second;
  reseeded.trainer.seed = 99;
  auto r4 = TrainJob(rt_, reseeded).fit();
  EXPECT_EQ(r4.steps, rf.steps);
  ASSERT_EQ(r4.history.size(), 1u);
  EXPECT_EQ(r4.history[0].epoch, 2);

  // A different number of workers continues from the same checkpoint.
  auto other = second;
  other.scaling.num_workers = 1;
  other.trainer.batch_size = 32;
  auto r3 = TrainJob(rt_, other).fit();
  EXPECT_EQ(r3.steps, r1.steps + 256 / 32);
  troupe::core::remove_tree(dir);
}

// A job does not write into a directory that holds another run's
// checkpoints: its own new ones were pruned at once (the other's steps
// counted as newest; its last_checkpoint named a folder gone), and losing
// every trainer it restored the other run's weights. Going on from them
// (resume_from in that directory) is its own.
TEST_F(TrainJobTest, AJobRefusesADirectoryHoldingAnotherRunsCheckpoints) {
  auto dir = fresh_dir("another-run");
  auto c = small_job(2, 16);
  c.checkpoint.dir = dir.string();
  c.checkpoint.every_steps = 4;
  c.checkpoint.keep = 0;  // every one kept
  ASSERT_TRUE(TrainJob(rt_, c).fit().last_checkpoint.has_value());
  const auto all = list_checkpoints(dir.string());
  ASSERT_GE(all.size(), 2u);
  {
    // A running job holds it: said first (its advice would not help).
    troupe::trainer::CheckpointWriter held(dir.string(), 0);
    try {
      TrainJob busy(rt_, c);
      ADD_FAILURE() << "a directory a running job holds was taken";
    } catch (const troupe::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("is in use by another running job"), std::string::npos) << e.what();
    }
  }
  // From an older checkpoint of it: the newer ones are another run's.
  auto older = c;
  older.resume_from = all.front().path;
  try {
    TrainJob rollback(rt_, older);
    ADD_FAILURE() << "a resume below newer checkpoints of the directory was taken";
  } catch (const troupe::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("holds checkpoints newer than resume_from"), std::string::npos) << e.what();
  }
  try {
    TrainJob again(rt_, c);
    ADD_FAILURE() << "a second run into the same checkpoint directory was taken";
  } catch (const troupe::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint.dir " + dir.string() + " already holds a checkpoint"),
              std::string::npos)
        << e.what();
  }
  c.resume_from = dir.string();
  c.epochs = 3;
  auto r = TrainJob(rt_, c).fit();
  ASSERT_TRUE(r.last_checkpoint.has_value());
  EXPECT_TRUE(fs::exists(r.last_checkpoint->path)) << r.last_checkpoint->path;
  troupe::core::remove_tree(dir);
}

// A trainer that dies while the job starts (in its setup, before any
// step) is a failure like any other: the job starts over with new trainers
// and ends with the weights of a run without it. It failed at once,
// whatever max_failures said.
TEST_F(TrainJobTest, ATrainerKilledWhileTheJobStartsIsReplaced) {
  auto dir = fresh_dir("gated");
  auto c = small_job(2, 16);
  c.trainer.step = StepSpec{"test_gated", dir.string()};
  c.failure.max_failures = 1;
  std::ofstream((dir / "go").string()) << "";
  const auto clean = TrainJob(rt_, c).fit();
  fs::remove(dir / "go");
  for (const auto& e : fs::directory_iterator(dir)) fs::remove(e.path());

  std::thread killer([&] {
    std::vector<pid_t> started;
    eventually(
        [&] {
          started.clear();
          for (const auto& e : fs::directory_iterator(dir))
            if (e.path().filename().string().rfind("started-", 0) == 0)
              started.push_back(std::stoi(e.path().filename().string().substr(8)));
          return started.size() >= 2;
        },
        kWaitBound);
    if (!started.empty()) ::kill(started.front(), SIGKILL);
    std::ofstream((dir / "go").string()) << "";
  });
  Result r;
  try {
    r = TrainJob(rt_, c).fit();
  } catch (...) {
    killer.join();
    throw;
  }
  killer.join();
  ASSERT_EQ(r.recoveries.size(), 1u);
  EXPECT_NE(r.recoveries[0].cause.find("while the job started"), std::string::npos) << r.recoveries[0].cause;
  EXPECT_EQ(r.steps, clean.steps);
  for (const auto& [name, t] : clean.final_state.model)
    EXPECT_TRUE(torch::equal(t, r.final_state.model.at(name))) << name;
  troupe::core::remove_tree(dir);
}

// Only a death is retried at the start: an error that new trainers would
// meet again ends the job at once with that error, also with no limit on
// failures (it started over for ever).
TEST_F(TrainJobTest, AnErrorEveryTrainerMeetsWhileTheJobStartsIsNotRetried) {
  auto c = small_job(2, 16);
  c.trainer.step = StepSpec{"test_unmakeable", ""};
  c.failure.max_failures = -1;
  try {
    TrainJob(rt_, c).fit();
    ADD_FAILURE() << "the job did not fail";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("this step needs a file no node has"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("while the job started"), std::string::npos) << e.what();
  }
}

// A batch too large to stream (over the frame limits) is the job's
// configuration: every retry would make the same batch. The loader's feed
// failed with a StreamError, which it took for its reader's going and kept
// from the driver; the trainers failed with "stream writer destroyed" and
// the job was retried until max_failures. It now ends at once, naming the
// batch and what to change.
TEST_F(TrainJobTest, ABatchTooLargeToStreamEndsTheJobNamingIt) {
  auto c = small_job(2, 4);
  c.trainer.data = actors::DatasetSpec("test_many_tensors");
  c.failure.max_failures = 3;
  try {
    TrainJob(rt_, c).fit();
    ADD_FAILURE() << "the job did not fail";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cannot be sent to its trainer"), std::string::npos) << what;
    EXPECT_NE(what.find("4096"), std::string::npos) << what;
    EXPECT_NE(what.find("fewer tensors per sample"), std::string::npos) << what;
    EXPECT_EQ(what.find("failure 2"), std::string::npos) << what;  // not retried
    if (const auto* failed = dynamic_cast<const JobFailed*>(&e)) {
      EXPECT_TRUE(failed->result().recoveries.empty()) << failed->result().recoveries.front().cause;
    }
  }
}

// A step whose evaluation raises is the user's error, as one whose training
// step raises: the job ends at once naming the rank and the validation.
// It was retried as a crash (for ever with no limit on failures).
TEST_F(TrainJobTest, AStepWhoseEvaluationRaisesEndsTheJobNamingIt) {
  auto c = small_job(2, 16);
  c.trainer.step = StepSpec{"test_eval_failing", "user"};
  c.evaluate = true;
  c.failure.max_failures = -1;
  try {
    TrainJob(rt_, c).fit();
    ADD_FAILURE() << "the job did not fail";
  } catch (const JobFailed& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("failed evaluating a batch"), std::string::npos) << what;
    EXPECT_NE(what.find("eval bug"), std::string::npos) << what;
    EXPECT_EQ(what.find("failure 2"), std::string::npos) << what;  // not retried
  }
}

// With EMA on, evaluation swaps the averaged weights in: one that failed
// (here a runtime error, healed) left them in place as the live weights,
// which the heal then sent to every rank. The job now ends with the
// weights of a run without the failure.
TEST_F(TrainJobTest, AFailedEvaluationLeavesTheLiveWeightsNotTheAverage) {
  auto dir = fresh_dir("eval-failing");
  auto c = small_job(2, 16);
  c.epochs = 2;
  c.trainer.ema_decay = 0.9;
  c.evaluate = true;
  c.failure.max_failures = 2;
  c.trainer.step = StepSpec{"test_eval_failing", "runtime:" + dir.string()};
  std::ofstream((dir / "raised").string()) << "";
  const auto clean = TrainJob(rt_, c).fit();
  fs::remove(dir / "raised");
  const auto r = TrainJob(rt_, c).fit();
  ASSERT_EQ(r.recoveries.size(), 1u);
  for (const auto& [name, t] : clean.final_state.model)
    EXPECT_TRUE(torch::equal(t, r.final_state.model.at(name))) << name;
  troupe::core::remove_tree(dir);
}

TEST_F(TrainJobTest, PeriodicCheckpointsAndMetrics) {
  auto dir = fresh_dir("periodic");
  auto c = small_job(2, 16);
  c.epochs = 2;
  c.checkpoint.dir = (dir / "ckpt").string();
  c.checkpoint.every_steps = 3;
  c.checkpoint.keep = 2;
  c.metrics_path = (dir / "metrics.jsonl").string();
  c.evaluate = true;
  c.trainer.validation_fraction = 0.25;
  auto r = TrainJob(rt_, c).fit();
  // 192 training samples / (2 × 16) = 6 steps an epoch.
  EXPECT_EQ(r.steps, 12);
  auto all = list_checkpoints(c.checkpoint.dir);
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all.back().step, 12);
  EXPECT_EQ(all.back().world_size, 2);
  EXPECT_EQ(r.history.size(), 2u);
  EXPECT_EQ(r.history.back().val_count, 64);
  std::ifstream m(c.metrics_path);
  int steps = 0, epochs = 0;
  for (std::string line; std::getline(m, line);) {
    steps += line.find("\"kind\":\"step\"") != std::string::npos;
    epochs += line.find("\"kind\":\"epoch\"") != std::string::npos;
  }
  EXPECT_EQ(steps, 12);
  EXPECT_EQ(epochs, 2);
  troupe::core::remove_tree(dir);
}

// A writer process killed (SIGKILL) in the middle of a checkpoint leaves
// no directory that latest_checkpoint() would pick; nor do directories
// without a manifest or with a corrupt file.
// A stop is seen at a step boundary, and rounds are cut to stop_within: with
// neither progress nor periodic checkpoints (one round would otherwise be
// the whole epoch) the job stops at the step where it was asked to, with a
// checkpoint of that step.
TEST_F(TrainJobTest, StopRequestedStopsWithinARoundOfStopWithin) {
  auto dir = fresh_dir("stop");
  auto c = small_job(2, 16);  // 256 samples / (2 × 16) = 8 steps an epoch
  c.epochs = 2;
  c.checkpoint.dir = dir.string();
  c.stop_within = 0ms;  // one step a round
  int64_t seen = 0;
  c.on_step = [&](const StepInfo& s) { seen = s.step; };
  c.stop_requested = [&] { return seen >= 3; };
  auto r = TrainJob(rt_, c).fit();
  EXPECT_TRUE(r.interrupted);
  EXPECT_EQ(r.steps, 3);
  ASSERT_TRUE(r.last_checkpoint.has_value());
  EXPECT_EQ(r.last_checkpoint->step, 3);
  bool event = false;
  for (const auto& e : r.events) event = event || e.kind == JobEventKind::kInterrupted;
  EXPECT_TRUE(event);
  troupe::core::remove_tree(dir);
}

TEST_F(TrainJobTest, HalfWrittenCheckpointIsNeverLatest) {
  auto dir = fresh_dir("killed");
  auto w = rt_.spawn<CheckpointLoop>({});
  auto pid = w.call(&CheckpointLoop::pid).get(kWaitBound);
  auto f = w.call(&CheckpointLoop::write_forever, dir.string());
  // Kill it while a temporary directory exists and at least one checkpoint
  // is complete.
  ASSERT_TRUE(eventually(
      [&] {
        if (list_checkpoints(dir.string()).empty()) return false;
        for (const auto& e : fs::directory_iterator(dir))
          if (e.path().filename().string().rfind(".tmp-", 0) == 0) return true;
        return false;
      },
      60s));
  ASSERT_EQ(::kill(static_cast<pid_t>(pid), SIGKILL), 0);
  EXPECT_THROW(f.get(kWaitBound), ActorDied);
  auto latest = latest_checkpoint(dir.string());
  ASSERT_TRUE(latest.has_value());
  EXPECT_NO_THROW(load_checkpoint(latest->path));
  // Forged leftovers: a step dir without manifest, and one whose file no
  // longer matches its checksum.
  fs::create_directories(dir / "step-99999998");
  fs::copy(latest->path, dir / "step-99999999", fs::copy_options::recursive);
  { std::ofstream(dir / "step-99999999" / "model.pt", std::ios::app) << "x"; }
  auto again = latest_checkpoint(dir.string());
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->step, latest->step);
  prune_checkpoints(dir.string(), 1);
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_NE(e.path().filename().string().rfind(".tmp-", 0), 0u) << e.path();
  troupe::core::remove_tree(dir);
}

TEST_F(TrainJobTest, TorchScriptModelFromPythonTrains) {
  auto dir = fresh_dir("script");
  auto path = (dir / "model.pt").string();
  std::string cmd = troupe::test::python() +
                    " -c \"import torch; torch.manual_seed(0); m=torch.nn.Sequential(torch.nn.Linear(16,32), "
                    "torch.nn.ReLU(), torch.nn.Linear(32,4)); torch.jit.save(torch.jit.script(m), '" +
                    path + "')\"";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  auto c = small_job(2, 16);
  c.trainer.model.name = "torchscript";
  c.trainer.model.path = path;
  c.epochs = 4;
  auto r = TrainJob(rt_, c).fit();
  ASSERT_EQ(r.history.size(), 4u);
  EXPECT_LT(r.history.back().train_loss, 0.8 * r.history.front().train_loss);
  EXPECT_EQ(r.final_state.model.count("0.weight"), 1u);
  troupe::core::remove_tree(dir);
}

// The CNN with BatchNorm on the real digits images, two workers.
TEST_F(TrainJobTest, CnnWithBatchNormTrainsOnDigits) {
  auto c = small_job(2, 32);
  c.trainer.model = ModelSpec{};
  c.trainer.model.name = "cnn";
  c.trainer.model.hidden = 16;
  c.trainer.data = actors::DatasetSpec("digits").set("normalize", 1).set("image", 1);
  c.trainer.validation_fraction = 0.2;
  c.trainer.optimizer.name = "adamw";
  c.trainer.optimizer.lr = 0.01;
  c.epochs = 3;
  c.evaluate = true;
  auto r = TrainJob(rt_, c).fit();
  ASSERT_EQ(r.history.size(), 3u);
  EXPECT_LT(r.history.back().train_loss, r.history.front().train_loss);
  EXPECT_GT(r.history.back().val_accuracy, 0.3);  // chance is 0.1
  EXPECT_EQ(r.final_state.model.count("bn1.running_mean"), 1u);
}

TEST_F(TrainJobTest, BadInputFailsBeforeAnyWork) {
  auto expect_error = [&](TrainJobConfig c, const std::string& needle) {
    try {
      TrainJob(rt_, c).fit();
      ADD_FAILURE() << "no error for " << needle;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto c = small_job(1, 16);
  c.trainer.model.name = "transformer-xxl";
  expect_error(c, "unknown model 'transformer-xxl'");
  c = small_job(1, 16);
  c.trainer.model.name = "torchscript";
  c.trainer.model.path = "/no/such/model.pt";
  expect_error(c, "/no/such/model.pt");
  c = small_job(1, 0);
  expect_error(c, "batch_size must be positive");
  c = small_job(2, 200);  // 256 samples: 128 a worker, less than a step
  expect_error(c, "fewer than one step on each of 2 workers (200 samples a step)");
  // A validation split counts only its training part: 256 less half is 64
  // a worker, less than a step of 100 (0-step epochs, reported a success).
  c = small_job(2, 100);
  c.trainer.validation_fraction = 0.5;
  expect_error(c, "256 samples (128 in its training split), fewer than one step on each of 2 workers");
  c = small_job(5, 16);
  expect_error(c, "PENDING");
  expect_error(c, "CPU");
  // Nothing was spawned.
  auto status = rt_.status_json();
  EXPECT_EQ(status.find("TrainerActor"), std::string::npos) << status;
}

// A job refused because another holds its checkpoint directory leaves no
// trace: no metrics file (which may be the running job's own), and nothing
// spawned. One that can never be placed makes neither file nor directory.
TEST_F(TrainJobTest, AJobRefusedTheCheckpointDirectoryLeavesNoMetricsFile) {
  auto dir = fresh_dir("refused");
  auto c = small_job(5, 16);  // more workers than the cluster has CPUs
  c.checkpoint.dir = (dir / "ckpt").string();
  c.metrics_path = (dir / "metrics.jsonl").string();
  EXPECT_THROW(TrainJob(rt_, c).fit(), ConfigError);
  EXPECT_FALSE(fs::exists(c.metrics_path));
  EXPECT_FALSE(fs::exists(c.checkpoint.dir));
  c.scaling.num_workers = 1;
  CheckpointWriter other(c.checkpoint.dir, 0, {});
  try {
    TrainJob(rt_, c).fit();
    ADD_FAILURE() << "a second job on a held checkpoint directory ran";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("in use by another running job"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(c.metrics_path));
  EXPECT_EQ(rt_.status_json().find("TrainerActor"), std::string::npos);
  troupe::core::remove_tree(dir);
}

// A step that raises at step 6 of a round of steps 1 to 8 (the epoch's)
// fails the job naming step 6, not the round's start (the last step
// boundary the driver saw).
TEST_F(TrainJobTest, AStepThatRaisesMidRoundNamesTheStepItRaisedAt) {
  auto c = small_job(2, 16);
  c.trainer.step = StepSpec{"test_raising", "raise:6"};
  c.progress_every_steps = 10;
  c.failure.max_failures = 3;  // the peer's abort is healed; the step's error ends the job
  try {
    TrainJob(rt_, c).fit();
    ADD_FAILURE() << "the job did not fail";
  } catch (const JobFailed& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(", step 6: boom at call 6"), std::string::npos) << what;
    EXPECT_NE(what.find("training failed between steps 1 and 8: "), std::string::npos) << what;
    EXPECT_EQ(what.find("failed at step 0"), std::string::npos) << what;
  }
}

// A step that raises on rank 1 only aborts rank 0's collective, and rank
// 0's "aborted" can reach the driver first: the failure named is rank 1's
// own error, the user's, which ends the job at once. No recovery starts on
// rank 0's account (a probe saw "failure rank 0 ...: allreduce aborted"
// logged before the job ended with rank 1's error).
TEST_F(TrainJobTest, AStepRaisingOnOneRankIsNamedBeforeItsPeersAbort) {
  auto c = small_job(2, 16);
  c.trainer.step = StepSpec{"test_raising", "raise1:3"};
  c.trainer.sync_batchnorm = true;  // the step learns its rank from the group
  c.progress_every_steps = 10;
  c.failure.max_failures = 3;
  try {
    TrainJob(rt_, c).fit();
    ADD_FAILURE() << "the job did not fail";
  } catch (const JobFailed& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("at rank 1, step 3: boom at call 3"), std::string::npos) << what;
    for (const auto& ev : e.result().events)
      EXPECT_NE(ev.kind, JobEventKind::kFailure) << "a recovery began: " << ev.detail;
  }
}

// A torch error raised while the group is aborted (a peer's failure) is a
// failure of the round, reported in one line: not the c10::Error's text,
// which ends with tens of frames of C++ backtrace.
TEST_F(TrainJobTest, AStepRaisingUnderAnAbortedGroupReportsNoCppBacktrace) {
  auto c = small_job(2, 16);
  c.trainer.step = StepSpec{"test_raising", "abort:3"};
  c.trainer.sync_batchnorm = true;
  c.progress_every_steps = 1;
  c.failure.max_failures = 0;
  try {
    TrainJob(rt_, c).fit();
    ADD_FAILURE() << "the job did not fail";
  } catch (const ConfigError& e) {
    ADD_FAILURE() << "a failure under an abort ended the job as the user's error: " << e.what();
  } catch (const JobFailed& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("failure.max_failures"), std::string::npos) << what;  // a failure, as before
    EXPECT_NE(what.find("raised under the abort"), std::string::npos) << what;
    EXPECT_NE(what.find(", step 3"), std::string::npos) << what;
    EXPECT_EQ(what.find("Exception raised from"), std::string::npos) << what;
    EXPECT_EQ(what.find("frame #"), std::string::npos) << what;
    bool saw_failure = false;
    for (const auto& ev : e.result().events) {
      EXPECT_EQ(ev.detail.find('\n'), std::string::npos) << ev.detail;
      saw_failure |= ev.kind == JobEventKind::kFailure;
    }
    EXPECT_TRUE(saw_failure);
  }
}

}  // namespace
