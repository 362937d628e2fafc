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

// What runs on every task and call is kept cheap (an executor serves
// hundreds of thousands a second): those running now (one, for a worker
// that runs one at a time) and a ring of those that ended lately, which
// only a cancel, rare, searches (a cancel may cross a finished one's
// reply; a busy actor of many callers ends thousands while one reply
// travels).
struct Running {
  uint64_t token;
  bool cancelled;  // since it began
};
struct TaskRecord {
  std::mutex mu;
  CancelledTokens cancelled;
  std::vector<Running> running;
  static constexpr size_t kRecent = 8192;
  std::array<uint64_t, kRecent> ended{};
  size_t next_ended = 0;
};

TaskRecord& record() {
  static auto* r = new TaskRecord;  // used by detached threads until _Exit
  return *r;
}

// The token of the task or call this thread runs.
thread_local uint64_t tls_current = 0;

std::vector<Running>::iterator find_running(TaskRecord& r, uint64_t token) {
  return std::find_if(r.running.begin(), r.running.end(), [token](const Running& x) { return x.token == token; });
}

const bool registered = register_process_control(
    CancelTask::kControlTag,
    typed_control_handler<CancelTask>([](const CancelTask& m) -> int32_t { return mark_task_cancelled(m.token); }));

}  // namespace

uint64_t unique_call_id() {
  // Below 2^62 at the start, so that ids keep increasing (an ActorClient
  // orders retries by them) for as long as any process lives.
  static std::atomic<uint64_t> next{[] {
    std::random_device rd;
    return ((static_cast<uint64_t>(rd()) << 32 | rd()) >> 2) | 1;
  }()};
  return next.fetch_add(1, std::memory_order_relaxed);
}

TaskState mark_task_cancelled(uint64_t token) {
  (void)registered;
  if (token == 0) return kTaskFinished;
  auto& r = record();
  std::lock_guard lock(r.mu);
  if (auto it = find_running(r, token); it != r.running.end()) {
    it->cancelled = true;
    return kTaskRunning;
  }
  if (std::find(r.ended.begin(), r.ended.end(), token) != r.ended.end()) return kTaskFinished;
  r.cancelled.insert(token);
  return kTaskNotStarted;
}

bool begin_task(uint64_t token) {
  if (token == 0) return true;
  auto& r = record();
  std::lock_guard lock(r.mu);
  if (!r.cancelled.empty() && r.cancelled.erase(token)) return false;
  r.running.push_back({token, false});
  tls_current = token;
  return true;
}

void end_task(uint64_t token) {
  if (token == 0) return;
  tls_current = 0;
  auto& r = record();
  std::lock_guard lock(r.mu);
  if (auto it = find_running(r, token); it != r.running.end()) r.running.erase(it);
  r.ended[r.next_ended++ % TaskRecord::kRecent] = token;
}

std::optional<bool> current_task_cancelled() {
  const uint64_t token = tls_current;
  if (token == 0) return std::nullopt;
  auto& r = record();
  std::lock_guard lock(r.mu);
  auto it = find_running(r, token);
  return it != r.running.end() && it->cancelled;
}

uint64_t current_task_token() { return tls_current; }

bool SubmitOnce::begin_submit() {
  uint64_t before = 0;
  return id_.compare_exchange_strong(before, kSubmitting);
}

uint64_t SubmitOnce::claim_for_cancel(core::FutureStateBase& answer, const std::string& error, CancelOutcome& outcome) {
  uint64_t id = 0;
  if (id_.compare_exchange_strong(id, kCancelledUnsubmitted)) {
    // Its arguments are not all there yet: it is never submitted.
    outcome = answer.ready() ? CancelOutcome::kFinished : CancelOutcome::kNotStarted;
    answer.set_error(std::make_exception_ptr(TaskCancelled(error)));
    return 0;
  }
  // Cancelled already, before it was submitted: its future holds that.
  if (id == kCancelledUnsubmitted) {
    outcome = CancelOutcome::kFinished;
    return 0;
  }
  // Being submitted (on the I/O thread, which does not wait for anything
  // here): it may already be on a worker, so wait for its id.
  while (id == kSubmitting) {
    std::this_thread::yield();
    id = id_.load();
  }
  return id;
}

CancelOutcome SubmitOnce::tell_worker(ActorClient& worker, uint64_t token, const TellExecutor& tell,
                                      const std::string& what) {
  // Awaited (briefly), so that what still waits in the worker's mailbox
  // or on the wire is marked there before cancel returns and cannot start
  // after it.
  auto told = tell ? tell(worker, token) : worker.control(CancelTask{token});
  try {
    if (told.wait_for(kCancelReplyBound))
      return told.get() == kTaskNotStarted ? CancelOutcome::kNotStarted : CancelOutcome::kStarted;
    TROUPE_LOG_DEBUG("cancel: the worker of {} did not answer within {} ms; it may still start it", what,
                     kCancelReplyBound.count());
  } catch (const std::exception& e) {
    // Its worker is gone: what it held went with it.
    TROUPE_LOG_DEBUG("cancel: telling the worker of {}: {}", what, e.what());
  }
  return CancelOutcome::kStarted;
}

TaskCancel::TaskCancel(std::string name, uint64_t owner)
    : name_(std::move(name)), owner_(owner), token_(unique_call_id()) {}

std::string TaskCancel::pending_text(const TaskSubmitter* s) const {
  const uint64_t id = submitted_id();
  if (id == 0) return "task '" + name_ + "' waits for its arguments";
  return s != nullptr && s->instance() == owner_ ? s->describe(id) : "";
}

std::string CallCancel::pending_text() const {
  auto a = actor();
  if (!a) return "";
  const auto info = a->info();
  const std::string call = info.class_name + "." + method() + " on actor " + std::to_string(info.id);
  // Not sent yet: an argument's value is not there (the actor has not seen it).
  if (submitted_id() == 0) return call + " waits for its arguments";
  auto because = [](const std::string& why) { return why.empty() ? std::string() : " (" + why + ")"; };
  switch (info.state) {
    case wire::ActorState::kPending:
      return call + ": the actor is PENDING" + because(info.pending_reason);
    case wire::ActorState::kRestarting:
      return call + ": the actor is RESTARTING" + because(info.death_cause);
    case wire::ActorState::kDead:
      return call + ": the actor is DEAD" + because(info.death_cause);
    case wire::ActorState::kAlive:
      break;
  }
  return call + ": the actor (worker pid " + std::to_string(info.pid) + ") has not answered it yet";
}

CancelOutcome TaskCancel::cancel(TaskSubmitter& s, core::FutureStateBase& answer, bool force, const CancelApi& api,
                                 const TellExecutor& tell) {
  if (owner_ != s.instance())
    throw ConfigError(std::string(api.name) + ": task '" + name_ + "' was submitted through another " + api.owner);
  const std::string what = "task '" + name_ + "'";
  CancelOutcome outcome{};
  const uint64_t id = claim_for_cancel(answer, what + " was cancelled", outcome);
  if (id == 0) return outcome;
  // The submitter fails the task's future itself (with how it went).
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
  return tell_worker(*r.executor, token_, tell, what);
}

CallCancel::CallCancel(const std::string* method, std::weak_ptr<ActorClient> actor)
    : method_(method), actor_(std::move(actor)) {}

CallCancel::CallCancel(std::string method, std::weak_ptr<ActorClient> actor)
    : owned_(std::move(method)), method_(&owned_), actor_(std::move(actor)) {}

CancelOutcome CallCancel::cancel(const Core& caller, core::FutureStateBase& answer, bool force, const CancelApi& api,
                                 const TellExecutor& tell) {
  auto actor = actor_.lock();
  if (actor && &actor->core() != &caller)
    throw ConfigError(std::string(api.name) + ": the call of " + *method_ + " was made through another " + api.owner);
  if (force)
    throw ConfigError(std::string(api.name) + ": " + api.force + " is for tasks; a running actor call (" + *method_ +
                      ") cannot be forced without losing its actor's state: " + api.kill + " the actor instead");
  const std::string what = "call " + (actor ? actor->info().class_name : std::string("actor")) + "." + *method_;
  CancelOutcome outcome{};
  const uint64_t id = claim_for_cancel(answer, what + " was cancelled", outcome);
  if (id == 0) return outcome;
  // Its client core is gone, and the call failed with it.
  if (!actor) return CancelOutcome::kFinished;
  switch (actor->withdraw(id)) {
    case ActorClient::Withdrawn::kNone:  // answered (or failed) already
      return CancelOutcome::kFinished;
    case ActorClient::Withdrawn::kQueued:
      answer.set_error(std::make_exception_ptr(TaskCancelled(what + " was cancelled")));
      return CancelOutcome::kNotStarted;
    case ActorClient::Withdrawn::kSent:
      break;
  }
  answer.set_error(std::make_exception_ptr(TaskCancelled(what + " was cancelled")));
  return tell_worker(*actor, id, tell, what);
}

}  // namespace troupe::client
