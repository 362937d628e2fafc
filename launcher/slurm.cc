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
#include <functional>
#include <iomanip>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <tuple>

#include "torchrun_slot.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/client/shipped_copies.h"
#include "troupe/runtime/core/cuda_devices.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/process.h"
#include "troupe/runtime/core/worker_env.h"
#include "troupe/runtime/wire/auth.h"

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

// A Slurm client's standard output (scontrol), found on PATH.
std::string output_of(std::vector<std::string> argv) {
  const std::string name = argv[0];
  argv[0] = which(name);
  if (argv[0].empty()) throw Error(name + " is not on PATH (" + env_or("PATH") + ")");
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

// This process's environment with `extra` added and the variables named in
// `drop` left out.
std::vector<std::string> this_environment(const std::vector<std::string>& extra,
                                          const std::vector<std::string>& drop = {}) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    const std::string name = kv.substr(0, kv.find('='));
    if (std::find(drop.begin(), drop.end(), name) == drop.end()) env.push_back(kv);
  }
  env.insert(env.end(), extra.begin(), extra.end());
  return env;
}

// Seconds for a message: "120 s", "0.5 s" (std::to_string gave "120.000000").
std::string seconds(double s) {
  std::ostringstream o;
  o << std::setprecision(10) << s << " s";
  return o.str();
}

// A plain non-negative decimal count (no sign, no suffix, not empty), or -1.
long plain_count(const std::string& s) {
  if (s.empty() || s.size() > 9 || !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return -1;
  return std::stol(s);
}

// The allocation as Slurm describes it to the batch step.
struct Allocation {
  std::vector<std::string> nodes;  // host names, first = this one
  std::string head_host;           // the first node's address (NodeAddr)
  std::vector<int> cpus;           // each node's CPUs in the job, in `nodes`' order
  int gpus_per_node = 0;           // on this (the batch) node, or --gpus-per-node
  bool gpus_given = false;         // --gpus-per-node: every node offers that many
};

// "2,1" for the summary line, or "2" when every node has as many.
std::string per_node_text(const std::vector<int>& counts) {
  if (std::adjacent_find(counts.begin(), counts.end(), std::not_equal_to<>()) == counts.end())
    return std::to_string(counts.empty() ? 0 : counts[0]);
  std::string out;
  for (int c : counts) out += (out.empty() ? "" : ",") + std::to_string(c);
  return out + " by node";
}

Allocation read_allocation(const SlurmOptions& o) {
  if (env_or("SLURM_JOB_ID").empty())
    throw ConfigError("not inside a Slurm allocation (SLURM_JOB_ID is not set): run it from sbatch or salloc");
  Allocation a;
  // The variables first: a bad one is refused before anything runs.
  const std::string cpn = env_or("SLURM_JOB_CPUS_PER_NODE");
  if (!cpn.empty()) a.cpus = cpus_per_node(cpn);
  a.gpus_per_node = gpus_on_node(env_or("SLURM_GPUS_ON_NODE"), env_or("CUDA_VISIBLE_DEVICES"));
  if (o.gpus_per_node > a.gpus_per_node)
    throw ConfigError("--gpus-per-node " + std::to_string(o.gpus_per_node) + " but the allocation has " +
                      std::to_string(a.gpus_per_node) + " GPU(s) per node (SLURM_GPUS_ON_NODE='" +
                      env_or("SLURM_GPUS_ON_NODE") + "', CUDA_VISIBLE_DEVICES='" + env_or("CUDA_VISIBLE_DEVICES") +
                      "'): ask sbatch for them (--gpus-per-node)");
  if (o.gpus_per_node >= 0) a.gpus_per_node = o.gpus_per_node;
  a.gpus_given = o.gpus_per_node >= 0;
  std::stringstream hosts(output_of({"scontrol", "show", "hostnames", env_or("SLURM_JOB_NODELIST")}));
  for (std::string h; hosts >> h;) a.nodes.push_back(h);
  if (a.nodes.empty()) throw ConfigError("SLURM_JOB_NODELIST '" + env_or("SLURM_JOB_NODELIST") + "' names no node");
  if (cpn.empty()) {
    // sbatch and salloc set SLURM_JOB_CPUS_PER_NODE; without it, the batch
    // node's own count stands for every node.
    const std::string here = env_or("SLURM_CPUS_ON_NODE");
    const long n = plain_count(here);
    if (n < 1)
      throw ConfigError("SLURM_JOB_CPUS_PER_NODE is not set and SLURM_CPUS_ON_NODE='" + here +
                        "' is not a count of CPUs");
    a.cpus.assign(a.nodes.size(), static_cast<int>(n));
  }
  if (a.cpus.size() != a.nodes.size())
    throw ConfigError("SLURM_JOB_CPUS_PER_NODE='" + cpn + "' gives " + std::to_string(a.cpus.size()) +
                      " node(s) but SLURM_JOB_NODELIST='" + env_or("SLURM_JOB_NODELIST") + "' names " +
                      std::to_string(a.nodes.size()));
  // The first node's address, as Slurm reaches it.
  std::string node = output_of({"scontrol", "show", "node", a.nodes[0]});
  size_t at = node.find("NodeAddr=");
  a.head_host = at == std::string::npos ? a.nodes[0] : node.substr(at + 9, node.find_first_of(" \n", at) - at - 9);
  return a;
}

// The signal that stops troupe slurm (SIGTERM from Slurm, SIGINT, SIGHUP
// from a closed terminal), or 0.
volatile sig_atomic_t g_stop = 0;

void on_stop(int sig) { g_stop = sig; }

// SIGUSR1 and SIGUSR2 received and not yet passed on to the driver: a
// time-limit warning (#SBATCH --signal=B:USR1@90, scancel --batch
// --signal=USR2) is the driver's, to checkpoint. Their default action
// ended troupe slurm, and its driver with it.
volatile sig_atomic_t g_usr1 = 0;
volatile sig_atomic_t g_usr2 = 0;

void on_user_signal(int sig) {
  if (sig == SIGUSR1)
    g_usr1 = 1;
  else
    g_usr2 = 1;
}

// Passes what came on to `driver`.
void pass_on_user_signals(pid_t driver) {
  for (auto [flag, sig, name] : {std::tuple{&g_usr1, SIGUSR1, "SIGUSR1"}, std::tuple{&g_usr2, SIGUSR2, "SIGUSR2"}}) {
    if (!*flag) continue;
    *flag = 0;
    std::fprintf(stderr, "troupe slurm: %s: passed on to the driver (pid %d)\n", name, static_cast<int>(driver));
    ::kill(driver, sig);
  }
}

// Thrown by the waits for the cluster to start when a signal stops it:
// said as the signal, not as a start that took too long.
struct StoppedBySignal : std::runtime_error {
  StoppedBySignal(int sig, const std::string& what) : std::runtime_error(what), signal(sig) {}
  int signal;
};

std::string signal_name(int sig) {
  switch (sig) {
    case SIGTERM:
      return "SIGTERM";
    case SIGINT:
      return "SIGINT";
    case SIGHUP:
      return "SIGHUP";
    default:
      return "signal " + std::to_string(sig);
  }
}

bool child_gone(pid_t pid, int* status) { return ::waitpid(pid, status, WNOHANG) == pid; }

// The first line of a file ("" when it cannot be read).
std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

// The cluster's processes: the head's `troupe start --block`, and srun.
struct Cluster {
  pid_t head = -1;
  pid_t srun = -1;
  std::string address;
  std::string token;
  std::string session;

  ~Cluster() { stop(); }
  // The head is told to stop its cluster first: every node agent stops its
  // workers and exits, srun's step ends by itself, and each node cleans up
  // after its agent. A SIGTERM to srun instead made it force the step's end
  // (SIGKILL to every agent: "srun: forcing job termination", a step
  // CANCELLED on every clean job, nothing cleaned up). Signals are for what
  // is still there after that.
  //
  // `keep_logs` (a job that failed): SIGPWR, sent with scancel to the
  // agents' step, reaches every node's script, which stops its agent and
  // keeps the node's session directory, whose logs tell what failed. srun
  // passes on only SIGUSR1 and SIGUSR2 (it takes the others for itself:
  // SIGALRM ends the step), which users' time-limit warnings send
  // (#SBATCH --signal=USR1@90): with SIGUSR1 every agent stopped 90 s
  // early.
  void stop(bool keep_logs = false) {
    bool told = false;
    if (keep_logs && srun > 0) {
      // The agents' step alone (the batch node's script wrote its id):
      // the whole job's steps held troupe slurm's own under salloc
      // (srun --pty troupe slurm), and a user's other steps.
      const std::string step = read_file(session + "/agents-step");
      try {
        if (step.empty()) throw Error("the agents' step id was not written");
        // By number: scancel knows only some names ("Unknown job signal: PWR").
        output_of({"scancel", "--signal=" + std::to_string(SIGPWR), step});
        told = true;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "troupe slurm: the node agents could not be told to keep their logs (%s)\n", e.what());
      }
    }
    if (!told && head > 0 && !address.empty()) {
      try {
        InitOptions io;
        io.address = address;
        io.token = token;
        Runtime rt = Runtime::connect(io);
        rt.core()->head().call_empty<void>(wire::Op::kShutdown, std::chrono::seconds(5));
        told = true;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "troupe slurm: the head could not be told to stop (%s); signalling the cluster\n",
                     e.what());
      }
    }
    int st = 0;
    // Not told: signalled at once (a time limit's SIGKILL follows soon).
    const auto deadline = Clock::now() + std::chrono::seconds(told ? 20 : 0);
    while (srun > 0 && Clock::now() < deadline) {
      if (child_gone(srun, &st))
        srun = -1;
      else
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    for (pid_t* p : {&srun, &head})
      if (*p > 0) ::kill(*p, SIGTERM);
    for (pid_t* p : {&srun, &head})
      if (*p > 0) {
        core::reap_process(*p, std::chrono::seconds(15));
        *p = -1;
      }
  }
};

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
            std::to_string(o.dashboard_port),
            "--no-token-file"};
  s.env = this_environment({"TROUPE_SESSION_DIR=" + c.session, "TROUPE_TOKEN=" + c.token});
  c.head = core::spawn_process(s);
  const auto deadline = Clock::now() + std::chrono::duration<double>(o.start_timeout_s);
  int st = 0;
  while (c.address.empty()) {
    // The signal first: one sent to the whole step (or process group)
    // reaches the head too, which may end first.
    if (const int sig = g_stop)
      throw StoppedBySignal(sig, "stopped by " + signal_name(sig) + " before the head was up");
    if (child_gone(c.head, &st)) {
      c.head = -1;
      throw Error("the head did not start (" + core::describe_exit_status(st) + "); see " + c.session + "/head.log");
    }
    if (Clock::now() > deadline)
      throw Timeout("the head did not start in " + seconds(o.start_timeout_s) + "; see " + c.session + "/head.log");
    c.address = read_file(c.session + "/address");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// What srun runs on each node: the node agent, offering its own node's CPUs.
// $1..$4 are troupe, the head's address, the GPUs and the batch node's
// name; the rest is one CPU count per node in SLURM_JOB_CPUS_PER_NODE's
// order, which is the order of SLURM_NODEID in a step over all the job's
// nodes. GPUs "auto": each node its own (nodes of a job may differ):
// SLURM_GPUS_ON_NODE of its step when a count, else what the agent finds
// (CUDA, within CUDA_VISIBLE_DEVICES). The token is in TROUPE_TOKEN, and
// no agent writes it to disk (--no-token-file). The batch node's agent
// shares the head's session directory (troupe slurm keeps or removes it);
// another node's has one of its own inside it (node-ID: a directory that
// only this agent writes, whether or not the nodes share TMPDIR), removed
// with its logs once the agent has stopped (kept with TROUPE_KEEP_SESSION
// set, or when SIGPWR stopped it: troupe slurm's job failed and sent it
// with scancel to the step whose id the batch node's script wrote in the
// session directory (agents-step); the agent ignores SIGPWR, which goes to
// the whole task), and the session
// path with it where nothing else is in it. A stop signal to the script is
// passed on to the agent. SIGUSR1 and SIGUSR2, a time-limit warning's
// (--signal=USR1@90, submitit's USR2), are the driver's: the script and the
// agent ignore them (USR1 stopped every agent, USR2 killed them).
const char* const kAgentScript =
    "troupe=$1 address=$2 gpus=$3 batch=$4; shift 4; "
    "case $SLURM_NODEID in ''|*[!0-9]*) i=$#;; *) i=$SLURM_NODEID;; esac; "
    "if [ \"$i\" -ge $# ]; then "
    "echo \"troupe slurm: on $SLURMD_NODENAME SLURM_NODEID='$SLURM_NODEID' is not one of the job's $# nodes\" >&2; "
    "exit 2; fi; "
    "shift \"$i\"; "
    "res=\"CPU=$1,GPU=$gpus\"; "
    "if [ \"$gpus\" = auto ]; then case $SLURM_GPUS_ON_NODE in "
    "''|*[!0-9]*) res=\"CPU=$1\";; *) res=\"CPU=$1,GPU=$SLURM_GPUS_ON_NODE\";; esac; fi; "
    "own=; if [ -n \"$batch\" ] && [ \"$SLURMD_NODENAME\" != \"$batch\" ] && [ -n \"$TROUPE_SESSION_DIR\" ]; then "
    "own=\"$TROUPE_SESSION_DIR/node-$i\"; (umask 077; mkdir -p \"$own\") || exit 1; "
    "elif [ -n \"$SLURM_STEP_ID\" ] && [ -n \"$TROUPE_SESSION_DIR\" ]; then "
    "echo \"$SLURM_JOB_ID.$SLURM_STEP_ID\" > \"$TROUPE_SESSION_DIR/agents-step\"; fi; "
    "pid=; keep=$TROUPE_KEEP_SESSION; trap '' PWR USR1 USR2; "
    "TROUPE_SESSION_DIR=${own:-$TROUPE_SESSION_DIR} \"$troupe\" start --block --no-token-file --address \"$address\" "
    "--resources \"$res\" & pid=$!; "
    "trap 'kill -TERM $pid 2>/dev/null' TERM INT HUP; trap 'keep=stopped; kill -TERM $pid 2>/dev/null' PWR; "
    "wait $pid; rc=$?; while kill -0 $pid 2>/dev/null; do wait $pid; rc=$?; done; "
    "if [ -n \"$own\" ] && [ -z \"$keep\" ]; then "
    "rm -rf \"$own\"; rmdir \"$TROUPE_SESSION_DIR\" 2>/dev/null; fi; "
    "[ \"$keep\" = stopped ] && exit 0; exit $rc";

}  // namespace

std::string slurm_agent_script() { return kAgentScript; }

namespace {

void start_nodes(Cluster& c, const SlurmOptions& o, const Allocation& a, const std::string& self) {
  const std::string n = std::to_string(a.nodes.size());
  core::SpawnOptions s;
  s.executable = which("srun");
  if (s.executable.empty()) throw ConfigError("srun is not on PATH");
  // One task per node with all the job's CPUs on that node, however many:
  // no --cpus-per-task (it asks every node for the same count and implies
  // --exact), and --whole (the default since Slurm 21.08; 20.11 needs it).
  s.args = {"--nodes=" + n,
            "--ntasks=" + n,
            "--ntasks-per-node=1",
            "--whole",
            "--overlap",
            "--kill-on-bad-exit=0",
            "/bin/sh",
            "-c",
            kAgentScript,
            "troupe-agent",
            self,
            c.address,
            a.gpus_given ? std::to_string(a.gpus_per_node) : std::string("auto"),
            env_or("SLURMD_NODENAME")};
  for (int cpus : a.cpus) s.args.push_back(std::to_string(cpus));
  // srun reads a per-task CPU count from these (sbatch -c sets some): it
  // would ask each node for it and imply --exact. --exact is at odds with
  // --whole.
  s.env = this_environment({"TROUPE_SESSION_DIR=" + c.session, "TROUPE_TOKEN=" + c.token},
                           {"SLURM_CPUS_PER_TASK", "SRUN_CPUS_PER_TASK", "SLURM_TRES_PER_TASK", "SLURM_EXACT"});
  c.srun = core::spawn_process(s);
  InitOptions io;
  io.address = c.address;
  io.token = c.token;
  Runtime rt = Runtime::connect(io);
  const auto deadline = Clock::now() + std::chrono::duration<double>(o.start_timeout_s);
  std::vector<int> gpus;  // each live node's, as its agent offers them
  for (;;) {
    size_t alive = 0;
    gpus.clear();
    for (const auto& node : rt.nodes()) {
      alive += node.alive;
      if (!node.alive) continue;
      const auto g = node.total.find("GPU");
      gpus.push_back(g == node.total.end() ? 0 : static_cast<int>(g->second));
    }
    if (alive >= a.nodes.size()) break;
    // The signal first: Slurm signals the whole step, srun included,
    // which may end first ("srun of the node agents ended").
    if (const int sig = g_stop)
      throw StoppedBySignal(sig, "stopped by " + signal_name(sig) + " before the cluster was up (" +
                                     std::to_string(alive) + " of " + n + " node agents had joined)");
    int st = 0;
    if (child_gone(c.srun, &st)) {
      c.srun = -1;
      throw Error("srun of the node agents ended (" + core::describe_exit_status(st) + ") with " +
                  std::to_string(alive) + " of " + n + " nodes up");
    }
    if (Clock::now() > deadline)
      throw Timeout(std::to_string(alive) + " of " + n + " node agents joined in " + seconds(o.start_timeout_s));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::printf("troupe slurm: cluster of %zu node(s) at %s (CPU=%s, GPU=%s); running the driver\n", a.nodes.size(),
              c.address.c_str(), per_node_text(a.cpus).c_str(), per_node_text(gpus).c_str());
  std::fflush(stdout);
}

// The driver's exit status; or, when a signal stopped troupe slurm
// (`*stopped_by` set to it), 128 + that signal, as the CLI's other commands
// that a signal stops exit, whichever ended first: the driver gets a
// terminal's Ctrl-C too, and may exit before it is told to.
int run_driver(const Cluster& c, const SlurmOptions& o, int* stopped_by) {
  core::SpawnOptions s;
  s.executable = which(o.command[0]);  // there: run_slurm checked it first
  s.arg0 = o.command[0];
  s.args.assign(o.command.begin() + 1, o.command.end());
  s.env =
      this_environment({"TROUPE_ADDRESS=" + c.address, "TROUPE_TOKEN=" + c.token, "TROUPE_SESSION_DIR=" + c.session});
  pid_t driver = core::spawn_process(s);
  int st = 0;
  while (!child_gone(driver, &st)) {
    pass_on_user_signals(driver);
    if (const int sig = g_stop) {
      std::fprintf(stderr, "troupe slurm: %s: ending the driver and the cluster\n", signal_name(sig).c_str());
      ::kill(driver, SIGTERM);
      core::reap_process(driver, std::chrono::seconds(10));
      *stopped_by = sig;
      return 128 + sig;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (const int sig = g_stop) {
    std::fprintf(stderr, "troupe slurm: %s: ending the cluster\n", signal_name(sig).c_str());
    *stopped_by = sig;
    return 128 + sig;
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

// troupe slurm runs where Slurm starts a batch script, on the allocation's
// first node, which hosts the head: "" there, else why not (salloc's shell
// on a login node: the head was started there on the first node's address,
// which it cannot bind, and said only "the head did not start").
std::string not_on_first_node(const Allocation& a) {
  const std::string here = env_or("SLURMD_NODENAME");
  if (here == a.nodes[0]) return "";
  return "troupe slurm runs on the allocation's first node (" + a.nodes[0] + "), which hosts the head; this shell " +
         (here.empty() ? std::string("is on no node of it (SLURMD_NODENAME is not set: a login node?)")
                       : "is on " + here + " (SLURMD_NODENAME)") +
         ": run it from sbatch, or with srun -N1 -n1 --overlap --pty troupe slurm ... inside salloc";
}

}  // namespace

std::string bad_slurm_value(const SlurmOptions& o) {
  if (o.command.empty()) return "give the driver after --, e.g. troupe slurm -- ./my_driver";
  // NaN passes a range check: said as what it must be.
  if (!(o.start_timeout_s > 0 && o.start_timeout_s <= 7 * 86400.0)) {
    std::ostringstream given;
    given << std::setprecision(10) << o.start_timeout_s;
    return "--start-timeout " + given.str() + " must be seconds in (0, 604800]";
  }
  return "";
}

int run_slurm(const SlurmOptions& o, const std::string& self) {
  if (const std::string why = bad_slurm_value(o); !why.empty()) {
    std::fprintf(stderr, "troupe slurm: %s\n", why.c_str());
    return 2;
  }
  // Before anything starts (it was found missing once the cluster was up).
  if (which(o.command[0]).empty()) {
    std::fprintf(stderr, "troupe slurm: driver '%s' is not an executable file%s\n", o.command[0].c_str(),
                 o.command[0].find('/') == std::string::npos ? " on PATH" : "");
    return 2;
  }
  Allocation a;
  try {
    a = read_allocation(o);
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "troupe slurm: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {  // scontrol could not be run, or failed
    std::fprintf(stderr, "troupe slurm: reading the allocation: %s\n", e.what());
    return 1;
  }
  if (const std::string why = not_on_first_node(a); !why.empty()) {
    std::fprintf(stderr, "troupe slurm: %s\n", why.c_str());
    return 2;
  }
  // A closed terminal (an interactive allocation) stops it as Ctrl-C does:
  // by default SIGHUP killed it at once, and its children by their parent
  // death signal (the head without emptying its state db).
  struct sigaction sa {};
  sa.sa_handler = on_stop;
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
  // A hang-up ignored when it started (nohup) stays ignored.
  struct sigaction hup {};
  if (::sigaction(SIGHUP, nullptr, &hup) == 0 && hup.sa_handler != SIG_IGN) ::sigaction(SIGHUP, &sa, nullptr);
  // Before the driver runs they wait for it (one that came while the
  // cluster started goes to it once it runs).
  struct sigaction user {};
  user.sa_handler = on_user_signal;
  ::sigaction(SIGUSR1, &user, nullptr);
  ::sigaction(SIGUSR2, &user, nullptr);
  Cluster c;
  // Made here and given to the head and the agents in their environment
  // (--no-token-file): the cluster's secret is never on disk, where a
  // scancel (a SIGKILL to this process: nothing cleans up after it) left it.
  c.token = wire::random_token();
  c.session = env_or("TMPDIR", "/tmp") + "/troupe-slurm-" + env_or("SLURM_JOB_ID") + "-" + std::to_string(::getpid());
  ::mkdir(c.session.c_str(), 0700);
  // The session holds the cluster's state db: gone with the cluster when
  // the job went well. Its logs are in it too: kept when the driver or the
  // cluster failed (the errors point there), or with TROUPE_KEEP_SESSION=1.
  // A scancel SIGKILLs this process at once: the directory stays, holding
  // logs only.
  auto finish = [&](int rc) {
    c.stop(rc != 0);
    if (rc == 0 && env_or("TROUPE_KEEP_SESSION").empty()) {
      std::error_code ec;
      std::filesystem::remove_all(c.session, ec);
    } else {
      // Kept for its logs, not for the copies of files drivers shipped
      // (the batch node's agent leaves them while the head still runs).
      remove_shipped_copies(c.session);
      std::printf("troupe slurm: kept the session directory %s (its logs; remove it when done)\n", c.session.c_str());
    }
    return rc;
  };
  try {
    start_head(c, o, a, self);
    start_nodes(c, o, a, self);
    int stopped_by = 0;
    int rc = run_driver(c, o, &stopped_by);
    finish(rc);
    if (stopped_by != 0)
      std::printf("troupe slurm: driver stopped by troupe slurm (%s); cluster stopped\n",
                  signal_name(stopped_by).c_str());
    else
      std::printf("troupe slurm: driver exited with %d; cluster stopped\n", rc);
    return rc;
  } catch (const StoppedBySignal& e) {
    std::fprintf(stderr, "troupe slurm: %s\n", e.what());
    return finish(128 + e.signal);
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
  std::string options = o.port > 0 ? " --port " + std::to_string(o.port) : std::string();
  if (o.gpus_per_node >= 0) options += " --gpus-per-node " + std::to_string(o.gpus_per_node);
  if (o.dashboard_port >= 0) options += " --dashboard-port " + std::to_string(o.dashboard_port);
  if (o.start_timeout_s != SlurmOptions{}.start_timeout_s) {
    std::ostringstream t;
    t << std::setprecision(10) << o.start_timeout_s;
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

std::vector<int> cpus_per_node(const std::string& value) {
  auto bad = [&](const std::string& why) {
    return ConfigError("SLURM_JOB_CPUS_PER_NODE='" + value + "' is not a list of CPUs per node like 72(x2),36 (" + why +
                       ")");
  };
  size_t i = 0;
  auto number = [&](const char* what) {
    size_t end = value.find_first_not_of("0123456789", i);
    if (end == std::string::npos) end = value.size();
    const std::string digits = value.substr(i, end - i);
    const long n = plain_count(digits);
    if (digits.size() > 9)  // 99999999999 is no typo of a small count
      throw bad(std::string("a ") + what + " of " + digits + " is too large (at offset " + std::to_string(i) + ")");
    if (n < 1) throw bad(std::string("a ") + what + " of 1 or more expected at offset " + std::to_string(i));
    i = end;
    return n;
  };
  // No more nodes than any Slurm cluster has: a typo such as 2(x20000000)
  // is refused, not expanded.
  constexpr size_t kMaxNodes = 1'000'000;
  std::vector<int> out;
  for (;;) {
    const long cpus = number("CPU count");
    long times = 1;
    if (value.compare(i, 2, "(x") == 0) {
      i += 2;
      times = number("repeat count");
      if (i >= value.size() || value[i] != ')') throw bad("no ')' at offset " + std::to_string(i));
      ++i;
    }
    if (out.size() + static_cast<size_t>(times) > kMaxNodes) throw bad("over a million nodes");
    out.insert(out.end(), static_cast<size_t>(times), static_cast<int>(cpus));
    if (i == value.size()) return out;
    if (value[i] != ',') throw bad("unexpected '" + value.substr(i, 1) + "' at offset " + std::to_string(i));
    ++i;
  }
}

int gpus_on_node(const std::string& slurm_gpus_on_node, const std::string& cuda_visible_devices) {
  if (!slurm_gpus_on_node.empty()) {
    const long n = plain_count(slurm_gpus_on_node);
    if (n < 0) throw ConfigError("SLURM_GPUS_ON_NODE='" + slurm_gpus_on_node + "' is not a count of GPUs");
    return static_cast<int>(n);
  }
  return static_cast<int>(core::cuda_visible_devices(cuda_visible_devices).size());
}

}  // namespace troupe::launcher
