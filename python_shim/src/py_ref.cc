#include "python_shim/src/py_ref.h"

#include <random>
#include <string>

#include "troupe/runtime/client/task_submitter.h"

namespace troupe::py {

std::shared_ptr<ReplyState> fetch_stored(client::Core& core, const ObjectRef<PyValue>& ref) {
  auto st = std::make_shared<ReplyState>();
  if (ref.holder()->owned()) {
    // Possibly a call's result that is not there yet (stored_ref).
    ref.holder()->store()->when_ready(ref.id(), [st, ref] {
      try {
        st->set_value(PyReply{0, ref.get()});
      } catch (...) {
        st->set_error(std::current_exception());
      }
    });
    return st;
  }
  auto store = ref.holder()->store();
  Future<wire::Message> fetched = store->fetch(ref.info());
  fetched.on_ready([st, fetched, c = &core, info = ref.info()] {
    try {
      wire::Message m = fetched.get();
      wire::Decoder d(m.body.data(), m.body.size(), &m.attachments, c);
      PyValue v = client::ObjectPayload<PyValue>::decode(d);
      if (!d.done()) throw DecodeError("trailing bytes after the payload of " + client::describe(info));
      st->set_value(PyReply{0, std::move(v)});
    } catch (...) {
      st->set_error(std::current_exception());
    }
  });
  return st;
}

std::string PyRef::pending_text() const {
  if (task_) {
    return task_->pending_text(core_->find_service<client::TaskSubmitter>().get());
  }
  if (call_) return call_->pending_text();
  // A stored object: a borrowed one waits for its owner's answer, an own
  // one for the call whose result it will hold.
  ObjectRef<PyValue> stored;
  {
    std::lock_guard lock(mu_);
    stored = stored_;
  }
  if (!stored.valid()) return "";
  const std::string what = client::describe(stored.info());
  return stored.holder()->owned() ? what + ", a call's result not come yet"
                                  : what +
                                        ": its owner has not sent it (a call's result not come there yet, or the "
                                        "owner busy or stopped)";
}

std::shared_ptr<ReplyState> PyRef::answer() {
  std::lock_guard lock(mu_);
  if (!answer_) answer_ = fetch_stored(*core_, stored_);
  return answer_;
}

ObjectRef<PyValue> PyRef::stored_ref() {
  std::lock_guard lock(mu_);
  if (stored_.valid()) return stored_;
  auto store = core_->service<client::ObjectStore>();
  if (answer_->ready() && !answer_->error()) {
    // An exception answer is kept as its value: its error box raises on
    // load. The answer is in this process already, the stored copy shares
    // its memory: kept whatever the store's limit.
    stored_ = ObjectRef<PyValue>(store->put_held(client::make_object_value(answer_->value().value)));
    return stored_;
  }
  // Not answered yet (or failed): a pending object, filled by the answer,
  // so that sending the ref on waits for nothing (as Ray's owner does).
  stored_ = ObjectRef<PyValue>(store->put_pending(client::make_object_value(PyValue{}).type));
  std::weak_ptr<client::ObjectStore> weak = store;
  answer_->on_ready([weak, id = stored_.id(), answer = std::weak_ptr<ReplyState>(answer_)] {
    auto s = weak.lock();
    auto a = answer.lock();
    if (!s || !a) return;
    if (auto e = a->error()) return s->fail(id, e);
    s->fill(id, client::make_object_value(a->value().value));
  });
  return stored_;
}

ReadySignal& ready_signal() {
  // Never destroyed: a ref may become ready while the process exits.
  static auto* signal = new ReadySignal;
  return *signal;
}

void bump_ready_signal() {
  auto& s = ready_signal();
  {
    std::lock_guard lock(s.mu);
    ++s.epoch;
  }
  s.cv.notify_all();
}

void PyRef::signal_when_ready() {
  if (signalling_.exchange(true)) return;
  answer()->on_ready(bump_ready_signal);
}

std::pair<uint64_t, uint64_t> PyRef::next_call_key() {
  // Call answers are numbered apart from every store's objects: under a
  // random number of this process's in place of a store instance.
  static const uint64_t calls = (uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
  static std::atomic<uint64_t> next{0};
  return {calls, next.fetch_add(1, std::memory_order_relaxed) + 1};
}

std::pair<uint64_t, uint64_t> PyRef::key() {
  std::lock_guard lock(mu_);
  if (!key_) key_.emplace(stored_.info().owner_instance, stored_.id());  // a stored ref: never a call's
  return *key_;
}

}  // namespace troupe::py
