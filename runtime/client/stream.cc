#include "troupe/runtime/client/stream.h"

#include "troupe/runtime/client/stream_server.h"

#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/wire/connection.h"

namespace troupe::client {

using namespace troupe::wire;

namespace {

// What a value's frame leaves under the connection's write bound for the
// frames sent without waiting (opens, ends, credits: tens of bytes each).
constexpr uint64_t kControlRoom = 1 << 20;

// Why a reader's process would refuse frame `f` ("" if it would not).
std::string frame_refusal(const OutFrame& f, const FrameLimits& limits) {
  uint32_t message_bytes = 0, attachments = 0;
  std::string why = check_header(f.head.data(), limits, &message_bytes, &attachments);
  if (!why.empty()) return why;
  std::vector<uint64_t> sizes;
  sizes.reserve(f.attachments.size());
  for (const auto& a : f.attachments) sizes.push_back(a.size());
  return check_sizes(message_bytes, sizes, limits);
}

// A writer's turn to send on its link (StreamLink::sending), given back
// when it goes out of scope.
class LinkTurn {
 public:
  explicit LinkTurn(StreamLink& link) : link_(link) {}
  LinkTurn(const LinkTurn&) = delete;
  LinkTurn& operator=(const LinkTurn&) = delete;
  // False when `deadline` passed first, or the link failed (its error set:
  // a shutdown, or its connection gone) while this waited.
  bool take(std::chrono::steady_clock::time_point deadline) {
    std::unique_lock lock(link_.mu);
    if (!link_.turn_cv.wait_until(lock, deadline, [&] { return !link_.sending || !link_.error.empty(); })) return false;
    if (!link_.error.empty()) return false;
    link_.sending = taken_ = true;
    return true;
  }
  ~LinkTurn() {
    if (!taken_) return;
    {
      std::lock_guard lock(link_.mu);
      link_.sending = false;
    }
    link_.turn_cv.notify_one();
  }

 private:
  StreamLink& link_;
  bool taken_ = false;
};

// A writer's own copy of its link's connection, counted on the link while
// held: a runtime's shutdown wakes the writers waiting on it, and one
// whose copy was the last, dropped after the core's io_context was gone,
// destroyed the connection's timers in freed memory (ASan).
class ConnCopy {
 public:
  explicit ConnCopy(const std::shared_ptr<StreamLink>& link) : link_(link) {
    if (!link_) return;
    std::lock_guard lock(link_->mu);
    ++link_->conn_users;
  }
  ConnCopy(const ConnCopy&) = delete;
  ConnCopy& operator=(const ConnCopy&) = delete;
  ~ConnCopy() {
    conn.reset();
    if (!link_) return;
    {
      std::lock_guard lock(link_->mu);
      --link_->conn_users;
    }
    link_->users_cv.notify_all();
  }
  std::shared_ptr<Connection> conn;

 private:
  std::shared_ptr<StreamLink> link_;
};

}  // namespace

StreamReaderCore::StreamReaderCore(const std::shared_ptr<Core>& core, size_t credits)
    : state_(std::make_shared<State>()), core_(core) {
  if (credits == 0) throw ConfigError("a stream needs at least 1 credit");
  state_->credits = credits;
  auto server = core->service<StreamServer>();
  ref_.address = server->address();
  ref_.id = server->add(state_);
  server_ = server;
}

StreamReaderCore::~StreamReaderCore() {
  {
    // The state outlives the reader (its writer connection's table holds it):
    // nothing is told of it from now on.
    std::lock_guard lock(state_->mu);
    state_->on_change.reset();
  }
  if (auto s = server_.lock()) s->remove(ref_.id);
}

namespace {
// now + timeout, saturated: milliseconds::max() ("for ever") overflowed
// the clock's nanoseconds into a deadline in the past, a read or write
// that timed out at once.
std::chrono::steady_clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  const auto now = std::chrono::steady_clock::now();
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::time_point::max() - now) -
      std::chrono::hours(24);
  return timeout >= left ? now + left : now + timeout;
}
}  // namespace

std::optional<Message> StreamReaderCore::read(std::chrono::milliseconds timeout) {
  std::unique_lock lock(state_->mu);
  if (!state_->cv.wait_until(lock, deadline_after(timeout),
                             [&] { return !state_->items.empty() || state_->ended || !state_->error.empty(); }))
    throw Timeout("stream " + std::to_string(ref_.id) + ": nothing to read after " + std::to_string(timeout.count()) +
                  " ms");
  if (!state_->items.empty()) {
    Message m = std::move(state_->items.front());
    state_->items.pop_front();
    // Grant credit back in batches (half the window) to keep frames few.
    if (++state_->consumed_since_grant >= std::max<size_t>(1, state_->credits / 2)) {
      if (auto writer = state_->writer.lock()) {
        writer->send(credit_event(ref_.id, state_->consumed_since_grant), true);
        state_->consumed_since_grant = 0;
      }
    }
    return m;
  }
  if (!state_->error.empty()) throw StreamError(state_->error);
  return std::nullopt;
}

void StreamReaderCore::cancel(const std::string& reason) {
  std::shared_ptr<const std::function<void()>> changed;
  {
    std::lock_guard lock(state_->mu);
    if (!state_->over()) {
      state_->error = "stream cancelled by its reader: " + reason;
      // The writer stops (its next write throws); the connection, which
      // may carry other streams, stays.
      if (auto writer = state_->writer.lock())
        writer->send(stream_event(StreamOp::kCancel, ref_.id, "cancelled: " + reason), true);
    }
    changed = state_->on_change;
  }
  state_->cv.notify_all();
  if (changed) (*changed)();
}

size_t StreamReaderCore::buffered() const {
  std::lock_guard lock(state_->mu);
  return state_->items.size();
}

StreamReaderCore::Peek StreamReaderCore::peek() const {
  std::lock_guard lock(state_->mu);
  if (!state_->items.empty()) return Peek::kItem;
  if (!state_->error.empty()) return Peek::kFailed;
  return state_->ended ? Peek::kEnd : Peek::kWait;
}

void StreamReaderCore::on_change(std::function<void()> fn) {
  std::shared_ptr<const std::function<void()>> shared;
  if (fn) shared = std::make_shared<const std::function<void()>>(std::move(fn));
  std::lock_guard lock(state_->mu);
  state_->on_change = std::move(shared);
}

StreamWriterCore::StreamWriterCore(const std::shared_ptr<Core>& core, const StreamRef& ref,
                                   std::chrono::milliseconds timeout)
    : state_(std::make_shared<State>()) {
  auto& st = *state_;
  st.id = ref.id;
  // Every stream's window is at least one value: the first write goes
  // right behind the open, without waiting for its answer. That answer
  // (kOpened) brings the rest of the window; a refusal (kError: the stream
  // is gone, over, or has a writer, and the reader side drops what came)
  // fails the write that waits for credit after it.
  st.credits = 1;
  core->service<StreamLinks>()->attach(ref.address, state_, deadline_after(timeout));
  st.conn->send(stream_event(StreamOp::kOpen, ref.id), true);
}

StreamWriterCore::~StreamWriterCore() {
  {
    std::lock_guard lock(state_->mu);
    // Without end-of-stream the reader must see the writer go: as an error.
    if (!state_->closed && state_->error.empty() && state_->conn)
      state_->conn->send(stream_event(StreamOp::kError, state_->id, "stream writer destroyed before close()"), true);
  }
  StreamLinks::detach(*state_);
}

void StreamWriterCore::write(Encoder&& e, std::chrono::milliseconds timeout) {
  auto& st = *state_;
  const auto deadline = deadline_after(timeout);
  auto timed_out = [&](const std::string& what) {
    return Timeout("stream " + std::to_string(st.id) + ": " + what + " within " + std::to_string(timeout.count()) +
                   " ms");
  };
  // Nothing changes until the frame goes: a write that times out (the
  // loader's feed retries in short slices) leaves credits and counts as
  // they were, and gives back the pins of the refs the value carries
  // (each timed-out try of a value with refs kept them for good).
  wire::Unsent unsent = e.take_unsent();
  std::lock_guard order(st.send_mu);
  ConnCopy held(st.link);
  auto& conn = held.conn;
  {
    std::unique_lock lock(st.mu);
    if (st.closed)
      throw StreamError(std::string(st.failed ? "write after fail()" : "write after close()") + " on stream " +
                        std::to_string(st.id));
    if (!st.cv.wait_until(lock, deadline, [&] { return st.credits > 0 || !st.error.empty(); }))
      throw timed_out("no credit from the reader");
    if (!st.error.empty()) throw StreamError(st.error);
    conn = st.conn;
  }
  Message m = stream_event(StreamOp::kData, st.id, std::move(e.bytes()));
  m.attachments = std::move(e.attachments());
  OutFrame f = encode_frame(m);
  // A value the reader's process would refuse (its listener keeps the
  // default limits) would close the connection there, and every stream on
  // it: refused here, for this stream alone.
  if (std::string why = frame_refusal(f, FrameLimits{}); !why.empty())
    throw StreamValueRefused("stream " + std::to_string(st.id) + ": value not sent: " + why);
  // Credits bound the items in flight, not their bytes: large items (a
  // batch of images) could exceed the connection's write bound, which would
  // drop a reader that is reading. Wait for the socket to take enough, one
  // writer of the link at a time (two that both saw room could overflow it
  // together), leaving room for the small frames sent without waiting.
  // A stream that failed meanwhile (its link's connection gone, its
  // runtime shut down) says so rather than that it timed out.
  auto throw_if_failed = [&] {
    std::string error;
    {
      std::lock_guard lock(st.mu);
      error = st.error;
    }
    if (error.empty()) {
      std::lock_guard lock(st.link->mu);
      if (!st.link->error.empty()) error = "stream " + std::to_string(st.id) + ": " + st.link->error;
    }
    if (!error.empty()) throw StreamError(error);
  };
  LinkTurn turn(*st.link);
  if (!turn.take(deadline)) {
    throw_if_failed();
    throw timed_out("another stream to the reader did not drain");
  }
  if (!conn->wait_for_room(f.total_bytes() + kControlRoom, deadline)) {
    throw_if_failed();
    throw timed_out("the connection to the reader did not drain");
  }
  throw_if_failed();
  {
    // Credits only grow while send_mu is held: the one checked is still here.
    std::lock_guard lock(st.mu);
    if (!st.error.empty()) throw StreamError(st.error);
    --st.credits;
    ++st.in_flight;
    st.max_in_flight = std::max(st.max_in_flight, st.in_flight);
  }
  unsent.sent();
  conn->send(std::move(f), true);
}

namespace {
// A value larger than the write bound less kControlRoom goes out alone
// (write() waits for an empty queue): until the socket has taken enough of
// it, even a small frame would trip the bound and drop the connection with
// the value half sent (a data loader closes its stream right after its
// last batch). The end and error frames wait for that room first, without
// the stream's lock (the I/O thread, which drains the queue, takes it),
// for a while: a reader that stopped reading is the bound's to drop.
constexpr auto kEndFrameWait = std::chrono::seconds(60);
void wait_for_end_room(Connection& conn) {
  conn.wait_for_room(kControlRoom, std::chrono::steady_clock::now() + kEndFrameWait);
}
}  // namespace

void StreamWriterCore::close() {
  std::lock_guard order(state_->send_mu);
  ConnCopy held(state_->link);
  auto& conn = held.conn;
  {
    std::lock_guard lock(state_->mu);
    if (state_->closed) return;
    conn = state_->conn;
  }
  if (!conn) {  // its runtime was shut down: nothing to tell
    std::lock_guard lock(state_->mu);
    state_->closed = true;
    return;
  }
  wait_for_end_room(*conn);
  std::lock_guard lock(state_->mu);
  if (state_->closed) return;  // failed meanwhile
  state_->closed = true;
  if (state_->conn) state_->conn->send(stream_event(StreamOp::kEnd, state_->id), true);
}

void StreamWriterCore::fail(const std::string& error) {
  ConnCopy held(state_->link);
  auto& conn = held.conn;
  {
    std::lock_guard lock(state_->mu);
    if (state_->closed) return;
    conn = state_->conn;
  }
  if (conn) wait_for_end_room(*conn);
  std::lock_guard lock(state_->mu);
  if (state_->closed) return;
  state_->closed = state_->failed = true;
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
