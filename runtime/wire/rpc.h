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
  return ok_response(id, std::move(encode_value(v).bytes()));
}
Message make_event(Op op, std::string body = {});
template <class T>
Message make_event_value(Op op, const T& v) {
  return make_event(op, std::move(encode_value(v).bytes()));
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
  template <class R, class Q>
  R call(Op op, const Q& req, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    return finish<R>(request(op, std::move(encode_value(req).bytes())), op, timeout);
  }
  template <class R>
  R call_empty(Op op, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    return finish<R>(request(op), op, timeout);
  }
  void send(const Message& m) { conn_->send(m); }
  void close(const std::string& reason) { conn_->close(reason); }
  bool is_open() const { return conn_ && conn_->is_open(); }
  const std::shared_ptr<Connection>& connection() const { return conn_; }

 private:
  template <class R>
  static R finish(Future<Message> f, Op op, std::chrono::milliseconds timeout) {
    if (!f.wait_for(timeout))
      throw Timeout("no response to request op " + std::to_string(static_cast<uint32_t>(op)) + " after " +
                    std::to_string(timeout.count()) + " ms");
    Message m = f.get();
    if constexpr (std::is_void_v<R>) {
      return;
    } else {
      return decode_value<R>(m.body.data(), m.body.size(), &m.attachments);
    }
  }
  void on_frame(Message&& m);
  void on_close(const std::string& reason);

  std::shared_ptr<Connection> conn_;
  EventHandler on_event_;
  CloseHandler on_close_;
  std::mutex mu_;
  uint64_t next_id_ = 1;
  bool closed_ = false;
  std::string close_reason_;
  std::unordered_map<uint64_t, std::shared_ptr<core::FutureState<Message>>> pending_;
};

}  // namespace troupe::wire
