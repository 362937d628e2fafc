// Fencing of node agents the head declared dead: a stopped agent's workers
// stop acting once their replacements exist, and the agent, when it wakes
// up, kills what it still runs and joins again as a new node.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/process.h"
#include "tests/support/tcp_proxy.h"
#include "tests/support/wait.h"
#include "troupe/runtime/client/core.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/testing/local_cluster.h"

using troupe::test::eventually;
using troupe::test::kWaitBound;
using troupe::test::TcpProxy;

namespace {

class Tally {
 public:
  explicit Tally(int start) : value_(start) {}
  int add(int x) { return value_ += x; }
  int pid() const { return getpid(); }
  uint64_t node() const { return std::stoull(std::getenv("TROUPE_NODE_ID")); }

 private:
  int value_;
};

// A process that has exited (a zombie its stopped parent has not reaped yet
// counts) or is gone.
bool exited(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;
  auto close = line.rfind(')');
  return close == std::string::npos || close + 2 >= line.size() || line[close + 2] == 'Z';
}

const troupe::NodeInfo* node_with_id(const std::vector<troupe::NodeInfo>& nodes, uint64_t id) {
  for (const auto& n : nodes)
    if (n.id == id) return &n;
  return nullptr;
}

double live_cpus(troupe::Runtime& rt) {
  double cpus = 0;
  for (const auto& n : rt.nodes())
    if (n.alive) cpus += n.total.count("CPU") ? n.total.at("CPU") : 0;
  return cpus;
}

// Appends "PID VALUE" per call to a file: who ran which call.
class Journal {
 public:
  explicit Journal(std::string path) : path_(std::move(path)) {}
  int write(int value) {
    std::ofstream(path_, std::ios::app) << getpid() << " " << value << "\n";
    return getpid();
  }
  uint64_t node() const { return std::stoull(std::getenv("TROUPE_NODE_ID")); }

 private:
  std::string path_;
};

std::string read_all(const std::string& path) {
  std::ifstream f(path);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

}  // namespace

TROUPE_ACTOR(Tally, &Tally::add, &Tally::pid, &Tally::node)
TROUPE_ACTOR(Journal, &Journal::write, &Journal::node)

TEST(Fencing, StoppedNodeAgentIsFencedAndRejoinsAsANewNode) {
  troupe::testing::LocalClusterOptions o;
  o.heartbeat_ms = 50;
  o.heartbeat_misses = 8;  // a lease of 350 ms: a loaded machine's head may stall 150
  troupe::testing::LocalCluster cluster(o);
  troupe::Runtime rt = cluster.connect();
  const double cpus = live_cpus(rt);
  auto c = rt.spawn<Tally>({.resources = {{"CPU", 2}}, .max_restarts = 1}, 3);
  const uint64_t first = c.call(&Tally::node).get(kWaitBound);
  const size_t index = cluster.node_id(0) == first ? 0 : 1;
  const int old_pid = c.call(&Tally::pid).get(kWaitBound);
  const pid_t agent = cluster.node_pid(index);

  // The agent stops heartbeating; its worker keeps running until the head
  // declares the node dead, then stops itself (the head closed its
  // connection) although the agent cannot kill it.
  cluster.kill_node(index, SIGSTOP);
  ASSERT_TRUE(eventually([&] {
    auto i = c.info();
    return i.state == troupe::ActorState::kAlive && i.node_id != first;
  }));
  EXPECT_TRUE(eventually([&] { return exited(old_pid); })) << "stale worker " << old_pid << " still runs";
  // Every call is answered by the new instance, never by the old one.
  for (int i = 0; i < 20; ++i) EXPECT_NE(c.call(&Tally::pid).get(kWaitBound), old_pid);
  EXPECT_EQ(c.call(&Tally::add, 1).get(kWaitBound), 4);

  // Woken up, the agent learns its incarnation is over, reaps its worker and
  // joins again as a new node (same process, new id); the old id stays dead.
  cluster.kill_node(index, SIGCONT);
  uint64_t rejoined = 0;
  ASSERT_TRUE(eventually([&] {
    for (const auto& n : rt.nodes())
      if (n.pid == agent && n.alive && n.id != first) rejoined = n.id;
    return rejoined != 0;
  }));
  const auto nodes = rt.nodes();
  ASSERT_NE(node_with_id(nodes, first), nullptr);
  EXPECT_FALSE(node_with_id(nodes, first)->alive);
  EXPECT_TRUE(eventually([&] { return troupe::test::process_gone(old_pid); }))
      << "old worker " << old_pid << " not reaped";
  // Its resources are back in the pool, and it takes work again.
  EXPECT_TRUE(eventually([&] { return live_cpus(rt) == cpus; }));
  auto d = rt.spawn<Tally>({.resources = {{"CPU", 2}}}, 0);
  EXPECT_EQ(d.call(&Tally::node).get(kWaitBound), rejoined);
  EXPECT_EQ(c.call(&Tally::add, 1).get(kWaitBound), 5);
  // The log of the actor's worker on the fenced node is asked of the same
  // agent, now the rejoined node (it was refused as "node N is not alive").
  // Where its agent keeps no worker log files, the agent says so.
  troupe::wire::ReadLog previous{"actor_previous", c.id()};
  try {
    auto chunk = rt.core()->head().call<troupe::wire::LogChunk>(troupe::wire::Op::kReadLog, previous);
    EXPECT_NE(chunk.path.find(std::to_string(old_pid)), std::string::npos) << chunk.path;
  } catch (const troupe::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("node " + std::to_string(rejoined) + " keeps no worker log files"),
              std::string::npos)
        << e.what();
  }
}

// A whole machine stalls past the fence time (its agent and the actor's
// worker stopped together: a frozen VM): the head restarts the actor
// elsewhere. The old worker, woken while its agent still sleeps, must not
// run the call that waited in its socket meanwhile: that call is its
// replacement's now (the caller retries or fails it). Before the worker's
// StallGuard, it often did, as its call thread read the call before its
// I/O thread read the head's close. A durable head tells a fenced worker
// to end and half-closes; a plain one closes: both are covered.
void stale_worker_runs_no_queued_call(bool durable, int max_concurrency = 1) {
  troupe::testing::LocalClusterOptions o;
  o.heartbeat_ms = 50;
  o.heartbeat_misses = 8;  // a lease of 350 ms: a loaded machine's head may stall 150
  o.durable_head = durable;
  troupe::testing::LocalCluster cluster(o);
  troupe::Runtime rt = cluster.connect();
  const std::string path = ::testing::TempDir() + "journal-" + std::to_string(getpid()) + (durable ? "-d" : "");
  std::remove(path.c_str());
  auto c = rt.spawn<Journal>({.resources = {{"CPU", 2}}, .max_restarts = 1, .max_concurrency = max_concurrency}, path);
  const int old_pid = c.call(&Journal::write, 0).get(kWaitBound);
  const uint64_t first = c.call(&Journal::node).get(kWaitBound);
  const size_t index = cluster.node_id(0) == first ? 0 : 1;
  const pid_t agent = cluster.node_pid(index);

  cluster.kill_node(index, SIGSTOP);
  // Stopped for sure before the calls go: a thread of it could still run
  // one between kill() and the stop.
  ASSERT_TRUE(troupe::test::stop_process(old_pid)) << "worker " << old_pid << " did not stop";
  // They wait in the stopped worker's socket (with more concurrency, for
  // several threads that each must not run one).
  std::vector<decltype(c.call(&Journal::write, 1))> queued;
  for (int i = 0; i < 4; ++i) queued.push_back(c.call(&Journal::write, 1));
  ASSERT_TRUE(eventually([&] {
    auto i = c.info();
    return i.state == troupe::ActorState::kAlive && i.node_id != first;
  }));
  ::kill(old_pid, SIGCONT);  // the worker wakes; its agent sleeps on
  EXPECT_TRUE(eventually([&] { return exited(old_pid); })) << "stale worker " << old_pid << " still runs";
  for (auto& q : queued) {
    try {
      q.get(kWaitBound);  // retried by the new worker, or failed: either is fine
    } catch (const troupe::Error&) {
    }
  }
  const int new_pid = c.call(&Journal::write, 2).get(kWaitBound);
  EXPECT_NE(new_pid, old_pid);
  const std::string journal = read_all(path);
  EXPECT_EQ(journal.find(std::to_string(old_pid) + " 1\n"), std::string::npos)
      << "the stale worker ran the queued call:\n"
      << journal;
  EXPECT_NE(journal.find(std::to_string(new_pid) + " 2\n"), std::string::npos) << journal;
  // The agent wakes and joins again as a new node before the cluster ends.
  cluster.kill_node(index, SIGCONT);
  EXPECT_TRUE(eventually([&] {
    for (const auto& n : rt.nodes())
      if (n.pid == agent && n.alive && n.id != first) return true;
    return false;
  }));
  std::remove(path.c_str());
}

TEST(Fencing, AWorkerWokenAfterItsNodeWasFencedRunsNoQueuedCall) { stale_worker_runs_no_queued_call(false); }

TEST(Fencing, AWorkerWokenAfterItsNodeWasFencedByADurableHeadRunsNoQueuedCall) {
  stale_worker_runs_no_queued_call(true);
}

// Calls drained by several threads: each waits for the one confirmation.
TEST(Fencing, AConcurrentWorkerWokenAfterItsNodeWasFencedRunsNoQueuedCall) {
  stale_worker_runs_no_queued_call(false, 4);
}

// A partition between a node and the head: the node's agent and workers,
// and a driver on their side of the cut, reach the head through a proxy
// that holds every byte; the driver on the head's side still reaches the
// workers. The head fences the node and restarts its actor on the other
// node. The cut-off driver, which cannot learn that, goes on calling the
// old worker; the agent, hearing nothing from the head, kills its workers
// first (HeadLease): the journal has no call of the old worker after its
// replacement's first. Healed, the agent joins again as a new node.
//
// `dropped`: with a durable head, the connections through the proxy break
// too and every new one goes nowhere, so the agent waits to join the head
// again rather than on a connection that is quiet. Its lease runs on: a
// connect to the head's address that is not refused may be a head that
// lives and fences. Before, the old worker served the cut-off driver for
// as long as the partition lasted.
void partitioned_nodes_workers_stop_first(bool dropped) {
  troupe::testing::LocalClusterOptions o;
  o.nodes = {{{"CPU", 2}}};
  o.heartbeat_ms = 200;  // fenced after 1 s, the lease 800 ms: a heartbeat of margin
  o.heartbeat_misses = 5;
  o.durable_head = dropped;
  troupe::testing::LocalCluster cluster(o);
  troupe::Runtime rt = cluster.connect();
  TcpProxy proxy(cluster.address());
  // The direct node is full while the actor is placed: it lands behind the proxy.
  auto blocker = rt.spawn<Tally>({.resources = {{"CPU", 2}}}, 0);
  blocker.call(&Tally::pid).get(kWaitBound);
  const size_t cut = cluster.add_node({{"CPU", 2}}, proxy.address());
  const uint64_t cut_id = cluster.node_id(cut);
  const pid_t agent = cluster.node_pid(cut);
  const std::string path = ::testing::TempDir() + "journal-partition-" + std::to_string(getpid());
  std::remove(path.c_str());
  auto c = rt.spawn<Journal>({.resources = {{"CPU", 2}}, .name = "journal", .max_restarts = 1}, path);
  const int old_pid = c.call(&Journal::write, 0).get(kWaitBound);
  ASSERT_EQ(c.call(&Journal::node).get(kWaitBound), cut_id);
  rt.kill(blocker);
  ASSERT_TRUE(eventually([&] { return live_cpus(rt) == 4; }));

  troupe::InitOptions cut_side;
  cut_side.address = proxy.address();
  cut_side.token = cluster.token();
  troupe::Runtime cut_rt = troupe::Runtime::connect(cut_side);
  auto cut_c = cut_rt.get_actor<Journal>("journal");
  ASSERT_EQ(cut_c.call(&Journal::write, 3).get(kWaitBound), old_pid);

  proxy.hold(true);
  if (dropped) {
    ASSERT_GE(proxy.cut(), 3);  // the agent's, its worker's and the cut-off driver's
  }
  std::atomic<bool> stop{false};
  std::atomic<int> cut_calls{0};
  std::thread cut_driver;
  struct Joiner {
    std::atomic<bool>& stop;
    std::thread& t;
    ~Joiner() {
      stop = true;
      if (t.joinable()) t.join();
    }
  } joiner{stop, cut_driver};
  cut_driver = std::thread([&] {
    while (!stop) {
      try {
        cut_c.call(&Journal::write, 3).get(std::chrono::seconds(1));
        ++cut_calls;
      } catch (const troupe::Error&) {
        // the old worker gone: the cut-off driver cannot learn of another
      }
    }
  });
  int new_pid = 0;
  ASSERT_TRUE(eventually([&] {
    try {
      const int pid = c.call(&Journal::write, 1).get(kWaitBound);
      if (pid != old_pid) new_pid = pid;
    } catch (const troupe::Error&) {
      // the old worker gone, its replacement not yet known: call again
    }
    return new_pid != 0;
  }));
  EXPECT_TRUE(eventually([&] { return exited(old_pid); }, std::chrono::seconds(10)))
      << "worker " << old_pid << " of the cut-off node still runs";
  stop = true;
  cut_driver.join();
  EXPECT_GT(cut_calls.load(), 0) << "the cut-off driver never reached the old worker during the partition";
  const std::string journal = read_all(path);
  const auto first_new = journal.find("\n" + std::to_string(new_pid) + " ");
  ASSERT_NE(first_new, std::string::npos) << journal;
  EXPECT_EQ(journal.find("\n" + std::to_string(old_pid) + " ", first_new), std::string::npos)
      << "the cut-off worker answered after its replacement:\n"
      << journal;

  proxy.hold(false);
  EXPECT_TRUE(eventually([&] {
    for (const auto& n : rt.nodes())
      if (n.pid == agent && n.alive && n.id != cut_id) return true;
    return false;
  })) << "the agent did not join again after the partition";
  std::remove(path.c_str());
}

TEST(Fencing, APartitionedNodesWorkersStopBeforeTheirReplacementsStart) { partitioned_nodes_workers_stop_first(false); }

TEST(Fencing, ANodeWaitingToRejoinADurableHeadAcrossAPartitionStopsItsWorkersFirst) {
  partitioned_nodes_workers_stop_first(true);
}
