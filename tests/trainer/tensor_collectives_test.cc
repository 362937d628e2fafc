// Unit tests of the torch-aware collective layer: what it refuses (dtype,
// contiguity, device, sizes) with a world-size-1 GlooGroup, and real data
// movement between two GlooGroup members in one process (two threads, a
// MemoryKvStore for the rendezvous).
#include <gtest/gtest.h>

#include <future>
#include <string>
#include <thread>

#include <torch/torch.h>

#include "tests/support/wait.h"
#include "troupe/runtime/collective/gloo_group.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/kv_store.h"
#include "troupe/trainer/tensor_collectives.h"

namespace troupe::trainer {
namespace {

using namespace std::chrono_literals;
using collective::GlooGroup;
using collective::ReduceOp;
using troupe::test::kWaitBound;

std::unique_ptr<GlooGroup> single(KvStore& kv, const std::string& name) {
  collective::GlooGroupOptions opts;
  opts.rendezvous_timeout = 10s;
  opts.op_timeout = 10s;
  return GlooGroup::create(kv, name, 1, 0, 1, opts);
}

// The message of the ConfigError that f throws ("" when it throws none).
template <class F>
std::string config_error(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(TensorCollectivesTest, MapsEverySupportedDtypeAndNamesTheOthers) {
  EXPECT_EQ(collective_dtype(torch::kFloat32), collective::DType::kFloat32);
  EXPECT_EQ(collective_dtype(torch::kFloat64), collective::DType::kFloat64);
  EXPECT_EQ(collective_dtype(torch::kInt32), collective::DType::kInt32);
  EXPECT_EQ(collective_dtype(torch::kInt64), collective::DType::kInt64);
  EXPECT_EQ(collective_dtype(torch::kBFloat16), collective::DType::kBFloat16);
  EXPECT_EQ(collective_dtype(torch::kFloat16), collective::DType::kFloat16);
  EXPECT_EQ(collective_dtype(torch::kUInt8), collective::DType::kUInt8);

  MemoryKvStore kv;
  auto g = single(kv, "dtypes");
  for (auto [dtype, name] : {std::pair{torch::kBool, "Bool"}, std::pair{torch::kInt16, "Short"},
                             std::pair{torch::kInt8, "Char"}, std::pair{torch::kComplexFloat, "ComplexFloat"}}) {
    auto t = torch::zeros({4}, torch::TensorOptions().dtype(dtype));
    std::string msg = config_error([&] { allreduce(*g, t); });
    EXPECT_NE(msg.find("allreduce"), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::string("dtype ") + name), std::string::npos) << msg;
  }
}

TEST(TensorCollectivesTest, RefusesNonContiguousUndefinedAndMismatchedTensors) {
  MemoryKvStore kv;
  auto g = single(kv, "checks");
  auto m = torch::ones({3, 4});
  std::string msg = config_error([&] { allreduce(*g, m.t()); });
  EXPECT_NE(msg.find("not contiguous"), std::string::npos) << msg;
  msg = config_error([&] { broadcast(*g, torch::Tensor(), 0); });
  EXPECT_NE(msg.find("undefined"), std::string::npos) << msg;

  auto in = torch::ones({5});
  msg = config_error([&] { allgather(*g, in, torch::zeros({4})); });
  EXPECT_NE(msg.find("output has 4 elements, expected 5 x world size 1"), std::string::npos) << msg;
  msg = config_error([&] { allgather(*g, in, torch::zeros({5}, torch::kFloat64)); });
  EXPECT_NE(msg.find("dtype"), std::string::npos) << msg;
  msg = config_error([&] { reduce_scatter(*g, torch::ones({6}), torch::zeros({5})); });
  EXPECT_NE(msg.find("input has 6 elements"), std::string::npos) << msg;

  DeviceGroups groups{.cpu = nullptr, .cuda = nullptr};
  msg = config_error([&] { groups.for_tensor(in); });
  EXPECT_NE(msg.find("needs a gloo group"), std::string::npos) << msg;
}

TEST(TensorCollectivesTest, CudaTensorOnAGlooGroupIsRefused) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device for torch";
  MemoryKvStore kv;
  auto g = single(kv, "device");
  auto t = torch::ones({8}, torch::kCUDA);
  std::string msg = config_error([&] { allreduce(*g, t); });
  EXPECT_NE(msg.find("is on cuda"), std::string::npos) << msg;
  EXPECT_NE(msg.find("gloo group 'device'"), std::string::npos) << msg;
}

TEST(TensorCollectivesTest, WorldSizeOneLeavesDataInPlace) {
  MemoryKvStore kv;
  auto g = single(kv, "one");
  auto t = torch::arange(10, torch::kFloat32);
  allreduce(*g, t, {.op = ReduceOp::kAvg})->wait(kWaitBound);
  EXPECT_TRUE(torch::equal(t, torch::arange(10, torch::kFloat32)));
  auto out = torch::zeros({2, 5}, torch::kInt64);
  allgather(*g, torch::arange(10, torch::kInt64), out)->wait(kWaitBound);
  EXPECT_TRUE(torch::equal(out.flatten(), torch::arange(10, torch::kInt64)));
  auto part = torch::zeros({10}, torch::kFloat64);
  reduce_scatter(*g, torch::ones({10}, torch::kFloat64), part)->wait(kWaitBound);
  EXPECT_TRUE(torch::equal(part, torch::ones({10}, torch::kFloat64)));
  DeviceGroups groups{.cpu = std::move(g)};
  EXPECT_EQ(&groups.for_tensor(t), groups.cpu.get());
}

// Two members in one process: every tensor operation moves real data.
TEST(TensorCollectivesTest, TwoMembersMoveTensors) {
  MemoryKvStore kv;
  auto member = [&kv](int rank) {
    collective::GlooGroupOptions opts;
    opts.rendezvous_timeout = 20s;
    opts.op_timeout = 20s;
    auto g = GlooGroup::create(kv, "pair", 1, rank, 2, opts);

    auto sum = torch::full({1000}, rank + 1.0, torch::kFloat32);
    allreduce(*g, sum)->wait(kWaitBound);
    EXPECT_TRUE(torch::allclose(sum, torch::full({1000}, 3.0, torch::kFloat32)));

    auto half = torch::full({7}, rank + 1.0, torch::kBFloat16);
    allreduce(*g, half, {.op = ReduceOp::kMax})->wait(kWaitBound);
    EXPECT_TRUE(torch::equal(half, torch::full({7}, 2.0, torch::kBFloat16)));

    auto b = torch::full({3, 3}, static_cast<int64_t>(rank * 10), torch::kInt64);
    broadcast(*g, b, 1)->wait(kWaitBound);
    EXPECT_TRUE(torch::equal(b, torch::full({3, 3}, int64_t{10}, torch::kInt64)));

    auto gathered = torch::empty({2, 4}, torch::kInt32);
    allgather(*g, torch::full({4}, rank, torch::kInt32), gathered)->wait(kWaitBound);
    EXPECT_TRUE(torch::equal(gathered[0], torch::zeros({4}, torch::kInt32)));
    EXPECT_TRUE(torch::equal(gathered[1], torch::ones({4}, torch::kInt32)));

    auto part = torch::empty({3}, torch::kFloat64);
    reduce_scatter(*g, torch::arange(6, torch::kFloat64), part)->wait(kWaitBound);
    EXPECT_TRUE(torch::equal(part, torch::arange(6, torch::kFloat64).slice(0, rank * 3, rank * 3 + 3) * 2));

    auto mine = torch::full({5}, rank + 100.0, torch::kFloat16);
    auto theirs = torch::empty({5}, torch::kFloat16);
    auto sent = send(*g, mine, 1 - rank);
    auto got = recv(*g, theirs, 1 - rank);
    sent->wait(kWaitBound);
    got->wait(kWaitBound);
    EXPECT_TRUE(torch::equal(theirs, torch::full({5}, (1 - rank) + 100.0, torch::kFloat16)));
  };
  auto other = std::async(std::launch::async, member, 1);
  member(0);
  other.get();
}

}  // namespace
}  // namespace troupe::trainer
