#include "troupe/runtime/wire/rpc.h"

#include <algorithm>

#include "troupe/runtime/core/exception_text.h"
#include "troupe/runtime/core/logging.h"

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

namespace {
// Events and requests that wait for a reconnection; beyond this many the
// oldest events are dropped (heartbeats and statistics, which are resent).
constexpr size_t kMaxBacklog = 10000;
constexpr std::chrono::milliseconds kRedialEvery{100};
}  // namespace

std::shared_ptr<RpcChannel> RpcChannel::connect(asio::io_context& io, const std::string& address,
                                                const std::string& token, std::chrono::milliseconds timeout,
                                                EventHandler on_event, CloseHandler on_close,
                                                ConnectionOptions options) {
  auto [host, port] = parse_address(address);
  auto ch = std::make_shared<RpcChannel>();
  ch->on_event_ = std::move(on_event);
  ch->on_close_ = std::move(on_close);
  ch->io_ = &io;
  ch->host_ = host;
  ch->port_ = port;
  ch->token_ = token;
  ch->options_ = options;
  auto done = std::make_shared<core::FutureState<std::string>>();
  std::weak_ptr<RpcChannel> weak = ch;
  Connection::connect(
      io, host, port, token, std::move(options),
      [weak](Message&& m) {
        if (auto c = weak.lock()) c->on_frame(0, std::move(m));
      },
      [weak](const std::string& reason) {
        if (auto c = weak.lock()) c->on_close(0, reason);
      },
      [ch, done](std::shared_ptr<Connection> conn, std::string error) {
        {
          std::lock_guard lock(ch->mu_);
          ch->conn_ = std::move(conn);
        }
        done->set_value(error);
      });
  // No connection and handshake in time is a connection that failed (a
  // ConnectionError, as a refused one is), not a slow answer: what listens
  // there is no troupe process, or the host drops what is sent to it.
  if (!done->wait_for(timeout))
    throw ConnectionError("cannot connect to " + address + ": no troupe handshake within " +
                          std::to_string(timeout.count()) +
                          " ms (nothing there answers as a troupe process does: a wrong port, a host that drops "
                          "packets, or a process that is stopped or overloaded)");
  std::string err = done->value();
  if (!err.empty()) throw ConnectionError("cannot connect to " + address + ": " + err);
  return ch;
}

void RpcChannel::enable_reconnect(Reconnect r) {
  std::lock_guard lock(mu_);
  reconnect_ = std::move(r);
}

void RpcChannel::timed_out(Op op, uint64_t id, std::chrono::milliseconds timeout) {
  bool withdrawn = false;
  {
    std::lock_guard lock(mu_);
    // An answer coming later finds nothing to complete and is dropped.
    pending_.erase(id);
    auto it = std::find_if(backlog_.begin(), backlog_.end(),
                           [id](const Message& b) { return b.kind == Kind::REQUEST && b.id == id; });
    if (it != backlog_.end()) {
      backlog_.erase(it);
      withdrawn = true;
    }
  }
  if (withdrawn)
    throw Timeout(op_name(op) + " (op " + std::to_string(static_cast<uint32_t>(op)) + ") to " +
                  format_address(host_, port_) + " was not sent within " + std::to_string(timeout.count()) +
                  " ms: the connection is being re-established; the request is withdrawn, not carried out");
  throw Timeout("no answer to " + op_name(op) + " (op " + std::to_string(static_cast<uint32_t>(op)) + ") from " +
                format_address(host_, port_) + " within " + std::to_string(timeout.count()) + " ms");
}

Future<Message> RpcChannel::request(Op op, std::string body) {
  uint64_t id = 0;
  return send_request(op, std::move(body), &id);
}

Future<Message> RpcChannel::send_request(Op op, std::string body, uint64_t* id) {
  auto state = std::make_shared<core::FutureState<Message>>();
  Message m;
  m.kind = Kind::REQUEST;
  m.op = static_cast<uint32_t>(op);
  m.body = std::move(body);
  std::unique_lock lock(mu_);
  if (closed_) {
    state->set_error(std::make_exception_ptr(ConnectionError("connection closed: " + close_reason_)));
    return Future<Message>(state);
  }
  m.id = next_id_++;
  *id = m.id;
  pending_[m.id] = state;
  if (reconnecting_) {
    backlog_.push_back(std::move(m));
    return Future<Message>(state);
  }
  auto c = conn_;
  lock.unlock();
  c->send(m);
  return Future<Message>(state);
}

void RpcChannel::send(const Message& m) {
  std::unique_lock lock(mu_);
  if (reconnecting_) {
    if (backlog_.size() >= kMaxBacklog) {
      auto it = std::find_if(backlog_.begin(), backlog_.end(), [](const Message& b) { return b.kind == Kind::EVENT; });
      if (it == backlog_.end()) return;
      backlog_.erase(it);
    }
    backlog_.push_back(m);
    return;
  }
  auto c = conn_;
  lock.unlock();
  if (c) c->send(m);
}

void RpcChannel::close(const std::string& reason) {
  std::unique_lock lock(mu_);
  user_closed_ = true;
  auto c = conn_;
  auto d = std::exchange(dialing_, nullptr);
  bool was_reconnecting = reconnecting_;
  lock.unlock();
  if (d) d->close(reason);
  if (c) c->close(reason);
  if (was_reconnecting) asio::post(*io_, [self = shared_from_this(), reason] { self->give_up(reason); });
}

bool RpcChannel::is_open() const {
  std::lock_guard lock(mu_);
  return conn_ && conn_->is_open() && !reconnecting_;
}

bool RpcChannel::is_closed() const {
  std::lock_guard lock(mu_);
  return closed_;
}

std::shared_ptr<Connection> RpcChannel::connection() const {
  std::lock_guard lock(mu_);
  return conn_;
}

void RpcChannel::on_frame(uint64_t gen, Message&& m) {
  if (m.kind == Kind::RESPONSE) {
    std::shared_ptr<core::FutureState<Message>> st;
    {
      std::unique_lock lock(mu_);
      if (gen != gen_) return;
      if (reconnecting_) {
        if (m.id != hello_id_) return;
        lock.unlock();
        return on_hello_reply(gen, std::move(m));
      }
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
  if (m.kind == Kind::EVENT && static_cast<Op>(m.op) == Op::kShutdown) {
    std::lock_guard lock(mu_);
    final_ = true;  // the head is going for good: nothing to wait for
  }
  if (on_event_) on_event_(std::move(m));
}

void RpcChannel::on_close(uint64_t gen, const std::string& reason) {
  std::unordered_map<uint64_t, std::shared_ptr<core::FutureState<Message>>> pending;
  std::unique_lock lock(mu_);
  if (gen != gen_ || closed_) return;
  if (reconnecting_) {
    // A new connection closed before its hello was answered.
    lock.unlock();
    return retry_later(gen);
  }
  pending.swap(pending_);
  const bool again = reconnect_.window.count() > 0 && !user_closed_ && !final_;
  if (!again) {
    closed_ = true;
    close_reason_ = reason;
    lock.unlock();
    for (auto& [id, st] : pending)
      st->set_error(std::make_exception_ptr(ConnectionError("connection closed: " + reason)));
    if (on_close_) on_close_(reason);
    return;
  }
  reconnecting_ = true;
  lost_at_ = std::chrono::steady_clock::now();
  lost_reason_ = reason;
  const uint64_t next = ++gen_;
  lock.unlock();
  for (auto& [id, st] : pending)
    st->set_error(std::make_exception_ptr(
        ConnectionError("lost the connection to " + format_address(host_, port_) + " (" + reason +
                        ") with this request in flight; it may or may not have been carried out")));
  TROUPE_LOG_WARN("lost the head at {} ({}); reconnecting for up to {} ms", format_address(host_, port_), reason,
                  reconnect_.window.count());
  end_at_window();
  dial(next);
}

// The window bounds the whole reconnect, also a dial that neither fails nor
// finishes: a connect into a partition (the kernel's SYN retries take two
// minutes), a head that accepts and says nothing (stopped, or its link
// holding every byte). retry_later's check alone waited as long as it hung.
void RpcChannel::end_at_window() {
  std::chrono::steady_clock::time_point lost_at;
  {
    std::lock_guard lock(mu_);
    lost_at = lost_at_;
  }
  auto t = std::make_shared<asio::steady_timer>(*io_, lost_at + reconnect_.window);
  t->async_wait([t, weak = std::weak_ptr<RpcChannel>(shared_from_this()), lost_at](asio::error_code) {
    auto c = weak.lock();
    if (!c) return;
    std::unique_lock lock(c->mu_);
    if (!c->reconnecting_ || c->closed_ || c->lost_at_ != lost_at) return;  // back, or lost again since
    if (auto d = std::exchange(c->dialing_, nullptr)) d->close("reconnect window over");
    std::string why = c->lost_reason_ + "; not back within " + std::to_string(c->reconnect_.window.count()) + " ms";
    lock.unlock();
    c->give_up(why);
  });
}

void RpcChannel::dial(uint64_t gen) {
  std::weak_ptr<RpcChannel> weak = shared_from_this();
  Connection::connect(
      *io_, host_, port_, token_, options_,
      [weak, gen](Message&& m) {
        if (auto c = weak.lock()) c->on_frame(gen, std::move(m));
      },
      [weak, gen](const std::string& reason) {
        if (auto c = weak.lock()) c->on_close(gen, reason);
      },
      [weak, gen](std::shared_ptr<Connection> conn, std::string error) {
        auto c = weak.lock();
        if (!c) return;
        if (!conn || !error.empty()) return c->retry_later(gen);
        Message h;
        {
          std::lock_guard lock(c->mu_);
          if (gen != c->gen_ || !c->reconnecting_) return conn->close("stale reconnection");
          c->dialing_ = conn;
          c->hello_id_ = c->next_id_++;
          h.kind = Kind::REQUEST;
          h.op = static_cast<uint32_t>(Op::kHello);
          h.id = c->hello_id_;
          h.body = c->reconnect_.hello;
        }
        conn->send(h);
      });
}

void RpcChannel::retry_later(uint64_t gen) {
  std::unique_lock lock(mu_);
  if (gen != gen_ || !reconnecting_) return;
  if (auto d = std::exchange(dialing_, nullptr)) d->close("reconnecting again");
  if (std::chrono::steady_clock::now() - lost_at_ > reconnect_.window) {
    std::string why = lost_reason_ + "; not back within " + std::to_string(reconnect_.window.count()) + " ms";
    lock.unlock();
    return give_up(why);
  }
  const uint64_t next = ++gen_;
  lock.unlock();
  auto t = std::make_shared<asio::steady_timer>(*io_, kRedialEvery);
  t->async_wait([t, weak = std::weak_ptr<RpcChannel>(shared_from_this()), next](asio::error_code) {
    if (auto c = weak.lock()) c->dial(next);
  });
}

void RpcChannel::on_hello_reply(uint64_t gen, Message&& m) {
  if (m.status != Status::OK) {
    std::shared_ptr<Connection> d;
    {
      std::lock_guard lock(mu_);
      d = std::exchange(dialing_, nullptr);
    }
    if (d) d->close("hello refused");
    return give_up("the head refused this process when it came back: " + core::exception_text(error_from_message(m)));
  }
  double away = 0;
  {
    std::lock_guard lock(mu_);
    if (gen != gen_) return;
    conn_ = std::exchange(dialing_, nullptr);
    reconnecting_ = false;
    away = std::chrono::duration<double>(std::chrono::steady_clock::now() - lost_at_).count();
    // Under the lock, so that nothing sent meanwhile overtakes them.
    for (auto& b : std::exchange(backlog_, {})) conn_->send(b);
  }
  TROUPE_LOG_INFO("reconnected to the head at {} after {:.2f} s", format_address(host_, port_), away);
  if (reconnect_.on_reconnected) reconnect_.on_reconnected(std::move(m));
}

void RpcChannel::give_up(const std::string& reason) {
  std::unordered_map<uint64_t, std::shared_ptr<core::FutureState<Message>>> pending;
  {
    std::lock_guard lock(mu_);
    if (closed_) return;
    closed_ = true;
    reconnecting_ = false;
    close_reason_ = reason;
    ++gen_;
    pending.swap(pending_);
    backlog_.clear();
  }
  for (auto& [id, st] : pending)
    st->set_error(std::make_exception_ptr(ConnectionError("connection closed: " + reason)));
  if (on_close_) on_close_(reason);
}

}  // namespace troupe::wire
