#include "slurm.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "torchrun_slot.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/process.h"
#include "troupe/runtime/core/worker_env.h"

extern char** environ;

namespace troupe::launcher {

namespace {

using Clock = std::chrono::steady_clock;

std::string env_or(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

// `name` on PATH (or as given when it holds a '/'), or "" when absent.
std::string which(const std::string& name) { return find_executable(name, env_or("PATH", "/usr/bin:/bin")); }

// One word for sh, whatever it holds: in single quotes, each ' in it
// written as '\'' (close, an escaped quote, open again).
std::string shell_word(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// A command's standard output (the Slurm clients: scontrol).
std::string output_of(const std::vector<std::string>& argv) {
  std::string cmd;
  for (const auto& a : argv) cmd += shell_word(a) + " ";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) throw Error("cannot run " + argv[0]);
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  if (::pclose(p) != 0) throw Error("`" + cmd + "` failed");
  return out;
}

std::vector<std::string> this_environment(const std::vector<std::string>& extra) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) env.emplace_back(*e);
  env.insert(env.end(), extra.begin(), extra.end());
  return env;
}

// The allocation as Slurm describes it to the batch step.
struct Allocation {
  std::vector<std::string> nodes;  // host names, first = this one
  std::string head_host;           // the first node's address (NodeAddr)
  int cpus_per_node = 1;
  int gpus_per_node = 0;
};

int gpus_here() {
  if (std::string g = env_or("SLURM_GPUS_ON_NODE"); !g.empty()) return std::atoi(g.c_str());
  std::string cvd = env_or("CUDA_VISIBLE_DEVICES");
  if (cvd.empty() || cvd == "NoDevFiles") return 0;
  return static_cast<int>(std::count(cvd.begin(), cvd.end(), ',')) + 1;
}

Allocation read_allocation(const SlurmOptions& o) {
  if (env_or("SLURM_JOB_ID").empty())
    throw ConfigError("not inside a Slurm allocation (SLURM_JOB_ID is not set): run it from sbatch or salloc");
  Allocation a;
  std::stringstream hosts(output_of({which("scontrol"), "show", "hostnames", env_or("SLURM_JOB_NODELIST")}));
  for (std::string h; hosts >> h;) a.nodes.push_back(h);
  if (a.nodes.empty()) throw ConfigError("SLURM_JOB_NODELIST '" + env_or("SLURM_JOB_NODELIST") + "' names no node");
  // The first node's address, as Slurm reaches it.
  std::string node = output_of({which("scontrol"), "show", "node", a.nodes[0]});
  size_t at = node.find("NodeAddr=");
  a.head_host = at == std::string::npos ? a.nodes[0] : node.substr(at + 9, node.find_first_of(" \n", at) - at - 9);
  // "2(x2)" or "4,2": the first node's count (nodes are taken as alike).
  a.cpus_per_node =
      std::max(1, std::atoi(env_or("SLURM_JOB_CPUS_PER_NODE", env_or("SLURM_CPUS_ON_NODE", "1")).c_str()));
  a.gpus_per_node = gpus_here();
  if (o.gpus_per_node > a.gpus_per_node)
    throw ConfigError("--gpus-per-node " + std::to_string(o.gpus_per_node) + " but the allocation has " +
                      std::to_string(a.gpus_per_node) + " GPU(s) per node (SLURM_GPUS_ON_NODE='" +
                      env_or("SLURM_GPUS_ON_NODE") + "', CUDA_VISIBLE_DEVICES='" + env_or("CUDA_VISIBLE_DEVICES") +
                      "'): ask sbatch for them (--gpus-per-node)");
  if (o.gpus_per_node >= 0) a.gpus_per_node = o.gpus_per_node;
  return a;
}

volatile sig_atomic_t g_stop = 0;

void on_stop(int) { g_stop = 1; }

// The cluster's processes: the head's `troupe start --block`, and srun.
struct Cluster {
  pid_t head = -1;
  pid_t srun = -1;
  std::string address;
  std::string token;
  std::string session;

  ~Cluster() { stop(); }
  void stop() {
    for (pid_t* p : {&srun, &head})
      if (*p > 0) ::kill(*p, SIGTERM);
    for (pid_t* p : {&srun, &head})
      if (*p > 0) {
        core::reap_process(*p, std::chrono::seconds(15));
        *p = -1;
      }
  }
};

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

bool child_gone(pid_t pid, int* status) { return ::waitpid(pid, status, WNOHANG) == pid; }

void start_head(Cluster& c, const SlurmOptions& o, const Allocation& a, const std::string& self) {
  core::SpawnOptions s;
  s.executable = self;
  s.args = {"start",
            "--head",
            "--no-node",
            "--block",
            "--host",
            a.head_host,
            "--port",
            std::to_string(o.port),
            "--dashboard-port",
            std::to_string(o.dashboard_port)};
  s.env = this_environment({"TROUPE_SESSION_DIR=" + c.session});
  c.head = core::spawn_process(s);
  const auto deadline = Clock::now() + std::chrono::duration<double>(o.start_timeout_s);
  int st = 0;
  while (c.address.empty()) {
    if (child_gone(c.head, &st)) {
      c.head = -1;
      throw Error("the head did not start (" + core::describe_exit_status(st) + "); see " + c.session + "/head.log");
    }
    if (Clock::now() > deadline || g_stop) throw Timeout("the head did not start in time");
    c.address = read_file(c.session + "/address");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  c.token = read_file(c.session + "/token");
}

void start_nodes(Cluster& c, const SlurmOptions& o, const Allocation& a, const std::string& self) {
  const std::string n = std::to_string(a.nodes.size());
  core::SpawnOptions s;
  s.executable = which("srun");
  if (s.executable.empty()) throw ConfigError("srun is not on PATH");
  s.args = {"--nodes=" + n,
            "--ntasks=" + n,
            "--ntasks-per-node=1",
            "--cpus-per-task=" + std::to_string(a.cpus_per_node),
            "--overlap",
            "--kill-on-bad-exit=0",
            self,
            "start",
            "--block",
            "--address",
            c.address,
            "--resources",
            "CPU=" + std::to_string(a.cpus_per_node) + ",GPU=" + std::to_string(a.gpus_per_node)};
  s.env = this_environment({"TROUPE_SESSION_DIR=" + c.session, "TROUPE_TOKEN=" + c.token});
  c.srun = core::spawn_process(s);
  InitOptions io;
  io.address = c.address;
  io.token = c.token;
  Runtime rt = Runtime::connect(io);
  const auto deadline = Clock::now() + std::chrono::duration<double>(o.start_timeout_s);
  for (;;) {
    size_t alive = 0;
    for (const auto& node : rt.nodes()) alive += node.alive;
    if (alive >= a.nodes.size()) break;
    int st = 0;
    if (child_gone(c.srun, &st)) {
      c.srun = -1;
      throw Error("srun of the node agents ended (" + core::describe_exit_status(st) + ") with " +
                  std::to_string(alive) + " of " + n + " nodes up");
    }
    if (Clock::now() > deadline || g_stop)
      throw Timeout(std::to_string(alive) + " of " + n + " node agents joined in " + std::to_string(o.start_timeout_s) +
                    " s");
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::printf("troupe slurm: cluster of %zu node(s) at %s (CPU=%d, GPU=%d each); running the driver\n", a.nodes.size(),
              c.address.c_str(), a.cpus_per_node, a.gpus_per_node);
  std::fflush(stdout);
}

int run_driver(const Cluster& c, const SlurmOptions& o) {
  core::SpawnOptions s;
  s.executable = which(o.command[0]);
  if (s.executable.empty()) throw ConfigError("driver '" + o.command[0] + "' is not on PATH");
  s.arg0 = o.command[0];
  s.args.assign(o.command.begin() + 1, o.command.end());
  s.env =
      this_environment({"TROUPE_ADDRESS=" + c.address, "TROUPE_TOKEN=" + c.token, "TROUPE_SESSION_DIR=" + c.session});
  pid_t driver = core::spawn_process(s);
  int st = 0;
  while (!child_gone(driver, &st)) {
    if (g_stop) {
      std::fprintf(stderr, "troupe slurm: stopping (signal); ending the driver and the cluster\n");
      ::kill(driver, SIGTERM);
      core::reap_process(driver, std::chrono::seconds(10));
      return 143;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

}  // namespace

int run_slurm(const SlurmOptions& o, const std::string& self) {
  if (o.command.empty()) {
    std::fprintf(stderr, "troupe slurm: give the driver after --, e.g. troupe slurm -- ./my_driver\n");
    return 2;
  }
  Allocation a;
  try {
    a = read_allocation(o);
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "troupe slurm: %s\n", e.what());
    return 2;
  }
  struct sigaction sa {};
  sa.sa_handler = on_stop;
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
  Cluster c;
  c.session = env_or("TMPDIR", "/tmp") + "/troupe-slurm-" + env_or("SLURM_JOB_ID") + "-" + std::to_string(::getpid());
  ::mkdir(c.session.c_str(), 0700);
  // The session holds the cluster's token and state db: gone with the
  // cluster when the job went well. Its logs are in it too: kept when the
  // driver or the cluster failed (the errors point there), or with
  // TROUPE_KEEP_SESSION=1.
  auto finish = [&](int rc) {
    c.stop();
    if (rc == 0 && env_or("TROUPE_KEEP_SESSION").empty()) {
      std::error_code ec;
      std::filesystem::remove_all(c.session, ec);
    } else {
      std::printf("troupe slurm: kept the session directory %s (its logs; remove it when done)\n", c.session.c_str());
    }
    return rc;
  };
  try {
    start_head(c, o, a, self);
    start_nodes(c, o, a, self);
    int rc = run_driver(c, o);
    finish(rc);
    std::printf("troupe slurm: driver exited with %d; cluster stopped\n", rc);
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe slurm: %s\n", e.what());
    return finish(1);
  }
}

std::string sbatch_script(const SlurmOptions& o, const std::string& self) {
  std::string cmd;
  for (const auto& a : o.command) cmd += " " + shell_word(a);
  std::string gpus = o.gpus_per_node > 0 ? "#SBATCH --gpus-per-node=" + std::to_string(o.gpus_per_node) + "\n" : "";
  // Every option the job would run with, defaults left out.
  std::string options = " --port " + std::to_string(o.port);
  if (o.gpus_per_node >= 0) options += " --gpus-per-node " + std::to_string(o.gpus_per_node);
  if (o.dashboard_port >= 0) options += " --dashboard-port " + std::to_string(o.dashboard_port);
  if (o.start_timeout_s != SlurmOptions{}.start_timeout_s) {
    std::ostringstream t;
    t << o.start_timeout_s;
    options += " --start-timeout " + t.str();
  }
  return "#!/bin/bash\n"
         "# A troupe cluster for the life of one driver (written by troupe slurm --print-sbatch).\n"
         "# Submit with: sbatch --nodes=N this-script\n"
         "#SBATCH --job-name=troupe\n"
         "#SBATCH --ntasks-per-node=1\n"
         "#SBATCH --exclusive\n" +
         gpus + "exec " + shell_word(self) + " slurm" + options + " --" + cmd + "\n";
}

}  // namespace troupe::launcher
