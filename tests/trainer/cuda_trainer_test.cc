// The CUDA trainer (issue 17's GPU lane): steps on cuda:0 equal the same
// steps on the CPU within float tolerance (SGD, AdamW, the EMA), bf16
// autocast and fp16 with dynamic loss scaling (a forced overflow step is
// skipped and the scale halves), a checkpoint written from GPU state loads
// with Python's torch.load where no GPU is visible, and a TrainJob whose
// trainer asks for {GPU: 1} on a real node agent trains on cuda:0 from a
// DataLoaderActor's stream and reaches the CPU job's weights; two trainers
// sharing one GPU ({GPU: 0.5} each) heal a SIGKILLed one to the weights of
// the run without the kill. A train() call of several steps makes the host
// wait for the device once, for its losses, and never per step (counted
// with c10's sync debug mode where LibTorch was built with CUDA).
//
// Every test but the first skips where LibTorch sees no CUDA device; the
// GPU lane (scripts/gpu_check.sh) runs them with `ctest -L gpu`.
#include <gtest/gtest.h>
#include <torch/torch.h>
#if TROUPE_TEST_SYNC_DEBUG
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Backtrace.h>
#include <c10/util/Exception.h>
#endif

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/support/python.h"
#include "tests/support/temp_dir.h"
#include "tests/support/train_jobs.h"
#include "tests/trainer/state_compare.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/testing/fault_injector.h"
#include "troupe/runtime/testing/local_cluster.h"
#include "troupe/trainer/checkpoint.h"
#include "troupe/trainer/train_job.h"
#include "troupe/trainer/trainer_actor.h"

using namespace troupe;
using namespace troupe::trainer;
namespace fs = std::filesystem;

namespace {

bool have_cuda() { return torch::cuda::is_available(); }

#define SKIP_WITHOUT_CUDA() \
  if (!have_cuda()) GTEST_SKIP() << "LibTorch sees no CUDA device"

// The tests' small MLP job (tests/support/train_jobs.h), one trainer's part.
TrainerConfig small_config(const std::string& device, const std::string& optimizer) {
  TrainerConfig c = troupe::test::small_mlp_job("cuda", 1, 32, 256).trainer;
  c.seed = 7;
  c.device = device;
  c.optimizer.name = optimizer;
  c.optimizer.lr = optimizer == "sgd" ? 0.05 : 0.005;
  c.optimizer.momentum = 0.9;
  return c;
}

// Runs `steps` optimizer steps of epoch 0 in-process and returns the state
// (every tensor on the CPU, as state() hands it out).
TrainState run(const TrainerConfig& c, int64_t steps, TrainerInfo* info = nullptr) {
  TrainerActor t;
  auto i = t.setup(c);
  if (info) *info = i;
  TrainRequest r;
  r.max_steps = steps;
  EXPECT_EQ(t.train(r).steps, steps);
  return t.state();
}

double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

void expect_close(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b,
                  double tol, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << what << ": " << name;
    const auto& u = b.at(name);
    if (!t.is_floating_point()) continue;
    EXPECT_TRUE(t.device().is_cpu()) << what << ": " << name << " on " << t.device().str();
    EXPECT_LE(max_diff(t, u), tol) << what << ": " << name;
  }
}

// Runs on every machine: asking for cuda where there is none is refused
// up front, naming the device.
TEST(CudaTrainerTest, DeviceCudaIsRefusedWithoutOneAndBadAmpValuesAreConfigErrors) {
  auto c = small_config("cuda", "sgd");
  if (!have_cuda()) {
    TrainerActor t;
    try {
      t.setup(c);
      FAIL() << "setup on device 'cuda' without CUDA succeeded";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("'cuda'"), std::string::npos) << e.what();
    }
  }
  c.amp_dtype = "fp8";
  EXPECT_THROW(validate(c), ConfigError);
  c.amp_dtype = "bf16";
  c.initial_loss_scale = 0;
  EXPECT_THROW(validate(c), ConfigError);
  c.device = "cuda:3";
  c.initial_loss_scale = 1024;
  EXPECT_THROW(validate(c), ConfigError);
  c.device = "cpu";
  c.collective = "nccl";
  EXPECT_THROW(validate(c), ConfigError);
  c.collective = "mpi";
  EXPECT_THROW(validate(c), ConfigError);
}

// Trainers holding part of a GPU may share one, which NCCL cannot: a job
// that asks for NCCL anyway is refused up front, and "auto" picks Gloo.
TEST(CudaTrainerTest, PartOfAGpuRefusesNcclAndPicksGloo) {
  troupe::testing::LocalCluster cluster(troupe::testing::LocalClusterOptions{.nodes = {{{"CPU", 1}}}});
  Runtime rt = cluster.connect();
  auto cfg = troupe::test::small_mlp_job("part", 2, 16, 64);
  cfg.scaling.resources_per_worker = {{"GPU", 0.5}, {"CPU", 1}};
  cfg.trainer.collective = "nccl";
  try {
    TrainJob job(rt, cfg);
    FAIL() << "NCCL accepted for trainers on half a GPU each";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("NCCL"), std::string::npos) << e.what();
  }
}

// SGD with momentum and AdamW, each with an EMA of the weights: six steps on
// cuda:0 land where six on the CPU do (fp32 throughout; matmuls on the GPU
// sum in another order, hence a tolerance), the optimizer state and the EMA
// included.
TEST(CudaTrainerTest, SgdAndAdamwStepsOnCudaMatchTheCpu) {
  SKIP_WITHOUT_CUDA();
  for (std::string opt : {"sgd", "adamw"}) {
    auto cpu = small_config("cpu", opt);
    auto gpu = small_config("cuda", opt);
    cpu.ema_decay = gpu.ema_decay = 0.9;
    TrainerInfo info;
    auto a = run(cpu, 6);
    auto b = run(gpu, 6, &info);
    EXPECT_EQ(info.device, "cuda:0");
    EXPECT_EQ(a.step, 6);
    EXPECT_EQ(b.step, 6);
    expect_close(a.model, b.model, 1e-4, opt + " weights");
    expect_close(a.optimizer, b.optimizer, 1e-4, opt + " optimizer state and EMA");
    EXPECT_GT(max_diff(a.model.begin()->second, run(cpu, 1).model.begin()->second), 1e-6)
        << opt << ": six steps moved the weights no further than one";
  }
}

#if TROUPE_TEST_SYNC_DEBUG
// Collects the "synchronizing CUDA operation" warnings of c10's sync debug
// mode, each with the stack that made it, while it is alive (on this
// thread, which runs the in-process trainer's steps).
class SyncCounter : public c10::WarningHandler {
 public:
  SyncCounter() : previous_(c10::WarningUtils::get_warning_handler()) {
    c10::WarningUtils::set_warning_handler(this);
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
  }
  ~SyncCounter() override {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    c10::WarningUtils::set_warning_handler(previous_);
  }
  void process(const c10::Warning& w) override {
    if (w.msg().find("synchroniz") == std::string::npos) return previous_->process(w);
    stacks.push_back(c10::get_backtrace(1, 24));
  }
  std::vector<std::string> stacks;

 private:
  c10::WarningHandler* previous_;
};
#endif

// The host queues a train() call's steps without waiting for the device
// between them and reads the losses back once at the end, so the next
// batch is collated and copied while the device runs the last step. Image
// records normalised on the GPU (defer_normalize) are the case that used to
// wait twice per step: the normalisation table was copied from host memory
// for every batch.
TEST(CudaTrainerTest, ATrainCallWaitsForTheDeviceOnceNotPerStep) {
  SKIP_WITHOUT_CUDA();
#if !TROUPE_TEST_SYNC_DEBUG
  GTEST_SKIP() << "this LibTorch has no c10_cuda to count the waits with";
#else
  TrainerConfig c;
  c.model.name = "cnn";
  c.model.channels = 3;
  c.model.image_size = 12;
  c.model.hidden = 8;
  c.model.num_classes = 4;
  c.data = actors::DatasetSpec("image_records")
               .set("size", 64)
               .set("channels", 3)
               .set("height", 16)
               .set("width", 16)
               .set("num_classes", 4)
               .set("crop", 12)
               .set("flip", 1)
               .set("mean", {0.5, 0.4, 0.3})
               .set("std", {0.2, 0.25, 0.3})
               .set("defer_normalize", 1);
  c.batch_size = 8;
  c.device = "cuda";
  c.optimizer.name = "sgd";
  c.optimizer.lr = 0.05;
  c.optimizer.momentum = 0.9;
  TrainerActor t;
  t.setup(c);
  TrainRequest r;
  r.max_steps = 2;  // the first call: cuDNN's and the caches' first use
  ASSERT_EQ(t.train(r).steps, 2);
  r.max_steps = 6;
  SyncCounter waits;
  const auto rep = t.train(r);
  ASSERT_EQ(rep.steps, 6);
  EXPECT_TRUE(std::isfinite(rep.loss_sum));
  std::string where;
  for (size_t i = 0; i < waits.stacks.size(); ++i) where += "\nwait " + std::to_string(i + 1) + ":\n" + waits.stacks[i];
  EXPECT_EQ(waits.stacks.size(), 1u) << "the host waited for the device " << waits.stacks.size()
                                     << " times in one train() call of 6 steps:" << where;
#endif
}

// bf16 autocast: the forward runs in bf16 (the weights differ from the fp32
// run's, yet stay near them), parameters and state stay fp32, and bf16 uses
// no loss scale.
TEST(CudaTrainerTest, Bf16AutocastTrainsNearFp32WithoutLossScaling) {
  SKIP_WITHOUT_CUDA();
  auto fp32 = small_config("cuda", "adamw");
  auto bf16 = fp32;
  bf16.mixed_precision = true;
  bf16.amp_dtype = "bf16";
  auto a = run(fp32, 6);
  auto b = run(bf16, 6);
  double furthest = 0;
  for (const auto& [name, w] : b.model) {
    EXPECT_EQ(w.scalar_type(), torch::kFloat32) << name;
    EXPECT_TRUE(torch::isfinite(w).all().item<bool>()) << name;
    furthest = std::max(furthest, max_diff(w, a.model.at(name)));
  }
  EXPECT_GT(furthest, 0.0) << "bf16 autocast changed nothing: did it run?";
  EXPECT_LT(furthest, 0.05);
  EXPECT_EQ(b.optimizer.at("loss_scale").item<double>(), bf16.initial_loss_scale);
}

// fp16 with dynamic loss scaling, as torch.amp.GradScaler: a scale so large
// that the scaled loss overflows makes the first step a skipped one (the
// weights and the optimizer stay as they were, the step still counts) and
// halves the scale; at the usual scale steps are taken and land near fp32.
TEST(CudaTrainerTest, Fp16OverflowStepIsSkippedAndTheScaleHalves) {
  SKIP_WITHOUT_CUDA();
  auto c = small_config("cuda", "sgd");
  c.mixed_precision = true;
  c.amp_dtype = "fp16";
  c.initial_loss_scale = 1e38;
  TrainerActor t;
  t.setup(c);
  auto before = t.state();
  TrainRequest r;
  r.max_steps = 1;
  EXPECT_EQ(t.train(r).steps, 1);
  auto after = t.state();
  EXPECT_EQ(after.step, 1);
  for (const auto& [name, w] : before.model) EXPECT_TRUE(torch::equal(w, after.model.at(name))) << name;
  EXPECT_DOUBLE_EQ(after.optimizer.at("loss_scale").item<double>(), 5e37);
  EXPECT_EQ(after.optimizer.at("good_steps").item<int64_t>(), 0);

  c.initial_loss_scale = 65536;
  auto fp16 = run(c, 6);
  auto fp32 = run(small_config("cuda", "sgd"), 6);
  EXPECT_EQ(fp16.optimizer.at("loss_scale").item<double>(), 65536.0) << "a step overflowed at the usual scale";
  expect_close(fp16.model, fp32.model, 0.05, "fp16 against fp32");
  EXPECT_FALSE(torch::equal(fp16.model.begin()->second, before.model.begin()->second));
}

// A checkpoint of a CUDA trainer holds CPU tensors only: Python's torch.load
// reads it with no GPU visible (CUDA_VISIBLE_DEVICES empty, no map_location)
// and finds the trainer's weights.
TEST(CudaTrainerTest, CheckpointFromGpuLoadsWithTorchLoadOnCpu) {
  SKIP_WITHOUT_CUDA();
  if (std::system((troupe::test::python() + " -c 'import torch' 2>/dev/null").c_str()) != 0)
    GTEST_SKIP() << troupe::test::python() << " has no torch (set TROUPE_TEST_PYTHON)";
  auto c = small_config("cuda", "adamw");
  c.mixed_precision = true;
  c.amp_dtype = "bf16";
  auto s = run(c, 3);
  auto dir = troupe::test::fresh_dir("cuda_ckpt");
  auto info = save_checkpoint(dir.string(), s);
  const auto& [name, w] = *s.model.begin();
  std::string script =
      "import torch, sys, glob\n"
      "assert not torch.cuda.is_available()\n"
      "d = torch.load(glob.glob(sys.argv[1] + '/model.pt')[0], weights_only=True)\n"
      "t = d[sys.argv[2]]\n"
      "assert t.device.type == 'cpu', t.device\n"
      "print(repr(float(t.double().sum())))\n";
  auto script_path = dir / "load.py";
  {
    std::FILE* f = std::fopen(script_path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(script.c_str(), f);
    std::fclose(f);
  }
  std::string cmd =
      "CUDA_VISIBLE_DEVICES= " + troupe::test::python() + " " + script_path.string() + " " + info.path + " " + name;
  std::FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  char buf[256] = {};
  std::string out;
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  ASSERT_EQ(::pclose(p), 0) << cmd << "\n" << out;
  EXPECT_NEAR(std::stod(out), w.to(torch::kFloat64).sum().item<double>(), 1e-6) << name;
}

// A TrainJob whose trainer asks for {GPU: 1} on a node agent that has one:
// the agent sets CUDA_VISIBLE_DEVICES, the trainer takes cuda:0, joins an
// NCCL group of one, and trains from a DataLoaderActor's stream; its weights
// are the CPU job's within float tolerance.
TEST(CudaTrainerTest, TrainJobOnAGpuNodeMatchesTheCpuJob) {
  SKIP_WITHOUT_CUDA();
  troupe::testing::LocalCluster cluster(troupe::testing::LocalClusterOptions{.nodes = {{{"CPU", 4}, {"GPU", 1}}}});
  Runtime rt = cluster.connect();
  auto cpu = troupe::test::small_mlp_job("cpu", 1, 32, 256);
  cpu.trainer.optimizer.lr = 0.05;
  cpu.use_loaders = true;
  auto gpu = cpu;
  gpu.name = "gpu";
  gpu.scaling.resources_per_worker = {{"GPU", 1}, {"CPU", 1}};
  auto a = TrainJob(rt, cpu).fit();
  auto b = TrainJob(rt, gpu).fit();
  EXPECT_EQ(a.steps, 256 / 32);
  EXPECT_EQ(b.steps, a.steps);
  expect_close(a.final_state.model, b.final_state.model, 1e-4, "GPU job against CPU job");
}

// Two trainers that each hold {GPU: 0.5} of a node's one GPU: the head puts
// both on GPU 0 (the node agent gives each CUDA_VISIBLE_DEVICES=0), each
// trains on cuda:0, and, as NCCL cannot put two ranks on one GPU, they
// reduce through host memory (TrainJob picks collective "gloo"). One of
// them SIGKILLed mid-run is replaced and healed from the other over Gloo,
// and the weights end bitwise as in the run without the kill.
TEST(CudaTrainerTest, TwoTrainersShareOneGpuAndHealToTheSameWeights) {
  SKIP_WITHOUT_CUDA();
  troupe::testing::LocalCluster cluster(troupe::testing::LocalClusterOptions{.nodes = {{{"CPU", 6}, {"GPU", 1}}}});
  Runtime rt = cluster.connect();
  auto cfg = troupe::test::small_mlp_job("share", 2, 16, 512);
  cfg.trainer.optimizer.lr = 0.05;
  cfg.scaling.resources_per_worker = {{"GPU", 0.5}, {"CPU", 1}};
  cfg.progress_every_steps = 4;
  cfg.failure.max_failures = 2;
  const auto clean = TrainJob(rt, cfg).fit();
  ASSERT_EQ(clean.steps, 512 / 32);
  ASSERT_EQ(clean.final_world_size, 2);

  troupe::testing::FaultInjector faults(rt);
  const uint64_t before = faults.last_actor_id();
  faults.at_step(8, [&] {
    auto id = faults.live_actors("troupe::trainer::TrainerActor", before).at(1).id;
    faults.after(std::chrono::milliseconds(2), [&faults, id] { faults.kill_actor(id); });
  });
  cfg.on_step = [&](const StepInfo& s) { faults.on_step(s.step); };
  const auto hurt = TrainJob(rt, cfg).fit();
  ASSERT_EQ(hurt.recoveries.size(), 1u);
  EXPECT_EQ(hurt.recoveries[0].mode, RecoveryMode::kHeal);
  EXPECT_EQ(hurt.recoveries[0].lost_steps, 0);
  EXPECT_EQ(hurt.final_world_size, 2);
  troupe::test::expect_bitwise_equal(clean.final_state, hurt.final_state);
}

}  // namespace
