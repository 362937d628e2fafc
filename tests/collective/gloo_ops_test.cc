// Every GlooGroup operation and element type, ranks in separate processes
// (forked), world sizes 1 to 4, counts 0, 1, 1000, and 10,000,000 for a
// few ops. Children check results themselves and report by exit code.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "tests/collective/test_values.h"
#include "tests/support/rank_processes.h"
#include "tests/support/temp_dir.h"
#include "troupe/runtime/collective/file_kv_store.h"
#include "troupe/runtime/collective/gloo_group.h"
#include "troupe/runtime/core/check.h"
#include "troupe/runtime/core/errors.h"

namespace troupe::collective {
namespace {

using namespace std::chrono_literals;
using testing::contribution;
using testing::expected_reduction;
using testing::load;
using testing::store;

constexpr DType kAllTypes[] = {DType::kFloat32,  DType::kFloat64, DType::kInt32, DType::kInt64,
                               DType::kBFloat16, DType::kFloat16, DType::kUInt8};
constexpr ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProduct};
constexpr auto kWait = 60s;

std::string what(const char* op, DType d, size_t count, const char* extra = "") {
  return std::string(op) + " " + to_string(d) + " count " + std::to_string(count) + " " + extra;
}

void check_allreduce(Group& g, DType d, ReduceOp op, size_t count) {
  auto buf = testing::make_buffer(count, d);
  for (size_t i = 0; i < count; ++i) store(buf.data(), i, d, contribution(g.rank(), i));
  AllreduceOptions o;
  o.op = op;
  g.allreduce(buf.data(), count, d, o)->wait(kWait);
  for (size_t i = 0; i < count; ++i) {
    double want = expected_reduction(op, d, g.world_size(), i);
    double got = load(buf.data(), i, d);
    TROUPE_CHECK(testing::close_enough(got, want, d))
        << what("allreduce", d, count, to_string(op)) << ": index " << i << " got " << got << " want " << want;
  }
}

void check_broadcast(Group& g, DType d, size_t count, int root) {
  auto buf = testing::make_buffer(count, d);
  for (size_t i = 0; i < count; ++i) store(buf.data(), i, d, contribution(g.rank(), i));
  g.broadcast(buf.data(), count, d, root)->wait(kWait);
  for (size_t i = 0; i < count; ++i) {
    TROUPE_CHECK(load(buf.data(), i, d) == contribution(root, i))
        << what("broadcast", d, count) << "root " << root << " index " << i;
  }
}

void check_allgather(Group& g, DType d, size_t count) {
  auto in = testing::make_buffer(count, d);
  auto out = testing::make_buffer(count * g.world_size(), d);
  for (size_t i = 0; i < count; ++i) store(in.data(), i, d, contribution(g.rank(), i));
  g.allgather(in.data(), out.data(), count, d)->wait(kWait);
  for (int r = 0; r < g.world_size(); ++r) {
    for (size_t i = 0; i < count; ++i) {
      TROUPE_CHECK(load(out.data(), r * count + i, d) == contribution(r, i))
          << what("allgather", d, count) << "block " << r << " index " << i;
    }
  }
}

void check_reduce_scatter(Group& g, DType d, ReduceOp op, size_t count) {
  const int n = g.world_size();
  auto in = testing::make_buffer(count * n, d);
  auto out = testing::make_buffer(count, d);
  // Block b, element i holds contribution(rank, b * count + i), so blocks
  // differ and a wrong block shows.
  for (size_t i = 0; i < count * n; ++i) store(in.data(), i, d, contribution(g.rank(), i));
  ReduceScatterOptions o;
  o.op = op;
  g.reduce_scatter(in.data(), out.data(), count, d, o)->wait(kWait);
  for (size_t i = 0; i < count; ++i) {
    size_t global = g.rank() * count + i;
    double want = expected_reduction(op, d, n, global);
    double got = load(out.data(), i, d);
    TROUPE_CHECK(testing::close_enough(got, want, d))
        << what("reduce_scatter", d, count, to_string(op)) << ": index " << i << " got " << got << " want " << want;
  }
}

// Every rank sends to the next and receives from the previous, all posting
// their send first: must not deadlock.
void check_send_recv_ring(Group& g, DType d, size_t count) {
  const int n = g.world_size();
  if (n == 1) return;
  const int next = (g.rank() + 1) % n;
  const int prev = (g.rank() + n - 1) % n;
  auto out = testing::make_buffer(count, d);
  auto in = testing::make_buffer(count, d);
  for (size_t i = 0; i < count; ++i) store(out.data(), i, d, contribution(g.rank(), i));
  SendOptions so;
  so.tag = 5;
  RecvOptions ro;
  ro.tag = 5;
  auto s = g.send(out.data(), count, d, next, so);
  auto r = g.recv(in.data(), count, d, prev, ro);
  s->wait(kWait);
  r->wait(kWait);
  for (size_t i = 0; i < count; ++i) {
    TROUPE_CHECK(load(in.data(), i, d) == contribution(prev, i)) << what("send/recv", d, count) << "index " << i;
  }
}

// Rank 0 and 1 exchange several tagged messages; messages of one tag
// arrive in order.
void check_send_recv_pairs(Group& g) {
  if (g.world_size() < 2 || g.rank() > 1) return;
  const int peer = 1 - g.rank();
  std::vector<int64_t> a(3), b(3), got_a(3), got_b(3);
  for (int i = 0; i < 3; ++i) {
    a[i] = 100 * g.rank() + i;
    b[i] = 1000 * g.rank() + i;
  }
  SendOptions s1;
  s1.tag = 1;
  SendOptions s2;
  s2.tag = 2;
  RecvOptions r1;
  r1.tag = 1;
  RecvOptions r2;
  r2.tag = 2;
  std::vector<WorkPtr> works;
  if (g.rank() == 0) {
    works.push_back(g.send(a.data(), 3, DType::kInt64, peer, s1));
    works.push_back(g.send(b.data(), 3, DType::kInt64, peer, s2));
    works.push_back(g.recv(got_b.data(), 3, DType::kInt64, peer, r2));
    works.push_back(g.recv(got_a.data(), 3, DType::kInt64, peer, r1));
  } else {
    works.push_back(g.recv(got_a.data(), 3, DType::kInt64, peer, r1));
    works.push_back(g.recv(got_b.data(), 3, DType::kInt64, peer, r2));
    works.push_back(g.send(b.data(), 3, DType::kInt64, peer, s2));
    works.push_back(g.send(a.data(), 3, DType::kInt64, peer, s1));
  }
  for (auto& w : works) w->wait(kWait);
  for (int i = 0; i < 3; ++i) {
    TROUPE_CHECK(got_a[i] == 100 * peer + i) << "tag 1 message " << i << " got " << got_a[i];
    TROUPE_CHECK(got_b[i] == 1000 * peer + i) << "tag 2 message " << i << " got " << got_b[i];
  }
}

void run_all_small(Group& g) {
  for (size_t count : {size_t{0}, size_t{1}, size_t{1000}}) {
    for (DType d : kAllTypes) {
      for (ReduceOp op : kAllOps) check_allreduce(g, d, op, count);
      check_broadcast(g, d, count, 0);
      check_broadcast(g, d, count, g.world_size() - 1);
      check_allgather(g, d, count);
      for (ReduceOp op : kAllOps) check_reduce_scatter(g, d, op, count);
      check_send_recv_ring(g, d, count);
    }
    g.barrier()->wait(kWait);
  }
  check_send_recv_pairs(g);
  g.barrier()->wait(kWait);
}

void run_ranks(int world_size, const std::string& tag, const std::function<void(Group&)>& body,
               bool check_agreement = true, bool check_point_to_point = false) {
  const std::string dir = test::make_temp_dir(tag);
  test::RankProcesses ranks(world_size, [&](int rank) {
    FileKvStore kv(dir);
    GlooGroupOptions opts;
    opts.rendezvous_timeout = 30s;
    opts.op_timeout = 60s;
    opts.check_agreement = check_agreement;
    opts.check_point_to_point = check_point_to_point;
    auto group = GlooGroup::create(kv, tag, 1, rank, world_size, opts);
    body(*group);
  });
  auto exits = ranks.wait_all(240s);
  test::remove_dir(dir);
  for (const auto& e : exits) {
    EXPECT_TRUE(e.exited && e.code == 0) << "world size " << world_size << ": " << test::describe(e);
  }
}

class GlooOpsTest : public ::testing::TestWithParam<int> {};

TEST_P(GlooOpsTest, EveryOpAndTypeSmallCounts) { run_ranks(GetParam(), "ops", run_all_small); }

INSTANTIATE_TEST_SUITE_P(WorldSizes, GlooOpsTest, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// 10,000,000 elements for a few ops only: the suite runs on two cores.
class GlooLargeTest : public ::testing::TestWithParam<int> {};

TEST_P(GlooLargeTest, TenMillionElements) {
  run_ranks(GetParam(), "large", [](Group& g) {
    constexpr size_t kCount = 10'000'000;
    check_allreduce(g, DType::kFloat32, ReduceOp::kSum, kCount);
    check_allreduce(g, DType::kBFloat16, ReduceOp::kAvg, kCount);
    check_allreduce(g, DType::kInt64, ReduceOp::kMax, kCount);
    check_broadcast(g, DType::kUInt8, kCount, g.world_size() - 1);
    check_reduce_scatter(g, DType::kFloat32, ReduceOp::kSum, kCount / g.world_size());
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, GlooLargeTest, ::testing::Values(2, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// Members asked for different operations: every member fails the operation
// with a ConfigError naming each rank's call, no process dies (gloo's
// transport thread aborts one that receives more than it posted), and the
// group goes on.
void expect_disagreement(const WorkPtr& work, const std::string& names) {
  try {
    work->wait(kWait);
  } catch (const ConfigError& e) {
    TROUPE_CHECK(std::string(e.what()).find(names) != std::string::npos)
        << "the error names '" << names << "': " << e.what();
    return;
  }
  TROUPE_CHECK(false) << "no ConfigError; expected one naming '" << names << "'";
}

void check_group_goes_on(Group& g) {
  std::vector<int64_t> x(7, g.rank() + 1);
  g.allreduce(x.data(), x.size(), DType::kInt64)->wait(kWait);
  const int64_t n = g.world_size();
  TROUPE_CHECK(x[6] == n * (n + 1) / 2) << "allreduce after a disagreement got " << x[6];
}

void run_disagreements(Group& g) {
  const int r = g.rank();
  const bool last = r == g.world_size() - 1;
  // Counts: the last rank passes more than the others (it would receive
  // less than gloo sends it the other way round).
  std::vector<float> big(1000, 1.0f);
  const size_t count = last ? 1000 : 10;
  expect_disagreement(g.allreduce(big.data(), count, DType::kFloat32),
                      "rank " + std::to_string(g.world_size() - 1) + ": allreduce of 1000 float32 (sum)");
  check_group_goes_on(g);
  // dtypes of one byte size, a reduction, a root, an operation.
  std::vector<int32_t> words(16, 1);
  expect_disagreement(g.allreduce(words.data(), 16, last ? DType::kInt32 : DType::kFloat32), "allreduce of 16 int32");
  AllreduceOptions maxed;
  maxed.op = last ? ReduceOp::kMax : ReduceOp::kSum;
  expect_disagreement(g.allreduce(big.data(), 4, DType::kFloat32, maxed), "allreduce of 4 float32 (max)");
  expect_disagreement(g.broadcast(big.data(), 8, DType::kFloat32, last ? 1 : 0), "broadcast of 8 float32 from rank 1");
  std::vector<float> gathered(1000 * g.world_size());
  expect_disagreement(last ? g.barrier() : g.allgather(big.data(), gathered.data(), 3, DType::kFloat32),
                      "allgather of 3 float32");
  // A count of zero on one rank only takes part in the check.
  expect_disagreement(g.allreduce(big.data(), last ? 0 : 5, DType::kFloat32), "allreduce of 0 float32");
  check_group_goes_on(g);
  // Point to point between ranks 0 and 1: a longer send, a shorter one,
  // another dtype. The receive fails and its memory is untouched; the send
  // completes.
  if (r <= 1) {
    std::vector<float> msg(1000, 5.0f), into(1000, -1.0f);
    for (size_t sent : {size_t{1000}, size_t{3}}) {
      if (r == 0) {
        g.send(msg.data(), sent, DType::kFloat32, 1)->wait(kWait);
      } else {
        expect_disagreement(g.recv(into.data(), 10, DType::kFloat32, 0),
                            "rank 0 sent " + std::to_string(sent) + " float32 and this receive takes 10 float32");
        TROUPE_CHECK(into[0] == -1.0f) << "a refused message landed: " << into[0];
      }
    }
    if (r == 0) {
      g.send(msg.data(), 4, DType::kInt32, 1)->wait(kWait);
      g.send(msg.data(), 4, DType::kFloat32, 1)->wait(kWait);
    } else {
      expect_disagreement(g.recv(into.data(), 4, DType::kFloat32, 0), "rank 0 sent 4 int32");
      g.recv(into.data(), 4, DType::kFloat32, 0)->wait(kWait);
      TROUPE_CHECK(into[3] == 5.0f) << "the agreeing message after a refused one got " << into[3];
    }
  }
  check_group_goes_on(g);
}

class GlooAgreementTest : public ::testing::TestWithParam<int> {};

TEST_P(GlooAgreementTest, MembersAskedForDifferentCallsFailItAndGoOn) {
  run_ranks(GetParam(), "agree", run_disagreements, true, /*check_point_to_point=*/true);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, GlooAgreementTest, ::testing::Values(2, 3),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// A member destroys the group (after a check of its own) while the
// other calls an allreduce: that call fails, and the leaving member's
// process stays up until told the other is done.
TEST(GlooLeaveTest, AMemberThatLeavesWhileAnotherCallsCrashesNeither) {
  const std::string dir = test::make_temp_dir("leave");
  test::RankProcesses ranks(2, [&](int rank) {
    FileKvStore kv(dir);
    GlooGroupOptions opts;
    opts.rendezvous_timeout = 30s;
    opts.op_timeout = 20s;
    auto group = GlooGroup::create(kv, "leave", 1, rank, 2, opts);
    check_group_goes_on(*group);
    if (rank == 0) {
      group.reset();
      kv.put("left", "1");
      kv.wait("other-done", 60s);
      return;
    }
    kv.wait("left", 60s);
    std::vector<float> x(4, 1.0f);
    bool failed = false;
    try {
      group->allreduce(x.data(), x.size(), DType::kFloat32)->wait(kWait);
    } catch (const Error&) {
      failed = true;
    }
    kv.put("other-done", "1");
    TROUPE_CHECK(failed) << "an allreduce with a member that left succeeded";
  });
  auto exits = ranks.wait_all(120s);
  test::remove_dir(dir);
  for (const auto& e : exits) EXPECT_TRUE(e.exited && e.code == 0) << test::describe(e);
}

// Point-to-point operations checked too: every operation still works.
TEST(GlooOpsCheckedTest, EveryOpAndTypeWithPointToPointChecked) {
  run_ranks(3, "checked", run_all_small, true, /*check_point_to_point=*/true);
}

// The trainer's groups turn the check off: every operation still works.
TEST(GlooOpsUncheckedTest, EveryOpAndTypeWithoutTheAgreementCheck) {
  run_ranks(3, "unchecked", run_all_small, /*check_agreement=*/false);
}

}  // namespace
}  // namespace troupe::collective
