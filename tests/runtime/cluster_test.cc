// Integration tests of the actor runtime on a LocalCluster: a real head
// process, two node-agent processes and real worker processes on loopback.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <thread>

#include "tests/support/error_text.h"
#include "tests/support/process.h"
#include "tests/support/raw_client.h"
#include "tests/support/wait.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/testing/fault_injector.h"
#include "troupe/runtime/testing/local_cluster.h"
#include "troupe/runtime/wire/frame.h"
#include "troupe/runtime/wire/protocol.h"
#include "troupe/runtime/wire/rpc.h"

using namespace std::chrono_literals;
using troupe::test::kWaitBound;

class Counter {
 public:
  explicit Counter(int start) : value_(start) {}
  int add(int x) { return value_ += x; }
  int get() const { return value_; }
  int pid() const { return getpid(); }
  uint64_t node() const { return std::stoull(std::getenv("TROUPE_NODE_ID")); }
  std::string fail(std::string message) { throw std::invalid_argument(message); }
  // Runs for `ms` (a workload that is in flight when a test kills the worker).
  int busy(int ms) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return getpid();
  }

 private:
  int value_;
};
TROUPE_ACTOR(Counter, &Counter::add, &Counter::get, &Counter::pid, &Counter::node, &Counter::fail, &Counter::busy)

// Is handed actors: calls one it was given, keeps one in a field, makes one
// and returns it.
struct CounterPair {
  troupe::ActorHandle<Counter> first;
  troupe::ActorHandle<Counter> second;
  TROUPE_FIELDS(first, second)
};
class Broker {
 public:
  int add_through(troupe::ActorHandle<Counter> c, int x) { return c.call(&Counter::add, x).get(); }
  int add_to_both(CounterPair pair, int x) {
    pair.first.call(&Counter::add, x).get();
    return pair.second.call(&Counter::add, x).get();
  }
  troupe::ActorHandle<Counter> make_counter(int start) {
    made_ = troupe::this_actor::runtime().spawn<Counter>({}, start);
    return made_;
  }

 private:
  troupe::ActorHandle<Counter> made_;
};
TROUPE_ACTOR(Broker, &Broker::add_through, &Broker::add_to_both, &Broker::make_counter)

// Holds a constructor argument large enough to travel as an attachment.
class BlobHolder {
 public:
  explicit BlobHolder(troupe::Buffer b) : b_(std::move(b)) {}
  int64_t size() const { return static_cast<int64_t>(b_.size()); }
  int64_t sum() const {
    int64_t s = 0;
    for (size_t i = 0; i < b_.size(); ++i) s += static_cast<unsigned char>(b_.data()[i]);
    return s;
  }
  int pid() const { return getpid(); }

 private:
  troupe::Buffer b_;
};
TROUPE_ACTOR(BlobHolder, &BlobHolder::size, &BlobHolder::sum, &BlobHolder::pid)

class Thrower {
 public:
  explicit Thrower(std::string why) { throw std::runtime_error(why); }
  int nothing() { return 0; }
};
TROUPE_ACTOR(Thrower, &Thrower::nothing)

// A user exception class registered to cross the wire as itself.
class QuotaExceeded : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
TROUPE_ERROR(QuotaExceeded)

// Throws the exception `kind` names with `message`, from a real worker.
class Raiser {
 public:
  Raiser() = default;
  int raise(std::string kind, std::string message) {
    if (kind == "timeout") throw troupe::Timeout(message);
    if (kind == "config") throw troupe::ConfigError(message);
    if (kind == "aborted") throw troupe::Aborted(message);
    if (kind == "actor_died") throw troupe::ActorDied(message);
    if (kind == "decode") throw troupe::DecodeError(message);
    if (kind == "connection") throw troupe::ConnectionError(message);
    if (kind == "quota") throw QuotaExceeded(message);
    throw std::out_of_range(message);
  }
};
TROUPE_ACTOR(Raiser, &Raiser::raise)

// Control messages of the test: Add answers with a sum, Release opens a
// latch that a running call waits on, Refuse makes the handler throw.
struct Add {
  static constexpr const char* kControlTag = "test.add";
  using Reply = int64_t;
  int64_t a = 0;
  int64_t b = 0;
  TROUPE_FIELDS(a, b)
};
struct Release {
  static constexpr const char* kControlTag = "test.release";
  using Reply = void;
  std::string note;
  TROUPE_FIELDS(note)
};
struct Refuse {
  static constexpr const char* kControlTag = "test.refuse";
  using Reply = std::string;
  TROUPE_FIELDS()
};
struct ThrowInt {
  static constexpr const char* kControlTag = "test.throw_int";
  using Reply = int32_t;
  TROUPE_FIELDS()
};
struct Unhandled {
  static constexpr const char* kControlTag = "test.unhandled";
  using Reply = void;
  TROUPE_FIELDS()
};

class Latch {
 public:
  Latch() : state_(std::make_shared<State>()) {
    troupe::this_actor::on_control<Add>([](const Add& m) { return m.a + m.b; });
    troupe::this_actor::on_control<Release>([st = state_](const Release& m) {
      std::lock_guard lock(st->mu);
      st->note = m.note;
      st->open = true;
      st->cv.notify_all();
    });
    troupe::this_actor::on_control<Refuse>(
        [](const Refuse&) -> std::string { throw troupe::ConfigError("refused on purpose"); });
    troupe::this_actor::on_control<ThrowInt>([](const ThrowInt&) -> int32_t { throw 42; });
  }
  // Returns once a Release control message arrives (at most 60 s): only a
  // message that bypasses the mailbox can end this call.
  std::string wait_release() {
    std::unique_lock lock(state_->mu);
    if (!state_->cv.wait_for(lock, std::chrono::seconds(60), [&] { return state_->open; }))
      throw troupe::Timeout("no release");
    return state_->note;
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool open = false;
    std::string note;
  };
  std::shared_ptr<State> state_;
};
TROUPE_ACTOR(Latch, &Latch::wait_release)

// Keeps what it was given, in the order the calls ran.
class Recorder {
 public:
  std::string add(std::string v) {
    seen_.push_back(v);
    return v;
  }
  std::vector<std::string> all() { return seen_; }
  int64_t measure(std::string s) { return static_cast<int64_t>(s.size()); }
  std::string make(int64_t n) { return std::string(static_cast<size_t>(n), 'x'); }

 private:
  std::vector<std::string> seen_;
};
TROUPE_ACTOR(Recorder, &Recorder::add, &Recorder::all, &Recorder::measure, &Recorder::make)

// Overloads, one picked with a cast whose commas are inside brackets.
class Overloaded {
 public:
  int f(int a) { return a; }
  int f(int a, int b) { return a + b; }
  int g() { return 7; }
};
TROUPE_ACTOR(Overloaded, static_cast<int (Overloaded::*)(int, int)>(&Overloaded::f), &Overloaded::g)

// Calls that wait at a gate until let through, counting how many wait at
// once: enter in the default group, enter_io in "io", the rest in
// "control" (ConcurrencyGroupsTest).
class Gate {
 public:
  // Waits (at most 60 s) for a permit of its own kind (release).
  void enter() { pass(plain_); }
  void enter_io() { pass(io_); }
  void release(bool io, int n) {
    std::lock_guard lock(mu_);
    (io ? io_ : plain_).permits += n;
    cv_.notify_all();
  }
  // {inside now, let through so far, the most inside at once}
  std::vector<int> counts(bool io) {
    std::lock_guard lock(mu_);
    const Kind& k = io ? io_ : plain_;
    return {k.inside, k.done, k.peak};
  }

 private:
  struct Kind {
    int permits = 0, inside = 0, done = 0, peak = 0;
  };
  void pass(Kind& k) {
    std::unique_lock lock(mu_);
    k.peak = std::max(k.peak, ++k.inside);
    cv_.notify_all();
    const bool let = cv_.wait_for(lock, std::chrono::seconds(60), [&] { return k.permits > 0; });
    --k.inside;
    if (!let) throw troupe::Timeout("no permit");
    --k.permits;
    ++k.done;
  }
  std::mutex mu_;
  std::condition_variable cv_;
  Kind plain_, io_;
};
TROUPE_ACTOR(Gate, &Gate::enter, &Gate::enter_io, &Gate::release, &Gate::counts)

// Starts processes of its own, as a DataLoader's workers or an actor's
// subprocess would be.
class ChildMaker {
 public:
  int start_sleeper() {
    pid_t child = -1;
    char sleep_cmd[] = "sleep", seconds[] = "600";
    char* argv[] = {sleep_cmd, seconds, nullptr};
    if (::posix_spawnp(&child, "sleep", nullptr, nullptr, argv, environ) != 0) return -1;
    return child;
  }
  int quit() { ::_exit(0); }
  // Runs this executable (a troupe program: its main serves a role when
  // told to) to list its tests, as an actor runs `troupe status` or a
  // helper of its own; its exit status, or -2 when it ran past 60 s.
  int run_self() {
    posix_spawn_file_actions_t quiet;
    ::posix_spawn_file_actions_init(&quiet);
    ::posix_spawn_file_actions_addopen(&quiet, 1, "/dev/null", O_WRONLY, 0);
    pid_t child = -1;
    char exe[] = "/proc/self/exe", list[] = "--gtest_list_tests";
    char* argv[] = {exe, list, nullptr};
    const int spawned = ::posix_spawn(&child, exe, &quiet, nullptr, argv, environ);
    ::posix_spawn_file_actions_destroy(&quiet);
    if (spawned != 0) return -1;
    int status = 0;
    for (int i = 0; i < 600; ++i) {
      if (::waitpid(child, &status, WNOHANG) == child) return WIFEXITED(status) ? WEXITSTATUS(status) : -3;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ::kill(child, SIGKILL);
    ::waitpid(child, &status, 0);
    return -2;
  }
  int pid() { return ::getpid(); }
};
TROUPE_ACTOR(ChildMaker, &ChildMaker::start_sleeper, &ChildMaker::quit, &ChildMaker::run_self, &ChildMaker::pid)

namespace {

using troupe::test::eventually;
using troupe::testing::LocalCluster;

// Ended: no such process, or a zombie whose parent (the dead worker) is
// gone and which init has not reaped yet.
bool ended(pid_t pid) {
  return troupe::test::process_gone(pid) || troupe::test::proc_state("/proc/" + std::to_string(pid) + "/stat") == 'Z';
}

class ClusterTest : public ::testing::Test {
 protected:
  ClusterTest() : cluster_(), rt_(cluster_.connect()) {}
  LocalCluster cluster_;
  troupe::Runtime rt_;
};

// A troupe program an actor starts runs as itself: it inherited the
// worker's TROUPE_ROLE and said hello as a second worker of the actor
// (constructing it again, taking its callers, never exiting).
TEST_F(ClusterTest, ATroupeProgramAnActorStartsIsNotAWorkerOfIt) {
  auto maker = rt_.spawn<ChildMaker>({});
  const int pid = maker.call(&ChildMaker::pid).get(kWaitBound);
  EXPECT_EQ(maker.call(&ChildMaker::run_self).get(std::chrono::seconds(90)), 0);
  EXPECT_EQ(maker.call(&ChildMaker::pid).get(kWaitBound), pid);
  EXPECT_EQ(rt_.actor_info(maker.id()).pid, pid);
}

// A node agent killed outright (out of memory, kill -9) takes its workers
// with it (the parent-death signal), and what they started: the worker
// alone died, and the actor's own processes ran on, reparented to init.
TEST(AgentKilled, WhatItsWorkersStartedEndsWithThem) {
  LocalCluster cluster({.nodes = {{{"CPU", 2}}, {{"CPU", 2}}}});
  troupe::Runtime rt = cluster.connect();
  auto maker = rt.spawn<ChildMaker>({});
  const int worker = maker.call(&ChildMaker::pid).get(kWaitBound);
  const int sleeper = maker.call(&ChildMaker::start_sleeper).get(kWaitBound);
  ASSERT_GT(sleeper, 0);
  const uint64_t node = rt.actor_info(maker.id()).node_id;
  size_t index = 0;
  while (cluster.node_id(index) != node) ++index;
  cluster.kill_node(index, SIGKILL);
  EXPECT_TRUE(eventually([&] { return ended(worker); }));
  EXPECT_TRUE(eventually([&] { return ended(sleeper); })) << "the actor's process outlived its node agent";
}

TEST_F(ClusterTest, CallsFromOneCallerRunInOrder) {
  auto c = rt_.spawn<Counter>({}, 0);
  std::vector<troupe::Future<int>> fs;
  for (int i = 0; i < 2000; ++i) fs.push_back(c.call(&Counter::add, 1));
  for (int i = 0; i < 2000; ++i) ASSERT_EQ(fs[i].get(kWaitBound), i + 1);
  EXPECT_EQ(c.call(&Counter::get).get(kWaitBound), 2000);
}

TEST_F(ClusterTest, RemoteErrorCarriesTypeAndMessageAndActorKeepsServing) {
  auto c = rt_.spawn<Counter>({}, 5);
  try {
    c.call(&Counter::fail, std::string("boom 42")).get(kWaitBound);
    FAIL() << "expected RemoteError";
  } catch (const troupe::RemoteError& e) {
    EXPECT_EQ(e.type_name(), "std::invalid_argument");
    EXPECT_EQ(e.remote_message(), "boom 42");
  }
  EXPECT_EQ(c.call(&Counter::add, 1).get(kWaitBound), 6);
}

// Each error kind crosses the wire and is caught by its type, with the
// message the actor gave it; the actor keeps serving.
TEST_F(ClusterTest, ErrorKindsAreCaughtByType) {
  auto r = rt_.spawn<Raiser>({});
  auto expect_kind = [&]<class E>(const std::string& kind) {
    try {
      r.call(&Raiser::raise, kind, "because " + kind).get(kWaitBound);
      ADD_FAILURE() << "no error for " << kind;
    } catch (const E& e) {
      EXPECT_EQ(std::string(e.what()), "because " + kind);
    } catch (const std::exception& e) {
      ADD_FAILURE() << kind << " arrived as " << e.what();
    }
  };
  expect_kind.operator()<troupe::Timeout>("timeout");
  expect_kind.operator()<troupe::ConfigError>("config");
  expect_kind.operator()<troupe::Aborted>("aborted");
  expect_kind.operator()<troupe::ActorDied>("actor_died");
  expect_kind.operator()<troupe::DecodeError>("decode");
  expect_kind.operator()<troupe::ConnectionError>("connection");
  // Unregistered classes still arrive as RemoteError naming their type.
  try {
    r.call(&Raiser::raise, std::string("other"), std::string("out")).get(kWaitBound);
    ADD_FAILURE() << "no error";
  } catch (const troupe::RemoteError& e) {
    EXPECT_EQ(e.type_name(), "std::out_of_range");
    EXPECT_EQ(e.remote_message(), "out");
  }
}

// A class registered with TROUPE_ERROR is caught by its class.
TEST_F(ClusterTest, RegisteredUserErrorIsCaughtByItsClass) {
  auto r = rt_.spawn<Raiser>({});
  try {
    r.call(&Raiser::raise, std::string("quota"), std::string("3 of 2 GPUs")).get(kWaitBound);
    FAIL() << "expected QuotaExceeded";
  } catch (const QuotaExceeded& e) {
    EXPECT_EQ(std::string(e.what()), "3 of 2 GPUs");
  }
}

// Typed control messages: the reply is typed, a handler's error arrives by
// type, a message with no handler is a ConfigError naming its tag, and a
// control message is served while the actor's call runs.
TEST_F(ClusterTest, TypedControlMessagesBypassTheMailbox) {
  auto l = rt_.spawn<Latch>({});
  ASSERT_TRUE(l.wait_ready(kWaitBound));
  troupe::Future<std::string> waiting = l.call(&Latch::wait_release);
  EXPECT_EQ(l.control(Add{.a = 40, .b = 2}).get(kWaitBound), 42);
  EXPECT_THROW(l.control(Refuse{}).get(kWaitBound), troupe::ConfigError);
  // A handler that throws what is no std::exception is answered as a
  // method's is (it ended the worker: std::terminate on its I/O thread).
  EXPECT_THROW(l.control(ThrowInt{}).get(kWaitBound), troupe::Error);
  EXPECT_EQ(l.control(Add{.a = 1, .b = 2}).get(kWaitBound), 3);
  try {
    l.control(Unhandled{}).get(kWaitBound);
    ADD_FAILURE() << "expected ConfigError";
  } catch (const troupe::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("test.unhandled"), std::string::npos) << e.what();
  }
  l.control(Release{.note = "go"}).get(kWaitBound);
  EXPECT_EQ(waiting.get(kWaitBound), "go");
}

// A worker runs one thread per concurrent call: a count past the bound is
// refused naming it, not a worker that dies making threads.
TEST_F(ClusterTest, MaxConcurrencyOutsideItsBoundIsRefusedNamingIt) {
  for (int bad : {0, 1025, 1 << 30}) {
    try {
      rt_.spawn<Counter>({.max_concurrency = bad}, 0);
      ADD_FAILURE() << bad << " accepted";
    } catch (const troupe::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("max_concurrency must be in [1, 1024], got " + std::to_string(bad)),
                std::string::npos)
          << e.what();
    }
  }
  auto c = rt_.spawn<Counter>({.max_concurrency = 1024}, 0);
  EXPECT_EQ(c.call(&Counter::add, 2).get(), 2);
}

// A call that waits for a Future argument is not overtaken by the calls
// made after it (Ray's rule for one caller): "ready" used to run first.
TEST_F(ClusterTest, ACallWaitingForAnArgumentIsNotOvertaken) {
  auto latch = rt_.spawn<Latch>({});
  ASSERT_TRUE(latch.wait_ready(kWaitBound));
  auto rec = rt_.spawn<Recorder>({});
  troupe::Future<std::string> waited = latch.call(&Latch::wait_release);
  auto first = rec.call(&Recorder::add, waited);
  auto second = rec.call(&Recorder::add, std::string("ready"));
  latch.control(Release{"waited"}).get(kWaitBound);
  EXPECT_EQ(first.get(kWaitBound), "waited");
  EXPECT_EQ(second.get(kWaitBound), "ready");
  EXPECT_EQ(rec.call(&Recorder::all).get(kWaitBound), (std::vector<std::string>{"waited", "ready"}));
}

// Each concurrency group runs its calls on threads of its own, at most its
// max_concurrency at once, while the default group's call waits: with one
// call at a time for the whole actor, counts() would wait behind enter().
TEST_F(ClusterTest, ConcurrencyGroupsRunBesideTheDefaultGroupEachToItsCap) {
  auto g = rt_.spawn<Gate>(
      {.max_concurrency = 1, .concurrency_groups = {{"io", 2, {"enter_io"}}, {"control", 1, {"release", "counts"}}}});
  auto plain = g.call(&Gate::enter);
  auto counts = [&](bool io) { return g.call(&Gate::counts, io).get(kWaitBound); };
  ASSERT_TRUE(eventually([&] { return counts(false)[0] == 1; }));
  std::vector<troupe::Future<void>> io;
  for (int i = 0; i < 3; ++i) io.push_back(g.call(&Gate::enter_io));
  ASSERT_TRUE(eventually([&] { return counts(true)[0] == 2; }));
  // The third waits for a thread of "io": let one through, and it enters.
  g.call(&Gate::release, true, 1).get(kWaitBound);
  ASSERT_TRUE(eventually([&] {
    auto c = counts(true);
    return c[1] == 1 && c[0] == 2;
  }));
  g.call(&Gate::release, true, 2).get(kWaitBound);
  for (auto& f : io) f.get(kWaitBound);
  EXPECT_EQ(counts(true)[2], 2) << "more io calls ran at once than the group's max_concurrency";
  g.call(&Gate::release, false, 1).get(kWaitBound);
  plain.get(kWaitBound);
  EXPECT_EQ(counts(false)[2], 1);
}

// A value by value past one message's limit is refused by the sender,
// naming the size: the receiver used to close the connection, which
// failed the call as ActorDied (and used up a task's retries).
TEST_F(ClusterTest, AValueTooBigForAMessageIsRefusedByNameAndTheActorServesOn) {
  auto rec = rt_.spawn<Recorder>({});
  auto refused = [&](auto attempt, const std::string& says) {
    try {
      attempt();
      ADD_FAILURE() << says << ": taken";
    } catch (const troupe::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused([&] { return rec.call(&Recorder::measure, std::string(70u << 20, 'x')).get(kWaitBound); },
          "(Recorder): 70.0 MiB encoded, more than the 64 MiB one message carries");
  refused([&] { return rec.call(&Recorder::make, int64_t{70} << 20).get(kWaitBound); },
          "the result of Recorder.make: 70.0 MiB encoded");
  EXPECT_EQ(rec.call(&Recorder::measure, std::string("ok")).get(kWaitBound), 2);
}

// TROUPE_ACTOR's names: a cast's commas used to split it, so the names
// after it shifted (a concurrency group listing "g" went to no method).
TEST_F(ClusterTest, MethodsPickedWithACastKeepTheirNames) {
  EXPECT_EQ(troupe::client::method_names<Overloaded>(), (std::vector<std::string>{"f", "g"}));
  auto o = rt_.spawn<Overloaded>({.concurrency_groups = {{"io", 1, {"g"}}}});
  EXPECT_EQ(o.call(static_cast<int (Overloaded::*)(int, int)>(&Overloaded::f), 2, 3).get(kWaitBound), 5);
  EXPECT_EQ(o.call(&Overloaded::g).get(kWaitBound), 7);
}

TEST_F(ClusterTest, BadConcurrencyGroupsAreRefusedNamingTheValue) {
  using Groups = std::vector<troupe::wire::ConcurrencyGroup>;
  auto refused = [&](const Groups& groups, const std::string& says) {
    try {
      rt_.spawn<Gate>({.concurrency_groups = groups});
      ADD_FAILURE() << says << ": accepted";
    } catch (const troupe::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused({{"io", 1, {"enter_io", "no_such"}}}, "lists method 'no_such', which Gate does not have");
  refused({{"io", 1, {}}, {"io", 2, {}}}, "group 'io' is given twice");
  refused({{"a", 1, {"enter"}}, {"b", 1, {"enter"}}}, "method 'enter' is in two groups, 'a' and 'b'");
  refused({{"io", 0, {}}}, "group 'io' has max_concurrency 0, not in [1, 1024]");
  refused({{"", 1, {}}}, "group #0 has an empty name");
}

TEST_F(ClusterTest, ConstructorFailureMakesActorDeadWithReason) {
  auto t = rt_.spawn<Thrower>({.max_restarts = 3}, std::string("no GPU here"));
  EXPECT_FALSE(t.wait_ready(10s));
  try {
    t.call(&Thrower::nothing).get(kWaitBound);
    FAIL() << "expected ActorDied";
  } catch (const troupe::ActorDied& e) {
    EXPECT_NE(std::string(e.what()).find("no GPU here"), std::string::npos) << e.what();
  }
}

TEST_F(ClusterTest, StrictSpreadPutsBundlesOnDistinctNodes) {
  auto pg = rt_.create_placement_group({{{"CPU", 1}}, {{"CPU", 1}}}, troupe::PlacementStrategy::kStrictSpread);
  ASSERT_TRUE(pg.wait(kWaitBound));
  auto info = pg.info();
  ASSERT_EQ(info.bundle_nodes.size(), 2u);
  EXPECT_NE(info.bundle_nodes[0], info.bundle_nodes[1]);
  auto a = rt_.spawn<Counter>({.resources = {{"CPU", 1}}, .placement_group = &pg, .bundle_index = 0}, 0);
  auto b = rt_.spawn<Counter>({.resources = {{"CPU", 1}}, .placement_group = &pg, .bundle_index = 1}, 0);
  EXPECT_EQ(a.call(&Counter::node).get(kWaitBound), info.bundle_nodes[0]);
  EXPECT_EQ(b.call(&Counter::node).get(kWaitBound), info.bundle_nodes[1]);
}

TEST_F(ClusterTest, UnsatisfiableRequestsStayPendingAndAreReported) {
  auto pg =
      rt_.create_placement_group({{{"CPU", 1}}, {{"CPU", 1}}, {{"CPU", 1}}}, troupe::PlacementStrategy::kStrictSpread);
  EXPECT_FALSE(pg.wait(300ms));
  EXPECT_NE(pg.info().pending_reason.find("STRICT_SPREAD"), std::string::npos);

  auto g = rt_.spawn<Counter>({.resources = {{"GPU", 1}}}, 0);
  try {
    g.wait_ready(300ms);
    FAIL() << "expected Timeout";
  } catch (const troupe::Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("GPU=1"), std::string::npos) << e.what();
  }
  EXPECT_EQ(g.info().state, troupe::ActorState::kPending);
  auto status = nlohmann::json::parse(rt_.status_json());
  bool found = false;
  for (auto& a : status["actors"])
    if (a["id"] == g.id()) {
      found = true;
      EXPECT_EQ(a["state"], "PENDING");
      EXPECT_NE(a["pending_reason"].get<std::string>(), "");
    }
  EXPECT_TRUE(found);
  // A node that has the resource makes it run.
  cluster_.add_node({{"CPU", 1}, {"GPU", 1}});
  EXPECT_TRUE(g.wait_ready(kWaitBound));
  EXPECT_EQ(g.call(&Counter::add, 2).get(kWaitBound), 2);
}

TEST_F(ClusterTest, KilledWorkerRestartsThenDiesWhenRestartsRunOut) {
  auto c = rt_.spawn<Counter>({.max_restarts = 1}, 10);
  EXPECT_EQ(c.call(&Counter::add, 5).get(kWaitBound), 15);
  int pid1 = c.call(&Counter::pid).get(kWaitBound);
  auto in_flight = c.call(&Counter::busy, 5000);
  ASSERT_EQ(::kill(pid1, SIGKILL), 0);
  // The call in flight names why its process ended, as the head reports it,
  // not only that its connection closed.
  try {
    in_flight.get(kWaitBound);
    FAIL() << "expected ActorDied";
  } catch (const troupe::ActorDied& e) {
    EXPECT_NE(std::string(e.what()).find("killed by signal 9"), std::string::npos) << e.what();
  }
  ASSERT_TRUE(eventually([&] { return c.info().restarts == 1 && c.info().state == troupe::ActorState::kAlive; }));
  // The constructor ran again with the same arguments.
  EXPECT_EQ(c.call(&Counter::get).get(kWaitBound), 10);
  int pid2 = c.call(&Counter::pid).get(kWaitBound);
  EXPECT_NE(pid1, pid2);

  ASSERT_EQ(::kill(pid2, SIGKILL), 0);
  ASSERT_TRUE(eventually([&] { return c.info().state == troupe::ActorState::kDead; }));
  EXPECT_NE(c.info().death_cause.find("signal 9"), std::string::npos) << c.info().death_cause;
  EXPECT_THROW(c.call(&Counter::get).get(kWaitBound), troupe::ActorDied);
}

// Runtime::kill with restarts returns once the killed incarnation is gone:
// a call made after it reaches the new one (fresh state, another pid).
// Before, it returned once the head had sent the kill, and the next call
// was answered by the old incarnation or failed with ActorDied.
TEST_F(ClusterTest, ACallAfterAKillWithRestartsReachesTheNewIncarnation) {
  auto c = rt_.spawn<Counter>({.max_restarts = 3}, 10);
  for (int round = 0; round < 3; ++round) {
    EXPECT_EQ(c.call(&Counter::add, 5).get(kWaitBound), 15) << "round " << round;
    const int before = c.call(&Counter::pid).get(kWaitBound);
    rt_.kill(c, /*no_restart=*/false);
    EXPECT_EQ(c.call(&Counter::get).get(kWaitBound), 10) << "round " << round << ": the old state answered";
    EXPECT_NE(c.call(&Counter::pid).get(kWaitBound), before) << "round " << round;
  }
}

// What a worker started goes with it: killed (troupe.kill, a restart), or
// ended by itself. Such processes outlived their worker, reparented to
// init (Ray kills them: kill_child_processes_on_worker_exit).
TEST_F(ClusterTest, ProcessesAWorkerStartedEndWithIt) {
  auto killed = rt_.spawn<ChildMaker>({});
  const int a = killed.call(&ChildMaker::start_sleeper).get(kWaitBound);
  ASSERT_GT(a, 0);
  auto quits = rt_.spawn<ChildMaker>({});
  const int b = quits.call(&ChildMaker::start_sleeper).get(kWaitBound);
  ASSERT_GT(b, 0);
  EXPECT_FALSE(ended(a));
  rt_.kill(killed);
  EXPECT_TRUE(eventually([&] { return ended(a); }));
  EXPECT_THROW(quits.call(&ChildMaker::quit).get(kWaitBound), troupe::ActorDied);
  EXPECT_TRUE(eventually([&] { return ended(b); }));
}

// A call made just after its actor's worker died: its client connects to
// the dead process's address while the head reports the replacement. The
// head's update finds that connect under way and leaves it; when it fails,
// the call goes to the replacement (it once waited forever: hello_actors'
// call after its SIGKILL hung under load). The "dead process" here is a
// socket that completes TCP connects and never answers a hello, closed
// after the update: the order is forced, not raced.
TEST_F(ClusterTest, CallQueuedWhileConnectingToAReplacedWorkerGoesToTheReplacement) {
  auto c = rt_.spawn<Counter>({}, 5);
  ASSERT_EQ(c.call(&Counter::get).get(kWaitBound), 5);
  const troupe::ActorInfo replacement = c.info();

  int silent = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(silent, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(silent, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(silent, 4), 0);
  socklen_t len = sizeof addr;
  ASSERT_EQ(::getsockname(silent, reinterpret_cast<sockaddr*>(&addr), &len), 0);

  troupe::ActorInfo dead = replacement;
  dead.address = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  troupe::ActorInfo newer = replacement;
  newer.incarnation = dead.incarnation + 1;
  auto core = rt_.core();
  auto client = std::make_shared<troupe::client::ActorClient>(*core, dead);
  auto answer = std::make_shared<troupe::core::FutureState<int>>();
  troupe::wire::Encoder args;
  troupe::wire::encode(args, std::tuple<>{});
  client->submit(
      troupe::client::method_index<Counter>(&Counter::get), std::move(args),
      [answer, raw = core.get()](troupe::wire::Message& m) { troupe::client::complete_call<int>(*answer, m, raw); },
      [answer](std::exception_ptr e) { answer->set_error(e); });
  client->on_update(newer);  // while the connect to `dead` waits for its hello
  ::close(silent);           // refuses it: the connect fails
  EXPECT_EQ(troupe::Future<int>(answer).get(kWaitBound), 5);
  client->detach("test over");
}

TEST_F(ClusterTest, TaskRetriesResendCallsInFlight) {
  auto c = rt_.spawn<Counter>({.max_restarts = 1, .max_task_retries = 1}, 0);
  int pid1 = c.call(&Counter::pid).get(kWaitBound);
  auto in_flight = c.call(&Counter::busy, 300);
  ASSERT_EQ(::kill(pid1, SIGKILL), 0);
  int pid2 = in_flight.get(kWaitBound);  // ran again on the restarted worker
  EXPECT_NE(pid2, pid1);
}

TEST_F(ClusterTest, KilledNodeAgentMovesItsActorsToTheOtherNode) {
  auto c = rt_.spawn<Counter>({.resources = {{"CPU", 2}}, .max_restarts = 2}, 7);
  uint64_t first = c.call(&Counter::node).get(kWaitBound);
  size_t index = cluster_.node_id(0) == first ? 0 : 1;
  int worker_pid = c.call(&Counter::pid).get(kWaitBound);
  cluster_.kill_node(index, SIGKILL);
  ASSERT_TRUE(eventually([&] {
    auto i = c.info();
    return i.state == troupe::ActorState::kAlive && i.node_id != first;
  }));
  EXPECT_EQ(c.call(&Counter::add, 1).get(kWaitBound), 8);
  EXPECT_EQ(c.call(&Counter::node).get(kWaitBound), cluster_.node_id(1 - index));
  // The old worker died with its node agent.
  EXPECT_TRUE(eventually([&] { return troupe::test::process_gone(worker_pid); }));
}

TEST(ClusterHeartbeat, SilentNodeIsDeclaredDeadAndItsActorsMove) {
  troupe::testing::LocalClusterOptions o;
  o.heartbeat_ms = 50;
  o.heartbeat_misses = 8;  // a lease of 350 ms: a loaded machine's head may stall 150
  LocalCluster cluster(o);
  troupe::Runtime rt = cluster.connect();
  auto c = rt.spawn<Counter>({.resources = {{"CPU", 2}}, .max_restarts = 1}, 3);
  uint64_t first = c.call(&Counter::node).get(kWaitBound);
  size_t index = cluster.node_id(0) == first ? 0 : 1;
  int worker_pid = c.call(&Counter::pid).get(kWaitBound);
  // A stopped node agent keeps its connection open but stops heartbeating.
  cluster.kill_node(index, SIGSTOP);
  ASSERT_TRUE(eventually([&] {
    auto i = c.info();
    return i.state == troupe::ActorState::kAlive && i.node_id != first;
  }));
  EXPECT_EQ(c.info().restarts, 1);
  EXPECT_NE(c.info().death_cause.find("node"), std::string::npos) << c.info().death_cause;
  EXPECT_EQ(c.call(&Counter::add, 1).get(kWaitBound), 4);
  // When it wakes up it finds itself declared dead and takes its worker down.
  cluster.kill_node(index, SIGCONT);
  EXPECT_TRUE(eventually([&] { return troupe::test::process_gone(worker_pid); }));
}

TEST_F(ClusterTest, FaultInjectorKillsAndStallsOnCue) {
  auto c = rt_.spawn<Counter>({.max_restarts = 2}, 0);
  c.wait_ready();
  troupe::testing::FaultInjector faults(rt_);
  int pid1 = c.call(&Counter::pid).get(kWaitBound);
  faults.at_step(3, [&] { faults.kill_actor(c.id()); });
  for (int step = 0; step < 3; ++step) faults.on_step(step);
  EXPECT_EQ(::kill(pid1, 0), 0);  // not yet
  faults.on_step(3);
  ASSERT_TRUE(eventually([&] { return c.info().restarts == 1 && c.info().state == troupe::ActorState::kAlive; }));
  // A stalled worker answers late but answers.
  faults.stall_actor(c.id(), 300ms);
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(c.call(&Counter::add, 1).get(kWaitBound), 1);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 250ms);
  ASSERT_EQ(faults.faults().size(), 2u);
  EXPECT_NE(faults.faults()[0].what.find("SIGKILL actor"), std::string::npos);
}

TEST_F(ClusterTest, NamedActorsAreFoundByName) {
  auto c = rt_.spawn<Counter>({.name = "global-counter"}, 100);
  auto same = rt_.get_actor<Counter>("global-counter");
  EXPECT_EQ(same.id(), c.id());
  EXPECT_EQ(same.call(&Counter::add, 1).get(kWaitBound), 101);
  EXPECT_THROW(rt_.get_actor<Counter>("no-such-actor"), troupe::ConfigError);
  EXPECT_THROW(rt_.spawn<Counter>({.name = "global-counter"}, 0), troupe::ConfigError);
  // Another driver sees it too.
  troupe::Runtime other = cluster_.connect();
  EXPECT_EQ(other.get_actor<Counter>("global-counter").call(&Counter::get).get(kWaitBound), 101);
}

// Actor handles travel in arguments, fields and results, as Ray's do: a
// handle had no Codec, so only named actors could be shared.
TEST_F(ClusterTest, ActorHandlesTravelToAndFromActors) {
  auto counter = rt_.spawn<Counter>({}, 10);
  auto broker = rt_.spawn<Broker>({});
  EXPECT_EQ(broker.call(&Broker::add_through, counter, 5).get(kWaitBound), 15);
  auto other = rt_.spawn<Counter>({}, 100);
  EXPECT_EQ(broker.call(&Broker::add_to_both, CounterPair{counter, other}, 1).get(kWaitBound), 101);
  EXPECT_EQ(counter.call(&Counter::get).get(kWaitBound), 16);
  // A handle made inside an actor comes back and is called from here.
  auto made = broker.call(&Broker::make_counter, 7).get(kWaitBound);
  EXPECT_EQ(made.call(&Counter::add, 3).get(kWaitBound), 10);
  EXPECT_EQ(broker.call(&Broker::add_through, made, 1).get(kWaitBound), 11);
  // An empty handle travels as one and names no actor there.
  EXPECT_THROW(broker.call(&Broker::add_through, troupe::ActorHandle<Counter>(), 1).get(kWaitBound), troupe::Error);
}

TEST_F(ClusterTest, FuturesCanBeArguments) {
  auto a = rt_.spawn<Counter>({}, 1);
  auto b = rt_.spawn<Counter>({}, 100);
  auto fa = a.call(&Counter::add, 1);   // 2
  auto fb = b.call(&Counter::add, fa);  // 102
  EXPECT_EQ(fb.get(kWaitBound), 102);
  std::vector<troupe::Future<int>> fs{a.call(&Counter::busy, 2000), b.call(&Counter::add, 0)};
  EXPECT_EQ(troupe::wait_any(fs, kWaitBound), 1u);
  troupe::wait_all(fs);
  EXPECT_TRUE(fs[0].ready());
}

// `--address` with no value is refused by name (it embedded a cluster, as
// if not given, when it came last or as `--address=`).
TEST(ConnectTest, AnAddressFlagWithoutAValueIsRefused) {
  for (std::vector<std::string> args :
       {std::vector<std::string>{"driver", "--address"}, std::vector<std::string>{"driver", "--address="}}) {
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    const std::string why = troupe::test::error_of([&] { troupe::init(static_cast<int>(argv.size()), argv.data()); });
    EXPECT_NE(why.find("--address needs a value"), std::string::npos) << why;
  }
}

// Without a token, a malformed address is still what is named first; a
// good address without a token asks for the token.
TEST(ConnectTest, MalformedAddressIsNamedBeforeTheMissingToken) {
  // The ConfigError of connecting to `address` without a token.
  auto refusal = [](const std::string& address) -> std::string {
    troupe::InitOptions o;
    o.address = address;
    try {
      troupe::Runtime::connect(o);
    } catch (const troupe::ConfigError& e) {
      return e.what();
    }
    ADD_FAILURE() << address << " accepted without a token";
    return "";
  };
  for (const std::string bad : {"nohost", "127.0.0.1:99999", "127.0.0.1:"}) {
    const std::string why = refusal(bad);
    EXPECT_NE(why.find(bad), std::string::npos) << why;
    EXPECT_EQ(why.find("token"), std::string::npos) << why;
  }
  // Something listens (a bare socket here): only then is the token asked for.
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof sa;
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len), 0);
  const std::string listening = "127.0.0.1:" + std::to_string(ntohs(sa.sin_port));
  const std::string why = refusal(listening);
  EXPECT_NE(why.find("needs the cluster token"), std::string::npos) << why;
  // Nothing listens there any more: said as that, not as a token to find.
  ::close(fd);
  try {
    troupe::InitOptions o;
    o.address = listening;
    troupe::Runtime::connect(o);
    ADD_FAILURE() << listening << " accepted without a token";
  } catch (const troupe::ConnectionError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot connect to " + listening), std::string::npos) << e.what();
  }
}

// Constructor arguments of 16 KiB and more are encoded as attachments; the
// head is sent them and keeps them (a restart replays them), and the driver
// stays connected. They used to be dropped on the way to the head, which
// then closed the driver's connection.
TEST_F(ClusterTest, LargeConstructorArgumentsReachTheActorAndItsRestart) {
  std::string bytes(256 * 1024, '\0');
  int64_t want = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    bytes[i] = static_cast<char>(i * 7 % 251);
    want += static_cast<unsigned char>(bytes[i]);
  }
  auto h = rt_.spawn<BlobHolder>({.max_restarts = 1}, troupe::Buffer::from_string(bytes));
  EXPECT_EQ(h.call(&BlobHolder::size).get(kWaitBound), static_cast<int64_t>(bytes.size()));
  EXPECT_EQ(h.call(&BlobHolder::sum).get(kWaitBound), want);
  const int first = h.call(&BlobHolder::pid).get(kWaitBound);
  ASSERT_EQ(::kill(first, SIGKILL), 0);
  ASSERT_TRUE(troupe::test::eventually([&] {
    try {
      return h.call(&BlobHolder::pid).get(kWaitBound) != first;
    } catch (const troupe::Error&) {
      return false;
    }
  }));
  EXPECT_EQ(h.call(&BlobHolder::sum).get(kWaitBound), want);
  // The driver's connection to the head still serves.
  auto c = rt_.spawn<Counter>({}, 1);
  EXPECT_EQ(c.call(&Counter::add, 1).get(kWaitBound), 2);
}

TEST_F(ClusterTest, WrongTokenIsRefused) {
  troupe::InitOptions o;
  o.address = cluster_.address();
  o.token = "not-the-token";
  EXPECT_THROW(troupe::Runtime::connect(o), troupe::ConnectionError);
  troupe::test::RawClient raw(cluster_.address());
  EXPECT_FALSE(raw.handshake("still-wrong"));
  // The cluster keeps serving.
  auto c = rt_.spawn<Counter>({}, 1);
  EXPECT_EQ(c.call(&Counter::add, 1).get(kWaitBound), 2);
}

TEST_F(ClusterTest, MalformedAndOversizedFramesCloseOnlyThatConnection) {
  auto c = rt_.spawn<Counter>({}, 0);
  ASSERT_EQ(c.call(&Counter::add, 1).get(kWaitBound), 1);
  std::string worker = c.info().address;
  for (const std::string& target : {cluster_.address(), worker}) {
    {
      troupe::test::RawClient raw(target);
      ASSERT_TRUE(raw.handshake(cluster_.token()));
      uint32_t bad[4] = {0x12345678, 64, 0, 0};  // wrong magic
      raw.write(bad, sizeof(bad));
      EXPECT_TRUE(raw.closed_by_peer()) << target;
    }
    {
      troupe::test::RawClient raw(target);
      ASSERT_TRUE(raw.handshake(cluster_.token()));
      uint32_t huge[4] = {troupe::wire::kFrameMagic, 8, 1, 0};
      uint64_t size = uint64_t(1) << 40;  // a 1 TiB attachment
      raw.write(huge, sizeof(huge));
      raw.write(&size, sizeof(size));
      EXPECT_TRUE(raw.closed_by_peer()) << target;
    }
    {
      troupe::test::RawClient raw(target);
      ASSERT_TRUE(raw.handshake(cluster_.token()));
      std::vector<uint8_t> junk(64, 0xff);
      uint32_t hdr[4] = {troupe::wire::kFrameMagic, 64, 0, 0};
      raw.write(hdr, sizeof(hdr));
      raw.write(junk.data(), junk.size());  // not a Cap'n Proto message
      EXPECT_TRUE(raw.closed_by_peer()) << target;
    }
  }
  // Every process keeps working.
  EXPECT_EQ(c.call(&Counter::add, 1).get(kWaitBound), 2);
  EXPECT_EQ(c.info().state, troupe::ActorState::kAlive);
  auto d = rt_.spawn<Counter>({}, 0);
  EXPECT_EQ(d.call(&Counter::add, 3).get(kWaitBound), 3);
}

// A hello naming no role the head knows, from a peer past the token, is a
// protocol violation: the head closes that connection (logging the role)
// rather than answering it, and serves everyone else as before.
TEST_F(ClusterTest, HelloWithAnUnknownRoleClosesOnlyThatConnection) {
  asio::io_context io;
  auto work = asio::make_work_guard(io);
  std::thread loop([&] { io.run(); });
  {
    auto channel = troupe::wire::RpcChannel::connect(
        io, cluster_.address(), cluster_.token(), kWaitBound, [](troupe::wire::Message&&) {},
        [](const std::string&) {});
    troupe::wire::Hello hello;
    hello.role = static_cast<troupe::wire::Role>(7);
    EXPECT_THROW(channel->call<troupe::wire::HelloReply>(troupe::wire::Op::kHello, hello, kWaitBound),
                 troupe::ConnectionError);
    channel->close("test done");
  }
  work.reset();
  io.stop();
  loop.join();
  auto c = rt_.spawn<Counter>({}, 1);
  EXPECT_EQ(c.call(&Counter::add, 1).get(kWaitBound), 2);
  EXPECT_EQ(rt_.nodes().size(), 2u);
}

// Only an actor's own worker may say it is ready: an ActorReady from any
// other peer (a buggy driver's) repointed the actor's new callers at the
// address it named. The head closes that peer's connection instead, and
// the actor stays where it runs.
TEST_F(ClusterTest, AnActorReadyFromAnotherPeerClosesItAndMovesNothing) {
  auto c = rt_.spawn<Counter>({}, 0);
  ASSERT_EQ(c.call(&Counter::add, 1).get(kWaitBound), 1);
  const auto before = c.info();
  asio::io_context io;
  auto work = asio::make_work_guard(io);
  std::thread loop([&] { io.run(); });
  std::atomic<bool> closed{false};
  {
    auto channel = troupe::wire::RpcChannel::connect(
        io, cluster_.address(), cluster_.token(), kWaitBound, [](troupe::wire::Message&&) {},
        [&](const std::string&) { closed = true; });
    troupe::wire::Hello hello;
    hello.role = troupe::wire::Role::kDriver;
    hello.client_id = 0x5eed;
    channel->call<troupe::wire::HelloReply>(troupe::wire::Op::kHello, hello, kWaitBound);
    channel->send(troupe::wire::make_event_value(
        troupe::wire::Op::kActorReady, troupe::wire::ActorReady{before.id, before.incarnation, "127.0.0.1:1", 1, ""}));
    EXPECT_TRUE(troupe::test::eventually([&] { return closed.load(); }));
    channel->close("test done");
  }
  work.reset();
  io.stop();
  loop.join();
  EXPECT_EQ(c.call(&Counter::add, 1).get(kWaitBound), 2);
  const auto after = c.info();
  EXPECT_EQ(after.address, before.address);
  EXPECT_EQ(after.pid, before.pid);
}

// A node's hostname and address go into log lines and the status: one
// with a newline and an escape code forged log lines, a 10 MB one wrote
// 10 MB per mention. The hello is refused, naming what was wrong.
TEST_F(ClusterTest, ANodeWhoseHostnameIsNotAPrintableNameIsRefused) {
  asio::io_context io;
  auto work = asio::make_work_guard(io);
  std::thread loop([&] { io.run(); });
  for (const std::string& bad :
       {std::string("evil\n[04:00:00.000] [head pid 1] [error] FORGED \x1b[31m"), std::string(300, 'h'),
        std::string("host\xc2\x9b"
                    "31m")}) {
    auto channel = troupe::wire::RpcChannel::connect(
        io, cluster_.address(), cluster_.token(), kWaitBound, [](troupe::wire::Message&&) {},
        [](const std::string&) {});
    troupe::wire::Hello hello;
    hello.role = troupe::wire::Role::kNode;
    hello.hostname = bad;
    hello.address = "127.0.0.1";
    hello.resources = {{"CPU", 1}};
    try {
      channel->call<troupe::wire::HelloReply>(troupe::wire::Op::kHello, hello, kWaitBound);
      ADD_FAILURE() << "a node named " << bad.size() << " bytes joined";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("a node's hostname must be printable text of at most 255 bytes; got " +
                                           std::to_string(bad.size()) + " bytes"),
                std::string::npos)
          << e.what();
    }
    channel->close("test done");
  }
  work.reset();
  io.stop();
  loop.join();
  EXPECT_EQ(rt_.nodes().size(), cluster_.node_count());
}

// A job's progress document is parsed for every status and dashboard
// poll, on the head's event loop: one of 15 MB (a buggy writer's) stalled
// the head past the nodes' lease, and every worker was killed. One over
// 1 MiB is listed by name, unread.
TEST_F(ClusterTest, AJobDocumentTooBigToReadIsListedUnread) {
  rt_.kv().put("troupe.jobs/huge", "{\"name\":\"huge\",\"pad\":\"" + std::string(2 << 20, 'x') + "\"}");
  rt_.kv().put("troupe.jobs/fine", R"({"name":"fine","state":"running","step":3})");
  const auto status = nlohmann::json::parse(rt_.status_json());
  std::map<std::string, nlohmann::json> jobs;
  for (const auto& j : status["jobs"]) jobs[j.value("name", "")] = j;
  ASSERT_EQ(jobs.count("huge"), 1u) << status["jobs"].dump();
  EXPECT_EQ(jobs["huge"]["state"], "unknown");
  EXPECT_NE(jobs["huge"]["error"].get<std::string>().find("over the 1048576 a status reads"), std::string::npos);
  EXPECT_EQ(jobs["fine"]["step"], 3);
  rt_.kv().erase("troupe.jobs/huge");
  rt_.kv().erase("troupe.jobs/fine");
}

TEST_F(ClusterTest, NodesAndClusterResourcesMatchTheLocalCluster) {
  auto nodes = rt_.nodes();
  ASSERT_EQ(nodes.size(), cluster_.node_count());
  for (size_t i = 0; i < cluster_.node_count(); ++i) {
    EXPECT_EQ(nodes[i].id, cluster_.node_id(i));
    EXPECT_EQ(nodes[i].pid, cluster_.node_pid(i));
    EXPECT_TRUE(nodes[i].alive);
    EXPECT_EQ(nodes[i].total.at("CPU"), 2);
    EXPECT_EQ(nodes[i].available.at("CPU"), 2);
  }
  EXPECT_EQ(rt_.cluster_resources().at("CPU"), 4);
  auto c = rt_.spawn<Counter>({.resources = {{"CPU", 1.5}}}, 0);
  ASSERT_TRUE(c.wait_ready(kWaitBound));
  EXPECT_DOUBLE_EQ(rt_.available_resources().at("CPU"), 2.5);
  EXPECT_EQ(rt_.cluster_resources().at("CPU"), 4);
  double used_on_its_node = 0;
  for (const auto& n : rt_.nodes())
    if (n.id == c.info().node_id) used_on_its_node = n.used.at("CPU");
  EXPECT_DOUBLE_EQ(used_on_its_node, 1.5);
  // A dead node is listed as dead and leaves the sums.
  size_t other = cluster_.node_id(0) == c.info().node_id ? 1 : 0;
  cluster_.kill_node(other, SIGKILL);
  ASSERT_TRUE(eventually([&] { return rt_.cluster_resources().at("CPU") == 2; }));
  EXPECT_FALSE(rt_.nodes().at(other).alive);
}

TEST_F(ClusterTest, BadResourcesAreConfigErrorsNamingTheKeyAndSchedulingStaysRight) {
  const double kBad[] = {std::nan(""), std::numeric_limits<double>::infinity(), -1.0, 1e300};
  for (double bad : kBad) {
    try {
      rt_.spawn<Counter>({.resources = {{"CPU", bad}}}, 0);
      FAIL() << "expected ConfigError for " << bad;
    } catch (const troupe::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("'CPU'"), std::string::npos) << e.what();
    }
    EXPECT_THROW(rt_.create_placement_group({{{"disk", bad}}}, troupe::PlacementStrategy::kPack), troupe::ConfigError);
    // The head refuses it too, whoever sends it.
    troupe::wire::ActorSpec spec;
    spec.class_name = "Counter";
    spec.resources = {{"custom", bad}};
    try {
      rt_.core()->head().call<troupe::ActorInfo>(troupe::wire::Op::kCreateActor, spec);
      FAIL() << "the head took " << bad;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("'custom'"), std::string::npos) << e.what();
    }
  }
  // Three 2-CPU actors on two 2-CPU nodes: two run on distinct nodes, one waits.
  std::vector<troupe::ActorHandle<Counter>> cs;
  for (int i = 0; i < 3; ++i) cs.push_back(rt_.spawn<Counter>({.resources = {{"CPU", 2}}}, i));
  ASSERT_TRUE(eventually([&] {
    int alive = 0;
    for (auto& c : cs) alive += c.info().state == troupe::ActorState::kAlive;
    return alive == 2;
  }));
  std::set<uint64_t> nodes;
  for (auto& c : cs)
    if (c.info().state == troupe::ActorState::kAlive) nodes.insert(c.info().node_id);
  EXPECT_EQ(nodes.size(), 2u);
  EXPECT_EQ(cs[2].info().state, troupe::ActorState::kPending);
  auto status = nlohmann::json::parse(rt_.status_json());
  for (auto& n : status["nodes"]) EXPECT_EQ(n["used"]["CPU"].get<double>(), 2.0);
}

}  // namespace

namespace {

// An embedded cluster (head and node agent in this process) with no warm
// workers: what the shutdown tests stop.
troupe::Runtime embedded_runtime() {
  troupe::InitOptions o;
  o.node_resources = {{"CPU", 1}};
  o.worker_pool_size = 0;
  o.prefill_own_executable = false;
  return troupe::Runtime::connect(o);
}

// Whether something accepts TCP connections at HOST:PORT.
bool accepts(const std::string& address) {
  auto [host, port] = troupe::wire::parse_address(address);
  asio::io_context io;
  asio::ip::tcp::socket s(io);
  asio::error_code ec;
  s.connect({asio::ip::make_address(host), port}, ec);
  return !ec;
}

}  // namespace

// After shutdown() every method says the Runtime is shut down, instead of
// dereferencing the core it let go (a crash before); shutdown() again and
// the destructor are no-ops.
TEST(RuntimeShutdown, CallsAfterShutdownAreRefusedNamingIt) {
  auto rt = embedded_runtime();
  const std::string address = rt.address();
  ASSERT_TRUE(rt.valid());
  ASSERT_EQ(rt.nodes().size(), 1u);
  rt.shutdown();
  EXPECT_FALSE(rt.valid());
  EXPECT_FALSE(accepts(address)) << "the embedded head still listens at " << address;
  const std::vector<std::function<void()>> calls = {
      [&] { rt.nodes(); },
      [&] { rt.status_json(); },
      [&] { rt.spawn<Counter>({}, 1); },
      [&] { rt.kill_actor(1); },
      [&] { rt.actor_info(1); },
      [&] {
        rt.create_placement_group({{{"CPU", 1}}}, troupe::PlacementStrategy::kPack);
      },
      [&] { rt.put(7); },
      [&] { rt.address(); },
      [&] { rt.core(); },
      [&] { rt.kv().put("k", "v"); },
  };
  for (size_t i = 0; i < calls.size(); ++i) {
    const std::string why = troupe::test::error_of(calls[i]);
    EXPECT_NE(why.find("shut down"), std::string::npos) << "call " << i << ": '" << why << "'";
  }
  rt.shutdown();
  EXPECT_FALSE(rt.valid());
}

// A call to an actor that was never placed (nothing can hold it) fails at
// shutdown naming the shutdown, not a head that is gone.
TEST(RuntimeShutdown, ACallWaitingForPlacementFailsNamingTheShutdown) {
  auto rt = embedded_runtime();
  auto c = rt.spawn<Counter>({.resources = {{"CPU", 1000}}}, 1);
  auto f = c.call(&Counter::add, 1);
  rt.shutdown();
  const std::string why = troupe::test::error_of([&] { f.get(kWaitBound); });
  EXPECT_NE(why.find("this process's Runtime was shut down before the actor was placed"), std::string::npos) << why;
}

// A reference to the KV store taken before shutdown refuses afterwards
// rather than reaching a freed core.
TEST(RuntimeShutdown, TheKvStoreOfAShutDownRuntimeRefuses) {
  auto rt = embedded_runtime();
  troupe::KvStore& kv = rt.kv();
  kv.put("key", "value");
  ASSERT_EQ(kv.get("key"), std::optional<std::string>("value"));
  rt.shutdown();
  EXPECT_NE(troupe::test::error_of([&] { kv.get("key"); }).find("shut down"), std::string::npos);
}

// Several threads shut one Runtime down while another keeps calling it:
// each shutdown() returns only once the embedded head has stopped
// listening, and the caller ends with the shut-down error, not a crash.
TEST(RuntimeShutdown, ConcurrentShutdownsWaitForTheFirstAndCallsRacingThemFailCleanly) {
  for (int round = 0; round < 3; ++round) {
    auto rt = embedded_runtime();
    const std::string address = rt.address();
    std::atomic<int> calls{0};
    std::string caller_error;
    std::thread caller([&] {
      try {
        for (;;) {
          rt.nodes();
          ++calls;
        }
      } catch (const std::exception& e) {
        caller_error = e.what();
      }
    });
    ASSERT_TRUE(eventually([&] { return calls.load() > 0; }));
    std::vector<std::thread> stoppers;
    std::atomic<int> still_listening{0};
    for (int i = 0; i < 3; ++i)
      stoppers.emplace_back([&] {
        rt.shutdown();
        if (accepts(address)) ++still_listening;
      });
    for (auto& t : stoppers) t.join();
    caller.join();
    EXPECT_EQ(still_listening.load(), 0) << "a shutdown() returned while the head still listened (round " << round
                                         << ")";
    EXPECT_FALSE(caller_error.empty());
    EXPECT_FALSE(rt.valid());
  }
}

// Assigning a new Runtime over a live one shuts the old one down first.
TEST(RuntimeShutdown, MoveAssigningOverALiveRuntimeStopsTheOldOne) {
  auto rt = embedded_runtime();
  const std::string old_address = rt.address();
  rt = embedded_runtime();
  EXPECT_FALSE(accepts(old_address));
  EXPECT_TRUE(rt.valid());
  EXPECT_EQ(rt.nodes().size(), 1u);
}
