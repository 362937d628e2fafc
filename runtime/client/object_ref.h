// ObjectRef<T>: a reference to a value kept by the process that made it
// (its owner), as in Ray. rt.put(v) makes one in the calling process;
// handle.call_ref(&A::m, ...) makes one in the callee's process (the callee
// keeps the result and replies with a ref; chosen per call by the caller).
// A ref is a value: copy it, pass it to actor calls (or inside any Codec
// value), return it. The consumer's get() fetches the value straight from
// the owner's object server, never through the driver or the head; in the
// owner, get() copies the value out of the store with no wire in between.
//
//   troupe::ObjectRef<std::vector<float>> r = rt.put(std::vector<float>(1 << 20));
//   auto r2 = a.call_ref(&A::make_big, n).get();   // kept in a's process
//   b.call(&B::consume, r2).get();                  // b fetches from a
//
// The owner frees an object once no handle refers to it anywhere (see
// object_store.h for the counting). get() throws ObjectLost naming the
// owner when it died or cannot be reached, and Timeout past its bound.
#pragma once

#include <chrono>
#include <memory>
#include <typeinfo>

#include "troupe/runtime/client/object_store.h"

namespace troupe {

template <class T>
class ObjectRef {
 public:
  ObjectRef() = default;
  explicit ObjectRef(std::shared_ptr<client::RefHolder> holder) : holder_(std::move(holder)) {}

  // The value: from the local store when this process owns it, else
  // fetched from its owner.
  T get(std::chrono::milliseconds timeout = std::chrono::seconds(60)) const {
    if (!holder_) throw ConfigError("get() on an empty ObjectRef");
    auto store = holder_->store();
    const client::ObjectRefInfo& info = holder_->info();
    if (holder_->owned()) return *std::static_pointer_cast<const T>(store->local_value(info.id, typeid(T).name()));
    wire::Message m = holder_->fetch(timeout);
    wire::Decoder d(m.body.data(), m.body.size(), &m.attachments, store->core());
    T v = client::ObjectPayload<T>::decode(d);
    if (!d.done()) throw DecodeError("trailing bytes after the payload of " + client::describe(info));
    return v;
  }

  bool valid() const { return holder_ != nullptr; }
  // Owner, object id and type as the wire carries them.
  const client::ObjectRefInfo& info() const { return holder_->info(); }
  uint64_t id() const { return holder_ ? holder_->info().id : 0; }
  const std::shared_ptr<client::RefHolder>& holder() const { return holder_; }

 private:
  std::shared_ptr<client::RefHolder> holder_;
};

template <class T>
struct IsObjectRef : std::false_type {};
template <class T>
struct IsObjectRef<ObjectRef<T>> : std::true_type {};

}  // namespace troupe

namespace troupe::wire {

// A ref crosses the wire as its owner's address, the object and a pin for
// this copy (ObjectStore::encode_ref); decoding registers with the owner,
// which needs the decoding process's client core (Decoder::core()).
template <class T>
struct Codec<ObjectRef<T>> {
  static void encode(Encoder& e, const ObjectRef<T>& r) {
    if (!r.valid()) return e.write_pod<uint8_t>(0);
    r.holder()->store()->encode_ref(e, *r.holder());
    if (!e.is_measuring()) e.keep(r.holder());
  }
  static ObjectRef<T> decode(Decoder& d) {
    auto has = d.read_pod<uint8_t>();
    if (has > 1) throw DecodeError("bad object ref tag " + std::to_string(has));
    if (!has) return {};
    auto info = wire::decode<client::ObjectRefInfo>(d);
    if (info.type != typeid(T).name())
      throw DecodeError("an object ref to a " + info.type + " was decoded as a ref to a " + typeid(T).name());
    if (!d.core()) throw DecodeError("an ObjectRef can only be decoded with the process's client core (Decoder::core)");
    return ObjectRef<T>(d.core()->service<client::ObjectStore>()->adopt(std::move(info)));
  }
};

}  // namespace troupe::wire
