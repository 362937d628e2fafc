#include "troupe/runtime/worker/reply_watch.h"

#include <atomic>

namespace troupe::worker {

namespace {
std::atomic<ReplyWatch*> process_watch{nullptr};
}

ReplyWatch::ReplyWatch() : thread_([this] { watch(); }) { process_watch.store(this); }

ReplyWatch* ReplyWatch::of_this_process() { return process_watch.load(); }

void ReplyWatch::send_held_now() {
  std::shared_ptr<wire::Connection> conn;
  {
    std::lock_guard lock(mu_);
    conn = conn_.lock();
  }
  if (conn) conn->send_held();
}

ReplyWatch::~ReplyWatch() {
  process_watch.store(nullptr);
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

void ReplyWatch::call_starts(const std::shared_ptr<wire::Connection>& conn) {
  std::lock_guard lock(mu_);
  conn_ = conn;
  ++calls_;
  running_ = true;
  // A busy actor's watch polls; only one that went to sleep costs a wake-up.
  if (asleep_) cv_.notify_one();
}

void ReplyWatch::call_ends() {
  std::lock_guard lock(mu_);
  running_ = false;
}

void ReplyWatch::watch() {
  std::unique_lock lock(mu_);
  int idle_polls = 0;
  while (!stop_) {
    if (!running_) {
      // Between calls it polls on for a while: a wake-up for each call
      // would cost an actor called back to back a third of its rate.
      if (++idle_polls <= kIdlePolls) {
        cv_.wait_for(lock, kHoldLimit, [&] { return stop_; });
        continue;
      }
      asleep_ = true;
      cv_.wait(lock, [&] { return running_ || stop_; });
      asleep_ = false;
      continue;
    }
    idle_polls = 0;
    const uint64_t call = calls_;
    cv_.wait_for(lock, kHoldLimit, [&] { return stop_; });
    if (stop_ || !running_ || calls_ != call) continue;
    // The same call still runs: what the calls before it left goes now.
    if (auto conn = conn_.lock()) {
      lock.unlock();
      conn->send_held();
      lock.lock();
    }
    // Nothing more is held until another call starts.
    asleep_ = true;
    cv_.wait(lock, [&] { return calls_ != call || stop_; });
    asleep_ = false;
  }
}

}  // namespace troupe::worker
