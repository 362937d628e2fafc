// NcclGroup on a real GPU; skipped where no CUDA device is visible (the
// backend is still compiled and linked wherever CUDA and NCCL are found).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "troupe/runtime/collective/nccl_group.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/kv_store.h"

namespace troupe::collective {
namespace {

using namespace std::chrono_literals;

class NcclGroupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (NcclGroup::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(NcclGroupTest, WorldSizeOneAllreduceAndAbort) {
  MemoryKvStore kv;
  auto g = NcclGroup::create(kv, "nccl", 1, 0, 1);
  std::vector<float> host = {1, 2, 3, 4};
  float* dev = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dev), host.size() * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dev, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  g->allreduce(dev, host.size(), DType::kFloat32)->wait(30s);
  g->barrier()->wait(30s);
  g->allreduce(dev, 0, DType::kFloat32)->wait(30s);
  std::vector<float> back(host.size());
  ASSERT_EQ(cudaMemcpy(back.data(), dev, back.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, host);
  g->abort("rank 1 died");
  try {
    g->allreduce(dev, host.size(), DType::kFloat32)->wait(5s);
    FAIL() << "allreduce after abort succeeded";
  } catch (const Aborted& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 died"), std::string::npos) << e.what();
  }
  g.reset();
  cudaFree(dev);
}

// Device memory of `bytes`, freed with the object.
struct DeviceBuffer {
  explicit DeviceBuffer(size_t bytes) {
    if (cudaMalloc(&ptr, bytes) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* ptr = nullptr;
};

// Every operation on every element type at world size 1: each must leave
// exactly the input's bytes where its result goes (a sum, average, min,
// max or product over one rank is the value itself; a gather or scatter of
// one rank is a copy). The input is bytes 1..n, valid in every type (no
// NaN patterns: small positive bytes in the high half of a 16-bit float are
// ordinary numbers).
TEST_F(NcclGroupTest, EveryOpAndDtypeAtWorldSizeOne) {
  MemoryKvStore kv;
  auto g = NcclGroup::create(kv, "nccl-ops", 1, 0, 1);
  const size_t count = 64;
  for (DType t : {DType::kFloat32, DType::kFloat64, DType::kInt32, DType::kInt64, DType::kBFloat16, DType::kFloat16,
                  DType::kUInt8}) {
    const size_t bytes = count * element_size(t);
    std::vector<uint8_t> host(bytes);
    for (size_t i = 0; i < bytes; ++i) host[i] = static_cast<uint8_t>(1 + i % 61);
    if (t == DType::kFloat32 || t == DType::kFloat64 || t == DType::kBFloat16 || t == DType::kFloat16) {
      // The top byte of each element 0x3f: every element a normal number.
      for (size_t i = element_size(t) - 1; i < bytes; i += element_size(t)) host[i] = 0x3f;
    }
    DeviceBuffer in(bytes), out(bytes);
    ASSERT_TRUE(in.ptr && out.ptr);
    auto load = [&] { ASSERT_EQ(cudaMemcpy(in.ptr, host.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess); };
    auto expect = [&](void* dev, const std::string& what) {
      std::vector<uint8_t> back(bytes);
      ASSERT_EQ(cudaMemcpy(back.data(), dev, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(back, host) << what << " " << to_string(t);
    };
    bool floating = t == DType::kFloat32 || t == DType::kFloat64 || t == DType::kBFloat16 || t == DType::kFloat16;
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProduct}) {
      if (op == ReduceOp::kAvg && !floating) continue;
      load();
      g->allreduce(in.ptr, count, t, {.op = op})->wait(30s);
      expect(in.ptr, std::string("allreduce ") + to_string(op));
      load();
      ASSERT_EQ(cudaMemset(out.ptr, 0, bytes), cudaSuccess);
      g->reduce_scatter(in.ptr, out.ptr, count, t, {.op = op})->wait(30s);
      expect(out.ptr, std::string("reduce_scatter ") + to_string(op));
    }
    load();
    g->broadcast(in.ptr, count, t, 0)->wait(30s);
    expect(in.ptr, "broadcast");
    ASSERT_EQ(cudaMemset(out.ptr, 0, bytes), cudaSuccess);
    g->allgather(in.ptr, out.ptr, count, t)->wait(30s);
    expect(out.ptr, "allgather");
  }
  g->barrier()->wait(30s);
}

// An operation comes after what the caller queued before it on the default
// stream (where LibTorch's kernels and cudaMemset go), though the group's
// own stream is non-blocking: with the default stream held up by a few
// gigabytes of memset, an allgather still copies the input as the last
// memset before it left it, never the bytes before that. (This test's
// neighbour above once read back a zeroed output here: the memset that
// cleared it ran after the operation had written it.)
TEST_F(NcclGroupTest, AnOperationFollowsTheWritesQueuedBeforeItOnTheDefaultStream) {
  MemoryKvStore kv;
  auto g = NcclGroup::create(kv, "nccl-order", 1, 0, 1);
  const size_t big = size_t(1) << 30, bytes = 4096;
  DeviceBuffer slow(big), in(bytes), out(bytes);
  ASSERT_TRUE(slow.ptr && in.ptr && out.ptr);
  for (int trial = 0; trial < 5; ++trial) {
    ASSERT_EQ(cudaMemset(in.ptr, 0, bytes), cudaSuccess);
    ASSERT_EQ(cudaMemset(out.ptr, 0, bytes), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (int i = 0; i < 4; ++i) ASSERT_EQ(cudaMemsetAsync(slow.ptr, i, big, cudaStreamLegacy), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(in.ptr, 7 + trial, bytes, cudaStreamLegacy), cudaSuccess);
    g->allgather(in.ptr, out.ptr, bytes, DType::kUInt8)->wait(30s);
    std::vector<uint8_t> back(bytes);
    ASSERT_EQ(cudaMemcpy(back.data(), out.ptr, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(back, std::vector<uint8_t>(bytes, static_cast<uint8_t>(7 + trial))) << "trial " << trial;
  }
}

// A rank whose rank 0 never publishes the communicator id gives up at the
// rendezvous timeout with a Timeout naming the group, not a hang.
TEST_F(NcclGroupTest, RendezvousWithoutRankZeroTimesOut) {
  MemoryKvStore kv;
  NcclGroupOptions o;
  o.rendezvous_timeout = 300ms;
  try {
    NcclGroup::create(kv, "nccl-lonely", 3, 1, 2, o);
    FAIL() << "rank 1 of 2 joined without rank 0";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("nccl-lonely"), std::string::npos) << e.what();
  }
}

// device_count() is what decides between NCCL and Gloo: it must agree
// with the CUDA runtime (0 where CUDA reports an error, as without a
// driver), on every call.
TEST_F(NcclGroupTest, DeviceCountAgreesWithTheCudaRuntime) {
  int n = -1;
  ASSERT_EQ(cudaGetDeviceCount(&n), cudaSuccess);
  EXPECT_GT(n, 0);
  EXPECT_EQ(NcclGroup::device_count(), n);
}

TEST(NcclGroupNoDeviceTest, DeviceCountAgreesWithTheCudaRuntime) {
  int n = 0;
  const bool cuda_ok = cudaGetDeviceCount(&n) == cudaSuccess;
  EXPECT_EQ(NcclGroup::device_count(), cuda_ok ? n : 0);
  EXPECT_EQ(NcclGroup::device_count(), cuda_ok ? n : 0) << "a second call answers differently";
}

}  // namespace
}  // namespace troupe::collective
