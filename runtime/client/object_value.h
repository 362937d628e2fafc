// What an object reference names, and a value kept by its owner with its
// type erased. The object store (object_store.h) holds ObjectValues; the
// worker turns a call_ref result into one without knowing ObjectRef.
//
// A value goes to a consumer in its *payload* encoding: Codec<T>, except
// that a vector of arithmetic values travels as one attachment that views
// the owner's vector (no copy on the owner's side; Codec<Buffer> attaches
// large buffers already).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include "troupe/runtime/wire/codec.h"

namespace troupe::client {

// An object reference on the wire: where its owner serves it, who the owner
// is (for ObjectLost messages), the object, its type, and the pin that keeps
// it alive until the receiver has registered (see ObjectStore).
struct ObjectRefInfo {
  std::string owner_address;    // HOST:PORT of the owner's object server
  uint64_t owner_instance = 0;  // random per owner store: a reused port is not the owner
  int32_t owner_pid = 0;
  uint64_t owner_actor = 0;  // 0: a driver
  uint64_t id = 0;
  std::string type;  // typeid(T).name()
  uint64_t pin = 0;  // the sender's pin for this copy (0: none)
  TROUPE_FIELDS(owner_address, owner_instance, owner_pid, owner_actor, id, type, pin)
};

// "object 3 of 127.0.0.1:4242 (pid 123, actor 7)": names the owner in errors.
std::string describe(const ObjectRefInfo& info);

// A value kept by its owner: the typed value (a local get copies it out),
// how it goes on the wire, and its size for the store's limit.
struct ObjectValue {
  std::shared_ptr<const void> value;
  void (*encode)(const std::shared_ptr<const void>& value, wire::Encoder& e) = nullptr;
  uint64_t bytes = 0;
  // Its payload's message part and attachment count, which a receiver's
  // frame limits bound (0 where not measured: file pieces).
  uint64_t inline_bytes = 0;
  uint64_t attachments = 0;
  const char* type = "";
};

// What a value costs its owner's store (`bytes`), and the shape of its
// payload on the wire (ObjectValue's fields of the same names).
struct ObjectSize {
  uint64_t bytes = 0;
  uint64_t inline_bytes = 0;
  uint64_t attachments = 0;
};

template <class T>
struct IsArithmeticVector : std::false_type {};
template <class E, class A>
struct IsArithmeticVector<std::vector<E, A>> : std::bool_constant<std::is_arithmetic_v<E>> {};

// The payload encoding of T (see the top of this file).
template <class T>
struct ObjectPayload {
  static void encode(const std::shared_ptr<const T>& v, wire::Encoder& e) {
    if constexpr (IsArithmeticVector<T>::value) {
      e.write_size(v->size());
      e.attach(Buffer(v, reinterpret_cast<const std::byte*>(v->data()), v->size() * sizeof(typename T::value_type)));
    } else {
      wire::encode(e, *v);
    }
  }
  static T decode(wire::Decoder& d) {
    if constexpr (IsArithmeticVector<T>::value) {
      uint64_t n = d.read_size();
      Buffer b = d.attachment();
      if (b.size() != n * sizeof(typename T::value_type))
        throw DecodeError("object payload of " + std::to_string(n) + " elements has " + std::to_string(b.size()) +
                          " bytes");
      T v(n);
      if (n) std::memcpy(v.data(), b.data(), b.size());
      return v;
    } else {
      return wire::decode<T>(d);
    }
  }
  static ObjectSize measure(const T& v) {
    if constexpr (IsArithmeticVector<T>::value) {
      return {v.size() * sizeof(typename T::value_type), sizeof(uint64_t) * 2, 1};
    } else if constexpr (std::is_same_v<T, std::string>) {
      return {v.size(), v.size() + sizeof(uint64_t), 0};
    } else if constexpr (std::is_same_v<T, Buffer>) {
      const bool attached = v.size() >= wire::kAttachThreshold;
      return {v.size(), attached ? 16 : v.size() + 16, attached ? 1u : 0u};
    } else {
      // Measured, not sent: refs inside take no pins (they leaked one each).
      wire::Encoder e = wire::Encoder::measuring();
      wire::encode(e, v);
      uint64_t n = e.bytes().size();
      for (const auto& a : e.attachments()) n += a.size();
      return {n, e.bytes().size(), e.attachments().size()};
    }
  }
};

template <class T>
ObjectValue make_object_value(T v) {
  ObjectValue o;
  const ObjectSize size = ObjectPayload<T>::measure(v);
  o.bytes = size.bytes;
  o.inline_bytes = size.inline_bytes;
  o.attachments = size.attachments;
  o.value = std::make_shared<const T>(std::move(v));
  o.encode = [](const std::shared_ptr<const void>& p, wire::Encoder& e) {
    ObjectPayload<T>::encode(std::static_pointer_cast<const T>(p), e);
  };
  o.type = typeid(T).name();
  return o;
}

// A piece of a file its owner reads each time the object is asked for (a
// fetch, a local get), holding no memory meanwhile: an object of type
// Buffer. ship_file serves a file this way, so that a driver does not keep
// a data set it ships in memory for the whole job. Errors naming the file
// when it can no longer be read whole (it shrank, it was removed).
ObjectValue file_piece_value(const std::string& path, uint64_t offset, uint64_t size);
// A file this process holds open, closed when the last of its pieces goes
// (an unlinked file's disk is freed then).
struct OpenFile {
  int fd = -1;
  explicit OpenFile(int f) : fd(f) {}
  ~OpenFile();
  OpenFile(const OpenFile&) = delete;
  OpenFile& operator=(const OpenFile&) = delete;
};
// A piece of `file`, read through its descriptor; `name` is what messages
// call it.
ObjectValue file_piece_value(std::shared_ptr<const OpenFile> file, const std::string& name, uint64_t offset,
                             uint64_t size);
// The typed value of `v`: a file piece's bytes read now, else v.value.
std::shared_ptr<const void> value_of(const ObjectValue& v);

// Keeps a call's result with the callee and writes a reference to it into
// the reply (the worker's side of ActorHandle::call_ref).
using ObjectSink = std::function<void(ObjectValue value, wire::Encoder& reply)>;

}  // namespace troupe::client
