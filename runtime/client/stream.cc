#include "troupe/runtime/client/stream.h"

#include <atomic>
#include <map>

#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/wire/connection.h"

namespace troupe::client {

using namespace troupe::wire;

namespace {

enum class StreamOp : uint32_t { kOpen = 100, kData = 101, kCredit = 102, kEnd = 103, kError = 104 };

Message stream_event(StreamOp op, uint64_t id, std::string body = {}) {
  Message m;
  m.kind = Kind::EVENT;
  m.op = static_cast<uint32_t>(op);
  m.id = id;
  m.body = std::move(body);
  return m;
}

}  // namespace

struct StreamReaderCore::State {
  mutable std::mutex mu;
  std::condition_variable cv;
  std::deque<Message> items;
  size_t credits = 0;
  size_t consumed_since_grant = 0;
  bool ended = false;
  std::string error;
  std::shared_ptr<Connection> conn;
};

// One listener per process serves every reader in it; a writer's first frame
// names the stream it feeds.
class StreamServer {
 public:
  static StreamServer& get(const std::shared_ptr<Core>& core) {
    static std::mutex mu;
    static std::map<Core*, std::unique_ptr<StreamServer>> servers;
    std::lock_guard lock(mu);
    auto& s = servers[core.get()];
    if (!s) s.reset(new StreamServer(core));
    return *s;
  }

  std::string address() const { return address_; }

  uint64_t add(std::shared_ptr<StreamReaderCore::State> st) {
    std::lock_guard lock(mu_);
    uint64_t id = next_id_++;
    readers_[id] = st;
    return id;
  }
  void remove(uint64_t id) {
    std::shared_ptr<StreamReaderCore::State> st;
    {
      std::lock_guard lock(mu_);
      auto it = readers_.find(id);
      if (it == readers_.end()) return;
      st = it->second;
      readers_.erase(it);
    }
    std::lock_guard lock(st->mu);
    if (st->conn) st->conn->close("stream reader closed");
  }

 private:
  explicit StreamServer(const std::shared_ptr<Core>& core) : core_(core) {
    std::string host = "127.0.0.1";
    if (const char* h = std::getenv("TROUPE_BIND_HOST"); h && *h) host = h;
    // The listener is created on the I/O thread that will serve it.
    auto done = std::make_shared<core::FutureState<std::string>>();
    asio::post(core->io(), [this, host, done] {
      try {
        listener_ = std::make_unique<Listener>(core_->io(), host, 0, core_->token(), ListenerOptions{},
                                               [this](std::shared_ptr<Connection> c) { accept(std::move(c)); });
        done->set_value(host + ":" + std::to_string(listener_->port()));
      } catch (...) {
        done->set_error(std::current_exception());
      }
    });
    address_ = Future<std::string>(done).get(std::chrono::seconds(10));
  }

  void accept(std::shared_ptr<Connection> c) {
    auto bound = std::make_shared<std::shared_ptr<StreamReaderCore::State>>();
    std::weak_ptr<Connection> weak = c;
    conns_[c.get()] = c;
    c->start([] {},
             [this, weak, bound](Message&& m) {
               auto conn = weak.lock();
               if (!conn) return;
               on_frame(conn, *bound, std::move(m));
             },
             [this, bound, raw = c.get()](const std::string& reason) {
               conns_.erase(raw);
               if (auto st = *bound) {
                 std::lock_guard lock(st->mu);
                 if (!st->ended && st->error.empty()) st->error = "stream writer disconnected: " + reason;
                 st->conn.reset();
                 st->cv.notify_all();
               }
             });
  }

  void on_frame(const std::shared_ptr<Connection>& c, std::shared_ptr<StreamReaderCore::State>& bound, Message&& m) {
    auto op = static_cast<StreamOp>(m.op);
    if (!bound) {
      if (op != StreamOp::kOpen) return c->close("stream frame before open");
      std::shared_ptr<StreamReaderCore::State> st;
      {
        std::lock_guard lock(mu_);
        auto it = readers_.find(m.id);
        if (it != readers_.end()) st = it->second;
      }
      if (!st) return c->close("no stream with id " + std::to_string(m.id));
      std::lock_guard lock(st->mu);
      if (st->conn) return c->close("stream " + std::to_string(m.id) + " already has a writer");
      st->conn = c;
      bound = st;
      c->send(stream_event(StreamOp::kCredit, m.id, std::to_string(st->credits)), true);
      return;
    }
    auto& st = *bound;
    std::lock_guard lock(st.mu);
    switch (op) {
      case StreamOp::kData:
        if (st.items.size() >= st.credits) {
          c->close("stream writer exceeded its credit");
          st.error = "stream writer exceeded its credit";
          break;
        }
        st.items.push_back(std::move(m));
        break;
      case StreamOp::kEnd:
        st.ended = true;
        break;
      case StreamOp::kError:
        st.error = "stream writer failed: " + m.body;
        break;
      default:
        c->close("unexpected stream op " + std::to_string(m.op));
    }
    st.cv.notify_all();
  }

  std::shared_ptr<Core> core_;
  std::unique_ptr<Listener> listener_;
  std::string address_;
  std::mutex mu_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::shared_ptr<StreamReaderCore::State>> readers_;
  std::map<Connection*, std::shared_ptr<Connection>> conns_;  // io thread only
};

StreamReaderCore::StreamReaderCore(const std::shared_ptr<Core>& core, size_t credits)
    : state_(std::make_shared<State>()) {
  if (credits == 0) throw ConfigError("a stream needs at least 1 credit");
  state_->credits = credits;
  auto& server = StreamServer::get(core);
  ref_.address = server.address();
  ref_.id = server.add(state_);
  server_core_ = core;
}

StreamReaderCore::~StreamReaderCore() {
  if (auto c = server_core_.lock()) StreamServer::get(c).remove(ref_.id);
}

std::optional<Message> StreamReaderCore::read(std::chrono::milliseconds timeout) {
  std::unique_lock lock(state_->mu);
  if (!state_->cv.wait_for(lock, timeout,
                           [&] { return !state_->items.empty() || state_->ended || !state_->error.empty(); }))
    throw Timeout("stream " + std::to_string(ref_.id) + ": nothing to read after " + std::to_string(timeout.count()) +
                  " ms");
  if (!state_->items.empty()) {
    Message m = std::move(state_->items.front());
    state_->items.pop_front();
    // Grant credit back in batches (half the window) to keep frames few.
    if (++state_->consumed_since_grant >= std::max<size_t>(1, state_->credits / 2) && state_->conn) {
      state_->conn->send(stream_event(StreamOp::kCredit, ref_.id, std::to_string(state_->consumed_since_grant)), true);
      state_->consumed_since_grant = 0;
    }
    return m;
  }
  if (!state_->error.empty()) throw StreamError(state_->error);
  return std::nullopt;
}

void StreamReaderCore::cancel(const std::string& reason) {
  std::shared_ptr<Connection> conn;
  {
    std::lock_guard lock(state_->mu);
    if (state_->error.empty() && !state_->ended) state_->error = "stream cancelled by its reader: " + reason;
    conn = state_->conn;
  }
  state_->cv.notify_all();
  // Outside the lock: closing may run the connection's close handler,
  // which takes it.
  if (conn) conn->close("stream cancelled: " + reason);
}

size_t StreamReaderCore::buffered() const {
  std::lock_guard lock(state_->mu);
  return state_->items.size();
}

struct StreamWriterCore::State {
  mutable std::mutex mu;
  std::condition_variable cv;
  size_t credits = 0;
  size_t in_flight = 0;
  size_t max_in_flight = 0;
  bool opened = false;
  bool closed = false;
  std::string error;
  std::shared_ptr<Connection> conn;
  uint64_t id = 0;
};

StreamWriterCore::StreamWriterCore(const std::shared_ptr<Core>& core, const StreamRef& ref,
                                   std::chrono::milliseconds timeout)
    : state_(std::make_shared<State>()) {
  state_->id = ref.id;
  auto [host, port] = parse_address(ref.address);
  auto st = state_;
  auto done = std::make_shared<core::FutureState<std::string>>();
  asio::post(core->io(), [&io = core->io(), host = host, port = port, token = core->token(), st, done, id = ref.id] {
    Connection::connect(
        io, host, port, token, FrameLimits{},
        [st](Message&& m) {
          if (static_cast<StreamOp>(m.op) != StreamOp::kCredit) return;
          size_t n = 0;
          try {
            n = std::stoull(m.body);
          } catch (...) {
            return;
          }
          std::lock_guard lock(st->mu);
          if (!st->opened) {
            st->opened = true;
            st->credits = n;
          } else {
            st->credits += n;
            st->in_flight -= std::min(st->in_flight, n);
          }
          st->cv.notify_all();
        },
        [st](const std::string& reason) {
          std::lock_guard lock(st->mu);
          if (st->error.empty()) st->error = "stream reader disconnected: " + reason;
          st->cv.notify_all();
        },
        [st, done, id](std::shared_ptr<Connection> c, std::string error) {
          if (!c) return done->set_value(error.empty() ? "connect failed" : error);
          {
            std::lock_guard lock(st->mu);
            st->conn = c;
          }
          c->send(stream_event(StreamOp::kOpen, id), true);
          done->set_value("");
        });
  });
  std::string err = Future<std::string>(done).get(timeout);
  if (!err.empty())
    throw StreamError("cannot connect to stream " + std::to_string(ref.id) + " at " + ref.address + ": " + err);
  std::unique_lock lock(st->mu);
  if (!st->cv.wait_for(lock, timeout, [&] { return st->opened || !st->error.empty(); }))
    throw Timeout("stream " + std::to_string(ref.id) + " did not open within " + std::to_string(timeout.count()) +
                  " ms");
  if (!st->error.empty()) throw StreamError(st->error);
}

StreamWriterCore::~StreamWriterCore() {
  std::lock_guard lock(state_->mu);
  if (!state_->conn) return;
  // After end-of-stream, leave gracefully (the reader may still be reading);
  // without it, the reader must see the writer go away.
  if (state_->closed)
    state_->conn->finish();
  else
    state_->conn->close("stream writer destroyed before close()");
}

void StreamWriterCore::write(Encoder&& e, std::chrono::milliseconds timeout) {
  auto& st = *state_;
  std::unique_lock lock(st.mu);
  if (st.closed) throw StreamError("write after close on stream " + std::to_string(st.id));
  if (!st.cv.wait_for(lock, timeout, [&] { return st.credits > 0 || !st.error.empty(); }))
    throw Timeout("stream " + std::to_string(st.id) + ": no credit from the reader after " +
                  std::to_string(timeout.count()) + " ms");
  if (!st.error.empty()) throw StreamError(st.error);
  --st.credits;
  ++st.in_flight;
  st.max_in_flight = std::max(st.max_in_flight, st.in_flight);
  Message m = stream_event(StreamOp::kData, st.id, std::move(e.bytes()));
  m.attachments = std::move(e.attachments());
  st.conn->send(m, true);
}

void StreamWriterCore::close() {
  std::lock_guard lock(state_->mu);
  if (state_->closed) return;
  state_->closed = true;
  if (state_->conn) state_->conn->send(stream_event(StreamOp::kEnd, state_->id), true);
}

void StreamWriterCore::fail(const std::string& error) {
  std::lock_guard lock(state_->mu);
  if (state_->closed) return;
  state_->closed = true;
  if (state_->conn) state_->conn->send(stream_event(StreamOp::kError, state_->id, error), true);
  // A write() blocked on credit (another thread) returns now.
  if (state_->error.empty()) state_->error = "stream failed by its writer: " + error;
  state_->cv.notify_all();
}

size_t StreamWriterCore::in_flight() const {
  std::lock_guard lock(state_->mu);
  return state_->in_flight;
}

size_t StreamWriterCore::max_in_flight() const {
  std::lock_guard lock(state_->mu);
  return state_->max_in_flight;
}

}  // namespace troupe::client
