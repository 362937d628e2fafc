// Bounded waiting for tests: the one bound for "this should happen soon",
// and polling a condition until it holds or a deadline passes. Tests wait
// on events or on these, never on a bare sleep.
#pragma once

#include <chrono>
#include <functional>
#include <thread>

namespace troupe::test {

// How long a test waits for something that takes milliseconds on an idle
// machine: a call's reply, a process or actor starting, a stream item, a
// death being noticed. Far beyond what a loaded 2-core machine needs, so
// only a bug reaches it; a test never asserts that something is this fast.
inline constexpr std::chrono::seconds kWaitBound{60};

// Polls `pred` every 2 ms until it holds or `timeout` passes; the last
// answer is returned, so a condition that turns true at the deadline counts.
inline bool eventually(const std::function<bool()>& pred, std::chrono::milliseconds timeout = kWaitBound) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return pred();
}

}  // namespace troupe::test
