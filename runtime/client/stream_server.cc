#include "troupe/runtime/client/stream_server.h"

#include "troupe/runtime/client/listen_host.h"
#include "troupe/runtime/client/process_stats.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/core/worker_env.h"

namespace troupe::client {

using namespace troupe::wire;

Message stream_event(StreamOp op, uint64_t id, std::string body) {
  Message m;
  m.kind = Kind::EVENT;
  m.op = static_cast<uint32_t>(op);
  m.id = id;
  m.body = std::move(body);
  return m;
}

Message credit_event(uint64_t id, uint64_t credits) {
  return stream_event(StreamOp::kCredit, id, encode_inline(credits));
}

StreamServer::StreamServer(Core& core) : core_(core) {
  const std::string host = listen_host(core_.address());
  // Readers connect to the advertise host (never a wildcard bind address).
  std::string advertise = core::env_value(core::kEnvAdvertiseHost);
  if (advertise.empty()) advertise = default_advertise_host(host);
  // The listener is created on the I/O thread that will serve it.
  auto done = std::make_shared<core::FutureState<std::string>>();
  asio::post(core_.io(), [this, host, advertise, done] {
    try {
      ListenerOptions options;
      options.connection = core_.connection_options();
      listener_ = std::make_unique<Listener>(core_.io(), host, 0, core_.token(), options,
                                             [this](std::shared_ptr<Connection> c) { accept(std::move(c)); });
      done->set_value(format_address(advertise, listener_->port()));
    } catch (...) {
      done->set_error(std::current_exception());
    }
  });
  address_ = Future<std::string>(done).get(std::chrono::seconds(10));
}

uint64_t StreamServer::add(std::shared_ptr<StreamReaderCore::State> st) {
  std::lock_guard lock(mu_);
  uint64_t id = next_id_++;
  readers_[id] = std::move(st);
  return id;
}

void StreamServer::remove(uint64_t id) {
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

void StreamServer::accept(std::shared_ptr<Connection> c) {
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
               std::shared_ptr<const std::function<void()>> changed;
               {
                 std::lock_guard lock(st->mu);
                 if (!st->ended && st->error.empty()) st->error = "stream writer disconnected: " + reason;
                 st->conn.reset();
                 changed = st->on_change;
               }
               st->cv.notify_all();
               if (changed) (*changed)();
             }
           });
}

// A writer's first frame names the stream it feeds.
void StreamServer::bind(const std::shared_ptr<Connection>& c, std::shared_ptr<StreamReaderCore::State>& bound,
                        const Message& m) {
  if (static_cast<StreamOp>(m.op) != StreamOp::kOpen) return c->close("stream frame before open");
  // A refused writer is told why before the connection ends.
  auto refuse = [&](const std::string& why) {
    c->send(stream_event(StreamOp::kError, m.id, why), true);
    c->finish();
  };
  std::shared_ptr<StreamReaderCore::State> st;
  {
    std::lock_guard lock(mu_);
    auto it = readers_.find(m.id);
    if (it != readers_.end()) st = it->second;
  }
  if (!st) return refuse("no stream with id " + std::to_string(m.id));
  std::lock_guard lock(st->mu);
  // One writer per stream, ever: one that comes after the first ended or
  // failed (an actor call resent to a restarted actor) would feed a reader
  // that stopped reading, and wait for credit forever. (Checked first: the
  // first writer's connection may not have closed yet.)
  if (st->ended || !st->error.empty()) return refuse("stream " + std::to_string(m.id) + " is over");
  if (st->conn) return refuse("stream " + std::to_string(m.id) + " already has a writer");
  st->conn = c;
  bound = st;
  c->send(credit_event(m.id, st->credits), true);
}

void StreamServer::on_frame(const std::shared_ptr<Connection>& c, std::shared_ptr<StreamReaderCore::State>& bound,
                            Message&& m) {
  if (!bound) return bind(c, bound, m);
  auto& st = *bound;
  std::shared_ptr<const std::function<void()>> changed;
  {
    std::lock_guard lock(st.mu);
    apply_frame(c, st, std::move(m));
    changed = st.on_change;
  }
  st.cv.notify_all();
  if (changed) (*changed)();
}

void StreamServer::apply_frame(const std::shared_ptr<Connection>& c, StreamReaderCore::State& st, Message&& m) {
  switch (static_cast<StreamOp>(m.op)) {
    case StreamOp::kData:
      if (st.items.size() >= st.credits) {
        c->close("stream writer exceeded its credit");
        st.error = "stream writer exceeded its credit";
        break;
      }
      {
        uint64_t bytes = m.body.size();
        for (const auto& a : m.attachments) bytes += a.size();
        process_stats().stream_bytes.fetch_add(bytes, std::memory_order_relaxed);
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
}

}  // namespace troupe::client
