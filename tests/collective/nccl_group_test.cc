// NcclGroup on a real GPU; skipped where no CUDA device is visible (the
// backend is still compiled and linked wherever CUDA and NCCL are found).
#include <gtest/gtest.h>

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
