// ThreadSet: threads started so that their starter need not wait for them
// (an abort that may take a while, run off the I/O thread), owned by
// whoever owns the set and joined when it goes, so no thread outlives its
// owner detached.
#pragma once

#include <atomic>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <thread>

namespace troupe::core {

class ThreadSet {
 public:
  ThreadSet() = default;
  ThreadSet(const ThreadSet&) = delete;
  ThreadSet& operator=(const ThreadSet&) = delete;
  ~ThreadSet() { join_all(); }

  // Runs `fn` on a new thread of this set; joins the finished ones first, so
  // the set does not grow with threads that are done.
  void spawn(std::function<void()> fn) {
    auto done = std::make_shared<std::atomic<bool>>(false);
    std::list<Entry> finished;
    std::lock_guard lock(mu_);
    for (auto it = threads_.begin(); it != threads_.end();) {
      auto next = std::next(it);
      if (it->done && it->done->load()) finished.splice(finished.end(), threads_, it);
      it = next;
    }
    for (auto& e : finished) e.thread.join();
    threads_.push_back(Entry{std::thread([fn = std::move(fn), done] {
                               fn();
                               done->store(true);
                             }),
                             done});
  }

  // Takes over a running thread, joined with the others.
  void adopt(std::thread thread) {
    std::lock_guard lock(mu_);
    threads_.push_back(Entry{std::move(thread), nullptr});
  }

  // Joins every thread, including those started meanwhile.
  void join_all() {
    for (;;) {
      std::list<Entry> all;
      {
        std::lock_guard lock(mu_);
        all.swap(threads_);
      }
      if (all.empty()) return;
      for (auto& e : all)
        if (e.thread.joinable()) e.thread.join();
    }
  }

 private:
  struct Entry {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;  // null for adopted threads
  };
  std::mutex mu_;
  std::list<Entry> threads_;
};

}  // namespace troupe::core
