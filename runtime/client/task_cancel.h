// Cancelling tasks (Runtime::cancel from C++, troupe.cancel from Python).
//
// The submitting side keeps a TaskCancel per task (a C++ task's future
// state is one, TaskFutureState): its token (the name the executor knows it by,
// written into the task's body after the task's name), and its
// TaskSubmitter id once submitted. TaskCancel::cancel fails
// the task's future with TaskCancelled at once (TaskSubmitter::cancel) and,
// for a task already sent to an executor, tells that executor.
//
// The executing side is one record per worker process: the task executor
// calls begin_task before it runs a task and end_task after; the CancelTask
// control (served on the worker's I/O thread, from its start) marks a
// token cancelled before it replies, so a task still waiting in the
// executor's mailbox never starts, and says whether the task had started.
// A running C++ task is not stopped (no C++ function can be stopped midway
// safely): it runs to its end and its result is dropped, unless the cancel
// is forced, which kills the executor. The Python worker interrupts a
// running Python task on top of this (python_shim/src/py_worker.cc).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "troupe/runtime/core/future.h"
#include "troupe/runtime/wire/codec.h"

namespace troupe {

// What cancelling a task found (Runtime::cancel).
enum class CancelOutcome {
  kFinished,    // it had finished or failed: the future holds its result
  kNotStarted,  // it had not started, and never will
  kStarted,     // it had started (a C++ task runs to its end, a Python task
                // is interrupted); its result is dropped
  kKilled,      // it had started, and its worker was killed (force)
};

namespace client {

class ActorClient;
class TaskSubmitter;

// What a worker knew of a task it was told is cancelled.
enum TaskState : int32_t {
  kTaskNotStarted = 0,  // not started: marked, it never will
  kTaskRunning = 1,     // running now
  kTaskFinished = 2,    // it ran to its end already
};

// Control message to a task executor's worker: task `token` is cancelled.
// Replies a TaskState.
struct CancelTask {
  static constexpr const char* kControlTag = "troupe.task.cancel";
  using Reply = int32_t;
  uint64_t token = 0;
  TROUPE_FIELDS(token)
};

// The executing side (process-wide, thread-safe). Token 0 is a task that
// cannot be cancelled there and is not recorded.
// Marks `token` cancelled unless it runs or ran; returns what was known.
TaskState mark_task_cancelled(uint64_t token);
// As a task starts: false when it was cancelled (then it must not run).
bool begin_task(uint64_t token);
// As a task ends (returned or threw).
void end_task(uint64_t token);

// How long TaskCancel waits for an executor's answer to CancelTask.
inline constexpr std::chrono::milliseconds kCancelReplyBound{2000};

// The submitting side: one per task, shared by the code that submits it
// and the code that cancels it (a C++ task's future state is one,
// TaskFutureState). Thread-safe and lock-free: it is made for every task.
class TaskCancel {
 public:
  // `owner`: TaskSubmitter::instance() of the submitter it goes to.
  TaskCancel(std::string name, uint64_t owner);
  virtual ~TaskCancel() = default;
  TaskCancel(const TaskCancel&) = delete;
  TaskCancel& operator=(const TaskCancel&) = delete;

  // A token unique in this process (and unlikely to meet another's).
  uint64_t token() const { return token_; }
  const std::string& name() const { return name_; }
  uint64_t owner() const { return owner_; }

  // Submits the task once, unless it was cancelled first: `submit()`
  // encodes and hands it to the TaskSubmitter and returns its id. A cancel
  // meanwhile waits for that id (the task may already be on an executor);
  // a submit that throws leaves the task unsubmitted.
  template <class Submit>
  void submit_once(Submit&& submit) {
    if (!begin_submit()) return;  // cancelled while it waited for its arguments
    uint64_t id = 0;
    try {
      id = submit();
    } catch (...) {
      id_.store(0);
      throw;
    }
    id_.store(id);
  }

  // Sends the executor that holds the task the control message that tells
  // it (CancelTask by default; the Python shim's interrupts a running
  // task too); the reply is a TaskState.
  using TellExecutor = std::function<Future<int32_t>(ActorClient& executor, uint64_t token)>;
  // Cancels the task: unless it had finished, `answer` (its future's state)
  // fails with TaskCancelled now. A task sent to an executor is told
  // through `tell`, whose reply is waited for up to kCancelReplyBound. Any
  // thread but the I/O thread (which submits tasks, and whose answers a
  // cancel waits for).
  CancelOutcome cancel(TaskSubmitter& s, core::FutureStateBase& answer, bool force, const TellExecutor& tell = {});

 private:
  bool begin_submit();
  // id_ before submission (0), while it is being submitted, and once
  // cancelled before it; then the submitter's id.
  static constexpr uint64_t kCancelledUnsubmitted = ~uint64_t{0};
  static constexpr uint64_t kSubmitting = ~uint64_t{0} - 1;
  const std::string name_;
  const uint64_t owner_;
  const uint64_t token_;
  std::atomic<uint64_t> id_{0};
};

// A C++ task's future state (Runtime::submit): its answer and its
// TaskCancel in one allocation; Runtime::cancel finds the second by
// dynamic_cast from the first.
template <class R>
class TaskFutureState final : public core::FutureState<R>, public TaskCancel {
 public:
  TaskFutureState(std::string name, uint64_t owner) : TaskCancel(std::move(name), owner) {}
};

}  // namespace client
}  // namespace troupe
