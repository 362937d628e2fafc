// Issue 12 item 3: every actor whose process is gone is DEAD with a cause.
// A driver (this binary re-executed, serving GhostDriverRole.Serve) creates
// a placement group with an actor in it and a free actor, then the test
// SIGKILLs the driver and the node agents in each order and asks the head
// that no actor is ALIVE with a dead pid and that the names are free again.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstring>
#include <thread>

#include "tests/support/process.h"
#include "tests/support/wait.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/core/process.h"
#include "troupe/runtime/testing/local_cluster.h"

extern char** environ;

using namespace std::chrono_literals;
using troupe::test::kWaitBound;

class GhostProbe {
 public:
  int pid() const { return getpid(); }
};
TROUPE_ACTOR(GhostProbe, &GhostProbe::pid)

namespace {

using troupe::test::eventually;
using troupe::testing::LocalCluster;

// The driver's role: runs only when re-executed by a test below.
TEST(GhostDriverRole, Serve) {
  const char* address = std::getenv("TROUPE_TEST_DRIVER_ADDRESS");
  if (!address) GTEST_SKIP() << "only run as the driver process of GhostActors tests";
  troupe::InitOptions o;
  o.address = address;
  o.token = std::getenv("TROUPE_TEST_DRIVER_TOKEN");
  troupe::Runtime rt = troupe::Runtime::connect(o);
  auto pg = rt.create_placement_group({{{"CPU", 1}}}, troupe::PlacementStrategy::kPack);
  ASSERT_TRUE(pg.wait(kWaitBound));
  auto in_group = rt.spawn<GhostProbe>(
      {.resources = {{"CPU", 1}}, .name = "ghost-in-group", .max_restarts = 3, .placement_group = &pg});
  auto free = rt.spawn<GhostProbe>({.resources = {{"CPU", 1}}, .name = "ghost-free"});
  ASSERT_TRUE(in_group.wait_ready(kWaitBound));
  ASSERT_TRUE(free.wait_ready(kWaitBound));
  std::printf("READY %llu %llu\n", (unsigned long long)in_group.id(), (unsigned long long)free.id());
  std::fflush(stdout);
  std::this_thread::sleep_for(60s);  // until SIGKILLed (bounded all the same)
}

// A driver process: started, and READY read back, within a bound.
struct Driver {
  pid_t pid = -1;
  uint64_t in_group = 0, free = 0;

  explicit Driver(const LocalCluster& cluster) {
    std::vector<std::string> env_strings = {"TROUPE_TEST_DRIVER_ADDRESS=" + cluster.address(),
                                            "TROUPE_TEST_DRIVER_TOKEN=" + cluster.token()};
    std::vector<char*> env;
    for (char** e = environ; *e; ++e) env.push_back(*e);
    for (auto& s : env_strings) env.push_back(s.data());
    env.push_back(nullptr);
    std::string exe = troupe::core::self_executable_path();
    std::string filter = "--gtest_filter=GhostDriverRole.Serve";
    char* argv[] = {exe.data(), filter.data(), nullptr};
    int fds[2];
    if (pipe(fds) != 0) throw std::runtime_error("pipe");
    pid = fork();
    if (pid == 0) {
      dup2(fds[1], 1);
      close(fds[0]);
      close(fds[1]);
      execve(exe.c_str(), argv, env.data());
      _exit(127);
    }
    close(fds[1]);
    try {
      read_ready(fds[0]);
    } catch (...) {
      close(fds[0]);
      kill9();
      throw;
    }
    close(fds[0]);
  }
  ~Driver() { kill9(); }
  Driver(const Driver&) = delete;
  Driver& operator=(const Driver&) = delete;

  void read_ready(int fd) {
    std::string out;
    char buf[256];
    auto deadline = std::chrono::steady_clock::now() + 60s;
    while (out.find("READY") == std::string::npos || out.find('\n', out.find("READY")) == std::string::npos) {
      if (std::chrono::steady_clock::now() > deadline) throw std::runtime_error("driver not ready: " + out);
      pollfd p{fd, POLLIN, 0};
      if (poll(&p, 1, 1000) <= 0) continue;
      ssize_t n = read(fd, buf, sizeof(buf));
      if (n <= 0) throw std::runtime_error("driver exited before READY: " + out);
      out.append(buf, n);
    }
    unsigned long long a = 0, b = 0;
    std::sscanf(out.c_str() + out.find("READY"), "READY %llu %llu", &a, &b);
    in_group = a;
    free = b;
  }

  void kill9() {
    if (pid <= 0) return;
    ::kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    pid = -1;
  }
};

// True when no actor is ALIVE (or RESTARTING, or PENDING) with a pid that is
// gone, and every actor in `ids` is DEAD with a cause.
bool no_ghosts(troupe::Runtime& rt, const std::vector<uint64_t>& ids) {
  auto status = nlohmann::json::parse(rt.status_json());
  for (auto& a : status["actors"]) {
    int pid = a["pid"].get<int>();
    if (a["state"] == "ALIVE" && (pid <= 0 || troupe::test::process_gone(pid))) return false;
  }
  for (auto id : ids) {
    auto info = rt.actor_info(id);
    if (info.state != troupe::ActorState::kDead || info.death_cause.empty()) return false;
  }
  return true;
}

// kDriverOnlyDurableHead: a durable head gives a client whose connection
// drops time to come back, but a driver seen to have exited (it ran where
// the head runs) loses what it owned at once, as with any other head.
enum class Order { kDriverOnly, kDriverThenAgent, kAgentThenDriver, kDriverOnlyDurableHead };

class GhostActors : public ::testing::TestWithParam<Order> {};

TEST_P(GhostActors, KilledDriverAndAgentLeaveNoAliveActorWithADeadPid) {
  LocalCluster cluster(
      {.nodes = {{{"CPU", 2}}, {{"CPU", 2}}}, .durable_head = GetParam() == Order::kDriverOnlyDurableHead});
  troupe::Runtime rt = cluster.connect();
  Driver driver(cluster);
  auto info = rt.actor_info(driver.in_group);
  ASSERT_EQ(info.state, troupe::ActorState::kAlive);
  size_t node_index = cluster.node_id(0) == info.node_id ? 0 : 1;
  int pid_in_group = info.pid;
  int pid_free = rt.actor_info(driver.free).pid;

  if (GetParam() == Order::kAgentThenDriver) {
    cluster.kill_node(node_index, SIGKILL);
    // The actor in the group restarts elsewhere once its group is placed again.
    ASSERT_TRUE(eventually([&] { return troupe::test::process_gone(pid_in_group); }, kWaitBound));
    ASSERT_TRUE(eventually([&] { return no_ghosts(rt, {}); }, kWaitBound));
  }
  driver.kill9();
  if (GetParam() == Order::kDriverThenAgent) cluster.kill_node(node_index, SIGKILL);

  EXPECT_TRUE(eventually(
      [&] {
        return no_ghosts(rt, {driver.in_group, driver.free});
      },
      kWaitBound))
      << rt.status_json();
  EXPECT_TRUE(eventually(
      [&] { return troupe::test::process_gone(pid_in_group) && troupe::test::process_gone(pid_free); }, kWaitBound));
  EXPECT_NE(rt.actor_info(driver.in_group).death_cause.find("driver exited"), std::string::npos)
      << rt.actor_info(driver.in_group).death_cause;
  // The names are free again.
  EXPECT_THROW(rt.get_actor<GhostProbe>("ghost-in-group"), troupe::ConfigError);
  EXPECT_THROW(rt.get_actor<GhostProbe>("ghost-free"), troupe::ConfigError);
  auto again = rt.spawn<GhostProbe>({.name = "ghost-in-group"});
  EXPECT_GT(again.call(&GhostProbe::pid).get(kWaitBound), 0);
}

INSTANTIATE_TEST_SUITE_P(Orders, GhostActors,
                         ::testing::Values(Order::kDriverOnly, Order::kDriverThenAgent, Order::kAgentThenDriver,
                                           Order::kDriverOnlyDurableHead),
                         [](const ::testing::TestParamInfo<Order>& p) {
                           switch (p.param) {
                             case Order::kDriverOnly:
                               return "DriverOnly";
                             case Order::kDriverThenAgent:
                               return "DriverThenAgent";
                             case Order::kDriverOnlyDurableHead:
                               return "DriverOnlyDurableHead";
                             default:
                               return "AgentThenDriver";
                           }
                         });

// A job that ends normally by removing its group: the group's actors are
// DEAD once their workers are gone (not ALIVE with a dead pid).
TEST(GhostActorsNormalEnd, RemovedGroupsActorsAreDeadOnceTheirWorkersExit) {
  LocalCluster cluster({.nodes = {{{"CPU", 2}}}});
  troupe::Runtime rt = cluster.connect();
  auto pg = rt.create_placement_group({{{"CPU", 1}}}, troupe::PlacementStrategy::kPack);
  ASSERT_TRUE(pg.wait(kWaitBound));
  auto a = rt.spawn<GhostProbe>({.resources = {{"CPU", 1}}, .name = "in-removed-group", .placement_group = &pg});
  int pid = a.call(&GhostProbe::pid).get(kWaitBound);
  rt.remove_placement_group(pg);
  EXPECT_TRUE(eventually([&] { return no_ghosts(rt, {a.id()}); }, kWaitBound)) << rt.status_json();
  EXPECT_TRUE(eventually([&] { return troupe::test::process_gone(pid); }));
  EXPECT_NE(a.info().death_cause.find("placement group " + std::to_string(pg.id()) + " was removed"), std::string::npos)
      << a.info().death_cause;
  EXPECT_EQ(rt.nodes().at(0).available.at("CPU"), 2);
}

}  // namespace
