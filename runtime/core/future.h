// Future<T>: the result of an actor call. A shared state set exactly once by
// the runtime (value or error); get() blocks with an optional timeout and
// rethrows the remote failure (ActorDied, RemoteError, Timeout). Callbacks
// let the runtime chain work (futures passed as call arguments).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "troupe/runtime/core/errors.h"

namespace troupe {

namespace core {

// Told when a thread starts and stops waiting for a result. A task
// executor's worker installs one on the thread that runs a task, so that a
// task blocked in get() lends its CPU back to the cluster meanwhile (as Ray
// does; tasks that wait for tasks cannot deadlock a small cluster).
class WaitObserver {
 public:
  virtual ~WaitObserver() = default;
  virtual void blocked() = 0;
  virtual void unblocked() = 0;
};

struct WaitObserverSlot {
  WaitObserver* observer = nullptr;
  int depth = 0;  // BlockedScopes open on this thread
};
inline thread_local WaitObserverSlot tls_wait_observer;

// Installs `observer` on the calling thread for the scope's life.
class WaitObserverInstall {
 public:
  explicit WaitObserverInstall(WaitObserver* observer) : before_(tls_wait_observer.observer) {
    tls_wait_observer.observer = observer;
  }
  ~WaitObserverInstall() { tls_wait_observer.observer = before_; }
  WaitObserverInstall(const WaitObserverInstall&) = delete;
  WaitObserverInstall& operator=(const WaitObserverInstall&) = delete;

 private:
  WaitObserver* before_;
};

// A wait that may take long: the outermost one on a thread with an
// observer tells it (blocked() now, unblocked() at the end). What an
// observer throws is its own business and not the waiter's.
class BlockedScope {
 public:
  BlockedScope() : observer_(tls_wait_observer.observer) {
    if (observer_ && tls_wait_observer.depth++ == 0) tell(&WaitObserver::blocked);
  }
  ~BlockedScope() {
    if (observer_ && --tls_wait_observer.depth == 0) tell(&WaitObserver::unblocked);
  }
  BlockedScope(const BlockedScope&) = delete;
  BlockedScope& operator=(const BlockedScope&) = delete;

 private:
  void tell(void (WaitObserver::*what)()) {
    try {
      (observer_->*what)();
    } catch (...) {
    }
  }
  WaitObserver* observer_;
};

// The part of a future's shared state that does not depend on T.
class FutureStateBase {
 public:
  virtual ~FutureStateBase() = default;

  // What the result still waits for, for a wait that timed out: "" when
  // the state does not know (a task's or an actor call's does). Any thread.
  virtual std::string pending_text() const { return {}; }

  bool ready() const { return ready_.load(std::memory_order_acquire); }
  // Waits until ready; false on timeout.
  bool wait_for(std::chrono::milliseconds timeout) const {
    if (timeout.count() <= 0) return ready();
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    if (spin(timeout)) return true;
    BlockedScope blocked;
    std::unique_lock lock(mu_);
    return cv_.wait_until(lock, deadline, [&] { return ready_.load(); });
  }
  void wait() const {
    if (spin()) return;
    BlockedScope blocked;
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return ready_.load(); });
  }
  void set_error(std::exception_ptr e) {
    complete([&] { error_ = std::move(e); });
  }
  // Runs cb once the state is ready (at once, on this thread, if it is).
  void on_ready(std::function<void()> cb) {
    std::unique_lock lock(mu_);
    if (ready_.load()) {
      lock.unlock();
      cb();
      return;
    }
    callbacks_.push_back(std::move(cb));
  }
  // A reply to a synchronous call usually lands within tens of
  // microseconds: checking for that briefly saves a sleep and a wake-up.
  // Never longer than `limit`; the clock is read after every yield, which
  // on a loaded machine may give the CPU away for milliseconds (reading
  // it every 16th let a get(1ms) block for tens of them).
  bool spin(std::chrono::microseconds limit = std::chrono::microseconds(kSpinMicros)) const {
    const auto until = std::chrono::steady_clock::now() + std::min(limit, std::chrono::microseconds(kSpinMicros));
    while (!ready()) {
      std::this_thread::yield();
      if (std::chrono::steady_clock::now() > until) return ready();
    }
    return true;
  }
  std::exception_ptr error() const {
    std::lock_guard lock(mu_);
    return error_;
  }

 protected:
  template <class F>
  void complete(F&& assign) {
    std::vector<std::function<void()>> cbs;
    {
      std::lock_guard lock(mu_);
      if (ready_.load()) return;  // first completion wins
      assign();
      ready_.store(true, std::memory_order_release);
      cbs.swap(callbacks_);
    }
    cv_.notify_all();
    for (auto& cb : cbs) cb();
  }

  static constexpr int kSpinMicros = 100;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::atomic<bool> ready_{false};
  std::exception_ptr error_;
  std::vector<std::function<void()>> callbacks_;
};

template <class T>
class FutureState : public FutureStateBase {
 public:
  void set_value(T v) {
    complete([&] { value_.emplace(std::move(v)); });
  }
  T& value() { return *value_; }

 private:
  std::optional<T> value_;
};

template <>
class FutureState<void> : public FutureStateBase {
 public:
  void set_value() {
    complete([] {});
  }
};

}  // namespace core

template <class T>
class Future {
 public:
  using value_type = T;
  Future() = default;
  explicit Future(std::shared_ptr<core::FutureState<T>> s) : state_(std::move(s)) {}

  bool valid() const { return state_ != nullptr; }
  bool ready() const { return state_ && state_->ready(); }

  // Blocks until the result is there and returns it (a copy; the future
  // stays valid), or rethrows the failure. On an empty future (made by
  // default, or moved from) each of these throws troupe::Error.
  T get() const {
    live().wait();
    return take();
  }
  // Like get(), but throws troupe::Timeout after `timeout`, saying what
  // the result waits for when the future is a task's or an actor call's.
  T get(std::chrono::milliseconds timeout) const {
    if (!live().wait_for(timeout)) throw timed_out(timeout);
    return take();
  }
  // The Timeout get(timeout) throws after waiting `waited`: for a caller
  // that waits in slices of its own (to see a stop between them).
  Timeout timed_out(std::chrono::milliseconds waited) const {
    std::string why;
    try {
      why = live().pending_text();
    } catch (const std::exception&) {
      // Only the text is lost: the timeout stands.
    }
    return Timeout("future not ready after " + std::to_string(waited.count()) + " ms" +
                   (why.empty() ? "" : ": " + why));
  }
  void wait() const { live().wait(); }
  bool wait_for(std::chrono::milliseconds timeout) const { return live().wait_for(timeout); }
  void on_ready(std::function<void()> cb) const { live().on_ready(std::move(cb)); }
  const std::shared_ptr<core::FutureState<T>>& state() const { return state_; }

 private:
  core::FutureState<T>& live() const {
    if (!state_) throw Error("an empty troupe::Future (made by default, or moved from) stands for no result");
    return *state_;
  }
  T take() const {
    if (auto e = state_->error()) std::rethrow_exception(e);
    if constexpr (!std::is_void_v<T>) return state_->value();
  }
  std::shared_ptr<core::FutureState<T>> state_;
};

template <class T>
struct IsFuture : std::false_type {};
template <class T>
struct IsFuture<Future<T>> : std::true_type {};

// Waits for every future (errors are not rethrown here; call get()).
template <class... F>
void wait_all(const F&... futures) {
  (futures.wait(), ...);
}
template <class T>
void wait_all(const std::vector<Future<T>>& futures) {
  for (auto& f : futures) f.wait();
}

// Waits until one of the futures is ready and returns its index; throws
// Timeout after `timeout`.
template <class T>
size_t wait_any(const std::vector<Future<T>>& futures,
                std::chrono::milliseconds timeout = std::chrono::hours(24 * 365)) {
  if (futures.empty()) throw Error("wait_any: no futures given");
  auto mu = std::make_shared<std::mutex>();
  auto cv = std::make_shared<std::condition_variable>();
  auto first = std::make_shared<std::optional<size_t>>();
  for (size_t i = 0; i < futures.size(); ++i) {
    futures[i].on_ready([mu, cv, first, i] {
      std::lock_guard lock(*mu);
      if (!*first) *first = i;
      cv->notify_all();
    });
  }
  std::optional<core::BlockedScope> blocked;
  std::unique_lock lock(*mu);
  if (!first->has_value()) blocked.emplace();
  if (!cv->wait_for(lock, timeout, [&] { return first->has_value(); }))
    throw Timeout("wait_any: no future ready after " + std::to_string(timeout.count()) + " ms");
  return **first;
}

// Waits until every state has succeeded, or until one has failed, whichever
// comes first (a round of calls where a failed one means the others may wait
// forever, e.g. survivors in a collective with a dead peer). Returns nullptr
// when all succeeded; otherwise the error of the first failed state in the
// order given, or a Timeout when neither happened within `timeout`. Calls
// still running are not cancelled.
inline std::exception_ptr wait_all_or_first_failure(const std::vector<std::shared_ptr<core::FutureStateBase>>& states,
                                                    std::chrono::milliseconds timeout) {
  struct Signal {
    std::mutex mu;
    std::condition_variable cv;
    size_t ready = 0;
  };
  auto signal = std::make_shared<Signal>();
  for (const auto& st : states)
    st->on_ready([signal] {
      {
        std::lock_guard lock(signal->mu);
        ++signal->ready;
      }
      signal->cv.notify_all();
    });
  std::exception_ptr failed;
  auto settled = [&] {
    for (const auto& st : states)
      if (st->ready())
        if (auto e = st->error()) {
          failed = e;
          return true;
        }
    return signal->ready == states.size();
  };
  std::optional<core::BlockedScope> blocked;
  std::unique_lock lock(signal->mu);
  if (!settled()) blocked.emplace();
  if (!signal->cv.wait_for(lock, timeout, settled))
    return std::make_exception_ptr(Timeout("no answer within " + std::to_string(timeout.count()) + " ms"));
  return failed;
}
template <class T>
std::exception_ptr wait_all_or_first_failure(const std::vector<Future<T>>& futures, std::chrono::milliseconds timeout) {
  std::vector<std::shared_ptr<core::FutureStateBase>> states;
  for (const auto& f : futures) states.push_back(f.state());
  return wait_all_or_first_failure(states, timeout);
}

}  // namespace troupe
