// examples/train_graphs: its pieces (the generated molecules with a graph
// collate, the message-passing model that returns its own loss and MAE)
// trained by 2 workers on a LocalCluster; a trainer SIGKILLed mid-run heals
// from its live peer to weights bitwise equal to the run without the kill.
// Then the example binary itself, with --kill-at-step, exits 0 after one
// recovery and a falling validation MAE.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "examples/train_graphs/molecules.h"
#include "tests/support/temp_dir.h"
#include "tests/trainer/state_compare.h"
#include "troupe/runtime/core/files.h"
#include "troupe/runtime/testing/fault_injector.h"
#include "troupe/runtime/testing/local_cluster.h"
#include "troupe/trainer/train_job.h"

using namespace std::chrono_literals;
using namespace troupe;
using namespace troupe::trainer;
namespace fs = std::filesystem;

namespace {

TEST(MoleculeGraphs, ValenceAndDeterminism) {
  for (int64_t i = 0; i < 200; ++i) {
    const auto m = molecules::generate(0, i);
    ASSERT_GE(m.type.size(), 1u);
    std::vector<int> degree(m.type.size(), 0);
    for (const auto& [u, v] : m.bonds) ++degree[u], ++degree[v];
    for (size_t a = 0; a < m.type.size(); ++a)
      ASSERT_EQ(degree[a] + m.hydrogens[a], molecules::kValence[m.type[a]]) << "molecule " << i << " atom " << a;
    EXPECT_EQ(m.energy_per_atom, molecules::generate(0, i).energy_per_atom);
  }
  molecules::MoleculeGraphs data(8, 0);
  std::vector<actors::Sample> samples = {data.get(0), data.get(1), data.get(2)};
  const int64_t nodes = samples[0].at("x").size(0) + samples[1].at("x").size(0) + samples[2].at("x").size(0);
  auto batch = data.collate(std::move(samples));
  EXPECT_EQ(batch.at("x").size(0), nodes);
  EXPECT_EQ(batch.at("batch").size(0), nodes);
  EXPECT_EQ(batch.at("y").size(0), 3);
  EXPECT_LT(batch.at("edge_index").max().item<int64_t>(), nodes);
}

TrainJobConfig graphs_job() {
  TrainJobConfig c;
  c.name = "graphs";
  c.scaling.num_workers = 2;
  c.trainer.model.name = "molecule_gnn";
  c.trainer.model.hidden = 32;
  c.trainer.model.config = "2";
  c.trainer.data = actors::DatasetSpec("molecules").set("size", 640).set("seed", 0);
  c.trainer.batch_size = 16;
  c.trainer.seed = 3;
  c.trainer.optimizer.name = "adamw";
  c.trainer.optimizer.lr = 3e-3;
  c.trainer.grad_clip = 1.0;
  c.epochs = 2;
  c.evaluate = false;
  c.verbose = false;
  c.progress_every_steps = 2;
  c.failure.max_failures = 2;
  c.failure.replacement_timeout = 3s;
  return c;
}

TEST(GraphsExample, HealsBitwiseAfterTrainerKill) {
  troupe::testing::LocalCluster cluster{{.nodes = {{{"CPU", 2}}, {{"CPU", 2}}}}};
  Runtime rt = cluster.connect();
  auto cfg = graphs_job();
  const Result clean = TrainJob(rt, cfg).fit();
  ASSERT_EQ(clean.steps, 40);  // 640 / (2 × 16) per epoch, 2 epochs
  EXPECT_LT(clean.history.back().train_loss, clean.history.front().train_loss);
  EXPECT_TRUE(clean.history.back().train_metrics.count("mae"));

  troupe::testing::FaultInjector faults(rt);
  const uint64_t before = faults.last_actor_id();
  cfg.on_step = [&](const StepInfo& s) { faults.on_step(s.step); };
  faults.at_step(13, [&] {
    auto id = faults.live_actors("troupe::trainer::TrainerActor", before).at(0).id;
    faults.after(2ms, [&faults, id] { faults.kill_actor(id); });
  });
  const Result hurt = TrainJob(rt, cfg).fit();
  ASSERT_EQ(hurt.recoveries.size(), 1u);
  EXPECT_EQ(hurt.recoveries[0].mode, RecoveryMode::kHeal);
  EXPECT_EQ(hurt.steps, clean.steps);
  test::expect_bitwise_equal(clean.final_state, hurt.final_state);
}

// What train_graphs prints and its exit status.
std::pair<int, std::string> run_graphs(const std::string& args) {
  FILE* p = ::popen((std::string(TRAIN_GRAPHS) + " " + args + " 2>&1").c_str(), "r");
  if (!p) return {-1, "popen failed"};
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out};
}

// Bad values are refused before a cluster starts, each naming the option
// and the value: not CLI11's range up to the largest double (309 digits),
// nor "cosine decay needs total_steps > 0" from deep in the job.
TEST(GraphsExample, BadValuesAreRefusedNamingThem) {
  for (const auto& [args, says] : std::vector<std::pair<std::string, std::string>>{
           {"--hidden 0", "--hidden: must be a positive number, got 0"},
           {"--lr nan", "--lr: must be a positive number, got nan"},
           {"--graphs 200 --workers 2 --batch-size 100",
            "--graphs 200 leaves 180 for training (a tenth validates), fewer than one step of --workers 2 × "
            "--batch-size 100 = 200"}}) {
    const auto [status, out] = run_graphs(args);
    EXPECT_NE(status, 0) << args << ": " << out;
    EXPECT_NE(out.find(says), std::string::npos) << args << ": " << out;
    EXPECT_LT(out.size(), 300u) << args << ": " << out;
  }
}

TEST(GraphsExample, BinarySurvivesKillAndLearns) {
  auto dir = test::fresh_dir("train-graphs");
  const std::string cmd = std::string(TRAIN_GRAPHS) + " --workers 2 --epochs 3 --graphs 800 --hidden 32 --layers 2" +
                          " --kill-at-step 30 --out " + dir.string() + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int status = ::pclose(p);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_NE(out.find("SIGKILL to trainer"), std::string::npos) << out;
  EXPECT_NE(out.find("survived a failure"), std::string::npos) << out;
  EXPECT_TRUE(fs::exists(dir / "metrics.jsonl"));
  troupe::core::remove_tree(dir);
}

}  // namespace
