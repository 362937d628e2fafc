#include "troupe/runtime/wire/rpc.h"

namespace troupe::wire {

Message error_response(uint64_t id, const std::exception& e) {
  Message m;
  m.kind = Kind::RESPONSE;
  m.id = id;
  set_error(m, e);
  return m;
}

Message ok_response(uint64_t id, std::string body) {
  Message m;
  m.kind = Kind::RESPONSE;
  m.id = id;
  m.body = std::move(body);
  return m;
}

Message make_event(Op op, std::string body) {
  Message m;
  m.kind = Kind::EVENT;
  m.op = static_cast<uint32_t>(op);
  m.body = std::move(body);
  return m;
}

std::shared_ptr<RpcChannel> RpcChannel::connect(asio::io_context& io, const std::string& address,
                                                const std::string& token, std::chrono::milliseconds timeout,
                                                EventHandler on_event, CloseHandler on_close,
                                                ConnectionOptions options) {
  auto [host, port] = parse_address(address);
  auto ch = std::make_shared<RpcChannel>();
  ch->on_event_ = std::move(on_event);
  ch->on_close_ = std::move(on_close);
  auto done = std::make_shared<core::FutureState<std::string>>();
  std::weak_ptr<RpcChannel> weak = ch;
  Connection::connect(
      io, host, port, token, std::move(options),
      [weak](Message&& m) {
        if (auto c = weak.lock()) c->on_frame(std::move(m));
      },
      [weak](const std::string& reason) {
        if (auto c = weak.lock()) c->on_close(reason);
      },
      [ch, done](std::shared_ptr<Connection> conn, std::string error) {
        ch->conn_ = std::move(conn);
        done->set_value(error);
      });
  if (!done->wait_for(timeout))
    throw Timeout("connecting to " + address + " timed out after " + std::to_string(timeout.count()) + " ms");
  std::string err = done->value();
  if (!err.empty()) throw ConnectionError("cannot connect to " + address + ": " + err);
  return ch;
}

Future<Message> RpcChannel::request(Op op, std::string body) {
  auto state = std::make_shared<core::FutureState<Message>>();
  Message m;
  m.kind = Kind::REQUEST;
  m.op = static_cast<uint32_t>(op);
  m.body = std::move(body);
  {
    std::lock_guard lock(mu_);
    if (closed_) {
      state->set_error(std::make_exception_ptr(ConnectionError("connection closed: " + close_reason_)));
      return Future<Message>(state);
    }
    m.id = next_id_++;
    pending_[m.id] = state;
  }
  conn_->send(m);
  return Future<Message>(state);
}

void RpcChannel::on_frame(Message&& m) {
  if (m.kind == Kind::RESPONSE) {
    std::shared_ptr<core::FutureState<Message>> st;
    {
      std::lock_guard lock(mu_);
      auto it = pending_.find(m.id);
      if (it == pending_.end()) return;
      st = std::move(it->second);
      pending_.erase(it);
    }
    if (m.status != Status::OK)
      st->set_error(error_from_message(m));
    else
      st->set_value(std::move(m));
    return;
  }
  if (on_event_) on_event_(std::move(m));
}

void RpcChannel::on_close(const std::string& reason) {
  std::unordered_map<uint64_t, std::shared_ptr<core::FutureState<Message>>> pending;
  {
    std::lock_guard lock(mu_);
    closed_ = true;
    close_reason_ = reason;
    pending.swap(pending_);
  }
  for (auto& [id, st] : pending)
    st->set_error(std::make_exception_ptr(ConnectionError("connection closed: " + reason)));
  if (on_close_) on_close_(reason);
}

}  // namespace troupe::wire
