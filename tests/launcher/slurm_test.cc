// `troupe slurm`'s reading of the allocation: Slurm's per-node CPU list and
// a node's GPUs, without a Slurm (test_slurm.py runs a real one).
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "launcher/slurm.h"
#include "tests/support/temp_dir.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/files.h"

using troupe::ConfigError;
using troupe::launcher::cpus_per_node;
using troupe::launcher::gpus_on_node;

namespace {

namespace fs = std::filesystem;

// The ConfigError's message for `value`, or "" when it was accepted.
std::string cpu_list_error(const std::string& value) {
  try {
    cpus_per_node(value);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

std::string gpu_error(const std::string& slurm_gpus_on_node) {
  try {
    gpus_on_node(slurm_gpus_on_node, "");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

// `command`'s exit code (-1: killed) and its output, stderr with stdout.
std::pair<int, std::string> shell(const std::string& command) {
  std::string out;
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  const int st = pclose(p);
  return std::make_pair(WIFEXITED(st) ? WEXITSTATUS(st) : -1, out);
}

}  // namespace

// Nodes of different sizes in one job (sbatch -N2 -n3 gives "2,1"): each
// node's own count, in node order. Only the first used to be read.
TEST(SlurmAllocation, CpusPerNodeExpandsSlurmsCompressedList) {
  EXPECT_EQ(cpus_per_node("2(x3),1"), (std::vector<int>{2, 2, 2, 1}));
  EXPECT_EQ(cpus_per_node("4"), (std::vector<int>{4}));
  EXPECT_EQ(cpus_per_node("1,2"), (std::vector<int>{1, 2}));
  EXPECT_EQ(cpus_per_node("72(x2),36"), (std::vector<int>{72, 72, 36}));
  EXPECT_EQ(cpus_per_node("8(x1)"), (std::vector<int>{8}));
  EXPECT_EQ(cpus_per_node("1,4(x2),2(x2)"), (std::vector<int>{1, 4, 4, 2, 2}));
}

TEST(SlurmAllocation, MalformedCpusPerNodeIsAConfigErrorNamingIt) {
  for (const std::string bad : {"", "2(x", "2(x3", "2(x)", "2(3)", "2,", ",2", "2,,1", "abc", "2abc", "-2", "0",
                                "2(x0)", "1.5", "2 ,1", "2(x3),1)", "4(x2000000)", "99999999999"}) {
    const std::string msg = cpu_list_error(bad);
    EXPECT_NE(msg.find("SLURM_JOB_CPUS_PER_NODE='" + bad + "'"), std::string::npos) << "'" << bad << "': " << msg;
  }
  // Too many digits is said as too large, not as "1 or more expected".
  EXPECT_NE(cpu_list_error("4(x99999999999)").find("a repeat count of 99999999999 is too large"), std::string::npos)
      << cpu_list_error("4(x99999999999)");
  EXPECT_NE(cpu_list_error("99999999999").find("a CPU count of 99999999999 is too large"), std::string::npos);
}

// SLURM_GPUS_ON_NODE wins and must be a plain count ("2abc" was read as 2,
// "abc" and "gpu:2" as 0).
TEST(SlurmAllocation, GpusOnNodeIsAPlainCount) {
  EXPECT_EQ(gpus_on_node("0", ""), 0);
  EXPECT_EQ(gpus_on_node("4", "0,1"), 4);
  for (const std::string bad : {"2abc", "abc", "gpu:2", "-1", " 2", "2.0", "1e3"}) {
    const std::string msg = gpu_error(bad);
    EXPECT_NE(msg.find("SLURM_GPUS_ON_NODE='" + bad + "'"), std::string::npos) << "'" << bad << "': " << msg;
  }
}

// CUDA_VISIBLE_DEVICES as CUDA reads it: "-1" hides every device (it used to
// count as 1), an empty entry is no device ("0,,1" counted 3), and the
// devices end at the first entry that names none.
TEST(SlurmAllocation, GpusFromCudaVisibleDevices) {
  EXPECT_EQ(gpus_on_node("", ""), 0);
  EXPECT_EQ(gpus_on_node("", "NoDevFiles"), 0);
  EXPECT_EQ(gpus_on_node("", "-1"), 0);
  EXPECT_EQ(gpus_on_node("", "0"), 1);
  EXPECT_EQ(gpus_on_node("", "0,1,2,3"), 4);
  EXPECT_EQ(gpus_on_node("", "0,,1"), 1);
  EXPECT_EQ(gpus_on_node("", ",0"), 0);
  EXPECT_EQ(gpus_on_node("", "0,1,"), 2);
  EXPECT_EQ(gpus_on_node("", "0,2,-1,1"), 2);
  EXPECT_EQ(gpus_on_node("", "GPU-8f0c2b1e,MIG-GPU-8f0c2b1e/1/0"), 2);
}

// The CLI refuses a malformed variable with exit status 2 and its value,
// before it runs scontrol or starts anything (no Slurm needed).
TEST(SlurmAllocation, CliRefusesMalformedVariablesNamingThem) {
  auto run = [](const std::string& env, const std::string& options = "") {
    return shell(
        "env -u SLURM_JOB_CPUS_PER_NODE -u SLURM_GPUS_ON_NODE -u CUDA_VISIBLE_DEVICES "
        "SLURM_JOB_ID=1 SLURM_JOB_NODELIST=n1 " +
        env + " " TROUPE_CLI " slurm " + options + " -- true");
  };
  auto [rc, out] = run("SLURM_JOB_CPUS_PER_NODE='2(x3'");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("SLURM_JOB_CPUS_PER_NODE='2(x3'"), std::string::npos) << out;
  std::tie(rc, out) = run("SLURM_JOB_CPUS_PER_NODE=2 SLURM_GPUS_ON_NODE=2abc");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("SLURM_GPUS_ON_NODE='2abc' is not a count of GPUs"), std::string::npos) << out;
  // "-1" hides every GPU: none to give (it used to pass as 1).
  std::tie(rc, out) = run("SLURM_JOB_CPUS_PER_NODE=2 CUDA_VISIBLE_DEVICES=-1", "--gpus-per-node 1");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--gpus-per-node 1 but the allocation has 0 GPU(s)"), std::string::npos) << out;
}

// Bad options are refused before anything runs or a script is printed: a
// --start-timeout of 0, below or NaN (it failed the job at the first look
// for the head), and --print-sbatch without a driver (a script that could
// only fail in the queue).
TEST(SlurmOptions, BadStartTimeoutAndAMissingDriverAreRefused) {
  auto run = [](const std::string& args) { return shell(TROUPE_CLI " slurm " + args); };
  for (const char* bad : {"0", "-1", "nan"}) {
    auto [rc, out] = run(std::string("--print-sbatch --start-timeout ") + bad + " -- ./driver");
    EXPECT_EQ(rc, 2) << bad << ": " << out;
    EXPECT_NE(out.find(std::string("--start-timeout ") + bad + " must be seconds in (0, 604800]"), std::string::npos)
        << out;
  }
  auto [rc, out] = run("--print-sbatch");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("give the driver after --"), std::string::npos) << out;
  std::tie(rc, out) = run("--print-sbatch --start-timeout 90 -- ./driver");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("--start-timeout 90 -- './driver'"), std::string::npos) << out;
  // A driver that is not there is said before scontrol runs or anything
  // starts (it was found missing once the whole cluster was up).
  std::tie(rc, out) =
      shell("SLURM_JOB_ID=1 SLURM_JOB_NODELIST=n1 SLURM_JOB_CPUS_PER_NODE=2 PATH=/nonexistent " TROUPE_CLI
            " slurm -- no-such-driver");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("troupe slurm: driver 'no-such-driver' is not an executable file on PATH"), std::string::npos)
      << out;
  // scontrol failing is said as reading the allocation, under the command's name.
  std::tie(rc, out) =
      shell("SLURM_JOB_ID=1 SLURM_JOB_NODELIST=n1 SLURM_JOB_CPUS_PER_NODE=2 PATH=/nonexistent " TROUPE_CLI
            " slurm -- /bin/true");
  EXPECT_EQ(rc, 1) << out;
  EXPECT_EQ(out.rfind("troupe slurm: reading the allocation: scontrol is not on PATH (/nonexistent)", 0), 0u) << out;
}

// What the node agent of each node is started with: its own CPUs, and by
// default its own GPUs (SLURM_GPUS_ON_NODE of its step, else none named, so
// that the agent counts them) rather than the batch node's count for all:
// nodes of one job may have different GPUs. --gpus-per-node N gives N to
// every node. The script runs here with `echo` for troupe.
// The script's output for `env` (NAME=VALUE, set in the child), GPUS and
// the batch node's name, with `troupe` run as the program given.
std::string run_agent_script(const std::vector<std::string>& env, const std::string& gpus,
                             const std::string& batch = "", const std::string& troupe = "echo") {
  int fds[2];
  if (::pipe(fds) != 0) return std::string("pipe failed");
  const std::string script = troupe::launcher::slurm_agent_script();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::close(fds[0]);
    ::unsetenv("SLURM_GPUS_ON_NODE");
    ::unsetenv("TROUPE_KEEP_SESSION");
    for (const auto& kv : env) ::putenv(const_cast<char*>(kv.c_str()));
    ::execl("/bin/sh", "sh", "-c", script.c_str(), "troupe-agent", troupe.c_str(), "head:1", gpus.c_str(),
            batch.c_str(), "4", "2", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(fds[1]);
  std::string out;
  char buf[512];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  ::waitpid(pid, nullptr, 0);
  return out;
}

// What the node agent of each node is started with: its own CPUs, and by
// default its own GPUs (SLURM_GPUS_ON_NODE of its step, else none named, so
// that the agent counts them) rather than the batch node's count for all:
// nodes of one job may have different GPUs. --gpus-per-node N gives N to
// every node. The script runs here with `echo` for troupe.
TEST(SlurmAgentScript, EachNodeOffersItsOwnGpus) {
  auto agent = [](const std::vector<std::string>& env, const std::string& gpus) { return run_agent_script(env, gpus); };
  EXPECT_EQ(agent({"SLURM_NODEID=1", "SLURM_GPUS_ON_NODE=3"}, "auto"),
            "start --block --no-token-file --address head:1 --resources CPU=2,GPU=3\n");
  EXPECT_EQ(agent({"SLURM_NODEID=0"}, "auto"), "start --block --no-token-file --address head:1 --resources CPU=4\n");
  EXPECT_EQ(agent({"SLURM_NODEID=0", "SLURM_GPUS_ON_NODE=gpu:2"}, "auto"),
            "start --block --no-token-file --address head:1 --resources CPU=4\n");
  EXPECT_EQ(agent({"SLURM_NODEID=1", "SLURM_GPUS_ON_NODE=3"}, "1"),
            "start --block --no-token-file --address head:1 --resources CPU=2,GPU=1\n");
  EXPECT_NE(agent({"SLURM_NODEID=5"}, "auto").find("is not one of the job's 2 nodes"), std::string::npos);
}

// The batch node's agent runs in the head's session directory, which troupe
// slurm keeps or removes. Another node's runs in a directory of its own
// inside it, removed once the agent has stopped (a node's token and logs
// outlived every job on a node with its own TMPDIR), and so is the session
// path where nothing else is in it; TROUPE_KEEP_SESSION keeps it. (The
// fake troupe here writes a file named token into it.)
TEST(SlurmAgentScript, ANodeOtherThanTheBatchNodeRemovesItsSessionAfterItsAgent) {
  const auto dir = troupe::test::fresh_dir("slurm-agent");
  const std::string fake = (dir / "fake-troupe").string();
  std::ofstream(fake) << "#!/bin/sh\necho \"in $TROUPE_SESSION_DIR\"\necho secret > \"$TROUPE_SESSION_DIR/token\"\n";
  ::chmod(fake.c_str(), 0755);
  const std::string session = (dir / "troupe-slurm-7-1").string();
  const std::string session_env = "TROUPE_SESSION_DIR=" + session;

  // Node 1 (n2), with the batch node n1: its own directory, gone after.
  std::string out = run_agent_script({"SLURM_NODEID=1", "SLURMD_NODENAME=n2", session_env}, "auto", "n1", fake);
  EXPECT_EQ(out, "in " + session + "/node-1\n");
  EXPECT_FALSE(fs::exists(session)) << out;
  // The batch node keeps its (the head's) directory for troupe slurm.
  fs::create_directories(session);
  out = run_agent_script({"SLURM_NODEID=0", "SLURMD_NODENAME=n1", session_env}, "auto", "n1", fake);
  EXPECT_EQ(out, "in " + session + "\n");
  EXPECT_TRUE(fs::exists(session + "/token"));
  // Nodes sharing TMPDIR: the other node removes only its own directory.
  out = run_agent_script({"SLURM_NODEID=1", "SLURMD_NODENAME=n2", session_env}, "auto", "n1", fake);
  EXPECT_FALSE(fs::exists(session + "/node-1")) << out;
  EXPECT_TRUE(fs::exists(session + "/token")) << out;
  // TROUPE_KEEP_SESSION: the node's directory stays.
  out = run_agent_script({"SLURM_NODEID=1", "SLURMD_NODENAME=n2", session_env, "TROUPE_KEEP_SESSION=1"}, "auto", "n1",
                         fake);
  EXPECT_TRUE(fs::exists(session + "/node-1/token")) << out;
  troupe::core::remove_tree(dir);
}

namespace {

// A Slurm of two scripts on PATH: scontrol names one node, n1, at
// `node_addr`; srun's step never comes up (its agents never join).
// Returns the PATH to run troupe slurm with.
std::string fake_slurm(const fs::path& dir, const std::string& node_addr) {
  fs::create_directories(dir / "bin");
  const std::string scontrol = (dir / "bin" / "scontrol").string();
  std::ofstream(scontrol) << "#!/bin/sh\n"
                             "if [ \"$2\" = hostnames ]; then echo n1; else echo \"NodeName=n1 NodeAddr="
                          << node_addr << " State=IDLE\"; fi\n";
  const std::string srun = (dir / "bin" / "srun").string();
  std::ofstream(srun) << "#!/bin/sh\nexec sleep 600\n";
  ::chmod(scontrol.c_str(), 0755);
  ::chmod(srun.c_str(), 0755);
  return (dir / "bin").string() + ":" + (std::getenv("PATH") ? std::getenv("PATH") : "/usr/bin:/bin");
}

}  // namespace

// troupe slurm runs on the allocation's first node, which hosts the head.
// In salloc's shell on a login node it started the head there on the first
// node's address, which it cannot bind, and said only "the head did not
// start": refused before anything starts, naming the node and the shell's.
TEST(SlurmCli, ItRefusesToRunAnywhereButTheAllocationsFirstNode) {
  const auto dir = troupe::test::fresh_dir("slurm-login-node");
  const std::string path = fake_slurm(dir, "192.0.2.1");
  auto run = [&](const std::string& node) {
    return shell("env -u SLURMD_NODENAME " + node + " PATH='" + path +
                 "' SLURM_JOB_ID=1 SLURM_JOB_NODELIST=n1 SLURM_JOB_CPUS_PER_NODE=2 TMPDIR='" + dir.string() +
                 "' " TROUPE_CLI " slurm -- /bin/true");
  };
  auto [rc, out] = run("");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("the allocation's first node (n1)"), std::string::npos) << out;
  EXPECT_NE(out.find("SLURMD_NODENAME is not set"), std::string::npos) << out;
  std::tie(rc, out) = run("SLURMD_NODENAME=n2");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("is on n2 (SLURMD_NODENAME)"), std::string::npos) << out;
  for (const auto& entry : fs::directory_iterator(dir))
    EXPECT_EQ(entry.path().filename().string().rfind("troupe-slurm-", 0), std::string::npos)
        << "a session was made: " << entry.path();
  troupe::core::remove_tree(dir);
}

// A signal while the cluster starts (Slurm's SIGTERM at a preemption or a
// time limit, Ctrl-C, a closed terminal) is said as that signal and exits
// 128 + it; it was said as a start that timed out ("0 of 1 node agents
// joined in 120 s", two seconds after the start) with exit 1, and SIGHUP
// killed troupe slurm outright.
TEST(SlurmCli, ASignalWhileTheClusterStartsIsSaidAsThatSignal) {
  const auto dir = troupe::test::fresh_dir("slurm-signal");
  const std::string path = fake_slurm(dir, "127.0.0.1");
  // To troupe slurm alone, and to its whole process group as Slurm signals
  // a step (srun and the head get it too, and may end first: that was said
  // as "srun of the node agents ended", exit 1).
  for (const bool group : {false, true})
    for (const auto& [sig, name] :
         {std::pair{SIGTERM, "SIGTERM"}, std::pair{SIGINT, "SIGINT"}, std::pair{SIGHUP, "SIGHUP"}}) {
      // Signalled once its head is up (its address written), while the wait
      // for the agents goes on.
      auto [rc, out] = shell("timeout 120 sh -c 'SLURMD_NODENAME=n1 PATH=\"" + path +
                             "\" SLURM_JOB_ID=1 SLURM_JOB_NODELIST=n1 SLURM_JOB_CPUS_PER_NODE=2 TMPDIR=\"" +
                             dir.string() + "\" " + (group ? "setsid " : "") +
                             TROUPE_CLI
                             " slurm --start-timeout 300 -- /bin/true & pid=$!; "
                             "while [ ! -s \"" +
                             dir.string() +
                             "/troupe-slurm-1-$pid/address\" ]; do kill -0 $pid || exit 99; sleep 0.05; done; kill -" +
                             std::to_string(sig) + (group ? " -$pid" : " $pid") + "; wait $pid; echo \"rc=$?\"'");
      EXPECT_EQ(rc, 0) << name << ": " << out;
      EXPECT_NE(out.find("rc=" + std::to_string(128 + sig)), std::string::npos) << name << ": " << out;
      // Before the head was up (troupe slurm had not yet read the address
      // the head wrote) or while the agents were awaited: said either way.
      EXPECT_NE(out.find(std::string("troupe slurm: stopped by ") + name + " before the "), std::string::npos) << out;
      EXPECT_EQ(out.find("joined in"), std::string::npos) << out;
      EXPECT_EQ(out.find("did not start in"), std::string::npos) << out;
    }
  troupe::core::remove_tree(dir);
}
