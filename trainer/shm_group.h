// ShmGroup: a collective::Group for ranks that share one host, whose
// float32 sum-allreduce runs through shared memory instead of TCP. Every
// rank maps one /dev/shm segment holding an arena per rank; allocate()
// carves tensors-to-be (gradient buckets) out of this rank's arena at the
// same offset on every rank. An allreduce of such memory is a reduce-scatter
// and all-gather in place: after a barrier, rank r sums chunk r of every
// rank's copy (in rank order, so all ranks end bitwise equal) and writes
// the sum into chunk r of every copy; a second barrier ends it. No byte
// crosses a socket and nothing is copied in or out. Everything else (other
// dtypes and ops, memory outside the arena, broadcast, barrier, ...) goes
// to the wrapped group (Gloo).
//
// A rank waiting at a barrier spins for up to 200 µs (when there are at
// least as many CPUs as ranks), then sleeps on a futex; waits are bounded by
// the operation timeout; abort() marks the segment so every rank's wait
// fails at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "troupe/runtime/collective/group.h"

namespace troupe::trainer {

class ShmGroup final : public collective::Group {
 public:
  // Collective over `inner`: rank 0 creates the segment, the others map it
  // after a barrier. `arena_bytes` per rank. On success the ShmGroup takes
  // `inner` over (it is left null); when shared memory is not available it
  // throws troupe::Error and `inner` stays with the caller, usable as it was.
  static std::unique_ptr<ShmGroup> create(std::unique_ptr<collective::Group>& inner, size_t arena_bytes,
                                          std::chrono::milliseconds timeout);
  ~ShmGroup() override;

  // `bytes` of this rank's arena (64-byte aligned); every rank must make
  // the same sequence of calls. nullptr when the arena is full.
  void* allocate(size_t bytes);

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  const std::string& name() const override { return inner_->name(); }
  int64_t generation() const override { return inner_->generation(); }
  collective::WorkPtr allreduce(void* data, size_t count, collective::DType dtype,
                                const collective::AllreduceOptions& opts = {}) override;
  collective::WorkPtr broadcast(void* data, size_t count, collective::DType dtype, int root,
                                const collective::BroadcastOptions& opts = {}) override {
    return inner_->broadcast(data, count, dtype, root, opts);
  }
  collective::WorkPtr allgather(const void* in, void* out, size_t count, collective::DType dtype,
                                const collective::AllgatherOptions& opts = {}) override {
    return inner_->allgather(in, out, count, dtype, opts);
  }
  collective::WorkPtr reduce_scatter(const void* in, void* out, size_t count_per_rank, collective::DType dtype,
                                     const collective::ReduceScatterOptions& opts = {}) override {
    return inner_->reduce_scatter(in, out, count_per_rank, dtype, opts);
  }
  collective::WorkPtr barrier(const collective::BarrierOptions& opts = {}) override { return inner_->barrier(opts); }
  collective::WorkPtr send(const void* data, size_t count, collective::DType dtype, int dst,
                           const collective::SendOptions& opts = {}) override {
    return inner_->send(data, count, dtype, dst, opts);
  }
  collective::WorkPtr recv(void* data, size_t count, collective::DType dtype, int src,
                           const collective::RecvOptions& opts = {}) override {
    return inner_->recv(data, count, dtype, src, opts);
  }
  void abort(const std::string& reason) override;
  bool is_aborted() const override;

  // Allreduces served through shared memory (for tests and benchmarks).
  int64_t shm_allreduces() const { return shm_ops_; }

 private:
  struct Header;
  // "shared-memory allreduce of NAME aborted: <the first abort's reason>".
  std::string aborted_text() const;
  // Marks the segment aborted for every rank, then throws Aborted.
  [[noreturn]] void throw_aborted();
  ShmGroup(std::unique_ptr<collective::Group> inner, void* base, size_t total, size_t arena,
           std::chrono::milliseconds timeout);
  void wait_barrier(std::chrono::milliseconds timeout);
  std::byte* arena(int r) const;

  std::unique_ptr<collective::Group> inner_;
  void* base_;
  size_t total_;
  size_t arena_bytes_;
  size_t used_ = 0;
  uint32_t barriers_ = 0;  // barriers this rank has passed
  std::chrono::milliseconds timeout_;
  // How long a barrier spins before it sleeps (spin_budget).
  std::chrono::microseconds spin_for_;
  int64_t shm_ops_ = 0;
};

}  // namespace troupe::trainer
