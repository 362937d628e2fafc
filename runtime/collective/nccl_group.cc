#include "troupe/runtime/collective/nccl_group.h"

#if TROUPE_WITH_NCCL

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "troupe/runtime/collective/kv_gloo_store.h"
#include "troupe/runtime/core/check.h"
#include "troupe/runtime/core/errors.h"

// Every CUDA and NCCL call goes through these: they throw troupe::Error
// naming file:line, the call and the library's error string.
#define TROUPE_CUDA_CHECK(expr)                                                                        \
  do {                                                                                                 \
    cudaError_t troupe_cuda_err_ = (expr);                                                             \
    if (troupe_cuda_err_ != cudaSuccess) {                                                             \
      throw ::troupe::Error(std::string(__FILE__) + ":" + std::to_string(__LINE__) + ": " #expr ": " + \
                            cudaGetErrorString(troupe_cuda_err_));                                     \
    }                                                                                                  \
  } while (0)

// ncclInProgress is success for a non-blocking communicator: the call was
// accepted and completes asynchronously (see wait_ready()).
#define TROUPE_NCCL_CHECK(expr)                                                                             \
  do {                                                                                                      \
    ncclResult_t troupe_nccl_res_ = (expr);                                                                 \
    if (troupe_nccl_res_ != ncclSuccess && troupe_nccl_res_ != ncclInProgress) {                            \
      throw ::troupe::Error(std::string(__FILE__) + ":" + std::to_string(__LINE__) + ": " #expr ": " +      \
                            ncclGetErrorString(troupe_nccl_res_) + " (" + ncclGetLastError(nullptr) + ")"); \
    }                                                                                                       \
  } while (0)

namespace troupe::collective {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

ncclDataType_t to_nccl(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kFloat64:
      return ncclFloat64;
    case DType::kInt32:
      return ncclInt32;
    case DType::kInt64:
      return ncclInt64;
    case DType::kBFloat16:
      return ncclBfloat16;
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kUInt8:
      return ncclUint8;
  }
  throw ConfigError("unknown dtype");
}

ncclRedOp_t to_nccl(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kProduct:
      return ncclProd;
  }
  throw ConfigError("unknown reduce op");
}

}  // namespace

struct NcclGroup::Shared {
  std::string name;
  int64_t generation = 0;
  int rank = 0;
  int size = 0;
  int device = 0;
  NcclGroupOptions options;
  // comm_mu guards comm against ncclCommAbort racing a query or enqueue.
  mutable std::mutex comm_mu;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  // Recorded on the legacy default stream before each operation, which
  // `stream` then waits for (see enqueue()).
  cudaEvent_t follow = nullptr;
  int* barrier_scratch = nullptr;  // one device int for barrier()
  bool aborted = false;
  // Set by abort() before it takes comm_mu: a wait_ready() holding the
  // lock (NCCL answering "in progress" while it connects to a peer that
  // died) gives up at once, so that the abort can run (it waited out the
  // op timeout, 300 s, spinning).
  std::atomic<bool> abort_asked{false};
  std::string abort_reason;
  std::exception_ptr broken;

  std::string describe() const {
    return "nccl group '" + name + "' generation " + std::to_string(generation) + " (rank " + std::to_string(rank) +
           " of " + std::to_string(size) + ")";
  }

  std::exception_ptr abort_error() const {
    return std::make_exception_ptr(Aborted(describe() + " aborted: " + abort_reason));
  }

  // For a non-blocking communicator, calls return ncclInProgress while NCCL
  // finishes them in the background; poll until done, failed, or deadline.
  // Caller holds comm_mu.
  void wait_ready(Clock::time_point deadline, const char* what) {
    for (;;) {
      ncclResult_t state = ncclSuccess;
      TROUPE_NCCL_CHECK(ncclCommGetAsyncError(comm, &state));
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        throw Error(describe() + ": " + what + ": " + ncclGetErrorString(state) + " (" + ncclGetLastError(comm) + ")");
      }
      if (abort_asked.load()) throw Aborted(describe() + ": " + what + " was aborted while it waited for NCCL");
      if (Clock::now() > deadline) throw Timeout(describe() + ": " + what + " did not finish in time");
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  void abort(const std::string& reason) {
    abort_asked.store(true);
    std::lock_guard lock(comm_mu);
    if (aborted) return;
    aborted = true;
    abort_reason = reason;
    broken = abort_error();
    if (comm != nullptr) {
      // Tears down the communicator even while its kernels wait on a dead
      // peer; errors here have nowhere useful to go.
      ncclCommAbort(comm);
      comm = nullptr;
    }
  }
};

namespace {

// Completes when the stream passes the event recorded after the operation.
class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclGroup::Shared> group, std::string description, milliseconds op_timeout)
      : group_(std::move(group)), description_(std::move(description)), op_deadline_(Clock::now() + op_timeout) {}
  ~NcclWork() override {
    if (event_ != nullptr) cudaEventDestroy(event_);  // nothing to report from a destructor
  }

  // After the NCCL call has been enqueued (caller holds comm_mu).
  void record() {
    TROUPE_CUDA_CHECK(cudaSetDevice(group_->device));
    TROUPE_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    TROUPE_CUDA_CHECK(cudaEventRecord(event_, group_->stream));
  }
  void mark_done() { done_ = true; }
  void mark_failed(std::exception_ptr error) { error_ = std::move(error); }

  void wait(milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      if (poll()) {
        if (error_) std::rethrow_exception(error_);
        return;
      }
      if (Clock::now() > op_deadline_) {
        // The collective itself overran: the communicator cannot be trusted.
        group_->abort(description_ + " timed out");
        error_ = std::make_exception_ptr(Timeout(description_ + " timed out"));
        std::rethrow_exception(error_);
      }
      if (Clock::now() > deadline) {
        throw Timeout("wait for " + description_ + " timed out after " + std::to_string(timeout.count()) + " ms");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  bool is_completed() override { return poll(); }

 private:
  // True once finished (successfully or with error_ set).
  bool poll() {
    if (done_ || error_) return true;
    std::lock_guard lock(group_->comm_mu);
    if (group_->aborted) {
      error_ = group_->abort_error();
      return true;
    }
    cudaError_t q = cudaEventQuery(event_);
    if (q == cudaSuccess) {
      done_ = true;
      return true;
    }
    if (q != cudaErrorNotReady) {
      error_ = std::make_exception_ptr(Error(description_ + ": cuda: " + cudaGetErrorString(q)));
      return true;
    }
    ncclResult_t state = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(group_->comm, &state);
    if (r != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
      error_ = std::make_exception_ptr(Error(description_ +
                                             " failed: nccl: " + ncclGetErrorString(r != ncclSuccess ? r : state) +
                                             " (" + ncclGetLastError(group_->comm) + ")"));
      return true;
    }
    return false;
  }

  std::shared_ptr<NcclGroup::Shared> group_;
  const std::string description_;
  const Clock::time_point op_deadline_;
  cudaEvent_t event_ = nullptr;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace

int NcclGroup::device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

NcclGroup::NcclGroup(std::shared_ptr<Shared> shared) : shared_(std::move(shared)) {}

std::unique_ptr<NcclGroup> NcclGroup::create(KvStore& kv, const std::string& name, int64_t generation, int rank,
                                             int world_size, const NcclGroupOptions& options) {
  TROUPE_CHECK(world_size >= 1) << "world_size " << world_size;
  TROUPE_CHECK(rank >= 0 && rank < world_size) << "rank " << rank << " of " << world_size;
  auto s = std::make_shared<Shared>();
  s->name = name;
  s->generation = generation;
  s->rank = rank;
  s->size = world_size;
  s->options = options;
  if (options.device >= 0) {
    s->device = options.device;
  } else {
    TROUPE_CUDA_CHECK(cudaGetDevice(&s->device));
  }
  TROUPE_CUDA_CHECK(cudaSetDevice(s->device));
  const auto deadline = Clock::now() + options.rendezvous_timeout;
  const std::string id_key = KvGlooStore::key_prefix(name, generation) + "nccl_unique_id";

  ncclUniqueId id;
  if (rank == 0) {
    TROUPE_NCCL_CHECK(ncclGetUniqueId(&id));
    kv.put(id_key, std::string(reinterpret_cast<const char*>(&id), sizeof id));
  } else {
    std::string bytes;
    try {
      bytes = kv.wait(id_key, options.rendezvous_timeout);
    } catch (const Timeout&) {
      throw Timeout("rendezvous of " + s->describe() + " timed out after " +
                    std::to_string(options.rendezvous_timeout.count()) + " ms: rank 0 never published '" + id_key +
                    "'");
    }
    TROUPE_CHECK(bytes.size() == sizeof id) << "malformed NCCL unique id under " << id_key;
    std::memcpy(&id, bytes.data(), sizeof id);
  }

  TROUPE_CUDA_CHECK(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking));
  TROUPE_CUDA_CHECK(cudaEventCreateWithFlags(&s->follow, cudaEventDisableTiming));
  TROUPE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&s->barrier_scratch), sizeof(int)));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // lets ncclCommAbort interrupt a stuck communicator
  // Once rank 0's communicator is ready every rank has joined with the id:
  // rank 0 erases it (also when the init fails), so the head's KV store
  // does not grow with every group a long job forms.
  auto erase_id = [&] {
    if (rank != 0) return;
    try {
      kv.erase(id_key);
    } catch (const std::exception&) {
      // Best effort: a head that is away keeps the key.
    }
  };
  {
    std::lock_guard lock(s->comm_mu);
    TROUPE_NCCL_CHECK(ncclCommInitRankConfig(&s->comm, world_size, id, rank, &config));
    try {
      s->wait_ready(deadline, "ncclCommInitRankConfig");
    } catch (...) {
      ncclCommAbort(s->comm);
      s->comm = nullptr;
      erase_id();
      throw;
    }
  }
  erase_id();
  return std::unique_ptr<NcclGroup>(new NcclGroup(std::move(s)));
}

NcclGroup::~NcclGroup() {
  // Destructors report nothing; release what exists.
  std::lock_guard lock(shared_->comm_mu);
  if (shared_->comm != nullptr) {
    cudaSetDevice(shared_->device);
    cudaStreamSynchronize(shared_->stream);
    ncclCommDestroy(shared_->comm);
    shared_->comm = nullptr;
  }
  if (shared_->barrier_scratch != nullptr) cudaFree(shared_->barrier_scratch);
  if (shared_->stream != nullptr) cudaStreamDestroy(shared_->stream);
  if (shared_->follow != nullptr) cudaEventDestroy(shared_->follow);
}

int NcclGroup::rank() const { return shared_->rank; }
int NcclGroup::world_size() const { return shared_->size; }
const std::string& NcclGroup::name() const { return shared_->name; }
int64_t NcclGroup::generation() const { return shared_->generation; }
void* NcclGroup::stream() const { return shared_->stream; }

bool NcclGroup::is_aborted() const {
  std::lock_guard lock(shared_->comm_mu);
  return shared_->aborted;
}

void NcclGroup::abort(const std::string& reason) { shared_->abort(reason); }

namespace {

// Enqueues `call` under comm_mu and returns its Work; an aborted group fails
// the work at once.
template <class Call>
WorkPtr enqueue(const std::shared_ptr<NcclGroup::Shared>& s, const std::string& what, milliseconds timeout, bool skip,
                Call&& call) {
  auto work = std::make_shared<NcclWork>(s, what + " of " + s->describe(),
                                         timeout.count() > 0 ? timeout : s->options.op_timeout);
  std::lock_guard lock(s->comm_mu);
  if (s->broken) {
    work->mark_failed(s->broken);
    return work;
  }
  if (skip) {
    work->mark_done();
    return work;
  }
  TROUPE_CUDA_CHECK(cudaSetDevice(s->device));
  // The group's stream does not synchronise with the default stream (it is
  // non-blocking), where LibTorch's kernels and cudaMemcpy/cudaMemset queue
  // the caller's writes: wait for what is queued there so far, or the
  // operation may read its input, or write its output, before them.
  TROUPE_CUDA_CHECK(cudaEventRecord(s->follow, cudaStreamLegacy));
  TROUPE_CUDA_CHECK(cudaStreamWaitEvent(s->stream, s->follow, 0));
  call(s->comm, s->stream);
  s->wait_ready(Clock::now() + s->options.op_timeout, what.c_str());
  work->record();
  return work;
}

}  // namespace

WorkPtr NcclGroup::allreduce(void* data, size_t count, DType dtype, const AllreduceOptions& opts) {
  return enqueue(shared_, "allreduce", opts.timeout, count == 0, [&](ncclComm_t comm, cudaStream_t stream) {
    TROUPE_NCCL_CHECK(ncclAllReduce(data, data, count, to_nccl(dtype), to_nccl(opts.op), comm, stream));
  });
}

WorkPtr NcclGroup::broadcast(void* data, size_t count, DType dtype, int root, const BroadcastOptions& opts) {
  TROUPE_CHECK(root >= 0 && root < shared_->size) << "broadcast root " << root;
  return enqueue(shared_, "broadcast", opts.timeout, count == 0, [&](ncclComm_t comm, cudaStream_t stream) {
    TROUPE_NCCL_CHECK(ncclBroadcast(data, data, count, to_nccl(dtype), root, comm, stream));
  });
}

WorkPtr NcclGroup::allgather(const void* in, void* out, size_t count, DType dtype, const AllgatherOptions& opts) {
  return enqueue(shared_, "allgather", opts.timeout, count == 0, [&](ncclComm_t comm, cudaStream_t stream) {
    TROUPE_NCCL_CHECK(ncclAllGather(in, out, count, to_nccl(dtype), comm, stream));
  });
}

WorkPtr NcclGroup::reduce_scatter(const void* in, void* out, size_t count_per_rank, DType dtype,
                                  const ReduceScatterOptions& opts) {
  return enqueue(
      shared_, "reduce_scatter", opts.timeout, count_per_rank == 0, [&](ncclComm_t comm, cudaStream_t stream) {
        TROUPE_NCCL_CHECK(ncclReduceScatter(in, out, count_per_rank, to_nccl(dtype), to_nccl(opts.op), comm, stream));
      });
}

WorkPtr NcclGroup::barrier(const BarrierOptions& opts) {
  // NCCL has no barrier: a one-element allreduce is one.
  int* scratch = shared_->barrier_scratch;
  return enqueue(shared_, "barrier", opts.timeout, false, [&](ncclComm_t comm, cudaStream_t stream) {
    TROUPE_NCCL_CHECK(ncclAllReduce(scratch, scratch, 1, ncclInt32, ncclSum, comm, stream));
  });
}

WorkPtr NcclGroup::send(const void* data, size_t count, DType dtype, int dst, const SendOptions& opts) {
  TROUPE_CHECK(dst >= 0 && dst < shared_->size && dst != shared_->rank) << "send to rank " << dst;
  return enqueue(shared_, "send to rank " + std::to_string(dst), opts.timeout, count == 0,
                 [&](ncclComm_t comm, cudaStream_t stream) {
                   TROUPE_NCCL_CHECK(ncclSend(data, count, to_nccl(dtype), dst, comm, stream));
                 });
}

WorkPtr NcclGroup::recv(void* data, size_t count, DType dtype, int src, const RecvOptions& opts) {
  TROUPE_CHECK(src >= 0 && src < shared_->size && src != shared_->rank) << "recv from rank " << src;
  return enqueue(shared_, "recv from rank " + std::to_string(src), opts.timeout, count == 0,
                 [&](ncclComm_t comm, cudaStream_t stream) {
                   TROUPE_NCCL_CHECK(ncclRecv(data, count, to_nccl(dtype), src, comm, stream));
                 });
}

}  // namespace troupe::collective

#endif  // TROUPE_WITH_NCCL
