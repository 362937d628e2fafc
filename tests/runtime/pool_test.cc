// The node agent's warm worker pool on a LocalCluster: real node agents and
// real pooled worker processes. A pooled worker runs as
// "troupe-worker:pooled" (its argv[0]) until an actor takes it, then as
// "troupe-worker:<class>" like a cold worker; the tests find a node's idle
// ones as its children by that name, and its count through Runtime::nodes().
#include <gtest/gtest.h>
#include <malloc.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>

#include "tests/support/process.h"
#include "tests/support/wait.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/node/script_executable.h"
#include "troupe/runtime/node/worker_pool.h"
#include "troupe/runtime/testing/local_cluster.h"

using namespace std::chrono_literals;
using troupe::test::eventually;
using troupe::test::process_gone;

class PoolProbe {
 public:
  PoolProbe() = default;
  int pid() const { return getpid(); }
  std::string env(std::string name) const {
    const char* v = std::getenv(name.c_str());
    return v ? v : "<unset>";
  }
  std::vector<int> gpus() const { return troupe::this_actor::gpu_ids(); }
  // Whether a 24 MiB block comes from its own mapping (glibc's default for
  // blocks that large) rather than from the heap (TROUPE_WORKER_MALLOC's
  // "reuse"). The actor thread's arena, like a training step's.
  bool large_block_mapped() const {
    const size_t before = ::mallinfo2().hblkhd;
    // volatile: the compiler may not drop the malloc/free pair.
    volatile char* p = static_cast<volatile char*>(std::malloc(24u << 20));
    p[0] = 1;
    const size_t during = ::mallinfo2().hblkhd;
    std::free(const_cast<char*>(p));
    return during > before;
  }
  // The command line's first string: "troupe-worker:PoolProbe", pooled or cold.
  std::string argv0() const {
    std::ifstream f("/proc/self/cmdline");
    std::string s;
    std::getline(f, s, '\0');
    return s;
  }
  // A worker taken from the pool keeps the room its idle command line had
  // (zeros after the title); a cold worker's ends with its argv[0].
  bool from_pool() const {
    std::ifstream f("/proc/self/cmdline");
    const std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    return all.size() > argv0().size() + 1;
  }
};
TROUPE_ACTOR(PoolProbe, &PoolProbe::pid, &PoolProbe::env, &PoolProbe::gpus, &PoolProbe::argv0, &PoolProbe::from_pool,
             &PoolProbe::large_block_mapped)

namespace {

constexpr const char* kPooledName = "troupe-worker:pooled";

// An actor's worker: titled for its class either way, from the pool or
// started for it (cold).
template <class Handle>
void expect_worker(Handle& a, bool pooled) {
  EXPECT_EQ(a.call(&PoolProbe::argv0).get(), "troupe-worker:PoolProbe");
  EXPECT_EQ(a.call(&PoolProbe::from_pool).get(), pooled) << (pooled ? "started cold" : "taken from the pool");
}

std::string read_first(const std::string& path, char delim) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s, delim);
  return s;
}

// Live (not zombie) children of `parent` named `kPooledName` but for
// `actors` (a taken worker keeps its argv[0]): its idle workers.
std::set<pid_t> idle_children(pid_t parent, const std::set<pid_t>& actors = {}) {
  std::set<pid_t> out;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string stat = read_first(entry.path() / "stat", '\n');
    auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 1));
    char state = 0;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid != parent || state == 'Z' || actors.count(std::stoi(name))) continue;
    if (read_first(entry.path() / "cmdline", '\0') == kPooledName) out.insert(std::stoi(name));
  }
  return out;
}

uint32_t idle_reported(troupe::Runtime& rt, uint64_t node_id) {
  for (const auto& n : rt.nodes())
    if (n.id == node_id) return n.idle_workers;
  return 0;
}

troupe::testing::LocalClusterOptions one_node(uint32_t pool_size, std::chrono::milliseconds idle_timeout = 5min) {
  troupe::testing::LocalClusterOptions o;
  o.nodes = {{{"CPU", 4}, {"GPU", 2}}};
  o.worker_pool_size = pool_size;
  o.worker_idle_timeout = idle_timeout;
  return o;
}

}  // namespace

TEST(WorkerPool, RefillsAfterSpawnsAndReportsIdleWorkers) {
  troupe::testing::LocalCluster cluster(one_node(2));
  auto rt = cluster.connect();
  ASSERT_TRUE(eventually([&] { return idle_reported(rt, cluster.node_id(0)) == 2; }, 30s));
  std::set<pid_t> before = idle_children(cluster.node_pid(0));
  ASSERT_EQ(before.size(), 2u);

  auto a = rt.spawn<PoolProbe>({});
  pid_t pid = a.call(&PoolProbe::pid).get();
  expect_worker(a, true);
  EXPECT_TRUE(before.count(pid)) << "actor's worker " << pid << " was not one of the idle ones";
  std::vector<troupe::ActorHandle<PoolProbe>> more;
  for (int i = 0; i < 3; ++i) more.push_back(rt.spawn<PoolProbe>({}));
  std::set<pid_t> actors{pid};
  for (auto& h : more) actors.insert(h.call(&PoolProbe::pid).get());
  EXPECT_EQ(actors.size(), 4u);

  // Back to two idle workers, none of them an actor's.
  ASSERT_TRUE(eventually([&] { return idle_reported(rt, cluster.node_id(0)) == 2; }, 30s));
  EXPECT_EQ(idle_children(cluster.node_pid(0), actors).size(), 2u);
}

// An assignment larger than the pool socket's buffer (an actor's
// environment of 400 KiB) waits for the idle worker to read it: the socket
// is non-blocking, and EAGAIN was taken for a dead worker, so each idle
// worker of the executable was killed in turn and the actor started cold.
TEST(WorkerPool, ALargeAssignmentIsTakenByAnIdleWorker) {
  troupe::testing::LocalCluster cluster(one_node(2));
  auto rt = cluster.connect();
  ASSERT_TRUE(eventually([&] { return idle_reported(rt, cluster.node_id(0)) == 2; }, 30s));
  const std::set<pid_t> before = idle_children(cluster.node_pid(0));
  ASSERT_EQ(before.size(), 2u);
  std::vector<std::string> env;
  for (char c : {'A', 'B', 'C', 'D'}) env.push_back(std::string("BIG_") + c + "=" + std::string(100 << 10, c));
  auto a = rt.spawn<PoolProbe>({.env = env});
  const pid_t pid = a.call(&PoolProbe::pid).get();
  expect_worker(a, true);
  EXPECT_TRUE(before.count(pid)) << "actor's worker " << pid << " was not one of the idle ones";
  EXPECT_EQ(a.call(&PoolProbe::env, std::string("BIG_D")).get(), std::string(100 << 10, 'D'));
  for (pid_t p : before) {
    if (p != pid) {
      EXPECT_FALSE(process_gone(p)) << "idle worker " << p << " was killed";
    }
  }
}

// An executable rebuilt at its path (a new file renamed over it) is not
// served by idle workers started from the old file: they ran the old code
// (a new actor class: "no constructor"; a changed method: its old body).
TEST(WorkerPool, IdleWorkersOfARebuiltExecutableAreNotHandedOut) {
  const auto dir = std::filesystem::path(::testing::TempDir()) / ("pool-rebuilt-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const auto app = dir / "app";
  std::filesystem::copy_file("/proc/self/exe", app);
  troupe::testing::LocalCluster cluster(one_node(2));
  auto rt = cluster.connect();
  const pid_t node = cluster.node_pid(0);
  auto first = rt.spawn<PoolProbe>({.executable = app.string()});
  const std::set<pid_t> actor{first.call(&PoolProbe::pid).get()};
  // The pool fills with workers of `app` (and of the test binary, whose
  // idle workers the cluster started).
  auto of_app = [&] {
    std::set<pid_t> out;
    for (pid_t p : idle_children(node, actor)) {
      std::error_code ec;
      if (std::filesystem::read_symlink("/proc/" + std::to_string(p) + "/exe", ec) == app) out.insert(p);
    }
    return out;
  };
  ASSERT_TRUE(eventually([&] { return of_app().size() == 2; }, 30s));
  const std::set<pid_t> old = of_app();
  // The rebuild: a new file renamed over the path.
  std::filesystem::copy_file("/proc/self/exe", dir / "app.new");
  std::filesystem::rename(dir / "app.new", app);
  auto second = rt.spawn<PoolProbe>({.executable = app.string()});
  const pid_t pid = second.call(&PoolProbe::pid).get();
  EXPECT_FALSE(old.count(pid)) << "an idle worker of the old file took the actor";
  std::error_code ec;
  const std::string exe = std::filesystem::read_symlink("/proc/" + std::to_string(pid) + "/exe", ec).string();
  EXPECT_EQ(exe, app.string());  // not "app (deleted)"
  for (pid_t p : old) EXPECT_TRUE(eventually([&] { return process_gone(p); }, 10s)) << p;
  std::filesystem::remove_all(dir);
}

TEST(WorkerPool, IdleWorkersAreReapedAfterTheTimeoutAndComeBackWithUse) {
  troupe::testing::LocalCluster cluster(one_node(2, 400ms));
  auto rt = cluster.connect();
  pid_t node = cluster.node_pid(0);
  ASSERT_TRUE(
      eventually([&] { return idle_children(node).empty() && idle_reported(rt, cluster.node_id(0)) == 0; }, 30s));
  // A spawn makes the executable used again: its pool fills, then times out.
  auto a = rt.spawn<PoolProbe>({});
  std::set<pid_t> actor{a.call(&PoolProbe::pid).get()};
  std::set<pid_t> seen;
  ASSERT_TRUE(eventually(
      [&] {
        for (pid_t p : idle_children(node, actor)) seen.insert(p);
        return !seen.empty() && idle_children(node, actor).empty();
      },
      30s));
  for (pid_t p : seen) EXPECT_TRUE(eventually([&] { return process_gone(p); }, 10s)) << p;
  // The actor itself is not an idle worker and lives on.
  EXPECT_EQ(a.info().state, troupe::ActorState::kAlive);
  EXPECT_GT(a.call(&PoolProbe::pid).get(), 0);
}

TEST(WorkerPool, PooledActorGetsItsGpusAndEnvironment) {
  troupe::testing::LocalCluster cluster(one_node(2));
  auto rt = cluster.connect();
  ASSERT_TRUE(eventually([&] { return idle_children(cluster.node_pid(0)).size() == 2; }, 30s));
  auto a = rt.spawn<PoolProbe>({.resources = {{"GPU", 1}}, .env = {"POOL_TEST_VAR=hello world"}});
  expect_worker(a, true);
  std::vector<int> gpus = a.call(&PoolProbe::gpus).get();
  ASSERT_EQ(gpus.size(), 1u);
  EXPECT_EQ(a.call(&PoolProbe::env, std::string("CUDA_VISIBLE_DEVICES")).get(), std::to_string(gpus[0]));
  EXPECT_EQ(a.call(&PoolProbe::env, std::string("POOL_TEST_VAR")).get(), "hello world");
  EXPECT_EQ(a.call(&PoolProbe::env, std::string("TROUPE_ACTOR_ID")).get(), std::to_string(a.id()));
  EXPECT_EQ(a.call(&PoolProbe::env, std::string("TROUPE_NODE_ID")).get(), std::to_string(cluster.node_id(0)));
  EXPECT_EQ(a.call(&PoolProbe::env, std::string("TROUPE_POOL_FD")).get(), "<unset>");

  // A variable the loader reads at exec cannot reach a running worker: cold.
  auto b = rt.spawn<PoolProbe>({.env = {"LD_BIND_NOW=1"}});
  expect_worker(b, false);
  EXPECT_EQ(b.call(&PoolProbe::env, std::string("LD_BIND_NOW")).get(), "1");
  EXPECT_EQ(b.call(&PoolProbe::env, std::string("CUDA_VISIBLE_DEVICES")).get(), "");
}

// An agent started with CUDA_VISIBLE_DEVICES (a Slurm step's GPUs, a
// host's share given to one agent) numbers only those: its GPU k is the
// k-th of that list, which is what a worker is given, pooled or cold. It
// gave ids 0..n-1 as the host's own (GPU 0, not 5).
TEST(WorkerPool, WorkersGetTheAgentsOwnVisibleDevices) {
  auto o = one_node(2);
  o.env = {"CUDA_VISIBLE_DEVICES= 5, 7"};  // blanks as torch reads them
  troupe::testing::LocalCluster cluster(o);
  auto rt = cluster.connect();
  auto pooled = rt.spawn<PoolProbe>({.resources = {{"GPU", 1}}});
  auto cold = rt.spawn<PoolProbe>({.resources = {{"GPU", 1}}, .env = {"LD_BIND_NOW=1"}});
  expect_worker(cold, false);
  std::set<std::string> seen{pooled.call(&PoolProbe::env, std::string("CUDA_VISIBLE_DEVICES")).get(),
                             cold.call(&PoolProbe::env, std::string("CUDA_VISIBLE_DEVICES")).get()};
  EXPECT_EQ(seen, (std::set<std::string>{"5", "7"}));
}

// An agent offering more GPUs than its CUDA_VISIBLE_DEVICES names (an
// override beside a mask) leaves the rest out of its workers' lists: the
// worker of node GPU 1 sees no device, not the host's GPU 1 (which the
// agent was not given).
TEST(WorkerPool, GpusPastTheAgentsVisibleDevicesAreNoDevice) {
  auto o = one_node(2);
  o.env = {"CUDA_VISIBLE_DEVICES=5"};
  troupe::testing::LocalCluster cluster(o);
  auto rt = cluster.connect();
  auto a = rt.spawn<PoolProbe>({.resources = {{"GPU", 1}}});
  auto b = rt.spawn<PoolProbe>({.resources = {{"GPU", 1}}});
  std::set<std::string> seen{a.call(&PoolProbe::env, std::string("CUDA_VISIBLE_DEVICES")).get(),
                             b.call(&PoolProbe::env, std::string("CUDA_VISIBLE_DEVICES")).get()};
  EXPECT_EQ(seen, (std::set<std::string>{"5", ""}));
}

// Workers keep freed memory in their heap (see malloc_policy.h): a large
// block is not a mapping of its own there, unless the actor asks for the
// system allocator's defaults. Pooled and cold workers alike.
TEST(WorkerPool, WorkersKeepLargeBlocksInTheHeapUnlessAskedNotTo) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the sanitizer's allocator replaces glibc's";
#endif
  troupe::testing::LocalCluster cluster(one_node(2));
  auto rt = cluster.connect();
  auto pooled = rt.spawn<PoolProbe>({});
  expect_worker(pooled, true);
  EXPECT_FALSE(pooled.call(&PoolProbe::large_block_mapped).get());
  EXPECT_NE(pooled.call(&PoolProbe::env, std::string("GLIBC_TUNABLES")).get().find("glibc.malloc.hugetlb=1"),
            std::string::npos);
  auto system = rt.spawn<PoolProbe>({.env = {"TROUPE_WORKER_MALLOC=system"}});
  EXPECT_EQ(system.call(&PoolProbe::env, std::string("TROUPE_WORKER_MALLOC")).get(), "system");
  EXPECT_TRUE(system.call(&PoolProbe::large_block_mapped).get());
  EXPECT_EQ(system.call(&PoolProbe::env, std::string("GLIBC_TUNABLES")).get().find("hugetlb"), std::string::npos);
  auto cold = rt.spawn<PoolProbe>({.env = {"LD_BIND_NOW=1"}});
  expect_worker(cold, false);
  EXPECT_FALSE(cold.call(&PoolProbe::large_block_mapped).get());
}

// An actor's own setting of a variable its node agent also has wins, in a
// cold worker (the agent's environment first, the actor's after) as in a
// pooled one (setenv over the inherited value).
TEST(WorkerPool, AnActorsEnvOverridesTheAgentsInColdAndPooledWorkers) {
  ::setenv("POOL_TEST_OVERRIDE", "agent", 1);
  troupe::testing::LocalCluster cluster(one_node(2));
  ::unsetenv("POOL_TEST_OVERRIDE");
  auto rt = cluster.connect();
  auto cold = rt.spawn<PoolProbe>({.env = {"LD_BIND_NOW=1", "POOL_TEST_OVERRIDE=actor"}});
  expect_worker(cold, false);
  EXPECT_EQ(cold.call(&PoolProbe::env, std::string("POOL_TEST_OVERRIDE")).get(), "actor");
  auto pooled = rt.spawn<PoolProbe>({.env = {"POOL_TEST_OVERRIDE=actor"}});
  expect_worker(pooled, true);
  EXPECT_EQ(pooled.call(&PoolProbe::env, std::string("POOL_TEST_OVERRIDE")).get(), "actor");
  EXPECT_EQ(rt.spawn<PoolProbe>({}).call(&PoolProbe::env, std::string("POOL_TEST_OVERRIDE")).get(), "agent");
}

TEST(WorkerPool, RestartTakesAPooledWorker) {
  troupe::testing::LocalCluster cluster(one_node(2));
  auto rt = cluster.connect();
  auto a = rt.spawn<PoolProbe>({.max_restarts = 2});
  pid_t first = a.call(&PoolProbe::pid).get();
  ASSERT_TRUE(eventually([&] { return idle_children(cluster.node_pid(0), {first}).size() == 2; }, 30s));
  std::set<pid_t> idle = idle_children(cluster.node_pid(0), {first});
  ASSERT_EQ(::kill(first, SIGKILL), 0);
  ASSERT_TRUE(
      eventually([&] { return a.info().incarnation == 1 && a.info().state == troupe::ActorState::kAlive; }, 30s));
  pid_t second = a.call(&PoolProbe::pid).get();
  EXPECT_NE(second, first);
  EXPECT_TRUE(idle.count(second)) << "the restart did not take an idle worker";
  EXPECT_EQ(a.call(&PoolProbe::env, std::string("TROUPE_INCARNATION")).get(), "1");
}

TEST(WorkerPool, IdleWorkerKilledDisturbsNothing) {
  troupe::testing::LocalCluster cluster(one_node(2));
  auto rt = cluster.connect();
  auto a = rt.spawn<PoolProbe>({});
  pid_t actor_pid = a.call(&PoolProbe::pid).get();
  pid_t node = cluster.node_pid(0);
  ASSERT_TRUE(eventually([&] { return idle_children(node, {actor_pid}).size() == 2; }, 30s));
  pid_t victim = *idle_children(node, {actor_pid}).begin();
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  // The pool refills without the dead one; no actor noticed.
  ASSERT_TRUE(eventually(
      [&] {
        auto now = idle_children(node, {actor_pid});
        return now.size() == 2 && !now.count(victim);
      },
      30s));
  EXPECT_EQ(a.info().state, troupe::ActorState::kAlive);
  EXPECT_EQ(a.info().restarts, 0);
  EXPECT_EQ(a.call(&PoolProbe::pid).get(), actor_pid);
  auto b = rt.spawn<PoolProbe>({});
  EXPECT_GT(b.call(&PoolProbe::pid).get(), 0);
}

// An idle worker that is stopped (SIGSTOP, or hung) when it is taken never
// acknowledges its assignment: past the bound the pool kills it and the
// actor starts in a worker of its own, late but neither failed nor
// restarted, and the pool fills again.
TEST(WorkerPool, StoppedIdleWorkerIsKilledAndItsActorStartsCold) {
  auto o = one_node(1);
  o.worker_assign_timeout = 1s;
  troupe::testing::LocalCluster cluster(o);
  auto rt = cluster.connect();
  pid_t node = cluster.node_pid(0);
  ASSERT_TRUE(eventually([&] { return idle_reported(rt, cluster.node_id(0)) == 1; }, 30s));
  std::set<pid_t> stopped = idle_children(node);
  ASSERT_EQ(stopped.size(), 1u);
  for (pid_t p : stopped) ASSERT_EQ(::kill(p, SIGSTOP), 0);

  auto a = rt.spawn<PoolProbe>({});
  ASSERT_TRUE(eventually([&] { return a.info().state == troupe::ActorState::kAlive; }, 30s))
      << "the actor handed to a stopped pooled worker never started";
  pid_t pid = a.call(&PoolProbe::pid).get();
  EXPECT_FALSE(stopped.count(pid)) << "the actor runs in the stopped worker " << pid;
  expect_worker(a, false);
  EXPECT_EQ(a.info().restarts, 0);
  EXPECT_EQ(a.info().incarnation, 0u);
  for (pid_t p : stopped) EXPECT_TRUE(eventually([&] { return process_gone(p); }, 10s)) << "stopped worker " << p;

  // The pool fills again, and its next worker serves.
  ASSERT_TRUE(eventually([&] { return idle_children(node, {pid}).size() == 1; }, 30s));
  auto b = rt.spawn<PoolProbe>({});
  expect_worker(b, true);
  EXPECT_EQ(a.info().state, troupe::ActorState::kAlive);
}

TEST(WorkerPool, IdleWorkersDieWithTheirAgent) {
  troupe::testing::LocalCluster cluster(one_node(3));
  pid_t node = cluster.node_pid(0);
  ASSERT_TRUE(eventually([&] { return idle_children(node).size() == 3; }, 30s));
  std::set<pid_t> idle = idle_children(node);
  cluster.kill_node(0, SIGKILL);
  for (pid_t p : idle) EXPECT_TRUE(eventually([&] { return process_gone(p); }, 10s)) << "pooled worker " << p;
}

TEST(WorkerPool, SizeZeroStartsEveryWorkerCold) {
  troupe::testing::LocalCluster cluster(one_node(0));
  auto rt = cluster.connect();
  auto a = rt.spawn<PoolProbe>({});
  expect_worker(a, false);
  EXPECT_TRUE(idle_children(cluster.node_pid(0)).empty());
  EXPECT_EQ(idle_reported(rt, cluster.node_id(0)), 0u);
}

TEST(WorkerPool, OutOfRangeOptionsAreRefusedNamingTheValue) {
  auto o = one_node(65);
  try {
    troupe::testing::LocalCluster cluster(o);
    FAIL() << "pool size 65 was accepted";
  } catch (const troupe::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("65"), std::string::npos) << e.what();
  }
  o = one_node(2, 0ms);
  EXPECT_THROW(troupe::testing::LocalCluster{o}, troupe::ConfigError);
  o = one_node(2);
  o.worker_assign_timeout = 0ms;
  try {
    troupe::testing::LocalCluster cluster(o);
    FAIL() << "assign timeout 0 ms was accepted";
  } catch (const troupe::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("assign timeout 0 ms"), std::string::npos) << e.what();
  }
}

namespace {

// A pid no process has now: a child's, once reaped.
pid_t dead_pid() {
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return pid;
}

void touch(const std::string& path) { std::ofstream(path) << "x\n"; }

}  // namespace

TEST(ExitedLogs, KeepsTheNewestAndDeletesOlderOnes) {
  auto dir = std::filesystem::temp_directory_path() / ("troupe-exited-logs-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  troupe::node::ExitedLogs logs(dir.string(), 2);
  std::vector<pid_t> pids;
  for (int i = 0; i < 4; ++i) {
    pids.push_back(dead_pid());
    touch(troupe::node::worker_log_path(dir.string(), pids.back()));
    logs.exited(pids.back());
  }
  EXPECT_EQ(logs.kept(), 2u);
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(std::filesystem::exists(troupe::node::worker_log_path(dir.string(), pids[i])), i >= 2) << i;
  // A pid that exited twice counts once, at its latest exit: it outlives
  // the one that exited between.
  logs.exited(pids[2]);
  pid_t next = dead_pid();
  touch(troupe::node::worker_log_path(dir.string(), next));
  logs.exited(next);
  EXPECT_TRUE(std::filesystem::exists(troupe::node::worker_log_path(dir.string(), pids[2])));
  EXPECT_FALSE(std::filesystem::exists(troupe::node::worker_log_path(dir.string(), pids[3])));
  // A live process's pid: its file is its own now, and stays.
  pid_t live = ::getpid();
  touch(troupe::node::worker_log_path(dir.string(), live));
  logs.exited(live);
  for (int i = 0; i < 2; ++i) {
    pid_t p = dead_pid();
    touch(troupe::node::worker_log_path(dir.string(), p));
    logs.exited(p);
  }
  EXPECT_TRUE(std::filesystem::exists(troupe::node::worker_log_path(dir.string(), live)));
  EXPECT_EQ(logs.kept(), 2u);
  std::filesystem::remove_all(dir);
}

// Each killed or replaced agent left up to `keep` logs of exited workers
// that no agent counted again: a soak's session directory grew by 1,000
// files an agent. The next agent to start there keeps the newest `keep` of
// those no live process runs, by modification time, with their rotated
// parts, and leaves a live process's file alone.
TEST(ExitedLogs, AnAgentStartingBoundsWhatEarlierAgentsLeftBehind) {
  auto dir = std::filesystem::temp_directory_path() / ("troupe-left-logs-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const auto now = std::filesystem::file_time_type::clock::now();
  std::vector<pid_t> pids;
  for (int i = 0; i < 5; ++i) {
    pids.push_back(dead_pid());
    const auto path = troupe::node::worker_log_path(dir.string(), pids.back());
    touch(path);
    touch(path + ".1");
    std::filesystem::last_write_time(path, now - std::chrono::hours(10 - i));  // pids[4] newest
  }
  const auto live = troupe::node::worker_log_path(dir.string(), ::getpid());
  touch(live);
  std::filesystem::last_write_time(live, now - std::chrono::hours(100));
  touch((dir / "worker-notapid.log").string());
  troupe::node::ExitedLogs logs(dir.string(), 2);
  for (int i = 0; i < 5; ++i) {
    const auto path = troupe::node::worker_log_path(dir.string(), pids[i]);
    EXPECT_EQ(std::filesystem::exists(path), i >= 3) << i;
    EXPECT_EQ(std::filesystem::exists(path + ".1"), i >= 3) << i;
  }
  EXPECT_TRUE(std::filesystem::exists(live));
  EXPECT_TRUE(std::filesystem::exists(dir / "worker-notapid.log"));
  std::filesystem::remove_all(dir);
}

// An executable given as a script's text is written once per content into
// a directory of this user's closed to others, and run from there; a
// directory others may write into, or a script too large, is refused
// naming it.
TEST(ScriptExecutable, IsWrittenOncePerContentIntoAPrivateDirectory) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("troupe-script-test-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const std::string a = "#!/bin/sh\necho a\n";
  const std::string b = "#!/bin/sh\necho b\n";
  EXPECT_TRUE(troupe::node::is_script_text(a));
  EXPECT_FALSE(troupe::node::is_script_text("/usr/bin/python3"));
  const std::string pa = troupe::node::script_executable(a, (dir / "launchers").string());
  EXPECT_EQ(troupe::node::script_executable(a, (dir / "launchers").string()), pa);
  const std::string pb = troupe::node::script_executable(b, (dir / "launchers").string());
  EXPECT_NE(pa, pb);
  std::ifstream in(pa);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), a);
  EXPECT_EQ(fs::status(pa).permissions() & fs::perms::owner_exec, fs::perms::owner_exec);
  EXPECT_EQ(fs::status(dir / "launchers").permissions() & fs::perms::others_all, fs::perms::none);
  // A file of that name with other content (a partial write of an older
  // version, say) is replaced.
  std::ofstream(pa, std::ios::trunc) << "#!/bin/sh\n";
  EXPECT_EQ(troupe::node::script_executable(a, (dir / "launchers").string()), pa);
  std::ifstream again(pa);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(again), {}), a);

  fs::create_directories(dir / "open");
  ::chmod((dir / "open").c_str(), 0777);
  try {
    troupe::node::script_executable(a, (dir / "open").string());
    ADD_FAILURE() << "a world-writable directory was taken";
  } catch (const troupe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("mode 0700"), std::string::npos) << e.what();
  }
  try {
    troupe::node::script_executable("#!" + std::string(70000, 'x'), (dir / "launchers").string());
    ADD_FAILURE() << "a 70 kB script was taken";
  } catch (const troupe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("70002 bytes (at most 65536)"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}
