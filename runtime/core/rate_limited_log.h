// A warning that a peer can cause again and again (a refused connection, a
// bad frame, a failing event) is logged at most `burst` times per window,
// then counted, so a storm of them cannot flood the log or spend the event
// loop's time writing it. One instance per kind of line, shared by every
// connection of the process.
#pragma once

#include <chrono>
#include <cstddef>
#include <mutex>
#include <utility>

#include "troupe/runtime/core/logging.h"

namespace troupe::core {

class RateLimitedLog {
 public:
  // `what` the log's lines are, as "N more <what> were not logged" says.
  // At most `burst` lines per `window`.
  explicit RateLimitedLog(const char* what, size_t burst = 20,
                          std::chrono::steady_clock::duration window = std::chrono::seconds(10))
      : what_(what), burst_(burst), window_(window) {}
  template <typename... Args>
  void warn(spdlog::format_string_t<Args...> fmt, Args&&... args) {
    size_t missed = 0;
    {
      std::lock_guard lock(mu_);
      auto now = std::chrono::steady_clock::now();
      if (now - window_start_ >= window_) {
        missed = suppressed_;
        suppressed_ = 0;
        logged_ = 0;
        window_start_ = now;
      }
      if (logged_ >= burst_) {
        ++suppressed_;
        return;
      }
      ++logged_;
    }
    if (missed) TROUPE_LOG_WARN("{} more {} were not logged", missed, what_);
    TROUPE_LOG_WARN(fmt, std::forward<Args>(args)...);
  }

 private:
  const char* const what_;
  const size_t burst_;
  const std::chrono::steady_clock::duration window_;
  std::mutex mu_;
  std::chrono::steady_clock::time_point window_start_{};
  size_t logged_ = 0;
  size_t suppressed_ = 0;
};

}  // namespace troupe::core
