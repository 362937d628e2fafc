// Control messages: typed requests to an actor's worker that its I/O thread
// serves at once, beside the call the actor is running (abort a collective,
// interrupt a stream, stop a feed, report stats). A control message is a
// struct with TROUPE_FIELDS, a stable tag that names it on the wire and the
// type of its reply; its body is Codec-encoded like a method's arguments:
//
//   struct AbortGroup {
//     static constexpr const char* kControlTag = "collective.abort";
//     using Reply = int32_t;  // or void
//     std::string name;
//     int64_t generation = -1;
//     TROUPE_FIELDS(name, generation)
//   };
//   // in the actor                 // in the caller
//   this_actor::on_control<AbortGroup>(     int n = handle.control(AbortGroup{.name = "dp"}).get();
//       [](const AbortGroup& m) { ... return n; });
//
// A message whose tag has no handler in the worker fails with ConfigError;
// what the handler throws reaches the caller typed (wire/error_kind.h).
#pragma once

#include <concepts>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>

#include "troupe/runtime/core/future.h"
#include "troupe/runtime/wire/codec.h"
#include "troupe/runtime/wire/error_kind.h"

namespace troupe {

template <class M>
concept ControlMessage = wire::HasTroupeFields<M> && requires {
  typename M::Reply;
  { M::kControlTag } -> std::convertible_to<const char*>;
};

namespace client {

// The control handlers of one process by tag, owned by its client core
// (the worker's control listener looks them up there). Thread-safe; a
// handler runs on the I/O thread, so it must be short.
class ControlTable {
 public:
  // Bytes of the message in, bytes of the reply out.
  using Handler = std::function<std::string(const std::string& body)>;

  // Registers (or replaces) the handler of `tag`.
  void set(const std::string& tag, Handler handler);
  // The handler of `tag` (this table's, else the process-wide one of
  // register_process_control); ConfigError naming the tag when there is
  // none.
  Handler find(const std::string& tag) const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, Handler> handlers_;
};

// Registers a handler that every worker of this binary serves from its
// start, during static initialisation (as TROUPE_ACTOR does for actors):
// for messages that may arrive before the actor's own code runs. A core's
// own set() of the same tag wins.
bool register_process_control(const std::string& tag, ControlTable::Handler handler);

// Wraps a typed handler (const M& -> M::Reply) into a ControlTable handler.
// With the process's client core (the table's owner), object refs inside
// the message decode as they do in call arguments.
template <ControlMessage M, class F>
ControlTable::Handler typed_control_handler(F handler, Core* core = nullptr) {
  return [h = std::move(handler), core](const std::string& body) -> std::string {
    M message;
    try {
      message = wire::decode_value<M>(body.data(), body.size(), nullptr, core);
    } catch (const DecodeError& e) {
      throw DecodeError(std::string("control message '") + M::kControlTag + "': " + e.what());
    }
    if constexpr (std::is_void_v<typename M::Reply>) {
      h(message);
      return {};
    } else {
      return wire::encode_inline<typename M::Reply>(h(message));
    }
  };
}

// Turns the raw answer to a control message into its typed reply; `core`
// (the caller's) lets object refs inside the reply decode.
template <ControlMessage M>
Future<typename M::Reply> typed_control_reply(Future<wire::Message> raw, Core* core = nullptr) {
  using R = typename M::Reply;
  auto st = std::make_shared<core::FutureState<R>>();
  raw.on_ready([raw, st, core] {
    try {
      wire::Message m = raw.get();
      if constexpr (std::is_void_v<R>) {
        st->set_value();
      } else {
        st->set_value(wire::decode_value<R>(m.body.data(), m.body.size(), &m.attachments, core));
      }
    } catch (...) {
      st->set_error(std::current_exception());
    }
  });
  return Future<R>(st);
}

}  // namespace client
}  // namespace troupe
