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

void run_ranks(int world_size, const std::string& tag, const std::function<void(Group&)>& body) {
  const std::string dir = test::make_temp_dir(tag);
  test::RankProcesses ranks(world_size, [&](int rank) {
    FileKvStore kv(dir);
    GlooGroupOptions opts;
    opts.rendezvous_timeout = 30s;
    opts.op_timeout = 60s;
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

}  // namespace
}  // namespace troupe::collective
