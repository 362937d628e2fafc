#include "troupe/runtime/client/task_cancel.h"

#include <atomic>
#include <deque>
#include <random>
#include <unordered_set>

#include "troupe/runtime/client/control.h"
#include "troupe/runtime/client/core.h"
#include "troupe/runtime/client/task_submitter.h"
#include "troupe/runtime/core/logging.h"

namespace troupe::client {

namespace {

// A set of tokens that forgets its oldest beyond a bound: tasks cancelled
// while they waited (a mailbox holds at most the submitter's pipeline
// depth, 256) and tasks that finished lately (a cancel may cross a
// finished task's reply).
class BoundedTokens {
 public:
  void insert(uint64_t token) {
    if (!set_.insert(token).second) return;
    order_.push_back(token);
    while (order_.size() > kKept) {
      set_.erase(order_.front());
      order_.pop_front();
    }
  }
  bool contains(uint64_t token) const { return set_.count(token) > 0; }
  bool erase(uint64_t token) { return set_.erase(token) > 0; }

 private:
  static constexpr size_t kKept = 4096;
  std::unordered_set<uint64_t> set_;
  std::deque<uint64_t> order_;
};

struct TaskRecord {
  std::mutex mu;
  BoundedTokens cancelled, finished;
  std::unordered_set<uint64_t> running;
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
  if (r.running.count(token)) return kTaskRunning;
  if (r.finished.contains(token)) return kTaskFinished;
  r.cancelled.insert(token);
  return kTaskNotStarted;
}

bool begin_task(uint64_t token) {
  if (token == 0) return true;
  auto& r = record();
  std::lock_guard lock(r.mu);
  if (r.cancelled.erase(token)) return false;
  r.running.insert(token);
  return true;
}

void end_task(uint64_t token) {
  if (token == 0) return;
  auto& r = record();
  std::lock_guard lock(r.mu);
  r.running.erase(token);
  r.finished.insert(token);
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

TaskCancel::TaskCancel(std::string name) : name_(std::move(name)), token_(next_token()) {}

bool TaskCancel::may_submit() {
  std::lock_guard lock(mu_);
  return !cancelled_;
}

void TaskCancel::submitted(TaskSubmitter& s, uint64_t id) {
  bool cancelled = false;
  {
    std::lock_guard lock(mu_);
    id_ = id;
    cancelled = cancelled_;
  }
  // Cancelled while it was being submitted: most likely still queued here.
  if (cancelled) s.cancel(id, false);
}

CancelOutcome TaskCancel::cancel(TaskSubmitter& s, core::FutureStateBase& answer, bool force, const AskExecutor& ask) {
  uint64_t id = 0;
  {
    std::lock_guard lock(mu_);
    if (id_ == 0) cancelled_ = true;
    id = id_;
  }
  if (id == 0) {
    // Its arguments are not all there yet: it is never submitted.
    const bool done = answer.ready();
    answer.set_error(std::make_exception_ptr(TaskCancelled("task '" + name_ + "' was cancelled")));
    return done ? CancelOutcome::kFinished : CancelOutcome::kNotStarted;
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
  if (ask) return ask(*r.executor);
  // Awaited (briefly), so that a task still in the executor's mailbox is
  // marked there before cancel returns and cannot start after it.
  auto told = r.executor->control(CancelTask{token_});
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
