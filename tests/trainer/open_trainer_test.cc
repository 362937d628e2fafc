// The open trainer: batches as TensorDicts, train steps, the user's pieces.
//  - a TorchScript module whose forward(Dict[str, Tensor]) returns `loss`
//    and metrics, on .npz data, trained by 2 workers; a trainer SIGKILLed
//    mid-run heals to weights bitwise equal to the run without the kill;
//    the metrics reach Result::history and the metrics file;
//  - C++ pieces registered in this binary (TROUPE_DATASET with a graph
//    collate, TROUPE_MODEL, TROUPE_STEP) found by the trainers it spawns;
//  - the built-in regression step;
//  - SyncBatchNorm: 2 workers train the cnn to the weights of 1 worker on
//    the whole batch, and heal bitwise;
//  - bad input: a TorchScript file of the wrong signature, a step without
//    `loss`, a batch key the model does not expect, a collate that throws.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <torch/script.h>
#include <torch/torch.h>

#include "tests/support/python.h"
#include "tests/support/temp_dir.h"
#include "tests/trainer/state_compare.h"
#include "troupe/actors/graph_collate.h"
#include "troupe/runtime/core/files.h"
#include "troupe/runtime/testing/fault_injector.h"
#include "troupe/runtime/testing/local_cluster.h"
#include "troupe/trainer/cpu_gemm.h"
#include "troupe/trainer/module_model.h"
#include "troupe/trainer/train_job.h"
#include "troupe/trainer/train_step.h"

using namespace std::chrono_literals;
using namespace troupe;
using namespace troupe::trainer;
namespace fs = std::filesystem;

namespace {

constexpr const char* kTrainerClass = "troupe::trainer::TrainerActor";

// Graph i: a chain of i % 4 + 2 nodes with 3 features; its target is the
// mean of its node features' sums.
class ChainGraphs final : public actors::Dataset {
 public:
  explicit ChainGraphs(int64_t n, bool broken) : n_(n), broken_(broken) {}
  int64_t size() const override { return n_; }
  std::string describe() const override { return "chain_graphs"; }
  actors::TensorDict collate(std::vector<actors::Sample>&& samples) const override {
    if (broken_) throw std::runtime_error("graph with a dangling edge");
    return actors::graph_collate(samples);
  }

 protected:
  actors::Sample load(int64_t index, int64_t /*epoch*/) const override {
    const int64_t nodes = index % 4 + 2;
    auto x = torch::sin(torch::arange(nodes * 3, torch::kFloat).reshape({nodes, 3}) * 0.37 * double(index + 1));
    auto src = torch::arange(nodes - 1, torch::kLong);
    return {{"x", x}, {"edge_index", torch::stack({src, src + 1})}, {"y", x.sum(1).mean()}};
  }

 private:
  int64_t n_;
  bool broken_;
};

TROUPE_DATASET("test_graphs", [](const actors::DatasetSpec& s) {
  return std::make_unique<ChainGraphs>(s.get_int("size", 64), s.get_int("broken", 0) != 0);
});

// One round of message passing (sum over in-edges), mean pooling per graph.
struct GnnImpl : torch::nn::Module {
  explicit GnnImpl(int64_t hidden)
      : embed(register_module("embed", torch::nn::Linear(3, hidden))),
        message(register_module("message", torch::nn::Linear(hidden, hidden))),
        readout(register_module("readout", torch::nn::Linear(hidden, 1))) {}
  torch::Tensor forward(const actors::TensorDict& b) {
    auto h = torch::relu(embed->forward(b.at("x")));
    const auto& e = b.at("edge_index");
    auto agg = torch::zeros_like(h).index_add(0, e[1], message->forward(h).index_select(0, e[0]));
    h = torch::relu(h + agg);
    const auto& graph = b.at("batch");
    const int64_t graphs = b.at("y").size(0);
    auto pooled = torch::zeros({graphs, h.size(1)}).index_add(0, graph, h);
    auto counts = torch::zeros({graphs}).index_add(0, graph, torch::ones({h.size(0)}));
    return readout->forward(pooled / counts.unsqueeze(1)).squeeze(1);
  }
  torch::nn::Linear embed, message, readout;
};
TORCH_MODULE(Gnn);

// A registered model that takes the whole batch and returns loss and MAE.
class GnnModel final : public Model {
 public:
  explicit GnnModel(int64_t hidden) : gnn_(hidden) {}
  torch::Tensor forward(const torch::Tensor&) override { throw ConfigError("gnn takes the batch"); }
  bool takes_batch() const override { return true; }
  actors::TensorDict forward_batch(const actors::TensorDict& batch) override {
    auto err = gnn_->forward(batch) - batch.at("y");
    return {{"loss", (err * err).mean()}, {"mae", err.abs().mean().detach()}};
  }
  std::vector<std::pair<std::string, torch::Tensor>> named_parameters() override {
    std::vector<std::pair<std::string, torch::Tensor>> out;
    for (auto& p : gnn_->named_parameters()) out.emplace_back(p.key(), p.value());
    return out;
  }
  std::vector<std::pair<std::string, torch::Tensor>> named_buffers() override { return {}; }
  void train(bool on) override { gnn_->train(on); }
  void to(const torch::Device& d) override { gnn_->to(d); }
  std::string describe() const override { return "test gnn"; }

 private:
  Gnn gnn_;
};

TROUPE_MODEL("test_gnn", [](const ModelSpec& s) { return std::make_unique<GnnModel>(s.hidden); });

// A registered step: MSE of model(input) with a `count` metric summed.
class CountingMse final : public TrainStep {
 public:
  StepOutput train(Model& model, const actors::TensorDict& batch) override {
    auto pred = model.forward(batch.at("input"));
    StepOutput out;
    out.loss = torch::mse_loss(pred, batch.at("target"));
    out.metrics["count"] = torch::scalar_tensor(static_cast<double>(pred.size(0)));
    return out;
  }
  std::set<std::string> summed_metrics() const override { return {"count"}; }
  std::string describe() const override { return "counting mse"; }
};

TROUPE_STEP("test_counting_mse", [](const std::string&) { return std::make_unique<CountingMse>(); });

// A step with a curriculum read from its context (the loss's weight grows
// over the first 6 steps) and state of its own: the forwards it has
// trained, which scale its loss. A heal that gave a replacement a fresh
// count (or a roll-back that kept a cut-short step's forwards counted)
// would train other weights.
class CurriculumStep final : public TrainStep {
 public:
  StepOutput train(Model& model, const actors::TensorDict& batch) override {
    const auto& c = context();
    if (c.rank < 0 || c.rank >= c.world_size || c.micro_step >= c.accumulation)
      throw std::logic_error("bad context: rank " + std::to_string(c.rank) + " of " + std::to_string(c.world_size));
    auto pred = model.forward(batch.at("input"));
    const double weight = std::min(1.0, double(c.step + 1) / 6.0);
    const double scale = 1.0 + 0.5 * std::sin(double(forwards_));
    StepOutput out;
    out.loss = torch::mse_loss(pred, batch.at("target")) * (weight * scale);
    out.metrics["weight"] = torch::scalar_tensor(weight, torch::kFloat64);
    out.metrics["epoch"] = torch::scalar_tensor(double(c.epoch), torch::kFloat64);
    if (c.training) ++forwards_;
    return out;
  }
  std::string describe() const override { return "curriculum"; }
  std::map<std::string, torch::Tensor> state() const override {
    return {{"forwards", torch::scalar_tensor(forwards_, torch::kInt64)}};
  }
  void load_state(const std::map<std::string, torch::Tensor>& s) override {
    auto it = s.find("forwards");
    forwards_ = it == s.end() ? 0 : it->second.item<int64_t>();
  }

 private:
  int64_t forwards_ = 0;
};

TROUPE_STEP("test_curriculum", [](const std::string&) { return std::make_unique<CurriculumStep>(); });

// A step whose state cannot be had: one that cannot be copied to the host
// (a meta tensor), or a state() that throws.
class BadStateStep final : public TrainStep {
 public:
  explicit BadStateStep(bool throws) : throws_(throws) {}
  StepOutput train(Model& model, const actors::TensorDict& batch) override {
    return {torch::mse_loss(model.forward(batch.at("input")), batch.at("target")), {}};
  }
  std::string describe() const override { return throws_ ? "throwing state" : "uncopyable state"; }
  std::map<std::string, torch::Tensor> state() const override {
    if (throws_) throw std::runtime_error("state refused");
    return {{"meta", torch::empty({4}, torch::TensorOptions().device(torch::kMeta))}};
  }
  void load_state(const std::map<std::string, torch::Tensor>&) override {}

 private:
  bool throws_;
};

TROUPE_STEP("test_uncopyable_state", [](const std::string&) { return std::make_unique<BadStateStep>(false); });
TROUPE_STEP("test_throwing_state", [](const std::string&) { return std::make_unique<BadStateStep>(true); });

void python(const std::string& script, const fs::path& dir) {
  auto file = dir / "make.py";
  std::ofstream(file) << script;
  std::string cmd = troupe::test::python() + " " + file.string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << script;
}

bool have_python_torch() {
  return std::system((troupe::test::python() + " -c 'import torch, numpy' 2>/dev/null").c_str()) == 0;
}

// A TorchScript step module (a small regressor with `mae` and a summed
// `count`) and 384 samples of .npz data.
void write_script_step(const fs::path& dir) {
  python("import torch, numpy as np\nfrom typing import Dict, List\nd = '" + dir.string() +
             "'\n"
             "class Step(torch.nn.Module):\n"
             "    summed_metrics: List[str]\n"
             "    def __init__(self):\n"
             "        super().__init__()\n"
             "        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))\n"
             "        self.summed_metrics = ['count']\n"
             "    def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:\n"
             "        err = self.net(batch['features']).squeeze(1) - batch['value']\n"
             "        return {'loss': (err * err).mean(), 'mae': err.abs().mean().detach(),\n"
             "                'count': torch.tensor(float(err.shape[0]))}\n"
             "torch.manual_seed(0)\n"
             "torch.jit.save(torch.jit.script(Step()), d + '/step.pt')\n"
             "rng = np.random.default_rng(0)\n"
             "x = rng.standard_normal((384, 8)).astype(np.float32)\n"
             "v = (x @ rng.standard_normal(8) + 0.1 * rng.standard_normal(384)).astype(np.float32)\n"
             "np.savez(d + '/train.npz', features=x, value=v)\n",
         dir);
}

// A submodule the user's module keeps in eval mode (a frozen BatchNorm)
// stays in eval mode after a validation pass puts the model in eval and
// back in training.
TEST(ScriptModelTest, ASubmoduleKeptInEvalStaysSoAfterValidation) {
  if (!have_python_torch()) GTEST_SKIP() << "no python3 with torch and numpy";
  auto dir = test::fresh_dir("frozen-bn");
  python("import torch\nfrom typing import Dict\nd = '" + dir.string() +
             "'\n"
             "class Step(torch.nn.Module):\n"
             "    def __init__(self):\n"
             "        super().__init__()\n"
             "        self.bn = torch.nn.BatchNorm1d(4)\n"
             "        self.fc = torch.nn.Linear(4, 1)\n"
             "    def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:\n"
             "        y = self.fc(self.bn(batch['x'])).sum()\n"
             "        return {'loss': y, 'bn_training': torch.tensor(float(self.bn.training)),\n"
             "                'training': torch.tensor(float(self.training))}\n"
             "m = Step()\n"
             "m.bn.eval()\n"
             "torch.jit.save(torch.jit.script(m), d + '/step.pt')\n",
         dir);
  ModelSpec spec;
  spec.name = "torchscript";
  spec.path = (dir / "step.pt").string();
  auto model = make_model(spec);
  auto step = make_step(StepSpec{}, *model);
  actors::TensorDict batch;
  batch.set("x", torch::randn({8, 4}));
  auto modes = [&] {
    auto out = step->train(*model, batch);
    return std::make_pair(out.metrics.at("training").item<double>(), out.metrics.at("bn_training").item<double>());
  };
  model->train(true);
  EXPECT_EQ(modes(), std::make_pair(1.0, 0.0));
  model->train(false);  // a validation pass
  model->train(true);
  EXPECT_EQ(modes(), std::make_pair(1.0, 0.0));
}

// A file that torch.save wrote (a whole module, pickled) is not a
// TorchScript file: the error says so and how to write one, rather than
// only that constants.pkl is missing.
TEST(ScriptModelTest, AFileFromTorchSaveIsNamedAsNotTorchScript) {
  if (!have_python_torch()) GTEST_SKIP() << "no python3 with torch and numpy";
  auto dir = test::fresh_dir("torch-save");
  python("import torch\ntorch.save(torch.nn.Linear(4, 1), '" + dir.string() + "/model.pt')\n", dir);
  ModelSpec spec;
  spec.name = "torchscript";
  spec.path = (dir / "model.pt").string();
  try {
    make_model(spec);
    FAIL() << "a torch.save file loaded as TorchScript";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("not a TorchScript file"), std::string::npos) << what;
    EXPECT_NE(what.find("torch.jit.save(torch.jit.script(model), path)"), std::string::npos) << what;
    EXPECT_NE(what.find(spec.path), std::string::npos) << what;
  }
}

// route_linear reaches the linear calls of free script functions too:
// nn.MultiheadAttention's projections live in F.multi_head_attention_forward.
// (Without oneDNN troupe::linear is ATen's, and the rewrite is checked all
// the same.)
TEST(CpuGemmRouteTest, FreeFunctionsAndAttentionAreRoutedAndComputeTheSame) {
  if (!have_python_torch()) GTEST_SKIP() << "no python3 with torch and numpy";
  auto dir = test::fresh_dir("route-linear");
  python("import torch\nimport torch.nn.functional as F\nd = '" + dir.string() +
             "'\n"
             "def project(x, w):\n"
             "    return F.linear(x, w)\n"
             "class M(torch.nn.Module):\n"
             "    def __init__(self):\n"
             "        super().__init__()\n"
             "        self.att = torch.nn.MultiheadAttention(8, 2, batch_first=True)\n"
             "        self.w = torch.nn.Parameter(torch.randn(4, 8))\n"
             "    def forward(self, x: torch.Tensor) -> torch.Tensor:\n"
             "        y, _ = self.att(x, x, x, need_weights=False)\n"
             "        return project(y, self.w)\n"
             "torch.manual_seed(0)\n"
             "torch.jit.save(torch.jit.script(M()), d + '/m.pt')\n",
         dir);
  auto plain = torch::jit::load((dir / "m.pt").string());
  auto routed = torch::jit::load((dir / "m.pt").string());
  // The in- and out-projections of the attention, and project().
  EXPECT_GE(route_linear(routed), 3);
  const auto x = torch::randn({2, 5, 8});
  const auto want = plain.forward({x}).toTensor();
  const auto got = routed.forward({x}).toTensor();
  EXPECT_TRUE(torch::allclose(got, want, 1e-4, 1e-5)) << (got - want).abs().max().item<double>();
  troupe::core::remove_tree(dir);
}

TrainJobConfig base_job(int64_t workers) {
  TrainJobConfig c;
  c.name = "open";
  c.scaling.num_workers = workers;
  c.trainer.batch_size = 16;
  c.trainer.seed = 7;
  c.trainer.optimizer.name = "adamw";
  c.trainer.optimizer.lr = 0.01;
  c.epochs = 2;
  c.evaluate = false;
  c.verbose = false;
  c.progress_every_steps = 2;
  c.failure.max_failures = 2;
  c.failure.replacement_timeout = 3s;
  return c;
}

// base_job on the built-in MLP (6 features in, 2 out, `hidden` wide) over
// `size` samples of synthetic regression data.
TrainJobConfig regression_job(int64_t workers, int64_t size, int64_t hidden) {
  auto c = base_job(workers);
  c.trainer.model.input_dim = 6;
  c.trainer.model.hidden = hidden;
  c.trainer.model.num_classes = 2;  // outputs
  c.trainer.data = actors::DatasetSpec("synthetic_regression")
                       .set("size", size)
                       .set("num_features", 6)
                       .set("num_outputs", 2)
                       .set("seed", 3);
  return c;
}

class OpenTrainerTest : public ::testing::Test {
 protected:
  troupe::testing::LocalCluster cluster_{{.nodes = {{{"CPU", 2}}, {{"CPU", 2}}}}};
  Runtime rt_ = cluster_.connect();
};

// A trainer reads its shipped model from this host's copy
// (SESSION/shipped/...), but what it says of the model names the driver's
// file: a model that does not load, a data file that is not an archive.
TEST_F(OpenTrainerTest, AShippedFilesErrorsNameTheDriversPath) {
  auto dir = test::fresh_dir("shipped-errors");
  auto session = dir / "session";
  std::filesystem::create_directories(session);
  std::filesystem::permissions(session, std::filesystem::perms::owner_all, std::filesystem::perm_options::replace);
  const std::string model = (dir / "step.pt").string();
  std::ofstream(model) << "not a TorchScript archive";
  auto cfg = regression_job(1, 64, 8);
  cfg.trainer.model.name = "torchscript";
  cfg.trainer.model.path = model;
  cfg.trainer.shipped_files = {troupe::ship_file(rt_, model)};
  auto t = rt_.spawn<TrainerActor>({.resources = {{"CPU", 1}}, .env = {"TROUPE_SESSION_DIR=" + session.string()}});
  try {
    t.call(&TrainerActor::setup, cfg.trainer).get(120s);
    ADD_FAILURE() << "a model that is not TorchScript was loaded";
  } catch (const troupe::ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'" + model + "'"), std::string::npos) << what;
    EXPECT_EQ(what.find("/shipped/"), std::string::npos) << what;
  }
  // The copy it read is there, under the session's shipped/.
  EXPECT_FALSE(std::filesystem::is_empty(session / "shipped"));
  rt_.kill(t);
}

TEST_F(OpenTrainerTest, ScriptedDictStepOnNpzHealsBitwise) {
  if (!have_python_torch()) GTEST_SKIP() << "no python3 with torch and numpy";
  auto dir = test::fresh_dir("open-script");
  write_script_step(dir);
  auto cfg = base_job(2);
  cfg.trainer.model.name = "torchscript";
  cfg.trainer.model.path = (dir / "step.pt").string();
  cfg.trainer.data = actors::DatasetSpec("npz").set("path", (dir / "train.npz").string());
  cfg.metrics_path = (dir / "metrics.jsonl").string();
  const Result clean = TrainJob(rt_, cfg).fit();
  ASSERT_EQ(clean.steps, 24);  // 384 / (2 × 16) per epoch, 2 epochs
  ASSERT_EQ(clean.history.size(), 2u);
  const auto& m = clean.history.back().train_metrics;
  ASSERT_TRUE(m.count("mae") && m.count("count")) << "metrics missing";
  EXPECT_EQ(m.at("count"), 384.0);  // summed over samples' batches and ranks
  EXPECT_LT(clean.history.back().train_loss, clean.history.front().train_loss);
  std::ifstream metrics(cfg.metrics_path);
  std::string line, all;
  while (std::getline(metrics, line)) all += line + "\n";
  EXPECT_NE(all.find("\"mae\""), std::string::npos) << all.substr(0, 400);

  troupe::testing::FaultInjector faults(rt_);
  const uint64_t before = faults.last_actor_id();
  cfg.metrics_path.clear();
  cfg.on_step = [&](const StepInfo& s) { faults.on_step(s.step); };
  faults.at_step(9, [&] {
    auto id = faults.live_actors(kTrainerClass, before).at(1).id;
    faults.after(2ms, [&faults, id] { faults.kill_actor(id); });
  });
  const Result hurt = TrainJob(rt_, cfg).fit();
  ASSERT_EQ(hurt.recoveries.size(), 1u);
  EXPECT_EQ(hurt.recoveries[0].mode, RecoveryMode::kHeal);
  test::expect_bitwise_equal(clean.final_state, hurt.final_state);
  troupe::core::remove_tree(dir);
}

// The scripted step's linear layers computed by oneDNN (the default) and by
// torch's BLAS (cpu_gemm "aten") train to the same weights, up to float32
// rounding (SGD: Adam's normalised step would turn a rounding difference in
// a near-zero gradient into a whole step).
TEST_F(OpenTrainerTest, ScriptedStepTrainsAlikeOnOneDnnAndAten) {
  if (!have_python_torch()) GTEST_SKIP() << "no python3 with torch and numpy";
  auto dir = test::fresh_dir("open-gemm");
  write_script_step(dir);
  auto cfg = base_job(2);
  cfg.epochs = 1;
  cfg.trainer.optimizer.name = "sgd";
  cfg.trainer.optimizer.lr = 0.05;
  cfg.trainer.model.name = "torchscript";
  cfg.trainer.model.path = (dir / "step.pt").string();
  cfg.trainer.data = actors::DatasetSpec("npz").set("path", (dir / "train.npz").string());
  const Result onednn = TrainJob(rt_, cfg).fit();
  cfg.trainer.cpu_gemm = "aten";
  const Result aten = TrainJob(rt_, cfg).fit();
  ASSERT_EQ(onednn.steps, aten.steps);
  ASSERT_EQ(onednn.final_state.model.size(), aten.final_state.model.size());
  for (const auto& [name, w] : onednn.final_state.model) {
    const auto& v = aten.final_state.model.at(name);
    EXPECT_TRUE(torch::allclose(w, v, 1e-3, 1e-4)) << name << ": " << (w - v).abs().max().item<double>();
  }
  EXPECT_NEAR(onednn.history.back().train_loss, aten.history.back().train_loss,
              1e-3 * std::abs(aten.history.back().train_loss));
  troupe::core::remove_tree(dir);
}

TEST_F(OpenTrainerTest, RegisteredGraphPiecesTrainWithTwoWorkers) {
  auto cfg = base_job(2);
  cfg.trainer.model.name = "test_gnn";
  cfg.trainer.model.hidden = 16;
  cfg.trainer.data = actors::DatasetSpec("test_graphs").set("size", 128);
  cfg.trainer.validation_fraction = 0.25;
  cfg.evaluate = true;
  cfg.epochs = 3;
  const Result r = TrainJob(rt_, cfg).fit();
  ASSERT_EQ(r.history.size(), 3u);
  EXPECT_TRUE(r.history.back().train_metrics.count("mae"));
  EXPECT_TRUE(r.history.back().val_metrics.count("mae"));
  EXPECT_LT(r.history.back().train_loss, r.history.front().train_loss);
  EXPECT_EQ(r.final_state.model.count("message.weight"), 1u);
}

TEST_F(OpenTrainerTest, RegressionAndRegisteredSteps) {
  auto cfg = regression_job(2, 256, 16);
  cfg.trainer.step.name = "regression";
  Result r = TrainJob(rt_, cfg).fit();
  ASSERT_EQ(r.history.size(), 2u);
  EXPECT_TRUE(r.history.back().train_metrics.count("mae"));
  EXPECT_EQ(r.history.back().train_accuracy, 0.0);
  EXPECT_LT(r.history.back().train_loss, r.history.front().train_loss);

  cfg.trainer.step.name = "test_counting_mse";
  cfg.epochs = 1;
  r = TrainJob(rt_, cfg).fit();
  ASSERT_EQ(r.history.size(), 1u);
  EXPECT_EQ(r.history.back().train_metrics.at("count"), 256.0);
}

// A step reads where it stands (step, epoch, micro-step, rank) and keeps
// state of its own: a checkpoint holds the state (step.pt), a resume and a
// heal give it back, so a run with a trainer SIGKILLed and one resumed from
// its first epoch's checkpoint end bitwise equal to the uninterrupted run,
// the step's state included.
TEST_F(OpenTrainerTest, AStepsContextAndStateSurviveAHealAndAResume) {
  auto dir = test::fresh_dir("open-step-state");
  auto cfg = regression_job(2, 384, 16);
  cfg.trainer.step.name = "test_curriculum";
  cfg.trainer.batch_size = 8;
  cfg.trainer.accumulation = 2;
  cfg.checkpoint.dir = (dir / "ckpt").string();
  cfg.checkpoint.keep = 0;
  cfg.checkpoint.async = false;
  const Result clean = TrainJob(rt_, cfg).fit();
  ASSERT_EQ(clean.steps, 24);  // 384 / (2 ranks × 8 × 2 micro-batches) per epoch, 2 epochs
  ASSERT_EQ(clean.final_state.step_state.count("forwards"), 1u);
  // Each rank's forwards: 2 per step.
  EXPECT_EQ(clean.final_state.step_state.at("forwards").item<int64_t>(), 48);
  ASSERT_EQ(clean.history.size(), 2u);
  EXPECT_DOUBLE_EQ(clean.history[0].train_metrics.at("epoch"), 0.0);
  EXPECT_DOUBLE_EQ(clean.history[1].train_metrics.at("epoch"), 1.0);
  EXPECT_DOUBLE_EQ(clean.history[1].train_metrics.at("weight"), 1.0);
  EXPECT_LT(clean.history[0].train_metrics.at("weight"), 1.0);
  const auto first_epoch = list_checkpoints(cfg.checkpoint.dir).front();
  ASSERT_EQ(first_epoch.step, 12);
  EXPECT_TRUE(fs::exists(fs::path(first_epoch.path) / "step.pt"));
  EXPECT_EQ(load_checkpoint(first_epoch.path).step_state.at("forwards").item<int64_t>(), 24);

  // A trainer killed mid-run: healed from its peer, the count with it.
  auto hurt_cfg = cfg;
  hurt_cfg.checkpoint.dir.clear();
  troupe::testing::FaultInjector faults(rt_);
  const uint64_t before = faults.last_actor_id();
  hurt_cfg.on_step = [&](const StepInfo& s) { faults.on_step(s.step); };
  faults.at_step(7, [&] {
    auto id = faults.live_actors(kTrainerClass, before).at(1).id;
    faults.after(2ms, [&faults, id] { faults.kill_actor(id); });
  });
  const Result hurt = TrainJob(rt_, hurt_cfg).fit();
  ASSERT_EQ(hurt.recoveries.size(), 1u);
  EXPECT_EQ(hurt.recoveries[0].mode, RecoveryMode::kHeal);
  test::expect_bitwise_equal(clean.final_state, hurt.final_state);

  // Resumed from the first epoch's checkpoint: the context goes on from
  // step 12 in epoch 1 and the count from the checkpoint's.
  auto resumed_cfg = cfg;
  resumed_cfg.checkpoint.dir.clear();
  resumed_cfg.resume_from = first_epoch.path;
  const Result resumed = TrainJob(rt_, resumed_cfg).fit();
  test::expect_bitwise_equal(clean.final_state, resumed.final_state);

  // A checkpoint with step state resumed by a step that keeps none is
  // refused, naming the state.
  auto other = resumed_cfg;
  other.trainer.step.name = "regression";
  try {
    TrainJob(rt_, other).fit();
    ADD_FAILURE() << "resumed a curriculum step's checkpoint into the regression step";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'forwards'"), std::string::npos) << e.what();
  }
  troupe::core::remove_tree(dir);
}

// A TorchScript step module that defines set_context(context: Dict[str,
// int]) is told where each forward stands: its metrics echo the step, the
// epoch and training/evaluation, and a trainer SIGKILLed mid-run heals to
// the weights of the run without the kill (the loss's weight follows the
// step). A set_context of another signature is refused, naming it.
TEST_F(OpenTrainerTest, AScriptedStepIsToldItsContext) {
  if (!have_python_torch()) GTEST_SKIP() << "no python3 with torch and numpy";
  auto dir = test::fresh_dir("open-script-context");
  python("import torch, numpy as np\nfrom typing import Dict\nd = '" + dir.string() +
             "'\n"
             "class Step(torch.nn.Module):\n"
             "    def __init__(self):\n"
             "        super().__init__()\n"
             "        self.net = torch.nn.Linear(8, 1)\n"
             "        self.step = 0\n"
             "        self.epoch = 0\n"
             "        self.in_training = 1\n"
             "    @torch.jit.export\n"
             "    def set_context(self, context: Dict[str, int]) -> None:\n"
             "        self.step = context['step']\n"
             "        self.epoch = context['epoch']\n"
             "        self.in_training = context['training']\n"
             "    def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:\n"
             "        err = self.net(batch['features']).squeeze(1) - batch['value']\n"
             "        weight = min(1.0, (self.step + 1) / 4.0)\n"
             "        return {'loss': (err * err).mean() * weight,\n"
             "                'ctx_step': torch.tensor(float(self.step)),\n"
             "                'ctx_epoch': torch.tensor(float(self.epoch)),\n"
             "                'ctx_training': torch.tensor(float(self.in_training))}\n"
             "class Wrong(torch.nn.Module):\n"
             "    def __init__(self):\n"
             "        super().__init__()\n"
             "        self.net = torch.nn.Linear(8, 1)\n"
             "    @torch.jit.export\n"
             "    def set_context(self, step: int) -> None:\n"
             "        pass\n"
             "    def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:\n"
             "        return {'loss': self.net(batch['features']).mean()}\n"
             "class Raising(torch.nn.Module):\n"
             "    def __init__(self):\n"
             "        super().__init__()\n"
             "        self.net = torch.nn.Linear(8, 1)\n"
             "    @torch.jit.export\n"
             "    def set_context(self, context: Dict[str, int]) -> None:\n"
             "        if context['step'] >= 3:\n"
             "            raise ValueError('no curriculum past step 3')\n"
             "    def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:\n"
             "        return {'loss': self.net(batch['features']).pow(2).mean()}\n"
             "torch.manual_seed(0)\n"
             "torch.jit.save(torch.jit.script(Step()), d + '/step.pt')\n"
             "torch.jit.save(torch.jit.script(Wrong()), d + '/wrong.pt')\n"
             "torch.jit.save(torch.jit.script(Raising()), d + '/raising.pt')\n"
             "rng = np.random.default_rng(0)\n"
             "x = rng.standard_normal((448, 8)).astype(np.float32)\n"
             "v = (x @ rng.standard_normal(8)).astype(np.float32)\n"
             "np.savez(d + '/train.npz', features=x, value=v)\n",
         dir);
  auto cfg = base_job(2);
  cfg.trainer.model.name = "torchscript";
  cfg.trainer.model.path = (dir / "step.pt").string();
  cfg.trainer.data = actors::DatasetSpec("npz").set("path", (dir / "train.npz").string());
  cfg.trainer.validation_fraction = 0.125;  // 392 to train on: 12 steps of 2 × 16 an epoch
  cfg.evaluate = true;
  const Result clean = TrainJob(rt_, cfg).fit();
  ASSERT_EQ(clean.steps, 24);
  ASSERT_EQ(clean.history.size(), 2u);
  // The mean over an epoch's steps (equal samples each) of the step number.
  EXPECT_DOUBLE_EQ(clean.history[0].train_metrics.at("ctx_step"), 5.5);
  EXPECT_DOUBLE_EQ(clean.history[1].train_metrics.at("ctx_step"), 17.5);
  EXPECT_DOUBLE_EQ(clean.history[1].train_metrics.at("ctx_epoch"), 1.0);
  EXPECT_DOUBLE_EQ(clean.history[1].train_metrics.at("ctx_training"), 1.0);
  EXPECT_DOUBLE_EQ(clean.history[1].val_metrics.at("ctx_training"), 0.0);
  EXPECT_DOUBLE_EQ(clean.history[1].val_metrics.at("ctx_step"), 24.0);

  troupe::testing::FaultInjector faults(rt_);
  const uint64_t before = faults.last_actor_id();
  auto hurt_cfg = cfg;
  hurt_cfg.on_step = [&](const StepInfo& s) { faults.on_step(s.step); };
  faults.at_step(5, [&] {
    auto id = faults.live_actors(kTrainerClass, before).at(1).id;
    faults.after(2ms, [&faults, id] { faults.kill_actor(id); });
  });
  const Result hurt = TrainJob(rt_, hurt_cfg).fit();
  ASSERT_EQ(hurt.recoveries.size(), 1u);
  test::expect_bitwise_equal(clean.final_state, hurt.final_state);

  auto wrong = cfg;
  wrong.trainer.model.path = (dir / "wrong.pt").string();
  try {
    TrainJob(rt_, wrong).fit();
    ADD_FAILURE() << "a set_context of another signature was taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("set_context(self, context: Dict[str, int]) -> None"), std::string::npos)
        << e.what();
  }
  // A set_context that raises is the user's error, not a crash to heal
  // (it was retried for ever with no limit on failures).
  auto raising = cfg;
  raising.trainer.model.path = (dir / "raising.pt").string();
  raising.failure.max_failures = 3;
  try {
    TrainJob(rt_, raising).fit();
    ADD_FAILURE() << "a raising set_context trained on";
  } catch (const JobFailed& e) {
    EXPECT_NE(std::string(e.what()).find("no curriculum past step 3"), std::string::npos) << e.what();
    EXPECT_TRUE(e.result().recoveries.empty()) << "healed " << e.result().recoveries.size() << " time(s)";
  }
  troupe::core::remove_tree(dir);
}

// A step's state that cannot be copied to the host ends the job with an
// error naming it (the job waited for ever: the final state failed, was
// taken for a failure, and the heal's source could not send its state
// while its peers waited for the block).
TEST_F(OpenTrainerTest, AStepStateThatCannotBeCopiedEndsTheJobNamingIt) {
  auto cfg = regression_job(2, 128, 8);
  cfg.trainer.step.name = "test_uncopyable_state";
  cfg.epochs = 1;
  cfg.failure.max_failures = -1;
  try {
    TrainJob(rt_, cfg).fit();
    ADD_FAILURE() << "a step state that cannot be copied was taken";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("'meta', which cannot be copied"), std::string::npos) << e.what();
  }
  // A state() that throws is the step's error too: the job ends with it,
  // healing nothing.
  cfg.trainer.step.name = "test_throwing_state";
  cfg.failure.max_failures = 3;
  try {
    TrainJob(rt_, cfg).fit();
    ADD_FAILURE() << "a state() that throws was taken";
  } catch (const JobFailed& e) {
    EXPECT_NE(std::string(e.what()).find("state() failed: state refused"), std::string::npos) << e.what();
    EXPECT_TRUE(e.result().recoveries.empty()) << "healed " << e.result().recoveries.size() << " time(s)";
  }
}

// Each bad input ends fit() with an error that names the culprit (quickly:
// these are not failures a replacement could fix).
TEST_F(OpenTrainerTest, BadInputIsNamed) {
  if (!have_python_torch()) GTEST_SKIP() << "no python3 with torch and numpy";
  auto dir = test::fresh_dir("open-bad");
  write_script_step(dir);
  python("import torch\nfrom typing import Dict\nd = '" + dir.string() +
             "'\n"
             "class NoLoss(torch.nn.Module):\n"
             "    def __init__(self):\n"
             "        super().__init__()\n"
             "        self.lin = torch.nn.Linear(8, 1)\n"
             "    def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:\n"
             "        return {'mse': self.lin(batch['features']).mean()}\n"
             "class WrongKey(NoLoss):\n"
             "    def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:\n"
             "        return {'loss': self.lin(batch['pixels']).mean()}\n"
             "class WrongSig(torch.nn.Module):\n"
             "    def forward(self, x: int) -> int:\n"
             "        return x + 1\n"
             "for name, m in [('no_loss', NoLoss()), ('wrong_key', WrongKey()), ('wrong_sig', WrongSig())]:\n"
             "    torch.jit.save(torch.jit.script(m), d + '/' + name + '.pt')\n",
         dir);
  auto expect_error = [&](TrainJobConfig c, std::vector<std::string> needles) {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      TrainJob(rt_, c).fit();
      ADD_FAILURE() << "no error for " << needles[0];
    } catch (const Error& e) {
      for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 120s) << needles[0];
  };
  auto script = [&](const std::string& name) {
    auto c = base_job(1);
    c.trainer.model.name = "torchscript";
    c.trainer.model.path = (dir / (name + ".pt")).string();
    c.trainer.data = actors::DatasetSpec("npz").set("path", (dir / "train.npz").string());
    return c;
  };
  expect_error(script("wrong_sig"), {"wrong_sig.pt", "Dict[str, Tensor]"});
  expect_error(script("no_loss"), {"no 'loss'", "mse"});
  expect_error(script("wrong_key"), {"wrong_key.pt", "pixels"});
  // With no failures allowed, the first error the driver hears may be what
  // the bad step caused (its loader's stream ended by its reader, a peer's
  // aborted collective); the job still ends naming the step's own error.
  for (int64_t workers : {1, 2}) {
    auto strict = script("wrong_key");
    strict.scaling.num_workers = workers;
    strict.failure.max_failures = 0;
    expect_error(strict, {"wrong_key.pt", "pixels"});
  }
  auto c = base_job(1);
  c.trainer.model.name = "test_gnn";
  c.trainer.data = actors::DatasetSpec("test_graphs").set("broken", 1);
  expect_error(c, {"collate of chain_graphs failed", "dangling edge"});
  c.trainer.data = actors::DatasetSpec("test_graphs");
  c.trainer.step.name = "no_such_step";
  expect_error(c, {"unknown step 'no_such_step'"});
  troupe::core::remove_tree(dir);
}

// SyncBatchNorm in a job: two workers of batch 16 train the built-in cnn to
// the weights one worker of batch 32 reaches (the same samples make each
// global batch, and the statistics are the global batch's); without it the
// BatchNorm statistics are each half's and the weights drift apart.
TEST_F(OpenTrainerTest, SyncBatchNormTwoWorkersMatchOneWorkerOfTheWholeBatch) {
  auto cfg = base_job(1);
  cfg.trainer.model.name = "cnn";
  cfg.trainer.model.channels = 1;
  cfg.trainer.model.image_size = 6;
  cfg.trainer.model.hidden = 6;
  cfg.trainer.model.num_classes = 3;
  cfg.trainer.data = actors::DatasetSpec("synthetic_classification")
                         .set("size", 192)
                         .set("num_features", 36)
                         .set("num_classes", 3)
                         .set("seed", 9);
  cfg.trainer.optimizer.name = "sgd";
  cfg.trainer.optimizer.lr = 0.05;
  cfg.epochs = 1;
  cfg.trainer.batch_size = 32;
  const Result one = TrainJob(rt_, cfg).fit();
  cfg.scaling.num_workers = 2;
  cfg.trainer.batch_size = 16;
  cfg.trainer.sync_batchnorm = true;
  const Result sync = TrainJob(rt_, cfg).fit();
  cfg.trainer.sync_batchnorm = false;
  const Result local = TrainJob(rt_, cfg).fit();
  ASSERT_EQ(one.steps, 6);
  ASSERT_EQ(sync.steps, 6);
  double sync_diff = 0, local_diff = 0;
  for (const auto& [name, t] : one.final_state.model) {
    if (!t.is_floating_point()) continue;
    sync_diff = std::max(sync_diff, (sync.final_state.model.at(name) - t).abs().max().item<double>());
    local_diff = std::max(local_diff, (local.final_state.model.at(name) - t).abs().max().item<double>());
  }
  EXPECT_LT(sync_diff, 1e-4) << "sync BatchNorm is off the one-worker run";
  EXPECT_GT(local_diff, 10 * sync_diff) << "the test cannot tell sync from local statistics";
  EXPECT_NEAR(sync.history.back().train_loss, one.history.back().train_loss, 1e-4);

  // A trainer killed mid-run heals to the same weights, bit for bit.
  troupe::testing::FaultInjector faults(rt_);
  const uint64_t before = faults.last_actor_id();
  cfg.trainer.sync_batchnorm = true;
  cfg.on_step = [&](const StepInfo& s) { faults.on_step(s.step); };
  faults.at_step(2, [&] {
    auto id = faults.live_actors(kTrainerClass, before).at(1).id;
    faults.after(2ms, [&faults, id] { faults.kill_actor(id); });
  });
  const Result hurt = TrainJob(rt_, cfg).fit();
  ASSERT_EQ(hurt.recoveries.size(), 1u);
  test::expect_bitwise_equal(sync.final_state, hurt.final_state);
  cfg.on_step = nullptr;

  // A TorchScript module's BatchNorm cannot be synchronised: refused.
  auto dir = test::fresh_dir("sync-bn");
  std::ofstream(dir / "step.pt") << "not read by validate()";
  cfg.trainer.model.name = "torchscript";
  cfg.trainer.model.path = (dir / "step.pt").string();
  cfg.trainer.sync_batchnorm = true;
  try {
    validate(cfg.trainer);
    ADD_FAILURE() << "sync_batchnorm with a TorchScript model was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("sync_batchnorm"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(cfg.trainer.model.path), std::string::npos) << e.what();
  }
  troupe::core::remove_tree(dir);
}

}  // namespace
