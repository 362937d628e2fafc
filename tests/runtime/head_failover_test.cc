// A durable head (tables written through to SQLite) SIGKILLed and started
// again: node agents keep their workers and join it as the nodes they were,
// drivers reconnect, and actors, names, keys and resources are as they were.
// Work that does not need the head goes on while it is down.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <fcntl.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <optional>
#include <thread>

#include <sqlite3.h>
#include <nlohmann/json.hpp>

#include "tests/support/process.h"
#include "tests/support/tcp_proxy.h"
#include "tests/support/temp_dir.h"
#include "tests/support/wait.h"
#include "troupe/runtime/client/core.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/testing/local_cluster.h"

using troupe::test::eventually;
using troupe::test::kWaitBound;
using troupe::test::TcpProxy;

namespace {

class Ledger {
 public:
  explicit Ledger(int start) : value_(start) {}
  int add(int x) { return value_ += x; }
  int pid() const { return getpid(); }

 private:
  int value_;
};

// An actor whose constructor writes its pid to GATE.entered and then waits
// (at most a minute) for the file GATE: the test decides when it is ready.
void wait_at(const std::string& gate) {
  std::ofstream(gate + ".entered") << getpid();
  const auto until = std::chrono::steady_clock::now() + std::chrono::minutes(1);
  while (!std::filesystem::exists(gate) && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

class Gated {
 public:
  explicit Gated(const std::string& gate) { wait_at(gate); }
  int pid() const { return getpid(); }
};

// As Gated, and then its constructor fails.
class FailsAtTheGate {
 public:
  explicit FailsAtTheGate(const std::string& gate) {
    wait_at(gate);
    throw std::runtime_error("no good at the gate");
  }
  int pid() const { return getpid(); }
};

// This process's stderr, and so that of every process it starts meanwhile,
// goes to `path` while it lives.
class StderrToFile {
 public:
  explicit StderrToFile(const std::string& path) : saved_(::dup(2)) {
    std::fflush(stderr);
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd >= 0) {
      ::dup2(fd, 2);
      ::close(fd);
    }
  }
  ~StderrToFile() {
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
  }
  StderrToFile(const StderrToFile&) = delete;
  StderrToFile& operator=(const StderrToFile&) = delete;

 private:
  int saved_;
};

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

troupe::testing::LocalClusterOptions durable(int nodes) {
  troupe::testing::LocalClusterOptions o;
  o.nodes.assign(nodes, {{"CPU", 2}});
  o.durable_head = true;
  return o;
}

// The driver has seen the head go (so nothing it sends next can be lost in
// a connection that is already dead).
void wait_until_head_lost(troupe::Runtime& rt) {
  ASSERT_TRUE(eventually([&] { return !rt.core()->head().is_open(); }));
}

// With the head SIGSTOPped, opens `gate` and waits for `line` in `log`: what
// the gated worker tells the head then lies unread in its socket. Then the
// head is SIGKILLed (taking that with it) and started again.
void tell_a_dying_head(troupe::testing::LocalCluster& cluster, troupe::Runtime& rt, const std::string& gate,
                       const std::string& log, const std::string& line) {
  ASSERT_EQ(::kill(cluster.head_pid(), SIGSTOP), 0);
  std::ofstream(gate).put('1');
  ASSERT_TRUE(eventually([&] { return read_text(log).find(line) != std::string::npos; }));
  cluster.kill_head(SIGKILL);
  ASSERT_NO_FATAL_FAILURE(wait_until_head_lost(rt));
  cluster.restart_head();
}

}  // namespace

TROUPE_ACTOR(Ledger, &Ledger::add, &Ledger::pid)
TROUPE_ACTOR(Gated, &Gated::pid)
TROUPE_ACTOR(FailsAtTheGate, &FailsAtTheGate::pid)

TEST(HeadFailover, ActorsNamesKeysAndNodesOutliveARestartedHead) {
  troupe::testing::LocalCluster cluster(durable(1));
  troupe::Runtime rt = cluster.connect();
  auto t = rt.spawn<Ledger>({.resources = {{"CPU", 1}}, .name = "ledger"}, 10);
  ASSERT_EQ(t.call(&Ledger::add, 5).get(kWaitBound), 15);
  const int pid = t.call(&Ledger::pid).get(kWaitBound);
  rt.kv().put("answer", "42");
  const uint64_t node = cluster.node_id(0);

  cluster.kill_head(SIGKILL);
  wait_until_head_lost(rt);
  // Calls go straight to the worker: no head needed.
  EXPECT_EQ(t.call(&Ledger::add, 1).get(kWaitBound), 16);

  cluster.restart_head();
  EXPECT_EQ(rt.kv().get("answer"), std::optional<std::string>("42"));
  EXPECT_EQ(t.call(&Ledger::add, 1).get(kWaitBound), 17);
  EXPECT_EQ(t.call(&Ledger::pid).get(kWaitBound), pid);  // the same process, its state intact
  EXPECT_EQ(rt.get_actor<Ledger>("ledger").id(), t.id());
  // The node is back as itself, the actor's CPU still taken.
  EXPECT_TRUE(eventually([&] {
    auto ns = rt.nodes();
    return ns.size() == 1 && ns[0].id == node && ns[0].alive && ns[0].available.at("CPU") == 1;
  }));
  // New work is placed.
  auto u = rt.spawn<Ledger>({.resources = {{"CPU", 1}}}, 0);
  EXPECT_EQ(u.call(&Ledger::add, 2).get(kWaitBound), 2);
}

// The head's state file is lost while the head is down (removed here; a
// head that fails a write removes it too): the head comes back empty,
// counting ids from 1 again. Those of the old cluster give it up rather
// than take its actor 1 for theirs: the driver's link ends, naming the
// lost tables, instead of reconnecting; the node agent kills the old
// worker; and a new driver's actor of the same id is its own.
TEST(HeadFailover, AHeadBackWithoutItsTablesIsGivenUpNotTakenForTheSameCluster) {
  troupe::testing::LocalCluster cluster(durable(1));
  troupe::Runtime rt = cluster.connect();
  auto t = rt.spawn<Ledger>({.resources = {{"CPU", 1}}, .name = "ledger"}, 10);
  const int pid = t.call(&Ledger::pid).get(kWaitBound);
  rt.kv().put("answer", "42");
  cluster.kill_head(SIGKILL);
  ASSERT_NO_FATAL_FAILURE(wait_until_head_lost(rt));
  const std::string db = cluster.head_state_db();
  for (const char* suffix : {"", "-wal", "-shm"}) std::filesystem::remove(db + suffix);
  cluster.restart_head();

  ASSERT_TRUE(eventually([&] { return rt.core()->head().is_closed(); })) << "the driver took the new head for its own";
  try {
    rt.kv().get("answer");
    ADD_FAILURE() << "the old driver still reaches the head";
  } catch (const troupe::ConnectionError& e) {
    EXPECT_NE(std::string(e.what()).find("without this cluster's tables"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(eventually([&] { return ::kill(pid, 0) != 0; })) << "the old worker " << pid << " still runs";

  troupe::Runtime rt2 = cluster.connect();
  EXPECT_EQ(rt2.kv().get("answer"), std::nullopt);
  auto u = rt2.spawn<Ledger>({.resources = {{"CPU", 1}}}, 100);
  EXPECT_EQ(u.id(), t.id());
  EXPECT_EQ(u.call(&Ledger::add, 1).get(kWaitBound), 101);
  EXPECT_NE(u.call(&Ledger::pid).get(kWaitBound), pid);
}

// The head is down for longer than a node's lease: the agent, which
// keeps its lease while it waits for a durable head, finds nothing
// listening at the head's address (refused: no head runs there to fence
// it) and keeps its workers, which serve all along.
TEST(HeadFailover, WorkersServeThroughAHeadDownForLongerThanTheLease) {
  auto o = durable(1);
  o.heartbeat_misses = troupe::core::kHeartbeatMisses;  // a cluster across machines' lease, not LocalCluster's 2.9 s
  troupe::testing::LocalCluster cluster(o);
  troupe::Runtime rt = cluster.connect();
  auto t = rt.spawn<Ledger>({.resources = {{"CPU", 1}}}, 0);
  const int pid = t.call(&Ledger::pid).get(kWaitBound);
  const uint64_t node = cluster.node_id(0);
  cluster.kill_head(SIGKILL);
  wait_until_head_lost(rt);
  // Three fence times (100 ms x 5) down: the lease (400 ms) would have run
  // out twice over.
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
  int calls = 0;
  while (std::chrono::steady_clock::now() < until) {
    ASSERT_EQ(t.call(&Ledger::add, 1).get(kWaitBound), ++calls);
    ASSERT_EQ(t.call(&Ledger::pid).get(kWaitBound), pid);
  }
  cluster.restart_head();
  EXPECT_EQ(t.call(&Ledger::add, 1).get(kWaitBound), calls + 1);
  EXPECT_EQ(t.call(&Ledger::pid).get(kWaitBound), pid);
  EXPECT_TRUE(eventually([&] {
    auto ns = rt.nodes();
    return ns.size() == 1 && ns[0].id == node && ns[0].alive;
  }));
}

// A restarted head that takes long to load its tables (a large store, a
// slow disk: here its file's write lock is held, so its first write waits)
// does not listen before it serves: the agent's connects are refused all
// along, it keeps its lease, and its workers serve through the load. (A
// head that listened first let the kernel accept the agent's connects and
// answered no handshake: the lease ran out and the workers went.)
TEST(HeadFailover, WorkersServeThroughARestartedHeadsSlowLoad) {
  auto o = durable(1);
  o.heartbeat_misses = troupe::core::kHeartbeatMisses;  // the 400 ms lease of a cluster across machines
  troupe::testing::LocalCluster cluster(o);
  troupe::Runtime rt = cluster.connect();
  auto t = rt.spawn<Ledger>({.resources = {{"CPU", 1}}}, 0);
  const int pid = t.call(&Ledger::pid).get(kWaitBound);
  cluster.kill_head(SIGKILL);
  wait_until_head_lost(rt);

  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(cluster.head_state_db().c_str(), &db), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(db, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr), SQLITE_OK);
  auto restarted = std::async(std::launch::async, [&] { cluster.restart_head(); });
  // Held for 1.2 s (three leases; under the head's 2 s wait for the lock,
  // after which it would give up writing its tables).
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1200);
  int calls = 0;
  while (std::chrono::steady_clock::now() < until) {
    ASSERT_EQ(t.call(&Ledger::add, 1).get(kWaitBound), ++calls);
    ASSERT_EQ(t.call(&Ledger::pid).get(kWaitBound), pid);
  }
  sqlite3_exec(db, "ROLLBACK", nullptr, nullptr, nullptr);
  sqlite3_close(db);
  ASSERT_EQ(restarted.wait_for(kWaitBound), std::future_status::ready);
  restarted.get();
  EXPECT_EQ(t.call(&Ledger::add, 1).get(kWaitBound), calls + 1);
  EXPECT_EQ(t.call(&Ledger::pid).get(kWaitBound), pid);
  // The head wrote its tables through the wait (it did not fall back to a
  // head that keeps nothing).
  EXPECT_TRUE(nlohmann::json::parse(rt.status_json())["state_db"]["written"].get<bool>());
}

// A worker's ActorReady sent just before the head died (here: the head
// SIGSTOPped, so it lies unread in the socket, then SIGKILLed) is lost with
// the head; sends are replayed only when made while the head is away. The
// worker tells it again when the head is back, so the restarted head does
// not keep the actor PENDING (its calls waiting) while its worker serves.
TEST(HeadFailover, AnActorReadyLostWithTheHeadIsToldAgain) {
  const std::string dir = troupe::test::make_temp_dir("ready-lost");
  const std::string gate = dir + "/gate", log = dir + "/stderr.log";
  auto o = durable(1);
  o.env = {"TROUPE_LOG_LEVEL=debug"};  // for the worker's "serving at" line
  o.heartbeat_misses = 300;            // the agent keeps its lease while the head is stopped
  {
    StderrToFile capture(log);
    troupe::testing::LocalCluster cluster(o);
    troupe::Runtime rt = cluster.connect();
    auto g = rt.spawn<Gated>({.resources = {{"CPU", 1}}}, gate);
    ASSERT_TRUE(eventually([&] { return !read_text(gate + ".entered").empty(); }));
    const int pid = std::stoi(read_text(gate + ".entered"));
    const std::string serving = "actor " + std::to_string(g.id()) + " (Gated) serving at";
    ASSERT_NO_FATAL_FAILURE(tell_a_dying_head(cluster, rt, gate, log, serving));
    EXPECT_TRUE(eventually([&] { return rt.actor_info(g.id()).state == troupe::ActorState::kAlive; }))
        << "actor " << g.id() << " is " << troupe::wire::to_string(rt.actor_info(g.id()).state);
    EXPECT_EQ(g.call(&Gated::pid).get(kWaitBound), pid);  // the same worker, not a restart
    EXPECT_EQ(rt.actor_info(g.id()).restarts, 0);
  }
  troupe::test::remove_dir(dir);
}

// A constructor failure told just before the head died (SIGSTOPped, then
// SIGKILLed, as above) is told again once the head is back, so the actor is
// dead of its constructor without a restart spent on it. The worker used
// to end in std::terminate when its confirming request failed, and the
// restarted head took the exit for a crash and ran the constructor again.
TEST(HeadFailover, AConstructorFailureToldAsTheHeadDiesIsNotTakenForACrash) {
  const std::string dir = troupe::test::make_temp_dir("init-failed-lost");
  const std::string gate = dir + "/gate", log = dir + "/stderr.log";
  auto o = durable(1);
  o.heartbeat_misses = 300;  // the agent keeps its lease while the head is stopped
  {
    StderrToFile capture(log);
    troupe::testing::LocalCluster cluster(o);
    troupe::Runtime rt = cluster.connect();
    auto g = rt.spawn<FailsAtTheGate>({.resources = {{"CPU", 1}}, .max_restarts = 1}, gate);
    ASSERT_TRUE(eventually([&] { return !read_text(gate + ".entered").empty(); }));
    const std::string failed = "actor " + std::to_string(g.id()) + " (FailsAtTheGate) failed to start";
    ASSERT_NO_FATAL_FAILURE(tell_a_dying_head(cluster, rt, gate, log, failed));
    ASSERT_TRUE(eventually([&] { return rt.actor_info(g.id()).state == troupe::ActorState::kDead; }));
    const auto info = rt.actor_info(g.id());
    EXPECT_NE(info.death_cause.find("constructor failed: "), std::string::npos) << info.death_cause;
    EXPECT_NE(info.death_cause.find("no good at the gate"), std::string::npos) << info.death_cause;
    EXPECT_EQ(info.restarts, 0);
  }
  troupe::test::remove_dir(dir);
}

TEST(HeadFailover, WorkerThatDiedWhileTheHeadWasDownIsRestartedAfter) {
  troupe::testing::LocalCluster cluster(durable(1));
  troupe::Runtime rt = cluster.connect();
  auto t = rt.spawn<Ledger>({.resources = {{"CPU", 1}}, .max_restarts = 1}, 10);
  const int pid = t.call(&Ledger::pid).get(kWaitBound);
  cluster.kill_head(SIGKILL);
  wait_until_head_lost(rt);
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  cluster.restart_head();
  // The node reports it gone when it joins again; the actor restarts.
  EXPECT_TRUE(eventually([&] {
    auto i = rt.actor_info(t.id());
    return i.state == troupe::ActorState::kAlive && i.incarnation == 1;
  }));
  EXPECT_EQ(t.call(&Ledger::add, 1).get(kWaitBound), 11);
  EXPECT_NE(t.call(&Ledger::pid).get(kWaitBound), pid);
}

TEST(HeadFailover, ClusterStoppedOnPurposeStartsEmpty) {
  troupe::testing::LocalCluster cluster(durable(1));
  {
    troupe::Runtime rt = cluster.connect();
    rt.kv().put("k", "v");
  }
  cluster.kill_head(SIGTERM);  // a stop: the cluster ends, the store forgets
  cluster.restart_head();
  troupe::Runtime rt = cluster.connect();
  EXPECT_EQ(rt.kv().get("k"), std::nullopt);
}

namespace {

size_t head_connections(troupe::Runtime& rt) {
  return nlohmann::json::parse(rt.status_json())["tables"]["connections"].get<size_t>();
}

// A driver of `cluster` whose head connection goes through `proxy`.
troupe::Runtime connect_through(const troupe::testing::LocalCluster& cluster, const TcpProxy& proxy) {
  troupe::InitOptions o;
  o.address = proxy.address();
  o.token = cluster.token();
  return troupe::Runtime::connect(o);
}

}  // namespace

// A network blip between a driver and a live durable head: the connection
// breaks (a proxy between them cuts it; both processes live on), the driver
// reconnects, and its actor, its placement group and its name are as they
// were, the actor in the same process. Before, the head took the drop for
// an exit and killed what the driver owned.
TEST(HeadFailover, ADriverWhoseConnectionDropsKeepsWhatItOwns) {
  troupe::testing::LocalCluster cluster(durable(1));
  TcpProxy proxy(cluster.address());
  troupe::Runtime watcher = cluster.connect();
  std::optional<troupe::Runtime> rt(connect_through(cluster, proxy));
  auto t = rt->spawn<Ledger>({.resources = {{"CPU", 1}}, .name = "kept"}, 10);
  auto pg = rt->create_placement_group({{{"CPU", 1}}}, troupe::PlacementStrategy::kPack);
  ASSERT_TRUE(pg.wait(kWaitBound));
  const int pid = t.call(&Ledger::pid).get(kWaitBound);
  const size_t connections = head_connections(watcher);

  ASSERT_EQ(proxy.cut(), 1);
  // Back on a new connection, and the old one closed at the head too.
  ASSERT_TRUE(eventually([&] { return proxy.accepted() >= 2 && rt->core()->head().is_open(); }));
  ASSERT_TRUE(eventually([&] { return head_connections(watcher) == connections; })) << watcher.status_json();

  auto info = watcher.actor_info(t.id());
  EXPECT_EQ(info.state, troupe::ActorState::kAlive) << info.death_cause;
  EXPECT_EQ(t.call(&Ledger::add, 1).get(kWaitBound), 11);
  EXPECT_EQ(t.call(&Ledger::pid).get(kWaitBound), pid);
  EXPECT_EQ(watcher.get_actor<Ledger>("kept").id(), t.id());
  EXPECT_EQ(pg.info().state, troupe::wire::PlacementGroupState::kCreated);

  // Still its owner: when it leaves (a goodbye), what it owns goes with it.
  rt.reset();
  EXPECT_TRUE(eventually([&] { return watcher.actor_info(t.id()).state == troupe::ActorState::kDead; }));
  EXPECT_EQ(watcher.actor_info(t.id()).death_cause, "its driver exited");
}

// A KV request in flight when the head's connection breaks is sent again
// on the new connection, not failed: a Python function's export on its
// first .remote() right after the head died failed with "lost the
// connection ... may or may not have been carried out".
TEST(HeadFailover, AKvRequestCutInFlightIsSentAgain) {
  troupe::testing::LocalCluster cluster(durable(1));
  TcpProxy proxy(cluster.address());
  troupe::Runtime watcher = cluster.connect();
  troupe::Runtime rt = connect_through(cluster, proxy);
  const std::string value(16 * 1024, 'x');
  proxy.hold(true);
  auto put = std::async(std::launch::async, [&] { rt.kv().put("cut-in-flight", value); });
  // The request is in the proxy, unanswered, when the connection breaks.
  ASSERT_TRUE(eventually([&] { return proxy.held_from_clients() >= value.size(); }));
  ASSERT_EQ(proxy.cut(), 1);
  proxy.hold(false);
  ASSERT_EQ(put.wait_for(kWaitBound), std::future_status::ready);
  EXPECT_NO_THROW(put.get());
  EXPECT_EQ(watcher.kv().get("cut-in-flight"), std::optional<std::string>(value));
}

// A reconnect whose dial hangs (the link takes the connect and then holds
// every byte, as a head that accepts and says nothing would) ends when the
// reconnect window does, as one refused all along would. It waited as long
// as the dial hung: in a partition, the kernel's two minutes of SYN retries.
TEST(HeadFailover, AReconnectWhoseDialHangsEndsAtTheWindow) {
  troupe::testing::LocalCluster cluster(durable(1));
  TcpProxy proxy(cluster.address());
  ::setenv("TROUPE_HEAD_RECONNECT_MS", "1000", 1);
  std::optional<troupe::Runtime> rt;
  try {
    rt.emplace(connect_through(cluster, proxy));
  } catch (...) {
    ::unsetenv("TROUPE_HEAD_RECONNECT_MS");
    throw;
  }
  ::unsetenv("TROUPE_HEAD_RECONNECT_MS");
  rt->kv().put("k", "v");
  proxy.hold(true);
  ASSERT_EQ(proxy.cut(), 1);
  ASSERT_TRUE(eventually([&] { return proxy.accepted() >= 2; }));  // the new dial, held
  EXPECT_TRUE(eventually([&] { return rt->core()->head_lost(); }));
  proxy.hold(false);
  EXPECT_THROW(rt->kv().get("k"), troupe::Error);
}

// A driver that stays away past the grace loses what it owned, with a
// death cause that says so.
TEST(HeadFailover, ADriverThatDoesNotComeBackLosesWhatItOwnedAfterTheGrace) {
  troupe::testing::LocalCluster cluster(durable(1));
  auto proxy = std::make_unique<TcpProxy>(cluster.address());
  troupe::Runtime watcher = cluster.connect();
  troupe::Runtime rt = connect_through(cluster, *proxy);
  auto t = rt.spawn<Ledger>({.resources = {{"CPU", 1}}}, 10);
  ASSERT_TRUE(t.wait_ready(kWaitBound));
  proxy.reset();  // cut, and nothing listens there any more: the driver cannot come back
  EXPECT_TRUE(eventually([&] { return watcher.actor_info(t.id()).state == troupe::ActorState::kDead; }));
  const std::string cause = watcher.actor_info(t.id()).death_cause;
  EXPECT_NE(cause.find("did not come back within"), std::string::npos) << cause;
}

// A blip between a node agent and a live durable head: the agent keeps its
// workers and joins again as the node it was, within the heartbeat limit.
// Before, the head declared the node dead at the drop: its actors were
// lost and the agent, taken back as a new node, killed its workers.
TEST(HeadFailover, ANodeAgentWhoseConnectionDropsKeepsItsWorkers) {
  auto o = durable(0);
  o.heartbeat_misses = 50;  // 5 s to come back: the agent's reconnect on a loaded machine
  troupe::testing::LocalCluster cluster(o);
  TcpProxy proxy(cluster.address());
  cluster.add_node({{"CPU", 2}}, proxy.address());
  troupe::Runtime rt = cluster.connect();
  auto t = rt.spawn<Ledger>({.resources = {{"CPU", 1}}}, 10);
  const int pid = t.call(&Ledger::pid).get(kWaitBound);
  const uint64_t node = cluster.node_id(0);
  const size_t connections = head_connections(rt);

  // The link goes down, and stays down until the head has seen the drop:
  // the agent's connection and its worker's (the agent gave it the proxy's
  // address), which is a client's blip as in the test above.
  proxy.set_refusing(true);
  const int cut = proxy.cut();
  ASSERT_EQ(cut, 2);
  ASSERT_TRUE(eventually([&] { return head_connections(rt) == connections - cut; })) << rt.status_json();
  proxy.set_refusing(false);
  ASSERT_TRUE(eventually([&] { return head_connections(rt) == connections; })) << rt.status_json();
  // New work is placed there once it is back.
  auto u = rt.spawn<Ledger>({.resources = {{"CPU", 1}}}, 0);
  EXPECT_EQ(u.call(&Ledger::add, 2).get(kWaitBound), 2);
  // Back as itself, the actor in its process.
  auto ns = rt.nodes();
  ASSERT_EQ(ns.size(), 1u) << rt.status_json();
  EXPECT_EQ(ns[0].id, node);
  EXPECT_TRUE(ns[0].alive);
  EXPECT_EQ(ns[0].available.at("CPU"), 0);
  auto info = rt.actor_info(t.id());
  EXPECT_EQ(info.state, troupe::ActorState::kAlive) << info.death_cause;
  EXPECT_EQ(t.call(&Ledger::add, 1).get(kWaitBound), 11);
  EXPECT_EQ(t.call(&Ledger::pid).get(kWaitBound), pid);
}

// A node agent stopped on purpose (SIGTERM) tells the durable head so: its
// node is lost at once, not awaited as a blip would be. A head on another
// machine could not see the agent's process end; here the head would see
// it (same host), so the cause names which of the two it went by.
TEST(HeadFailover, ANodeAgentThatStopsSaysGoodbye) {
  auto o = durable(1);
  o.heartbeat_misses = 50;  // a blip would be awaited 5 s
  troupe::testing::LocalCluster cluster(o);
  troupe::Runtime rt = cluster.connect();
  auto t = rt.spawn<Ledger>({.resources = {{"CPU", 1}}}, 10);
  ASSERT_EQ(t.call(&Ledger::add, 1).get(kWaitBound), 11);
  cluster.kill_node(0, SIGTERM);
  ASSERT_TRUE(eventually([&] { return rt.actor_info(t.id()).state == troupe::ActorState::kDead; }));
  const std::string cause = rt.actor_info(t.id()).death_cause;
  EXPECT_NE(cause.find("said goodbye"), std::string::npos) << cause;
  EXPECT_FALSE(rt.nodes().at(0).alive);
}

// A head gone for good (not durable, killed) and the actor's process gone
// with it: a call fails naming both instead of waiting for an update that
// no head will send (a task running when `troupe stop` came once waited
// out its get's whole timeout when its retry's executor had just been
// reported alive).
TEST(HeadFailover, ACallToAnActorWhoseProcessAndHeadAreGoneFails) {
  troupe::testing::LocalClusterOptions o;
  o.nodes = {{{"CPU", 1}}};
  troupe::testing::LocalCluster cluster(o);
  troupe::Runtime rt = cluster.connect();
  auto t = rt.spawn<Ledger>({.resources = {{"CPU", 1}}}, 10);
  // Alive, and never called: this driver has no connection to its process
  // (as a task executor the head has just reported alive).
  ASSERT_TRUE(t.wait_ready(kWaitBound));
  const int pid = rt.actor_info(t.id()).pid;
  ASSERT_GT(pid, 0);
  cluster.kill_head(SIGKILL);
  ASSERT_TRUE(eventually([&] { return rt.core()->head_lost(); }));
  ::kill(pid, SIGKILL);  // if it has not ended by itself yet
  ASSERT_TRUE(eventually([&] { return troupe::test::process_gone(pid); }));
  try {
    t.call(&Ledger::add, 1).get(kWaitBound);
    FAIL() << "a call to an actor whose process and head are gone returned";
  } catch (const troupe::ActorDied& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cannot be reached"), std::string::npos) << what;
    EXPECT_NE(what.find("the cluster's head is gone"), std::string::npos) << what;
  }
}

// A request that times out while the driver waits to reconnect is withdrawn:
// the head that comes back never carries it out, so a caller that asks
// again on the Timeout does not have it done twice. It was sent with the
// backlog once the head was back.
TEST(HeadFailover, ARequestThatTimesOutWaitingForTheHeadIsNeverSent) {
  troupe::testing::LocalCluster cluster(durable(1));
  troupe::Runtime rt = cluster.connect();
  auto& head = rt.core()->head();
  ASSERT_EQ(head.call<int64_t>(troupe::wire::Op::kKvAdd, troupe::wire::KvAdd{"n", 0}), 0);
  cluster.kill_head(SIGKILL);
  ASSERT_NO_FATAL_FAILURE(wait_until_head_lost(rt));
  try {
    head.call<int64_t>(troupe::wire::Op::kKvAdd, troupe::wire::KvAdd{"n", 1}, std::chrono::milliseconds(300));
    FAIL() << "a request to a head that is down was answered";
  } catch (const troupe::Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("was not sent"), std::string::npos) << e.what();
  }
  cluster.restart_head();
  // Waits for the reconnection and goes out after anything still queued.
  EXPECT_EQ(head.call<int64_t>(troupe::wire::Op::kKvAdd, troupe::wire::KvAdd{"n", 0}, kWaitBound), 0);
}
