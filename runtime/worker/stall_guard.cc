#include "troupe/runtime/worker/stall_guard.h"

#include <time.h>

#include <algorithm>
#include <cstdlib>
#include <exception>

#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/core/signal_free_thread.h"

namespace troupe::worker {

StallGuard::StallGuard(std::chrono::milliseconds limit, std::function<void()> confirm)
    : limit_ns_(std::chrono::nanoseconds(limit).count()), confirm_(std::move(confirm)), last_ns_(now_ns()) {
  thread_ = core::signal_free_thread([this] { watch(); });
}

StallGuard::~StallGuard() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

int64_t StallGuard::now_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_BOOTTIME, &ts);  // runs on through a suspend, unlike CLOCK_MONOTONIC
  return int64_t(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

// Ticks four times a limit. A tick that comes later than the limit after
// the last one saw a stall: the next call confirms first.
void StallGuard::watch() {
  const auto tick = std::chrono::nanoseconds(std::max<int64_t>(limit_ns_ / 4, 1'000'000));
  std::unique_lock lock(mu_);
  while (!cv_.wait_for(lock, tick, [this] { return stop_; })) {
    const int64_t now = now_ns();
    if (now - last_ns_.load() > limit_ns_) stalls_.fetch_add(1);  // before last_ns_: see stalled()
    last_ns_.store(now);
  }
}

void StallGuard::before_call() {
  if (!stalled(now_ns())) return;
  // One thread asks; the others wait here, and see stalled() false once
  // its answer covered the stalls they saw.
  std::lock_guard lock(confirm_mu_);
  if (!stalled(now_ns())) return;
  const uint64_t seen = stalls_.load();
  const int64_t asked = now_ns();
  const int64_t gap_ms = (asked - last_ns_.load()) / 1'000'000;
  try {
    confirm_();
  } catch (const std::exception& e) {
    TROUPE_LOG_WARN(
        "stalled (the last {} ms or more) and cannot confirm with the head that this worker still "
        "serves ({}); exiting rather than running a call its replacement may run",
        gap_ms, e.what());
    std::_Exit(0);
  }
  // Only what came before the ping is covered: a stall during it is seen
  // by the watch (a later stall count) or by the gap from `asked`.
  cleared_.store(seen);
  for (int64_t last = last_ns_.load(); last < asked && !last_ns_.compare_exchange_weak(last, asked);) {
  }
  TROUPE_LOG_INFO("stalled; the head confirmed this worker still serves");
}

}  // namespace troupe::worker
