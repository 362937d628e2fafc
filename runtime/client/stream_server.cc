#include "troupe/runtime/client/stream_server.h"

#include "troupe/runtime/client/listen_host.h"
#include "troupe/runtime/client/object_store.h"
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

Message credit_event(uint64_t id, uint64_t credits, StreamOp op) {
  return stream_event(op, id, encode_inline(credits));
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
      // A writer whose host vanished acknowledges none of the credits this
      // reader returns: the connection ends, and its streams fail, after
      // the send timeout (keepalive finds it where nothing was sent).
      options.connection.send_timeout = send_timeout();
      listener_ = std::make_unique<Listener>(core_.io(), host, 0, core_.token(), options,
                                             [this](std::shared_ptr<Connection> c) { accept(std::move(c)); });
      done->set_value(format_address(advertise, listener_->port()));
    } catch (...) {
      done->set_error(std::current_exception());
    }
  });
  address_ = Future<std::string>(done).get(std::chrono::seconds(10));
}

StreamServer::~StreamServer() {
  std::map<uint64_t, std::shared_ptr<StreamReaderCore::State>> readers;
  {
    std::lock_guard lock(mu_);
    readers.swap(readers_);
  }
  for (auto& [id, st] : readers) {
    std::shared_ptr<const std::function<void()>> changed;
    {
      std::lock_guard lock(st->mu);
      if (!st->over()) st->error = "stream " + std::to_string(id) + ": its runtime was shut down";
      changed = st->on_change;
    }
    st->cv.notify_all();
    if (changed) (*changed)();
  }
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
  std::shared_ptr<Connection> writer;
  {
    std::lock_guard lock(st->mu);
    writer = st->writer.lock();
    // Over, so that an open under way now is refused; a writer still
    // writing stops (its next write throws); one that is done was told
    // nothing and needs nothing.
    const bool was_over = st->over();
    if (!was_over) st->error = "stream reader closed";
    if (!writer) return;
    if (!was_over) writer->send(stream_event(StreamOp::kCancel, id, "stream reader closed"), true);
  }
  // The connection's table lets go of the stream (late frames for it are
  // dropped).
  asio::post(core_.io(), [this, id, raw = writer.get()] {
    auto it = conns_.find(raw);
    if (it != conns_.end()) it->second.second->erase(id);
  });
}

void StreamServer::accept(std::shared_ptr<Connection> c) {
  auto streams = std::make_shared<Streams>();
  std::weak_ptr<Connection> weak = c;
  conns_[c.get()] = {c, streams};
  accepted_.fetch_add(1);
  // The handlers hold the stream table, whose states hold the connection
  // only weakly: nothing here keeps a connection alive but conns_.
  c->start([] {},
           [this, weak, streams](Message&& m) {
             if (auto conn = weak.lock()) on_frame(conn, *streams, std::move(m));
           },
           [this, streams, raw = c.get()](const std::string& reason) { on_closed(raw, *streams, reason); });
}

void StreamServer::on_closed(Connection* raw, Streams& streams, const std::string& reason) {
  for (auto& [id, st] : streams) {
    std::shared_ptr<const std::function<void()>> changed;
    {
      std::lock_guard lock(st->mu);
      if (!st->over()) st->error = "stream writer disconnected: " + reason;
      st->writer.reset();
      changed = st->on_change;
    }
    st->cv.notify_all();
    if (changed) (*changed)();
  }
  streams.clear();
  conns_.erase(raw);
}

// A writer opens a stream by naming it; the answer is its first credits, or
// why not.
void StreamServer::open(const std::shared_ptr<Connection>& c, Streams& streams, const Message& m) {
  auto refuse = [&](const std::string& why) { c->send(stream_event(StreamOp::kError, m.id, why), true); };
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
  if (st->over()) return refuse("stream " + std::to_string(m.id) + " is over");
  if (st->bound) return refuse("stream " + std::to_string(m.id) + " already has a writer");
  st->bound = true;
  st->writer = c;
  streams[m.id] = st;
  c->send(credit_event(m.id, st->credits, StreamOp::kOpened), true);
}

void StreamServer::on_frame(const std::shared_ptr<Connection>& c, Streams& streams, Message&& m) {
  if (static_cast<StreamOp>(m.op) == StreamOp::kOpen) return open(c, streams, m);
  auto it = streams.find(m.id);
  // A stream this connection does not carry (any more): its reader went or
  // cancelled it, and the writer, told so, has frames still on the way.
  if (it == streams.end()) return;
  auto st = it->second;
  std::shared_ptr<const std::function<void()>> changed;
  bool open = false;
  {
    std::lock_guard lock(st->mu);
    open = apply_frame(c, *st, std::move(m));
    if (!open) st->writer.reset();
    changed = st->on_change;
  }
  if (!open) streams.erase(it);
  st->cv.notify_all();
  if (changed) (*changed)();
}

bool StreamServer::apply_frame(const std::shared_ptr<Connection>& c, StreamReaderCore::State& st, Message&& m) {
  const uint64_t id = m.id;
  // Frames after the reader cancelled, before the writer heard of it.
  if (st.over()) return false;
  switch (static_cast<StreamOp>(m.op)) {
    case StreamOp::kData: {
      if (st.items.size() >= st.credits) {
        // This stream fails; the connection and its other streams go on.
        st.error = "stream writer exceeded its credit";
        c->send(stream_event(StreamOp::kCancel, id, st.error), true);
        return false;
      }
      uint64_t bytes = m.body.size();
      for (const auto& a : m.attachments) bytes += a.size();
      process_stats().stream_bytes.fetch_add(bytes, std::memory_order_relaxed);
      st.items.push_back(std::move(m));
      return true;
    }
    case StreamOp::kEnd:
      st.ended = true;
      return false;
    case StreamOp::kError:
      st.error = "stream writer failed: " + m.body;
      return false;
    default:
      st.error = "stream writer sent unexpected op " + std::to_string(m.op);
      c->send(stream_event(StreamOp::kCancel, id, st.error), true);
      return false;
  }
}

void StreamLinks::attach(const std::string& address, const std::shared_ptr<StreamWriterCore::State>& st,
                         std::chrono::steady_clock::time_point deadline) {
  const std::string which = "stream " + std::to_string(st->id) + " at " + address;
  std::shared_ptr<StreamLink> link = link_to(address);
  std::unique_lock lock(link->mu);
  if (!link->cv.wait_until(lock, deadline, [&] { return link->conn || !link->error.empty(); }))
    throw Timeout("cannot connect to " + which + ": no connection within the timeout");
  if (!link->error.empty()) throw StreamError("cannot connect to " + which + ": " + link->error);
  // A writer of this id that went before its open was answered left an
  // empty entry, which the answer removes: wait for it (an earlier writer's
  // answer must not reach this one).
  const bool answered = link->cv.wait_until(lock, deadline, [&] {
    auto it = link->writers.find(st->id);
    return it == link->writers.end() || !it->second.expired() || !link->error.empty();
  });
  if (!link->error.empty()) throw StreamError("cannot connect to " + which + ": " + link->error);
  if (!answered) throw Timeout(which + ": an earlier writer's open was not answered within the timeout");
  // Another writer of this id here: the reader's process would refuse this
  // one anyway.
  if (!link->writers.emplace(st->id, st).second) throw StreamError(which + " already has a writer in this process");
  st->link = link;
  st->conn = link->conn;
}

void StreamLinks::detach(StreamWriterCore::State& st) {
  if (!st.link) return;
  // The link's lock, then the writer's: on_frame takes an answer so too.
  std::lock_guard lock(st.link->mu);
  auto it = st.link->writers.find(st.id);
  if (it == st.link->writers.end() || it->second.lock().get() != &st) return;
  bool answered = false;
  {
    std::lock_guard state_lock(st.mu);
    answered = st.answered;
  }
  // Unanswered: the entry stays, empty, until the answer comes and goes
  // with it (on_frame), so the answer never reaches a later writer.
  if (answered)
    st.link->writers.erase(it);
  else
    it->second.reset();
}

StreamLinks::~StreamLinks() {
  std::map<std::string, std::shared_ptr<StreamLink>> links;
  {
    std::lock_guard lock(mu_);
    links.swap(links_);
  }
  for (auto& [address, link] : links) {
    // The connections go now, while the core's io_context they belong to
    // still exists: a writer that outlives its runtime held one, and
    // destroyed it after the io_context (a use after free).
    std::vector<std::shared_ptr<StreamWriterCore::State>> writers;
    std::vector<std::shared_ptr<Connection>> conns;
    {
      std::lock_guard lock(link->mu);
      if (link->error.empty()) link->error = "its runtime was shut down";
      for (auto& [id, w] : link->writers)
        if (auto st = w.lock()) writers.push_back(std::move(st));
      if (link->conn) conns.push_back(std::move(link->conn));
    }
    // Every writer's error is set before any waiter is woken: a woken
    // writer finds it.
    for (auto& st : writers) {
      std::lock_guard lock(st->mu);
      if (st->error.empty()) st->error = "stream " + std::to_string(st->id) + ": its runtime was shut down";
      if (st->conn) conns.push_back(std::move(st->conn));
    }
    link->cv.notify_all();
    link->turn_cv.notify_all();  // writers waiting for the link's turn
    for (auto& st : writers) st->cv.notify_all();
    // Writers waiting for room on the connection: the I/O thread that would
    // have drained it is stopped.
    for (auto& c : conns) c->release_room_waiters();
    // The writers woken hold copies of the connection on their threads:
    // they let go (at once: they fail) before `conns` destroys it, while
    // the core's io_context exists. Bounded: a writer's thread that is
    // not scheduled does not hold up the shutdown for ever.
    std::unique_lock lock(link->mu);
    link->users_cv.wait_for(lock, std::chrono::seconds(10), [&] { return link->conn_users == 0; });
  }
}

std::shared_ptr<StreamLink> StreamLinks::link_to(const std::string& address) {
  auto [host, port] = parse_address(address);
  std::shared_ptr<StreamLink> link;
  {
    std::lock_guard lock(mu_);
    auto& slot = links_[address];
    if (slot) return slot;
    slot = link = std::make_shared<StreamLink>();
  }
  // The connection's handlers hold the link weakly: the link (in links_ and
  // in its writers) holds the connection, never the other way round.
  std::weak_ptr<StreamLink> weak = link;
  // A reader whose host vanished takes none of what this writer sends:
  // the connection ends after the send timeout (as the reader's side
  // does), not after the kernel's retransmissions, about 15 minutes of a
  // writer (and a one-at-a-time actor's other callers) blocked.
  ConnectionOptions options = core_.connection_options();
  options.send_timeout = send_timeout();
  asio::post(core_.io(), [this, host = host, port = port, address, weak, options] {
    Connection::connect(
        core_.io(), host, port, core_.token(), options,
        [this, weak](Message&& m) {
          if (auto link = weak.lock()) on_frame(*link, std::move(m));
        },
        [this, address, weak](const std::string& reason) {
          if (auto link = weak.lock()) on_closed(address, link, reason);
        },
        [this, address, weak](std::shared_ptr<Connection> c, std::string error) {
          auto link = weak.lock();
          if (!link) {
            if (c) c->close("stream link no longer wanted");
            return;
          }
          if (!c) return on_closed(address, link, error.empty() ? "connect failed" : error);
          std::lock_guard lock(link->mu);
          link->conn = std::move(c);
          link->cv.notify_all();
        });
  });
  return link;
}

void StreamLinks::on_frame(StreamLink& link, Message&& m) {
  const auto op = static_cast<StreamOp>(m.op);
  uint64_t n = 0;
  if (op == StreamOp::kOpened || op == StreamOp::kCredit) {
    try {
      n = decode_value<uint64_t>(m.body);
    } catch (const DecodeError& e) {
      TROUPE_LOG_WARN("stream {}: bad credit from the reader: {}", m.id, e.what());
      return;
    }
  }
  const bool answer = op == StreamOp::kOpened || op == StreamOp::kError;
  std::shared_ptr<StreamWriterCore::State> st;
  std::unique_lock link_lock(link.mu);
  auto it = link.writers.find(m.id);
  if (it != link.writers.end()) st = it->second.lock();
  if (!st) {
    // The answer to the open of a writer that went before it came: its
    // entry goes, and a writer of that id waiting for that may come.
    if (answer && it != link.writers.end()) {
      link.writers.erase(it);
      link.cv.notify_all();
    }
    return;  // a writer that went: what its reader still sends it is moot
  }
  // An answer is taken under the link's lock, as detach() decides under it
  // whether one came: none slips between them.
  if (!answer) link_lock.unlock();
  std::lock_guard lock(st->mu);
  switch (op) {
    case StreamOp::kOpened:
      if (st->opened) return;
      st->opened = st->answered = true;
      // The window less what went before the answer (one value at most).
      st->credits = n > st->in_flight ? n - st->in_flight : 0;
      break;
    case StreamOp::kCredit:
      if (!st->opened) return;
      st->credits += n;
      st->in_flight -= std::min(st->in_flight, n);
      break;
    case StreamOp::kError:  // the answer to its open: refused
      st->answered = true;
      if (st->error.empty()) st->error = "stream refused by its reader's process: " + m.body;
      break;
    case StreamOp::kCancel:
      if (st->error.empty()) st->error = "stream ended by its reader: " + m.body;
      break;
    default:
      return;
  }
  st->cv.notify_all();
}

void StreamLinks::on_closed(const std::string& address, const std::shared_ptr<StreamLink>& link,
                            const std::string& reason) {
  {
    std::lock_guard lock(mu_);
    auto it = links_.find(address);
    if (it != links_.end() && it->second == link) links_.erase(it);
  }
  std::vector<std::shared_ptr<StreamWriterCore::State>> writers;
  {
    std::lock_guard lock(link->mu);
    if (link->error.empty()) link->error = reason;
    // Done with: the writers' copies let go of it with them.
    link->conn.reset();
    for (auto& [id, w] : link->writers)
      if (auto st = w.lock()) writers.push_back(std::move(st));
    link->writers.clear();
    link->cv.notify_all();
    link->turn_cv.notify_all();
  }
  for (auto& st : writers) {
    std::lock_guard lock(st->mu);
    if (st->error.empty()) st->error = "stream reader disconnected: " + reason;
    st->cv.notify_all();
  }
}

}  // namespace troupe::client
