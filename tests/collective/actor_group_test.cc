// Collective groups formed by actors in real worker processes on a
// LocalCluster (a head and two node agents on loopback): every operation and
// element type for world sizes 1 to 4, then failures: a rank killed with
// SIGKILL inside a large allreduce, a group aborted by the driver, and a
// rank that never arrives at the rendezvous.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "tests/collective/test_values.h"
#include "tests/support/wait.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/collective/actor_group.h"
#include "troupe/runtime/collective/gloo_group.h"
#include "troupe/runtime/collective/kv_gloo_store.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/testing/local_cluster.h"

using namespace std::chrono_literals;
using troupe::collective::DType;
using troupe::collective::Group;
using troupe::collective::ReduceOp;
using troupe::test::kWaitBound;
namespace tv = troupe::collective::testing;

namespace {

int64_t monotonic_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string mismatch(const char* what, DType d, size_t i, double got, double want) {
  std::ostringstream s;
  s << what << " " << troupe::collective::to_string(d) << " element " << i << ": got " << got << ", want " << want;
  return s.str();
}

}  // namespace

// One member of the groups under test. Every op method runs the operation,
// checks this rank's result and returns "" or the first mismatch, so that
// large buffers never travel back to the driver.
class Rank {
 public:
  Rank() = default;

  int pid() const { return ::getpid(); }

  // The type of the group that moves the data behind join_group's.
  std::string backend(std::string name) {
    Group& b = group(name).backend();
    if (&b == &group(name)) return "the wrapper itself";
    return dynamic_cast<troupe::collective::GlooGroup*>(&b) != nullptr ? "gloo" : "another";
  }

  void join(std::string name, int64_t generation, int rank, int world, std::vector<uint64_t> members,
            int64_t rendezvous_ms) {
    troupe::collective::GroupSpec spec;
    spec.name = name;
    spec.generation = generation;
    spec.rank = rank;
    spec.world_size = world;
    spec.members = std::move(members);
    spec.rendezvous_timeout = std::chrono::milliseconds(rendezvous_ms);
    spec.op_timeout = 60s;    // a bug fails the test instead of hanging it
    groups_[name] = nullptr;  // drops an older generation first
    groups_[name] = troupe::collective::join_group(spec);
  }

  std::string allreduce(std::string name, DType d, ReduceOp op, int64_t count) {
    Group& g = group(name);
    auto buf = tv::make_buffer(count, d);
    for (int64_t i = 0; i < count; ++i) tv::store(buf.data(), i, d, tv::contribution(g.rank(), i));
    g.allreduce(buf.data(), count, d, {.op = op})->wait(60s);
    for (int64_t i = 0; i < count; ++i) {
      double want = tv::expected_reduction(op, d, g.world_size(), i);
      double got = tv::load(buf.data(), i, d);
      if (!tv::close_enough(got, want, d)) return mismatch(troupe::collective::to_string(op), d, i, got, want);
    }
    return "";
  }

  std::string broadcast(std::string name, DType d, int root, int64_t count) {
    Group& g = group(name);
    auto buf = tv::make_buffer(count, d);
    for (int64_t i = 0; i < count; ++i) tv::store(buf.data(), i, d, tv::contribution(g.rank(), i));
    g.broadcast(buf.data(), count, d, root)->wait(60s);
    for (int64_t i = 0; i < count; ++i) {
      double want = tv::contribution(root, i);
      double got = tv::load(buf.data(), i, d);
      if (got != want) return mismatch("broadcast", d, i, got, want);
    }
    return "";
  }

  std::string allgather(std::string name, DType d, int64_t count) {
    Group& g = group(name);
    auto in = tv::make_buffer(count, d);
    auto out = tv::make_buffer(count * g.world_size(), d);
    for (int64_t i = 0; i < count; ++i) tv::store(in.data(), i, d, tv::contribution(g.rank(), i));
    g.allgather(in.data(), out.data(), count, d)->wait(60s);
    for (int r = 0; r < g.world_size(); ++r) {
      for (int64_t i = 0; i < count; ++i) {
        double want = tv::contribution(r, i);
        double got = tv::load(out.data(), r * count + i, d);
        if (got != want) return mismatch("allgather", d, r * count + i, got, want);
      }
    }
    return "";
  }

  std::string reduce_scatter(std::string name, DType d, ReduceOp op, int64_t per_rank) {
    Group& g = group(name);
    const int64_t total = per_rank * g.world_size();
    auto in = tv::make_buffer(total, d);
    auto out = tv::make_buffer(per_rank, d);
    for (int64_t i = 0; i < total; ++i) tv::store(in.data(), i, d, tv::contribution(g.rank(), i));
    g.reduce_scatter(in.data(), out.data(), per_rank, d, {.op = op})->wait(60s);
    for (int64_t i = 0; i < per_rank; ++i) {
      double want = tv::expected_reduction(op, d, g.world_size(), g.rank() * per_rank + i);
      double got = tv::load(out.data(), i, d);
      if (!tv::close_enough(got, want, d)) return mismatch("reduce_scatter", d, i, got, want);
    }
    return "";
  }

  // A ring of send/recv pairs: every rank sends to the next and receives
  // from the previous, both posted before either is waited on.
  std::string send_recv(std::string name, DType d, int64_t count) {
    Group& g = group(name);
    const int n = g.world_size();
    const int next = (g.rank() + 1) % n;
    const int prev = (g.rank() + n - 1) % n;
    auto out = tv::make_buffer(count, d);
    auto in = tv::make_buffer(count, d);
    for (int64_t i = 0; i < count; ++i) tv::store(out.data(), i, d, tv::contribution(g.rank(), i));
    auto sent = g.send(out.data(), count, d, next, {.tag = 7});
    auto received = g.recv(in.data(), count, d, prev, {.tag = 7});
    sent->wait(60s);
    received->wait(60s);
    for (int64_t i = 0; i < count; ++i) {
      double want = tv::contribution(prev, i);
      double got = tv::load(in.data(), i, d);
      if (got != want) return mismatch("recv", d, i, got, want);
    }
    return "";
  }

  void barrier(std::string name) { group(name).barrier()->wait(60s); }

  // All-reduces `count` float32 in a loop until an operation fails; says so
  // through the KV after the first success (the driver kills a rank then).
  // Returns the failure's message and when it surfaced (steady_clock ms).
  std::tuple<std::string, int64_t> allreduce_until_failure(std::string name, int64_t count) {
    Group& g = group(name);
    std::vector<float> buf(count);
    const auto give_up = std::chrono::steady_clock::now() + 60s;
    for (int iter = 0; std::chrono::steady_clock::now() < give_up; ++iter) {
      std::fill(buf.begin(), buf.end(), 1.0f);
      try {
        g.allreduce(buf.data(), buf.size(), DType::kFloat32)->wait(60s);
      } catch (const std::exception& e) {
        return {e.what(), monotonic_ms()};
      }
      if (iter == 0) troupe::this_actor::runtime().kv().put(name + "/looping/" + std::to_string(g.rank()), "1");
    }
    return {"", monotonic_ms()};
  }

 private:
  Group& group(const std::string& name) {
    auto it = groups_.find(name);
    if (it == groups_.end() || !it->second) throw std::invalid_argument("no group '" + name + "' joined");
    return *it->second;
  }

  std::map<std::string, std::unique_ptr<Group>> groups_;
};
TROUPE_ACTOR(Rank, &Rank::pid, &Rank::join, &Rank::allreduce, &Rank::broadcast, &Rank::allgather, &Rank::reduce_scatter,
             &Rank::send_recv, &Rank::barrier, &Rank::allreduce_until_failure, &Rank::backend)

namespace {

using troupe::ActorHandle;
using troupe::Future;

constexpr DType kAllTypes[] = {DType::kFloat32,  DType::kFloat64, DType::kInt32, DType::kInt64,
                               DType::kBFloat16, DType::kFloat16, DType::kUInt8};
constexpr ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProduct};
constexpr int64_t kCounts[] = {0, 1, 1000};

// A cluster of two nodes with two CPUs each, and four Rank actors (one CPU
// each, so two per node), shared by the tests of one suite.
class ActorGroupTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cluster_ = new troupe::testing::LocalCluster();
    rt_ = new troupe::Runtime(cluster_->connect());
  }
  static void TearDownTestSuite() {
    delete rt_;
    delete cluster_;
    rt_ = nullptr;
    cluster_ = nullptr;
  }

  std::vector<ActorHandle<Rank>> spawn_ranks(int n) {
    std::vector<ActorHandle<Rank>> ranks;
    for (int i = 0; i < n; ++i) ranks.push_back(rt_->spawn<Rank>({.resources = {{"CPU", 1}}}));
    for (auto& r : ranks) EXPECT_TRUE(r.wait_ready(kWaitBound));
    return ranks;
  }

  static std::vector<uint64_t> ids(const std::vector<ActorHandle<Rank>>& ranks) {
    std::vector<uint64_t> out;
    for (auto& r : ranks) out.push_back(r.id());
    return out;
  }

  // Every rank of `ranks` joins (name, generation) with its index as rank.
  static void join_all(const std::vector<ActorHandle<Rank>>& ranks, const std::string& name, int64_t generation,
                       int64_t rendezvous_ms = 20000) {
    std::vector<Future<void>> joins;
    for (size_t r = 0; r < ranks.size(); ++r) {
      joins.push_back(ranks[r].call(&Rank::join, name, generation, static_cast<int>(r), static_cast<int>(ranks.size()),
                                    ids(ranks), rendezvous_ms));
    }
    for (auto& j : joins) j.get(kWaitBound);
  }

  static inline troupe::testing::LocalCluster* cluster_ = nullptr;
  static inline troupe::Runtime* rt_ = nullptr;
};

// Issues every operation to every rank at once (calls to one actor run in
// order, so all ranks see the same sequence) and then collects the checks.
TEST_F(ActorGroupTest, EveryOpAndTypeForWorldSizesOneToFour) {
  auto all = spawn_ranks(4);
  for (int world = 1; world <= 4; ++world) {
    SCOPED_TRACE("world size " + std::to_string(world));
    std::vector<ActorHandle<Rank>> ranks(all.begin(), all.begin() + world);
    const std::string name = "ops-w" + std::to_string(world);
    join_all(ranks, name, 1);
    // What the trainer's tensor collectives ask to tell host from device
    // memory (trainer/tensor_collectives.cc).
    for (auto& r : ranks) EXPECT_EQ(r.call(&Rank::backend, name).get(kWaitBound), "gloo");

    // (description, one future per rank)
    std::vector<std::pair<std::string, std::vector<Future<std::string>>>> checks;
    auto issue = [&](const std::string& what, auto&& call) {
      std::vector<Future<std::string>> fs;
      for (auto& r : ranks) fs.push_back(call(r));
      checks.emplace_back(what, std::move(fs));
    };
    for (DType d : kAllTypes) {
      for (int64_t count : kCounts) {
        const std::string suffix = std::string(" ") + troupe::collective::to_string(d) + " x" + std::to_string(count);
        for (ReduceOp op : kAllOps) {
          issue(std::string("allreduce ") + troupe::collective::to_string(op) + suffix,
                [&](auto& r) { return r.call(&Rank::allreduce, name, d, op, count); });
          issue(std::string("reduce_scatter ") + troupe::collective::to_string(op) + suffix,
                [&](auto& r) { return r.call(&Rank::reduce_scatter, name, d, op, count); });
        }
        issue("broadcast" + suffix, [&](auto& r) { return r.call(&Rank::broadcast, name, d, world - 1, count); });
        issue("allgather" + suffix, [&](auto& r) { return r.call(&Rank::allgather, name, d, count); });
        if (world > 1) issue("send/recv" + suffix, [&](auto& r) { return r.call(&Rank::send_recv, name, d, count); });
      }
    }
    // The large cases: 10,000,000 elements.
    if (world == 4) {
      issue("allreduce sum float32 x10M", [&](auto& r) {
        return r.call(&Rank::allreduce, name, DType::kFloat32, ReduceOp::kSum, int64_t{10'000'000});
      });
    }
    if (world == 2) {
      issue("reduce_scatter max int64 x10M (5M per rank)", [&](auto& r) {
        return r.call(&Rank::reduce_scatter, name, DType::kInt64, ReduceOp::kMax, int64_t{5'000'000});
      });
    }
    std::vector<Future<void>> barriers;
    for (auto& r : ranks) barriers.push_back(r.call(&Rank::barrier, name));

    for (auto& [what, fs] : checks) {
      for (size_t r = 0; r < fs.size(); ++r) EXPECT_EQ(fs[r].get(kWaitBound), "") << what << " at rank " << r;
    }
    for (auto& b : barriers) b.get(kWaitBound);
    // The group formed: its rendezvous keys left the head's KV store.
    const std::string prefix = troupe::collective::KvGlooStore::key_prefix(name, 1);
    for (int r = 0; r < world; ++r) {
      EXPECT_FALSE(rt_->kv().get(prefix + "member/" + std::to_string(r))) << "member key of rank " << r;
      EXPECT_FALSE(rt_->kv().get(prefix + std::to_string(r))) << "mesh key of rank " << r;
    }
  }
  for (auto& r : all) rt_->kill(r);
}

// SIGKILL one rank while all three are inside large allreduces: every
// survivor's operation fails within 2 s naming the dead rank, then the
// survivors form generation 2 on their own and all-reduce again.
TEST_F(ActorGroupTest, KilledRankFailsSurvivorsFastAndTheyReformGenerationTwo) {
  auto ranks = spawn_ranks(3);
  const int victim = 1;
  const std::string name = "fault";
  join_all(ranks, name, 1);
  const int victim_pid = ranks[victim].call(&Rank::pid).get(kWaitBound);

  std::vector<Future<std::tuple<std::string, int64_t>>> loops;
  for (auto& r : ranks) loops.push_back(r.call(&Rank::allreduce_until_failure, name, int64_t{4'000'000}));
  for (int r = 0; r < 3; ++r) rt_->kv().wait(name + "/looping/" + std::to_string(r), kWaitBound);

  const int64_t killed_at = monotonic_ms();
  ASSERT_EQ(::kill(victim_pid, SIGKILL), 0);
  const std::string dead_rank =
      "rank " + std::to_string(victim) + " (actor " + std::to_string(ranks[victim].id()) + ")";
  for (int r = 0; r < 3; ++r) {
    if (r == victim) continue;
    auto [error, failed_at] = loops[r].get(kWaitBound);
    const int64_t took = failed_at - killed_at;
    SCOPED_TRACE("survivor rank " + std::to_string(r) + " failed " + std::to_string(took) +
                 " ms after the kill: " + error);
    std::printf("[survivor rank %d] failed %lld ms after the kill: %s\n", r, static_cast<long long>(took),
                error.c_str());
    EXPECT_NE(error, "") << "the allreduce never failed";
    EXPECT_NE(error.find(dead_rank), std::string::npos);
    EXPECT_LT(took, 2000);
    EXPECT_GE(took, 0);
  }
  EXPECT_THROW(loops[victim].get(kWaitBound), troupe::ActorDied);

  // Generation 2: the survivors, renumbered 0 and 1.
  std::vector<ActorHandle<Rank>> survivors = {ranks[0], ranks[2]};
  join_all(survivors, name, 2);
  std::vector<Future<std::string>> checks;
  for (auto& r : survivors)
    checks.push_back(r.call(&Rank::allreduce, name, DType::kFloat32, ReduceOp::kSum, int64_t{1000}));
  for (auto& c : checks) EXPECT_EQ(c.get(kWaitBound), "");
  for (auto& r : survivors) rt_->kill(r);
}

// The driver aborts a group whose third member never joins the allreduce:
// the two waiting members fail at once with the driver's reason.
TEST_F(ActorGroupTest, DriverAbortReachesMembersBlockedInsideAnAllreduce) {
  auto ranks = spawn_ranks(3);
  const std::string name = "driver-abort";
  join_all(ranks, name, 1);
  std::vector<Future<std::string>> stuck;
  for (int r = 0; r < 2; ++r)
    stuck.push_back(ranks[r].call(&Rank::allreduce, name, DType::kFloat32, ReduceOp::kSum, int64_t{1000}));
  // Rank 2 never issues its allreduce; nothing can complete. (Whether the
  // two are inside it yet or not, the abort fails their allreduce.)
  EXPECT_FALSE(stuck[0].ready());

  const int64_t start = monotonic_ms();
  EXPECT_EQ(troupe::collective::abort_group(*rt_, ids(ranks), name, "driver says stop"), 3);
  for (auto& f : stuck) {
    try {
      f.get(kWaitBound);
      ADD_FAILURE() << "expected the allreduce to fail";
    } catch (const troupe::Aborted& e) {
      EXPECT_NE(std::string(e.what()).find("driver says stop"), std::string::npos) << e.what();
    }
  }
  EXPECT_LT(monotonic_ms() - start, 2000);
  // An aborted group refuses later operations too.
  EXPECT_THROW(ranks[2].call(&Rank::barrier, name).get(kWaitBound), troupe::Aborted);
  for (auto& r : ranks) rt_->kill(r);
}

// Two of three ranks join; they fail at the rendezvous timeout, naming the
// missing rank, instead of waiting forever.
TEST_F(ActorGroupTest, RankThatNeverArrivesFailsRendezvousAtItsTimeout) {
  auto ranks = spawn_ranks(3);
  std::vector<uint64_t> members = ids(ranks);
  std::vector<Future<void>> joins;
  const int64_t start = monotonic_ms();
  for (int r = 0; r < 2; ++r) {
    joins.push_back(ranks[r].call(&Rank::join, std::string("absent"), int64_t{1}, r, 3, members, int64_t{1500}));
  }
  for (auto& j : joins) {
    try {
      j.get(kWaitBound);
      ADD_FAILURE() << "expected the rendezvous to time out";
    } catch (const troupe::Timeout& e) {
      EXPECT_NE(std::string(e.what()).find("rank(s) 2 never arrived"), std::string::npos) << e.what();
    }
  }
  const int64_t took = monotonic_ms() - start;
  EXPECT_GE(took, 1400);
  EXPECT_LT(took, 6000);
  for (auto& r : ranks) rt_->kill(r);
}

// A member that dies while the others wait for it at the rendezvous makes
// the rendezvous fail soon, naming it, rather than at the timeout.
TEST_F(ActorGroupTest, MemberDyingDuringRendezvousFailsItEarly) {
  auto ranks = spawn_ranks(3);
  std::vector<uint64_t> members = ids(ranks);
  const int victim_pid = ranks[2].call(&Rank::pid).get(kWaitBound);
  std::vector<Future<void>> joins;
  for (int r = 0; r < 2; ++r) {
    joins.push_back(ranks[r].call(&Rank::join, std::string("early"), int64_t{1}, r, 3, members, int64_t{30000}));
  }
  // Both are inside the rendezvous once they have announced themselves.
  for (int r = 0; r < 2; ++r) {
    rt_->kv().wait(troupe::collective::KvGlooStore::key_prefix("early", 1) + "member/" + std::to_string(r), kWaitBound);
  }
  const int64_t killed_at = monotonic_ms();
  ASSERT_EQ(::kill(victim_pid, SIGKILL), 0);
  for (auto& j : joins) {
    try {
      j.get(kWaitBound);
      ADD_FAILURE() << "expected the rendezvous to fail";
    } catch (const troupe::Aborted& e) {
      EXPECT_NE(std::string(e.what()).find("rank 2 (actor " + std::to_string(members[2]) + ")"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_LT(monotonic_ms() - killed_at, 3000);
  for (int r = 0; r < 2; ++r) rt_->kill(ranks[r]);
}

}  // namespace
