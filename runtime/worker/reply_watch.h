// ReplyWatch: an actor that runs one call at a time runs its calls on the
// thread that reads them, and the replies of the calls read together go out
// together once that batch is done (Connection::send), a write for many
// replies. A call that runs long would then hold the replies of the quick
// calls read before it, and lose them if the actor exited or died in it.
// While one call runs for longer than kHoldLimit, this watch's thread sends
// what is held on that call's connection (Connection::send_held).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>

#include "troupe/runtime/wire/connection.h"

namespace troupe::worker {

class ReplyWatch {
 public:
  // Polled this often: a wake-up each millisecond cost an actor called back
  // to back 8% of its rate (bench/run actor_calls, 1_1_sync).
  static constexpr std::chrono::milliseconds kHoldLimit{10};
  // Polls with no call running before the watch sleeps until the next
  // call wakes it.
  static constexpr int kIdlePolls = 20;

  ReplyWatch();
  ~ReplyWatch();
  ReplyWatch(const ReplyWatch&) = delete;
  ReplyWatch& operator=(const ReplyWatch&) = delete;

  // Around each call, on the thread that runs it.
  void call_starts(const std::shared_ptr<wire::Connection>& conn);
  void call_ends();
  // Sends at once what the running call's connection holds: before the
  // process ends itself (exit_actor), which would lose it.
  void send_held_now();

  // The process's watch (one actor per worker process), or nullptr.
  static ReplyWatch* of_this_process();

 private:
  void watch();

  std::mutex mu_;
  std::condition_variable cv_;
  std::weak_ptr<wire::Connection> conn_;  // the running call's
  uint64_t calls_ = 0;                    // calls started
  bool running_ = false;
  bool asleep_ = false;  // waits for a call to start: call_starts wakes it
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace troupe::worker
