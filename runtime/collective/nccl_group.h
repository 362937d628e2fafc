// NcclGroup: the device-memory collective backend, on NCCL. Built only when
// troupe is configured with NCCL (TROUPE_WITH_NCCL); this header declares
// nothing otherwise. The NCCL unique id travels through the KvStore under
// "<name>/gen<generation>/", like Gloo's addresses, so generations never
// mix. Operations are enqueued on the group's own CUDA stream, after the
// work queued before them on the device's default stream (LibTorch's, and
// cudaMemcpy's and cudaMemset's): an operation sees what the caller wrote
// there. Their Work completes when the stream passes the operation. The
// communicator is created non-blocking, so abort() (ncclCommAbort) can
// tear down a communicator whose kernels wait on a dead peer. CUDA types stay out of
// this header: stream() returns the cudaStream_t as void*.
#pragma once

#include "troupe/config.h"

#if TROUPE_WITH_NCCL

#include <chrono>
#include <memory>
#include <string>

#include "troupe/runtime/collective/group.h"
#include "troupe/runtime/core/kv_store.h"

namespace troupe::collective {

struct NcclGroupOptions {
  // CUDA device the communicator lives on; -1 = the calling thread's current.
  int device = -1;
  std::chrono::milliseconds rendezvous_timeout{std::chrono::seconds(120)};
  std::chrono::milliseconds op_timeout{std::chrono::seconds(300)};
};

class NcclGroup final : public Group {
 public:
  // Rank 0 creates the unique id and publishes it; all ranks then init the
  // communicator. Throws troupe::Timeout naming group, generation and what
  // was missing; troupe::Error for CUDA/NCCL failures.
  static std::unique_ptr<NcclGroup> create(KvStore& kv, const std::string& name, int64_t generation, int rank,
                                           int world_size, const NcclGroupOptions& options = {});
  ~NcclGroup() override;

  // The number of CUDA devices visible to this process (0 when the driver
  // or devices are missing: tests skip on that).
  static int device_count();

  int rank() const override;
  int world_size() const override;
  const std::string& name() const override;
  int64_t generation() const override;
  // The cudaStream_t all operations run on.
  void* stream() const;

  // Pointers are device pointers. bfloat16/float16 are reduced by NCCL
  // natively (NCCL's own accumulation).
  WorkPtr allreduce(void* data, size_t count, DType dtype, const AllreduceOptions& opts = {}) override;
  WorkPtr broadcast(void* data, size_t count, DType dtype, int root, const BroadcastOptions& opts = {}) override;
  WorkPtr allgather(const void* in, void* out, size_t count, DType dtype, const AllgatherOptions& opts = {}) override;
  WorkPtr reduce_scatter(const void* in, void* out, size_t count_per_rank, DType dtype,
                         const ReduceScatterOptions& opts = {}) override;
  WorkPtr barrier(const BarrierOptions& opts = {}) override;
  // NCCL point-to-point calls block the stream until the peer matches them:
  // two ranks must not both send first.
  WorkPtr send(const void* data, size_t count, DType dtype, int dst, const SendOptions& opts = {}) override;
  WorkPtr recv(void* data, size_t count, DType dtype, int src, const RecvOptions& opts = {}) override;

  void abort(const std::string& reason) override;
  bool is_aborted() const override;

  struct Shared;

 private:
  explicit NcclGroup(std::shared_ptr<Shared> shared);

  std::shared_ptr<Shared> shared_;
};

}  // namespace troupe::collective

#endif  // TROUPE_WITH_NCCL
