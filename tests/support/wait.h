// Bounded waiting for tests: poll a condition until it holds or a deadline
// passes. Tests wait on events or on this, never on a bare sleep.
#pragma once

#include <chrono>
#include <functional>
#include <thread>

namespace troupe::test {

// Polls `pred` every 2 ms until it holds or `timeout` passes; the last
// answer is returned, so a condition that turns true at the deadline counts.
inline bool eventually(const std::function<bool()>& pred,
                       std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return pred();
}

}  // namespace troupe::test
