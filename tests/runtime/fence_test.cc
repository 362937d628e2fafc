// Fencing of node agents the head declared dead: a stopped agent's workers
// stop acting once their replacements exist, and the agent, when it wakes
// up, kills what it still runs and joins again as a new node.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "tests/support/process.h"
#include "tests/support/wait.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/testing/local_cluster.h"

using troupe::test::eventually;
using troupe::test::kWaitBound;

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

}  // namespace

TROUPE_ACTOR(Tally, &Tally::add, &Tally::pid, &Tally::node)

TEST(Fencing, StoppedNodeAgentIsFencedAndRejoinsAsANewNode) {
  troupe::testing::LocalClusterOptions o;
  o.heartbeat_ms = 50;
  o.heartbeat_misses = 4;
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
}
