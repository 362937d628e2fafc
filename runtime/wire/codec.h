// Codec<T>: how user values cross the wire. Built in for arithmetic types,
// enums, strings, vectors, arrays, maps, sets, optionals, pairs, tuples,
// troupe::Buffer (large ones travel as frame attachments, not copied into
// the message) and structs that list their fields with TROUPE_FIELDS.
//
// The encoding is little-endian, fixed-width, length-prefixed. Decoding is
// bounds-checked: truncated or malformed bytes throw troupe::DecodeError,
// never read out of range. Torch-aware layers add Codec<torch::Tensor>.
#pragma once

#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <unordered_map>
#include <utility>
#include <vector>

#include "troupe/runtime/core/buffer.h"
#include "troupe/runtime/core/errors.h"

namespace troupe::client {
class Core;
}

namespace troupe::wire {

// Buffers at least this large go as attachments instead of inline bytes.
inline constexpr size_t kAttachThreshold = 16 * 1024;
// Upper bound on any decoded container length, so a forged length cannot
// make the decoder allocate terabytes before noticing the input is short.
inline constexpr uint64_t kMaxDecodedElements = uint64_t(1) << 32;

// What a message's encoding took that its receiver would have given back
// (an ObjectRef's pin, ObjectStore::encode_ref): given back here when the
// message is never sent (a call to an actor already dead, a task cancelled
// while queued, arguments too large to send), as it goes unless sent()
// was called first.
class Unsent {
 public:
  Unsent() = default;
  explicit Unsent(std::vector<std::function<void()>> undo) : undo_(std::move(undo)) {}
  Unsent(Unsent&& o) noexcept : undo_(std::exchange(o.undo_, {})) {}
  Unsent& operator=(Unsent&& o) noexcept {
    if (this != &o) {
      release();
      undo_ = std::exchange(o.undo_, {});
    }
    return *this;
  }
  Unsent(const Unsent&) = delete;
  Unsent& operator=(const Unsent&) = delete;
  ~Unsent() { release(); }
  // The message went: its receiver gives back what it carries.
  void sent() { undo_.clear(); }
  // It never will: gives everything back now (once).
  void release() {
    for (auto& f : std::exchange(undo_, {})) f();
  }
  // Returns what `send` (which sends the message) returns, the message
  // sent. A ConfigError is a refusal before anything went (a name taken,
  // a bad option): what it carries is given back when this goes. After
  // any other error the receiver may have it, as after a return.
  template <class Send>
  auto sent_by(Send&& send) -> decltype(send()) {
    try {
      auto result = send();
      sent();
      return result;
    } catch (const ConfigError&) {
      throw;
    } catch (...) {
      sent();
      throw;
    }
  }

 private:
  std::vector<std::function<void()>> undo_;
};

class Encoder {
 public:
  Encoder() = default;
  // inline_buffers: every Buffer goes into bytes(), none into attachments()
  // (see encode_inline).
  explicit Encoder(bool inline_buffers) : inline_buffers_(inline_buffers) {}
  bool inline_buffers() const { return inline_buffers_; }
  // An encoder whose bytes only measure a value (an object's size in its
  // owner's store) and go nowhere: what encoding would do besides writing
  // bytes is left out (an ObjectRef takes no pin, which no receiver would
  // ever release). The same size as a real encoding.
  static Encoder measuring() {
    Encoder e;
    e.measuring_ = true;
    return e;
  }
  bool is_measuring() const { return measuring_; }
  // What the value's ObjectRefs hold (Codec<ObjectRef>): a sender that may
  // send the same bytes again (a retry, an actor's restart) keeps them, so
  // that the objects outlive a first receiver that registered and died.
  void keep(std::shared_ptr<const void> holder) { kept_.push_back(std::move(holder)); }
  // Those holders as one handle (null when the value has no refs).
  std::shared_ptr<const void> take_kept() {
    if (kept_.empty()) return nullptr;
    return std::make_shared<const std::vector<std::shared_ptr<const void>>>(std::move(kept_));
  }

  // What to give back if the message is never sent (see Unsent); a sender
  // that knows takes them with take_unsent(), others drop them.
  void on_unsent(std::function<void()> undo) { unsent_.push_back(std::move(undo)); }
  Unsent take_unsent() { return Unsent(std::exchange(unsent_, {})); }

  void write_bytes(const void* p, size_t n) {
    auto* c = static_cast<const char*>(p);
    bytes_.append(c, n);
  }
  template <class T>
  void write_pod(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    write_bytes(&v, sizeof(T));
  }
  void write_size(uint64_t n) { write_pod(n); }
  // Adds an attachment and writes its index inline.
  void attach(Buffer b) {
    write_size(attachments_.size());
    attachments_.push_back(std::move(b));
  }

  std::string& bytes() { return bytes_; }
  std::vector<Buffer>& attachments() { return attachments_; }

 private:
  std::string bytes_;
  std::vector<Buffer> attachments_;
  bool inline_buffers_ = false;
  bool measuring_ = false;
  std::vector<std::shared_ptr<const void>> kept_;
  std::vector<std::function<void()>> unsent_;
};

class Decoder {
 public:
  // `core` is the client core of the process that decodes: values that name
  // another process's state (ObjectRef) register with it. Without one, such
  // values fail to decode with DecodeError.
  Decoder(const void* data, size_t size, const std::vector<Buffer>* attachments = nullptr, client::Core* core = nullptr)
      : p_(static_cast<const char*>(data)), end_(p_ + size), attachments_(attachments), core_(core) {}

  void read_bytes(void* out, size_t n) {
    need(n);
    if (n) std::memcpy(out, p_, n);
    p_ += n;
  }
  const char* take(size_t n) {
    need(n);
    const char* r = p_;
    p_ += n;
    return r;
  }
  template <class T>
  T read_pod() {
    T v;
    read_bytes(&v, sizeof(T));
    return v;
  }
  uint64_t read_size() {
    auto n = read_pod<uint64_t>();
    if (n > kMaxDecodedElements) throw DecodeError("decoded length " + std::to_string(n) + " exceeds limit");
    return n;
  }
  // Checks that at least n more bytes are there (before allocating for n
  // elements of a container of trivially copyable values).
  void need(size_t n) const {
    if (static_cast<size_t>(end_ - p_) < n)
      throw DecodeError("truncated value: need " + std::to_string(n) + " bytes, have " + std::to_string(end_ - p_));
  }
  Buffer attachment() {
    uint64_t i = read_pod<uint64_t>();
    if (!attachments_ || i >= attachments_->size())
      throw DecodeError("attachment index " + std::to_string(i) + " out of range");
    return (*attachments_)[i];
  }
  size_t remaining() const { return end_ - p_; }
  bool done() const { return p_ == end_; }
  client::Core* core() const { return core_; }

 private:
  const char* p_;
  const char* end_;
  const std::vector<Buffer>* attachments_;
  client::Core* core_;
};

template <class T, class Enable = void>
struct Codec;

// Whether T has a Codec: TROUPE_FIELDS inside the struct, or a
// specialization of troupe::wire::Codec declared before this use.
template <class T, class = void>
inline constexpr bool kHasCodec = false;
template <class T>
inline constexpr bool kHasCodec<T, std::void_t<decltype(sizeof(Codec<T>))>> = true;

template <class T>
void encode(Encoder& e, const T& v) {
  static_assert(kHasCodec<std::decay_t<T>>,
                "this type cannot travel: list its fields with TROUPE_FIELDS(a, b, ...) inside the struct, or "
                "specialize troupe::wire::Codec<T> (T is named in 'encode<T>' below)");
  if constexpr (kHasCodec<std::decay_t<T>>) Codec<std::decay_t<T>>::encode(e, v);
}
template <class T>
T decode(Decoder& d) {
  static_assert(kHasCodec<T>,
                "this type cannot travel: list its fields with TROUPE_FIELDS(a, b, ...) inside the struct, or "
                "specialize troupe::wire::Codec<T> (T is named in 'decode<T>' below)");
  if constexpr (kHasCodec<T>) {
    return Codec<T>::decode(d);
  } else {
    std::abort();  // not compiled: the static_assert above failed
  }
}

// Arithmetic and enum types: raw little-endian bytes.
template <class T>
struct Codec<T, std::enable_if_t<std::is_arithmetic_v<T> || std::is_enum_v<T>>> {
  static void encode(Encoder& e, const T& v) { e.write_pod(v); }
  static T decode(Decoder& d) { return d.read_pod<T>(); }
};

// A bool is one byte, 0 or 1: any other byte read as a bool would be
// undefined behaviour, so it is refused.
template <>
struct Codec<bool> {
  static void encode(Encoder& e, const bool& v) { e.write_pod<uint8_t>(v ? 1 : 0); }
  static bool decode(Decoder& d) {
    auto b = d.read_pod<uint8_t>();
    if (b > 1) throw DecodeError("bad bool byte " + std::to_string(b));
    return b == 1;
  }
};

template <>
struct Codec<std::string> {
  static void encode(Encoder& e, const std::string& v) {
    e.write_size(v.size());
    e.write_bytes(v.data(), v.size());
  }
  static std::string decode(Decoder& d) {
    auto n = d.read_size();
    const char* p = d.take(n);
    return std::string(p, n);
  }
};

template <>
struct Codec<Buffer> {
  static void encode(Encoder& e, const Buffer& v) {
    if (v.size() >= kAttachThreshold && !e.inline_buffers()) {
      e.write_pod<uint8_t>(1);
      e.attach(v);
    } else {
      e.write_pod<uint8_t>(0);
      e.write_size(v.size());
      e.write_bytes(v.data(), v.size());
    }
  }
  static Buffer decode(Decoder& d) {
    auto tag = d.read_pod<uint8_t>();
    if (tag == 1) return d.attachment();
    if (tag != 0) throw DecodeError("bad buffer tag " + std::to_string(tag));
    auto n = d.read_size();
    const char* p = d.take(n);
    return Buffer::copy(p, n);
  }
};

template <class T, class A>
struct Codec<std::vector<T, A>> {
  static void encode(Encoder& e, const std::vector<T, A>& v) {
    e.write_size(v.size());
    if constexpr (std::is_arithmetic_v<T>) {
      e.write_bytes(v.data(), v.size() * sizeof(T));
    } else {
      for (const auto& x : v) troupe::wire::encode(e, x);
    }
  }
  static std::vector<T, A> decode(Decoder& d) {
    auto n = d.read_size();
    std::vector<T, A> v;
    if constexpr (std::is_arithmetic_v<T>) {
      d.need(n * sizeof(T));
      v.resize(n);
      d.read_bytes(v.data(), n * sizeof(T));
    } else {
      // Every element takes at least one byte: refuse counts the input
      // cannot hold before reserving.
      if constexpr (sizeof(T) > 0) d.need(n > 0 ? 1 : 0);
      v.reserve(std::min<uint64_t>(n, d.remaining()));
      for (uint64_t i = 0; i < n; ++i) v.push_back(troupe::wire::decode<T>(d));
    }
    return v;
  }
};

template <class T, size_t N>
struct Codec<std::array<T, N>> {
  static void encode(Encoder& e, const std::array<T, N>& v) {
    for (const auto& x : v) troupe::wire::encode(e, x);
  }
  static std::array<T, N> decode(Decoder& d) {
    std::array<T, N> v;
    for (auto& x : v) x = troupe::wire::decode<T>(d);
    return v;
  }
};

template <class M>
struct MapCodec {
  using K = typename M::key_type;
  using V = typename M::mapped_type;
  static void encode(Encoder& e, const M& m) {
    e.write_size(m.size());
    for (const auto& [k, v] : m) {
      troupe::wire::encode(e, k);
      troupe::wire::encode(e, v);
    }
  }
  static M decode(Decoder& d) {
    auto n = d.read_size();
    M m;
    for (uint64_t i = 0; i < n; ++i) {
      K k = troupe::wire::decode<K>(d);
      m.emplace(std::move(k), troupe::wire::decode<V>(d));
    }
    return m;
  }
};
template <class K, class V, class C, class A>
struct Codec<std::map<K, V, C, A>> : MapCodec<std::map<K, V, C, A>> {};
template <class K, class V, class H, class E, class A>
struct Codec<std::unordered_map<K, V, H, E, A>> : MapCodec<std::unordered_map<K, V, H, E, A>> {};

template <class T, class C, class A>
struct Codec<std::set<T, C, A>> {
  static void encode(Encoder& e, const std::set<T, C, A>& s) {
    e.write_size(s.size());
    for (const auto& x : s) troupe::wire::encode(e, x);
  }
  static std::set<T, C, A> decode(Decoder& d) {
    auto n = d.read_size();
    std::set<T, C, A> s;
    for (uint64_t i = 0; i < n; ++i) s.insert(troupe::wire::decode<T>(d));
    return s;
  }
};

template <class T>
struct Codec<std::optional<T>> {
  static void encode(Encoder& e, const std::optional<T>& v) {
    e.write_pod<uint8_t>(v.has_value());
    if (v) troupe::wire::encode(e, *v);
  }
  static std::optional<T> decode(Decoder& d) {
    auto has = d.read_pod<uint8_t>();
    if (has > 1) throw DecodeError("bad optional tag " + std::to_string(has));
    if (!has) return std::nullopt;
    return troupe::wire::decode<T>(d);
  }
};

template <class A, class B>
struct Codec<std::pair<A, B>> {
  static void encode(Encoder& e, const std::pair<A, B>& v) {
    troupe::wire::encode(e, v.first);
    troupe::wire::encode(e, v.second);
  }
  static std::pair<A, B> decode(Decoder& d) {
    A a = troupe::wire::decode<A>(d);
    B b = troupe::wire::decode<B>(d);
    return {std::move(a), std::move(b)};
  }
};

template <class... Ts>
struct Codec<std::tuple<Ts...>> {
  static void encode(Encoder& e, const std::tuple<Ts...>& v) {
    std::apply([&](const auto&... x) { (troupe::wire::encode(e, x), ...); }, v);
  }
  static std::tuple<Ts...> decode(Decoder& d) {
    // Braced initialisation evaluates left to right.
    return std::tuple<Ts...>{troupe::wire::decode<Ts>(d)...};
  }
};

// Structs that declare TROUPE_FIELDS(a, b, c).
template <class T>
concept HasTroupeFields = requires(T& t) {
  t.troupe_fields([](auto&...) {});
};

template <class T>
struct Codec<T, std::enable_if_t<HasTroupeFields<T>>> {
  static void encode(Encoder& e, const T& v) {
    const_cast<T&>(v).troupe_fields([&](auto&... f) { (troupe::wire::encode(e, f), ...); });
  }
  static T decode(Decoder& d) {
    T v{};
    v.troupe_fields([&](auto&... f) { ((f = troupe::wire::decode<std::decay_t<decltype(f)>>(d)), ...); });
    return v;
  }
};

// Encodes a value into fresh bytes + attachments.
template <class T>
Encoder encode_value(const T& v) {
  Encoder e;
  encode(e, v);
  return e;
}
// Encodes a value into one string with every buffer inline: for messages
// that travel as a body alone (the control plane's requests, replies and
// events, hellos, assignments), which carry no attachments. Encoding those
// with encode_value(v).bytes() lost any buffer of kAttachThreshold or more.
template <class T>
std::string encode_inline(const T& v) {
  Encoder e(true);
  encode(e, v);
  return std::move(e.bytes());
}
// A type's name as written in C++ ("troupe::head::ActorRow"), not the
// compiler's mangled one, for messages (wire/error_kind.cc).
std::string readable_type_name(const std::type_info& type);
// The same from typeid(T).name() (what an ObjectValue keeps).
std::string readable_type_name(const char* mangled);

// Decodes a whole value and checks nothing is left over.
template <class T>
T decode_value(const void* data, size_t size, const std::vector<Buffer>* attachments = nullptr,
               client::Core* core = nullptr) {
  Decoder d(data, size, attachments, core);
  T v = decode<T>(d);
  if (!d.done())
    throw DecodeError(std::to_string(d.remaining()) + " trailing bytes after decoding a " +
                      readable_type_name(typeid(T)));
  return v;
}
template <class T>
T decode_value(const std::string& s) {
  return decode_value<T>(s.data(), s.size());
}

}  // namespace troupe::wire

// Lists a struct's fields for Codec (and for anything else that wants to
// visit them). Use inside the struct body: TROUPE_FIELDS(x, y, name).
#define TROUPE_FIELDS(...)                             \
  template <class TroupeVisitor>                       \
  auto troupe_fields(TroupeVisitor&& troupe_visitor) { \
    return troupe_visitor(__VA_ARGS__);                \
  }
