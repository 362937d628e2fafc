// Cancelling tasks and actor calls (Runtime::cancel from C++, troupe.cancel
// from Python).
//
// The submitting side keeps one object per task or call, shared by the
// code that submits it and the code that cancels it (a C++ future's state
// is one: TaskFutureState, CallFutureState):
// - TaskCancel, a task's: its token (the name its executor knows it by,
//   written into the task's body after the task's name), and its
//   TaskSubmitter id once submitted;
// - CallCancel, an actor method call's: its call id, which is the token its
//   actor knows it by (call ids are unique in a process, unique_call_id()).
// Either cancel fails the future with TaskCancelled at once and, for what
// was already sent, tells the worker that holds it.
//
// The executing side is one record per worker process: a task executor,
// and an actor for each call, calls begin_task before it runs one and
// end_task after; the CancelTask control (served on the worker's I/O
// thread, from its start) marks a token cancelled before it replies, so
// that what still waits in a mailbox or on the wire never starts, and says
// whether it had started. What runs is not stopped (no C++ function can be
// stopped midway safely; an actor's state would be left half-changed): it
// runs to its end and its result is dropped, and it may ask
// this_actor::is_cancelled() to end early. A forced task cancel kills the
// executor; an actor call cannot be forced. The Python worker interrupts a
// running Python task, and cancels an async actor method's coroutine, on
// top of this (python_shim/src/py_worker.cc).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "troupe/runtime/core/future.h"
#include "troupe/runtime/wire/codec.h"

namespace troupe {

// What cancelling a task or an actor call found (Runtime::cancel).
enum class CancelOutcome {
  kFinished,    // it had finished or failed: the future holds its result
  kNotStarted,  // it had not started, and never will
  kStarted,     // it had started (it runs to its end, or a Python task is
                // interrupted, an async method's coroutine cancelled); its
                // result is dropped
  kKilled,      // it had started, and its worker was killed (force)
};

namespace client {

class ActorClient;
class Core;
class TaskSubmitter;

// How the API a cancel came through names itself, in the errors that the
// checks of TaskCancel::cancel and CallCancel::cancel raise.
struct CancelApi {
  const char* name;   // "Runtime::cancel"
  const char* owner;  // what made the task or call: "Runtime", "troupe.init"
  const char* force;  // its force flag: "force", "force=True"
  const char* kill;   // how to kill an actor: "kill", "troupe.kill"
};
inline constexpr CancelApi kCppCancelApi{"Runtime::cancel", "Runtime", "force", "kill"};

// A number that names a task or an actor call to the worker that runs it:
// unique in this process, and from a random start, so that the numbers of
// two processes hardly ever meet at one worker. Never 0.
uint64_t unique_call_id();

// What a worker knew of a task or call it was told is cancelled.
enum TaskState : int32_t {
  kTaskNotStarted = 0,  // not started: marked, it never will
  kTaskRunning = 1,     // running now (this_actor::is_cancelled() says so)
  kTaskFinished = 2,    // it ran to its end already
};

// Control message to the worker of a task executor or an actor: the task
// or call `token` is cancelled. Replies a TaskState.
struct CancelTask {
  static constexpr const char* kControlTag = "troupe.task.cancel";
  using Reply = int32_t;
  uint64_t token = 0;
  TROUPE_FIELDS(token)
};

// The executing side (process-wide, thread-safe). Token 0 is a task that
// cannot be cancelled there and is not recorded.
// Marks `token` cancelled: one that has not started never will; one that
// runs is flagged for is_cancelled(). Returns what was known.
TaskState mark_task_cancelled(uint64_t token);
// As a task or call starts, on the thread that runs it: false when it was
// cancelled (then it must not run).
bool begin_task(uint64_t token);
// As it ends (returned or threw), on the same thread.
void end_task(uint64_t token);
// On the thread of a running task or call: whether it was cancelled since
// it began; nullopt on a thread that runs none (this_actor::is_cancelled).
std::optional<bool> current_task_cancelled();
// The token of the task or call this thread runs; 0 for none.
uint64_t current_task_token();

// How long a cancel waits for the worker's answer to CancelTask (its I/O
// thread answers at once, whatever the task or call does; a dead worker's
// refusal comes sooner): what a cancel says of one on the wire depends on
// that answer.
inline constexpr std::chrono::milliseconds kCancelReplyBound{10000};

// Sends the worker that holds a task or call the control message that
// tells it (CancelTask by default; the Python shim's also interrupts a
// running task); the reply is a TaskState.
using TellExecutor = std::function<Future<int32_t>(ActorClient& executor, uint64_t token)>;

// What a task and a call share: submitted at most once, and never once
// cancelled first. Thread-safe and lock-free: there is one for every task
// and call.
class SubmitOnce {
 public:
  SubmitOnce(const SubmitOnce&) = delete;
  SubmitOnce& operator=(const SubmitOnce&) = delete;

  // The id submit() returned; 0 while it was not submitted (it waits for
  // its arguments, or was cancelled first).
  uint64_t submitted_id() const {
    const uint64_t id = id_.load();
    return id == kCancelledUnsubmitted || id == kSubmitting ? 0 : id;
  }

  // Submits once, unless cancelled first: `submit()` encodes and hands it
  // on and returns its id there (a TaskSubmitter's task id, a call id). A
  // cancel meanwhile waits for that id (it may already be on a worker); a
  // submit that throws leaves it unsubmitted.
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

 protected:
  SubmitOnce() = default;
  virtual ~SubmitOnce() = default;
  // For a cancel: the id submit() returned, waiting while it runs on
  // another thread. 0 when it was never submitted and now never will be:
  // then `answer` has failed with TaskCancelled(`error`) (unless it had a
  // result) and `outcome` says which.
  uint64_t claim_for_cancel(core::FutureStateBase& answer, const std::string& error, CancelOutcome& outcome);
  // Tells the worker that holds it (`tell`, or CancelTask) and waits up to
  // kCancelReplyBound for what it knew.
  static CancelOutcome tell_worker(ActorClient& worker, uint64_t token, const TellExecutor& tell,
                                   const std::string& what);

 private:
  bool begin_submit();
  // id_ before submission (0), while it is being submitted, and once
  // cancelled before it; then the submission's id.
  static constexpr uint64_t kCancelledUnsubmitted = ~uint64_t{0};
  static constexpr uint64_t kSubmitting = ~uint64_t{0} - 1;
  std::atomic<uint64_t> id_{0};
};

// A task's (Runtime::submit, troupe's remote functions).
class TaskCancel : public SubmitOnce {
 public:
  // `owner`: TaskSubmitter::instance() of the submitter it goes to.
  TaskCancel(std::string name, uint64_t owner);

  // The task's token, written into its body (unique_call_id()).
  uint64_t token() const { return token_; }
  const std::string& name() const { return name_; }
  uint64_t owner() const { return owner_; }
  // What the task waits for, for a wait that timed out: its arguments, or
  // where `s` has it (TaskSubmitter::describe); "" once it ended, or when
  // `s` is null or not the submitter it went to. Any thread.
  std::string pending_text(const TaskSubmitter* s) const;

  // Cancels the task: unless it had finished, `answer` (its future's state)
  // fails with TaskCancelled now. A task sent to an executor is told
  // through `tell`; with `force`, a running one's executor is killed.
  // ConfigError (named as `api` names itself) when `s` is not the
  // submitter it was submitted through. Any thread but the I/O thread
  // (which submits tasks, and whose answers a cancel waits for).
  CancelOutcome cancel(TaskSubmitter& s, core::FutureStateBase& answer, bool force, const CancelApi& api,
                       const TellExecutor& tell = {});

 private:
  const std::string name_;
  const uint64_t owner_;
  const uint64_t token_;
};

// An actor method call's (ActorHandle::call and call_ref, a Python actor
// method's ref). Its submit() is ActorClient::submit, whose call id is the
// token the actor knows the call by.
class CallCancel : public SubmitOnce {
 public:
  // `method`: the method's name, for the error; a C++ actor's (its
  // method_names(), which live as long as the process) is not copied.
  CallCancel(const std::string* method, std::weak_ptr<ActorClient> actor);
  CallCancel(std::string method, std::weak_ptr<ActorClient> actor);

  const std::string& method() const { return *method_; }
  // Null once its client core is gone.
  std::shared_ptr<ActorClient> actor() const { return actor_.lock(); }
  // What the call waits for, for a wait that timed out: its arguments, or
  // its actor (PENDING and why, RESTARTING, DEAD, or alive and not
  // answering yet). "" once its client core is gone. Any thread.
  std::string pending_text() const;

  // Cancels the call: unless it had finished, `answer` fails with
  // TaskCancelled now. A call waiting for its arguments or for its actor
  // (restarting, connecting) is never sent; one sent is marked at the
  // actor, which skips it if it has not started. One that runs goes on to
  // its end (an actor's state would be left half-changed otherwise: there
  // is no force) and may ask this_actor::is_cancelled(); an async Python
  // method's coroutine is cancelled (`tell`). ConfigError (named as `api`
  // names itself) when the call was made through another client core than
  // `caller`, or with `force`. Any thread but the I/O thread.
  CancelOutcome cancel(const Core& caller, core::FutureStateBase& answer, bool force, const CancelApi& api,
                       const TellExecutor& tell = {});

 private:
  const std::string owned_;
  const std::string* const method_;
  const std::weak_ptr<ActorClient> actor_;
};

// A C++ task's future state (Runtime::submit): its answer and its
// TaskCancel in one allocation; Runtime::cancel finds the second by
// dynamic_cast from the first.
template <class R>
class TaskFutureState final : public core::FutureState<R>, public TaskCancel {
 public:
  TaskFutureState(std::string name, uint64_t owner, std::weak_ptr<TaskSubmitter> submitter)
      : TaskCancel(std::move(name), owner), submitter_(std::move(submitter)) {}
  std::string pending_text() const override { return TaskCancel::pending_text(submitter_.lock().get()); }

 private:
  const std::weak_ptr<TaskSubmitter> submitter_;
};

// The same for an actor call (ActorHandle::call, call_ref).
template <class R>
class CallFutureState final : public core::FutureState<R>, public CallCancel {
 public:
  CallFutureState(const std::string* method, std::weak_ptr<ActorClient> actor) : CallCancel(method, std::move(actor)) {}
  std::string pending_text() const override { return CallCancel::pending_text(); }
};

}  // namespace client
}  // namespace troupe
