// RpcChannel: request/response over a Connection for the control plane.
// Requests carry an id that the response echoes; events are one-way. Used by
// drivers, node agents and workers to talk to the head.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "troupe/runtime/core/future.h"
#include "troupe/runtime/wire/connection.h"
#include "troupe/runtime/wire/error_kind.h"
#include "troupe/runtime/wire/protocol.h"

namespace troupe::wire {

// Builds an error response to request `id` from an exception.
Message error_response(uint64_t id, const std::exception& e);
Message ok_response(uint64_t id, std::string body = {});
template <class T>
Message ok_response_value(uint64_t id, const T& v) {
  return ok_response(id, encode_inline(v));
}
Message make_event(Op op, std::string body = {});
template <class T>
Message make_event_value(Op op, const T& v) {
  return make_event(op, encode_inline(v));
}

class RpcChannel : public std::enable_shared_from_this<RpcChannel> {
 public:
  using EventHandler = std::function<void(Message&&)>;
  using CloseHandler = std::function<void(const std::string&)>;

  // Connects to `address` and waits (blocking the calling thread, which must
  // not be io's thread) up to `timeout`. Events and close run on io's thread.
  static std::shared_ptr<RpcChannel> connect(asio::io_context& io, const std::string& address, const std::string& token,
                                             std::chrono::milliseconds timeout, EventHandler on_event,
                                             CloseHandler on_close, ConnectionOptions options = {});

  Future<Message> request(Op op, std::string body = {});
  // Sends a request and decodes the response body as R (void for none).
  // A request that times out while still waiting for a reconnection is
  // withdrawn, never sent: a caller that asks again does not have it
  // carried out twice.
  template <class R, class Q>
  R call(Op op, const Q& req, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    uint64_t id = 0;
    auto f = send_request(op, encode_inline(req), &id);
    return finish<R>(std::move(f), op, id, timeout);
  }
  template <class R>
  R call_empty(Op op, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    uint64_t id = 0;
    auto f = send_request(op, {}, &id);
    return finish<R>(std::move(f), op, id, timeout);
  }
  // An event; while the channel reconnects it waits (a bounded backlog)
  // and leaves on the new connection.
  void send(const Message& m);
  void close(const std::string& reason);
  bool is_open() const;
  // Closed for good: by close(), or a drop it will not (or no longer) try
  // to reconnect from. Requests fail at once from then on.
  bool is_closed() const;
  std::shared_ptr<Connection> connection() const;

  // When the connection drops (not by close(), and not after the head said
  // it is going for good with a kShutdown event), connect again to the same
  // address for up to `window`, re-sending `hello` (a kHello body) first.
  // Requests in flight at the drop fail with ConnectionError (the head may
  // or may not have acted on them); requests and events made meanwhile wait
  // and go out once the hello is answered, when `on_reconnected` (on io's
  // thread) gets the reply. Only when the window passes, or the
  // hello is refused, does the close handler run. Call once, right after
  // connect.
  struct Reconnect {
    std::chrono::milliseconds window{0};
    std::string hello;
    std::function<void(Message&& reply)> on_reconnected;
  };
  void enable_reconnect(Reconnect r);

 private:
  Future<Message> send_request(Op op, std::string body, uint64_t* id);
  template <class R>
  R finish(Future<Message> f, Op op, uint64_t id, std::chrono::milliseconds timeout) {
    // An answer comes within a round trip: a task waiting for one lends
    // its CPU only where the request waits by design (core::WaitObserver).
    const bool waits = op == Op::kKvWait || op == Op::kWaitPlacementGroup;
    core::WaitObserverInstall quick(waits ? core::tls_wait_observer.observer : nullptr);
    if (!f.wait_for(timeout)) timed_out(op, id, timeout);
    Message m = f.get();
    if constexpr (std::is_void_v<R>) {
      return;
    } else {
      return decode_value<R>(m.body.data(), m.body.size(), &m.attachments);
    }
  }
  // Throws the Timeout of request `id` that got no answer, naming the
  // request and the address it went to; one not yet sent (waiting for a
  // reconnection) is withdrawn and the Timeout says it was not sent.
  [[noreturn]] void timed_out(Op op, uint64_t id, std::chrono::milliseconds timeout);
  void on_frame(uint64_t gen, Message&& m);
  void on_close(uint64_t gen, const std::string& reason);
  // Starts connection generation `gen`'s connect (on io's thread).
  void dial(uint64_t gen);
  void retry_later(uint64_t gen);
  // Gives up when the reconnect begun now is not done within the window.
  void end_at_window();
  void on_hello_reply(uint64_t gen, Message&& m);
  // The end: fails everything waiting and runs the close handler.
  void give_up(const std::string& reason);

  asio::io_context* io_ = nullptr;
  std::string host_, token_;
  uint16_t port_ = 0;
  ConnectionOptions options_;
  std::shared_ptr<Connection> conn_;
  uint64_t gen_ = 0;  // of conn_; frames of older connections are ignored
  Reconnect reconnect_;
  bool user_closed_ = false, final_ = false, reconnecting_ = false;
  std::chrono::steady_clock::time_point lost_at_;
  std::string lost_reason_;
  uint64_t hello_id_ = 0;
  std::vector<Message> backlog_;
  std::shared_ptr<Connection> dialing_;
  EventHandler on_event_;
  CloseHandler on_close_;
  mutable std::mutex mu_;
  uint64_t next_id_ = 1;
  bool closed_ = false;
  std::string close_reason_;
  std::unordered_map<uint64_t, std::shared_ptr<core::FutureState<Message>>> pending_;
};

}  // namespace troupe::wire
