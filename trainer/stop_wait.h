// The driver's long waits (a placement, the trainers' setup with a shipped
// file's fetch, a group forming, a state loading: minutes at worst) cut
// short by the job's stop (TrainJobConfig::stop_requested), which is
// otherwise seen only at step boundaries. Without it a Ctrl-C or a batch
// system's SIGTERM while a job started or healed waited for the wait to
// end (a host that stopped reading a shipped file: the object server's
// send timeout, 120 s, and a fetch). Polled every kStopPoll.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/future.h"

namespace troupe::trainer {

// Thrown out of such a wait when a stop was asked for during it: the job
// ends as interrupted (Result::interrupted), not as failed.
class StopRequested : public Error {
 public:
  explicit StopRequested(const std::string& waiting_for)
      : Error("stopped while waiting for " + waiting_for), waiting_for(waiting_for) {}
  std::string waiting_for;  // "the trainers' setup"
};

inline constexpr std::chrono::milliseconds kStopPoll{200};

// wait_for(slice) in slices of kStopPoll until it returns true (then true)
// or `timeout` has passed (false; wait_for is called at least once, so a
// timeout of 1 ms still sees what is ready); throws StopRequested naming
// `what` ("the trainers' setup") as soon as `stop` returns true. Without
// `stop`, one wait_for(timeout).
inline bool wait_or_stop(const std::function<bool(std::chrono::milliseconds)>& wait_for,
                         std::chrono::milliseconds timeout, const std::function<bool()>& stop,
                         const std::string& what) {
  if (!stop) return wait_for(timeout);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (bool waited = false;; waited = true) {
    if (stop()) throw StopRequested(what);
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0 && waited) return false;
    if (wait_for(std::clamp(left, std::chrono::milliseconds(0), kStopPoll))) return true;
  }
}

// f.get(timeout), cut short by `stop` as wait_or_stop is; its Timeout says
// what Future::get's says.
template <class R>
R get_or_stop(const Future<R>& f, std::chrono::milliseconds timeout, const std::function<bool()>& stop,
              const std::string& what) {
  if (!stop) return f.get(timeout);
  if (!wait_or_stop([&](std::chrono::milliseconds slice) { return f.wait_for(slice); }, timeout, stop, what))
    throw f.timed_out(timeout);
  return f.get();
}

}  // namespace troupe::trainer
