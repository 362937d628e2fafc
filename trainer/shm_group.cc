#include "troupe/trainer/shm_group.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <utility>

#include "troupe/runtime/core/check.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/process.h"
#include "troupe/runtime/core/random_id.h"

namespace troupe::trainer {

namespace {

constexpr size_t kHeaderBytes = 4096;
constexpr size_t kAlign = 64;

class DoneWork final : public collective::Work {
 public:
  void wait(std::chrono::milliseconds) override {}
  bool is_completed() override { return true; }
};

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// How long a barrier spins before it sleeps. Spinning pays only while every
// rank has a CPU of its own; with more ranks than CPUs a spinning rank holds
// the CPU the late one needs.
std::chrono::microseconds spin_budget(int world_size) {
  // Affinity and the cgroup's quota, whichever is lower.
  const int cpus = core::cpu_limit();
  return cpus >= world_size ? std::chrono::microseconds(200) : std::chrono::microseconds(0);
}

long futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* ts) {
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, ts, nullptr, 0);
}

}  // namespace

// Lives at the start of the segment; lock-free atomics work across
// processes that map the same memory.
struct ShmGroup::Header {
  std::atomic<uint32_t> arrived;  // barrier arrivals, ever
  std::atomic<uint32_t> aborted;
  std::atomic<uint32_t> sleepers;  // ranks in FUTEX_WAIT on `arrived`
  // Why the first abort came (a rank's error), for every rank's message.
  std::atomic<uint32_t> reason_claimed;
  std::atomic<uint32_t> reason_ready;
  char reason[1024];
};

static_assert(std::atomic<uint32_t>::is_always_lock_free);

namespace {

// What a create made so far, undone when it does not get as far as the
// group: a collective in it that throws (a peer died, the group was
// aborted while it formed) left the segment in /dev/shm until reboot and
// its mapping in the process.
struct PendingSegment {
  std::string name;
  bool unlink = false;  // rank 0, which created it
  int fd = -1;
  void* base = MAP_FAILED;
  size_t total = 0;
  ~PendingSegment() {
    if (fd >= 0) ::close(fd);
    if (base != MAP_FAILED) ::munmap(base, total);
    if (unlink) ::shm_unlink(name.c_str());
  }
};

}  // namespace

std::unique_ptr<ShmGroup> ShmGroup::create(std::unique_ptr<collective::Group>& inner, size_t arena_bytes,
                                           std::chrono::milliseconds timeout) {
  TROUPE_CHECK(inner);
  arena_bytes = (arena_bytes + kAlign - 1) / kAlign * kAlign;
  PendingSegment s;
  s.total = kHeaderBytes + arena_bytes * static_cast<size_t>(inner->world_size());
  // A name every rank derives alike; the random part comes from rank 0
  // through a broadcast, so a stale segment of an earlier run never matches.
  uint64_t nonce = 0;
  if (inner->rank() == 0) nonce = core::random_id();
  inner->broadcast(&nonce, 1, collective::DType::kInt64, 0)->wait(timeout);
  s.name = "/troupe-" + std::to_string(nonce);
  int err = 0;
  if (inner->rank() == 0) {
    s.fd = ::shm_open(s.name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    s.unlink = s.fd >= 0;
    // Reserve the pages now: a tmpfs too small for the segment fails here
    // (and every rank falls back) instead of SIGBUS on first touch.
    if (s.fd < 0 || ::ftruncate(s.fd, static_cast<off_t>(s.total)) != 0)
      err = errno;
    else
      err = ::posix_fallocate(s.fd, 0, static_cast<off_t>(s.total));  // returns its error
    if (err != 0 && s.fd >= 0) ::close(std::exchange(s.fd, -1));
  }
  int64_t ok = inner->rank() == 0 ? (s.fd >= 0) : 1;
  inner->broadcast(&ok, 1, collective::DType::kInt64, 0)->wait(timeout);
  if (!ok)
    throw Error("cannot create shared memory segment " + s.name + ": " +
                (inner->rank() == 0 ? std::strerror(err) : "rank 0 could not"));
  if (inner->rank() != 0) s.fd = ::shm_open(s.name.c_str(), O_RDWR, 0600);
  if (s.fd >= 0) {
    s.base = ::mmap(nullptr, s.total, PROT_READ | PROT_WRITE, MAP_SHARED, s.fd, 0);
    ::close(std::exchange(s.fd, -1));
  }
  int64_t all = s.base != MAP_FAILED;
  collective::AllreduceOptions ao;
  ao.op = collective::ReduceOp::kMin;
  inner->allreduce(&all, 1, collective::DType::kInt64, ao)->wait(timeout);
  // Everyone has it mapped (or failed): the name is no longer needed
  // (PendingSegment unlinks it on rank 0, whatever happens).
  if (!all) throw Error("a rank could not map the shared memory segment " + s.name);
  void* base = std::exchange(s.base, MAP_FAILED);
  return std::unique_ptr<ShmGroup>(new ShmGroup(std::move(inner), base, s.total, arena_bytes, timeout));
}

ShmGroup::ShmGroup(std::unique_ptr<collective::Group> inner, void* base, size_t total, size_t arena,
                   std::chrono::milliseconds timeout)
    : inner_(std::move(inner)),
      base_(base),
      total_(total),
      arena_bytes_(arena),
      timeout_(timeout),
      spin_for_(spin_budget(inner_->world_size())) {}

ShmGroup::~ShmGroup() { ::munmap(base_, total_); }

std::byte* ShmGroup::arena(int r) const {
  return static_cast<std::byte*>(base_) + kHeaderBytes + arena_bytes_ * static_cast<size_t>(r);
}

void* ShmGroup::allocate(size_t bytes) {
  size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
  if (used_ + rounded > arena_bytes_) return nullptr;
  void* p = arena(rank()) + used_;
  used_ += rounded;
  return p;
}

void ShmGroup::abort(const std::string& reason) {
  static_assert(sizeof(Header) <= kHeaderBytes);
  auto* h = static_cast<Header*>(base_);
  if (h->reason_claimed.exchange(1) == 0) {
    const size_t n = std::min(reason.size(), sizeof h->reason - 1);
    std::memcpy(h->reason, reason.data(), n);
    h->reason[n] = '\0';
    h->reason_ready.store(1);
  }
  h->aborted.store(1);
  futex(&h->arrived, FUTEX_WAKE, INT32_MAX, nullptr);
  inner_->abort(reason);
}

std::string ShmGroup::aborted_text() const {
  const auto* h = static_cast<const Header*>(base_);
  std::string why = h->reason_ready.load() ? ": " + std::string(h->reason) : "";
  return "shared-memory allreduce of " + name() + " aborted" + why;
}

bool ShmGroup::is_aborted() const { return static_cast<Header*>(base_)->aborted.load() != 0 || inner_->is_aborted(); }

// An abort that reached only this rank's inner group (a driver's AbortGroup
// names the group, not its shared memory) is made every rank's: one that
// was stopped when its own abort came, and is woken later, must not go on
// reducing with what its aborted peers left in the segment.
[[noreturn]] void ShmGroup::throw_aborted() {
  auto* h = static_cast<Header*>(base_);
  if (h->aborted.exchange(1) == 0) futex(&h->arrived, FUTEX_WAKE, INT32_MAX, nullptr);
  throw Aborted(aborted_text());
}

void ShmGroup::wait_barrier(std::chrono::milliseconds timeout) {
  auto* h = static_cast<Header*>(base_);
  const uint32_t n = static_cast<uint32_t>(world_size());
  ++barriers_;
  const uint32_t target = barriers_ * n;
  h->arrived.fetch_add(1);
  if (h->sleepers.load() > 0) futex(&h->arrived, FUTEX_WAKE, INT32_MAX, nullptr);
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + timeout;
  for (uint32_t spin = 0;; ++spin) {
    uint32_t v = h->arrived.load();
    // Wrap-safe: the counter passes the target by less than n.
    if (static_cast<int32_t>(v - target) >= 0) return;
    // Spin first: the ranks of a step arrive close together, and a rank
    // that sleeps pays for its wake-up (tens to hundreds of microseconds on
    // a virtual machine). The clock is read every 64 rounds.
    if (spin % 64 != 0 || std::chrono::steady_clock::now() - start < spin_for_) {
      cpu_relax();
      continue;
    }
    if (h->aborted.load() || inner_->is_aborted()) throw_aborted();
    auto now = std::chrono::steady_clock::now();
    if (now >= deadline)
      throw Timeout("shared-memory allreduce of " + name() + ": a rank did not arrive within " +
                    std::to_string(timeout.count()) + " ms");
    timespec ts{0, 2'000'000};  // re-check at least every 2 ms
    // Counted before the wait: an arrival after the load above either sees
    // a sleeper and wakes it, or has changed `arrived` so that this wait
    // returns at once.
    h->sleepers.fetch_add(1);
    futex(&h->arrived, FUTEX_WAIT, v, &ts);
    h->sleepers.fetch_sub(1);
  }
}

collective::WorkPtr ShmGroup::allreduce(void* data, size_t count, collective::DType dtype,
                                        const collective::AllreduceOptions& opts) {
  auto* p = static_cast<std::byte*>(data);
  std::byte* mine = arena(rank());
  bool in_arena = p >= mine && p + count * sizeof(float) <= mine + used_;
  if (dtype != collective::DType::kFloat32 || opts.op != collective::ReduceOp::kSum || !in_arena)
    return inner_->allreduce(data, count, dtype, opts);
  auto timeout = opts.timeout.count() > 0 ? opts.timeout : timeout_;
  if (is_aborted()) throw_aborted();
  const size_t offset = static_cast<size_t>(p - mine);
  const int n = world_size();
  wait_barrier(timeout);  // every rank's copy is complete
  const size_t chunk = (count + static_cast<size_t>(n) - 1) / static_cast<size_t>(n);
  const size_t begin = std::min(count, chunk * static_cast<size_t>(rank()));
  const size_t end = std::min(count, begin + chunk);
  if (end > begin) {
    float* acc = reinterpret_cast<float*>(arena(0) + offset) + begin;
    // The sum in rank order lands in rank 0's copy first, then is copied to
    // the others: identical bits everywhere.
    for (int r = 1; r < n; ++r) {
      const float* src = reinterpret_cast<const float*>(arena(r) + offset) + begin;
      for (size_t i = 0; i < end - begin; ++i) acc[i] += src[i];
    }
    for (int r = 1; r < n; ++r)
      std::memcpy(reinterpret_cast<float*>(arena(r) + offset) + begin, acc, (end - begin) * sizeof(float));
  }
  wait_barrier(timeout);  // every chunk is summed everywhere
  ++shm_ops_;
  return std::make_shared<DoneWork>();
}

}  // namespace troupe::trainer
