// Tasks on a LocalCluster: real head, node agent and task-executor worker
// processes on loopback. Results, futures as arguments, typed errors,
// resources respected, retries while the worker is SIGKILLed, and a bounded
// soak that checks the driver's fds and the executors left behind.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <stdexcept>
#include <thread>

#include "tests/support/process.h"
#include "tests/support/temp_dir.h"
#include "tests/support/wait.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/testing/local_cluster.h"

using namespace std::chrono_literals;

namespace {

class TaskQuotaExceeded : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

int square(int x) { return x * x; }
int add(int a, int b) { return a + b; }
std::string shout(std::string s) { return s + "!"; }
int not_a_task(int x) { return x; }

// Throws the error `kind` names.
int fail_with(std::string kind, std::string message) {
  if (kind == "config") throw troupe::ConfigError(message);
  if (kind == "quota") throw TaskQuotaExceeded(message);
  throw std::invalid_argument(message);
}

int own_pid() { return ::getpid(); }

// SIGKILLs its own worker the first time (when `marker` does not exist
// yet); afterwards returns its pid.
int die_once(std::string marker) {
  if (!std::filesystem::exists(marker)) {
    std::ofstream(marker) << "ran";
    ::kill(::getpid(), SIGKILL);
  }
  return ::getpid();
}

// Reads its ref (registering with the owner), then dies as die_once does;
// afterwards returns the sum.
int64_t sum_then_die_once(troupe::ObjectRef<std::vector<int>> ref, std::string marker) {
  const auto v = ref.get(std::chrono::seconds(30));
  die_once(marker);
  int64_t sum = 0;
  for (int x : v) sum += x;
  return sum;
}

// Counts the tasks running at once under KV key `tag` and returns the most
// it saw. With `wait` it waits (bounded) until a second task ran beside it:
// one that found another running bumps `tag/overlaps`, so a short partner
// is not missed between two polls.
int64_t overlap(std::string tag, bool wait) {
  auto& kv = troupe::this_actor::runtime().kv();
  std::string overlaps = tag + "/overlaps";
  int64_t before = kv.add(overlaps, 0);
  int64_t seen = kv.add(tag, 1);
  if (seen >= 2) kv.add(overlaps, 1);
  if (wait) troupe::test::eventually([&] { return kv.add(overlaps, 0) > before; }, 10s);
  seen = std::max(seen, kv.add(tag, 0));
  kv.add(tag, -1);
  return seen;
}

// A vector of n bytes, all `fill`; and the sum of a referenced vector's bytes.
int64_t buffer_size(troupe::Buffer b) { return static_cast<int64_t>(b.size()); }
std::vector<uint8_t> make_bytes(int64_t n, int fill) { return std::vector<uint8_t>(n, static_cast<uint8_t>(fill)); }
int64_t sum_bytes(troupe::ObjectRef<std::vector<uint8_t>> ref) {
  int64_t s = 0;
  for (uint8_t b : ref.get()) s += b;
  return s;
}

// Ray's signal pattern: waiters block on a KV key (a wait that lends the
// CPU) until the setter puts it.
std::string wait_for_key(std::string key) { return troupe::this_actor::runtime().kv().wait(key, 120s); }
std::string set_key(std::string key) {
  troupe::this_actor::runtime().kv().put(key, "set");
  return "done";
}

// Tasks that wait for tasks, each with a CPU of its own: top waits for two
// middles, each middle for a leaf. On two CPUs the leaves run only because
// a task waiting in get() lends its CPU back meanwhile.
int64_t leaf(int64_t x) { return x + 1; }
int64_t middle(int64_t x) {
  return troupe::this_actor::runtime().submit(&leaf, {.resources = {{"CPU", 1}}}, x).get(60s) * 10;
}
int64_t top(int64_t x) {
  auto& rt = troupe::this_actor::runtime();
  auto a = rt.submit(&middle, {.resources = {{"CPU", 1}}}, x);
  auto b = rt.submit(&middle, {.resources = {{"CPU", 1}}}, x + 1);
  return a.get(90s) + b.get(90s);
}

// Writes its pid to `started`, then polls until `release` exists.
int spin_until_file(std::string started, std::string release) {
  std::ofstream(started) << ::getpid();
  while (!std::filesystem::exists(release)) std::this_thread::sleep_for(10ms);
  return ::getpid();
}
// Says it started, then SIGKILLs its own worker once `release` exists (a
// crash while tasks wait behind it on the same executor).
int die_when_released(std::string started, std::string release) {
  std::ofstream(started) << ::getpid();
  while (!std::filesystem::exists(release)) std::this_thread::sleep_for(10ms);
  ::kill(::getpid(), SIGKILL);
  return 0;
}
// Ray's gang of num_cpus=0 tasks: each says it started (a file in `dir`)
// and polls, lending nothing, until `n` have; returns how many it saw.
int64_t gang_member(std::string dir, int64_t i, int64_t n) {
  std::ofstream(dir + "/" + std::to_string(i)) << "up";
  auto count = [&] {
    return std::distance(std::filesystem::directory_iterator(dir), std::filesystem::directory_iterator{});
  };
  troupe::test::eventually([&] { return count() >= n; }, 60s);
  return count();
}
int touch_file(std::string path) {
  std::ofstream(path) << "ran";
  return 1;
}
// Returns `path` once `release` exists (throws after two minutes).
std::string path_when_released(std::string release, std::string path) {
  if (!troupe::test::eventually([&] { return std::filesystem::exists(release); }, 120s))
    throw std::runtime_error(release + " never appeared");
  return path;
}

// Submits `fn` through the TaskSubmitter itself, as Runtime::submit does,
// keeping the task's id for cancel().
template <class R, class... P>
std::pair<uint64_t, troupe::Future<R>> submit_with_id(troupe::Runtime& rt, R (*fn)(P...), std::decay_t<P>... args) {
  auto core = rt.core();
  auto submitter = core->service<troupe::client::TaskSubmitter>();
  const auto& entry = troupe::client::task_for_function(troupe::client::task_function_key(fn));
  auto st = std::make_shared<troupe::core::FutureState<R>>();
  troupe::wire::Encoder e;
  troupe::wire::encode(e, entry.name);
  troupe::wire::encode(e, uint64_t{0});  // no token: the executor cannot skip it
  troupe::wire::encode(e, std::make_tuple(args...));
  uint64_t id = submitter->submit(
      submitter->key_for({}), entry.name, std::move(e), 0,
      [st, c = core.get()](troupe::wire::Message& m) { troupe::client::complete_call<R>(*st, m, c); },
      [st](std::exception_ptr ex) { st->set_error(ex); });
  return {id, troupe::Future<R>(st)};
}

class Adder {
 public:
  int plus(int a, int b) { return a + b; }
};

// Holds a ref another process handed it, reads it, lets it go.
class Keeper {
 public:
  int keep(troupe::ObjectRef<std::vector<uint8_t>> ref) {
    ref_ = std::move(ref);
    return 1;
  }
  int64_t sum() {
    int64_t s = 0;
    for (uint8_t b : ref_->get(30s)) s += b;
    return s;
  }
  int drop() {
    ref_.reset();
    return 1;
  }

 private:
  std::optional<troupe::ObjectRef<std::vector<uint8_t>>> ref_;
};

// Puts 1000 bytes of 5 into its executor's store, hands the ref to
// `keeper`, and then fails.
int put_then_throw(troupe::ActorHandle<Keeper> keeper) {
  auto ref = troupe::this_actor::runtime().put(std::vector<uint8_t>(1000, 5));
  keeper.call(&Keeper::keep, ref).get(30s);
  throw std::runtime_error("thrown after handing out a ref");
}

// The objects its executor's store holds.
int64_t objects_here() { return troupe::this_actor::runtime().object_store_stats().objects; }

// Writes `started`, then polls this_actor::is_cancelled() (for up to two
// minutes) and writes `saw` once it says so; returns its polls.
int64_t poll_until_cancelled(std::string started, std::string saw) {
  std::ofstream(started) << ::getpid();
  int64_t polls = 0;
  bool cancelled = false;
  troupe::test::eventually(
      [&] {
        ++polls;
        return cancelled = troupe::this_actor::is_cancelled();
      },
      120s);
  if (cancelled) std::ofstream(saw) << polls;
  return polls;
}

// An actor whose calls a test cancels: one that runs until cancelled, and
// ones that leave a trace when they run.
class Gate {
 public:
  int64_t hold(std::string started, std::string saw) { return poll_until_cancelled(started, saw); }
  int touch(std::string path) { return touch_file(path); }
  int seven() { return 7; }
};

size_t open_fds() {
  size_t n = 0;
  for ([[maybe_unused]] auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

}  // namespace

TROUPE_ERROR(TaskQuotaExceeded);
TROUPE_TASK(square)
TROUPE_TASK(own_pid)
TROUPE_TASK(add)
TROUPE_TASK(shout)
TROUPE_TASK(fail_with)
TROUPE_TASK(die_once)
TROUPE_TASK(sum_then_die_once)
TROUPE_TASK(overlap)
TROUPE_TASK(buffer_size)
TROUPE_TASK(make_bytes)
TROUPE_TASK(sum_bytes)
TROUPE_TASK(leaf)
TROUPE_TASK(wait_for_key)
TROUPE_TASK(set_key)
TROUPE_TASK(middle)
TROUPE_TASK(top)
TROUPE_TASK(spin_until_file)
TROUPE_TASK(die_when_released)
TROUPE_TASK(touch_file)
TROUPE_TASK(gang_member)
TROUPE_TASK(path_when_released)
TROUPE_TASK(poll_until_cancelled)
TROUPE_TASK(put_then_throw)
TROUPE_TASK(objects_here)
TROUPE_ACTOR(Adder, &Adder::plus)
TROUPE_ACTOR(Keeper, &Keeper::keep, &Keeper::sum, &Keeper::drop)
TROUPE_ACTOR(Gate, &Gate::hold, &Gate::touch, &Gate::seven)

class TaskTest : public ::testing::Test {
 protected:
  static troupe::testing::LocalClusterOptions two_cpus() {
    troupe::testing::LocalClusterOptions o;
    o.nodes = {{{"CPU", 2}}};
    return o;
  }
  troupe::testing::LocalCluster cluster_{two_cpus()};
  troupe::Runtime rt_ = cluster_.connect();
};

TEST_F(TaskTest, ReturnsResults) {
  EXPECT_EQ(rt_.submit(&square, {.resources = {{"CPU", 1}}, .max_retries = 2}, 7).get(30s), 49);
  EXPECT_EQ(rt_.submit(&shout, {}, std::string("hey")).get(30s), "hey!");
  std::vector<troupe::Future<int>> fs;
  for (int i = 0; i < 100; ++i) fs.push_back(rt_.submit(&square, {}, i));
  for (int i = 0; i < 100; ++i) EXPECT_EQ(fs[i].get(30s), i * i);
}

TEST_F(TaskTest, FuturesAreArgumentsOfTasksAndActorCalls) {
  auto a = rt_.submit(&square, {}, 3);
  auto b = rt_.submit(&square, {}, 4);
  auto sum = rt_.submit(&add, {}, a, b);
  auto chained = rt_.submit(&add, {}, sum, 5);
  EXPECT_EQ(chained.get(30s), 30);
  auto adder = rt_.spawn<Adder>({});
  EXPECT_EQ(adder.call(&Adder::plus, rt_.submit(&square, {}, 6), 1).get(30s), 37);
  // A failed argument fails the task that needed it, with the same error.
  auto bad = rt_.submit(&fail_with, {}, std::string("config"), std::string("no"));
  EXPECT_THROW(rt_.submit(&add, {}, bad, 1).get(30s), troupe::ConfigError);
}

TEST_F(TaskTest, RefsAreArgumentsAndSubmitRefKeepsTheResultRemote) {
  // The driver's own object, read by a task in another process.
  auto mine = rt_.put(std::vector<uint8_t>(1000, 3));
  EXPECT_EQ(rt_.submit(&sum_bytes, {}, mine).get(30s), 3000);
  // A result kept in its executor: the driver gets only a reference, and a
  // second task reads it from there.
  auto kept = rt_.submit_ref(&make_bytes, {}, int64_t{1 << 20}, 2).get(30s);
  EXPECT_EQ(rt_.submit(&sum_bytes, {}, kept).get(30s), int64_t{2} << 20);
  EXPECT_EQ(kept.get(30s).size(), size_t{1} << 20);
}

TEST_F(TaskTest, ErrorsArriveTypedAsFromActorCalls) {
  try {
    rt_.submit(&fail_with, {}, std::string("other"), std::string("bad value 42")).get(30s);
    FAIL() << "expected RemoteError";
  } catch (const troupe::RemoteError& e) {
    EXPECT_NE(e.type_name().find("invalid_argument"), std::string::npos) << e.type_name();
    EXPECT_EQ(e.remote_message(), "bad value 42");
  }
  EXPECT_THROW(rt_.submit(&fail_with, {}, std::string("config"), std::string("x")).get(30s), troupe::ConfigError);
  EXPECT_THROW(rt_.submit(&fail_with, {}, std::string("quota"), std::string("x")).get(30s), TaskQuotaExceeded);
  // The executor keeps serving after a task threw.
  EXPECT_EQ(rt_.submit(&square, {}, 2).get(30s), 4);
}

TEST_F(TaskTest, BadSubmissionsFailFast) {
  EXPECT_THROW(rt_.submit(&not_a_task, {}, 1), troupe::ConfigError);
  try {
    rt_.submit(&square, {.resources = {{"CPU", 64}}}, 1);
    FAIL() << "expected ConfigError";
  } catch (const troupe::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("CPU=64"), std::string::npos) << e.what();
  }
  EXPECT_THROW(rt_.submit(&square, {.resources = {{"GPU", 1}}}, 1), troupe::ConfigError);
  EXPECT_THROW(rt_.submit(&square, {.max_retries = -2}, 1), troupe::ConfigError);
}

TEST_F(TaskTest, AtMostAsManyRunAsTheResourcesAllow) {
  // {"CPU": 1} each on a 2-CPU cluster: two at a time, never three.
  std::vector<troupe::Future<int64_t>> fs;
  // The last two need not wait for a partner: one may run alone.
  for (int i = 0; i < 6; ++i)
    fs.push_back(rt_.submit(&overlap, {.resources = {{"CPU", 1}}}, std::string("running"), i < 4));
  int64_t most = 0;
  for (auto& f : fs) most = std::max(most, f.get(60s));
  EXPECT_EQ(most, 2);
  auto tasks = rt_.core()->service<troupe::client::TaskSubmitter>();
  EXPECT_LE(tasks->executor_count(), 2u);
}

// Tasks that ask for zero CPUs are not held to the CPU count (as Ray's
// num_cpus=0): four that each wait for all four to start, on two CPUs,
// all run.
TEST_F(TaskTest, TasksThatAskForZeroCpusAreNotHeldToTheCpuCount) {
  const auto dir = troupe::test::fresh_dir("gang");
  std::vector<troupe::Future<int64_t>> fs;
  for (int64_t i = 0; i < 4; ++i)
    fs.push_back(rt_.submit(&gang_member, {.resources = {{"CPU", 0}}}, dir.string(), i, int64_t{4}));
  for (auto& f : fs) EXPECT_EQ(f.get(120s), 4);
  std::filesystem::remove_all(dir);
}

// Ray's max_calls: a worker runs that many tasks of the key, then goes and
// another takes its place (what a GPU task needs when its library keeps
// memory until its process ends).
TEST_F(TaskTest, MaxCallsGivesEachWorkerThatManyTasks) {
  std::vector<troupe::Future<int>> fs;
  for (int i = 0; i < 6; ++i) fs.push_back(rt_.submit(&own_pid, {.resources = {{"CPU", 1}}, .max_calls = 1}));
  std::map<int, int> per_pid;
  for (auto& f : fs) per_pid[f.get(60s)]++;
  EXPECT_EQ(per_pid.size(), 6u);
  // One at a time: each worker takes two, then the next one comes.
  per_pid.clear();
  for (int i = 0; i < 6; ++i) per_pid[rt_.submit(&own_pid, {.max_calls = 2}).get(60s)]++;
  EXPECT_EQ(per_pid.size(), 3u);
  for (const auto& [pid, n] : per_pid) EXPECT_EQ(n, 2) << pid;
  // Without it, workers stay for the next tasks.
  std::set<int> pids;
  for (int i = 0; i < 6; ++i) pids.insert(rt_.submit(&own_pid, {}).get(60s));
  EXPECT_EQ(pids.size(), 1u);
  EXPECT_THROW(rt_.submit(&own_pid, {.max_calls = -1}), troupe::ConfigError);
  // One whose result stays in its store cannot go without it: it stays,
  // and does not hold its resources from the next task (all the node's
  // memory here, which no lend gives back).
  const double memory = rt_.nodes().at(0).total.at("memory");
  const troupe::TaskOptions whole{.resources = {{"CPU", 1}, {"memory", memory}}, .max_calls = 1};
  auto kept = rt_.submit_ref(&make_bytes, whole, int64_t{1000}, 1).get(60s);
  auto again = rt_.submit_ref(&make_bytes, whole, int64_t{1000}, 2).get(60s);
  EXPECT_EQ(kept.get(30s), std::vector<uint8_t>(1000, 1));
  EXPECT_EQ(again.get(30s), std::vector<uint8_t>(1000, 2));
}

// An executor whose store holds objects is kept when idle (its CPU lent),
// also after a task that put one, handed out its ref and then threw (its
// error answer said nothing of its store, and the executor was released
// with the object). Once its objects are all freed it is released when
// idle, as any other (it used to be kept, with what it held, for good).
TEST_F(TaskTest, AnExecutorIsKeptWhileItsStoreHoldsObjectsAndReleasedOnceItHoldsNone) {
  auto keeper = rt_.spawn<Keeper>({});
  auto tasks = rt_.core()->service<troupe::client::TaskSubmitter>();
  const troupe::TaskOptions one{.resources = {{"CPU", 1}}};
  EXPECT_THROW(rt_.submit(&put_then_throw, one, keeper).get(60s), troupe::RemoteError);
  ASSERT_EQ(tasks->executor_count(), 1u);
  tasks->release_idle();
  // Lent or released, its CPU comes back; released, it is no longer counted.
  ASSERT_TRUE(troupe::test::eventually([&] { return rt_.available_resources().at("CPU") == 2; }));
  EXPECT_EQ(tasks->executor_count(), 1u);
  EXPECT_EQ(keeper.call(&Keeper::sum).get(60s), 5000);

  keeper.call(&Keeper::drop).get(30s);
  // Once its store is empty, an answer says so.
  ASSERT_TRUE(troupe::test::eventually([&] { return rt_.submit(&objects_here, one).get(60s) == 0; }));
  tasks->release_idle();
  EXPECT_TRUE(troupe::test::eventually([&] { return tasks->executor_count() == 0; }));
}

TEST_F(TaskTest, RetriesOnAnotherWorkerWhenItsWorkerIsKilled) {
  auto dir = troupe::test::fresh_dir("task-retry");
  std::string marker = (dir / "retry-once").string();
  int pid = rt_.submit(&die_once, {.max_retries = 1}, marker).get(60s);
  EXPECT_GT(pid, 0);
  EXPECT_TRUE(std::filesystem::exists(marker));
}

// A retry sends the task's bytes again: the refs in them must still name
// live objects after the caller dropped its own and the first worker,
// which had registered for them, died (the object went with that worker's
// registration, and the retry failed with ObjectLost).
TEST_F(TaskTest, ARetryStillFindsTheObjectsItsCallerDropped) {
  auto dir = troupe::test::fresh_dir("task-retry-ref");
  std::string marker = (dir / "retry-once").string();
  auto sum = rt_.submit(&sum_then_die_once, {.max_retries = 1}, rt_.put(std::vector<int>(1000, 2)), marker);
  EXPECT_EQ(sum.get(60s), 2000);
  EXPECT_TRUE(std::filesystem::exists(marker));
}

TEST_F(TaskTest, WithoutRetriesTheWorkersDeathIsTheError) {
  auto dir = troupe::test::fresh_dir("task-no-retry");
  std::string marker = (dir / "no-retry").string();
  try {
    rt_.submit(&die_once, {.max_retries = 0, .name = "die-once-no-retry"}, marker).get(60s);
    FAIL() << "expected WorkerDied";
  } catch (const troupe::WorkerDied& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("die-once-no-retry"), std::string::npos) << what;
    EXPECT_NE(what.find("died"), std::string::npos) << what;
  }
  // The next task gets a fresh worker.
  EXPECT_GT(rt_.submit(&die_once, {}, marker).get(60s), 0);
}

// Idle executors hold their CPUs for idle_release; an actor or placement
// group this process creates, which needs those CPUs, makes them go at once
// (here idle_release is far longer than the test's bounds).
TEST_F(TaskTest, IdleExecutorsMakeWayForAnActorOrGroupThatNeedsTheirResources) {
  auto tasks = rt_.core()->service<troupe::client::TaskSubmitter>();
  tasks->set_options({.idle_release = 10min});
  auto run_two = [&](const std::string& tag) {
    std::vector<troupe::Future<int64_t>> fs;
    for (int i = 0; i < 2; ++i) fs.push_back(rt_.submit(&overlap, {.resources = {{"CPU", 1}}}, tag, true));
    int64_t most = 0;
    for (auto& f : fs) most = std::max(most, f.get(60s));
    ASSERT_EQ(most, 2);
    ASSERT_EQ(tasks->executor_count(), 2u);
    ASSERT_TRUE(troupe::test::eventually([&] { return rt_.available_resources()["CPU"] == 0; }, 20s));
  };
  run_two("before-actor");
  auto adder = rt_.spawn<Adder>({.resources = {{"CPU", 2}}});
  EXPECT_EQ(adder.call(&Adder::plus, 2, 3).get(60s), 5);
  EXPECT_EQ(tasks->executor_count(), 0u);
  rt_.kill(adder);
  ASSERT_TRUE(troupe::test::eventually([&] { return rt_.available_resources()["CPU"] == 2; }, 20s));

  run_two("before-group");
  auto pg = rt_.create_placement_group({{{"CPU", 2}}}, troupe::PlacementStrategy::kPack);
  EXPECT_TRUE(pg.wait(60s)) << pg.info().pending_reason;
  EXPECT_EQ(tasks->executor_count(), 0u);
}

// The same across processes: executors idle in one driver make way for the
// tasks of another, which the head says wait for room (ResourcesWanted).
// Without that the other driver's task would wait the ten minutes.
TEST_F(TaskTest, IdleExecutorsOfOneDriverMakeWayForAnothersTasks) {
  auto tasks = rt_.core()->service<troupe::client::TaskSubmitter>();
  tasks->set_options({.idle_release = 10min});
  std::vector<troupe::Future<int64_t>> fs;
  for (int i = 0; i < 2; ++i) fs.push_back(rt_.submit(&overlap, {.resources = {{"CPU", 1}}}, "held", true));
  int64_t most = 0;
  for (auto& f : fs) most = std::max(most, f.get(60s));
  ASSERT_EQ(most, 2);
  ASSERT_EQ(tasks->executor_count(), 2u);
  ASSERT_TRUE(troupe::test::eventually([&] { return rt_.available_resources()["CPU"] == 0; }, 20s));

  troupe::Runtime other = cluster_.connect();
  EXPECT_EQ(other.submit(&square, {.resources = {{"CPU", 1}}}, 9).get(60s), 81);
  EXPECT_LT(tasks->executor_count(), 2u);
  // Once nothing waits, executors are kept for reuse again.
  EXPECT_EQ(rt_.submit(&square, {.resources = {{"CPU", 1}}}, 3).get(60s), 9);
  EXPECT_TRUE(troupe::test::eventually([&] { return !tasks->resources_wanted(); }, 20s));
  EXPECT_EQ(rt_.submit(&square, {.resources = {{"CPU", 1}}}, 4).get(60s), 16);
  EXPECT_GE(tasks->executor_count(), 1u);
}

TEST_F(TaskTest, TasksWaitingForTasksLendTheirCpuSoNestingCannotDeadlock) {
  // Five executors of one CPU each on two CPUs: without lending, top and
  // one middle hold both and the leaves never start (the middles' gets
  // time out after 60 s and the error says so).
  EXPECT_EQ(rt_.submit(&top, {.resources = {{"CPU", 1}}}, 1).get(180s), 50);
  // Once the idle executors are released the node has its two CPUs again:
  // nothing stays lent or taken twice.
  EXPECT_TRUE(troupe::test::eventually([&] { return rt_.nodes().at(0).available.at("CPU") == 2; }, 60s));
  EXPECT_EQ(rt_.submit(&leaf, {.resources = {{"CPU", 2}}}, 1).get(60s), 2);
}

// Waiters and their setter in one burst on two CPUs: once the key has both
// executors it can lease, the rest are pipelined behind the first two, the
// setter behind a waiter. The waiter's executor hands it back when its task
// blocks, and it runs on the CPU the waiters lend (it used to wait for ever).
TEST_F(TaskTest, TasksQueuedBehindATaskThatWaitsRunElsewhere) {
  std::vector<troupe::Future<std::string>> waiters;
  for (int i = 0; i < 4; ++i)
    waiters.push_back(rt_.submit(&wait_for_key, {.resources = {{"CPU", 1}}}, std::string("burst")));
  auto setter = rt_.submit(&set_key, {.resources = {{"CPU", 1}}}, std::string("burst"));
  EXPECT_EQ(setter.get(150s), "done");
  for (auto& w : waiters) EXPECT_EQ(w.get(150s), "set");
}

TEST_F(TaskTest, SoakKeepsFdsAndExecutorsBounded) {
  auto tasks = rt_.core()->service<troupe::client::TaskSubmitter>();
  tasks->set_options({.idle_release = 200ms});
  for (int i = 0; i < 50; ++i) rt_.submit(&square, {}, i).get(30s);
  size_t fds = open_fds();
  for (int round = 0; round < 20; ++round) {
    std::vector<troupe::Future<int>> fs;
    for (int i = 0; i < 50; ++i) fs.push_back(rt_.submit(&square, {}, i));
    for (int i = 0; i < 50; ++i) ASSERT_EQ(fs[i].get(30s), i * i);
    for (int i = 0; i < 50; ++i) ASSERT_EQ(rt_.submit(&add, {}, i, round).get(30s), i + round);
    ASSERT_LE(tasks->executor_count(), 2u);
  }
  EXPECT_LE(open_fds(), fds + 4) << "fds before: " << fds;
  // Idle executors are released, and their resources with them.
  EXPECT_TRUE(troupe::test::eventually([&] { return tasks->executor_count() == 0; }, 20s));
  EXPECT_TRUE(troupe::test::eventually(
      [&] {
        auto avail = rt_.available_resources();
        return avail["CPU"] == 2;
      },
      20s));
}

// cancel(): one executor, one task at a time on it. A queued task never
// runs; a running one's future fails at once, and without force its
// executor runs it to its end and serves on; with force the executor is
// killed, and the tasks in flight behind it run on another without
// spending a retry (they have none).
TEST_F(TaskTest, CancelledTasksFailAndOnlyAForcedOneCostsItsWorker) {
  using Cancel = troupe::client::TaskSubmitter::Cancel;
  auto tasks = rt_.core()->service<troupe::client::TaskSubmitter>();
  tasks->set_options({.pipeline_depth = 1, .max_executors = 1});
  auto dir = troupe::test::fresh_dir("task-cancel");
  auto path = [&](const char* name) { return (dir / name).string(); };
  auto exists = [&](const char* name) { return [p = path(name)] { return std::filesystem::exists(p); }; };

  auto [running, running_f] = submit_with_id(rt_, &spin_until_file, path("started"), path("release"));
  ASSERT_TRUE(troupe::test::eventually(exists("started"), 60s));
  auto [queued, queued_f] = submit_with_id(rt_, &touch_file, path("never"));
  auto [next, next_f] = submit_with_id(rt_, &square, 5);
  EXPECT_EQ(tasks->cancel(queued, false).outcome, Cancel::kDequeued);
  EXPECT_THROW(queued_f.get(30s), troupe::TaskCancelled);
  auto r = tasks->cancel(running, false);
  EXPECT_EQ(r.outcome, Cancel::kRunning);
  ASSERT_TRUE(r.executor);
  try {
    running_f.get(30s);
    FAIL() << "expected TaskCancelled";
  } catch (const troupe::TaskCancelled& e) {
    EXPECT_NE(std::string(e.what()).find("spin_until_file' was cancelled"), std::string::npos) << e.what();
  }
  // It runs to its end all the same; then the next task runs there.
  std::ofstream(path("release")) << "go";
  EXPECT_EQ(next_f.get(60s), 25);
  EXPECT_EQ(tasks->executor_count(), 1u);
  EXPECT_EQ(tasks->cancel(running, false).outcome, Cancel::kDone);
  EXPECT_EQ(tasks->cancel(next, true).outcome, Cancel::kDone);

  // Forced, with two tasks in flight behind it on the same executor.
  tasks->set_options({.pipeline_depth = 8, .max_executors = 1});
  std::filesystem::remove(path("started"));
  std::filesystem::remove(path("release"));
  auto [stuck, stuck_f] = submit_with_id(rt_, &spin_until_file, path("started"), path("release"));
  ASSERT_TRUE(troupe::test::eventually(exists("started"), 60s));
  auto behind_a = submit_with_id(rt_, &square, 6);
  auto behind_b = submit_with_id(rt_, &square, 7);
  auto behind_c = submit_with_id(rt_, &square, 8);
  int pid = std::stoi([&] {
    std::ifstream in(path("started"));
    return std::string(std::istreambuf_iterator<char>(in), {});
  }());
  // Forcing the cancel of one that waits behind the running task does not
  // kill the executor (it would end the running one).
  EXPECT_EQ(tasks->cancel(behind_c.first, true).outcome, Cancel::kRunning);
  EXPECT_THROW(behind_c.second.get(30s), troupe::TaskCancelled);
  EXPECT_EQ(::kill(pid, 0), 0);
  EXPECT_EQ(tasks->cancel(stuck, true).outcome, Cancel::kKilled);
  EXPECT_THROW(stuck_f.get(30s), troupe::TaskCancelled);
  EXPECT_EQ(behind_a.second.get(60s), 36);
  EXPECT_EQ(behind_b.second.get(60s), 49);
  EXPECT_TRUE(troupe::test::eventually([&] { return ::kill(pid, 0) != 0; }, 30s)) << "executor " << pid;
  EXPECT_FALSE(std::filesystem::exists(path("never")));
}

// An executor kept for the object its task left in its store goes once
// that object is fetched and let go: it held its resources (here `slot`,
// as a GPU) until the driver exited, and an actor that needs them waited
// for ever.
TEST(TaskObjects, AnExecutorKeptForItsObjectsGoesOnceTheyAreGone) {
  troupe::testing::LocalCluster cluster({.nodes = {{{"CPU", 2}, {"slot", 1}}}});
  troupe::Runtime rt = cluster.connect();
  {
    auto ref = rt.submit_ref(&square, {.resources = {{"slot", 1}}}, 6).get(60s);
    EXPECT_EQ(ref.get(60s), 36);
  }  // the only ref: let go
  auto adder = rt.spawn<Adder>({.resources = {{"slot", 1}}});
  EXPECT_EQ(adder.call(&Adder::plus, 2, 3).get(60s), 5);
}

// A task that crashes its worker costs only its own retries: those sent
// behind it to the same executor had not started, and run again elsewhere
// (with no retries, as C++ tasks have by default, they failed as
// "its worker died while running it").
TEST_F(TaskTest, TasksQueuedBehindOneThatCrashesItsWorkerRunElsewhere) {
  auto tasks = rt_.core()->service<troupe::client::TaskSubmitter>();
  tasks->set_options({.pipeline_depth = 8, .max_executors = 1});
  auto dir = troupe::test::fresh_dir("task-crash-behind");
  const std::string started = (dir / "started").string(), release = (dir / "release").string();
  auto crashing = rt_.submit(&die_when_released, {}, started, release);
  ASSERT_TRUE(troupe::test::eventually([&] { return std::filesystem::exists(started); }, 60s));
  std::vector<troupe::Future<int>> behind;
  for (int i = 1; i <= 4; ++i) behind.push_back(rt_.submit(&square, {}, i));
  std::ofstream(release) << "go";
  EXPECT_THROW(crashing.get(60s), troupe::WorkerDied);
  for (int i = 1; i <= 4; ++i) EXPECT_EQ(behind[static_cast<size_t>(i - 1)].get(60s), i * i) << i;
  troupe::core::remove_tree(dir);
}

// A task cancelled while still queued here never went: the pins its
// refs took are given back, as its receiver would have (they kept the
// objects until this process exited).
TEST_F(TaskTest, ARefInATaskCancelledWhileQueuedIsLetGo) {
  using Cancel = troupe::client::TaskSubmitter::Cancel;
  auto tasks = rt_.core()->service<troupe::client::TaskSubmitter>();
  tasks->set_options({.pipeline_depth = 1, .max_executors = 1});
  auto dir = troupe::test::fresh_dir("task-cancel-ref");
  auto path = [&](const char* name) { return (dir / name).string(); };
  const auto base = rt_.object_store_stats().objects;
  auto [running, running_f] = submit_with_id(rt_, &spin_until_file, path("started"), path("release"));
  ASSERT_TRUE(troupe::test::eventually([p = path("started")] { return std::filesystem::exists(p); }, 60s));
  {
    auto ref = rt_.put(std::vector<uint8_t>(1 << 20, 1));
    auto [queued, queued_f] = submit_with_id(rt_, &sum_bytes, ref);
    EXPECT_EQ(tasks->cancel(queued, false).outcome, Cancel::kDequeued);
    EXPECT_THROW(queued_f.get(30s), troupe::TaskCancelled);
    EXPECT_EQ(rt_.object_store_stats().objects, base + 1);
  }
  EXPECT_TRUE(troupe::test::eventually([&] { return rt_.object_store_stats().objects == base; }))
      << rt_.object_store_stats().objects << " objects, " << base << " before";
  std::ofstream(path("release")) << "go";
  EXPECT_GT(running_f.get(60s), 0);
}

// Runtime::cancel, as ray.cancel: a task waiting in its executor's mailbox
// or for its arguments never runs; a running C++ task runs to its end with
// its result dropped, or is killed with its worker when forced; a finished
// one keeps its result; a future that is not a task's is refused.
TEST_F(TaskTest, RuntimeCancelSkipsWaitingTasksAndDropsOrKillsRunningOnes) {
  using troupe::CancelOutcome;
  auto tasks = rt_.core()->service<troupe::client::TaskSubmitter>();
  // One executor, tasks pipelined into its mailbox behind the running one.
  tasks->set_options({.pipeline_depth = 8, .max_executors = 1});
  auto dir = troupe::test::fresh_dir("task-runtime-cancel");
  auto path = [&](const char* name) { return (dir / name).string(); };
  auto exists = [&](const char* name) { return [p = path(name)] { return std::filesystem::exists(p); }; };

  auto running = rt_.submit(&spin_until_file, {}, path("started"), path("release"));
  ASSERT_TRUE(troupe::test::eventually(exists("started"), 60s));
  auto waiting = rt_.submit(&touch_file, {}, path("never"));
  auto next = rt_.submit(&square, {}, 5);
  EXPECT_EQ(rt_.cancel(waiting), CancelOutcome::kNotStarted);
  EXPECT_THROW(waiting.get(30s), troupe::TaskCancelled);
  // Running: the future fails now, while the task still runs.
  EXPECT_EQ(rt_.cancel(running), CancelOutcome::kStarted);
  try {
    running.get(30s);
    FAIL() << "expected TaskCancelled";
  } catch (const troupe::TaskCancelled& e) {
    EXPECT_NE(std::string(e.what()).find("spin_until_file' was cancelled"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(path("release")));
  std::ofstream(path("release")) << "go";
  // The executor skipped the cancelled task and ran the one behind it.
  EXPECT_EQ(next.get(60s), 25);
  EXPECT_FALSE(std::filesystem::exists(path("never")));
  EXPECT_EQ(tasks->executor_count(), 1u);
  EXPECT_EQ(rt_.cancel(next), CancelOutcome::kFinished);
  EXPECT_EQ(next.get(), 25);
  EXPECT_EQ(rt_.cancel(running), CancelOutcome::kFinished);  // cancelled already

  // Waiting for its argument (a task's future): never submitted.
  std::filesystem::remove(path("release"));
  auto argument = rt_.submit(&path_when_released, {}, path("release"), path("never2"));
  auto dependent = rt_.submit(&touch_file, {}, argument);
  EXPECT_EQ(rt_.cancel(dependent), CancelOutcome::kNotStarted);
  EXPECT_THROW(dependent.get(30s), troupe::TaskCancelled);
  std::ofstream(path("release")) << "go";
  EXPECT_EQ(argument.get(60s), path("never2"));
  EXPECT_EQ(rt_.submit(&square, {}, 6).get(60s), 36);
  EXPECT_FALSE(std::filesystem::exists(path("never2")));

  // Forced: its worker is killed; the task behind it runs elsewhere.
  std::filesystem::remove(path("started"));
  std::filesystem::remove(path("release"));
  auto stuck = rt_.submit(&spin_until_file, {}, path("started"), path("release"));
  ASSERT_TRUE(troupe::test::eventually(exists("started"), 60s));
  auto behind = rt_.submit(&square, {}, 7);
  const int pid = std::stoi([&] {
    std::ifstream in(path("started"));
    return std::string(std::istreambuf_iterator<char>(in), {});
  }());
  EXPECT_EQ(rt_.cancel(stuck, true), CancelOutcome::kKilled);
  EXPECT_THROW(stuck.get(30s), troupe::TaskCancelled);
  EXPECT_EQ(behind.get(60s), 49);
  EXPECT_TRUE(troupe::test::eventually([&] { return ::kill(pid, 0) != 0; }, 30s)) << "executor " << pid;

  // Neither a task's nor a call's future.
  EXPECT_THROW(rt_.cancel(troupe::Future<int>(std::make_shared<troupe::core::FutureState<int>>())),
               troupe::ConfigError);
  EXPECT_THROW(rt_.cancel(troupe::Future<int>()), troupe::ConfigError);
}

// Runtime::cancel of actor calls, as ray.cancel of actor tasks: a call
// queued at the actor behind a running one, or waiting for its argument,
// never runs; the running one is not stopped (its actor's state would be
// half-changed) but sees this_actor::is_cancelled() and may end early; a
// call cannot be forced. A running task sees is_cancelled() too.
TEST_F(TaskTest, RuntimeCancelSkipsQueuedActorCallsAndFlagsTheRunningOne) {
  using troupe::CancelOutcome;
  auto dir = troupe::test::fresh_dir("call-cancel");
  auto path = [&](const char* name) { return (dir / name).string(); };
  auto exists = [&](const char* name) { return [p = path(name)] { return std::filesystem::exists(p); }; };

  auto gate = rt_.spawn<Gate>({});
  auto running = gate.call(&Gate::hold, path("started"), path("saw"));
  ASSERT_TRUE(troupe::test::eventually(exists("started"), 60s));
  auto queued = gate.call(&Gate::touch, path("never"));
  auto next = gate.call(&Gate::seven);
  EXPECT_EQ(rt_.cancel(queued), CancelOutcome::kNotStarted);
  try {
    queued.get(30s);
    FAIL() << "expected TaskCancelled";
  } catch (const troupe::TaskCancelled& e) {
    EXPECT_NE(std::string(e.what()).find("call Gate.touch was cancelled"), std::string::npos) << e.what();
  }
  auto expect_config_error = [](auto&& cancel, const std::string& text) {
    try {
      cancel();
      ADD_FAILURE() << "expected ConfigError with " << text;
    } catch (const troupe::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  expect_config_error([&] { rt_.cancel(running, true); },  // no force for a call
                      "Runtime::cancel: force is for tasks; a running actor call (hold)");
  // Only the Runtime that made a call or task cancels it; the other's
  // attempt leaves both as they were.
  troupe::Runtime other = cluster_.connect();
  expect_config_error([&] { other.cancel(running); }, "the call of hold was made through another Runtime");
  auto elsewhere = other.submit(&path_when_released, {}, path("release0"), path("ran0"));
  expect_config_error([&] { rt_.cancel(elsewhere); },
                      "task 'path_when_released' was submitted through another Runtime");
  std::ofstream(path("release0")) << "go";
  EXPECT_EQ(elsewhere.get(60s), path("ran0"));
  EXPECT_EQ(rt_.cancel(running), CancelOutcome::kStarted);
  EXPECT_THROW(running.get(30s), troupe::TaskCancelled);
  // The running call saw the cancel and returned; the actor skipped the
  // cancelled call and ran the one behind it.
  EXPECT_EQ(next.get(60s), 7);
  EXPECT_TRUE(std::filesystem::exists(path("saw")));
  EXPECT_FALSE(std::filesystem::exists(path("never")));
  EXPECT_EQ(rt_.cancel(next), CancelOutcome::kFinished);
  EXPECT_EQ(next.get(), 7);
  EXPECT_EQ(rt_.cancel(running), CancelOutcome::kFinished);  // cancelled already

  // Waiting for its argument (a task's future): never sent.
  auto argument = rt_.submit(&path_when_released, {}, path("release"), path("never2"));
  auto dependent = gate.call(&Gate::touch, argument);
  EXPECT_EQ(rt_.cancel(dependent), CancelOutcome::kNotStarted);
  EXPECT_THROW(dependent.get(30s), troupe::TaskCancelled);
  std::ofstream(path("release")) << "go";
  EXPECT_EQ(argument.get(60s), path("never2"));
  EXPECT_EQ(gate.call(&Gate::seven).get(60s), 7);
  EXPECT_FALSE(std::filesystem::exists(path("never2")));

  // A running task sees the cancel too.
  auto task = rt_.submit(&poll_until_cancelled, {}, path("task-started"), path("task-saw"));
  ASSERT_TRUE(troupe::test::eventually(exists("task-started"), 60s));
  EXPECT_EQ(rt_.cancel(task), CancelOutcome::kStarted);
  EXPECT_THROW(task.get(30s), troupe::TaskCancelled);
  EXPECT_TRUE(troupe::test::eventually(exists("task-saw"), 60s));

  // Outside a task or call there is nothing to ask about.
  EXPECT_THROW(troupe::this_actor::is_cancelled(), troupe::ConfigError);
}

// A get that times out says what the result waits for, as Python's does:
// "future not ready after N ms" alone left a C++ driver guessing whether
// the actor was pending, busy or gone.
TEST_F(TaskTest, AGetThatTimesOutSaysWhatTheResultWaitsFor) {
  auto dir = troupe::test::fresh_dir("get-text");
  auto path = [&](const char* name) { return (dir / name).string(); };
  auto timeout_text = [](auto&& future) {
    try {
      future.get(200ms);
    } catch (const troupe::Timeout& e) {
      return std::string(e.what());
    }
    return std::string("no Timeout");
  };
  // An actor busy with a call: the one behind it has no answer yet.
  auto gate = rt_.spawn<Gate>({.resources = {{"CPU", 2}}});
  auto running = gate.call(&Gate::hold, path("started"), path("saw"));
  ASSERT_TRUE(troupe::test::eventually([&] { return std::filesystem::exists(path("started")); }, 60s));
  auto behind = gate.call(&Gate::seven);
  std::string text = timeout_text(behind);
  EXPECT_NE(text.find("future not ready after 200 ms: Gate.seven on actor "), std::string::npos) << text;
  EXPECT_NE(text.find("has not answered it yet"), std::string::npos) << text;
  // An actor that cannot be placed while the first holds both CPUs.
  auto adder = rt_.spawn<Adder>({.resources = {{"CPU", 2}}});
  text = timeout_text(adder.call(&Adder::plus, 1, 2));
  EXPECT_NE(text.find("Adder.plus on actor "), std::string::npos) << text;
  EXPECT_NE(text.find("the actor is PENDING"), std::string::npos) << text;
  // A task with no executor to run on, and one whose argument is not there.
  text = timeout_text(rt_.submit(&square, {.resources = {{"CPU", 1}}}, 3));
  EXPECT_NE(text.find("task 'square' is queued"), std::string::npos) << text;
  text = timeout_text(rt_.submit(&add, {}, behind, 1));
  EXPECT_NE(text.find("task 'add' waits for its arguments"), std::string::npos) << text;
  EXPECT_EQ(rt_.cancel(running), troupe::CancelOutcome::kStarted);
  EXPECT_EQ(behind.get(60s), 7);
}

// A long task and short ones in one burst on two CPUs: once the key holds
// both executors, short tasks are pipelined behind the long one too. When
// the other executor runs out of work it takes them (HandBackQueued), so
// they all finish while the long task still runs; before, those behind it
// waited for it (here, for ever: it ends only after them).
TEST_F(TaskTest, ShortTasksQueuedBehindALongOneRunOnAnIdleExecutor) {
  auto dir = troupe::test::fresh_dir("task-steal");
  std::string started = (dir / "started").string(), release = (dir / "release").string();
  auto long_one = rt_.submit(&spin_until_file, {.resources = {{"CPU", 1}}}, started, release);
  ASSERT_TRUE(troupe::test::eventually([&] { return std::filesystem::exists(started); }, 60s));
  std::vector<troupe::Future<int>> shorts;
  for (int i = 0; i < 40; ++i) shorts.push_back(rt_.submit(&square, {.resources = {{"CPU", 1}}}, i));
  for (int i = 0; i < 40; ++i) EXPECT_EQ(shorts[i].get(60s), i * i) << "task " << i;
  std::ofstream(release) << "go";
  EXPECT_GT(long_one.get(60s), 0);
}

// Arguments past the frame limit a receiver takes (4 GiB with their
// buffers) are refused by the sender, naming the size: the receiving
// worker closed the connection, which read as its crash, and left it
// holding its CPU. The buffer is never read, so it need not exist.
TEST_F(TaskTest, ArgumentsPastTheFrameLimitAreRefusedNamingTheirSize) {
  const troupe::Buffer huge(nullptr, nullptr, (size_t{4} << 30) + (size_t{64} << 20));
  try {
    rt_.submit(&buffer_size, {.name = "too-big"}, huge).get(30s);
    FAIL() << "a 4.06 GiB argument was sent";
  } catch (const troupe::ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("the arguments of task 'too-big': 4.06 GiB with buffers, more than the 4 GiB"),
              std::string::npos)
        << what;
  }
  EXPECT_EQ(rt_.submit(&buffer_size, {}, troupe::Buffer::from_string("abc")).get(30s), 3);
}

// A result past the message limit names its task (it named the executor:
// "the result of TaskExecutor.run").
TEST_F(TaskTest, AResultPastTheMessageLimitNamesItsTask) {
  try {
    rt_.submit(&make_bytes, {}, int64_t{70} << 20, 1).get(60s);
    FAIL() << "a 70 MiB result was sent inline";
  } catch (const troupe::ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("the result of task 'make_bytes': 70.0 MiB encoded, more than the 64 MiB"), std::string::npos)
        << what;
  }
  EXPECT_EQ(rt_.submit(&square, {}, 4).get(30s), 16);
}

// Shuts down this process's TCP connections to 127.0.0.1:`port`, as a
// network fault cuts them, leaving the process at the other end running.
int cut_connections_to(uint16_t port) {
  int cut = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    const int fd = std::atoi(entry.path().filename().c_str());
    sockaddr_in peer{};
    socklen_t len = sizeof peer;
    if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) != 0 || peer.sin_family != AF_INET) continue;
    if (ntohs(peer.sin_port) == port && ::shutdown(fd, SHUT_RDWR) == 0) ++cut;
  }
  return cut;
}

// The driver's connections to two busy executors are cut while their
// workers live on (a network blip, a frame the worker refused): the
// workers are killed, their CPUs come back, and the tasks' retries run
// on new executors. The cut-off executors held both CPUs for ever, and
// every later task of the driver waited for them.
TEST_F(TaskTest, ExecutorsCutOffFromTheDriverAreKilledAndTheirTasksRunElsewhere) {
  auto dir = troupe::test::fresh_dir("task-cut");
  const std::string release = (dir / "release").string();
  std::vector<troupe::Future<int>> running;
  std::vector<std::string> started;
  for (int i = 0; i < 2; ++i) {
    started.push_back((dir / ("started-" + std::to_string(i))).string());
    running.push_back(
        rt_.submit(&spin_until_file, {.resources = {{"CPU", 1}}, .max_retries = 1}, started.back(), release));
  }
  std::vector<int> first;
  for (const auto& s : started) {
    ASSERT_TRUE(troupe::test::eventually([&] { return std::filesystem::exists(s); }, 60s)) << s;
    std::string pid;
    ASSERT_TRUE(troupe::test::eventually([&] { return (std::ifstream(s) >> pid) && !pid.empty(); }, 60s));
    first.push_back(std::stoi(pid));
  }
  const auto status = nlohmann::json::parse(rt_.status_json());
  int cut = 0;
  for (const auto& a : status["actors"])
    if (std::find(first.begin(), first.end(), a["pid"].get<int>()) != first.end()) {
      const std::string address = a["address"];
      cut += cut_connections_to(static_cast<uint16_t>(std::stoi(address.substr(address.rfind(':') + 1))));
    }
  ASSERT_GE(cut, 2) << status.dump();
  std::ofstream(release) << "go";
  for (auto& f : running) {
    const int pid = f.get(60s);
    EXPECT_EQ(std::find(first.begin(), first.end(), pid), first.end()) << "ran on a cut-off executor";
  }
  for (int pid : first) EXPECT_TRUE(troupe::test::eventually([&] { return troupe::test::process_gone(pid); }));
  EXPECT_EQ(rt_.submit(&square, {.resources = {{"CPU", 2}}}, 9).get(60s), 81);  // both CPUs free again
}

// The only node that could hold a task's resources dies while it runs: the
// retry, and later tasks of those resources, fail naming them once no live
// node could hold them for infeasible_grace, rather than waiting for ever
// (a fresh driver is told at once; this one had checked when the node lived).
TEST(TaskFeasibility, TasksWhoseOnlyNodeDiedFailInsteadOfWaiting) {
  troupe::testing::LocalClusterOptions o;
  o.nodes = {{{"CPU", 2}}, {{"CPU", 1}, {"side", 1}}};
  troupe::testing::LocalCluster cluster(o);
  troupe::Runtime rt = cluster.connect();
  rt.core()->service<troupe::client::TaskSubmitter>()->set_options({.infeasible_grace = 1s});
  auto dir = troupe::test::fresh_dir("task-feasibility");
  const std::string started = (dir / "started").string(), release = (dir / "release").string();
  const troupe::TaskOptions side{.resources = {{"CPU", 1}, {"side", 1}}, .max_retries = 2};
  auto running = rt.submit(&spin_until_file, side, started, release);
  ASSERT_TRUE(troupe::test::eventually([&] { return std::filesystem::exists(started); }, 60s));
  cluster.kill_node(1, SIGKILL);
  try {
    running.get(60s);
    FAIL() << "expected a ConfigError";
  } catch (const troupe::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("{CPU=1, side=1} fit on no live node of the cluster any more"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(rt.submit(&square, side, 3).get(60s), troupe::ConfigError);
  // What the live node holds still runs.
  EXPECT_EQ(rt.submit(&square, {.resources = {{"CPU", 1}}}, 4).get(60s), 16);
}

// A task whose executor is asked for once the head is gone (`troupe stop`
// while a task ran: its retry needs a new executor) fails naming the head,
// not with the raw "connection closed" of the call that asked for one; so
// does a task of a shape this driver has not run before.
TEST(TaskFeasibility, TasksLeasedAfterTheHeadIsGoneSayTheHeadIsGone) {
  troupe::testing::LocalClusterOptions o;
  o.nodes = {{{"CPU", 1}}};
  troupe::testing::LocalCluster cluster(o);
  troupe::Runtime rt = cluster.connect();
  // One task per executor: the next task needs a new one.
  const troupe::TaskOptions once{.resources = {{"CPU", 1}}, .max_calls = 1};
  ASSERT_EQ(rt.submit(&square, once, 3).get(60s), 9);
  cluster.kill_head(SIGKILL);
  ASSERT_TRUE(troupe::test::eventually([&] { return rt.core()->head_lost(); }, 60s));
  for (const auto& options : {once, troupe::TaskOptions{.resources = {{"CPU", 0.5}}}}) {
    try {
      rt.submit(&square, options, 4).get(60s);
      FAIL() << "a task submitted after the head went returned";
    } catch (const troupe::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("the cluster's head is gone"), std::string::npos) << what;
    }
  }
}
