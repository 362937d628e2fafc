// StallGuard: a worker that stalled (SIGSTOP, a frozen VM, a host starved
// of CPU) for longer than its node could stay silent before the head fences
// it must not run another call before it knows it still serves: the head
// may have declared its node dead meanwhile and started its actor again
// elsewhere, whose callers then retried what waits in this worker's sockets.
// A fenced worker exits as soon as its I/O thread reads the head's close,
// but after a stall the thread that runs calls may read a queued call
// first. So a watch thread ticks on CLOCK_BOOTTIME (which runs on while
// the process is stopped, and through a suspend); before each call, a gap since the last tick
// longer than the limit (half the head's fence time) makes the call wait
// for one round trip to the head (kPing). The head answers no fenced
// worker: it closes its connection, and the worker exits then. A worker
// that cannot reach the head at all exits too. It does not cover a worker
// that runs on but is cut off from the head (a partition): see
// docs/runtime.md.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

namespace troupe::worker {

class StallGuard {
 public:
  // `confirm` asks the head whether this worker still serves: it returns
  // when it does and throws when that cannot be known.
  StallGuard(std::chrono::milliseconds limit, std::function<void()> confirm);
  ~StallGuard();
  StallGuard(const StallGuard&) = delete;
  StallGuard& operator=(const StallGuard&) = delete;

  // Before a call runs (any thread): at once unless the process stalled for
  // longer than the limit since it last knew it serves; then after
  // confirming it with the head (one thread asks, the others wait for its
  // answer). Exits the process when `confirm` throws.
  void before_call();

 private:
  static int64_t now_ns();
  // last_ns_ first: a reader that sees the watch's new tick sees the stall
  // it counted before it (both seq_cst).
  bool stalled(int64_t now) const {
    const int64_t last = last_ns_.load();
    return stalls_.load() != cleared_.load() || now - last > limit_ns_;
  }
  void watch();

  const int64_t limit_ns_;
  const std::function<void()> confirm_;
  std::atomic<int64_t> last_ns_;
  std::atomic<uint64_t> stalls_{0};   // gaps the watch thread saw (it woke up late)
  std::atomic<uint64_t> cleared_{0};  // the stall count a confirmation covered
  std::mutex confirm_mu_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace troupe::worker
