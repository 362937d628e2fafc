// testing::LocalCluster and FaultInjector as a test writer uses them: what
// they leave behind (files, stopped processes, state directories), where
// their processes live, and how they refuse bad options.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/temp_dir.h"
#include "tests/support/wait.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/testing/fault_injector.h"
#include "troupe/runtime/testing/local_cluster.h"

using namespace std::chrono_literals;
using troupe::test::eventually;
using troupe::test::kWaitBound;

class Marker {
 public:
  explicit Marker(int v) : v_(v) {}
  int get() const { return v_; }
  int pid() const { return getpid(); }
  uint64_t node() const { return std::stoull(std::getenv("TROUPE_NODE_ID")); }
  // A line on stdout, not flushed: a worker's stdout is line-buffered.
  int say(const std::string& what) { return std::printf("marker %d says %s\n", v_, what.c_str()); }
  // Runs until `dir`/release exists (at most a minute), after writing
  // `dir`/started: a call in flight for as long as a test wants.
  int hold(const std::string& dir) {
    std::ofstream(dir + "/started") << getpid();
    for (int i = 0; i < 6000 && !std::filesystem::exists(dir + "/release"); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return v_;
  }

 private:
  int v_;
};
TROUPE_ACTOR(Marker, &Marker::get, &Marker::pid, &Marker::node, &Marker::say, &Marker::hold)

namespace {

std::vector<std::string> names_in(const std::filesystem::path& dir, const std::string& prefix) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) == 0) out.push_back(name);
  }
  return out;
}

// The ConfigError text of building a cluster with `o` ("" if none).
std::string refusal(const troupe::testing::LocalClusterOptions& o) {
  try {
    troupe::testing::LocalCluster c(o);
  } catch (const troupe::ConfigError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// A test run as `./tests > dir/out.log` gives the cluster's processes that
// file as their output. It is the test's, not a daemon's log of their own:
// their workers write into it too, and no worker-PID.log appears beside it.
// What an actor prints is there at once, a line at a time, though its
// worker is then SIGKILLed (a file's stdio buffer was lost with it).
TEST(LocalClusterTest, WorkersOfATestWhoseOutputIsAFileWriteIntoItNotBesideIt) {
  const auto dir = troupe::test::fresh_dir("output-file");
  const auto out = dir / "test.log";
  fflush(stdout);
  const int saved = ::dup(1);
  ASSERT_GE(saved, 0);
  const int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  ::dup2(fd, 1);
  ::close(fd);
  int answer = 0;
  {
    troupe::testing::LocalCluster cluster({.nodes = {{{"CPU", 1}}}, .env = {"TROUPE_LOG_LEVEL=info"}});
    auto rt = cluster.connect();
    auto e = rt.spawn<Marker>({.resources = {{"CPU", 1}}}, 7);
    answer = e.call(&Marker::get).get(kWaitBound);
    e.call(&Marker::say, std::string("hello before its end")).get(kWaitBound);
    ::kill(e.call(&Marker::pid).get(kWaitBound), SIGKILL);
    rt.shutdown();
  }
  fflush(stdout);
  ::dup2(saved, 1);
  ::close(saved);
  EXPECT_EQ(answer, 7);
  EXPECT_EQ(names_in(dir, "worker-"), std::vector<std::string>{});
  EXPECT_TRUE(std::filesystem::exists(out));
  std::ifstream in(out);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("marker 7 says hello before its end\n"), std::string::npos) << text;
  troupe::core::remove_tree(dir);
}

// Every process is started on the cluster's own thread: a node added from
// a thread that ends at once (a FaultInjector action) lives on.
TEST(LocalClusterTest, ANodeAddedFromAShortLivedThreadOutlivesIt) {
  troupe::testing::LocalCluster cluster({.nodes = {{{"CPU", 1}}}});
  auto rt = cluster.connect();
  size_t added = 0;
  std::thread([&] { added = cluster.add_node({{"CPU", 1}, {"spare", 1}}); }).join();
  // Placed there after the thread that added it has ended.
  auto e = rt.spawn<Marker>({.resources = {{"spare", 1}}}, 3);
  EXPECT_EQ(e.call(&Marker::node).get(kWaitBound), cluster.node_id(added));
  EXPECT_EQ(::kill(cluster.node_pid(added), 0), 0);
}

// The cluster may be called from two threads at once (a test's and a
// FaultInjector action's): nodes added on one while the other reads the
// node list and kills a node. Without a lock, add_node's reallocation of
// the list raced with the reads; CI runs this under TSan too.
TEST(LocalClusterTest, NodesAddedOnOneThreadWhileAnotherReadsAndKills) {
  troupe::testing::LocalCluster cluster({.nodes = {{{"CPU", 1}}, {{"CPU", 1}}}});
  std::atomic<bool> done{false};
  std::thread adder([&] {
    try {
      for (int k = 0; k < 3; ++k) cluster.add_node({{"CPU", 1}});
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
    }
    done = true;
  });
  pid_t killed = -1;
  while (!done.load()) {  // each add_node ends within its start timeout
    const size_t seen = cluster.node_count();
    if (seen > 2 && killed < 0) {
      killed = cluster.node_pid(0);
      cluster.kill_node(0, SIGKILL);
    }
    for (size_t i = 0; i < seen; ++i) EXPECT_NE(cluster.node_pid(i), 0);
    std::this_thread::yield();
  }
  adder.join();
  EXPECT_EQ(cluster.node_count(), 5u);
  if (killed < 0) {  // the adder was faster than every look
    killed = cluster.node_pid(0);
    cluster.kill_node(0, SIGKILL);
  }
  EXPECT_EQ(cluster.node_pid(0), -1);
  EXPECT_NE(::kill(killed, 0), 0);  // reaped
  for (size_t i = 1; i < 5; ++i) EXPECT_EQ(::kill(cluster.node_pid(i), 0), 0);
}

// A FaultInjector destroyed while an actor it stalled is still stopped
// wakes it: a test that ends early leaves no stopped process behind.
TEST(LocalClusterTest, AFaultInjectorDestroyedEarlyWakesTheActorItStalled) {
  troupe::testing::LocalCluster cluster({.nodes = {{{"CPU", 1}}}});
  auto rt = cluster.connect();
  auto e = rt.spawn<Marker>({.resources = {{"CPU", 1}}}, 5);
  const int pid = e.call(&Marker::pid).get(kWaitBound);
  {
    troupe::testing::FaultInjector faults(rt);
    faults.stall_actor(e.id(), std::chrono::hours(1));
  }
  EXPECT_EQ(e.call(&Marker::get).get(kWaitBound), 5);
  EXPECT_EQ(e.call(&Marker::pid).get(kWaitBound), pid);  // the same process, woken
}

// Dropped connections fail the calls in flight, also on an actor that runs
// its calls on its listener's thread (the default): the close waited there
// for the running call, whose reply went first, so no caller saw a fault.
TEST(LocalClusterTest, DroppedConnectionsFailTheCallInFlightOfAnInlineActor) {
  const auto dir = troupe::test::fresh_dir("drop-inflight");
  troupe::testing::LocalCluster cluster({.nodes = {{{"CPU", 1}}}});
  auto rt = cluster.connect();
  auto e = rt.spawn<Marker>({.resources = {{"CPU", 1}}}, 4);
  auto held = e.call(&Marker::hold, dir.string());
  ASSERT_TRUE(troupe::test::eventually([&] { return std::filesystem::exists(dir / "started"); }));
  troupe::testing::FaultInjector faults(rt);
  faults.drop_connections(e.id());
  EXPECT_THROW(held.get(kWaitBound), troupe::ActorDied);
  std::ofstream(dir / "release") << 1;
  troupe::core::remove_tree(dir);
}

TEST(LocalClusterTest, KillingANodeAgentTwiceIsRefusedByName) {
  troupe::testing::LocalCluster cluster({.nodes = {{{"CPU", 1}}, {{"CPU", 1}}}});
  auto rt = cluster.connect();
  troupe::testing::FaultInjector faults(rt);
  faults.kill_node(cluster, 1);
  try {
    faults.kill_node(cluster, 1);
    ADD_FAILURE() << "a second kill of node agent 1 was accepted";
  } catch (const troupe::Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("node agent 1 (node " + std::to_string(cluster.node_id(1)) + ") is not running"),
        std::string::npos)
        << e.what();
  }
  EXPECT_EQ(faults.faults().size(), 1u);
}

TEST(LocalClusterTest, BadHeartbeatsAndNodeResourcesAreRefusedByName) {
  EXPECT_NE(refusal({.heartbeat_ms = 0}).find("LocalClusterOptions: heartbeat_ms 0 is not in [10, 60000]"),
            std::string::npos);
  EXPECT_NE(refusal({.heartbeat_misses = 0}).find("LocalClusterOptions: heartbeat_misses 0 is not in [1, 100000]"),
            std::string::npos);
  // Each in range, their product over a day (it wrapped the agents' 32-bit
  // fence time).
  EXPECT_NE(refusal({.heartbeat_ms = 60000, .heartbeat_misses = 100000})
                .find("heartbeat_ms 60000 × heartbeat_misses 100000 = 6000000000 ms before a silent node is fenced, "
                      "over 86400000 (a day)"),
            std::string::npos);
  EXPECT_NE(refusal({.nodes = {{{"CPU", 1e300}}}}).find("node 0: resource 'CPU' = 1e+300 exceeds the limit"),
            std::string::npos)
      << refusal({.nodes = {{{"CPU", 1e300}}}});
  EXPECT_NE(refusal({.nodes = {{{"CPU", 1}}, {{"a b", 1}}}}).find("node 1: resource name 'a b' has a character"),
            std::string::npos)
      << refusal({.nodes = {{{"CPU", 1}}, {{"a b", 1}}}});
  troupe::InitOptions o;
  o.heartbeat_ms = 1;
  try {
    troupe::Runtime::connect(o);
    ADD_FAILURE() << "a 1 ms heartbeat was accepted";
  } catch (const troupe::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("InitOptions: heartbeat_ms 1 is not in [10, 60000]"), std::string::npos)
        << e.what();
  }
}

// A durable head's state directory goes with a cluster whose start fails,
// and with the cluster of a process that died without its destructor (it
// is removed by the next durable cluster this user makes).
TEST(LocalClusterTest, DurableHeadStateDirectoriesDoNotOutliveTheirCluster) {
  const std::string mine = "troupe-head-" + std::to_string(::getpid()) + "-";
  EXPECT_THROW(troupe::testing::LocalCluster({.host = "192.0.2.1", .durable_head = true}), troupe::Error);
  EXPECT_EQ(names_in("/tmp", mine), std::vector<std::string>{});

  // The directory a crashed test process left: its pid no longer runs.
  const pid_t gone = ::fork();
  if (gone == 0) ::_exit(0);
  ASSERT_GT(gone, 0);
  ASSERT_EQ(::waitpid(gone, nullptr, 0), gone);
  const auto dir = [&](const std::string& tail) {
    auto d = std::filesystem::path("/tmp") / ("troupe-head-" + std::to_string(gone) + "-" + tail);
    std::filesystem::create_directories(d);
    return d;
  };
  // Its lock file is left, not held: the process that held it is gone.
  const auto orphan = dir("abcdef");
  std::ofstream(orphan / "owner.lock").put('\n');
  // One of an older troupe, without a lock file, an hour old.
  const auto old = dir("ghijkl");
  const ::timeval hour_ago[2] = {{::time(nullptr) - 3600, 0}, {::time(nullptr) - 3600, 0}};
  ASSERT_EQ(::utimes(old.c_str(), hour_ago), 0);
  // A live cluster's, of a process in another PID namespace sharing /tmp
  // (its pid means nothing here): it holds the lock.
  const auto elsewhere = dir("mnopqr");
  const int held = ::open((elsewhere / "owner.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  ASSERT_GE(held, 0);
  ASSERT_EQ(::flock(held, LOCK_EX), 0);
  // One made a moment ago, not locked yet.
  const auto making = dir("stuvwx");
  {
    troupe::testing::LocalCluster cluster({.nodes = {{{"CPU", 1}}}, .durable_head = true});
    EXPECT_FALSE(std::filesystem::exists(orphan));
    EXPECT_FALSE(std::filesystem::exists(old));
    EXPECT_TRUE(std::filesystem::exists(elsewhere));
    EXPECT_TRUE(std::filesystem::exists(making));
    EXPECT_EQ(names_in("/tmp", mine).size(), 1u);
  }
  EXPECT_EQ(names_in("/tmp", mine), std::vector<std::string>{});
  ::close(held);
  std::filesystem::remove_all(elsewhere);
  std::filesystem::remove_all(making);
}
