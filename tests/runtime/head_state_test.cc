// Deterministic tests of the head's tables and decisions (HeadState): no
// sockets, no clocks, no threads. Each test plays the messages a server
// would pass in, with made-up times, and checks the state and its outputs.
#include <gtest/gtest.h>
#include <sqlite3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>

#include "tests/support/wait.h"
#include "troupe/runtime/client/actor_keys.h"
#include "troupe/runtime/client/process_stats.h"
#include "troupe/runtime/client/task.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/head/head_state.h"
#include "troupe/runtime/head/head_store.h"
#include "troupe/runtime/head/resource_pool.h"
#include "troupe/runtime/head/scheduler.h"

namespace {

using namespace troupe::head;
using namespace troupe::wire;
using namespace std::chrono_literals;

constexpr PeerId kDriver = 100;
constexpr PeerId kOtherDriver = 101;

class HeadStateTest : public ::testing::Test {
 protected:
  HeadStateTest() : state_(HeadConfig{100, 5, 1000}) {}

  uint64_t add_node(Resources r, PeerId peer) {
    Hello h;
    h.role = Role::kNode;
    h.resources = std::move(r);
    h.hostname = "host" + std::to_string(peer);
    h.pid = static_cast<int32_t>(peer);
    return state_.register_node(peer, h, now_);
  }

  ActorSpec spec(Resources r = {}, int max_restarts = 0, std::string name = "") {
    ActorSpec s;
    s.class_name = "Counter";
    s.ctor_args = "args";
    s.resources = std::move(r);
    s.max_restarts = max_restarts;
    s.name = std::move(name);
    return s;
  }

  // Plays the node agent: every spawned worker says hello and is ready.
  // Returns the outputs it took.
  HeadOutputs start_spawned() {
    auto out = state_.take_outputs();
    for (auto& [node, s] : out.spawns) {
      state_.worker_hello(s.actor_id, s.incarnation);
      state_.actor_ready({s.actor_id, s.incarnation, "127.0.0.1:1", 1000 + static_cast<int32_t>(s.actor_id), ""});
    }
    kills_ = out.kills;
    return out;
  }

  // Plays the node agent reporting the exit of the actor's current worker.
  void exited(uint64_t actor_id, const std::string& how = "killed by signal 9") {
    const auto& i = state_.actor_info(actor_id);
    state_.worker_exited({actor_id, i.incarnation, i.pid, how}, i.node_id);
  }

  ActorState state_of(uint64_t id) { return state_.actor_info(id).state; }
  const NodeInfo node(uint64_t id) {
    for (auto& n : state_.nodes())
      if (n.id == id) return n;
    throw std::runtime_error("no node");
  }

  HeadState state_;
  Time now_{};
  std::vector<std::pair<uint64_t, KillWorker>> kills_;
};

TEST(ResourcePool, TakesAndGivesBackAmountsAndGpuIds) {
  ResourcePool p({{"CPU", 4}, {"GPU", 2}});
  EXPECT_EQ(p.free_gpus(), (std::vector<int32_t>{0, 1}));
  auto g = p.take({{"CPU", 1}, {"GPU", 1}});
  EXPECT_EQ(g.gpu_ids, (std::vector<int32_t>{0}));
  EXPECT_EQ(p.available().at("CPU"), 3);
  EXPECT_EQ(p.used().at("GPU"), 1);
  EXPECT_FALSE(p.fits({{"GPU", 2}}));
  EXPECT_THROW(p.take({{"GPU", 2}}), troupe::ConfigError);
  p.give_back(g);
  EXPECT_EQ(p.available().at("CPU"), 4);
  EXPECT_EQ(p.free_gpus().size(), 2u);
}

// Fractions taken and given back in another order add up to the total
// again, not to it plus rounding dust (a probe's idle node showed
// "CPU 2.22045e-16/2" used).
TEST(ResourcePool, FractionsGivenBackLeaveNoRoundingDust) {
  ResourcePool p({{"CPU", 2}});
  std::vector<Grant> grants;
  for (double v : {0.3, 0.2, 0.1, 0.6, 0.7}) grants.push_back(p.take({{"CPU", v}}));
  for (size_t i : {1, 3, 2, 4, 0}) p.give_back(grants[i]);  // 1.9999999999999998 before
  EXPECT_EQ(p.available().at("CPU"), 2.0);
  EXPECT_EQ(p.used().at("CPU"), 0.0);
}

// Two trainers asking for {GPU: 0.5} share GPU 0 and leave GPU 1 whole; a
// whole GPU then takes GPU 1; giving back a half makes room for a half but
// not a whole GPU; a restarted head retakes a half on the GPU it was on;
// a bundle of half a GPU holds that half of its one GPU.
TEST(ResourcePool, HalvesOfAGpuShareItAndWholeGpusStayWhole) {
  ResourcePool p({{"CPU", 4}, {"GPU", 2}});
  auto a = p.take({{"GPU", 0.5}});
  auto b = p.take({{"GPU", 0.5}});
  EXPECT_EQ(a.gpu_ids, (std::vector<int32_t>{0}));
  EXPECT_EQ(b.gpu_ids, (std::vector<int32_t>{0}));
  EXPECT_EQ(p.free_gpus(), (std::vector<int32_t>{1}));
  auto c = p.take({{"GPU", 1}});
  EXPECT_EQ(c.gpu_ids, (std::vector<int32_t>{1}));
  EXPECT_FALSE(p.fits({{"GPU", 0.5}}));
  p.give_back(a);
  EXPECT_TRUE(p.fits({{"GPU", 0.5}}));
  EXPECT_FALSE(p.fits({{"GPU", 1}}));
  p.retake(a);
  EXPECT_THROW(p.retake(a), troupe::ConfigError);
  p.give_back(a);
  p.give_back(b);
  p.give_back(c);
  EXPECT_EQ(p.free_gpus(), (std::vector<int32_t>{0, 1}));

  ResourcePool two({{"GPU", 2}});
  two.take({{"GPU", 0.6}});
  two.take({{"GPU", 0.6}});
  EXPECT_NEAR(two.available().at("GPU"), 0.8, 1e-12);
  EXPECT_FALSE(two.fits({{"GPU", 0.5}})) << "0.8 is free, but 0.4 on each GPU";

  ResourcePool bundle({{"CPU", 1}, {"GPU", 0.5}}, {1});
  auto whole_bundle = bundle.take({{"GPU", 0.5}, {"CPU", 1}});
  EXPECT_EQ(whole_bundle.gpu_ids, (std::vector<int32_t>{1}));
  EXPECT_FALSE(bundle.fits({{"GPU", 0.1}}));
  // Given back twice, a half stays a half: a pool never holds more of a GPU
  // than it has.
  bundle.give_back(whole_bundle);
  bundle.give_back(whole_bundle);
  EXPECT_EQ(bundle.gpu_free(), (std::vector<double>{0.5}));

  // A node that offers 0.3 of a GPU offers that share of GPU 0 (it had no
  // GPU id at all, and the scheduler then placed what the pool refused).
  ResourcePool partial({{"GPU", 0.3}});
  EXPECT_EQ(partial.gpu_ids(), (std::vector<int32_t>{0}));
  EXPECT_TRUE(partial.fits({{"GPU", 0.2}}));
  EXPECT_FALSE(partial.fits({{"GPU", 0.4}}));
  EXPECT_EQ(partial.take({{"GPU", 0.2}}).gpu_ids, (std::vector<int32_t>{0}));
  EXPECT_TRUE(partial.free_gpus().empty());
  try {
    validate_resources({{"GPU", 1.5}}, "actor options");
    FAIL() << "GPU 1.5 accepted";
  } catch (const troupe::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'GPU' = 1.5"), std::string::npos) << e.what();
  }
}

TEST(ResourcePool, NonFiniteOrNegativeRequestsNeverFitAndAreNeverStored) {
  ResourcePool p({{"CPU", 2}});
  for (double bad : {std::nan(""), std::numeric_limits<double>::infinity(), -1.0}) {
    EXPECT_FALSE(p.fits({{"CPU", bad}})) << bad;
    EXPECT_THROW(p.take({{"CPU", bad}}), troupe::ConfigError) << bad;
    EXPECT_TRUE(std::isfinite(p.available().at("CPU")));
  }
  Resources avail{{"CPU", 2}};
  EXPECT_THROW(subtract(avail, {{"CPU", std::nan("")}}), troupe::ConfigError);
  EXPECT_EQ(avail.at("CPU"), 2);
}

TEST(ResourcePool, ValidationNamesTheKeyAndTheValue) {
  EXPECT_NO_THROW(validate_resources({{"CPU", 2}, {"GPU", 1}, {"custom", 0.5}}, "x"));
  EXPECT_NO_THROW(validate_resources({{"memory", 64.0 * (1ull << 30)}}, "x"));  // bytes: past 1e9
  struct Case {
    Resources r;
    std::string needle;
  };
  std::vector<Case> cases = {{{{"CPU", std::nan("")}}, "'CPU' = nan"},
                             {{{"CPU", std::numeric_limits<double>::infinity()}}, "'CPU' = inf"},
                             {{{"disk", -1}}, "'disk' = -1"},
                             {{{"CPU", 1e300}}, "'CPU' = 1e+300"},
                             {{{"GPU", 5000}}, "'GPU' = 5000"},
                             {{{"", 1}}, "empty name"},
                             {{{"memory", 0.5}}, "'memory' = 0.5 is not a whole number of bytes"},
                             {{{"memory", 1e16}}, "'memory' = 1e+16 exceeds the limit"}};
  for (const auto& c : cases) {
    try {
      validate_resources(c.r, "actor options");
      FAIL() << c.needle;
    } catch (const troupe::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(c.needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("actor options"), std::string::npos) << e.what();
    }
  }
}

TEST_F(HeadStateTest, ActorsGoToTheEmptierNodeAndWaitWhenNothingFits) {
  uint64_t n1 = add_node({{"CPU", 2}}, 1);
  uint64_t n2 = add_node({{"CPU", 2}}, 2);
  auto a = state_.create_actor(kDriver, spec({{"CPU", 2}}));
  auto b = state_.create_actor(kDriver, spec({{"CPU", 2}}));
  auto c = state_.create_actor(kDriver, spec({{"CPU", 2}}));
  start_spawned();
  EXPECT_EQ(state_of(a.id), ActorState::kAlive);
  EXPECT_EQ(state_of(b.id), ActorState::kAlive);
  EXPECT_NE(state_.actor_info(a.id).node_id, state_.actor_info(b.id).node_id);
  EXPECT_EQ(state_of(c.id), ActorState::kPending);
  EXPECT_NE(state_.actor_info(c.id).pending_reason.find("CPU=2"), std::string::npos);
  EXPECT_EQ(node(n1).available.at("CPU"), 0);
  EXPECT_EQ(node(n2).used.at("CPU"), 2);
  // One exits for good: the pending one takes its place.
  state_.kill_actor(a.id, true, "test");
  exited(a.id);
  EXPECT_EQ(state_of(a.id), ActorState::kDead);
  start_spawned();
  EXPECT_EQ(state_of(c.id), ActorState::kAlive);
}

// A worker tells its ActorReady again each time a durable head comes back
// (the first may have died with the last head): a head that heard it
// already changes nothing and tells nobody; one that did not (the actor
// still PENDING with its worker running) takes it.
TEST_F(HeadStateTest, AnActorReadyToldAgainIsTakenOnlyWhereItWasLost) {
  add_node({{"CPU", 3}}, 1);
  auto a = state_.create_actor(kDriver, spec({{"CPU", 1}}));
  start_spawned();
  ASSERT_EQ(state_of(a.id), ActorState::kAlive);
  const auto before = state_.actor_info(a.id);
  state_.take_outputs();
  state_.actor_ready({a.id, before.incarnation, before.address, before.pid, ""});
  EXPECT_EQ(state_.actor_info(a.id).version, before.version);
  EXPECT_TRUE(state_.take_outputs().updates.empty());

  auto b = state_.create_actor(kDriver, spec({{"CPU", 1}}));
  auto out = state_.take_outputs();
  ASSERT_EQ(out.spawns.size(), 1u);
  state_.worker_hello(b.id, 0);  // its ActorReady lost: still PENDING
  ASSERT_EQ(state_of(b.id), ActorState::kPending);
  state_.actor_ready({b.id, 0, "127.0.0.1:2", 4242, ""});
  EXPECT_EQ(state_of(b.id), ActorState::kAlive);
  EXPECT_EQ(state_.actor_info(b.id).pid, 4242);
  EXPECT_EQ(state_.take_outputs().updates.size(), 1u);

  // Killed for good before its ready came: its worker is being stopped,
  // and it is never published as serving meanwhile.
  auto c = state_.create_actor(kDriver, spec({{"CPU", 1}}));
  ASSERT_EQ(state_.take_outputs().spawns.size(), 1u);
  state_.worker_hello(c.id, 0);
  state_.kill_actor(c.id, true, "test");
  state_.actor_ready({c.id, 0, "127.0.0.1:3", 4343, ""});
  EXPECT_NE(state_of(c.id), ActorState::kAlive);
  EXPECT_TRUE(state_.actor_info(c.id).address.empty());
}

// Only the node that runs an actor's worker may say it exited: a report
// from another node's agent (a buggy one) restarted the actor while its
// worker lived on.
TEST_F(HeadStateTest, AWorkerExitReportedByAnotherNodeIsIgnored) {
  uint64_t n = add_node({{"CPU", 1}}, 1);
  uint64_t other = add_node({{"CPU", 0}}, 2);
  auto a = state_.create_actor(kDriver, spec({{"CPU", 1}}));
  start_spawned();
  ASSERT_EQ(state_of(a.id), ActorState::kAlive);
  ASSERT_EQ(state_.actor_info(a.id).node_id, n);
  state_.worker_exited({a.id, 0, state_.actor_info(a.id).pid, "exited (forged)"}, other);
  EXPECT_EQ(state_of(a.id), ActorState::kAlive);
  EXPECT_EQ(state_.actor_info(a.id).restarts, 0);
  exited(a.id);
  EXPECT_NE(state_of(a.id), ActorState::kAlive);
}

TEST_F(HeadStateTest, GpuIdsAreAssignedAndReleased) {
  uint64_t n = add_node({{"CPU", 4}, {"GPU", 2}}, 1);
  auto a = state_.create_actor(kDriver, spec({{"GPU", 1}}, 1));
  auto b = state_.create_actor(kDriver, spec({{"GPU", 1}}));
  auto out = state_.take_outputs();
  ASSERT_EQ(out.spawns.size(), 2u);
  EXPECT_EQ(out.spawns[0].second.gpu_ids, (std::vector<int32_t>{0}));
  EXPECT_EQ(out.spawns[1].second.gpu_ids, (std::vector<int32_t>{1}));
  EXPECT_TRUE(node(n).free_gpu_ids.empty());
  // A restart gives the GPU back and takes one again.
  state_.worker_exited({a.id, 0, 1, "killed by signal 9"}, n);
  EXPECT_EQ(state_.actor_info(a.id).restarts, 1);
  out = state_.take_outputs();
  ASSERT_EQ(out.spawns.size(), 1u);
  EXPECT_EQ(out.spawns[0].second.gpu_ids, (std::vector<int32_t>{0}));
  state_.worker_exited({b.id, 0, 2, "exited with code 0"}, n);
  EXPECT_EQ(state_of(b.id), ActorState::kDead);
  EXPECT_EQ(node(n).free_gpu_ids, (std::vector<int32_t>{1}));
}

TEST_F(HeadStateTest, RestartsCountUpThenTheActorIsDead) {
  add_node({{"CPU", 2}}, 1);
  auto a = state_.create_actor(kDriver, spec({}, 2));
  for (int i = 0; i < 2; ++i) {
    start_spawned();
    exited(a.id);
    EXPECT_EQ(state_of(a.id), ActorState::kRestarting);
    EXPECT_EQ(state_.actor_info(a.id).restarts, i + 1);
    EXPECT_EQ(state_.actor_info(a.id).incarnation, uint32_t(i + 1));
  }
  start_spawned();
  // A stale report (an older incarnation) changes nothing.
  state_.worker_exited({a.id, 0, 1, "late"}, state_.actor_info(a.id).node_id);
  EXPECT_EQ(state_of(a.id), ActorState::kAlive);
  exited(a.id);
  EXPECT_EQ(state_of(a.id), ActorState::kDead);
  EXPECT_NE(state_.actor_info(a.id).death_cause.find("no restarts left: 2 of 2"), std::string::npos);
}

// An actor whose workers keep ending before it is ready (a constructor
// that crashes its process) is restarted at once three times, then after
// 100 ms, 200 ms, ... (it was restarted twenty times a second for ever);
// once ready, its next death restarts it at once again.
TEST_F(HeadStateTest, AnActorThatKeepsDyingBeforeItIsReadyRestartsLessAndLessOften) {
  add_node({{"CPU", 2}}, 1);
  state_.check_heartbeats(now_);
  auto a = state_.create_actor(kDriver, spec({}, -1));
  // Spawns the actor's worker now if it is due, and ends it before ready.
  auto spawned_and_died = [&] {
    auto out = state_.take_outputs();
    if (out.spawns.empty()) return false;
    exited(a.id, "exited with code 1");
    return true;
  };
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(spawned_and_died()) << "early death " << i;
  for (const auto wait : {100ms, 200ms, 400ms}) {
    EXPECT_FALSE(spawned_and_died()) << "restarted before its back-off of " << wait.count() << " ms";
    EXPECT_NE(state_.actor_info(a.id).pending_reason.find("restarting in " + std::to_string(wait.count()) + " ms"),
              std::string::npos)
        << state_.actor_info(a.id).pending_reason;
    state_.check_heartbeats(now_ += wait - 1ms);
    EXPECT_FALSE(spawned_and_died());
    state_.check_heartbeats(now_ += 1ms);
    EXPECT_TRUE(spawned_and_died()) << "not restarted after " << wait.count() << " ms";
  }
  // Ready once: the count starts again, and the next death restarts it at once.
  state_.check_heartbeats(now_ += 800ms);
  start_spawned();
  ASSERT_EQ(state_of(a.id), ActorState::kAlive);
  exited(a.id);
  EXPECT_FALSE(state_.take_outputs().spawns.empty());
}

// A worker's last counters, read from its stats page by its agent after
// the kill, count in place of what it last published (calls served after
// that were lost); a late publication of the dead worker changes nothing.
TEST_F(HeadStateTest, AReapedWorkersLastCountersCountInPlaceOfItsLastPublication) {
  using Totals = std::pair<uint64_t, uint64_t>;
  namespace client = troupe::client;
  add_node({{"CPU", 2}}, 1);
  auto a = state_.create_actor(kDriver, spec({}, 1));
  start_spawned();
  const std::string key0 = std::string(client::kStatsKeyPrefix) + std::to_string(a.id) + ".0";
  state_.kv_put(key0, client::format_stats(10, 100));
  EXPECT_EQ(state_.worker_stats(), (Totals{10, 100}));
  WorkerExited w{a.id, 0, state_.actor_info(a.id).pid, "killed by signal 9"};
  w.has_stats = 1;
  w.calls = 250;
  w.stream_bytes = 100;
  state_.worker_exited(w, state_.actor_info(w.actor_id).node_id);
  EXPECT_EQ(state_of(a.id), ActorState::kRestarting);
  EXPECT_EQ(state_.worker_stats(), (Totals{250, 100}));
  state_.kv_put(key0, client::format_stats(12, 100));  // the killed worker's, late: dropped
  start_spawned();                                     // incarnation 1 serves: 0's numbers are retired
  EXPECT_EQ(state_.worker_stats(), (Totals{250, 100}));
  // A worker without a page: what it published counts, as before.
  state_.kv_put(std::string(client::kStatsKeyPrefix) + std::to_string(a.id) + ".1", client::format_stats(5, 0));
  exited(a.id);
  EXPECT_EQ(state_of(a.id), ActorState::kDead);
  EXPECT_EQ(state_.worker_stats(), (Totals{255, 100}));
}

// A task's executor never restarts (its caller retries the task): its
// death cause is what happened, without "no restarts left", which read as
// the task's end in a death the caller went on to retry.
TEST_F(HeadStateTest, AnExecutorsDeathCauseSaysNothingOfRestarts) {
  add_node({{"CPU", 2}}, 1);
  auto s = spec({});
  s.class_name = troupe::client::kTaskExecutorClass;
  auto a = state_.create_actor(kDriver, s);
  start_spawned();
  exited(a.id);
  EXPECT_EQ(state_of(a.id), ActorState::kDead);
  EXPECT_EQ(state_.actor_info(a.id).death_cause.find("restarts"), std::string::npos)
      << state_.actor_info(a.id).death_cause;
}

// Nor does an actor that asked for no restarts (a TorchTrainer's or a
// TrainJob's worker, whose job recovers): "no restarts left: 0 of 0 used"
// read as the job's end.
TEST_F(HeadStateTest, AnActorWithoutRestartsDiesWithoutTalkOfRestarts) {
  add_node({{"CPU", 2}}, 1);
  auto a = state_.create_actor(kDriver, spec({}, 0));
  start_spawned();
  exited(a.id);
  EXPECT_EQ(state_of(a.id), ActorState::kDead);
  EXPECT_EQ(state_.actor_info(a.id).death_cause, "worker pid " + std::to_string(1000 + a.id) + " killed by signal 9")
      << state_.actor_info(a.id).death_cause;
}

TEST_F(HeadStateTest, NodeDeathRestartsItsActorsElsewhereOrMakesThemDead) {
  uint64_t n1 = add_node({{"CPU", 2}}, 1);
  auto a = state_.create_actor(kDriver, spec({{"CPU", 2}}, 1));
  auto b = state_.create_actor(kDriver, spec({}, 0));
  start_spawned();
  ASSERT_EQ(state_.actor_info(b.id).node_id, n1);
  uint64_t n2 = add_node({{"CPU", 2}}, 2);
  state_.heartbeat(n2, now_ + 400ms);
  state_.check_heartbeats(now_ + 600ms);  // n1 silent for 600 ms > 5 * 100 ms
  auto out = state_.take_outputs();
  ASSERT_EQ(out.dead_nodes.size(), 1u);
  EXPECT_EQ(out.dead_nodes[0].first, n1);
  EXPECT_FALSE(node(n1).alive);
  EXPECT_EQ(state_of(b.id), ActorState::kDead);
  EXPECT_NE(state_.actor_info(b.id).death_cause.find("node"), std::string::npos);
  ASSERT_EQ(out.spawns.size(), 1u);
  EXPECT_EQ(out.spawns[0].first, n2);
  EXPECT_EQ(state_.actor_info(a.id).restarts, 1);
}

// NodeAffinitySchedulingStrategy: hard stays on its node (waiting for room,
// dead with it); soft too while its node is alive and big enough in all
// (as Ray's), else it goes elsewhere; a hard affinity to a node that is
// gone, or too small, is refused at creation.
TEST_F(HeadStateTest, NodeAffinityPinsHardAndPrefersSoft) {
  uint64_t n1 = add_node({{"CPU", 2}}, 1);
  uint64_t n2 = add_node({{"CPU", 4}}, 2);  // emptier: the default choice
  auto pinned = [&](uint64_t node, bool soft, double cpus = 2, int restarts = 0) {
    ActorSpec s = spec({{"CPU", cpus}}, restarts);
    s.node_affinity = node;
    s.affinity_soft = soft;
    return s;
  };
  auto hard = state_.create_actor(kDriver, pinned(n1, false, 2, 1));
  start_spawned();
  EXPECT_EQ(state_.actor_info(hard.id).node_id, n1);
  // Its node is full: another hard one waits, though n2 has room, and so
  // does a soft one; one too big for n1 in all goes to n2.
  auto waits = state_.create_actor(kDriver, pinned(n1, false));
  auto soft = state_.create_actor(kDriver, pinned(n1, true, 1));
  auto spilled = state_.create_actor(kDriver, pinned(n1, true, 3));
  start_spawned();
  EXPECT_EQ(state_of(waits.id), ActorState::kPending);
  EXPECT_NE(state_.actor_info(waits.id).pending_reason.find("CPU=2"), std::string::npos);
  EXPECT_EQ(state_of(soft.id), ActorState::kPending);
  EXPECT_EQ(state_.actor_info(spilled.id).node_id, n2);
  // Refused at creation: a node that does not exist, too little in all,
  // a placement group as well.
  EXPECT_THROW(state_.create_actor(kDriver, pinned(99, false)), troupe::ConfigError);
  EXPECT_THROW(state_.create_actor(kDriver, pinned(n1, false, 3)), troupe::ConfigError);
  ActorSpec both = pinned(n1, false);
  both.placement_group = 1;
  EXPECT_THROW(state_.create_actor(kDriver, both), troupe::ConfigError);
  // Room on n1: the waiting ones take it (the soft one too, not n2).
  state_.kill_actor(waits.id, true, "test");
  state_.kill_actor(hard.id, true, "test");
  exited(hard.id);
  start_spawned();
  EXPECT_EQ(state_.actor_info(soft.id).node_id, n1);
  auto hard2 = state_.create_actor(kDriver, pinned(n1, false, 1, 1));
  start_spawned();
  EXPECT_EQ(state_.actor_info(hard2.id).node_id, n1);
  // n1 dies: its hard actor dies with it (a restart left or not), none
  // restarts on n2.
  state_.heartbeat(n2, now_ + 400ms);
  state_.check_heartbeats(now_ + 600ms);
  auto out = state_.take_outputs();
  EXPECT_FALSE(node(n1).alive);
  EXPECT_EQ(state_of(hard2.id), ActorState::kDead);
  EXPECT_NE(state_.actor_info(hard2.id).death_cause.find("hard affinity"), std::string::npos)
      << state_.actor_info(hard2.id).death_cause;
  for (auto& [node, s] : out.spawns) EXPECT_NE(s.actor_id, hard2.id);
  EXPECT_THROW(state_.create_actor(kDriver, pinned(n1, false)), troupe::ConfigError);
  // A soft affinity to a dead node places as usual.
  auto anywhere = state_.create_actor(kDriver, pinned(n1, true, 1));
  start_spawned();
  EXPECT_EQ(state_.actor_info(anywhere.id).node_id, n2);
}

// The head's own stall (its check running a second late) is not the nodes'
// silence: a node whose heartbeats the stalled head had no chance to read
// stays alive, and silence from then on still kills it after 5 intervals.
TEST_F(HeadStateTest, TheHeadsOwnStallDoesNotCountAgainstTheNodes) {
  uint64_t n = add_node({{"CPU", 2}}, 1);
  state_.check_heartbeats(now_ + 100ms);
  state_.check_heartbeats(now_ + 1200ms);  // 1 s late: the head was stalled
  EXPECT_TRUE(node(n).alive);
  EXPECT_TRUE(state_.take_outputs().dead_nodes.empty());
  for (auto t = 1300ms; t <= 1500ms; t += 100ms) state_.check_heartbeats(now_ + t);
  EXPECT_TRUE(node(n).alive);  // silent for 500 ms of the head's time: not more
  state_.check_heartbeats(now_ + 1600ms);
  EXPECT_FALSE(node(n).alive);
  ASSERT_EQ(state_.take_outputs().dead_nodes.size(), 1u);
}

// As Ray's: a kill (for good) frees the name at once, while the worker is
// still being stopped (get_actor found a killed actor for a moment after
// troupe.kill returned); a restart keeps it; the killed actor's later death
// leaves the name's new holder alone.
TEST_F(HeadStateTest, NamedActorsAreFoundAndTheirNameIsFreedWhenKilled) {
  add_node({{"CPU", 2}}, 1);
  auto a = state_.create_actor(kDriver, spec({}, 1, "svc"));
  EXPECT_EQ(state_.named_actor("svc").id, a.id);
  EXPECT_THROW(state_.create_actor(kDriver, spec({}, 0, "svc")), troupe::ConfigError);
  EXPECT_THROW(state_.named_actor("nope"), troupe::ConfigError);
  start_spawned();
  state_.kill_actor(a.id, false, "test");  // to restart: the name stays
  EXPECT_EQ(state_.named_actor("svc").id, a.id);
  state_.kill_actor(a.id, true, "test");
  EXPECT_THROW(state_.named_actor("svc"), troupe::ConfigError);
  auto b = state_.create_actor(kDriver, spec({}, 0, "svc"));
  EXPECT_EQ(state_.named_actor("svc").id, b.id);
  exited(a.id);
  EXPECT_EQ(state_.actor_info(a.id).state, ActorState::kDead);
  EXPECT_EQ(state_.named_actor("svc").id, b.id);
}

// A group of 0.4, 0.4, 0.6 and 0.6 of a GPU on a node with two GPUs: the
// head places it and takes each bundle's share in the order it planned, so
// every take fits and the two GPUs end fully reserved.
TEST_F(HeadStateTest, PartsOfGpusPackIntoAGroup) {
  uint64_t n = add_node({{"CPU", 4}, {"GPU", 2}}, 1);
  auto g = state_.create_placement_group(
      kDriver, {{{{"GPU", 0.4}}, {{"GPU", 0.4}}, {{"GPU", 0.6}}, {{"GPU", 0.6}}}, PlacementStrategy::kStrictPack, ""});
  ASSERT_EQ(g.state, PlacementGroupState::kCreated) << g.pending_reason;
  EXPECT_NEAR(node(n).available.at("GPU"), 0.0, 1e-9);
  EXPECT_TRUE(node(n).free_gpu_ids.empty());
  state_.remove_placement_group(g.id);
  EXPECT_EQ(node(n).free_gpu_ids, (std::vector<int32_t>{0, 1}));
}

// A removed group's workers are told to die, and run on until their exit
// is reported: until then what each holds stays held on its node (its GPU
// above all), as a killed actor's resources do. It went back free with
// the bundles: a new actor got the GPU a dying worker still used.
TEST_F(HeadStateTest, ARemovedGroupsWorkersKeepTheirGpusUntilTheyExit) {
  uint64_t n = add_node({{"CPU", 4}, {"GPU", 2}}, 1);
  auto g = state_.create_placement_group(kDriver, {{{{"GPU", 1}}, {{"CPU", 1}}}, PlacementStrategy::kPack, ""});
  ASSERT_EQ(g.state, PlacementGroupState::kCreated) << g.pending_reason;
  auto s = spec({{"GPU", 1}});
  s.placement_group = g.id;
  auto a = state_.create_actor(kDriver, s);
  start_spawned();
  ASSERT_EQ(state_of(a.id), ActorState::kAlive);
  const auto held = state_.actor_info(a.id).gpu_ids;
  ASSERT_EQ(held.size(), 1u);

  state_.remove_placement_group(g.id);
  auto both = state_.create_actor(kDriver, spec({{"GPU", 2}}));
  auto out = start_spawned();
  ASSERT_EQ(out.kills.size(), 1u);
  EXPECT_EQ(out.kills[0].second.actor_id, a.id);
  EXPECT_NE(state_of(a.id), ActorState::kDead);  // its worker has not exited
  EXPECT_EQ(state_of(both.id), ActorState::kPending) << "placed on the GPU of a worker still running";
  EXPECT_EQ(node(n).free_gpu_ids, (std::vector<int32_t>{1 - held[0]}));
  EXPECT_EQ(node(n).available.at("GPU"), 1);
  EXPECT_EQ(node(n).available.at("CPU"), 4);  // the CPU bundle nobody used went back at once

  exited(a.id);
  EXPECT_EQ(state_of(a.id), ActorState::kDead);
  start_spawned();
  EXPECT_EQ(state_of(both.id), ActorState::kAlive);
  EXPECT_EQ(state_.actor_info(both.id).gpu_ids, (std::vector<int32_t>{0, 1}));
  state_.kill_actor(both.id, true, "test");
  exited(both.id);
  EXPECT_EQ(node(n).available.at("GPU"), 2);
  EXPECT_EQ(node(n).available.at("CPU"), 4);
  EXPECT_EQ(node(n).free_gpu_ids, (std::vector<int32_t>{0, 1}));
}

// A removed group waits for nothing: status must not keep showing why it
// could not be placed.
TEST_F(HeadStateTest, ARemovedGroupKeepsNoPendingReason) {
  add_node({{"CPU", 1}}, 1);
  auto g = state_.create_placement_group(kDriver, {{{{"CPU", 2}}}, PlacementStrategy::kPack, ""});
  ASSERT_EQ(g.state, PlacementGroupState::kPending);
  EXPECT_FALSE(state_.placement_group(g.id).pending_reason.empty());
  state_.remove_placement_group(g.id);
  EXPECT_EQ(state_.placement_group(g.id).state, PlacementGroupState::kRemoved);
  EXPECT_EQ(state_.placement_group(g.id).pending_reason, "");
}

TEST_F(HeadStateTest, PlacementStrategiesPlaceBundles) {
  uint64_t n1 = add_node({{"CPU", 4}}, 1);
  uint64_t n2 = add_node({{"CPU", 4}}, 2);
  auto pack = state_.create_placement_group(kDriver, {{{{"CPU", 1}}, {{"CPU", 1}}}, PlacementStrategy::kPack, ""});
  EXPECT_EQ(pack.state, PlacementGroupState::kCreated);
  EXPECT_EQ(pack.bundle_nodes[0], pack.bundle_nodes[1]);
  auto spread =
      state_.create_placement_group(kDriver, {{{{"CPU", 1}}, {{"CPU", 1}}}, PlacementStrategy::kStrictSpread, ""});
  EXPECT_NE(spread.bundle_nodes[0], spread.bundle_nodes[1]);
  auto soft = state_.create_placement_group(kDriver, {{{{"CPU", 1}}, {{"CPU", 1}}}, PlacementStrategy::kSpread, ""});
  EXPECT_EQ(soft.state, PlacementGroupState::kCreated);
  EXPECT_NE(soft.bundle_nodes[0], soft.bundle_nodes[1]);
  auto strict_pack =
      state_.create_placement_group(kDriver, {{{{"CPU", 2}}, {{"CPU", 1}}}, PlacementStrategy::kStrictPack, ""});
  EXPECT_EQ(strict_pack.state, PlacementGroupState::kPending);
  EXPECT_EQ(node(n1).available.at("CPU") + node(n2).available.at("CPU"), 2);
  // Actors in a bundle take from the bundle, not from the node.
  auto s = spec({{"CPU", 1}});
  s.placement_group = spread.id;
  s.bundle_index = 1;
  auto a = state_.create_actor(kDriver, s);
  EXPECT_EQ(state_.actor_info(a.id).node_id, spread.bundle_nodes[1]);
  EXPECT_EQ(node(n1).available.at("CPU") + node(n2).available.at("CPU"), 2);
  auto again = state_.create_actor(kDriver, s);
  EXPECT_EQ(state_of(again.id), ActorState::kPending);
  // Removing a group frees its reservation and lets the pending group in.
  state_.remove_placement_group(pack.id);
  state_.remove_placement_group(soft.id);
  EXPECT_EQ(state_.placement_group(strict_pack.id).state, PlacementGroupState::kCreated);
  auto out = state_.take_outputs();
  EXPECT_GE(out.groups_settled.size(), 3u);
}

TEST_F(HeadStateTest, KvPutGetAddErase) {
  state_.kv_put("k", "v");
  EXPECT_EQ(state_.kv_get("k"), "v");
  EXPECT_EQ(state_.kv_add("n", 2), 2);
  EXPECT_EQ(state_.kv_add("n", 3), 5);
  EXPECT_THROW(state_.kv_add("k", 1), troupe::ConfigError);
  state_.kv_erase("k");
  EXPECT_FALSE(state_.kv_get("k").has_value());
  auto out = state_.take_outputs();
  ASSERT_EQ(out.kv_set.size(), 3u);
  EXPECT_EQ(out.kv_set[2].value, "5");
}

// Found by the kv fuzz target: sums past int64 were signed overflow, and a
// value with trailing junk counted as its leading number.
TEST_F(HeadStateTest, KvAddRefusesOverflowAndPartNumbers) {
  state_.kv_put("big", std::to_string(std::numeric_limits<int64_t>::max()));
  EXPECT_THROW(state_.kv_add("big", 1), troupe::ConfigError);
  EXPECT_EQ(state_.kv_add("big", -1), std::numeric_limits<int64_t>::max() - 1);
  state_.kv_put("partly", "12abc");
  EXPECT_THROW(state_.kv_add("partly", 1), troupe::ConfigError);
}

// Issue 12 item 3: an actor whose process is gone is DEAD, in every order.
TEST_F(HeadStateTest, DriverGoneWithAGroupLeavesNoGhosts) {
  add_node({{"CPU", 2}}, 1);
  auto g = state_.create_placement_group(kDriver, {{{{"CPU", 1}}}, PlacementStrategy::kPack, ""});
  auto s = spec({{"CPU", 1}}, 3, "trainer");
  s.placement_group = g.id;
  auto a = state_.create_actor(kDriver, s);
  start_spawned();
  state_.peer_gone(kDriver, "connection reset");
  // The group is removed and the worker is told to die; it is not DEAD yet.
  EXPECT_EQ(state_.placement_group(g.id).state, PlacementGroupState::kRemoved);
  auto out = state_.take_outputs();
  ASSERT_EQ(out.kills.size(), 1u);
  EXPECT_EQ(out.kills[0].second.actor_id, a.id);
  // Its exit report, after the group's resources went back, makes it DEAD.
  exited(a.id);
  EXPECT_EQ(state_of(a.id), ActorState::kDead);
  EXPECT_NE(state_.actor_info(a.id).death_cause.find("driver exited"), std::string::npos);
  EXPECT_EQ(state_.actor_info(a.id).pid, 0);
  EXPECT_THROW(state_.named_actor("trainer"), troupe::ConfigError);
  EXPECT_EQ(node(1).available.at("CPU"), 2);
}

// A durable head's clients reconnect when a connection drops: one that did
// not say goodbye keeps its actors, groups and keys for client_grace, and
// what it owns is its own again on its new connection.
class DroppedClientTest : public HeadStateTest {
 protected:
  DroppedClientTest() {
    HeadConfig c{100, 5, 1000};
    c.client_grace = 2s;
    state_ = HeadState(c);
    state_.bind_client(kDriver, 7);
    node_ = add_node({{"CPU", 2}}, kAgent);
    actor_ = state_.create_actor(kDriver, spec({{"CPU", 1}})).id;
    group_ = state_.create_placement_group(kDriver, {{{{"CPU", 1}}}, PlacementStrategy::kPack, ""}).id;
    start_spawned();
    key_ = troupe::client::client_key_prefix(7) + "object";
    state_.kv_put(key_, "v");
  }

  bool everything_kept() {
    return state_of(actor_) == ActorState::kAlive &&
           state_.placement_group(group_).state == PlacementGroupState::kCreated && state_.kv_get(key_).has_value();
  }

  // The agent of node_ joins again on connection `peer`, listing the
  // actor's worker.
  uint64_t rejoin(PeerId peer) {
    Hello h;
    h.role = Role::kNode;
    h.resources = {{"CPU", 2}};
    h.hostname = "host" + std::to_string(kAgent);
    h.pid = static_cast<int32_t>(kAgent);
    h.resume_node_id = node_;
    const auto& i = state_.actor_info(actor_);
    h.workers = {{actor_, i.incarnation, i.pid}};
    return state_.resume_node(peer, h, now_ + 100ms);
  }

  static constexpr PeerId kAgent = 1;
  uint64_t node_ = 0, actor_ = 0, group_ = 0;
  std::string key_;
};

// Its node agent's connection drops: the node waits (nothing new placed on
// it) for the agent to join again as itself, which keeps what runs there;
// a kill sent meanwhile, lost with the connection, is sent again.
TEST_F(DroppedClientTest, ANodeWhoseAgentCameBackKeepsItsWorkers) {
  state_.peer_gone(kAgent, "connection reset", true, now_);
  EXPECT_TRUE(state_.node_awaited(node_));
  EXPECT_TRUE(everything_kept());
  state_.kill_actor(actor_, true, "killed by request");
  ASSERT_EQ(state_.take_outputs().kills.size(), 1u);  // to a connection that is gone
  EXPECT_EQ(rejoin(50), node_);
  EXPECT_FALSE(state_.node_awaited(node_));
  auto out = state_.take_outputs();
  ASSERT_EQ(out.kills.size(), 1u);
  EXPECT_EQ(out.kills[0].second.actor_id, actor_);
  state_.heartbeat(node_, now_ + 400ms);
  state_.check_heartbeats(now_ + 600ms);
  EXPECT_TRUE(node(node_).alive);
}

// A spawn sent as the agent's connection dropped may never have reached
// it: an actor whose worker had not served and is not listed when the
// agent is back is placed again, without using one of its restarts (it
// has none), and the exit report of a worker it may have had is stale.
TEST_F(DroppedClientTest, ASpawnLostWithTheConnectionIsSentAgainWithoutARestart) {
  const uint64_t late = state_.create_actor(kDriver, spec()).id;
  // One whose worker said hello (took its arguments) and then died, its
  // exit report lost with the connection: a crash, its last restart used.
  const uint64_t started = state_.create_actor(kDriver, spec()).id;
  auto out = state_.take_outputs();
  ASSERT_EQ(out.spawns.size(), 2u);  // on the connection about to drop
  state_.worker_hello(started, 0);
  state_.peer_gone(kAgent, "connection reset", true, now_);
  EXPECT_EQ(rejoin(50), node_);  // listing actor_'s worker only
  EXPECT_EQ(state_of(started), ActorState::kDead);
  EXPECT_NE(state_.actor_info(started).death_cause.find("ended while its node was away"), std::string::npos)
      << state_.actor_info(started).death_cause;
  out = state_.take_outputs();
  ASSERT_EQ(out.spawns.size(), 1u);
  EXPECT_EQ(out.spawns[0].second.actor_id, late);
  EXPECT_EQ(out.spawns[0].second.incarnation, 1u);
  const auto& info = state_.actor_info(late);
  EXPECT_EQ(info.state, ActorState::kPending);
  EXPECT_EQ(info.restarts, 0);
  state_.worker_exited({late, 0, 0, "killed by signal 9"}, state_.actor_info(late).node_id);
  EXPECT_EQ(state_of(late), ActorState::kPending);
  state_.worker_hello(late, 1);
  state_.actor_ready({late, 1, "127.0.0.1:1", 2000, ""});
  EXPECT_EQ(state_of(late), ActorState::kAlive);
  EXPECT_TRUE(everything_kept());
}

TEST_F(DroppedClientTest, ANodeWhoseAgentDidNotComeBackIsDeadAfterTheHeartbeatLimit) {
  state_.peer_gone(kAgent, "connection reset", true, now_);
  state_.check_heartbeats(now_ + 300ms);
  EXPECT_TRUE(node(node_).alive);
  state_.check_heartbeats(now_ + 400ms);
  state_.check_heartbeats(now_ + 500ms);
  state_.check_heartbeats(now_ + 600ms);
  EXPECT_FALSE(node(node_).alive);
  start_spawned();  // takes the kill of its lost worker
  EXPECT_EQ(state_of(actor_), ActorState::kDead);
  EXPECT_NE(state_.actor_info(actor_).death_cause.find("node " + std::to_string(node_) + " died"), std::string::npos)
      << state_.actor_info(actor_).death_cause;
  // Its agent joins as a new node.
  EXPECT_NE(rejoin(50), node_);
}

// A kill that lets the actor restart, sent while the agent was away, is
// sent again too.
TEST_F(DroppedClientTest, ARestartingKillSentWhileTheAgentWasAwayIsSentAgain) {
  state_.peer_gone(kAgent, "connection reset", true, now_);
  state_.kill_actor(actor_, false, "restart it");
  ASSERT_EQ(state_.take_outputs().kills.size(), 1u);  // to a connection that is gone
  EXPECT_EQ(rejoin(50), node_);
  auto out = state_.take_outputs();
  ASSERT_EQ(out.kills.size(), 1u);
  EXPECT_EQ(out.kills[0].second.actor_id, actor_);
}

// The agent's new connection said hello before the head saw the old one
// close: the same agent takes its node over, and the late close is moot.
TEST_F(DroppedClientTest, AnAgentWhoseReconnectRacedTheCloseKeepsItsNode) {
  EXPECT_EQ(rejoin(50), node_);
  state_.peer_gone(kAgent, "connection reset", false, now_);
  EXPECT_TRUE(node(node_).alive);
  EXPECT_FALSE(state_.node_awaited(node_));
  EXPECT_TRUE(everything_kept());
  EXPECT_TRUE(state_.take_outputs().kills.empty());
}

TEST_F(DroppedClientTest, KeepsWhatItOwnsAndGetsItBackOnANewConnection) {
  state_.peer_gone(kDriver, "connection reset", true, now_);
  EXPECT_TRUE(state_.take_outputs().kills.empty());
  EXPECT_TRUE(state_.awaits_client(7));
  EXPECT_TRUE(everything_kept());
  state_.check_restored_owners(now_ + 1s);
  EXPECT_TRUE(everything_kept());
  state_.bind_client(kOtherDriver, 7);  // back, on another connection
  EXPECT_FALSE(state_.awaits_client(7));
  state_.check_restored_owners(now_ + 3s);
  EXPECT_TRUE(everything_kept());
  // The new connection owns it all: its end (a goodbye) takes it along.
  state_.peer_gone(kOtherDriver, "goodbye");
  EXPECT_EQ(state_.placement_group(group_).state, PlacementGroupState::kRemoved);
  EXPECT_FALSE(state_.kv_get(key_).has_value());
  ASSERT_EQ(state_.take_outputs().kills.size(), 1u);
  exited(actor_);
  EXPECT_EQ(state_.actor_info(actor_).death_cause, HeadState::kOwnerExited);
}

TEST_F(DroppedClientTest, NotBackWithinTheGraceLosesWhatItOwnedWithTheReason) {
  state_.peer_gone(kDriver, "connection reset", true, now_);
  state_.check_restored_owners(now_ + 2500ms);
  EXPECT_FALSE(state_.awaits_client(7));
  EXPECT_EQ(state_.placement_group(group_).state, PlacementGroupState::kRemoved);
  EXPECT_FALSE(state_.kv_get(key_).has_value());
  ASSERT_EQ(state_.take_outputs().kills.size(), 1u);
  exited(actor_);
  const auto& cause = state_.actor_info(actor_).death_cause;
  EXPECT_NE(cause.find("connection to the head dropped (connection reset)"), std::string::npos) << cause;
  EXPECT_NE(cause.find("2000 ms"), std::string::npos) << cause;
}

TEST_F(DroppedClientTest, SeenToHaveExitedLosesWhatItOwnedAtOnce) {
  state_.peer_gone(kDriver, "connection reset", true, now_);
  state_.client_exited(7);
  EXPECT_FALSE(state_.awaits_client(7));
  ASSERT_EQ(state_.take_outputs().kills.size(), 1u);
  exited(actor_);
  EXPECT_EQ(state_.actor_info(actor_).death_cause, HeadState::kOwnerExited);
}

TEST_F(DroppedClientTest, AGoodbyeOrAHeadWithoutGraceLosesWhatItOwnedAtOnce) {
  state_.peer_gone(kDriver, "goodbye", false, now_);
  EXPECT_FALSE(state_.awaits_client(7));
  EXPECT_FALSE(state_.kv_get(key_).has_value());
  EXPECT_EQ(state_.take_outputs().kills.size(), 1u);

  HeadState no_grace(HeadConfig{100, 5, 1000});
  no_grace.bind_client(kDriver, 8);
  no_grace.peer_gone(kDriver, "connection reset", true, now_);
  EXPECT_FALSE(no_grace.awaits_client(8));
}

// The process's new connection said hello before the head saw its old one
// close: what the old one owned passes to the new one, nothing is killed.
TEST_F(DroppedClientTest, AReconnectThatRacedTheCloseInheritsWhatItOwns) {
  state_.bind_client(kOtherDriver, 7);
  state_.peer_gone(kDriver, "connection reset", false, now_);
  EXPECT_FALSE(state_.awaits_client(7));
  EXPECT_TRUE(state_.take_outputs().kills.empty());
  EXPECT_TRUE(everything_kept());
  state_.peer_gone(kOtherDriver, "goodbye");
  EXPECT_EQ(state_.take_outputs().kills.size(), 1u);
}

// A worker that owns an actor: when its node reports the worker's exit, the
// head stops waiting for it, whichever comes first, the exit or the close.
// The owned actor's cause names its owner (it said "its driver exited").
TEST_F(DroppedClientTest, AWorkersOwnedActorsGoWithTheWorkerWhateverTheOrder) {
  for (bool exit_first : {false, true}) {
    const uint64_t w = state_.create_actor(kDriver, spec({}, 0)).id;
    start_spawned();
    constexpr PeerId kWorkerPeer = 200;
    const uint64_t client = exit_first ? 21 : 20;
    state_.bind_client(kWorkerPeer, client, w, state_.actor_info(w).incarnation);
    const uint64_t owned = state_.create_actor(kWorkerPeer, spec()).id;
    start_spawned();
    if (exit_first) exited(w);
    state_.peer_gone(kWorkerPeer, "connection reset", true, now_);
    if (!exit_first) {
      EXPECT_TRUE(state_.awaits_client(client));
      exited(w);
    }
    EXPECT_FALSE(state_.awaits_client(client)) << exit_first;
    start_spawned();  // takes the kill
    exited(owned);
    EXPECT_EQ(state_of(owned), ActorState::kDead) << exit_first;
    EXPECT_EQ(state_.actor_info(owned).death_cause, "its owner, actor " + std::to_string(w) + " (Counter), ended")
        << exit_first;
  }
}

// A placement group made inside an actor or a task is its job's, as Ray's:
// the worker's end (a task executor released when idle, an actor that
// restarts) removed it, and killed what ran in it. Its driver's end does.
TEST_F(DroppedClientTest, AGroupMadeInsideAWorkerIsItsJobsAndOutlivesTheWorker) {
  const uint64_t w = state_.create_actor(kDriver, spec({}, 0)).id;
  start_spawned();
  constexpr PeerId kWorkerPeer = 200;
  state_.bind_client(kWorkerPeer, 20, w, state_.actor_info(w).incarnation);
  const auto g = state_.create_placement_group(kWorkerPeer, {{{{"CPU", 1}}}, PlacementStrategy::kPack, ""});
  exited(w);
  state_.peer_gone(kWorkerPeer, "connection reset", true, now_);
  EXPECT_NE(state_.placement_group(g.id).state, PlacementGroupState::kRemoved);  // PENDING: the node is full
  state_.peer_gone(kDriver, "goodbye");
  EXPECT_EQ(state_.placement_group(g.id).state, PlacementGroupState::kRemoved);
}

// Actors that ask for nothing load no node: they all went to the first
// node of equally loaded ones (SPREAD too). The node with fewer actors wins
// a tie of load.
TEST_F(HeadStateTest, ActorsThatAskForNothingAreSpreadOverTheNodes) {
  uint64_t n1 = add_node({{"CPU", 2}}, 1);
  uint64_t n2 = add_node({{"CPU", 2}}, 2);
  std::map<uint64_t, int> on;
  for (int i = 0; i < 6; ++i) ++on[state_.create_actor(kDriver, spec()).id];
  start_spawned();
  std::map<uint64_t, int> per_node;
  for (const auto& [id, one] : on) per_node[state_.actor_info(id).node_id] += one;
  EXPECT_EQ(per_node[n1], 3);
  EXPECT_EQ(per_node[n2], 3);
}

// A detached group (Ray's lifetime="detached") has no owner: its creator's
// exit leaves it, and the actors in it, in place.
TEST_F(HeadStateTest, ADetachedGroupOutlivesItsCreator) {
  add_node({{"CPU", 2}}, 1);
  PlacementGroupSpec kept{{{{"CPU", 1}}}, PlacementStrategy::kPack, "kept", true};
  auto g = state_.create_placement_group(kDriver, kept);
  auto owned = state_.create_placement_group(kDriver, {{{{"CPU", 1}}}, PlacementStrategy::kPack, ""});
  auto s = spec({{"CPU", 1}});
  s.placement_group = g.id;
  s.detached = true;
  auto a = state_.create_actor(kDriver, s);
  start_spawned();
  state_.peer_gone(kDriver, "connection reset");
  EXPECT_EQ(state_.placement_group(g.id).state, PlacementGroupState::kCreated);
  EXPECT_EQ(state_.placement_group(owned.id).state, PlacementGroupState::kRemoved);
  EXPECT_EQ(state_of(a.id), ActorState::kAlive);
}

TEST_F(HeadStateTest, NodeLostAfterGroupRemovalLeavesNoGhosts) {
  uint64_t n = add_node({{"CPU", 2}}, 1);
  auto g = state_.create_placement_group(kDriver, {{{{"CPU", 1}}}, PlacementStrategy::kPack, ""});
  auto s = spec({{"CPU", 1}});
  s.placement_group = g.id;
  auto a = state_.create_actor(kDriver, s);
  start_spawned();
  state_.remove_placement_group(g.id);
  EXPECT_EQ(state_of(a.id), ActorState::kAlive);  // its worker still runs
  // The node agent is SIGKILLed before it reports the exit.
  state_.peer_gone(1, "connection reset");
  EXPECT_FALSE(node(n).alive);
  EXPECT_EQ(state_of(a.id), ActorState::kDead);
  EXPECT_NE(state_.actor_info(a.id).death_cause.find("placement group " + std::to_string(g.id) + " was removed"),
            std::string::npos);
}

TEST_F(HeadStateTest, NodeLostThenDriverGoneLeavesNoGhosts) {
  add_node({{"CPU", 2}}, 1);
  auto a = state_.create_actor(kDriver, spec({}, 5, "x"));
  start_spawned();
  state_.peer_gone(1, "connection reset");
  EXPECT_EQ(state_of(a.id), ActorState::kRestarting);
  state_.peer_gone(kDriver, "connection reset");
  EXPECT_EQ(state_of(a.id), ActorState::kDead);
  EXPECT_THROW(state_.named_actor("x"), troupe::ConfigError);
}

TEST_F(HeadStateTest, ActorsOfOtherDriversSurviveADriver) {
  add_node({{"CPU", 2}}, 1);
  auto mine = state_.create_actor(kDriver, spec());
  auto theirs = state_.create_actor(kOtherDriver, spec());
  start_spawned();
  state_.peer_gone(kDriver, "closed");
  exited(mine.id);
  EXPECT_EQ(state_of(mine.id), ActorState::kDead);
  EXPECT_EQ(state_of(theirs.id), ActorState::kAlive);
}

// Issue 12 item 4: bad resources are refused at every entry.
TEST_F(HeadStateTest, BadResourcesAreRefusedAtEveryEntryAndSchedulingStaysRight) {
  Hello h;
  h.role = Role::kNode;
  h.resources = {{"CPU", std::nan("")}};
  EXPECT_THROW(state_.register_node(1, h, now_), troupe::ConfigError);
  add_node({{"CPU", 2}}, 2);
  for (double bad : {std::nan(""), std::numeric_limits<double>::infinity(), -1.0, 1e300}) {
    EXPECT_THROW(state_.create_actor(kDriver, spec({{"CPU", bad}})), troupe::ConfigError) << bad;
    EXPECT_THROW(state_.create_placement_group(kDriver, {{{{"CPU", bad}}}, PlacementStrategy::kPack, ""}),
                 troupe::ConfigError)
        << bad;
  }
  EXPECT_EQ(state_.actor_count(), 0u);
  auto a = state_.create_actor(kDriver, spec({{"CPU", 2}}));
  auto b = state_.create_actor(kDriver, spec({{"CPU", 2}}));
  EXPECT_NE(state_.actor_info(a.id).node_id, 0u);  // placed
  EXPECT_EQ(state_.actor_info(b.id).node_id, 0u);  // the node is full: no poisoned arithmetic
  EXPECT_NO_THROW(state_.status({}).dump());
}

// Issue 12 item 5: constructor arguments and DEAD actors are bounded.
TEST_F(HeadStateTest, ConstructorArgumentsAreDroppedWhenNoRestartCanNeedThem) {
  add_node({{"CPU", 2}}, 1);
  auto once = state_.create_actor(kDriver, spec({}, 0));
  auto twice = state_.create_actor(kDriver, spec({}, 1));
  EXPECT_TRUE(state_.holds_ctor_args(once.id));
  start_spawned();
  EXPECT_FALSE(state_.holds_ctor_args(once.id));  // its only worker has them
  EXPECT_TRUE(state_.holds_ctor_args(twice.id));
  exited(twice.id);
  auto out = state_.take_outputs();
  ASSERT_EQ(out.spawns.size(), 1u);
  EXPECT_EQ(state_.worker_hello(twice.id, 1).spec.ctor_args, "args");  // the restart got them
  EXPECT_FALSE(state_.holds_ctor_args(twice.id));
}

TEST(HeadStateLimits, DeadActorsAreKeptUpToTheLimitOldestFirst) {
  HeadState state(HeadConfig{100, 5, 3});
  std::vector<uint64_t> ids;
  for (int i = 0; i < 5; ++i) {
    ActorSpec s;
    s.class_name = "C";
    ids.push_back(state.create_actor(kDriver, s).id);  // no node: PENDING
  }
  for (auto id : ids) state.kill_actor(id, true, "test");
  EXPECT_EQ(state.actor_count(), 3u);
  EXPECT_THROW(state.actor_info(ids[0]), troupe::ConfigError);
  EXPECT_THROW(state.actor_info(ids[1]), troupe::ConfigError);
  EXPECT_EQ(state.actor_info(ids[4]).state, ActorState::kDead);
  auto out = state.take_outputs();
  EXPECT_EQ(out.evicted, (std::vector<uint64_t>{ids[0], ids[1]}));
}

// --max-dead-actors 0 (keep none): the actor set_dead had just retired was
// evicted under its caller, which read it freed (a schedule pass), and
// create_actor in a removed group answered "map::at". The newest dead row
// stays; older ones go.
TEST(HeadStateLimits, NoDeadActorsKeptStillAnswersTheOneThatJustDied) {
  HeadState state(HeadConfig{100, 5, 0});
  Hello h;
  h.role = Role::kNode;
  h.resources = {{"CPU", 1}};
  h.hostname = "host1";
  h.pid = 1;
  state.register_node(1, h, Time{});
  auto g = state.create_placement_group(kDriver, {{{{"CPU", 1}}}, PlacementStrategy::kPack, ""});
  state.remove_placement_group(g.id);
  ActorSpec s;
  s.class_name = "C";
  s.placement_group = g.id;
  ActorInfo first, second;
  ASSERT_NO_THROW(first = state.create_actor(kDriver, s));
  EXPECT_EQ(first.state, ActorState::kDead);
  EXPECT_NE(first.death_cause.find("placement group " + std::to_string(g.id) + " was removed"), std::string::npos)
      << first.death_cause;
  ASSERT_NO_THROW(second = state.create_actor(kDriver, s));
  EXPECT_EQ(second.state, ActorState::kDead);
  EXPECT_EQ(state.actor_count(), 1u);  // the first one's row went
  EXPECT_THROW(state.actor_info(first.id), troupe::ConfigError);
}

// Placement-group options the head refuses for every client, naming them:
// a negative bundle index other than -1 (taken for "any"; a task's options
// refused it) and an index without a group (ignored).
TEST_F(HeadStateTest, BundleIndexesThatNameNoBundleAreRefused) {
  add_node({{"CPU", 2}}, 1);
  auto g = state_.create_placement_group(kDriver, {{{{"CPU", 1}}}, PlacementStrategy::kPack, ""});
  auto s = spec({{"CPU", 1}});
  s.placement_group = g.id;
  s.bundle_index = -7;
  try {
    state_.create_actor(kDriver, s);
    ADD_FAILURE() << "bundle index -7 taken";
  } catch (const troupe::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("bundle index -7 is out of range"), std::string::npos) << e.what();
  }
  s.placement_group = 0;
  s.bundle_index = 2;
  try {
    state_.create_actor(kDriver, s);
    ADD_FAILURE() << "bundle index 2 without a group taken";
  } catch (const troupe::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("bundle index 2 names a bundle of no placement group"), std::string::npos)
        << e.what();
  }
}

// An actor that may use any bundle of a full group says so: it read
// "bundle -1 of placement group N has no room", a bundle that does not exist.
TEST_F(HeadStateTest, AnActorWaitingForAnyBundleOfAFullGroupSaysNoBundleHasRoom) {
  add_node({{"CPU", 2}}, 1);
  auto g = state_.create_placement_group(kDriver, {{{{"CPU", 1}}}, PlacementStrategy::kPack, ""});
  auto s = spec({{"CPU", 1}});
  s.placement_group = g.id;
  state_.create_actor(kDriver, s);
  start_spawned();
  auto waiting = state_.create_actor(kDriver, s);
  const std::string why = state_.actor_info(waiting.id).pending_reason;
  EXPECT_NE(why.find("no bundle of placement group " + std::to_string(g.id) + " has room for {CPU=1}"),
            std::string::npos)
      << why;
  EXPECT_EQ(why.find("bundle -1"), std::string::npos) << why;
}

// Names are printed in status, logs and the dashboard: a newline would
// forge a log line, bytes that are not UTF-8 broke every status reader.
TEST(HeadStateNames, NamesWithControlCharactersOrNotUtf8AreRefusedNamingThem) {
  HeadState state(HeadConfig{100, 5, 20});
  auto refused = [&](const std::string& name, const std::string& says) {
    ActorSpec s;
    s.class_name = "C";
    s.name = name;
    try {
      state.create_actor(kDriver, s);
      ADD_FAILURE() << "accepted " << name;
    } catch (const troupe::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused("evil\n[head] [error] FORGED", "'evil?[head] [error] FORGED' has a control character");
  refused("red\x1b[31m", "control character");
  refused(
      "csi\xc2\x9b"
      "31m",
      "'csi?31m' has a control character");
  refused(
      "txt.\xe2\x80\xae"
      "exe",
      "'txt.?exe' has a control character");
  refused("bad\xff", "is not UTF-8 text");
  refused(std::string(2000, 'n'), "2000 bytes long");
  ActorSpec ok;
  ok.class_name = "C";
  ok.name = "caf\xc3\xa9 \xe2\x9c\x93";
  EXPECT_EQ(state.create_actor(kDriver, ok).name, ok.name);
  EXPECT_THROW(troupe::head::validate_resources({{"\xff\xfe", 1.0}}, "--resources"), troupe::ConfigError);
}

// Task executors the pool let go are kept apart and fewer: a burst of
// tasks does not push a crashed actor's row (its cause) out of status.
TEST(HeadStateLimits, RoutineTaskExecutorDeathsDoNotEvictOtherDeadActors) {
  HeadState state(HeadConfig{100, 5, 20});
  ActorSpec user;
  user.class_name = "Important";
  const uint64_t crashed = state.create_actor(kDriver, user).id;
  state.kill_actor(crashed, true, "its constructor raised");
  std::vector<uint64_t> executors;
  for (int i = 0; i < 50; ++i) {
    ActorSpec s;
    s.class_name = troupe::client::kTaskExecutorClass;
    executors.push_back(state.create_actor(kDriver, s).id);
    state.kill_actor(executors.back(), true, "killed by request");
  }
  EXPECT_EQ(state.actor_info(crashed).death_cause, "its constructor raised");
  // 20 / 10 routine rows kept, the newest.
  EXPECT_EQ(state.actor_count(), 3u);
  EXPECT_EQ(state.actor_info(executors.back()).state, ActorState::kDead);
  EXPECT_THROW(state.actor_info(executors[47]), troupe::ConfigError);
}

// A fenced node that joins again is a new node, and every job removes its
// placement groups: both tables keep only the newest few of the dead ones.
TEST(HeadStateLimits, DeadNodesAndRemovedGroupsAreKeptUpToTheirLimits) {
  HeadConfig config{100, 5, 3};
  config.max_dead_nodes = 2;
  config.max_removed_groups = 2;
  HeadState state(config);
  Hello h;
  h.role = Role::kNode;
  h.resources = {{"CPU", 1}};
  std::vector<uint64_t> nodes;
  for (PeerId peer = 1; peer <= 4; ++peer) {
    nodes.push_back(state.register_node(peer, h, Time{}));
    state.node_lost(nodes.back(), "fenced");
  }
  uint64_t live = state.register_node(9, h, Time{});
  auto shown = state.nodes();
  ASSERT_EQ(shown.size(), 3u);
  EXPECT_EQ(shown[0].id, nodes[2]);
  EXPECT_EQ(shown[2].id, live);
  EXPECT_EQ(state.status({})["tables"]["dead_nodes"], 2);

  std::vector<uint64_t> groups;
  for (int i = 0; i < 4; ++i) {
    groups.push_back(state.create_placement_group(kDriver, {{{{"CPU", 1}}}}).id);
    state.remove_placement_group(groups.back());
  }
  EXPECT_THROW(state.placement_group(groups[1]), troupe::ConfigError);
  EXPECT_EQ(state.placement_group(groups[3]).state, PlacementGroupState::kRemoved);
  // A driver that leaves with groups, some of them removed and forgotten.
  for (int i = 0; i < 3; ++i) groups.push_back(state.create_placement_group(kOtherDriver, {{{{"CPU", 1}}}}).id);
  state.peer_gone(kOtherDriver, "gone");
  auto tables = state.status({})["tables"];
  EXPECT_EQ(tables["placement_groups"], 2);
  EXPECT_EQ(tables["removed_groups"], 2);
  // A new actor in a forgotten group is refused, naming it.
  ActorSpec s;
  s.class_name = "C";
  s.placement_group = groups[4];
  EXPECT_THROW(state.create_actor(kDriver, s), troupe::ConfigError);
}

TEST_F(HeadStateTest, StatusFiltersByStateAndLimit) {
  add_node({{"CPU", 1}}, 1);
  std::vector<uint64_t> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(state_.create_actor(kDriver, spec({{"CPU", 1}})).id);
  start_spawned();
  auto all = state_.status({});
  EXPECT_EQ(all["actors"].size(), 4u);
  EXPECT_EQ(all["actors_total"], 4);
  auto pending = state_.status({"PENDING", 0});
  EXPECT_EQ(pending["actors"].size(), 3u);
  auto newest = state_.status({"PENDING", 2});
  ASSERT_EQ(newest["actors"].size(), 2u);
  EXPECT_EQ(newest["actors"][0]["id"], ids[2]);
  EXPECT_EQ(newest["actors"][1]["id"], ids[3]);
  EXPECT_THROW(state_.status({"SLEEPY", 0}), troupe::ConfigError);
}

// log_to_driver asks for its own work only: the actors a driver created,
// and those its actors' workers created in turn.
TEST_F(HeadStateTest, StatusFiltersByTheDriverWhoseWorkAnActorIs) {
  add_node({{"CPU", 8}}, 1);
  state_.bind_client(kDriver, 7);
  state_.bind_client(kOtherDriver, 8);
  const uint64_t mine = state_.create_actor(kDriver, spec()).id;
  const uint64_t theirs = state_.create_actor(kOtherDriver, spec()).id;
  start_spawned();
  constexpr PeerId kWorkerPeer = 200;
  state_.bind_client(kWorkerPeer, 30, mine, state_.actor_info(mine).incarnation);
  const uint64_t grandchild = state_.create_actor(kWorkerPeer, spec()).id;
  start_spawned();
  auto ids = [](const nlohmann::json& status) {
    std::vector<uint64_t> v;
    for (const auto& a : status["actors"]) v.push_back(a["id"].get<uint64_t>());
    return v;
  };
  EXPECT_EQ(ids(state_.status({"", 0, 7})), (std::vector<uint64_t>{mine, grandchild}));
  EXPECT_EQ(ids(state_.status({"", 0, 8})), (std::vector<uint64_t>{theirs}));
  EXPECT_EQ(ids(state_.status({"ALIVE", 1, 7})), (std::vector<uint64_t>{grandchild}));
  EXPECT_EQ(state_.status({})["actors"].size(), 3u);
  EXPECT_TRUE(state_.status({"", 0, 99})["actors"].empty());
}

TEST_F(HeadStateTest, NodesReportTotalsUsageAndGpus) {
  uint64_t n = add_node({{"CPU", 4}, {"GPU", 2}}, 1);
  state_.create_actor(kDriver, spec({{"CPU", 1}, {"GPU", 1}}));
  auto info = node(n);
  EXPECT_EQ(info.hostname, "host1");
  EXPECT_TRUE(info.alive);
  EXPECT_EQ(info.total.at("CPU"), 4);
  EXPECT_EQ(info.used.at("CPU"), 1);
  EXPECT_EQ(info.available.at("GPU"), 1);
  EXPECT_EQ(info.gpu_ids, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(info.free_gpu_ids, (std::vector<int32_t>{1}));
}

}  // namespace

// ---- write-through and restore ------------------------------------------------

namespace {

// Applies rows to a map as a store would.
void apply_rows(std::map<std::string, std::string>& store, const std::vector<HeadState::Row>& rows) {
  for (const auto& [k, v] : rows)
    if (v)
      store[k] = *v;
    else
      store.erase(k);
}

// A restarted head places what waits oldest first, as before: its rows
// come in key order ("g/10" before "g/9"), and group 10 took the room
// group 9 had waited for longer.
TEST_F(HeadStateTest, ARestartedHeadPlacesWaitingGroupsOldestFirst) {
  state_.enable_write_through();
  add_node({{"CPU", 1}}, 1);
  const PlacementGroupSpec one{{{{"CPU", 1}}}, PlacementStrategy::kPack, "", true};
  for (int i = 0; i < 8; ++i) state_.remove_placement_group(state_.create_placement_group(kDriver, one).id);
  auto hold = state_.create_actor(kDriver, spec({{"CPU", 1}}));
  start_spawned();
  ASSERT_EQ(state_of(hold.id), ActorState::kAlive);
  const auto older = state_.create_placement_group(kDriver, one);
  const auto newer = state_.create_placement_group(kDriver, one);
  ASSERT_EQ(older.id, 9u);
  ASSERT_EQ(newer.id, 10u);
  std::map<std::string, std::string> store;
  apply_rows(store, state_.take_rows());
  HeadState again(HeadConfig{100, 5, 1000});
  again.restore(store, now_, 2s);
  Hello h;
  h.role = Role::kNode;
  h.resources = {{"CPU", 1}};
  h.hostname = "host2";
  h.pid = 2;
  again.register_node(2, h, now_);
  EXPECT_EQ(again.placement_group(older.id).state, PlacementGroupState::kCreated);
  EXPECT_EQ(again.placement_group(newer.id).state, PlacementGroupState::kPending);
}

// The rows a durable head writes, against the format number that names
// them (HeadStore::check_format refuses a file of another format). When
// this fails, a row's record changed: bump HeadState::kRowFormat and put
// the new pair here, so that a head never misreads an older file.
TEST_F(HeadStateTest, RowFormatIsKnown) {
  state_.enable_write_through();
  add_node({{"CPU", 4}, {"GPU", 1}}, 1);
  state_.bind_client(kDriver, 7);
  PlacementGroupSpec g;
  g.bundles = {{{"CPU", 1}}};
  g.name = "pg";
  state_.create_placement_group(kDriver, g);
  state_.create_actor(kDriver, spec({{"CPU", 1}, {"GPU", 1}}, 2, "named"));
  start_spawned();
  state_.kv_put("key", "value");
  std::map<std::string, std::string> store;
  apply_rows(store, state_.take_rows());
  uint64_t hash = 1469598103934665603ull;  // FNV-1a over every key and value
  for (const auto& [k, v] : store)
    for (const std::string* part : {&k, &v}) {
      for (unsigned char c : *part + '\0') hash = (hash ^ c) * 1099511628211ull;
    }
  EXPECT_EQ(std::make_pair(HeadState::kRowFormat, hash), std::make_pair(8, uint64_t{561531740420673195ull}))
      << "the head's rows changed: bump HeadState::kRowFormat";
}

// A node with one of a group's bundles dies: that bundle alone is placed
// again. The others keep their node, their reservation and their actors,
// whose shares stay taken (a newcomer does not get them twice) and come
// back to their bundle when they end; a restarted head keeps it so too.
TEST_F(HeadStateTest, ANodeLossPlacesAgainOnlyTheBundlesLostWithIt) {
  state_.enable_write_through();
  const uint64_t n1 = add_node({{"CPU", 2}, {"GPU", 1}}, 1);
  const uint64_t n2 = add_node({{"CPU", 2}, {"GPU", 1}}, 2);
  auto g = state_.create_placement_group(
      kDriver, {{{{"CPU", 1}, {"GPU", 1}}, {{"CPU", 1}, {"GPU", 1}}}, PlacementStrategy::kStrictSpread, ""});
  ASSERT_EQ(g.state, PlacementGroupState::kCreated) << g.pending_reason;
  const size_t on1 = g.bundle_nodes[0] == n1 ? 0 : 1;
  const size_t on2 = 1 - on1;
  auto s = spec({{"GPU", 1}});
  s.placement_group = g.id;
  s.bundle_index = static_cast<int32_t>(on1);
  auto kept = state_.create_actor(kDriver, s);
  s.bundle_index = static_cast<int32_t>(on2);
  s.max_restarts = 1;
  auto moved = state_.create_actor(kDriver, s);
  start_spawned();
  const auto kept_gpus = state_.actor_info(kept.id).gpu_ids;
  ASSERT_EQ(kept_gpus.size(), 1u);

  state_.heartbeat(n1, now_ + 400ms);
  state_.check_heartbeats(now_ + 600ms);  // n2 silent for 600 ms > 5 * 100 ms
  ASSERT_FALSE(node(n2).alive);
  auto pg = state_.placement_group(g.id);
  EXPECT_EQ(pg.state, PlacementGroupState::kPending);
  EXPECT_EQ(pg.bundle_nodes[on1], n1);
  EXPECT_EQ(pg.bundle_nodes[on2], 0u);
  EXPECT_EQ(state_of(kept.id), ActorState::kAlive);
  EXPECT_EQ(state_.actor_info(kept.id).gpu_ids, kept_gpus);
  EXPECT_TRUE(node(n1).free_gpu_ids.empty());  // still the bundle's
  EXPECT_EQ(node(n1).available.at("CPU"), 1);
  // A kept bundle takes actors meanwhile; the lost one waits.
  auto cpu = spec({{"CPU", 1}});
  cpu.placement_group = g.id;
  cpu.bundle_index = static_cast<int32_t>(on1);
  auto meanwhile = state_.create_actor(kDriver, cpu);
  cpu.bundle_index = static_cast<int32_t>(on2);
  auto waits = state_.create_actor(kDriver, cpu);
  start_spawned();
  EXPECT_EQ(state_of(meanwhile.id), ActorState::kAlive);
  EXPECT_EQ(state_.actor_info(meanwhile.id).node_id, n1);
  EXPECT_EQ(state_of(waits.id), ActorState::kPending);
  EXPECT_NE(state_.actor_info(waits.id).pending_reason.find("waiting for placement group"), std::string::npos);
  // One more for the kept bundle, full now, is told so (a new node would
  // not help it), not that the group is being placed.
  cpu.bundle_index = static_cast<int32_t>(on1);
  auto full = state_.create_actor(kDriver, cpu);
  EXPECT_EQ(state_of(full.id), ActorState::kPending);
  EXPECT_NE(state_.actor_info(full.id).pending_reason.find("has no room"), std::string::npos)
      << state_.actor_info(full.id).pending_reason;

  // Restarted now, a head holds the kept bundle as this one does.
  std::map<std::string, std::string> store;
  apply_rows(store, state_.take_rows());
  HeadState again(HeadConfig{100, 5, 1000});
  again.restore(store, now_, 2s);
  EXPECT_EQ(again.placement_group(g.id).bundle_nodes[on1], n1);
  for (const auto& n : again.nodes())
    if (n.id == n1) {
      EXPECT_EQ(n.available.at("CPU"), 1);
    }

  // A new node takes the lost bundle; the group is whole again and the
  // actor lost with n2 starts there.
  const uint64_t n3 = add_node({{"CPU", 2}, {"GPU", 1}}, 3);
  pg = state_.placement_group(g.id);
  ASSERT_EQ(pg.state, PlacementGroupState::kCreated) << pg.pending_reason;
  EXPECT_EQ(pg.bundle_nodes[on1], n1);
  EXPECT_EQ(pg.bundle_nodes[on2], n3);
  start_spawned();
  EXPECT_EQ(state_.actor_info(moved.id).node_id, n3);
  EXPECT_EQ(state_of(moved.id), ActorState::kAlive);
  EXPECT_EQ(state_.actor_info(waits.id).node_id, n3);
  EXPECT_EQ(state_of(waits.id), ActorState::kAlive);
  // The kept bundle is full: a newcomer for it waits...
  s.bundle_index = static_cast<int32_t>(on1);
  s.max_restarts = 0;
  auto newcomer = state_.create_actor(kDriver, s);
  EXPECT_EQ(state_of(newcomer.id), ActorState::kPending);
  // ...until the actor holding it ends and gives its share back.
  exited(kept.id);
  EXPECT_EQ(state_of(kept.id), ActorState::kDead);
  start_spawned();
  EXPECT_EQ(state_of(newcomer.id), ActorState::kAlive);
  EXPECT_EQ(state_.actor_info(newcomer.id).gpu_ids, kept_gpus);
  // Removed, the group gives every node all it had.
  state_.remove_placement_group(g.id);
  for (auto id : {newcomer.id, moved.id, meanwhile.id, waits.id}) exited(id);
  EXPECT_EQ(node(n1).available.at("CPU"), 2);
  EXPECT_EQ(node(n1).free_gpu_ids.size(), 1u);
  EXPECT_EQ(node(n3).available.at("CPU"), 2);
  EXPECT_EQ(node(n3).free_gpu_ids.size(), 1u);
}

// troupe_actor_restarts_total is a counter: the restarts of a DEAD actor
// the table no longer keeps still count, after a head restart too.
TEST_F(HeadStateTest, RestartsOfEvictedActorsStillCount) {
  HeadState state(HeadConfig{100, 5, 1});  // keeps one DEAD actor
  state.enable_write_through();
  Hello h;
  h.role = Role::kNode;
  h.resources = {{"CPU", 4}};
  state.register_node(1, h, now_);
  auto run_and_die = [&](int restarts) {
    const uint64_t id = state.create_actor(kDriver, spec({}, restarts)).id;
    for (int i = 0; i <= restarts; ++i) {
      for (auto& [node, sp] : state.take_outputs().spawns) {
        state.worker_hello(sp.actor_id, sp.incarnation);
        state.actor_ready({sp.actor_id, sp.incarnation, "127.0.0.1:1", 1000 + i, ""});
      }
      const auto& info = state.actor_info(id);
      state.worker_exited({id, info.incarnation, info.pid, "killed by signal 9"}, info.node_id);
    }
  };
  run_and_die(2);
  run_and_die(1);
  run_and_die(0);  // the first two are evicted by now
  EXPECT_EQ(state.status({})["actors"].size(), 1u);
  EXPECT_EQ(state.status({})["actor_restarts_total"], 3);
  std::map<std::string, std::string> store;
  apply_rows(store, state.take_rows());
  HeadState again(HeadConfig{100, 5, 1});
  again.restore(store, now_, 2s);
  EXPECT_EQ(again.status({})["actor_restarts_total"], 3);
}

Hello node_hello(Resources r, uint64_t resume = 0, std::vector<LiveWorker> workers = {}) {
  Hello h;
  h.role = Role::kNode;
  h.resources = std::move(r);
  h.hostname = "host";
  h.resume_node_id = resume;
  h.workers = std::move(workers);
  return h;
}

}  // namespace

// Keys under troupe.actor/<id>/ live as long as their actor: a restart
// keeps them, its death erases them (from the state store too, as it does
// the actor's stats keys), and a put for an actor that is dead or unknown
// is dropped (nothing would erase it).
TEST_F(HeadStateTest, ActorKeysLiveAsLongAsTheirActor) {
  state_.enable_write_through();
  std::map<std::string, std::string> store;
  add_node({{"CPU", 2}}, 1);
  auto a = state_.create_actor(kDriver, spec({}, 1, "svc"));
  auto b = state_.create_actor(kDriver, spec({}, 0, "other"));
  start_spawned();
  const std::string key = troupe::client::actor_key_prefix(a.id) + "py.methods";
  const std::string other = troupe::client::actor_key_prefix(b.id) + "py.methods";
  state_.kv_put(key, "table");
  state_.kv_put(other, "its table");
  state_.kv_put(troupe::client::actor_key_prefix(999) + "x", "no such actor");
  EXPECT_FALSE(state_.kv_get(troupe::client::actor_key_prefix(999) + "x").has_value());
  // Only troupe.actor/<id>/...: a key that its actor's erasure would miss
  // is not made, by a put or an add.
  const std::string bare = "troupe.actor/" + std::to_string(a.id);
  for (const auto& odd : {bare, bare + "abc", std::string("troupe.actor//x"), std::string("troupe.actor/-1/x")}) {
    state_.kv_put(odd, "v");
    EXPECT_FALSE(state_.kv_get(odd).has_value()) << odd;
    EXPECT_THROW(state_.kv_add(odd, 1), troupe::ConfigError) << odd;
  }
  EXPECT_EQ(state_.kv_add(troupe::client::actor_key_prefix(a.id) + "n", 2), 2);
  exited(a.id);
  EXPECT_EQ(state_of(a.id), ActorState::kRestarting);
  start_spawned();
  EXPECT_EQ(state_.kv_get(key), "table");
  const std::string stats = std::string(troupe::client::kStatsKeyPrefix) + std::to_string(a.id) + ".1";
  state_.kv_put(stats, "not even numbers");
  apply_rows(store, state_.take_rows());
  ASSERT_TRUE(store.count("k/" + key) && store.count("k/" + stats));
  exited(a.id);
  EXPECT_EQ(state_of(a.id), ActorState::kDead);
  EXPECT_FALSE(state_.kv_get(key).has_value());
  EXPECT_EQ(state_.kv_get(other), "its table");
  state_.kv_put(key, "late");
  EXPECT_FALSE(state_.kv_get(key).has_value());
  apply_rows(store, state_.take_rows());
  EXPECT_FALSE(store.count("k/" + key));
  EXPECT_FALSE(store.count("k/" + stats));
  EXPECT_TRUE(store.count("k/" + other));
}

// A key <scope>ref/<target> holds every key under `target` while it lives:
// a client's goes with the client's connection, an actor's with the actor
// (not with a restart), and the last one's going erases the target's keys,
// from the store too. A restarted head counts the references again, and a
// client that held keys gets the owners' grace to come back.
TEST_F(HeadStateTest, ReferencedKeysLiveWhileOneOfTheirReferencesDoes) {
  using troupe::client::actor_key_prefix;
  using troupe::client::client_key_prefix;
  state_.enable_write_through();
  std::map<std::string, std::string> store;
  state_.bind_client(kDriver, 7);
  state_.bind_client(kOtherDriver, 8);
  add_node({{"CPU", 2}}, 1);
  const uint64_t a = state_.create_actor(kOtherDriver, spec({}, 1)).id;
  start_spawned();
  for (const char* k : {"pkg.A", "pkg.A.0", "pkg.B", "pkg.B.0", "pkg.C", "pkg.D", "other"}) state_.kv_put(k, "bytes");
  state_.kv_put(client_key_prefix(7) + "ref/pkg.A", "");
  state_.kv_put(actor_key_prefix(a) + "ref/pkg.A", "");
  state_.kv_put(client_key_prefix(7) + "ref/pkg.B", "");
  state_.kv_put(client_key_prefix(8) + "ref/pkg.C", "");
  state_.kv_put(client_key_prefix(8) + "ref/pkg.D", "");
  // A client the head does not know, a target that is or holds a scoped
  // key (erasing it would erase what other rules keep), and a new target
  // that holds or extends one referenced now: refused.
  for (const std::string& odd :
       {client_key_prefix(99) + "ref/pkg.A", client_key_prefix(7) + "ref/", client_key_prefix(7) + "ref/troupe.",
        client_key_prefix(7) + "ref/troupe.actor/1/x", std::string("troupe.client/x/y"), std::string("troupe.client/7"),
        client_key_prefix(7) + "ref/pkg.", client_key_prefix(7) + "ref/pkg.A.0"}) {
    state_.kv_put(odd, "");
    EXPECT_FALSE(state_.kv_get(odd).has_value()) << odd;
  }
  // The only reference erased: its target goes.
  state_.kv_erase(client_key_prefix(8) + "ref/pkg.C");
  EXPECT_FALSE(state_.kv_get("pkg.C").has_value());
  // Client 7 leaves: B (held by it alone) goes, every key of it; A, which
  // the actor holds too, stays.
  state_.peer_gone(kDriver, "connection closed");
  EXPECT_FALSE(state_.kv_get("pkg.B").has_value());
  EXPECT_FALSE(state_.kv_get("pkg.B.0").has_value());
  EXPECT_FALSE(state_.kv_get(client_key_prefix(7) + "ref/pkg.A").has_value());
  EXPECT_EQ(state_.kv_get("pkg.A.0"), "bytes");
  EXPECT_EQ(state_.kv_get("other"), "bytes");
  state_.kv_put(client_key_prefix(7) + "ref/pkg.D", "");  // a client that left is unknown
  EXPECT_FALSE(state_.kv_get(client_key_prefix(7) + "ref/pkg.D").has_value());
  // A restart keeps the actor's reference.
  exited(a);
  ASSERT_EQ(state_of(a), ActorState::kRestarting);
  start_spawned();
  EXPECT_EQ(state_.kv_get("pkg.A"), "bytes");
  apply_rows(store, state_.take_rows());
  EXPECT_FALSE(store.count("k/pkg.B") || store.count("k/pkg.C"));
  ASSERT_TRUE(store.count("k/pkg.A") && store.count("k/pkg.D"));

  // A restarted head: client 8 never comes back, so what it held goes,
  // and so does its actor, and with it the last reference to A.
  HeadState again(HeadConfig{100, 5, 1000});
  again.restore(store, now_, 2s);
  EXPECT_EQ(again.kv_get("pkg.A"), "bytes");
  EXPECT_EQ(again.kv_get("pkg.D"), "bytes");
  again.check_heartbeats(now_ + 3s);
  EXPECT_FALSE(again.kv_get("pkg.D").has_value());
  EXPECT_EQ(again.actor_info(a).state, ActorState::kDead);
  EXPECT_FALSE(again.kv_get("pkg.A").has_value());
  EXPECT_EQ(again.kv_get("other"), "bytes");

  // Here, the actor's death erases A, in the store too.
  exited(a);
  ASSERT_EQ(state_of(a), ActorState::kDead);
  EXPECT_FALSE(state_.kv_get("pkg.A").has_value());
  apply_rows(store, state_.take_rows());
  EXPECT_FALSE(store.count("k/pkg.A") || store.count("k/pkg.A.0"));
}

// A head restarted between a kill for good and the killed worker's exit,
// with the name taken again meanwhile: the name is the new holder's. Rows
// come back in key order ("a/10" before "a/9"), and the killed actor's,
// restored last, took the name back.
TEST_F(HeadStateTest, ARestartedHeadKeepsAKilledActorsNameWithItsNewHolder) {
  state_.enable_write_through();
  std::map<std::string, std::string> store;
  state_.bind_client(kDriver, 7);
  add_node({{"CPU", 4}}, 1);
  uint64_t killed = 0;
  while ((killed = state_.create_actor(kDriver, spec({}, 0, "")).id) < 8) {
  }
  killed = state_.create_actor(kDriver, spec({}, 0, "svc")).id;
  start_spawned();
  state_.kill_actor(killed, true, "test");
  const uint64_t holder = state_.create_actor(kDriver, spec({}, 0, "svc")).id;
  ASSERT_EQ(std::to_string(killed).size() + 1, std::to_string(holder).size()) << "ids " << killed << ", " << holder;
  start_spawned();
  apply_rows(store, state_.take_rows());
  HeadState again(HeadConfig{100, 5, 1000});
  again.restore(store, now_, 2s);
  EXPECT_EQ(again.named_actor("svc").id, holder);
}

TEST_F(HeadStateTest, RestartedHeadKeepsWhatComesBackAndLosesWhatDoesNot) {
  state_.enable_write_through();
  std::map<std::string, std::string> store;
  state_.bind_client(kDriver, 7);
  const uint64_t n1 = add_node({{"CPU", 1}, {"GPU", 2}}, 1);
  const uint64_t n2 = add_node({{"CPU", 2}}, 2);
  const uint64_t kept = state_.create_actor(kDriver, spec({{"GPU", 1}}, 1, "kept")).id;
  const uint64_t gone = state_.create_actor(kDriver, spec({{"CPU", 2}}, 1)).id;
  start_spawned();
  state_.kv_put("rendezvous/0", "addr");
  state_.kv_put("scratch", "x");
  state_.kv_erase("scratch");
  apply_rows(store, state_.take_rows());
  const auto kept_info = state_.actor_info(kept);
  ASSERT_EQ(kept_info.node_id, n1);
  ASSERT_EQ(state_.actor_info(gone).node_id, n2);

  // The head dies; a new one reloads the rows.
  HeadState again(HeadConfig{100, 5, 1000});
  again.restore(store, now_, 2s);
  EXPECT_EQ(again.kv_get("rendezvous/0"), std::optional<std::string>("addr"));
  EXPECT_EQ(again.kv_get("scratch"), std::nullopt);
  EXPECT_EQ(again.named_actor("kept").id, kept);
  EXPECT_EQ(again.actor_info(kept).state, ActorState::kAlive);
  // Node 1 comes back with its worker; node 2 never does.
  again.bind_client(200, 7);
  EXPECT_EQ(again.resume_node(11, node_hello({{"CPU", 1}, {"GPU", 2}}, n1, {{kept, kept_info.incarnation, 5}}), now_),
            n1);
  EXPECT_TRUE(again.take_outputs().kills.empty());
  // The kept actor still holds its GPU: one left on node 1.
  for (const auto& n : again.nodes())
    if (n.id == n1) {
      EXPECT_EQ(n.free_gpu_ids.size(), 1u);
    }
  again.heartbeat(n1, now_ + 2800ms);
  again.check_heartbeats(now_ + 3s);
  EXPECT_EQ(again.actor_info(kept).state, ActorState::kAlive);
  EXPECT_EQ(again.actor_info(gone).state, ActorState::kRestarting);  // its node did not come back
  // New ids never collide with old ones.
  EXPECT_GT(again.create_actor(200, spec()).id, gone);
}

// A request to create an actor asked again (its caller had no answer in
// time: a head that stalled, or one restarted) gets the actor the first ask
// made; before, each ask made one, and a caller that gave up left one
// holding resources (a task executor, a named actor whose name it took).
TEST_F(HeadStateTest, ARequestAskedAgainMakesOneActor) {
  state_.enable_write_through();
  std::map<std::string, std::string> store;
  add_node({{"CPU", 4}}, 1);
  ActorSpec named = spec({{"CPU", 1}}, 0, "once");
  named.request_id = 41;
  const auto first = state_.create_actor(kDriver, named);
  EXPECT_EQ(state_.create_actor(kDriver, named).id, first.id);  // not "the name is taken"
  ActorSpec plain = spec({{"CPU", 1}});
  plain.request_id = 42;
  const auto other = state_.create_actor(kDriver, plain);
  EXPECT_NE(other.id, first.id);
  EXPECT_EQ(state_.create_actor(kDriver, plain).id, other.id);
  // Requests without an id are not merged.
  EXPECT_NE(state_.create_actor(kDriver, spec()).id, state_.create_actor(kDriver, spec()).id);
  PlacementGroupSpec group{{{{"CPU", 1}}}, PlacementStrategy::kPack, "", false, 44};
  const uint64_t group_id = state_.create_placement_group(kDriver, group).id;
  EXPECT_EQ(state_.create_placement_group(kDriver, group).id, group_id);
  start_spawned();
  apply_rows(store, state_.take_rows());
  // A restarted head knows the requests from its rows.
  HeadState again(HeadConfig{100, 5, 1000});
  again.restore(store, now_, 2s);
  EXPECT_EQ(again.create_actor(kDriver, plain).id, other.id);
  EXPECT_EQ(again.create_actor(kDriver, named).id, first.id);
  EXPECT_EQ(again.create_placement_group(kDriver, group).id, group_id);
  ActorSpec fresh = spec();
  fresh.request_id = 43;
  EXPECT_GT(again.create_actor(kDriver, fresh).id, other.id);
}

TEST_F(HeadStateTest, RestoredNodeReportsWorkersThatEndedAndOnesItMustKill) {
  state_.enable_write_through();
  std::map<std::string, std::string> store;
  const uint64_t n = add_node({{"CPU", 4}}, 1);
  const uint64_t a = state_.create_actor(kDriver, spec({{"CPU", 1}}, 1)).id;
  const uint64_t b = state_.create_actor(kDriver, spec({{"CPU", 1}})).id;
  start_spawned();
  apply_rows(store, state_.take_rows());
  HeadState again(HeadConfig{100, 5, 1000});
  again.restore(store, now_, 2s);
  // a's worker ended while the head was down; an unknown worker is still there.
  again.resume_node(11, node_hello({{"CPU", 4}}, n, {{b, 0, 6}, {999, 0, 7}}), now_);
  auto out = again.take_outputs();
  ASSERT_EQ(out.kills.size(), 1u);
  EXPECT_EQ(out.kills[0].second.actor_id, 999u);
  EXPECT_EQ(again.actor_info(a).state, ActorState::kRestarting);
  EXPECT_EQ(again.actor_info(a).incarnation, 1u);
  ASSERT_EQ(out.spawns.size(), 1u);  // a's restart, on the node that is back
  EXPECT_EQ(out.spawns[0].second.actor_id, a);
  EXPECT_EQ(again.actor_info(b).state, ActorState::kAlive);
}

// The head died with a spawn it had written down but its agent never got:
// the restarted head places it again without using a restart, as it does
// for a spawn lost with an agent's connection. One whose worker had said
// hello (the head's tables keep that) crashed, and uses its restart.
TEST_F(HeadStateTest, ASpawnTheHeadDiedWithIsSentAgainWithoutARestart) {
  state_.enable_write_through();
  std::map<std::string, std::string> store;
  const uint64_t n = add_node({{"CPU", 4}}, 1);
  const uint64_t lost = state_.create_actor(kDriver, spec({{"CPU", 1}})).id;
  const uint64_t crashed = state_.create_actor(kDriver, spec({{"CPU", 1}}, 1)).id;
  ASSERT_EQ(state_.take_outputs().spawns.size(), 2u);
  state_.worker_hello(crashed, 0);
  apply_rows(store, state_.take_rows());
  HeadState again(HeadConfig{100, 5, 1000});
  again.restore(store, now_, 2s);
  again.resume_node(11, node_hello({{"CPU", 4}}, n), now_);
  EXPECT_EQ(again.actor_info(lost).state, ActorState::kPending);
  EXPECT_EQ(again.actor_info(lost).restarts, 0);
  EXPECT_EQ(again.actor_info(lost).incarnation, 1u);
  EXPECT_EQ(again.actor_info(crashed).state, ActorState::kRestarting);
  EXPECT_EQ(again.actor_info(crashed).restarts, 1);
  auto out = again.take_outputs();
  EXPECT_EQ(out.spawns.size(), 2u);  // both placed again
}

TEST_F(HeadStateTest, OwnerThatDoesNotComeBackLosesItsActors) {
  state_.enable_write_through();
  std::map<std::string, std::string> store;
  state_.bind_client(kDriver, 7);
  const uint64_t n = add_node({{"CPU", 2}}, 1);
  const uint64_t a = state_.create_actor(kDriver, spec({{"CPU", 1}})).id;
  start_spawned();
  apply_rows(store, state_.take_rows());
  HeadState again(HeadConfig{100, 5, 1000});
  again.restore(store, now_, 2s);
  again.resume_node(11, node_hello({{"CPU", 2}}, n, {{a, 0, 5}}), now_);
  again.take_outputs();
  again.heartbeat(n, now_ + 900ms);
  again.check_heartbeats(now_ + 1s);
  EXPECT_EQ(again.actor_info(a).state, ActorState::kAlive);
  again.heartbeat(n, now_ + 2500ms);
  again.check_heartbeats(now_ + 3s);
  auto out = again.take_outputs();
  ASSERT_EQ(out.kills.size(), 1u);  // its worker is told to go
  EXPECT_EQ(out.kills[0].second.actor_id, a);
}

TEST_F(HeadStateTest, NodeDeclaredDeadBeforeItCameBackJoinsAsANewNode) {
  state_.enable_write_through();
  std::map<std::string, std::string> store;
  const uint64_t n = add_node({{"CPU", 2}}, 1);
  apply_rows(store, state_.take_rows());
  HeadState again(HeadConfig{100, 5, 1000});
  again.restore(store, now_, 1s);
  again.check_heartbeats(now_ + 2s);
  EXPECT_NE(again.resume_node(11, node_hello({{"CPU", 2}}, n), now_ + 2s), n);
}

// A task executor whose task waits in get() lends its CPU: a pending actor
// takes it; the waiter takes it back over the node's total (the node shows
// -1 free and fits nothing) and gives back only the unlent part if it dies
// while lent; a lend of a stale incarnation, a second lend and a take-back
// without a lend change nothing; a restarted head keeps what is lent, and
// a node over its total.
TEST_F(HeadStateTest, ATaskWaitingInGetLendsItsCpuUntilItResumes) {
  state_.enable_write_through();
  std::map<std::string, std::string> store;
  const uint64_t n = add_node({{"CPU", 1}, {"memory", 4}}, 1);
  const uint64_t waiter = state_.create_actor(kDriver, spec({{"CPU", 1}, {"memory", 1}})).id;
  start_spawned();
  const uint32_t inc = state_.actor_info(waiter).incarnation;
  const uint64_t child = state_.create_actor(kDriver, spec({{"CPU", 1}})).id;
  start_spawned();
  ASSERT_EQ(state_of(child), ActorState::kPending);

  state_.lend_resources({waiter, inc + 1, true});  // a stale worker: ignored
  start_spawned();
  EXPECT_EQ(state_of(child), ActorState::kPending);
  state_.lend_resources({waiter, inc, false});  // nothing lent: ignored
  EXPECT_EQ(node(n).available.at("CPU"), 0);

  state_.lend_resources({waiter, inc, true});
  EXPECT_TRUE(state_.actor_info(waiter).blocked);  // published: its submitter sends it nothing
  state_.lend_resources({waiter, inc, true});      // a second lend: ignored
  start_spawned();
  EXPECT_EQ(state_of(child), ActorState::kAlive);
  EXPECT_EQ(node(n).available.at("CPU"), 0);
  EXPECT_EQ(node(n).available.at("memory"), 3);  // only CPU is lent

  apply_rows(store, state_.take_rows());
  HeadState again(HeadConfig{100, 5, 1000});
  again.restore(store, now_, 2s);
  for (const auto& info : again.nodes()) EXPECT_EQ(info.available.at("CPU"), 0);

  state_.lend_resources({waiter, inc, false});
  EXPECT_FALSE(state_.actor_info(waiter).blocked);
  EXPECT_EQ(node(n).available.at("CPU"), -1);
  const uint64_t third = state_.create_actor(kDriver, spec({{"CPU", 0.5}})).id;
  start_spawned();
  EXPECT_EQ(state_of(third), ActorState::kPending);
  apply_rows(store, state_.take_rows());
  HeadState over(HeadConfig{100, 5, 1000});
  over.restore(store, now_, 2s);  // a node over its total is restored as it was
  for (const auto& info : over.nodes()) EXPECT_EQ(info.available.at("CPU"), -1);

  state_.kill_actor(child, true, "test");
  exited(child);
  EXPECT_EQ(node(n).available.at("CPU"), 0);
  start_spawned();
  EXPECT_EQ(state_of(third), ActorState::kPending);
  state_.lend_resources({waiter, inc, true});
  start_spawned();
  EXPECT_EQ(state_of(third), ActorState::kAlive);
  EXPECT_EQ(node(n).available.at("CPU"), 0.5);
  // Dying while lent gives back what was not lent.
  state_.kill_actor(waiter, true, "test");
  exited(waiter);
  EXPECT_EQ(node(n).available.at("CPU"), 0.5);
  EXPECT_EQ(node(n).available.at("memory"), 4);
}

// `troupe logs` of an actor that died before the head restarted still
// finds its last worker.
TEST_F(HeadStateTest, ARestartedHeadKnowsTheLastWorkerOfADeadActor) {
  state_.enable_write_through();
  std::map<std::string, std::string> store;
  const uint64_t n = add_node({{"CPU", 1}}, 1);
  const uint64_t a = state_.create_actor(kDriver, spec()).id;
  start_spawned();
  const int32_t pid = state_.actor_info(a).pid;
  exited(a, "exited with code 1");
  ASSERT_EQ(state_of(a), ActorState::kDead);
  EXPECT_EQ(state_.actor_log_source(a), std::make_pair(n, pid));
  apply_rows(store, state_.take_rows());
  HeadState again(HeadConfig{100, 5, 1000});
  again.restore(store, now_, 2s);
  EXPECT_EQ(again.actor_log_source(a), std::make_pair(n, pid));
}

// A detached actor outlives the driver that made it, also across a head
// restart where that driver does not come back; a kill still ends it.
TEST_F(HeadStateTest, ADetachedActorOutlivesItsDriver) {
  state_.enable_write_through();
  std::map<std::string, std::string> store;
  state_.bind_client(kDriver, 7);
  const uint64_t n = add_node({{"CPU", 2}}, 1);
  auto s = spec({}, 0, "service");
  s.detached = true;
  const auto detached = state_.create_actor(kDriver, s);
  const auto owned = state_.create_actor(kDriver, spec());
  start_spawned();
  apply_rows(store, state_.take_rows());
  state_.peer_gone(kDriver, "closed");
  exited(owned.id);
  EXPECT_EQ(state_of(owned.id), ActorState::kDead);
  EXPECT_EQ(state_of(detached.id), ActorState::kAlive);
  EXPECT_EQ(state_.named_actor("service").id, detached.id);

  // A restarted head waits for the driver of owned actors; not for this one.
  HeadState again(HeadConfig{100, 5, 1000});
  again.restore(store, now_, 2s);
  const auto& info = again.actor_info(detached.id);
  again.resume_node(11, node_hello({{"CPU", 2}}, n, {{detached.id, info.incarnation, info.pid}}), now_);
  again.heartbeat(n, now_ + 2800ms);
  again.check_heartbeats(now_ + 3s);
  EXPECT_EQ(again.actor_info(detached.id).state, ActorState::kAlive);

  state_.kill_actor(detached.id, true, "killed by request");
  exited(detached.id);
  EXPECT_EQ(state_of(detached.id), ActorState::kDead);
}

// A submitter lends the CPU of an idle executor it keeps for its objects:
// only the executor's owner may; anyone else is ignored.
TEST_F(HeadStateTest, OnlyItsOwnerLendsAnIdleExecutorsCpu) {
  const uint64_t n = add_node({{"CPU", 1}}, 1);
  const uint64_t kept = state_.create_actor(kDriver, spec({{"CPU", 1}})).id;
  start_spawned();
  state_.lend_resources({kept, 0, true}, kOtherDriver);
  EXPECT_EQ(node(n).available.at("CPU"), 0);
  state_.lend_resources({kept, 0, true}, kDriver);
  EXPECT_EQ(node(n).available.at("CPU"), 1);
  EXPECT_FALSE(state_.actor_info(kept).blocked);  // idle, not waiting
  state_.lend_resources({kept, 0, false}, kDriver);
  EXPECT_EQ(node(n).available.at("CPU"), 0);
}

// The owner lends an idle executor's CPU and then gives it a task that
// waits at once: the worker's lend and the owner's take-back come on two
// connections, in either order. The CPU stays lent, and the executor known
// as blocked, until neither lends (the owner's take-back used to end the
// worker's lend, which had been ignored).
TEST_F(HeadStateTest, AnExecutorLentByItsOwnerAndItsWorkerIsLentUntilNeitherDoes) {
  const uint64_t n = add_node({{"CPU", 1}}, 1);
  const uint64_t kept = state_.create_actor(kDriver, spec({{"CPU", 1}})).id;
  start_spawned();
  for (bool worker_first : {false, true}) {
    SCOPED_TRACE(worker_first ? "the worker's lend first" : "the owner's take-back first");
    state_.lend_resources({kept, 0, true}, kDriver);  // idle, kept for its objects
    ASSERT_EQ(node(n).available.at("CPU"), 1);
    if (worker_first) {
      state_.lend_resources({kept, 0, true});  // its new task waits
      state_.lend_resources({kept, 0, false}, kDriver);
    } else {
      state_.lend_resources({kept, 0, false}, kDriver);
      state_.lend_resources({kept, 0, true});
    }
    EXPECT_EQ(node(n).available.at("CPU"), 1);
    EXPECT_TRUE(state_.actor_info(kept).blocked);
    state_.lend_resources({kept, 0, false});  // the task goes on
    EXPECT_EQ(node(n).available.at("CPU"), 0);
    EXPECT_FALSE(state_.actor_info(kept).blocked);
  }
  // Told again after a reconnect: repeats change nothing.
  state_.lend_resources({kept, 0, true}, kDriver);
  state_.lend_resources({kept, 0, true}, kDriver);
  EXPECT_EQ(node(n).available.at("CPU"), 1);
  state_.lend_resources({kept, 0, false});
  EXPECT_EQ(node(n).available.at("CPU"), 1);  // the worker did not lend: the owner's stands
  state_.lend_resources({kept, 0, false}, kDriver);
  state_.lend_resources({kept, 0, false}, kDriver);
  EXPECT_EQ(node(n).available.at("CPU"), 0);
}

// Task executors idle in one process must not keep CPUs from the tasks that
// another one waits for: while something waits for room that executors
// hold, every owner of actors hears it, and hears when it is over. Demand
// that no executor could meet (a GPU) does not count.
TEST_F(HeadStateTest, OwnersHearWhileSomethingWaitsForRoomThatExecutorsHold) {
  using Told = std::vector<std::pair<PeerId, bool>>;
  constexpr PeerId kThird = 102, kFourth = 103;
  add_node({{"CPU", 2}, {"GPU", 1}}, 1);
  auto executor = [&] {
    ActorSpec s = spec({{"CPU", 1}});
    s.type_key = troupe::client::kTaskExecutorKey;
    return s;
  };
  state_.create_actor(kDriver, executor());
  const uint64_t other = state_.create_actor(kOtherDriver, executor()).id;
  state_.create_actor(kThird, spec({{"GPU", 1}}));
  EXPECT_EQ(start_spawned().resources_wanted, Told{});  // all fit

  // A second GPU actor waits, but no executor holds a GPU.
  state_.create_actor(kThird, spec({{"GPU", 1}}));
  EXPECT_EQ(start_spawned().resources_wanted, Told{});

  // A CPU actor waits for what the executors hold: every owner hears it.
  const uint64_t waiting = state_.create_actor(kDriver, spec({{"CPU", 1}})).id;
  EXPECT_EQ(start_spawned().resources_wanted, (Told{{kDriver, true}, {kOtherDriver, true}, {kThird, true}}));
  // An owner that comes meanwhile hears it at once; the others hear nothing new.
  const uint64_t fourth = state_.create_actor(kFourth, spec({{"CPU", 1}})).id;
  EXPECT_EQ(start_spawned().resources_wanted, (Told{{kFourth, true}}));

  // One executor goes: `waiting` starts, `fourth` still waits.
  state_.kill_actor(other, true, "released");
  exited(other);
  EXPECT_EQ(start_spawned().resources_wanted, Told{});
  EXPECT_EQ(state_.actor_info(waiting).state, ActorState::kAlive);
  // Once `fourth` is gone too (killed while pending), only the GPU actor
  // waits: the owners told, and still there, hear that it is over.
  state_.peer_gone(kOtherDriver, "exited");
  state_.kill_actor(fourth, true, "given up");
  EXPECT_EQ(state_.take_outputs().resources_wanted, (Told{{kDriver, false}, {kThird, false}, {kFourth, false}}));

  // A placement group that could never be placed does not count either.
  PlacementGroupSpec huge;
  huge.bundles = {{{"CPU", 2}}, {{"CPU", 2}}};
  huge.strategy = PlacementStrategy::kStrictSpread;
  state_.create_placement_group(kDriver, huge);
  EXPECT_EQ(state_.take_outputs().resources_wanted, Told{});
}

// TrainJob documents of jobs that ended are kept up to a bound, the oldest
// erased first; a running job's is never erased (a cluster that ran
// uniquely named jobs for weeks kept every one in status and /metrics).
TEST_F(HeadStateTest, EndedJobDocumentsAreKeptUpToABound) {
  const size_t kMax = troupe::head::HeadState::kMaxJobDocuments;
  auto job = [](size_t i) { return "troupe.jobs/job-" + std::to_string(i); };
  state_.kv_put(job(0), R"({"state":"running"})");
  state_.kv_put(job(1), "not a document");
  for (size_t i = 2; i < kMax + 10; ++i) state_.kv_put(job(i), R"({"state":"finished"})");
  EXPECT_EQ(state_.kv_with_prefix("troupe.jobs/").size(), kMax);
  EXPECT_TRUE(state_.kv_get(job(0)));   // running
  EXPECT_FALSE(state_.kv_get(job(1)));  // the oldest that is not running
  EXPECT_FALSE(state_.kv_get(job(10)));
  EXPECT_TRUE(state_.kv_get(job(11)));
  state_.kv_put(job(5), R"({"state":"finished"})");  // back under its old name: the newest
  EXPECT_TRUE(state_.kv_get(job(5)));
  EXPECT_FALSE(state_.kv_get(job(11)));
}

// A running job whose driver is gone (killed: status shows it lost) is
// trimmed as an ended one is, and so is a document too large to read: a
// killed driver's document said "running" for ever, was never erased, and
// every job's put parsed it again.
TEST_F(HeadStateTest, LostJobDocumentsAreTrimmedAsEndedOnesAre) {
  const size_t kMax = troupe::head::HeadState::kMaxJobDocuments;
  state_.bind_client(kDriver, 7);
  const std::string alive = troupe::client::client_key_prefix(7) + "job";
  state_.kv_put(alive, "here");
  ASSERT_TRUE(state_.kv_get(alive));
  auto job = [](size_t i) { return "troupe.jobs/job-" + std::to_string(i); };
  state_.kv_put(job(0), R"({"state":"running","driver_key":")" + alive + R"("})");
  state_.kv_put(job(1), R"({"state":"running","driver_key":"troupe.client/99/job"})");
  state_.kv_put(job(2), std::string(troupe::head::HeadState::kMaxJobDocument + 1, ' '));
  for (size_t i = 3; i < kMax + 10; ++i)
    state_.kv_put(job(i), R"({"state":"running","driver_key":"troupe.client/99/job"})");
  EXPECT_EQ(state_.kv_with_prefix("troupe.jobs/").size(), kMax);
  EXPECT_TRUE(state_.kv_get(job(0)));  // its driver is there
  EXPECT_FALSE(state_.kv_get(job(1)));
  EXPECT_FALSE(state_.kv_get(job(2)));
  EXPECT_TRUE(state_.kv_get(job(kMax + 9)));
}

// An actor backing off between early deaths (restart_backoff) waits for
// its time, not for room: task executors keep what they hold (and their
// reuse) until it is due and finds none.
TEST_F(HeadStateTest, AnActorBackingOffAsksExecutorsForRoomOnlyWhenDue) {
  using Told = std::vector<std::pair<PeerId, bool>>;
  add_node({{"CPU", 2}}, 1);
  state_.check_heartbeats(now_);
  const uint64_t a = state_.create_actor(kDriver, spec({{"CPU", 1}}, -1)).id;
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(state_.take_outputs().spawns.size(), 1u) << "early death " << i;
    exited(a, "exited with code 1");
  }
  ActorSpec executor = spec({{"CPU", 1}});
  executor.type_key = troupe::client::kTaskExecutorKey;
  state_.create_actor(kOtherDriver, executor);
  state_.create_actor(kOtherDriver, executor);
  auto out = start_spawned();
  EXPECT_EQ(out.spawns.size(), 2u);  // the executors, in the room `a` left
  EXPECT_EQ(out.resources_wanted, Told{});
  state_.check_heartbeats(now_ += 100ms);
  EXPECT_EQ(state_.take_outputs().resources_wanted, (Told{{kDriver, true}, {kOtherDriver, true}}));
}

// The head credits its own late checks to every node; a restored node's
// last heartbeat lies in the future (its grace), which the credit must not
// pull back to now.
TEST_F(HeadStateTest, LateChecksDoNotCutARestoredNodesGraceShort) {
  state_.enable_write_through();
  std::map<std::string, std::string> store;
  const uint64_t n = add_node({{"CPU", 2}}, 1);
  apply_rows(store, state_.take_rows());
  HeadState again(HeadConfig{100, 5, 1000});
  again.restore(store, now_, 2s);
  for (auto t = 150ms; t < 1800ms; t += 150ms) again.check_heartbeats(now_ + t);  // each 50 ms late
  bool alive = false;
  for (const auto& node : again.nodes()) alive = alive || (node.id == n && node.alive);
  EXPECT_TRUE(alive);
}

// A restarted head whose writing back of its tables took longer than the
// grace counts the grace from when it serves (restart_grace): its nodes and
// the owners of its actors are not lost before they could come back.
TEST_F(HeadStateTest, ARestartedHeadsGraceCountsFromWhenItServes) {
  state_.enable_write_through();
  const uint64_t n = add_node({{"CPU", 2}}, 1);
  state_.bind_client(kDriver, 7);
  auto a = state_.create_actor(kDriver, spec({{"CPU", 1}}));
  start_spawned();
  std::map<std::string, std::string> store;
  apply_rows(store, state_.take_rows());
  auto node_alive = [&](HeadState& h) {
    for (const auto& node : h.nodes())
      if (node.id == n) return node.alive;
    return false;
  };
  for (const bool rebased : {false, true}) {
    SCOPED_TRACE(rebased ? "grace from when it serves" : "grace from the restore");
    HeadState again(HeadConfig{100, 5, 1000});
    again.restore(store, now_, 2s);
    if (rebased) again.restart_grace(now_ + 10s, 2s);  // 10 s writing back
    again.check_heartbeats(now_ + 11s);
    EXPECT_EQ(node_alive(again), rebased);
    EXPECT_EQ(again.actor_info(a.id).state == ActorState::kDead, !rebased);
  }
}

// A stopped cluster's state file is emptied and gives its pages back: a
// long session's KV store once left tens of MB of free pages behind.
TEST(HeadStoreTest, ClearShrinksTheFile) {
  const std::string dir = ::testing::TempDir() + "head-store-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/head.sqlite";
  {
    troupe::head::HeadStore store(path);
    std::vector<HeadState::Row> rows;
    for (int i = 0; i < 16; ++i) rows.emplace_back("kv/" + std::to_string(i), std::string(256 * 1024, 'x'));
    store.write(rows);
    EXPECT_GT(std::filesystem::file_size(path) + std::filesystem::file_size(path + "-wal"), 4u << 20);
    store.clear();
    EXPECT_TRUE(store.load().empty());
  }
  uintmax_t bytes = std::filesystem::file_size(path);
  if (std::filesystem::exists(path + "-wal")) bytes += std::filesystem::file_size(path + "-wal");
  EXPECT_LT(bytes, 256u * 1024) << "the emptied state file keeps its pages";
  std::filesystem::remove_all(dir);
}

// A file of an older format this head still reads is taken and marked
// with the head's format (a head of the older one then refuses it, rather
// than misread what the newer wrote); one older than that is refused.
TEST(HeadStoreTest, AnOlderFormatItReadsIsTakenAndMarkedNew) {
  using troupe::head::HeadStore;
  const std::string dir = ::testing::TempDir() + "head-store-format-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/head.sqlite";
  {
    HeadStore store(path);
    store.check_format(7);
    store.write({{"k/x", std::string("1")}});
  }
  {
    HeadStore store(path);
    EXPECT_THROW(store.check_format(9, 8), troupe::ConfigError);
    store.check_format(8, 7);
  }
  HeadStore store(path);
  EXPECT_THROW(store.check_format(7), troupe::ConfigError);  // marked 8 now
  EXPECT_NO_THROW(store.check_format(8));
  std::filesystem::remove_all(dir);
}

namespace {
std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}
}  // namespace

// A KV key is bytes: one with a NUL comes back whole from the state file
// (it was cut at the NUL on reload: it took the value of the key before
// it, and could never be erased).
TEST(HeadStoreTest, KeysWithNulBytesComeBackWhole) {
  using troupe::head::HeadStore;
  const std::string dir = ::testing::TempDir() + "head-store-nul-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/head.sqlite";
  const std::string with_nul("k/a\0b", 5);
  {
    HeadStore store(path);
    store.write({{"k/a", std::string("real")}});
    store.write({{with_nul, std::string("x")}});
  }
  HeadStore store(path);
  const auto rows = store.load();
  EXPECT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows.count("k/a") ? rows.at("k/a") : "(none)", "real");
  EXPECT_EQ(rows.count(with_nul) ? rows.at(with_nul) : "(none)", "x");
  std::filesystem::remove_all(dir);
}

// Another program's SQLite database named as the state file is refused
// and left as it was: it was taken (WAL mode, the head's table, its
// format mark over the program's user_version, mode 0600), and a failed
// write or `troupe stop --force` removed it.
TEST(HeadStoreTest, AnotherProgramsDatabaseIsRefusedAndLeftAsItWas) {
  using troupe::head::HeadStore;
  const std::string dir = ::testing::TempDir() + "head-store-other-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/app.sqlite3";
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(db, "CREATE TABLE users (id INTEGER); PRAGMA user_version = 42", nullptr, nullptr, nullptr),
            SQLITE_OK);
  sqlite3_close(db);
  ::chmod(path.c_str(), 0644);
  const std::string before = slurp(path);
  try {
    HeadStore store(path);
    ADD_FAILURE() << "another program's database was taken";
  } catch (const troupe::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("table 'users'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(slurp(path), before);
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
  EXPECT_FALSE(std::filesystem::exists(path + "-wal"));
  std::filesystem::remove_all(dir);
}

// After a restart, "the oldest ended job documents" are still the oldest
// written, not the first by name: a job that had just ended was trimmed
// before ones that ended long ago.
TEST_F(HeadStateTest, ARestartedHeadTrimsTheOldestJobDocumentsFirst) {
  using troupe::head::HeadStore;
  const std::string dir = ::testing::TempDir() + "head-store-jobs-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/head.sqlite";
  const size_t kMax = troupe::head::HeadState::kMaxJobDocuments;
  auto job = [](const std::string& name) { return "troupe.jobs/" + name; };
  {
    HeadStore store(path);
    state_.enable_write_through();
    store.write(state_.take_rows());
    for (size_t i = 0; i + 1 < kMax; ++i) {
      state_.kv_put(job("z" + std::to_string(1000 + i)), R"({"state":"finished"})");
      store.write(state_.take_rows());  // one message, one write
    }
    state_.kv_put(job("a"), R"({"state":"finished"})");  // the newest
    store.write(state_.take_rows());
  }
  {
    // A restarted head writes all its rows back: the order must survive
    // that write too (it was the keys' order then).
    HeadStore store(path);
    std::vector<std::string> order;
    const auto rows = store.load(&order);
    HeadState again(HeadConfig{100, 5, 1000});
    again.restore(rows, now_, 2s, order);
    again.enable_write_through();
    store.write(again.take_rows());
  }
  HeadStore store(path);
  std::vector<std::string> order;
  const auto rows = store.load(&order);
  HeadState again(HeadConfig{100, 5, 1000});
  again.restore(rows, now_, 2s, order);
  again.kv_put(job("m"), R"({"state":"running"})");
  EXPECT_TRUE(again.kv_get(job("a")));
  EXPECT_FALSE(again.kv_get(job("z1000")));  // the oldest
  EXPECT_TRUE(again.kv_get(job("z1001")));
  std::filesystem::remove_all(dir);
}

// The head's event loop writes; a checkpoint syncs the disk, which can take
// longer than a node's HeadLease, so a thread of the store's own does it.
// Written in bursts (as a head writes), the WAL is checkpointed by that
// thread and starts over at the next burst, and the writer checkpoints
// nothing itself (with SQLite's automatic checkpoint, on the writer, the
// thread's count would stay 0). Written without a pause, the WAL cannot
// start over until the writer checkpoints at kWriterCheckpointPages; then
// it does.
TEST(HeadStoreTest, AThreadOfItsOwnCheckpointsTheWal) {
  using troupe::head::HeadStore;
  const std::string dir = ::testing::TempDir() + "head-store-ckpt-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/head.sqlite";
  {
    HeadStore store(path);
    const std::string value(1000, 'v');
    for (int burst = 0; burst < 4; ++burst) {
      for (int i = 0; i < 300; ++i) store.write({{"kv/" + std::to_string(i % 64), value}});
      // No write comes now: the thread checkpoints every page (when the WAL
      // is long enough to wake it; on a loaded machine it may have started
      // over within the burst already).
      EXPECT_TRUE(troupe::test::eventually([&] {
        return store.wal_pages() < HeadStore::kCheckpointPages || store.backfilled_pages() == store.wal_pages();
      })) << burst;
      store.write({{"kv/next", value}});
      EXPECT_LT(store.wal_pages(), HeadStore::kCheckpointPages + 64)
          << "the WAL did not start over after burst " << burst;
    }
    EXPECT_GT(store.checkpoints(), 0);
    EXPECT_EQ(store.writer_checkpoints(), 0);
    // About 4.5 pages a write: several times kWriterCheckpointPages.
    int starts_over = 0;
    for (int i = 0, before = store.wal_pages(); i < 4000; ++i) {
      store.write({{"kv/" + std::to_string(i % 64), value}});
      starts_over += store.wal_pages() < before;
      before = store.wal_pages();
    }
    EXPECT_GE(starts_over, 1);
    EXPECT_EQ(store.load().size(), 65u);
  }
  std::filesystem::remove_all(dir);
}
