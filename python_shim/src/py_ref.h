// PyRef: what Python sees as troupe.ObjectRef. Either the pending answer of
// a call or task (a future of its PyReply: the usual case, answered inline
// with no second round trip), or a stored object (troupe.put, or a ref that
// arrived inside a value), fetched from its owner on first use.
//
// A call result that must travel as a ref (nested in another value) becomes
// an object of this process's store at once (stored_ref()): a pending one,
// filled when the answer comes, if it has not come yet.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>

#include "python_shim/src/py_value.h"
#include "troupe/runtime/client/core.h"
#include "troupe/runtime/client/task_cancel.h"
#include "troupe/runtime/core/future.h"

namespace troupe::py {

using ReplyState = core::FutureState<PyReply>;

// Told whenever a ref that some wait asked about becomes ready: troupe.wait
// sleeps on it and counts again. Each ref registers one callback for it,
// the first time it is waited for, so a loop that waits on the same
// pending refs again and again (`while pending: ready, pending =
// wait(pending)`) adds nothing per call.
struct ReadySignal {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t epoch = 0;  // bumped by every ready
};
ReadySignal& ready_signal();
// Tells every waiter on ready_signal() to count again.
void bump_ready_signal();

class PyRef {
 public:
  PyRef(std::shared_ptr<client::Core> core, std::shared_ptr<ReplyState> answer)
      : core_(std::move(core)), from_call_(true), answer_(std::move(answer)), key_(next_call_key()) {}
  PyRef(std::shared_ptr<client::Core> core, ObjectRef<PyValue> stored)
      : core_(std::move(core)), stored_(std::move(stored)) {}
  // A task's result; `task` (shared with the task's submission, which waits
  // for its top-level arguments first) is how troupe.cancel reaches it.
  PyRef(std::shared_ptr<client::Core> core, std::shared_ptr<ReplyState> answer,
        std::shared_ptr<client::TaskCancel> task)
      : core_(std::move(core)),
        from_call_(true),
        answer_(std::move(answer)),
        task_(std::move(task)),
        key_(next_call_key()) {}
  // An actor method call's result; `call` is how troupe.cancel reaches it.
  PyRef(std::shared_ptr<client::Core> core, std::shared_ptr<ReplyState> answer,
        std::shared_ptr<client::CallCancel> call)
      : core_(std::move(core)),
        from_call_(true),
        answer_(std::move(answer)),
        call_(std::move(call)),
        key_(next_call_key()) {}

  // The state that completes with the value (for a stored ref: starts the
  // fetch from its owner on first use). Thread-safe.
  std::shared_ptr<ReplyState> answer();
  // The ref as a stored object of this process's store, made on first use
  // without waiting: a call's answer once it is there, a pending object
  // until then (its error, if the call fails, is what fetching it raises).
  // A Python exception answer is stored as is (its pickle is an error box,
  // which whoever loads it raises).
  ObjectRef<PyValue> stored_ref();
  // The stored ref of a ref that was never a call's (a put, a ref that
  // arrived inside a value), else null: a call's result goes by its answer
  // (inline, and waited for by the caller), even once it was sent on as a
  // ref, which may still be pending.
  // Whether it was a call's is fixed when the ref is made: a stored ref
  // fetched once (get, wait) has an answer too, and went inline as a
  // call's result, its whole value relayed through this process.
  std::optional<ObjectRef<PyValue>> stored_if_any() const {
    if (from_call_) return std::nullopt;
    std::lock_guard lock(mu_);
    if (!stored_.valid()) return std::nullopt;
    return stored_;
  }
  // Names this ref's object for the ref's whole life (hex, ==, hash): a
  // stored object by its owner store's instance and its id; a call's
  // answer by a number of this process's, given when the call is made and
  // kept after the answer was stored to be sent on.
  std::pair<uint64_t, uint64_t> key();
  // Bumps ready_signal() once this ref is ready (registered once).
  void signal_when_ready();
  // The task whose result this is, in the process that submitted it; else
  // null.
  const std::shared_ptr<client::TaskCancel>& task() const { return task_; }
  // The connection to the cluster the ref was made in.
  const std::shared_ptr<client::Core>& core() const { return core_; }
  // The actor call whose result this is, in the process that made it; else
  // null.
  const std::shared_ptr<client::CallCancel>& call() const { return call_; }
  // What this ref's value waits for, for a get that timed out: where its
  // task is (queued, and why; on which worker), or its actor's state (a
  // PENDING one's reason). "" when not known (a put, a ref received).
  std::string pending_text() const;

 private:
  std::shared_ptr<client::Core> core_;
  const bool from_call_ = false;  // made with a call's answer (not a put or a ref received)
  mutable std::mutex mu_;
  std::shared_ptr<ReplyState> answer_;
  ObjectRef<PyValue> stored_;
  std::shared_ptr<client::TaskCancel> task_;
  std::shared_ptr<client::CallCancel> call_;
  std::atomic<bool> signalling_{false};
  std::optional<std::pair<uint64_t, uint64_t>> key_;  // under mu_, once given
  static std::pair<uint64_t, uint64_t> next_call_key();
};

// The answer a stored ref's owner gives: the payload, decoded.
std::shared_ptr<ReplyState> fetch_stored(client::Core& core, const ObjectRef<PyValue>& ref);

}  // namespace troupe::py
