// `troupe train` end to end, as a user runs it: a TorchScript step module
// and .npz arrays written by Debian's python3 (torch, numpy), then
//  - `troupe train` (the torch-free CLI exec'ing troupe-train) with a JSON
//    job file and flags overriding it trains 2 workers on an embedded
//    cluster: loss falls, the metrics file has one line per step with the
//    step's metrics, samples/s and world size, the final checkpoint loads
//    with torch.load, and no process is left behind;
//  - run against a running cluster (--address) it heals a trainer SIGKILLed
//    mid-run and finishes;
//  - bad input (a missing file or a directory, a step without `loss`, a
//    batch key the module does not expect, bad flag values, NaN or infinite
//    floating options, data too small for one step, an unknown job-file key
//    or a number of the wrong kind there) exits non-zero with one line
//    naming the culprit.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/process.h"
#include "tests/support/python.h"
#include "tests/support/temp_dir.h"
#include "tests/support/wait.h"
#include "troupe/runtime/core/files.h"
#include "troupe/runtime/testing/fault_injector.h"
#include "troupe/runtime/testing/local_cluster.h"

using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

constexpr const char* kTrainerClass = "troupe::trainer::TrainerActor";

bool have_python_torch() {
  return std::system((troupe::test::python() + " -c 'import torch, numpy' 2>/dev/null").c_str()) == 0;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Runs `script` with the system python; its stdout.
std::string python(const fs::path& dir, const std::string& script) {
  std::ofstream(dir / "script.py") << script;
  std::string cmd =
      troupe::test::python() + " " + (dir / "script.py").string() + " > " + (dir / "script.out").string() + " 2>&1";
  int rc = std::system(cmd.c_str());
  std::string out = read_text(dir / "script.out");
  if (rc != 0) ADD_FAILURE() << "python failed: " << out;
  return out;
}

// A regressor step module: `variant` "ok" returns loss, mae and a summed
// count; "noloss" returns no `loss`. `n` samples of 8 features in
// train.npz and n / 4 in val.npz (keys `features`, `value`; `bad.npz` has
// `feats` instead of `features`).
void write_inputs(const fs::path& dir, const std::string& variant, int n, int hidden) {
  std::string loss_key = variant == "noloss" ? "err2" : "loss";
  // "nan": the loss is NaN from the first batch; "typo": summed_metrics
  // names a metric forward does not return.
  const std::string scale = variant == "nan" ? " * float('nan')" : "";
  const std::string summed = variant == "typo" ? "cnt" : "count";
  python(dir, "import torch, numpy as np\nfrom typing import Dict, List\nd = '" + dir.string() +
                  "'\n"
                  "class Step(torch.nn.Module):\n"
                  "    summed_metrics: List[str]\n"
                  "    def __init__(self):\n"
                  "        super().__init__()\n"
                  "        self.net = torch.nn.Sequential(torch.nn.Linear(8, " +
                  std::to_string(hidden) + "), torch.nn.Tanh(), torch.nn.Linear(" + std::to_string(hidden) +
                  ", 1))\n"
                  "        self.summed_metrics = ['" +
                  summed +
                  "']\n"
                  "    def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:\n"
                  "        err = self.net(batch['features']).squeeze(1) - batch['value']\n"
                  "        return {'" +
                  loss_key + "': (err * err).mean()" + scale +
                  ", 'mae': err.abs().mean().detach(),\n"
                  "                'count': torch.tensor(float(err.shape[0]))}\n"
                  "torch.manual_seed(0)\n"
                  "torch.jit.save(torch.jit.script(Step()), d + '/step.pt')\n"
                  "rng = np.random.default_rng(0)\n"
                  "w = rng.standard_normal(8)\n"
                  "def arrays(n):\n"
                  "    x = rng.standard_normal((n, 8)).astype(np.float32)\n"
                  "    return x, (x @ w + 0.1 * rng.standard_normal(n)).astype(np.float32)\n"
                  "x, v = arrays(" +
                  std::to_string(n) +
                  ")\n"
                  "np.savez(d + '/train.npz', features=x, value=v)\n"
                  "np.savez(d + '/bad.npz', feats=x, value=v)\n"
                  "x, v = arrays(" +
                  std::to_string(n / 4) + ")\nnp.savez(d + '/val.npz', features=x, value=v)\n");
}

struct Outcome {
  int status = -1;  // exit code, or 128 + signal
  std::string output;
};

// Set in the environment of every process this test starts, and so of
// their children (the embedded cluster's agent and workers, which inherit
// all but TROUPE_* variables): ctest runs tests side by side, and other
// tests start troupe-train processes too.
std::string own_mark() { return "TRAIN_CLI_TEST_MARK=" + std::to_string(::getpid()); }

// Starts `args` with stdout and stderr to `log` and `env` added.
// `max_file_bytes` > 0: no file the command (or a process it starts)
// writes may grow past that (RLIMIT_FSIZE; SIGXFSZ ignored, so a write
// past it fails with EFBIG, as on a full disk).
pid_t spawn(const std::vector<std::string>& args, const fs::path& log,
            const std::vector<std::pair<std::string, std::string>>& env = {}, rlim_t max_file_bytes = 0) {
  const std::string mark = own_mark();
  pid_t pid = ::fork();
  if (pid == 0) {
    if (max_file_bytes > 0) {
      ::signal(SIGXFSZ, SIG_IGN);
      const struct rlimit limit { max_file_bytes, max_file_bytes };
      if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) ::_exit(125);
    }
    ::putenv(const_cast<char*>(mark.c_str()));  // the child's copy of the string outlives the exec
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    FILE* f = std::freopen(log.c_str(), "w", stdout);
    if (!f || ::dup2(STDOUT_FILENO, STDERR_FILENO) < 0) ::_exit(126);
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

// Waits (bounded) for `pid`; kills it when the bound passes.
Outcome finish(pid_t pid, const fs::path& log, std::chrono::seconds bound = 240s) {
  Outcome o;
  int st = 0;
  const auto deadline = std::chrono::steady_clock::now() + bound;
  while (::waitpid(pid, &st, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &st, 0);
      ADD_FAILURE() << "troupe train did not end within " << bound.count() << " s";
      break;
    }
    std::this_thread::sleep_for(20ms);
  }
  o.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  o.output = read_text(log);
  return o;
}

Outcome run(const std::vector<std::string>& args, const fs::path& log) { return finish(spawn(args, log), log); }

// Processes whose executable is troupe-train and that this test started
// (own_mark() in their environment), zombies aside.
int live_train_processes() {
  std::error_code ec;
  const fs::path exe = fs::canonical(TROUPE_TRAIN, ec);
  const std::string mark = own_mark();
  int n = 0;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    std::error_code ec2;
    fs::path p = fs::read_symlink(e.path() / "exe", ec2);
    if (ec2 || p != exe) continue;
    const std::string env = troupe::test::read_proc_file(e.path() / "environ");
    for (size_t at = env.find(mark); at != std::string::npos; at = env.find(mark, at + 1))
      if ((at == 0 || env[at - 1] == '\0') && (at + mark.size() == env.size() || env[at + mark.size()] == '\0')) {
        ++n;
        break;
      }
  }
  return n;
}

std::vector<nlohmann::json> metrics_lines(const fs::path& p, const std::string& kind) {
  std::vector<nlohmann::json> out;
  std::ifstream in(p);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.value("kind", "") == kind) out.push_back(j);
  }
  return out;
}

// The one line a failed run prints.
void expect_one_line_failure(const Outcome& o, const std::string& must_name) {
  EXPECT_NE(o.status, 0) << o.output;
  std::string text = o.output;
  while (!text.empty() && text.back() == '\n') text.pop_back();
  EXPECT_EQ(text.find('\n'), std::string::npos) << "more than one line:\n" << o.output;
  EXPECT_EQ(text.rfind("troupe train: ", 0), 0u) << o.output;
  EXPECT_NE(text.find(must_name), std::string::npos) << "does not name '" << must_name << "': " << o.output;
}

class TrainCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_python_torch()) GTEST_SKIP() << "no python3 with torch and numpy";
    dir_ = troupe::test::fresh_dir("train-cli");
  }
  void TearDown() override {
    std::error_code ec;
    troupe::core::remove_tree(dir_, ec);
  }
  std::string at(const std::string& name) const { return (dir_ / name).string(); }

  // `troupe train` of two workers on a running cluster of two nodes, with
  // `flags` after the common ones (model, data, sgd, batch 16, checkpoints,
  // metrics in metrics.jsonl); once `steps` steps are logged and both
  // trainers are up, `fault` is done to the second trainer's actor id.
  struct Faulted {
    bool started = false;  // the fault was done
    Outcome outcome;
  };
  Faulted run_with_fault(const std::vector<std::string>& flags, size_t steps,
                         const std::function<void(troupe::testing::FaultInjector&, uint64_t)>& fault) {
    troupe::testing::LocalCluster cluster{{.nodes = {{{"CPU", 2}}, {{"CPU", 2}}}}};
    troupe::Runtime rt = cluster.connect();
    troupe::testing::FaultInjector faults(rt);
    const uint64_t before = faults.last_actor_id();
    const fs::path log = dir_ / "train.log", metrics = dir_ / "metrics.jsonl";
    std::vector<std::string> args = {
        TROUPE_TRAIN,   "--model",   at("step.pt"),    "--data",    at("train.npz"),  "--workers", "2",
        "--batch-size", "16",        "--optimizer",    "sgd",       "--lr",           "0.01",      "--checkpoint-dir",
        at("ckpt"),     "--metrics", metrics.string(), "--address", cluster.address()};
    args.insert(args.end(), flags.begin(), flags.end());
    pid_t pid = spawn(args, log, {{"TROUPE_TOKEN", cluster.token()}});
    Faulted r;
    r.started = troupe::test::eventually(
        [&] {
          return metrics_lines(metrics, "step").size() >= steps &&
                 faults.live_actors(kTrainerClass, before).size() == 2;
        },
        120s);
    if (r.started) fault(faults, faults.live_actors(kTrainerClass, before).at(1).id);
    r.outcome = finish(pid, log);
    return r;
  }

  fs::path dir_;
};

TEST_F(TrainCliTest, TrainsTwoWorkersFromAJobFileWithMetricsAndATorchLoadableCheckpoint) {
  write_inputs(dir_, "ok", 512, 16);
  // The job file says one worker and one epoch; the flags override both.
  std::ofstream(dir_ / "job.json") << nlohmann::json{
      {"model", at("step.pt")},
      {"data", at("train.npz")},
      {"val_data", at("val.npz")},
      {"workers", 1},
      {"epochs", 1},
      {"batch_size", 16},
      {"optimizer", "adamw"},
      {"lr", 0.01},
      {"warmup_steps", 4},
      {"loader_threads", 2},
      {"checkpoint_dir", at("ckpt")}}.dump();
  const Outcome o = run({TROUPE_CLI, "train", "--config", at("job.json"), "--workers", "2", "--epochs", "3",
                         "--metrics", at("metrics.jsonl")},
                        dir_ / "train.log");
  ASSERT_EQ(o.status, 0) << o.output;
  EXPECT_NE(o.output.find("epoch 3/3"), std::string::npos) << o.output;
  // The summary's loss says what it is (it read "final loss", and a step
  // line's loss is that step's).
  EXPECT_NE(o.output.find("last epoch's mean loss "), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("final checkpoint"), std::string::npos) << o.output;

  const auto steps = metrics_lines(dir_ / "metrics.jsonl", "step");
  ASSERT_EQ(steps.size(), 48u);  // 512 / (2 × 16) per epoch, 3 epochs
  for (const char* key : {"step", "epoch", "loss", "mae", "count", "samples_per_s", "world_size", "data_wait"})
    EXPECT_TRUE(steps.front().contains(key)) << key << " missing in " << steps.front().dump();
  EXPECT_EQ(steps.back()["world_size"], 2);
  EXPECT_EQ(steps.back()["step"], 48);
  EXPECT_EQ(steps.back()["count"], 32.0);  // summed over both ranks' batches
  EXPECT_GT(steps.back()["samples_per_s"].get<double>(), 0.0);
  const auto epochs = metrics_lines(dir_ / "metrics.jsonl", "epoch");
  ASSERT_EQ(epochs.size(), 3u);
  EXPECT_LT(epochs.back()["train_loss"].get<double>(), 0.5 * epochs.front()["train_loss"].get<double>());
  EXPECT_EQ(epochs.back()["val_count"], 128);
  EXPECT_TRUE(epochs.back()["val_metrics"].contains("mae"));
  // A regression step reports no accuracy: none is written (not 0).
  EXPECT_TRUE(epochs.back().contains("val_loss")) << epochs.back().dump();
  EXPECT_FALSE(epochs.back().contains("train_accuracy")) << epochs.back().dump();
  EXPECT_FALSE(epochs.back().contains("val_accuracy")) << epochs.back().dump();
  const double wait = epochs.back()["data_wait"].get<double>();
  EXPECT_TRUE(wait >= 0 && wait <= 1) << wait;

  // The last checkpoint loads with torch.load, with the module's names.
  std::string out = python(dir_,
                           "import glob, torch\n"
                           "d = sorted(glob.glob('" +
                               at("ckpt") +
                               "/step-*'))[-1]\n"
                               "m = torch.load(d + '/model.pt')\n"
                               "print(d.split('/')[-1], sorted(m.keys()), tuple(m['net.0.weight'].shape))\n");
  EXPECT_NE(out.find("step-00000048"), std::string::npos) << out;
  EXPECT_NE(out.find("'net.2.bias'"), std::string::npos) << out;
  EXPECT_NE(out.find("(16, 8)"), std::string::npos) << out;

  // The embedded cluster's processes (node agent, workers) went with it.
  EXPECT_TRUE(troupe::test::eventually([] { return live_train_processes() == 0; }, 30s))
      << live_train_processes() << " troupe-train process(es) left";
}

TEST_F(TrainCliTest, HealsATrainerKilledMidRunOnARunningCluster) {
  write_inputs(dir_, "ok", 2048, 64);
  const fs::path metrics = dir_ / "metrics.jsonl";
  // Mid-run: both trainers up and ten steps done (of 192).
  const auto [started, o] = run_with_fault({"--epochs", "3", "--max-failures", "2"}, 10,
                                           [](troupe::testing::FaultInjector& f, uint64_t id) { f.kill_actor(id); });
  ASSERT_TRUE(started) << o.output;
  ASSERT_EQ(o.status, 0) << o.output;
  EXPECT_NE(o.output.find("1 failure(s) healed"), std::string::npos) << o.output;
  bool healed = false;
  for (const auto& e : metrics_lines(metrics, "event")) healed = healed || e["event"] == "healed";
  EXPECT_TRUE(healed) << read_text(metrics).substr(0, 2000);
  EXPECT_EQ(metrics_lines(metrics, "step").back()["step"], 192);
}

// A failure past --max-failures ends the job naming the flag and its value,
// in troupe train's terms (the C++ TrainJob says failure.max_failures).
TEST_F(TrainCliTest, AFailurePastMaxFailuresNamesTheFlag) {
  write_inputs(dir_, "ok", 2048, 64);
  const auto [started, o] = run_with_fault({"--epochs", "3", "--max-failures", "0"}, 4,
                                           [](troupe::testing::FaultInjector& f, uint64_t id) { f.kill_actor(id); });
  ASSERT_TRUE(started) << o.output;
  EXPECT_EQ(o.status, 1) << o.output;
  EXPECT_NE(o.output.find("failure 1 and --max-failures 0: "), std::string::npos) << o.output;
  EXPECT_EQ(o.output.find("failure.max_failures"), std::string::npos) << o.output;
  // The dead trainer's rank, not only its actor id (which the user never
  // sees), and the trainer, not its loader, whose stream broke with it.
  // Its pid: in the parentheses while the driver still knew it, and in the
  // cause, never as "pid 0".
  EXPECT_TRUE(std::regex_search(o.output, std::regex(R"(: rank [01] \(actor \d+(, pid \d+)?\): .*pid \d+)")))
      << o.output;
  EXPECT_EQ(o.output.find("pid 0"), std::string::npos) << o.output;
  EXPECT_EQ(o.output.find("the loader of rank"), std::string::npos) << o.output;
  // No checkpoint was due yet (an epoch is 64 steps): the survivor's state
  // is saved as one, at a step no earlier than the last one logged, and
  // --resume goes on from it.
  std::smatch saved;
  ASSERT_TRUE(std::regex_search(o.output, saved, std::regex(R"(the survivors' state at step (\d+) is saved in (\S+))")))
      << o.output;
  const int64_t step = std::stoll(saved[1]);
  EXPECT_GE(step, metrics_lines(dir_ / "metrics.jsonl", "step").back()["step"].get<int64_t>());
  EXPECT_TRUE(fs::exists(fs::path(saved[2].str()) / "model.pt")) << saved[2];
  const Outcome resumed = run({TROUPE_TRAIN,
                               "--model",
                               at("step.pt"),
                               "--data",
                               at("train.npz"),
                               "--workers",
                               "2",
                               "--batch-size",
                               "16",
                               "--optimizer",
                               "sgd",
                               "--lr",
                               "0.01",
                               "--epochs",
                               "1",
                               "--checkpoint-dir",
                               at("ckpt"),
                               "--metrics",
                               at("resumed.jsonl"),
                               "--resume"},
                              dir_ / "resumed.log");
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resuming from " + saved[2].str()), std::string::npos) << resumed.output;
  EXPECT_EQ(metrics_lines(dir_ / "resumed.jsonl", "step").front()["step"], step + 1);
}

// The job's state as the head shows it (`troupe status`, the dashboard),
// or "" when the head shows no job of that name.
std::string job_state(troupe::Runtime& rt, const std::string& name) {
  const auto status = nlohmann::json::parse(rt.status_json());
  for (const auto& j : status.value("jobs", nlohmann::json::array()))
    if (j.value("name", "") == name) return j.value("state", "");
  return "";
}

// A driver SIGKILLed mid-run on a running cluster cannot say its job ended:
// the head shows the job "lost" once the driver's connection is gone. It
// used to show it "running" for as long as the cluster lived.
TEST_F(TrainCliTest, AJobWhoseDriverIsKilledIsShownLostNotRunning) {
  write_inputs(dir_, "ok", 2048, 64);
  troupe::testing::LocalCluster cluster{{.nodes = {{{"CPU", 2}}}}};
  troupe::Runtime rt = cluster.connect();
  const fs::path log = dir_ / "train.log", metrics = dir_ / "metrics.jsonl";
  std::vector<std::string> args = {TROUPE_TRAIN,     "--model",          at("step.pt"),    "--data",
                                   at("train.npz"),  "--checkpoint-dir", at("ckpt"),       "--metrics",
                                   metrics.string(), "--address",        cluster.address()};
  for (const char* flag : {"--workers 1", "--epochs 50", "--batch-size 16", "--optimizer sgd", "--name doomed"}) {
    const std::string f = flag;
    args.push_back(f.substr(0, f.find(' ')));
    args.push_back(f.substr(f.find(' ') + 1));
  }
  pid_t pid = spawn(args, log, {{"TROUPE_TOKEN", cluster.token()}});
  const bool running = troupe::test::eventually(
      [&] { return metrics_lines(metrics, "step").size() >= 2 && job_state(rt, "doomed") == "running"; }, 120s);
  ::kill(pid, SIGKILL);
  const Outcome o = finish(pid, log);
  ASSERT_TRUE(running) << o.output << "\nstate: " << job_state(rt, "doomed");
  EXPECT_TRUE(troupe::test::eventually([&] { return job_state(rt, "doomed") == "lost"; }, 60s))
      << "state: " << job_state(rt, "doomed");
}

// A trainer stopped (SIGSTOP) mid-run neither dies nor answers: after
// --step-timeout its round counts as failed, recovery finds it silent,
// kills it and heals the job, which ends with every step done.
TEST_F(TrainCliTest, AStoppedTrainerIsKilledAndHealedAfterTheStepTimeout) {
  write_inputs(dir_, "ok", 1024, 64);
  const fs::path metrics = dir_ / "metrics.jsonl";
  const auto [started, o] = run_with_fault(
      {"--epochs", "2", "--max-failures", "1", "--step-timeout", "5", "--log-every", "2"}, 4,
      [](troupe::testing::FaultInjector& f, uint64_t id) { f.stall_actor(id, std::chrono::minutes(5)); });
  ASSERT_TRUE(started) << o.output;
  ASSERT_EQ(o.status, 0) << o.output;
  EXPECT_NE(o.output.find("1 failure(s) healed"), std::string::npos) << o.output;
  EXPECT_EQ(metrics_lines(metrics, "step").back()["step"], 64);  // 1024 / (2 × 16) per epoch, 2 epochs
}

// SIGTERM (a batch system's time limit, or Ctrl-C's SIGINT) mid-run: the
// job stops at the next round of --log-every steps with a checkpoint of the
// step reached and exits 143, naming the checkpoint. The directory is then
// refused without --resume (it would mix two runs' checkpoints); with it the
// same command goes on from that step and ends with weights bitwise those
// of a run never interrupted. Progress lines reach the log file while the
// job runs, and the embedded cluster's workers leave no log files beside it.
TEST_F(TrainCliTest, SigtermStopsWithACheckpointAndResumeEndsWithTheSameWeights) {
  write_inputs(dir_, "ok", 2048, 64);
  auto args = [&](const std::string& ckpt, const std::string& metrics) {
    return std::vector<std::string>{TROUPE_TRAIN,  "--model",     at("step.pt"), "--data",    at("train.npz"),
                                    "--workers",   "2",           "--epochs",    "3",         "--batch-size",
                                    "16",          "--optimizer", "adamw",       "--lr",      "0.005",
                                    "--log-every", "4",           "--metrics",   at(metrics), "--checkpoint-dir",
                                    at(ckpt)};
  };
  const Outcome whole = run(args("ckpt-whole", "whole.jsonl"), dir_ / "whole.log");
  ASSERT_EQ(whole.status, 0) << whole.output;
  // No --val-data: the epoch records hold no validation figures.
  for (const auto& e : metrics_lines(dir_ / "whole.jsonl", "epoch"))
    EXPECT_FALSE(e.contains("val_loss") || e.contains("val_metrics")) << e.dump();

  const fs::path log = dir_ / "cut.log";
  pid_t pid = spawn(args("ckpt", "cut.jsonl"), log);
  const bool running =
      troupe::test::eventually([&] { return metrics_lines(dir_ / "cut.jsonl", "step").size() >= 12; }, 120s);
  // The first progress line is in the file already, not in a buffer.
  const std::string early = read_text(log);
  if (running) ::kill(pid, SIGTERM);
  const Outcome cut = finish(pid, log);
  ASSERT_TRUE(running) << cut.output;
  EXPECT_NE(early.find("[train] 2 trainer(s)"), std::string::npos) << early;
  ASSERT_EQ(cut.status, 128 + SIGTERM) << cut.output;
  EXPECT_NE(cut.output.find("interrupted at step"), std::string::npos) << cut.output;
  EXPECT_NE(cut.output.find("--resume"), std::string::npos) << cut.output;
  const int64_t stopped_at = metrics_lines(dir_ / "cut.jsonl", "step").back()["step"];
  EXPECT_LT(stopped_at, 192);  // 2048 / (2 × 16) = 64 steps an epoch, 3 epochs
  EXPECT_TRUE(fs::exists(
      dir_ / "ckpt" / ("step-" + std::string(8 - std::to_string(stopped_at).size(), '0') + std::to_string(stopped_at))))
      << cut.output;
  bool interrupted = false;
  for (const auto& e : metrics_lines(dir_ / "cut.jsonl", "event"))
    interrupted = interrupted || e["event"] == "interrupted";
  EXPECT_TRUE(interrupted);

  expect_one_line_failure(run(args("ckpt", "again.jsonl"), dir_ / "again.log"), "add --resume");
  // Resumed with another optimizer than the checkpoint's: said so, not as
  // a parameter missing from its state.
  auto other = args("ckpt", "other.jsonl");
  other.push_back("--resume");
  std::replace(other.begin(), other.end(), std::string("adamw"), std::string("sgd"));
  const Outcome mismatched = run(other, dir_ / "other.log");
  EXPECT_NE(mismatched.status, 0) << mismatched.output;
  EXPECT_NE(mismatched.output.find("the checkpoint's optimizer state is adamw's, and this job's optimizer is sgd"),
            std::string::npos)
      << mismatched.output;

  auto resume = args("ckpt", "resumed.jsonl");
  resume.push_back("--resume");
  const Outcome resumed = run(resume, dir_ / "resumed.log");
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resuming from"), std::string::npos) << resumed.output;
  const auto steps = metrics_lines(dir_ / "resumed.jsonl", "step");
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(steps.front()["step"], stopped_at + 1);
  EXPECT_EQ(steps.back()["step"], 192);
  // Resumed with the epochs asked for done, or more: nothing to train, and
  // it says so, counting epochs as the progress lines do.
  for (const char* epochs : {"1", "3"}) {
    auto past = args("ckpt", "past.jsonl");
    past.push_back("--resume");
    *std::find(past.begin(), past.end(), std::string("3")) = epochs;  // --epochs
    const Outcome nothing = run(past, dir_ / "past.log");
    EXPECT_EQ(nothing.status, 0) << nothing.output;
    EXPECT_NE(nothing.output.find("the checkpoint at step 192 has 3 epoch(s) done, and --epochs is " +
                                  std::string(epochs) + ": nothing to train"),
              std::string::npos)
        << nothing.output;
    EXPECT_NE(nothing.output.find("troupe train: done, 192 steps"), std::string::npos) << nothing.output;
  }
  const std::string same = python(dir_,
                                  "import torch\n"
                                  "a = torch.load('" +
                                      at("ckpt-whole/step-00000192/model.pt") +
                                      "')\n"
                                      "b = torch.load('" +
                                      at("ckpt/step-00000192/model.pt") +
                                      "')\n"
                                      "print('same' if a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)"
                                      " else 'different')\n");
  EXPECT_NE(same.find("same"), std::string::npos) << same;

  for (const auto& e : fs::directory_iterator(dir_))
    EXPECT_NE(e.path().filename().string().rfind("worker-", 0), 0u) << "a worker log beside the driver's: " << e.path();
}

// A checkpoint the disk refuses (here: files may not grow past 256 KiB, and
// the model's is larger) ends the job with an error naming the file, the
// reason and the newest checkpoint on disk; it is not healed as a trainer's
// failure while training goes on without checkpoints.
TEST_F(TrainCliTest, ACheckpointTheDiskRefusesFailsTheJob) {
  write_inputs(dir_, "ok", 256, 16384);  // model.pt about 640 KiB
  const fs::path log = dir_ / "full.log";
  const Outcome o = finish(spawn({TROUPE_TRAIN, "--model", at("step.pt"), "--data", at("train.npz"), "--workers", "1",
                                  "--epochs", "2", "--batch-size", "64", "--optimizer", "sgd", "--lr", "0.001",
                                  "--max-failures", "3", "--checkpoint-dir", at("ckpt")},
                                 log, {}, 256 << 10),
                           log);
  EXPECT_EQ(o.status, 1) << o.output;
  EXPECT_NE(o.output.find("cannot write checkpoint file"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("File too large"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("the newest checkpoint written is none"), std::string::npos) << o.output;
  EXPECT_EQ(o.output.find("healed"), std::string::npos) << o.output;
  EXPECT_TRUE(troupe::test::eventually([] { return live_train_processes() == 0; }, 30s));
}

// A loss that turns NaN or infinite mid-run (a learning rate that blows
// the weights up) fails the job naming the step, rather than training on
// to NaN weights and ending as done.
TEST_F(TrainCliTest, ALossThatDivergesFailsTheJobNamingTheStep) {
  write_inputs(dir_, "ok", 256, 8);
  const Outcome o = run({TROUPE_TRAIN, "--model", at("step.pt"), "--data", at("train.npz"), "--epochs", "2",
                         "--batch-size", "32", "--optimizer", "sgd", "--lr", "1e30", "--checkpoint-dir", at("ckpt")},
                        dir_ / "diverge.log");
  EXPECT_EQ(o.status, 1) << o.output;
  EXPECT_NE(o.output.find("the loss is "), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("try a lower --lr"), std::string::npos) << o.output;
  EXPECT_EQ(o.output.find("troupe train: done"), std::string::npos) << o.output;
  // Said at the step the loss went, once, under the command's name alone
  // (it said "at step 11" of an infinity at step 3, then "troupe train:
  // [train] training failed between steps 2 and 11: the loss is inf at
  // step 2").
  EXPECT_TRUE(
      std::regex_search(o.output, std::regex(R"(\ntroupe train: training failed: the loss is \S+ at step \d+ )")))
      << o.output;
}

// A run resumed from good checkpoints that then diverges saves nothing past
// the non-finite loss: no "survivors' state" of NaN weights that would
// prune the good checkpoints (only the newest three are kept) and fail the
// next resume at once. It names the newest good checkpoint instead.
TEST_F(TrainCliTest, ADivergedRunKeepsTheGoodCheckpointsAndNamesTheNewest) {
  write_inputs(dir_, "ok", 256, 8);
  const std::vector<std::string> base = {TROUPE_TRAIN,    "--model",          at("step.pt"), "--data",
                                         at("train.npz"), "--batch-size",     "32",          "--optimizer",
                                         "sgd",           "--checkpoint-dir", at("ckpt")};
  auto with = [&](std::vector<std::string> extra) {
    auto args = base;
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  const auto steps_on_disk = [&] {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_ / "ckpt"))
      if (e.path().filename().string().rfind("step-", 0) == 0) names.insert(e.path().filename().string());
    return names;
  };
  const Outcome good = run(with({"--epochs", "1", "--lr", "0.01"}), dir_ / "good.log");
  ASSERT_EQ(good.status, 0) << good.output;
  const auto before = steps_on_disk();
  ASSERT_FALSE(before.empty());
  for (int attempt = 0; attempt < 2; ++attempt) {
    const Outcome o = run(with({"--epochs", "3", "--lr", "1e30", "--resume"}), dir_ / "diverge.log");
    EXPECT_EQ(o.status, 1) << o.output;
    EXPECT_NE(o.output.find("the loss is "), std::string::npos) << o.output;
    EXPECT_NE(o.output.find("the newest checkpoint is " + (dir_ / "ckpt" / *before.rbegin()).string()),
              std::string::npos)
        << o.output;
    EXPECT_EQ(o.output.find("survivors' state"), std::string::npos) << o.output;
    EXPECT_EQ(steps_on_disk(), before) << o.output;
  }
  // The good checkpoint still resumes.
  const Outcome resumed = run(with({"--epochs", "2", "--lr", "0.01", "--resume"}), dir_ / "resumed.log");
  EXPECT_EQ(resumed.status, 0) << resumed.output;
}

// --resume over damaged checkpoints: a damaged newest one is named and
// passed over; when none can be read it is an error, not a run from step
// 0 that says the directory holds no checkpoint.
TEST_F(TrainCliTest, ResumeNamesDamagedCheckpointsAndRefusesWhenNoneCanBeRead) {
  write_inputs(dir_, "ok", 128, 8);
  auto args = [&](const std::string& epochs, bool resume) {
    std::vector<std::string> a = {
        TROUPE_TRAIN,  "--model", at("step.pt"), "--data", at("train.npz"),    "--epochs", epochs, "--batch-size", "32",
        "--optimizer", "sgd",     "--lr",        "0.01",   "--checkpoint-dir", at("ckpt")};
    if (resume) a.push_back("--resume");
    return a;
  };
  ASSERT_EQ(run(args("2", false), dir_ / "first.log").status, 0);
  std::vector<fs::path> steps;
  for (const auto& e : fs::directory_iterator(dir_ / "ckpt")) steps.push_back(e.path());
  std::sort(steps.begin(), steps.end());
  ASSERT_EQ(steps.size(), 2u);  // one at each epoch's end
  fs::resize_file(steps[1] / "model.pt", 10);
  const Outcome passed_over = run(args("2", true), dir_ / "passed.log");
  EXPECT_EQ(passed_over.status, 0) << passed_over.output;
  EXPECT_NE(passed_over.output.find("skipping damaged checkpoint " + steps[1].string()), std::string::npos)
      << passed_over.output;
  EXPECT_NE(passed_over.output.find("resuming from " + steps[0].string()), std::string::npos) << passed_over.output;
  for (const auto& s : steps) fs::resize_file(s / "model.pt", 10);
  const Outcome none = run(args("2", true), dir_ / "none.log");
  expect_one_line_failure(none, "--resume: no checkpoint in " + at("ckpt") + " can be read");
  EXPECT_NE(none.output.find("has 10 bytes, its manifest says"), std::string::npos) << none.output;
}

// --resume with a checkpoint of another model (here: a wider hidden layer)
// is the user's input, refused with exit 2 naming the tensor and both
// shapes, not a runtime failure (exit 1) in the C++ type's words.
TEST_F(TrainCliTest, ResumingAnotherModelsCheckpointIsRefusedNamingTheTensor) {
  write_inputs(dir_, "ok", 128, 8);
  auto args = [&](bool resume) {
    std::vector<std::string> a = {
        TROUPE_TRAIN,  "--model", at("step.pt"), "--data", at("train.npz"),    "--epochs", "1", "--batch-size", "32",
        "--optimizer", "sgd",     "--lr",        "0.01",   "--checkpoint-dir", at("ckpt")};
    if (resume) a.push_back("--resume");
    return a;
  };
  ASSERT_EQ(run(args(false), dir_ / "first.log").status, 0);
  write_inputs(dir_, "ok", 128, 16);
  const Outcome other = run(args(true), dir_ / "other.log");
  EXPECT_EQ(other.status, 2) << other.output;
  EXPECT_NE(other.output.find("the checkpoint's 'net.0.weight' is [8, 8], this model's is [16, 8]: it is another "
                              "model's"),
            std::string::npos)
      << other.output;
  EXPECT_EQ(other.output.find("troupe::Error"), std::string::npos) << other.output;
}

// --checkpoint-every N: checkpoints inside the epoch at every N-th step
// (and at its end), the newest 3 kept; --resume from a mid-epoch one goes
// on from its step.
TEST_F(TrainCliTest, CheckpointEveryWritesMidEpochCheckpointsAndResumesFromOne) {
  write_inputs(dir_, "ok", 512, 8);
  auto args = [&](const std::string& metrics) {
    return std::vector<std::string>{TROUPE_TRAIN,
                                    "--model",
                                    at("step.pt"),
                                    "--data",
                                    at("train.npz"),
                                    "--workers",
                                    "2",
                                    "--epochs",
                                    "1",
                                    "--batch-size",
                                    "16",
                                    "--optimizer",
                                    "sgd",
                                    "--lr",
                                    "0.01",
                                    "--checkpoint-every",
                                    "5",
                                    "--log-every",
                                    "16",
                                    "--metrics",
                                    at(metrics),
                                    "--checkpoint-dir",
                                    at("ckpt")};
  };
  const Outcome o = run(args("first.jsonl"), dir_ / "first.log");
  ASSERT_EQ(o.status, 0) << o.output;
  std::vector<int64_t> at_steps;
  for (const auto& e : metrics_lines(dir_ / "first.jsonl", "event"))
    if (e["event"] == "checkpoint") at_steps.push_back(e["step"].get<int64_t>());
  EXPECT_EQ(at_steps, (std::vector<int64_t>{5, 10, 15, 16}));  // 512 / (2 × 16) = 16 steps
  std::vector<std::string> kept;
  for (const auto& e : fs::directory_iterator(dir_ / "ckpt")) kept.push_back(e.path().filename().string());
  std::sort(kept.begin(), kept.end());
  // No .lock: a job holds it while it runs (CheckpointWriter), then removes it.
  EXPECT_EQ(kept, (std::vector<std::string>{"step-00000010", "step-00000015", "step-00000016"}));
  // The run as if stopped after step 15: --resume goes on from there.
  fs::remove_all(dir_ / "ckpt" / "step-00000016");
  auto again = args("again.jsonl");
  again.push_back("--resume");
  const Outcome resumed = run(again, dir_ / "again.log");
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resuming from " + at("ckpt/step-00000015")), std::string::npos) << resumed.output;
  const auto steps = metrics_lines(dir_ / "again.jsonl", "step");
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps.front()["step"], 16);
  // The epoch's summary covers all 16 steps, the 15 before the checkpoint
  // too (it used to be step 16's alone): the uninterrupted run's loss.
  const auto whole = metrics_lines(dir_ / "first.jsonl", "epoch");
  const auto resumed_epoch = metrics_lines(dir_ / "again.jsonl", "epoch");
  ASSERT_EQ(whole.size(), 1u);
  ASSERT_EQ(resumed_epoch.size(), 1u);
  const double full_loss = whole.front()["train_loss"].get<double>();
  EXPECT_NEAR(resumed_epoch.front()["train_loss"].get<double>(), full_loss, 1e-9 * std::abs(full_loss))
      << resumed_epoch.front().dump() << " vs " << whole.front().dump();
  EXPECT_NE(steps.front()["loss"].get<double>(), full_loss);  // so the check above could fail
  // Resumed with smaller steps, the rest of the epoch (16 samples a worker)
  // fills one step of 12: the 8 samples left over are said (they went
  // untrained without a word).
  fs::remove_all(dir_ / "ckpt" / "step-00000016");
  auto smaller = args("smaller.jsonl");
  *(std::find(smaller.begin(), smaller.end(), std::string("--batch-size")) + 1) = "12";
  smaller.push_back("--resume");
  const Outcome short_steps = run(smaller, dir_ / "smaller.log");
  ASSERT_EQ(short_steps.status, 0) << short_steps.output;
  EXPECT_NE(short_steps.output.find("in this run's steps of 12 on 2 worker(s), 8 samples of the rest of that epoch go "
                                    "untrained"),
            std::string::npos)
      << short_steps.output;
  const auto skipped = metrics_lines(dir_ / "smaller.jsonl", "event");
  EXPECT_EQ(
      std::count_if(skipped.begin(), skipped.end(), [](const auto& e) { return e["event"] == "samples_skipped"; }), 1);
  EXPECT_EQ(resumed.output.find("go untrained"), std::string::npos) << resumed.output;
  // A negative N is refused naming the flag.
  auto bad = args("bad.jsonl");
  *std::find(bad.begin(), bad.end(), std::string("5")) = "-5";
  expect_one_line_failure(run(bad, dir_ / "bad.log"), "--checkpoint-every -5 must be 0 (off) or a number of steps");
}

// --max-steps stops mid-epoch with a checkpoint of the step reached; a
// resume with a higher limit goes on from it and ends with the weights of
// a run that went there at once; a limit the checkpoint has reached trains
// nothing and says so.
TEST_F(TrainCliTest, MaxStepsStopsMidEpochWithACheckpointAndAResumeGoesOnToTheRaisedLimit) {
  write_inputs(dir_, "ok", 512, 8);
  auto args = [&](const std::string& ckpt, const std::string& metrics, const std::string& max_steps) {
    return std::vector<std::string>{TROUPE_TRAIN,  "--model",     at("step.pt"), "--data",    at("train.npz"),
                                    "--workers",   "2",           "--epochs",    "2",         "--batch-size",
                                    "16",          "--optimizer", "adamw",       "--lr",      "0.01",
                                    "--log-every", "4",           "--metrics",   at(metrics), "--checkpoint-dir",
                                    at(ckpt),      "--max-steps", max_steps};
  };
  const Outcome short_run = run(args("ckpt", "short.jsonl", "7"), dir_ / "short.log");
  ASSERT_EQ(short_run.status, 0) << short_run.output;
  EXPECT_NE(short_run.output.find("troupe train: done, 7 steps (--max-steps)"), std::string::npos) << short_run.output;
  EXPECT_TRUE(fs::exists(dir_ / "ckpt" / "step-00000007")) << short_run.output;
  EXPECT_EQ(metrics_lines(dir_ / "short.jsonl", "step").back()["step"], 7);

  auto more = args("ckpt", "more.jsonl", "20");  // 16 steps an epoch: into the second
  more.push_back("--resume");
  const Outcome resumed = run(more, dir_ / "more.log");
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resuming from " + at("ckpt/step-00000007")), std::string::npos) << resumed.output;
  const auto steps = metrics_lines(dir_ / "more.jsonl", "step");
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(steps.front()["step"], 8);
  EXPECT_EQ(steps.back()["step"], 20);
  EXPECT_TRUE(fs::exists(dir_ / "ckpt" / "step-00000020")) << resumed.output;

  const Outcome straight = run(args("ckpt-straight", "straight.jsonl", "20"), dir_ / "straight.log");
  ASSERT_EQ(straight.status, 0) << straight.output;
  const std::string same = python(dir_,
                                  "import torch\n"
                                  "a = torch.load('" +
                                      at("ckpt-straight/step-00000020/model.pt") +
                                      "')\n"
                                      "b = torch.load('" +
                                      at("ckpt/step-00000020/model.pt") +
                                      "')\n"
                                      "print('same' if a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)"
                                      " else 'different')\n");
  EXPECT_NE(same.find("same"), std::string::npos) << same;

  auto past = args("ckpt", "past.jsonl", "20");
  past.push_back("--resume");
  const Outcome nothing = run(past, dir_ / "past.log");
  EXPECT_EQ(nothing.status, 0) << nothing.output;
  EXPECT_NE(nothing.output.find("the checkpoint is at step 20, and --max-steps is 20: nothing to train"),
            std::string::npos)
      << nothing.output;
  expect_one_line_failure(run(args("ckpt-bad", "bad.jsonl", "-1"), dir_ / "bad.log"),
                          "--max-steps must be 0 (--epochs alone) or positive, got -1");
}

TEST_F(TrainCliTest, BadInputExitsNonZeroWithOneLineNamingIt) {
  write_inputs(dir_, "ok", 64, 8);
  const std::vector<std::string> ok = {TROUPE_TRAIN,    "--model",          at("step.pt"), "--data",
                                       at("train.npz"), "--checkpoint-dir", at("ckpt")};
  auto with = [&](std::vector<std::string> extra) {
    auto a = ok;
    a.insert(a.end(), extra.begin(), extra.end());
    return run(a, dir_ / "bad.log");
  };
  expect_one_line_failure(with({"--data", at("missing.npz")}), "missing.npz");
  expect_one_line_failure(with({"--val-data", at("nowhere.npz")}), "nowhere.npz");
  expect_one_line_failure(with({"--data", at("bad.npz")}), "features");  // the key the module reads
  expect_one_line_failure(with({"--optimizer", "adam"}), "adam");
  expect_one_line_failure(with({"--workers", "zero"}), "--workers zero: not a value --workers takes");
  expect_one_line_failure(with({"--lr", "abc"}), "--lr abc: not a value --lr takes");
  expect_one_line_failure(with({"--batch-size", "0"}), "--batch-size");
  expect_one_line_failure(with({"--accumulation", "0"}), "--accumulation must be between 1 and 1048576, got 0");
  expect_one_line_failure(with({"--lr", "-1"}), "--lr");
  expect_one_line_failure(with({"--loader-threads", "0"}), "--loader-threads");
  expect_one_line_failure(with({"--step-timeout", "0"}), "--step-timeout");
  expect_one_line_failure(with({"--frobnicate"}), "--frobnicate");
  expect_one_line_failure(with({"--gpus-per-worker", "1.5"}), "--gpus-per-worker");
  expect_one_line_failure(with({"--amp", "fp8", "--gpus-per-worker", "1"}), "fp8");
  expect_one_line_failure(with({"--amp", "fp16"}), "--gpus-per-worker");
  expect_one_line_failure(with({"--cpu-gemm", "mkl"}), "--cpu-gemm must be auto, onednn or aten, got 'mkl'");
  // Floating options are finite and in range (CLI11 reads inf, nan, and
  // 1e400 as inf; the job would train to NaN and exit 0).
  expect_one_line_failure(with({"--lr", "inf"}), "--lr must be a positive finite number, got inf");
  expect_one_line_failure(with({"--lr", "1e400"}), "--lr must be a positive finite number, got inf");
  expect_one_line_failure(with({"--weight-decay", "nan"}), "--weight-decay must be a finite number >= 0, got nan");
  expect_one_line_failure(with({"--weight-decay", "-1"}), "--weight-decay must be a finite number >= 0, got -1");
  expect_one_line_failure(with({"--grad-clip", "inf"}), "--grad-clip must be a finite number >= 0");
  expect_one_line_failure(with({"--min-lr-factor", "nan"}), "--min-lr-factor must be between 0 and 1, got nan");
  expect_one_line_failure(with({"--cpus-per-worker", "inf"}), "--cpus-per-worker must be a positive finite number");
  expect_one_line_failure(with({"--gpus-per-worker", "nan"}), "--gpus-per-worker");
  expect_one_line_failure(with({"--block-size", "-1"}), "--block-size");  // 0 (the default) is .npz
  // An .npz's zip bytes are no token ids (before: trained on them, exit 0).
  expect_one_line_failure(with({"--block-size", "8"}),
                          "--block-size 8 reads a token stream, and " + at("train.npz") + " is an .npz of arrays");
  expect_one_line_failure(with({"--workers", "2", "--min-workers", "3"}),
                          "--min-workers must be 0 (as many as --workers) or 1 to --workers 2, got 3");
  expect_one_line_failure(with({"--workers", "2", "--max-workers", "1"}),
                          "--max-workers must be 0 (as many as --workers) or at least --workers 2, got 1");
  // A job that may grow to --max-workers needs a step for each of them.
  expect_one_line_failure(with({"--batch-size", "32", "--max-workers", "4"}),
                          "has 64 samples, fewer than one step of --max-workers 4 × --batch-size 32 = 128");
  // Data too small for one step of workers × batch size: refused before
  // anything runs, not 0 steps, a made-up loss and a checkpoint.
  expect_one_line_failure(
      with({"--workers", "2", "--batch-size", "64"}),
      "--data " + at("train.npz") + " has 64 samples, fewer than one step of --workers 2 × --batch-size 64 = 128");
  expect_one_line_failure(with({"--workers", "2", "--batch-size", "16", "--accumulation", "4"}),
                          " has 64 samples, fewer than one step of --workers 2 × --batch-size 16 × --accumulation 4 = "
                          "128");
  // Every run above was refused before it began: none made --checkpoint-dir.
  EXPECT_FALSE(fs::exists(dir_ / "ckpt")) << "a refused run left an empty --checkpoint-dir";
  expect_one_line_failure(with({"--checkpoint-dir", at("train.npz")}),
                          "--checkpoint-dir " + at("train.npz") + " is a file, not a directory");
  // A directory that exists but takes no file: refused before training,
  // not at the first checkpoint (/sys/kernel refuses new files, root's too).
  if (fs::is_directory("/sys/kernel") && ::access("/sys/kernel", W_OK) != 0)
    expect_one_line_failure(with({"--checkpoint-dir", "/sys/kernel"}),
                            "--checkpoint-dir /sys/kernel takes no checkpoint");
  {
    std::ofstream tokens(dir_ / "tokens.bin", std::ios::binary);
    for (uint16_t t = 0; t < 20; ++t) tokens.write(reinterpret_cast<const char*>(&t), sizeof t);
  }
  expect_one_line_failure(with({"--data", at("tokens.bin"), "--block-size", "16", "--batch-size", "4"}),
                          "has 1 window of --block-size 16, fewer than one step of --workers 1 × --batch-size 4");
  std::ofstream(dir_ / "odd.bin", std::ios::binary) << "abc";  // not whole uint16 ids
  const Outcome odd = with({"--data", at("odd.bin"), "--block-size", "4"});
  expect_one_line_failure(odd, "raw token file '" + at("odd.bin") + "': 3 bytes");
  EXPECT_EQ(odd.output.find("npy file"), std::string::npos) << odd.output;
  // A directory is named as one.
  expect_one_line_failure(with({"--model", dir_.string()}), "--model " + dir_.string() + " is a directory");
  expect_one_line_failure(with({"--data", dir_.string()}), "--data " + dir_.string() + " is a directory");
  expect_one_line_failure(with({"--config", dir_.string()}), "job file " + dir_.string() + " is a directory");
  // The metrics file's open failure says why (a regular file as its parent).
  expect_one_line_failure(with({"--metrics", at("train.npz") + "/m.jsonl"}), "m.jsonl: Not a directory");
  std::ofstream(dir_ / "job.json") << R"({"epochs": 2, "learning_rate": 0.1})";
  expect_one_line_failure(with({"--config", at("job.json")}), "learning_rate");
  std::ofstream(dir_ / "job.yaml") << "epochs: 2\nbatch_size: many\n";
  expect_one_line_failure(with({"--config", at("job.yaml")}), "batch_size");
  // Job-file numbers: too large for a double, or not an integer where one
  // is due (nlohmann would read 1.5 and true as 1), name the file and key.
  std::ofstream(dir_ / "big.json") << R"({"epochs": 1e400})";
  expect_one_line_failure(with({"--config", at("big.json")}), "job file " + at("big.json") + ": number overflow");
  std::ofstream(dir_ / "half.json") << R"({"workers": 1.5})";
  expect_one_line_failure(with({"--config", at("half.json")}),
                          "job file " + at("half.json") + ": key 'workers' must be an integer, got 1.5");
  std::ofstream(dir_ / "bool.json") << R"({"epochs": true})";
  expect_one_line_failure(with({"--config", at("bool.json")}), "key 'epochs' must be an integer, got true");
  std::ofstream(dir_ / "opts.json") << R"({"model_options": {"hidden": 2.5}})";
  expect_one_line_failure(with({"--config", at("opts.json")}), "key 'model_options.hidden' must be an integer");
  std::ofstream(dir_ / "half.yaml") << "workers: 1.5\n";
  expect_one_line_failure(with({"--config", at("half.yaml")}), "half.yaml: key 'workers' must be an integer");
  std::ofstream(dir_ / "self.yaml") << "a: &x [*x]\n";
  expect_one_line_failure(with({"--config", at("self.yaml")}), "job file " + at("self.yaml") + ": YAML nested");
  // Ten lines that name 10^9 values: refused, not expanded until memory runs out.
  {
    std::ofstream bomb(dir_ / "bomb.yaml");
    for (int i = 0; i < 10; ++i) {
      const std::string item = i == 0 ? "x" : "*a" + std::to_string(i - 1);
      bomb << "a" << i << ": &a" << i << " [" << item;
      for (int k = 1; k < 10; ++k) bomb << ", " << item;
      bomb << "]\n";
    }
  }
  expect_one_line_failure(with({"--config", at("bomb.yaml")}), "bomb.yaml: YAML expands to more than 100000 values");
  // What a job file gave is named by its key, not by flags the command
  // never had ("--data … fewer than one step of --workers 2").
  std::ofstream(dir_ / "small.yaml") << "model: " << at("step.pt") << "\ndata: " << at("train.npz")
                                     << "\nworkers: 2\nbatch_size: 64\ncheckpoint_dir: " << at("ckpt") << "\n";
  const Outcome small = run({TROUPE_TRAIN, "--config", at("small.yaml")}, dir_ / "small.log");
  const std::string key = "job file " + at("small.yaml") + ": key ";
  expect_one_line_failure(small, key + "'data': " + at("train.npz") + " has 64 samples, fewer than one step of " + key +
                                     "'workers': 2 × " + key + "'batch_size': 64 = 128");
  EXPECT_EQ(small.output.find("--workers"), std::string::npos) << small.output;
  EXPECT_EQ(run({TROUPE_TRAIN, "--help"}, dir_ / "help.log").status, 0);

  expect_one_line_failure(with({"--momentum", "1"}), "--momentum must be a number in [0, 1), got 1");
  write_inputs(dir_, "nan", 64, 8);
  expect_one_line_failure(with({}), "its 'loss' is not finite (nan) on the first batch");
  write_inputs(dir_, "typo", 64, 8);
  expect_one_line_failure(with({}), "its summed_metrics names 'cnt', which forward does not return (it returns");
  write_inputs(dir_, "noloss", 64, 8);
  expect_one_line_failure(with({}), "loss");
  EXPECT_TRUE(troupe::test::eventually([] { return live_train_processes() == 0; }, 30s));
}

}  // namespace
