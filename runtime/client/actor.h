// Declaring actor classes. TROUPE_ACTOR(Class, &Class::m1, &Class::m2, ...)
// lists the methods callers may invoke; it fills ActorTraits<Class>, from
// which the caller finds a method's index and the worker builds its
// dispatch table. Constructors are registered where spawn<T>(args...) is
// instantiated, so any constructor a driver uses is known to the worker
// binary (the driver's own executable by default).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include "troupe/runtime/client/object_value.h"
#include "troupe/runtime/core/check.h"
#include "troupe/runtime/wire/codec.h"

namespace troupe {

// Specialised by TROUPE_ACTOR.
template <class T>
struct ActorTraits;

// Whether T was declared with TROUPE_ACTOR (before this use).
template <class T, class = void>
inline constexpr bool kIsActor = false;
template <class T>
inline constexpr bool kIsActor<T, std::void_t<decltype(sizeof(ActorTraits<T>))>> = true;

namespace client {

template <class M>
struct MethodTraits;
#define TROUPE_METHOD_TRAITS(QUAL)                 \
  template <class C, class R, class... A>          \
  struct MethodTraits<R (C::*)(A...) QUAL> {       \
    using Class = C;                               \
    using Result = std::decay_t<R>;                \
    using Args = std::tuple<std::decay_t<A>...>;   \
    static constexpr size_t kArity = sizeof...(A); \
  };
TROUPE_METHOD_TRAITS()
TROUPE_METHOD_TRAITS(const)
TROUPE_METHOD_TRAITS(noexcept)
TROUPE_METHOD_TRAITS(const noexcept)
#undef TROUPE_METHOD_TRAITS

// "&Counter::add, &Counter::get" -> {"add", "get"}
std::vector<std::string> split_method_names(const char* list);

template <class T>
const std::vector<std::string>& method_names() {
  static const std::vector<std::string> names = split_method_names(ActorTraits<T>::kMethodNames);
  return names;
}

// Whether TROUPE_ACTOR's list for T has a method of type M.
template <class M, class Listed>
inline constexpr bool kListsType = false;
template <class M, class... L>
inline constexpr bool kListsType<M, std::tuple<L...>> = (std::is_same_v<M, L> || ...);

// Index of `m` in TROUPE_ACTOR's list for T. A method whose type no listed
// method has fails to compile; one that shares a listed method's type but
// is not listed throws ConfigError.
template <class T, class M>
uint32_t method_index(M m) {
  static_assert(kListsType<M, decltype(ActorTraits<T>::methods())>,
                "this method is not listed in TROUPE_ACTOR(Class, ...): add it to the list (T and M are named in "
                "'method_index<T, M>' below)");
  uint32_t found = UINT32_MAX;
  uint32_t i = 0;
  std::apply(
      [&](auto... listed) {
        (
            [&](auto x) {
              if constexpr (std::is_same_v<decltype(x), M>) {
                if (found == UINT32_MAX && x == m) found = i;
              }
              ++i;
            }(listed),
            ...);
      },
      ActorTraits<T>::methods());
  if (found == UINT32_MAX)
    throw ConfigError(std::string("a method of ") + ActorTraits<T>::kName + " is not listed in TROUPE_ACTOR(" +
                      ActorTraits<T>::kName + ", ...) (a listed method has its signature): add it to the list");
  return found;
}

// The top bit of a call's method index (Message::op) asks the callee to keep
// the result and reply with a reference to it (ActorHandle::call_ref).
inline constexpr uint32_t kKeepResult = 1u << 31;
// A call's op: the method index in the low bits, and in bits 20-27 the
// concurrency group its caller names (1 + its index in
// ActorSpec::concurrency_groups; 0 = none named: the method's group, else
// the default one; wire::kMaxConcurrencyGroups at most).
inline constexpr uint32_t kCallGroupShift = 20;
inline constexpr uint32_t kCallMethodMask = (1u << kCallGroupShift) - 1;
inline constexpr uint32_t call_op_group(uint32_t op) { return (op >> kCallGroupShift) & 0xFFu; }
inline constexpr uint32_t call_op_method(uint32_t op) { return op & kCallMethodMask; }
// Set in a task executor's reply (Message::op) when its process's object
// store holds objects after the task (a Python task that returns what it
// put): the submitter keeps that executor, whose objects others may read.
inline constexpr uint32_t kHoldsObjects = 1u << 30;
// A task executor's reply (Message::op) to a task it did not start because
// the task before it waits in get(): the body and attachments are the
// task's own, handed back; the submitter sends it elsewhere.
inline constexpr uint32_t kBounced = 1u << 29;

// An actor instance inside a worker, behind a type-erased interface.
class HostedActor {
 public:
  virtual ~HostedActor() = default;
  // Runs method `index` with encoded args; writes the encoded result, or,
  // with `keep` (a call_ref), hands the result to `keep`, which stores it
  // and writes a reference to it.
  virtual void invoke(uint32_t index, wire::Decoder& args, wire::Encoder& result, const ObjectSink* keep) = 0;
  virtual size_t method_count() const = 0;
  virtual std::string method_name(uint32_t index) const = 0;
};

template <class T>
class Hosted final : public HostedActor {
 public:
  explicit Hosted(std::unique_ptr<T> obj) : obj_(std::move(obj)) {}

  void invoke(uint32_t index, wire::Decoder& args, wire::Encoder& result, const ObjectSink* keep) override {
    static const auto table = make_table(std::make_index_sequence<kCount>{});
    if (index >= kCount)
      throw Error("method index " + std::to_string(index) + " out of range for " + ActorTraits<T>::kName);
    table[index](*obj_, args, result, keep);
  }
  size_t method_count() const override { return kCount; }
  std::string method_name(uint32_t index) const override {
    const auto& n = method_names<T>();
    return index < n.size() ? n[index] : "#" + std::to_string(index);
  }

 private:
  static constexpr size_t kCount = std::tuple_size_v<decltype(ActorTraits<T>::methods())>;
  using Fn = void (*)(T&, wire::Decoder&, wire::Encoder&, const ObjectSink*);

  template <size_t I>
  static void call_one(T& obj, wire::Decoder& d, wire::Encoder& e, const ObjectSink* keep) {
    constexpr auto m = std::get<I>(ActorTraits<T>::methods());
    using MT = MethodTraits<std::remove_const_t<decltype(m)>>;
    auto args = wire::decode<typename MT::Args>(d);
    if (!d.done()) throw DecodeError("trailing bytes after the arguments of " + method_names<T>()[I]);
    if constexpr (std::is_void_v<typename MT::Result>) {
      if (keep) throw ConfigError("call_ref on " + method_names<T>()[I] + ", which returns nothing");
      std::apply([&](auto&&... a) { (obj.*m)(std::move(a)...); }, std::move(args));
    } else {
      auto r = std::apply([&](auto&&... a) { return (obj.*m)(std::move(a)...); }, std::move(args));
      if (keep) {
        (*keep)(make_object_value(std::move(r)), e);
      } else {
        wire::encode(e, r);
      }
    }
  }
  template <size_t... I>
  static std::array<Fn, kCount> make_table(std::index_sequence<I...>) {
    return {&call_one<I>...};
  }

  std::unique_ptr<T> obj_;
};

// Constructor registry: key -> factory. Filled at static-initialisation
// time by CtorRegistration instances that spawn<T>(args...) instantiates.
struct ActorFactory {
  std::string class_name;
  std::unique_ptr<HostedActor> (*make)(wire::Decoder& args);
};
void register_factory(const std::string& key, ActorFactory f);
const ActorFactory* find_factory(const std::string& key);

template <class T, class... A>
std::string factory_key() {
  // Appended, not concatenated with +: GCC 12 warns (-Warray-bounds, wrongly)
  // on the inlined operator+ here.
  std::string key(ActorTraits<T>::kName);
  key += '/';
  key += typeid(std::tuple<A...>).name();
  return key;
}

template <class T, class... A>
struct CtorRegistration {
  static std::unique_ptr<HostedActor> make(wire::Decoder& d) {
    auto args = wire::decode<std::tuple<A...>>(d);
    auto obj = std::apply([](auto&&... a) { return std::make_unique<T>(std::move(a)...); }, std::move(args));
    return std::make_unique<Hosted<T>>(std::move(obj));
  }
  static inline const bool registered =
      (register_factory(factory_key<T, A...>(), ActorFactory{ActorTraits<T>::kName, &make}), true);
};

}  // namespace client
}  // namespace troupe

// Declares Class as an actor type with the listed methods. Use at global
// namespace scope, after the class definition.
#define TROUPE_ACTOR(Class, ...)                                             \
  template <>                                                                \
  struct troupe::ActorTraits<Class> {                                        \
    static constexpr const char* kName = #Class;                             \
    static constexpr const char* kMethodNames = #__VA_ARGS__;                \
    static constexpr auto methods() { return std::make_tuple(__VA_ARGS__); } \
  };

// Registers the constructor T(Args...) explicitly, for binaries that serve
// actors they never spawn themselves (the stand-alone troupe-worker, a
// worker executable separate from the driver). Use at namespace scope.
#define TROUPE_REGISTER_CTOR(Class, ...)                                  \
  static const bool TROUPE_CONCAT(troupe_ctor_registered_, __COUNTER__) = \
      ::troupe::client::CtorRegistration<Class __VA_OPT__(, ) __VA_ARGS__>::registered;
#define TROUPE_CONCAT_INNER(a, b) a##b
#define TROUPE_CONCAT(a, b) TROUPE_CONCAT_INNER(a, b)
