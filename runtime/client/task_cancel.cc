#include "troupe/runtime/client/task_cancel.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <deque>
#include <random>
#include <thread>
#include <unordered_set>
#include <vector>

#include "troupe/runtime/client/control.h"
#include "troupe/runtime/client/core.h"
#include "troupe/runtime/client/task_submitter.h"
#include "troupe/runtime/core/logging.h"

namespace troupe::client {

namespace {

// Tokens of tasks cancelled while they waited, forgetting the oldest
// beyond a bound (a mailbox holds at most the submitter's pipeline depth,
// 256).
class CancelledTokens {
 public:
  void insert(uint64_t token) {
    if (!set_.insert(token).second) return;
    order_.push_back(token);
    while (order_.size() > kKept) {
      set_.erase(order_.front());
      order_.pop_front();
    }
  }
  bool erase(uint64_t token) { return set_.erase(token) > 0; }
  bool empty() const { return set_.empty(); }

 private:
  static constexpr size_t kKept = 4096;
  std::unordered_set<uint64_t> set_;
  std::deque<uint64_t> order_;
};

// What runs on every task is kept cheap (a task executor serves hundreds
// of thousands a second): the tasks running now (one, for an executor that
// runs one at a time) and a ring of those that ended lately, which only a
// cancel, rare, searches (a cancel may cross a finished task's reply).
struct TaskRecord {
  std::mutex mu;
  CancelledTokens cancelled;
  std::vector<uint64_t> running;
  static constexpr size_t kRecent = 1024;
  std::array<uint64_t, kRecent> ended{};
  size_t next_ended = 0;
};

TaskRecord& record() {
  static auto* r = new TaskRecord;  // used by detached threads until _Exit
  return *r;
}

const bool registered = register_process_control(
    CancelTask::kControlTag,
    typed_control_handler<CancelTask>([](const CancelTask& m) -> int32_t { return mark_task_cancelled(m.token); }));

}  // namespace

TaskState mark_task_cancelled(uint64_t token) {
  (void)registered;
  if (token == 0) return kTaskFinished;
  auto& r = record();
  std::lock_guard lock(r.mu);
  if (std::find(r.running.begin(), r.running.end(), token) != r.running.end()) return kTaskRunning;
  if (std::find(r.ended.begin(), r.ended.end(), token) != r.ended.end()) return kTaskFinished;
  r.cancelled.insert(token);
  return kTaskNotStarted;
}

bool begin_task(uint64_t token) {
  if (token == 0) return true;
  auto& r = record();
  std::lock_guard lock(r.mu);
  if (!r.cancelled.empty() && r.cancelled.erase(token)) return false;
  r.running.push_back(token);
  return true;
}

void end_task(uint64_t token) {
  if (token == 0) return;
  auto& r = record();
  std::lock_guard lock(r.mu);
  if (auto it = std::find(r.running.begin(), r.running.end(), token); it != r.running.end()) r.running.erase(it);
  r.ended[r.next_ended++ % TaskRecord::kRecent] = token;
}

namespace {

uint64_t next_token() {
  // Random start, so that tokens of two processes hardly ever meet should
  // one executor serve both.
  static std::atomic<uint64_t> next{[] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32 | rd()) | 1;
  }()};
  uint64_t t;
  do {
    t = next.fetch_add(1);
  } while (t == 0);
  return t;
}

}  // namespace

TaskCancel::TaskCancel(std::string name, uint64_t owner)
    : name_(std::move(name)), owner_(owner), token_(next_token()) {}

bool TaskCancel::begin_submit() {
  uint64_t before = 0;
  return id_.compare_exchange_strong(before, kSubmitting);
}

CancelOutcome TaskCancel::cancel(TaskSubmitter& s, core::FutureStateBase& answer, bool force,
                                 const TellExecutor& tell) {
  uint64_t id = 0;
  if (id_.compare_exchange_strong(id, kCancelledUnsubmitted)) {
    // Its arguments are not all there yet: it is never submitted.
    const bool done = answer.ready();
    answer.set_error(std::make_exception_ptr(TaskCancelled("task '" + name_ + "' was cancelled")));
    return done ? CancelOutcome::kFinished : CancelOutcome::kNotStarted;
  }
  // Cancelled already, before it was submitted: its future holds that.
  if (id == kCancelledUnsubmitted) return CancelOutcome::kFinished;
  // Being submitted (on the I/O thread, which does not wait for anything
  // here): it may already be on an executor, so wait for its id.
  while (id == kSubmitting) {
    std::this_thread::yield();
    id = id_.load();
  }
  auto r = s.cancel(id, force);
  switch (r.outcome) {
    case TaskSubmitter::Cancel::kDone:
      return CancelOutcome::kFinished;
    case TaskSubmitter::Cancel::kDequeued:
      return CancelOutcome::kNotStarted;
    case TaskSubmitter::Cancel::kKilled:
      return CancelOutcome::kKilled;
    case TaskSubmitter::Cancel::kRunning:
      break;
  }
  // Awaited (briefly), so that a task still in the executor's mailbox is
  // marked there before cancel returns and cannot start after it.
  auto told = tell ? tell(*r.executor, token_) : r.executor->control(CancelTask{token_});
  try {
    if (told.wait_for(kCancelReplyBound))
      return told.get() == kTaskNotStarted ? CancelOutcome::kNotStarted : CancelOutcome::kStarted;
    TROUPE_LOG_DEBUG("cancel: the executor of task '{}' did not answer within {} ms; it may still start it", name_,
                     kCancelReplyBound.count());
  } catch (const std::exception& e) {
    // Its executor is gone: the task went with it.
    TROUPE_LOG_DEBUG("cancel: telling the executor of task '{}': {}", name_, e.what());
  }
  return CancelOutcome::kStarted;
}

}  // namespace troupe::client
