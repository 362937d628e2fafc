// The collective-communication interface of troupe, modelled on c10d's
// Backend/Work: a Group is one member's handle on a fixed set of ranks formed
// for one generation; every operation is asynchronous and returns a Work that
// the caller waits on. Backends (GlooGroup for host memory over TCP,
// NcclGroup for device memory) implement Group. The runtime calls abort() on
// every survivor when a member dies, so no rank stays blocked in a collective.
//
// Memory passed to an operation must stay valid (and, for inputs, unchanged)
// until its Work has completed. After abort() the Work fails at once, but the
// backend may still touch the memory of the operation that was running until
// the group is destroyed; destroy the group before freeing such memory.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace troupe::collective {

// Reductions of allreduce / reduce_scatter. kAvg divides the sum by the world
// size (integer division for integer types).
enum class ReduceOp { kSum, kAvg, kMin, kMax, kProduct };

// Element types. On Gloo (host memory), kBFloat16 and kFloat16 are reduced
// in float32 (each member widens its input to float32, the float32 values
// are reduced and the result is rounded back to 16 bits once), so the sum
// of many ranks does not lose precision at every step and every rank gets
// bit-identical results. NCCL reduces 16-bit types in their own width, as
// its ncclFloat16/ncclBfloat16 do.
enum class DType { kFloat32, kFloat64, kInt32, kInt64, kBFloat16, kFloat16, kUInt8 };

// Bytes per element of dtype.
size_t element_size(DType dtype);
const char* to_string(DType dtype);
const char* to_string(ReduceOp op);

// Used when an options struct leaves timeout at zero: the group's default.
inline constexpr std::chrono::milliseconds kUseGroupTimeout{0};

// Per-operation options. `tag` distinguishes operations that run
// concurrently between the same ranks (only send/recv pairs need it here:
// collectives of one group run in submission order). A zero timeout means
// the group's default operation timeout.
struct AllreduceOptions {
  ReduceOp op = ReduceOp::kSum;
  std::chrono::milliseconds timeout = kUseGroupTimeout;
  uint32_t tag = 0;
};
struct BroadcastOptions {
  std::chrono::milliseconds timeout = kUseGroupTimeout;
  uint32_t tag = 0;
};
struct AllgatherOptions {
  std::chrono::milliseconds timeout = kUseGroupTimeout;
  uint32_t tag = 0;
};
struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::kSum;
  std::chrono::milliseconds timeout = kUseGroupTimeout;
  uint32_t tag = 0;
};
struct BarrierOptions {
  std::chrono::milliseconds timeout = kUseGroupTimeout;
  uint32_t tag = 0;
};
struct SendOptions {
  std::chrono::milliseconds timeout = kUseGroupTimeout;
  uint32_t tag = 0;
};
struct RecvOptions {
  std::chrono::milliseconds timeout = kUseGroupTimeout;
  uint32_t tag = 0;
};

// The pending result of one operation. A resource: not copyable, shared
// between the caller and the backend through std::shared_ptr.
class Work {
 public:
  // How long wait() blocks when not told: long enough for any sane
  // operation; operations have their own timeouts that fire first.
  static constexpr std::chrono::milliseconds kDefaultWaitTimeout{std::chrono::minutes(30)};

  Work() = default;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;
  virtual ~Work() = default;

  // Blocks until the operation completed; rethrows its failure
  // (troupe::Aborted after abort(), troupe::Timeout, troupe::Error). Throws
  // troupe::Timeout when `timeout` passes first (the operation goes on).
  virtual void wait(std::chrono::milliseconds timeout = kDefaultWaitTimeout) = 0;
  // True once the operation has succeeded or failed.
  virtual bool is_completed() = 0;
};

using WorkPtr = std::shared_ptr<Work>;

// One member of a collective group. A resource, owned by one unique_ptr.
// Operations may be issued from one thread at a time; they run in the order
// issued. Every rank must issue the same collectives in the same order with
// the same counts and dtypes.
class Group {
 public:
  Group() = default;
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;
  virtual ~Group() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual const std::string& name() const = 0;
  virtual int64_t generation() const = 0;

  // In place: every rank's `data` (count elements) becomes the reduction.
  virtual WorkPtr allreduce(void* data, size_t count, DType dtype, const AllreduceOptions& opts = {}) = 0;
  // In place: every rank's `data` becomes root's.
  virtual WorkPtr broadcast(void* data, size_t count, DType dtype, int root, const BroadcastOptions& opts = {}) = 0;
  // `out` (count * world_size elements) receives every rank's `in` (count
  // elements), in rank order.
  virtual WorkPtr allgather(const void* in, void* out, size_t count, DType dtype,
                            const AllgatherOptions& opts = {}) = 0;
  // `in` holds count_per_rank * world_size elements; rank r's `out`
  // (count_per_rank elements) receives the reduction of block r.
  virtual WorkPtr reduce_scatter(const void* in, void* out, size_t count_per_rank, DType dtype,
                                 const ReduceScatterOptions& opts = {}) = 0;
  virtual WorkPtr barrier(const BarrierOptions& opts = {}) = 0;
  // Point to point; a send matches the recv of the same tag on the peer, in
  // order. Sends and receives do not wait for each other, so two ranks may
  // both send first.
  virtual WorkPtr send(const void* data, size_t count, DType dtype, int dst, const SendOptions& opts = {}) = 0;
  virtual WorkPtr recv(void* data, size_t count, DType dtype, int src, const RecvOptions& opts = {}) = 0;

  // Fails every pending and future operation at once with troupe::Aborted
  // whose message includes `reason`, and tears the connections down so that
  // peers blocked on this member fail too. Idempotent, thread-safe, callable
  // from any thread (the runtime calls it from its control thread).
  virtual void abort(const std::string& reason) = 0;
  virtual bool is_aborted() const = 0;

  // The group that moves the data: this one, or the one a wrapper forwards
  // to (join_group's), for callers that ask which backend it is (host or
  // device memory).
  virtual Group& backend() { return *this; }
};

}  // namespace troupe::collective
