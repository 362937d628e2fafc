// `troupe torchrun` end to end, with real interpreters and real processes:
// the environment is torchrun's, output is rank-prefixed, a dead worker
// restarts the group (and a DDP script resumes from its own checkpoint),
// max_restarts exhausted is a non-zero exit, a killed node agent shrinks an
// elastic group, and bad input is one clear line with nothing left running.
// The parsing and the environment table are also checked without processes.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <regex>
#include <thread>

#include "launcher/stop_signals.h"
#include "launcher/torchrun_options.h"
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"
#include "tests/support/wait.h"
#include "troupe/runtime/core/files.h"

namespace fs = std::filesystem;
using troupe::test::eventually;
using troupe::test::kWaitBound;
namespace tl = troupe::launcher;

namespace {

const std::string kPython = "/usr/bin/python3";
const std::string kScripts = TROUPE_TORCHRUN_SCRIPTS;

struct CommandResult {
  int status = -1;
  std::string output;
  pid_t session = -1;
};

// A command started in a session of its own (so what it leaves running can
// be found), its stdout and stderr together in a pipe.
struct Started {
  pid_t pid = -1;
  int output = -1;  // the pipe's read end
};

Started start(const std::vector<std::string>& args) {
  int fds[2];
  EXPECT_EQ(::pipe(fds), 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::setsid();
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::close(fds[0]);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  return {pid, fds[0]};
}

// Reads the command's output to its end and reaps it; bounded by the ctest
// timeout.
CommandResult collect(Started c) {
  CommandResult r;
  r.session = c.pid;
  std::array<char, 4096> buf;
  ssize_t n;
  while ((n = ::read(c.output, buf.data(), buf.size())) > 0) r.output.append(buf.data(), size_t(n));
  ::close(c.output);
  int st = 0;
  ::waitpid(c.pid, &st, 0);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

CommandResult run(const std::vector<std::string>& args) { return collect(start(args)); }

// Reads the command's output into `seen` until it holds `what` (true), or
// the output ends or 120 s pass (false).
bool read_until(const Started& c, std::string& seen, const std::string& what) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  std::array<char, 4096> buf;
  while (seen.find(what) == std::string::npos) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    pollfd p{c.output, POLLIN, 0};
    if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) <= 0) return false;
    const ssize_t n = ::read(c.output, buf.data(), buf.size());
    if (n <= 0) return false;
    seen.append(buf.data(), size_t(n));
  }
  return true;
}

std::vector<std::string> torchrun(std::vector<std::string> args) {
  args.insert(args.begin(), {TROUPE_CLI, "torchrun"});
  return args;
}

// Processes still in session `sid` (the command's own session).
std::vector<pid_t> left_in_session(pid_t sid) {
  std::vector<pid_t> left;
  for (auto& e : fs::directory_iterator("/proc")) {
    std::string name = e.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string stat = troupe::test::read_proc_file(e.path() / "stat");
    auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    std::string state;
    long ppid = 0, pgrp = 0, session = 0;
    rest >> state >> ppid >> pgrp >> session;
    if (session == sid && state != "Z") left.push_back(std::stoi(name));
  }
  return left;
}

// A script's pid file: its pid and start time (see tests/support/process.h).
struct ScriptPid {
  pid_t pid = -1;
  long long started = -1;
};

ScriptPid read_pid(const fs::path& p) {
  std::ifstream f(p);
  ScriptPid s;
  f >> s.pid >> s.started;
  return s;
}

bool alive(const ScriptPid& s) { return !troupe::test::process_gone(s.pid, s.started); }

bool have_torch() {
  static bool yes = std::system((kPython + " -c 'import torch.distributed' 2>/dev/null").c_str()) == 0;
  return yes;
}

class TorchrunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = troupe::test::fresh_dir("torchrun");
    out_ = dir_ / "out";
    fs::create_directories(out_);
    session_ = dir_ / "session";
    fs::create_directories(session_);
    fs::permissions(session_, fs::perms::owner_all);
    setenv("TROUPE_SESSION_DIR", session_.c_str(), 1);
    unsetenv("TROUPE_TOKEN");
    unsetenv("OMP_NUM_THREADS");
  }
  void TearDown() override {
    run({TROUPE_CLI, "stop"});
    unsetenv("TROUPE_SESSION_DIR");
    troupe::core::remove_tree(dir_);
  }
  // A head (and its node) of this session with `resources`; its address,
  // "" when it did not start (said).
  std::string start_head(const std::string& resources) {
    auto head = run({TROUPE_CLI, "start", "--head", "--port", "0", "--resources", resources});
    EXPECT_EQ(head.status, 0) << head.output;
    std::ifstream af(session_ / "address");
    std::string address;
    af >> address;
    return address;
  }
  fs::path dir_, out_, session_;
};

nlohmann::json read_json(const fs::path& p) {
  std::ifstream f(p);
  return nlohmann::json::parse(f);
}

// Reaps the forked `child` and expects it to have exited 0.
void expect_clean_exit(pid_t child) {
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << (WIFSIGNALED(status) ? "killed by signal " + std::to_string(WTERMSIG(status))
                              : "exit " + std::to_string(WEXITSTATUS(status)));
}

}  // namespace

// A stop signal the kernel hands to a thread that existed before
// StopSignals (a BLAS library's pool, which does not block it) is taken as
// a stop request: its default action used to kill `troupe train` on the
// spot, without the checkpoint. In a child process, which such a failure
// kills alone.
TEST(StopSignalsTest, ASignalToAThreadThatWasThereBeforeIsTakenNotFatal) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::thread early([&] {
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return done; });
    });
    int code = 3;
    {
      troupe::launcher::StopSignals stop("test", "stopping");
      ::pthread_kill(early.native_handle(), SIGTERM);
      for (int i = 0; i < 6000 && !stop.requested(); ++i) ::usleep(10000);  // a bounded poll of its state
      code = stop.requested() ? 0 : 4;
    }
    {
      std::lock_guard lock(mu);
      done = true;
    }
    cv.notify_all();
    early.join();
    ::_exit(code);
  }
  expect_clean_exit(child);
}

// `timeout` and batch systems send SIGTERM to the process and then to its
// group: the same signal again at once is one request, not "stop now" (which
// used to end `troupe torchrun` under `timeout` without its ranks' exits).
TEST(StopSignalsTest, TheSameSignalTwiceAtOnceIsOneRequest) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    int code = 3;
    {
      troupe::launcher::StopSignals stop("test", "stopping");
      ::kill(::getpid(), SIGTERM);
      for (int i = 0; i < 6000 && !stop.requested(); ++i) ::usleep(10000);  // a bounded poll of its state
      ::kill(::getpid(), SIGTERM);
      for (int i = 0; i < 6000 && stop.repeats() == 0; ++i) ::usleep(10000);
      code = stop.requested() && stop.repeats() == 1 ? 0 : 4;
    }
    ::_exit(code);
  }
  expect_clean_exit(child);
}

// A terminal's Ctrl-C reaches a Python driver and troupe-train alike, and
// TrainJob passes its KeyboardInterrupt on as SIGTERM: one request, not
// "stop now" (which ended the job without its checkpoint: probe 28b). And
// a pipe's reader killed by that Ctrl-C (`| tee log`) ends nothing: the
// write fails, the process goes on to stop in order. Before a stop a
// broken pipe still ends it (`| head`), and after it as before.
TEST(StopSignalsTest, SigtermAtOnceAfterSigintIsOneRequestAndABrokenPipeEndsNothing) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::signal(SIGPIPE, SIG_DFL);
    auto pipe_ignored = [] {
      struct sigaction now {};
      return ::sigaction(SIGPIPE, nullptr, &now) == 0 && now.sa_handler == SIG_IGN;
    };
    int code = 3;
    {
      troupe::launcher::StopSignals stop("test", "stopping");
      const bool default_before = !pipe_ignored();
      ::kill(::getpid(), SIGINT);
      for (int i = 0; i < 6000 && !stop.requested(); ++i) ::usleep(10000);  // a bounded poll of its state
      ::kill(::getpid(), SIGTERM);
      for (int i = 0; i < 6000 && stop.repeats() == 0; ++i) ::usleep(10000);
      int p[2];
      const bool piped = ::pipe(p) == 0;
      if (piped) ::close(p[0]);
      const bool broken = piped && ::write(p[1], "x", 1) < 0 && errno == EPIPE;
      code = default_before && stop.signal() == SIGINT && stop.repeats() == 1 && broken ? 0 : 4;
    }
    if (code == 0 && pipe_ignored()) code = 5;  // the default back with the scope's end
    ::_exit(code);
  }
  expect_clean_exit(child);
}

TEST(TorchrunOptions, TorchrunSpellingsAndScriptArguments) {
  auto o = tl::parse_torchrun_args({"--nproc_per_node=3", "--nnodes", "1:4", "--max-restarts", "2", "--standalone",
                                    "--run_id", "job7", "train.py", "--lr", "0.1", "--nnodes", "x"});
  EXPECT_EQ(o.nproc_per_node, 3);
  EXPECT_EQ(o.min_nodes, 1);
  EXPECT_EQ(o.max_nodes, 4);
  EXPECT_EQ(o.max_restarts, 2);
  EXPECT_EQ(o.run_id, "job7");
  EXPECT_EQ(o.script, "train.py");
  EXPECT_EQ(o.script_args, (std::vector<std::string>{"--lr", "0.1", "--nnodes", "x"}));
  EXPECT_EQ(tl::parse_nnodes("2"), std::make_pair(2, 2));
  EXPECT_TRUE(tl::parse_torchrun_args({"-m", "pkg.train"}).module);
  auto warm = tl::parse_torchrun_args({"a.py"});
  EXPECT_FALSE(warm.cold_restarts);
  EXPECT_EQ(warm.preload, (std::vector<std::string>{"torch", "torch.distributed", "torch.nn.parallel"}));
  auto cold = tl::parse_torchrun_args({"--cold-restarts", "--preload=numpy,my_pkg.models", "a.py"});
  EXPECT_TRUE(cold.cold_restarts);
  EXPECT_EQ(cold.preload, (std::vector<std::string>{"numpy", "my_pkg.models"}));
  EXPECT_TRUE(tl::parse_torchrun_args({"--preload", "", "a.py"}).preload.empty());
  // The command line of a multi-node guide runs as it is: what troupe does
  // its own way is accepted and named as ignored.
  auto guide = tl::parse_torchrun_args({"--nnodes=1", "--nproc_per_node=2", "--rdzv_backend=c10d",
                                        "--rdzv_endpoint=localhost:29400", "--master-port", "29500", "--node_rank=0",
                                        "--tee", "3", "train.py"});
  EXPECT_EQ(guide.nproc_per_node, 2);
  EXPECT_EQ(guide.ignored, (std::vector<std::string>{"--rdzv_backend c10d", "--rdzv_endpoint localhost:29400",
                                                     "--master-port 29500", "--tee 3"}));
  // One-letter options with their values attached, as torchrun's argparse
  // takes them.
  auto attached = tl::parse_torchrun_args({"-r3", "-t", "3", "-m", "pkg.train"});
  EXPECT_EQ(attached.ignored, (std::vector<std::string>{"-r 3", "-t 3"}));
  EXPECT_TRUE(attached.module);
  EXPECT_THROW(tl::parse_torchrun_args({"-x3", "a.py"}), tl::TorchrunUsageError);
  // A malformed --address is usage (exit 2) like any other bad flag; it
  // failed later, with exit 1 (probe 15a).
  EXPECT_THROW(tl::parse_torchrun_args({"--address", "nonsense", "a.py"}), tl::TorchrunUsageError);
  EXPECT_THROW(tl::parse_torchrun_args({"--address", "127.0.0.1", "a.py"}), tl::TorchrunUsageError);
  EXPECT_EQ(tl::parse_torchrun_args({"--address", "auto", "a.py"}).address, "auto");
  EXPECT_EQ(tl::parse_torchrun_args({"--address", "127.0.0.1:6380", "a.py"}).address, "127.0.0.1:6380");
  // torchrun's PET_* variables are its options' defaults; the command line wins.
  const std::map<std::string, std::string> pet = {{"PET_NPROC_PER_NODE", "3"}, {"PET_MAX_RESTARTS", "2"}};
  const auto lookup = [&](const char* name) -> const char* {
    auto it = pet.find(name);
    return it == pet.end() ? nullptr : it->second.c_str();
  };
  auto from_env = tl::parse_torchrun_args({"a.py"}, lookup);
  EXPECT_EQ(from_env.nproc_per_node, 3);
  EXPECT_EQ(from_env.max_restarts, 2);
  EXPECT_EQ(tl::parse_torchrun_args({"--nproc-per-node", "1", "a.py"}, lookup).nproc_per_node, 1);
  // A bad value the command line overrides is never read; one it does not is named.
  const auto bad = [](const char* name) -> const char* { return std::string(name) == "PET_NODE_RANK" ? "x" : nullptr; };
  EXPECT_EQ(tl::parse_torchrun_args({"--node_rank=0", "a.py"}, bad).script, "a.py");
  // Any spelling of an option is the command line's: --run-id is --rdzv_id
  // (PET_RDZV_ID overrode it); and a bad PET_NNODES is named as itself, not
  // as a --nnodes nobody gave.
  const auto rdzv = [](const char* name) -> const char* {
    const std::string n = name;
    return n == "PET_RDZV_ID" ? "envid" : n == "PET_NNODES" ? "3:1" : nullptr;
  };
  EXPECT_EQ(tl::parse_torchrun_args({"--run-id", "job7", "--nnodes", "1", "a.py"}, rdzv).run_id, "job7");
  EXPECT_EQ(tl::parse_torchrun_args({"--run_id=job8", "--nnodes=1", "a.py"}, rdzv).run_id, "job8");
  try {
    tl::parse_torchrun_args({"a.py"}, rdzv);
    ADD_FAILURE() << "PET_NNODES=3:1 was accepted";
  } catch (const tl::TorchrunUsageError& e) {
    EXPECT_NE(std::string(e.what()).find("PET_NNODES 3:1: MIN is above MAX"), std::string::npos) << e.what();
  }
  try {
    tl::parse_torchrun_args({"a.py"}, bad);
    ADD_FAILURE() << "PET_NODE_RANK=x was accepted";
  } catch (const tl::TorchrunUsageError& e) {
    EXPECT_NE(std::string(e.what()).find("PET_NODE_RANK"), std::string::npos) << e.what();
  }
  auto words = [](const std::string& word, int cpus, int gpus, const std::string& address = "") {
    auto o = tl::parse_torchrun_args({"--nproc-per-node", word, "a.py"});
    o.address = address;
    tl::resolve_nproc(o, cpus, gpus);
    return o.nproc_per_node;
  };
  EXPECT_EQ(words("cpu", 16, 2), 16);
  EXPECT_EQ(words("gpu", 16, 2), 2);
  EXPECT_EQ(words("auto", 16, 2), 2);
  EXPECT_EQ(words("auto", 16, 0), 16);
  EXPECT_THROW(words("gpu", 16, 0), tl::TorchrunUsageError);
  EXPECT_THROW(words("auto", 16, 2, "head:6380"), tl::TorchrunUsageError);
}

TEST(TorchrunOptions, BadValuesNameThemselves) {
  auto message = [](std::vector<std::string> args) {
    try {
      tl::parse_torchrun_args(args);
    } catch (const tl::TorchrunUsageError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message({"--nnodes", "3:1", "a.py"}).find("--nnodes 3:1: MIN is above MAX"), std::string::npos);
  EXPECT_NE(message({"--nnodes", "x", "a.py"}).find("--nnodes x"), std::string::npos);
  EXPECT_NE(message({"--nnodes", "0:2", "a.py"}).find("--nnodes 0:2"), std::string::npos);
  EXPECT_NE(message({"--nproc-per-node", "0", "a.py"}).find("--nproc-per-node 0"), std::string::npos);
  EXPECT_NE(message({"--nproc_per_node=abc", "a.py"}).find("--nproc_per_node abc"), std::string::npos);
  EXPECT_NE(message({"--max-restarts", "-1", "a.py"}).find("--max-restarts -1"), std::string::npos);
  EXPECT_NE(message({"--frobnicate", "a.py"}).find("unknown option --frobnicate"), std::string::npos);
  EXPECT_NE(message({"--nproc-per-node"}).find("needs a value"), std::string::npos);
  EXPECT_NE(message({}).find("give the training script"), std::string::npos);
  EXPECT_NE(message({"--preload", "torch,,numpy", "a.py"}).find("--preload torch,,numpy: '' is not a module name"),
            std::string::npos);
  EXPECT_NE(message({"--preload", "os;rm", "a.py"}).find("'os;rm' is not a module name"), std::string::npos);
  // A part that begins with a digit is no Python identifier either.
  EXPECT_NE(message({"--preload", "1bad", "a.py"}).find("'1bad' is not a module name"), std::string::npos);
  EXPECT_NE(message({"--preload", "torch.2d", "a.py"}).find("'torch.2d' is not a module name"), std::string::npos);
  EXPECT_NE(message({"--preload", "torch..nn", "a.py"}).find("'torch..nn' is not a module name"), std::string::npos);
  EXPECT_EQ(message({"--preload", "torch,torch.nn,_x1.y2", "a.py"}), "accepted");
  EXPECT_NE(message({"--node_rank=1", "a.py"}).find("run it once, on one machine"), std::string::npos);
  EXPECT_NE(message({"--local-ranks-filter", "0,x", "a.py"}).find("--local-ranks-filter 0,x: expected local ranks"),
            std::string::npos);
  EXPECT_NE(message({"--local_ranks_filter="}).find("--local_ranks_filter \"\": expected local ranks"),
            std::string::npos);
  EXPECT_NE(message({"--no-python", "-m", "pkg.train"}).find("--no-python and -m cannot be combined"),
            std::string::npos);
  EXPECT_NE(message({"--ship-exclude", "*.pt", "a.py"}).find("--ship-exclude leaves files out of what"),
            std::string::npos);
  EXPECT_NE(message({"--ship-working-dir", "--ship-exclude=,", "a.py"}).find("--ship-exclude \"\""), std::string::npos);
}

TEST(TorchrunOptions, ShippingTheWorkingDirectory) {
  auto o = tl::parse_torchrun_args(
      {"--ship-working-dir", "--ship-exclude", "*.pt,data/", "--ship-exclude=outputs", "train.py", "--ship-exclude"});
  EXPECT_TRUE(o.ship_working_dir);
  EXPECT_EQ(o.ship_excludes, (std::vector<std::string>{"*.pt", "data/", "outputs"}));
  EXPECT_EQ(o.script_args, (std::vector<std::string>{"--ship-exclude"}));  // the script's own
  EXPECT_FALSE(tl::parse_torchrun_args({"train.py"}).ship_working_dir);
}

TEST(TorchrunOptions, ProgramsFiltersAndStartMethods) {
  auto o = tl::parse_torchrun_args({"--no_python", "--local_ranks_filter=1,0,1", "--start-method", "fork", "--run-path",
                                    "./train.sh", "--epochs", "2"});
  EXPECT_TRUE(o.no_python);
  EXPECT_EQ(o.local_ranks_filter, (std::vector<int>{1, 0}));
  EXPECT_EQ(o.ignored, (std::vector<std::string>{"--start-method fork", "--run-path"}));
  EXPECT_EQ(o.script, "./train.sh");
  EXPECT_EQ(o.script_args, (std::vector<std::string>{"--epochs", "2"}));
  EXPECT_TRUE(tl::parse_torchrun_args({"a.py"}).local_ranks_filter.empty());
  // The default run id is a version-4 UUID, as torchrun --standalone's.
  for (int i = 0; i < 20; ++i) {
    const std::string id = tl::random_run_id();
    EXPECT_TRUE(std::regex_match(id, std::regex("[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")))
        << id;
  }
}

TEST(TorchrunOptions, EnvironmentIsTorchrunsTable) {
  tl::RankPlace p{5, 1, 2, 2, 3};
  tl::AttemptEnv a{4, 7, "job", "10.0.0.1", 29500, "1", "1"};
  auto env = tl::torchrun_env(p, a);
  std::vector<std::string> want = {"LOCAL_RANK=1",
                                   "RANK=5",
                                   "GROUP_RANK=2",
                                   "ROLE_RANK=5",
                                   "ROLE_NAME=default",
                                   "LOCAL_WORLD_SIZE=2",
                                   "WORLD_SIZE=6",
                                   "GROUP_WORLD_SIZE=3",
                                   "ROLE_WORLD_SIZE=6",
                                   "MASTER_ADDR=10.0.0.1",
                                   "MASTER_PORT=29500",
                                   "TORCHELASTIC_RESTART_COUNT=4",
                                   "TORCHELASTIC_MAX_RESTARTS=7",
                                   "TORCHELASTIC_RUN_ID=job",
                                   "TORCHELASTIC_USE_AGENT_STORE=False",
                                   "NCCL_ASYNC_ERROR_HANDLING=1",
                                   "TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
                                   "OMP_NUM_THREADS=1"};
  EXPECT_EQ(env, want);
}

// The ranks take the driver's environment (torchrun's workers inherit
// their launcher's), but for what describes the driver's own host, login,
// batch system or launcher, and for torchrun's own variables, which win.
TEST(TorchrunOptions, RanksTakeTheDriversEnvironmentButItsHostsAndTorchrunsOwn) {
  const std::vector<std::string> driver = {"NCCL_DEBUG=INFO",
                                           "PYTHONPATH=/src:/lib",
                                           "MYVAR=a=b",
                                           "PATH=/driver/bin",
                                           "HOME=/home/driver",
                                           "SLURM_PROCID=7",
                                           "SSH_CONNECTION=1 2 3 4",
                                           "TROUPE_TOKEN=secret",
                                           "RANK=9",
                                           "OMP_NUM_THREADS=4",
                                           "CUDA_VISIBLE_DEVICES=3",
                                           "TORCHELASTIC_ERROR_FILE=/tmp/x",
                                           "NOEQUALS"};
  const auto env = tl::rank_environment(driver, {"RANK=0", "OMP_NUM_THREADS=4", "CUDA_VISIBLE_DEVICES=0"});
  const std::vector<std::string> want = {"NCCL_DEBUG=INFO", "PYTHONPATH=/src:/lib", "MYVAR=a=b",
                                         "RANK=0",          "OMP_NUM_THREADS=4",    "CUDA_VISIBLE_DEVICES=0"};
  EXPECT_EQ(env, want);
  EXPECT_FALSE(tl::kept_from_node("NCCL_SOCKET_IFNAME"));
  EXPECT_TRUE(tl::kept_from_node("SLURM_LOCALID"));
}

// On a cluster (--address) a rank is the node agent's child: the driver's
// variables reach it only because troupe torchrun sends them.
TEST_F(TorchrunTest, OnAClusterRanksTakeTheDriversEnvironment) {
  const std::string address = start_head("CPU=2,GPU=0");
  ASSERT_FALSE(address.empty());
  const std::string node_path = std::getenv("PATH");
  setenv("DRIVER_ONLY_TEST_VAR", "from the driver", 1);
  setenv("SLURM_PROCID", "7", 1);
  setenv("PATH", (node_path + ":/troupe-driver-only").c_str(), 1);
  auto r = run(torchrun({"--address", address, "--nproc-per-node", "1", "--run-id", "envcluster", "--python", kPython,
                         kScripts + "/env_dump.py", out_.string()}));
  setenv("PATH", node_path.c_str(), 1);
  unsetenv("SLURM_PROCID");
  unsetenv("DRIVER_ONLY_TEST_VAR");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto env = read_json(out_ / "env-0-0.json")["env"];
  EXPECT_EQ(env.value("DRIVER_ONLY_TEST_VAR", ""), "from the driver") << env;
  // The node's own value, if it has one (this suite run under Slurm),
  // not the driver's.
  EXPECT_NE(env.value("SLURM_PROCID", ""), "7") << env;
  EXPECT_EQ(env.value("PATH", "").find("/troupe-driver-only"), std::string::npos) << env;
  EXPECT_EQ(env.value("RANK", ""), "0");
}

// GPU slots of an agent started with CUDA_VISIBLE_DEVICES=5,7 give their
// ranks those devices, not the node's numbers 0 and 1 (which named the
// host's first GPUs, another agent's perhaps).
TEST_F(TorchrunTest, GpuRanksGetTheAgentsOwnDevices) {
  setenv("CUDA_VISIBLE_DEVICES", "5,7", 1);
  const std::string address = start_head("CPU=2,GPU=2");
  unsetenv("CUDA_VISIBLE_DEVICES");
  ASSERT_FALSE(address.empty());
  auto r = run(torchrun({"--address", address, "--nproc-per-node", "2", "--run-id", "gpus", "--python", kPython,
                         kScripts + "/env_dump.py", out_.string()}));
  ASSERT_EQ(r.status, 0) << r.output;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string list =
        read_json(out_ / ("env-" + std::to_string(rank) + "-0.json"))["env"].value("CUDA_VISIBLE_DEVICES", "<unset>");
    EXPECT_TRUE(list == "5,7" || list == "7,5") << "rank " << rank << ": " << list;
  }
}

TEST_F(TorchrunTest, EnvironmentIsTorchrunsAndOutputIsRankPrefixed) {
  // A setting troupe keeps for its workers (clean_environment) is not the
  // ranks': it reached every one.
  setenv("TROUPE_LOG_MAX_BYTES", "1000000", 1);
  auto r = run(torchrun(
      {"--nproc-per-node", "2", "--run-id", "envtest", "--python", kPython, kScripts + "/env_dump.py", out_.string()}));
  unsetenv("TROUPE_LOG_MAX_BYTES");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("[default0]:hello from 0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[default1]:hello from 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[default1]:oops from 1"), std::string::npos) << r.output;
  // The embedded cluster's node agent goes with its head: no warning of it.
  EXPECT_EQ(r.output.find("is dead"), std::string::npos) << r.output;
  std::string port;
  for (int rank = 0; rank < 2; ++rank) {
    auto j = read_json(out_ / ("env-" + std::to_string(rank) + "-0.json"));
    auto env = j["env"].get<std::map<std::string, std::string>>();
    std::map<std::string, std::string> want = {{"LOCAL_RANK", std::to_string(rank)},
                                               {"RANK", std::to_string(rank)},
                                               {"GROUP_RANK", "0"},
                                               {"ROLE_RANK", std::to_string(rank)},
                                               {"ROLE_NAME", "default"},
                                               {"LOCAL_WORLD_SIZE", "2"},
                                               {"WORLD_SIZE", "2"},
                                               {"GROUP_WORLD_SIZE", "1"},
                                               {"ROLE_WORLD_SIZE", "2"},
                                               {"MASTER_ADDR", "127.0.0.1"},
                                               {"TORCHELASTIC_RESTART_COUNT", "0"},
                                               {"TORCHELASTIC_MAX_RESTARTS", "0"},
                                               {"TORCHELASTIC_RUN_ID", "envtest"},
                                               {"TORCHELASTIC_USE_AGENT_STORE", "False"},
                                               {"NCCL_ASYNC_ERROR_HANDLING", "1"},
                                               {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"},
                                               {"OMP_NUM_THREADS", "1"}};
    for (auto& [k, v] : want) EXPECT_EQ(env[k], v) << k << " of rank " << rank;
    EXPECT_TRUE(env.count("CUDA_VISIBLE_DEVICES")) << "rank " << rank;
    EXPECT_FALSE(env["TORCHELASTIC_ERROR_FILE"].empty());
    int p = std::stoi(env["MASTER_PORT"]);
    EXPECT_GT(p, 0);
    // Outside the ephemeral range, which any outgoing connect may take
    // before rank 0 binds it (an attempt failed with EADDRINUSE).
    std::ifstream range_file("/proc/sys/net/ipv4/ip_local_port_range");
    int lo = 0, hi = 0;
    if (range_file >> lo >> hi && (lo > 10000 || hi < 65535)) {
      EXPECT_TRUE(p < lo || p > hi) << p << " is in [" << lo << ", " << hi << "]";
    }
    if (rank == 0) port = env["MASTER_PORT"];
    EXPECT_EQ(env["MASTER_PORT"], port);
    for (auto& [k, v] : env) EXPECT_NE(k.rfind("TROUPE_", 0), 0u) << "leaked " << k;
    EXPECT_EQ(j["cwd"].get<std::string>(), fs::current_path().string());
  }
  EXPECT_TRUE(left_in_session(r.session).empty());
}

// A progress bar redrawn with '\r' (tqdm) shows while it runs: its frame
// reaches the launcher's output before the script ends its line, as a
// rank-prefixed line, and the finished bar is one line with its last frame;
// no raw '\r' gets through. It used to show nothing until the bar's '\n',
// then every frame run together after one prefix.
TEST_F(TorchrunTest, AProgressBarShowsWhileItRunsAsPrefixedLines) {
  Started c =
      start(torchrun({"--nproc-per-node", "1", "--python", kPython, kScripts + "/progress_bar.py", out_.string()}));
  std::string early;
  const bool shown = read_until(c, early, "[default0]:training   0/3\n");
  std::ofstream(out_ / "go") << "go";
  CommandResult r = collect(c);
  r.output = early + r.output;
  ASSERT_TRUE(shown) << r.output;
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("[default0]:training   3/3\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[default0]:finished\n"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find('\r'), std::string::npos) << r.output;
}

// torchrun's --no-python runs a program that is not Python as each rank,
// with the same environment; --local-ranks-filter prints only the ranks
// named (the others' output is read and dropped, so they still finish).
TEST_F(TorchrunTest, NoPythonRunsAProgramAndTheFilterPrintsTheRanksNamed) {
  auto r = run(torchrun(
      {"--nproc-per-node", "2", "--no-python", "--local-ranks-filter", "1", kScripts + "/rank_echo.sh", "a", "b"}));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("[default1]:rank 1 of 2, local rank 1, args a b\n"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("[default0]:"), std::string::npos) << r.output;
  EXPECT_TRUE(left_in_session(r.session).empty());
}

// A line longer than one output message carries (64 KiB) is printed as
// one line with one prefix, and two ranks' long lines do not mix. It used
// to come out as several lines, each with the rank's prefix.
TEST_F(TorchrunTest, ALineLongerThanAMessageIsPrintedWhole) {
  auto r = run(torchrun({"--nproc-per-node", "2", "--no-python", kScripts + "/long_line.sh"}));
  ASSERT_EQ(r.status, 0) << r.output.substr(0, 2000);
  for (const char* rank : {"0", "1"})
    EXPECT_NE(r.output.find(std::string("[default") + rank + "]:" + std::string(200000, 'x') + " rank " + rank + "\n"),
              std::string::npos)
        << rank << ": " << r.output.size() << " bytes";
  size_t prefixes = 0;
  for (size_t at = 0; (at = r.output.find("[default", at)) != std::string::npos; ++at) ++prefixes;
  EXPECT_EQ(prefixes, 2u) << r.output.size() << " bytes";
}

// Output a rank leaves unfinished at its end, exactly a message's worth
// (64 KiB) long, is printed: its pieces waited for a rest of the line that
// never came, and were dropped with the stream.
TEST_F(TorchrunTest, AnUnfinishedLastLineOfExactlyAMessageIsPrinted) {
  auto r = run(torchrun({"--nproc-per-node", "1", "--no-python", kScripts + "/exact_block.sh"}));
  ASSERT_EQ(r.status, 0) << r.output.substr(0, 2000);
  EXPECT_NE(r.output.find("[default0]:" + std::string(65536, 'x') + "\n"), std::string::npos)
      << r.output.size() << " bytes";
}

// A --python given as a path is the driver's, as the script's path is: a
// node agent started in another directory looked it up in its own ("an
// interpreter venv/bin/python not found", or another venv's interpreter).
TEST_F(TorchrunTest, ARelativePythonIsTheDriversPath) {
  const std::string address = start_head("CPU=2,GPU=0");
  ASSERT_FALSE(address.empty());
  fs::create_directories(dir_ / "venv" / "bin");
  fs::create_symlink(kPython, dir_ / "venv" / "bin" / "python");
  const auto here = fs::current_path();
  fs::current_path(dir_);
  auto r = run(torchrun({"--address", address, "--nproc-per-node", "1", "--python", "venv/bin/python",
                         kScripts + "/env_dump.py", out_.string()}));
  fs::current_path(here);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(fs::exists(out_ / "env-0-0.json")) << r.output;
}

TEST_F(TorchrunTest, MaxRestartsExhaustedExitsNonZeroAndStopsEveryScript) {
  auto r = run(torchrun({"--nproc-per-node", "2", "--max-restarts", "1", "--python", kPython,
                         kScripts + "/fail_rank1.py", out_.string()}));
  EXPECT_EQ(r.status, 3) << r.output;
  EXPECT_NE(r.output.find("rank 1 exited with code 3; restarting the group (restart 1/1)"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("no restarts left (--max-restarts 1)"), std::string::npos) << r.output;
  for (auto attempt : {"0", "1"})
    for (auto rank : {"0", "1"}) {
      ScriptPid script = read_pid(out_ / (std::string("pid-") + rank + "-" + attempt));
      // Rank 1 fails at once, so the group may be stopped before rank 0's
      // interpreter got to write its pid (a loaded machine): nothing of it
      // can outlive the run then. Rank 1 ran in each attempt.
      if (std::string(rank) == "0" && script.pid <= 0) continue;
      ASSERT_GT(script.pid, 0) << "rank " << rank << " attempt " << attempt << " never ran";
      EXPECT_TRUE(eventually([&] { return !alive(script); })) << "script " << script.pid << " outlived troupe torchrun";
    }
  EXPECT_TRUE(left_in_session(r.session).empty());
}

// Both ranks of save_on_sigterm.py have their handler in place (bounded).
bool both_ranks_wait(const fs::path& out) {
  return eventually([&] { return read_pid(out / "pid-0").pid > 0 && read_pid(out / "pid-1").pid > 0; });
}

// Each rank of save_on_sigterm.py saved on the launcher's SIGTERM, and
// nothing of the run is left.
void expect_every_rank_saved(const fs::path& out, const CommandResult& r, int signal = SIGTERM) {
  for (auto rank : {"0", "1"}) {
    std::ifstream saved(out / (std::string("saved-") + rank));
    std::string line;
    std::getline(saved, line);
    EXPECT_EQ(line, std::string("rank ") + rank + " saved on signal " + std::to_string(signal)) << r.output;
  }
  EXPECT_TRUE(eventually([&] { return left_in_session(r.session).empty(); }));
}

// SIGTERM to troupe torchrun (a batch system's time limit, a preemption)
// reaches every script as torchrun's does, so one that saves its state on
// SIGTERM gets to; the command then exits 143 without restarting the group
// and leaves nothing running. It used to die at once and its scripts were
// killed without a chance to save.
TEST_F(TorchrunTest, SigtermReachesEveryScriptAndNothingRestarts) {
  Started c = start(torchrun({"--nproc-per-node", "2", "--max-restarts", "3", "--python", kPython,
                              kScripts + "/save_on_sigterm.py", out_.string()}));
  const bool running = both_ranks_wait(out_);
  if (running) ::kill(c.pid, SIGTERM);
  CommandResult r = collect(c);
  ASSERT_TRUE(running) << r.output;
  EXPECT_EQ(r.status, 128 + SIGTERM) << r.output;
  EXPECT_NE(r.output.find("stopped every rank on SIGTERM"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("restarting"), std::string::npos) << r.output;
  expect_every_rank_saved(out_, r);
}

// A closed ssh session's SIGHUP (and SIGQUIT) stops the job as SIGTERM
// does, as torchrun takes all four: it killed the launcher at once, and
// the ranks were SIGKILLed without their SIGTERM.
TEST_F(TorchrunTest, SighupReachesEveryScriptAsSigtermDoes) {
  Started c = start(torchrun({"--nproc-per-node", "2", "--max-restarts", "3", "--python", kPython,
                              kScripts + "/save_on_sigterm.py", out_.string()}));
  const bool running = both_ranks_wait(out_);
  if (running) ::kill(c.pid, SIGHUP);
  CommandResult r = collect(c);
  ASSERT_TRUE(running) << r.output;
  EXPECT_EQ(r.status, 128 + SIGHUP) << r.output;
  EXPECT_NE(r.output.find("stopped every rank on SIGHUP"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("restarting"), std::string::npos) << r.output;
  expect_every_rank_saved(out_, r);
}

// Ctrl-C in a terminal sends SIGINT to the whole foreground process
// group, `timeout` and batch systems a group SIGTERM: the workers that
// host the ranks' slots used to share the launcher's group and die of it,
// so their scripts were SIGKILLed before the launcher's SIGTERM came and
// nothing was saved. Workers have groups of their own now. The scripts
// get Ctrl-C's SIGINT, as under torchrun, so `except KeyboardInterrupt`
// runs (they got SIGTERM, and such a handler never ran).
TEST_F(TorchrunTest, CtrlCToTheProcessGroupStillLetsEveryScriptSave) {
  Started c = start(torchrun({"--nproc-per-node", "2", "--max-restarts", "3", "--python", kPython,
                              kScripts + "/save_on_sigterm.py", out_.string()}));
  const bool running = both_ranks_wait(out_);
  if (running) ::kill(-c.pid, SIGINT);  // start() made the launcher a group leader
  CommandResult r = collect(c);
  ASSERT_TRUE(running) << r.output;
  EXPECT_EQ(r.status, 128 + SIGINT) << r.output;
  EXPECT_EQ(r.output.find("restarting"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("lost its slot"), std::string::npos) << r.output;
  expect_every_rank_saved(out_, r, SIGINT);
}

// Processes whose environment carries TORCHELASTIC_RUN_ID=`run_id` (the
// scripts of that run and their spare interpreters).
std::vector<pid_t> processes_of_run(const std::string& run_id) {
  std::vector<pid_t> found;
  const std::string needle = "TORCHELASTIC_RUN_ID=" + run_id;
  for (auto& e : fs::directory_iterator("/proc")) {
    std::string name = e.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string env = troupe::test::read_proc_file(e.path() / "environ");
    for (size_t at = env.find(needle); at != std::string::npos; at = env.find(needle, at + 1))
      if ((at == 0 || env[at - 1] == '\0') && (at + needle.size() == env.size() || env[at + needle.size()] == '\0')) {
        found.push_back(std::stoi(name));
        break;
      }
  }
  return found;
}

TEST_F(TorchrunTest, RestartRunsInASpareInterpreterThatPreloaded) {
  // The spare starts with its script (no delay), so it is there, its
  // import done or under way, when rank 1 fails at once.
  setenv("TROUPE_TORCHRUN_SPARE_DELAY_MS", "0", 1);
  // Bytes that are not UTF-8 reach the spare's script as they reach a
  // fresh one (they arrived as U+FFFD).
  setenv("WARM_TEST_BYTES", "caf\xe9", 1);
  const std::string run_id = "warm-" + std::to_string(::getpid());
  auto r = run(torchrun({"--nproc-per-node", "2", "--max-restarts", "1", "--python", kPython, "--run-id", run_id,
                         "--preload", "email.mime.text", kScripts + "/warm_restart.py", out_.string(), "caf\xe9"}));
  unsetenv("WARM_TEST_BYTES");
  unsetenv("TROUPE_TORCHRUN_SPARE_DELAY_MS");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("rank 1 exited with code 3; restarting the group (restart 1/1)"), std::string::npos)
      << r.output;
  auto first = read_json(out_ / "warm-1-0.json");
  EXPECT_FALSE(first["preloaded"].get<bool>()) << first;  // a fresh interpreter
  EXPECT_EQ(first["argv_hex"], (nlohmann::json{"636166e9"})) << first;
  EXPECT_EQ(first["env_hex"], "636166e9") << first;
  for (auto rank : {"0", "1"}) {
    auto w = read_json(out_ / (std::string("warm-") + rank + "-1.json"));
    EXPECT_TRUE(w["preloaded"].get<bool>()) << "rank " << rank << ": " << w;
    EXPECT_EQ(w["name"], "__main__") << w;
    EXPECT_EQ(w["argv"], (nlohmann::json{kScripts + "/warm_restart.py", out_.string()})) << w;
    EXPECT_EQ(w["argv_hex"], (nlohmann::json{"636166e9"})) << w;
    EXPECT_EQ(w["env_hex"], "636166e9") << w;
    EXPECT_EQ(w["path0"], fs::canonical(kScripts).string()) << w;
    EXPECT_EQ(w["cwd"], fs::current_path().string()) << w;
    EXPECT_TRUE(w["troupe_vars"].empty()) << w;
    EXPECT_EQ(w["world_size"], "2") << w;
    EXPECT_NE(w["error_file"], "") << w;
  }
  EXPECT_NE(read_json(out_ / "warm-1-1.json")["pid"], first["pid"]);
  // Nothing of the run outlives it: not its scripts, not the spares made
  // for a restart that never came.
  EXPECT_TRUE(eventually([&] { return processes_of_run(run_id).empty(); }))
      << "left running: " << processes_of_run(run_id).size() << " process(es)";
}

TEST_F(TorchrunTest, ColdRestartsStartEveryAttemptInAFreshInterpreter) {
  setenv("TROUPE_TORCHRUN_SPARE_DELAY_MS", "0", 1);
  auto r = run(torchrun({"--nproc-per-node", "2", "--max-restarts", "1", "--python", kPython, "--cold-restarts",
                         "--preload", "email.mime.text", kScripts + "/warm_restart.py", out_.string()}));
  unsetenv("TROUPE_TORCHRUN_SPARE_DELAY_MS");
  ASSERT_EQ(r.status, 0) << r.output;
  for (auto rank : {"0", "1"}) {
    auto w = read_json(out_ / (std::string("warm-") + rank + "-1.json"));
    EXPECT_FALSE(w["preloaded"].get<bool>()) << "rank " << rank << ": " << w;
  }
}

TEST_F(TorchrunTest, KilledWorkerRestartsTheGroupWhichResumesFromItsCheckpoint) {
  if (!have_torch()) GTEST_SKIP() << kPython << " has no torch.distributed";
  std::string ckpt = (out_ / "ckpt.pt").string();
  auto r = run(torchrun({"--nproc_per_node=2", "--max_restarts=2", "--python", kPython,
                         TROUPE_SOURCE_DIR "/examples/torchrun/train_ddp.py", "--checkpoint", ckpt, "--kill-rank", "1",
                         "--kill-step", "12"}));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("rank 1 killed by signal 9"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("restart 1/2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[default0]:rank 0: epoch 0 step 8"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[default1]:rank 1: resumed from epoch 0 step 8 (restart 1)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[default0]:rank 0: epoch 2 step 24 "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("world 2 restart 1"), std::string::npos) << r.output;
  EXPECT_TRUE(left_in_session(r.session).empty());
}

TEST_F(TorchrunTest, KilledNodeAgentShrinksAnElasticGroup) {
  const std::string address = start_head("CPU=1,GPU=0");
  ASSERT_FALSE(address.empty());
  auto node = run({TROUPE_CLI, "start", "--address", address, "--resources", "CPU=1,GPU=0"});
  ASSERT_EQ(node.status, 0) << node.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(node.output, m, std::regex("\\(pid ([0-9]+)\\)"))) << node.output;
  pid_t node_pid = std::stoi(m[1]);

  // Two ranks a node fit no node of this cluster (1 CPU each): refused
  // after a 10 s grace, not after the 300 s rendezvous wait.
  auto too_big = run(torchrun(
      {"--address", address, "--nproc-per-node", "2", "--python", kPython, kScripts + "/env_dump.py", out_.string()}));
  EXPECT_EQ(too_big.status, 1) << too_big.output;
  EXPECT_NE(too_big.output.find("--nproc-per-node 2 needs 2 CPUs or 2 GPUs on one node, and no node of the cluster "
                                "has that many (node 1: CPU 1, GPU 0; node 2: CPU 1, GPU 0)"),
            std::string::npos)
      << too_big.output;

  auto job = std::async(std::launch::async, [&] {
    return run(torchrun({"--address", address, "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "2",
                         "--python", kPython, kScripts + "/wait_for_done.py", out_.string()}));
  });
  auto up = [&](const std::string& name) { return fs::exists(out_ / name); };
  ASSERT_TRUE(eventually([&] { return up("up-0-0-2") && up("up-0-1-2"); }))
      << (job.wait_for(std::chrono::seconds(0)) == std::future_status::ready ? job.get().output : "");
  ASSERT_EQ(::kill(node_pid, SIGKILL), 0);
  bool shrunk = eventually([&] { return up("up-1-0-1"); });
  std::ofstream(out_ / "done") << "1";
  ASSERT_EQ(job.wait_for(kWaitBound), std::future_status::ready);
  auto r = job.get();
  ASSERT_TRUE(shrunk) << r.output;
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("restarting the group (restart 1/2)"), std::string::npos) << r.output;
  for (auto f : {"up-0-0-2", "up-0-1-2", "up-1-0-1"}) {
    ScriptPid script = read_pid(out_ / f);
    ASSERT_GT(script.pid, 0) << f;
    EXPECT_TRUE(eventually([&] { return !alive(script); })) << f << " (pid " << script.pid << ")";
  }
}

TEST_F(TorchrunTest, BadInputIsOneClearLineAndLeavesNothingRunning) {
  std::string script = kScripts + "/env_dump.py";
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  std::vector<Case> cases = {
      {{"missing_script.py"}, "troupe torchrun: script missing_script.py: no such file"},
      {{"--nnodes", "3:1", script}, "troupe torchrun: --nnodes 3:1: MIN is above MAX"},
      {{"--nnodes", "x", script}, "troupe torchrun: --nnodes x: "},
      // srun torchrun --nnodes 1:4 ...: each machine trained a whole job of its own.
      {{"--nnodes", "1:2", script}, "troupe torchrun: --nnodes 1:2 needs a cluster of up to 2 nodes: give --address"},
      {{"--nproc-per-node", "0", script}, "troupe torchrun: --nproc-per-node 0: expected a whole number"},
      {{"--nproc_per_node", "two", script}, "troupe torchrun: --nproc_per_node two: expected a whole number"},
      {{"--python", "/no/such/python3", script}, "troupe torchrun: --python /no/such/python3: no such interpreter"},
      {{"--no-python", script}, "troupe torchrun: script " + script + ": is not executable"},
      {{"--no-python", "no-such-program-xyz"}, "troupe torchrun: --no-python no-such-program-xyz: no such program"},
  };
  for (auto& c : cases) {
    auto r = run(torchrun(c.args));
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_EQ(r.output.rfind(c.says, 0), 0u) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
    EXPECT_TRUE(left_in_session(r.session).empty()) << c.says;
  }
  auto help = run(torchrun({"--help"}));
  EXPECT_EQ(help.status, 0);
  EXPECT_NE(help.output.find("usage: troupe torchrun"), std::string::npos);
}
