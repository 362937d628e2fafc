#include "python_shim/src/py_ref.h"

namespace troupe::py {

std::shared_ptr<ReplyState> fetch_stored(client::Core& core, const ObjectRef<PyValue>& ref) {
  auto st = std::make_shared<ReplyState>();
  if (ref.holder()->owned()) {
    try {
      st->set_value(PyReply{0, ref.get()});
    } catch (...) {
      st->set_error(std::current_exception());
    }
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

std::shared_ptr<ReplyState> PyRef::answer() {
  std::lock_guard lock(mu_);
  if (!answer_) answer_ = fetch_stored(*core_, stored_);
  return answer_;
}

ObjectRef<PyValue> PyRef::stored_ref() {
  std::shared_ptr<ReplyState> pending;
  {
    std::lock_guard lock(mu_);
    if (stored_.valid()) return stored_;
    pending = answer_;
  }
  pending->wait();
  if (auto e = pending->error()) std::rethrow_exception(e);
  // An exception answer is kept as its value: its error box raises on load.
  auto store = core_->service<client::ObjectStore>();
  ObjectRef<PyValue> made(store->put(client::make_object_value(pending->value().value)));
  std::lock_guard lock(mu_);
  if (!stored_.valid()) stored_ = std::move(made);
  return stored_;
}

uint64_t PyRef::id() const { return stored_.valid() ? stored_.id() : reinterpret_cast<uintptr_t>(answer_.get()); }

}  // namespace troupe::py
