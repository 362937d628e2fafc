// In-process tests of the collective layer: conversions, the stores, and
// GlooGroup behaviour that needs no second process (ranks as threads over a
// MemoryKvStore): rendezvous timeouts, generations, abort semantics.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <future>
#include <thread>
#include <vector>

#include "tests/support/rank_processes.h"
#include "tests/support/temp_dir.h"
#include "troupe/runtime/collective/file_kv_store.h"
#include "troupe/runtime/collective/gloo_group.h"
#include "troupe/runtime/collective/kv_gloo_store.h"
#include "troupe/runtime/collective/reduce.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/kv_store.h"
#include "troupe/runtime/core/thread_set.h"

namespace troupe::collective {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

int64_t ms_since(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

TEST(ReduceTest, HalfConversionsRoundTripAndRoundToNearestEven) {
  for (float f : {0.0f, 1.0f, -2.5f, 3.0f, 1024.0f, 0.15625f}) {
    EXPECT_EQ(detail::bf16_to_float(detail::float_to_bf16(f)), f);
    EXPECT_EQ(detail::fp16_to_float(detail::float_to_fp16(f)), f);
  }
  // 1 + 2^-8 lies halfway between two bfloat16 values: ties go to even (1).
  EXPECT_EQ(detail::bf16_to_float(detail::float_to_bf16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_TRUE(std::isnan(detail::bf16_to_float(detail::float_to_bf16(NAN))));
  EXPECT_EQ(element_size(DType::kBFloat16), 2u);
  EXPECT_EQ(element_size(DType::kInt64), 8u);
  EXPECT_THROW(detail::reduce_function(DType::kFloat16, ReduceOp::kSum), ConfigError);
}

// An average over 256 or more ranks of uint8 data: the world size cast to
// uint8_t divided by 0 (SIGFPE) at 256 and by 44 at 300.
TEST(ReduceTest, AnAverageOfBytesDividesByTheWholeWorldSize) {
  std::vector<uint8_t> bytes{255, 200};
  detail::divide_in_place(bytes.data(), bytes.size(), DType::kUInt8, 256);
  EXPECT_EQ(bytes, (std::vector<uint8_t>{0, 0}));
  std::vector<uint8_t> more{255};
  detail::divide_in_place(more.data(), 1, DType::kUInt8, 100);
  EXPECT_EQ(more[0], 2);
  std::vector<int32_t> ints{-7, 1000};
  detail::divide_in_place(ints.data(), ints.size(), DType::kInt32, 300);
  EXPECT_EQ(ints, (std::vector<int32_t>{0, 3}));
}

TEST(FileKvStoreTest, PutGetWaitEraseAdd) {
  const std::string dir = test::make_temp_dir("kv");
  FileKvStore kv(dir);
  EXPECT_FALSE(kv.get("a/b").has_value());
  kv.put("a/b", std::string("x\0y", 3));
  EXPECT_EQ(*kv.get("a/b"), std::string("x\0y", 3));
  EXPECT_EQ(kv.wait("a/b", 10ms), std::string("x\0y", 3));
  kv.erase("a/b");
  EXPECT_FALSE(kv.get("a/b").has_value());
  auto start = Clock::now();
  try {
    kv.wait("missing", 100ms);
    FAIL() << "wait did not time out";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("missing"), std::string::npos);
  }
  EXPECT_LT(ms_since(start), 2000);
  EXPECT_EQ(kv.add("n", 2), 2);
  EXPECT_EQ(kv.add("n", 3), 5);
  test::remove_dir(dir);
}

TEST(FileKvStoreTest, AddIsAtomicAcrossProcesses) {
  const std::string dir = test::make_temp_dir("kv-add");
  test::RankProcesses procs(4, [&](int) {
    FileKvStore kv(dir);
    for (int i = 0; i < 25; ++i) kv.add("counter", 1);
  });
  for (const auto& e : procs.wait_all(60s)) EXPECT_TRUE(e.exited && e.code == 0) << test::describe(e);
  EXPECT_EQ(*FileKvStore(dir).get("counter"), "100");
  test::remove_dir(dir);
}

TEST(KvGlooStoreTest, PrefixesKeysWithGroupAndGeneration) {
  MemoryKvStore kv;
  KvGlooStore gen1(kv, "grp", 1, 100ms);
  KvGlooStore gen2(kv, "grp", 2, 100ms);
  gen1.set("rank_0", {'a', 'b'});
  EXPECT_EQ(*kv.get("grp/gen1/rank_0"), "ab");
  EXPECT_EQ(gen1.get("rank_0"), (std::vector<char>{'a', 'b'}));
  try {
    gen2.wait({"rank_0"}, 100ms);
    FAIL() << "generation 2 saw generation 1's key";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("grp/gen2/rank_0"), std::string::npos) << e.what();
  }
}

// Forms `world` ranks as threads; returns the groups (nullptr where create
// threw, with the error in `errors`).
std::vector<std::unique_ptr<GlooGroup>> form(KvStore& kv, const std::string& name, int64_t generation,
                                             const std::vector<int>& ranks, int world, GlooGroupOptions opts,
                                             std::vector<std::string>* errors = nullptr) {
  std::vector<std::unique_ptr<GlooGroup>> groups(ranks.size());
  std::vector<std::string> errs(ranks.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < ranks.size(); ++i) {
    threads.emplace_back([&, i] {
      try {
        groups[i] = GlooGroup::create(kv, name, generation, ranks[i], world, opts);
      } catch (const std::exception& e) {
        errs[i] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (errors) *errors = errs;
  return groups;
}

TEST(GlooGroupTest, RendezvousFailsAtItsTimeoutNamingMissingRank) {
  MemoryKvStore kv;
  GlooGroupOptions opts;
  opts.rendezvous_timeout = 500ms;
  std::vector<std::string> errors;
  auto start = Clock::now();
  auto groups = form(kv, "rv", 7, {0, 1}, 3, opts, &errors);
  EXPECT_LT(ms_since(start), 5000);
  for (size_t i = 0; i < groups.size(); ++i) {
    EXPECT_EQ(groups[i], nullptr);
    EXPECT_NE(errors[i].find("'rv'"), std::string::npos) << errors[i];
    EXPECT_NE(errors[i].find("generation 7"), std::string::npos) << errors[i];
    EXPECT_NE(errors[i].find("rank(s) 2 never arrived"), std::string::npos) << errors[i];
  }
}

TEST(GlooGroupTest, RendezvousKeysLeaveTheStoreOnceTheGroupFormsOrFails) {
  MemoryKvStore kv;
  auto groups = form(kv, "tidy", 3, {0, 1, 2}, 3, {});
  ASSERT_TRUE(groups[0] && groups[1] && groups[2]);
  for (int r = 0; r < 3; ++r) {
    EXPECT_FALSE(kv.get("tidy/gen3/member/" + std::to_string(r))) << "member key of rank " << r;
    EXPECT_FALSE(kv.get("tidy/gen3/" + std::to_string(r))) << "mesh key of rank " << r;
  }
  // The formed group still works without them.
  std::vector<std::vector<int32_t>> v = {{1}, {2}, {3}};
  std::vector<WorkPtr> works;
  for (int r = 0; r < 3; ++r) works.push_back(groups[r]->allreduce(v[r].data(), 1, DType::kInt32));
  for (auto& w : works) w->wait(10s);
  EXPECT_EQ(v[2], std::vector<int32_t>{6});

  GlooGroupOptions opts;
  opts.rendezvous_timeout = 200ms;
  EXPECT_THROW(GlooGroup::create(kv, "tidy", 4, 0, 2, opts), Timeout);
  EXPECT_FALSE(kv.get("tidy/gen4/member/0")) << "a failed rendezvous left its member key";
}

TEST(GlooGroupTest, RendezvousTimeoutIsATroupeTimeout) {
  MemoryKvStore kv;
  GlooGroupOptions opts;
  opts.rendezvous_timeout = 200ms;
  EXPECT_THROW(GlooGroup::create(kv, "alone", 1, 0, 2, opts), Timeout);
}

TEST(GlooGroupTest, MembersOfDifferentGenerationsNeverMeet) {
  MemoryKvStore kv;
  GlooGroupOptions opts;
  opts.rendezvous_timeout = 500ms;
  std::vector<std::thread> threads;
  std::atomic<int> timeouts{0};
  for (int gen : {1, 2}) {
    threads.emplace_back([&, gen] {
      try {
        GlooGroup::create(kv, "gens", gen, gen - 1, 2, opts);
      } catch (const Timeout&) {
        ++timeouts;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(timeouts, 2);
}

TEST(GlooGroupTest, WorldSizeOneRunsEveryOpLocally) {
  MemoryKvStore kv;
  auto g = GlooGroup::create(kv, "solo", 1, 0, 1);
  std::vector<float> v = {1, 2, 3};
  AllreduceOptions avg;
  avg.op = ReduceOp::kAvg;
  g->allreduce(v.data(), 3, DType::kFloat32, avg)->wait(5s);
  EXPECT_EQ(v, (std::vector<float>{1, 2, 3}));
  std::vector<float> out(3);
  g->allgather(v.data(), out.data(), 3, DType::kFloat32)->wait(5s);
  EXPECT_EQ(out, v);
  g->broadcast(v.data(), 3, DType::kFloat32, 0)->wait(5s);
  g->barrier()->wait(5s);
  g->allreduce(nullptr, 0, DType::kInt32)->wait(5s);
  EXPECT_THROW(g->send(v.data(), 3, DType::kFloat32, 0), Error);  // to self
}

TEST(GlooGroupTest, TwoThreadRanksAllreduce) {
  MemoryKvStore kv;
  auto groups = form(kv, "pair", 1, {0, 1}, 2, {});
  ASSERT_TRUE(groups[0] && groups[1]);
  std::vector<int32_t> a = {1, 2, 3}, b = {10, 20, 30};
  auto wa = groups[0]->allreduce(a.data(), 3, DType::kInt32);
  auto wb = groups[1]->allreduce(b.data(), 3, DType::kInt32);
  wa->wait(10s);
  wb->wait(10s);
  EXPECT_EQ(a, (std::vector<int32_t>{11, 22, 33}));
  EXPECT_EQ(b, a);
}

TEST(GlooGroupTest, AbortFailsABlockedAllreduceAtOnceAndEveryLaterOp) {
  MemoryKvStore kv;
  // Owns the operation thread the aborted group leaves parked in gloo, as
  // the runtime's group table does; declared first, so it joins that
  // thread (which leaves gloo at the operation timeout) after both groups
  // are gone. The timeout is far above what the test asserts about abort,
  // and short enough that this join does not make the test slow.
  auto stragglers = std::make_shared<core::ThreadSet>();
  GlooGroupOptions opts;
  opts.op_timeout = 15s;
  opts.stragglers = stragglers;
  auto groups = form(kv, "abort", 3, {0, 1}, 2, opts);
  ASSERT_TRUE(groups[0] && groups[1]);
  // Rank 1 never joins the allreduce: rank 0 blocks inside gloo.
  std::vector<float> data(1 << 20, 1.0f);
  auto work = groups[0]->allreduce(data.data(), data.size(), DType::kFloat32);
  EXPECT_FALSE(work->is_completed());
  EXPECT_THROW(work->wait(100ms), Timeout);  // the wait, not the op, timed out
  auto start = Clock::now();
  groups[0]->abort("rank 1 (actor 7) died");
  try {
    work->wait(5s);
    FAIL() << "aborted allreduce succeeded";
  } catch (const Aborted& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 (actor 7) died"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'abort' generation 3"), std::string::npos) << e.what();
  }
  EXPECT_LT(ms_since(start), 2000);
  EXPECT_TRUE(groups[0]->is_aborted());
  EXPECT_THROW(groups[0]->barrier()->wait(1s), Aborted);
  float x = 0;
  EXPECT_THROW(groups[0]->allreduce(&x, 1, DType::kFloat32)->wait(1s), Aborted);

  // The aborted member closed its connections: its peer fails promptly
  // instead of waiting for its 15 s timeout.
  start = Clock::now();
  EXPECT_THROW(groups[1]->allreduce(data.data(), data.size(), DType::kFloat32)->wait(10s), Error);
  EXPECT_LT(ms_since(start), 5000);

  start = Clock::now();
  groups[0].reset();
  groups[1].reset();
  EXPECT_LT(ms_since(start), 3000);
}

TEST(GlooGroupTest, AbortFailsAPendingReceive) {
  MemoryKvStore kv;
  auto groups = form(kv, "p2p", 1, {0, 1}, 2, {});
  ASSERT_TRUE(groups[0] && groups[1]);
  std::vector<int64_t> in(4);
  auto recv = groups[0]->recv(in.data(), 4, DType::kInt64, 1);
  EXPECT_THROW(recv->wait(100ms), Timeout);
  auto start = Clock::now();
  groups[0]->abort("test");
  EXPECT_THROW(recv->wait(5s), Aborted);
  EXPECT_LT(ms_since(start), 2000);
}

TEST(GlooGroupTest, DestroyingWithPendingWorkFailsIt) {
  MemoryKvStore kv;
  auto stragglers = std::make_shared<core::ThreadSet>();  // as above
  GlooGroupOptions opts;
  opts.op_timeout = 10s;
  opts.stragglers = stragglers;
  auto groups = form(kv, "pending", 1, {0, 1}, 2, opts);
  ASSERT_TRUE(groups[0] && groups[1]);
  std::vector<float> data(1024, 1.0f);
  auto work = groups[0]->allreduce(data.data(), data.size(), DType::kFloat32);
  auto start = Clock::now();
  groups[0].reset();
  EXPECT_LT(ms_since(start), 3000);
  EXPECT_THROW(work->wait(1s), Aborted);
}

}  // namespace
}  // namespace troupe::collective
