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
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

// Ticks four times a limit. A tick that comes later than the limit after
// the last one saw a stall: the next call confirms first.
void StallGuard::watch() {
  const auto tick = std::chrono::nanoseconds(std::max<int64_t>(limit_ns_ / 4, 1'000'000));
  std::unique_lock lock(mu_);
  while (!cv_.wait_for(lock, tick, [this] { return stop_; })) {
    const int64_t now = now_ns();
    if (now - last_ns_.load() > limit_ns_) suspect_.store(true);  // before last_ns_: see stalled()
    last_ns_.store(now);
  }
}

void StallGuard::before_call() {
  if (!stalled(now_ns())) return;
  std::lock_guard lock(confirm_mu_);
  const int64_t gap_ms = (now_ns() - last_ns_.load()) / 1'000'000;
  if (!stalled(now_ns())) return;  // another call's confirmation covered it
  suspect_.store(false);           // a stall from here on is seen again
  try {
    confirm_();
  } catch (const std::exception& e) {
    TROUPE_LOG_WARN(
        "stalled (the last {} ms or more) and cannot confirm with the head that this worker still "
        "serves ({}); exiting rather than running a call its replacement may run",
        gap_ms, e.what());
    std::_Exit(0);
  }
  last_ns_.store(now_ns());
  confirmed_.fetch_add(1);
  TROUPE_LOG_INFO("stalled; the head confirmed this worker still serves");
}

}  // namespace troupe::worker
