// The two sides of one process's stream connections, internal to
// client/stream.cc (users see StreamReader/StreamWriter):
//
//  - StreamServer, the listener: accepts writers' connections and routes
//    each frame to the reader its stream id names;
//  - StreamLinks, the writers' side: one connection per reader process (by
//    its listener's address), shared by every writer in this process that
//    feeds a stream there.
//
// So a connection carries many streams, one after another or at once, told
// apart by the stream id every frame carries; opening a stream on it costs
// no wait at all, not a TCP connect and a handshake. Each stream has its own
// credits, so one slow reader never holds up the others (a frame is always
// taken off the socket: its stream granted room for it). What ends one
// stream (its end, an error, a reader's cancel, a writer over its credit)
// ends only that stream; a connection that closes fails every stream it
// still carried.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "troupe/runtime/client/core.h"
#include "troupe/runtime/client/stream.h"
#include "troupe/runtime/wire/connection.h"

namespace troupe::client {

// The frames of a stream connection (in Message::op; Message::id is the
// stream's id).
//   writer -> reader: kOpen, then kData..., then kEnd or kError;
//   reader -> writer: kOpened (the first credits) or kError (refused) in
//   answer to kOpen; then kCredit..., and kCancel once the reader's side
//   ended the stream (cancelled, gone, or the writer overran its credit).
enum class StreamOp : uint32_t {
  kOpen = 100,
  kData = 101,
  kCredit = 102,
  kEnd = 103,
  kError = 104,
  kCancel = 105,
  kOpened = 106,
};

wire::Message stream_event(StreamOp op, uint64_t id, std::string body = {});
// A grant of `credits` more values to the writer of stream `id` (kCredit,
// or kOpened for the first).
wire::Message credit_event(uint64_t id, uint64_t credits, StreamOp op = StreamOp::kCredit);

// What a reader and the listener share about one stream.
struct StreamReaderCore::State {
  mutable std::mutex mu;
  std::condition_variable cv;
  std::deque<wire::Message> items;
  size_t credits = 0;
  size_t consumed_since_grant = 0;
  bool ended = false;
  std::string error;
  // Whether a writer ever opened it (a stream takes one, ever), and that
  // writer's connection while it lasts.
  bool bound = false;
  std::weak_ptr<wire::Connection> writer;
  // StreamReaderCore::on_change's; called after `cv` is notified.
  std::shared_ptr<const std::function<void()>> on_change;

  bool over() const { return ended || !error.empty(); }
};

class StreamServer {
 public:
  // Listens on TROUPE_BIND_HOST (or loopback) on `core`'s I/O thread.
  explicit StreamServer(Core& core);
  // Core::shutdown (the I/O thread stopped): fails every reader still
  // waiting, which would otherwise wait out its timeout (a day by default).
  ~StreamServer();
  StreamServer(const StreamServer&) = delete;
  StreamServer& operator=(const StreamServer&) = delete;

  std::string address() const { return address_; }
  // Registers a reader; returns the stream id a writer names.
  uint64_t add(std::shared_ptr<StreamReaderCore::State> st);
  // Unregisters a reader; a writer still writing is told (kCancel).
  void remove(uint64_t id);
  // Writer connections accepted so far (each carries any number of
  // streams): what tells that writers share them.
  uint64_t connections_accepted() const { return accepted_.load(); }

 private:
  // The streams one writer process's connection carries now (I/O thread).
  using Streams = std::map<uint64_t, std::shared_ptr<StreamReaderCore::State>>;

  void accept(std::shared_ptr<wire::Connection> c);
  void on_frame(const std::shared_ptr<wire::Connection>& c, Streams& streams, wire::Message&& m);
  void open(const std::shared_ptr<wire::Connection>& c, Streams& streams, const wire::Message& m);
  // One frame of an open stream, applied under its lock; false once the
  // stream is over (it leaves the connection's table).
  bool apply_frame(const std::shared_ptr<wire::Connection>& c, StreamReaderCore::State& st, wire::Message&& m);
  void on_closed(wire::Connection* raw, Streams& streams, const std::string& reason);

  Core& core_;
  std::unique_ptr<wire::Listener> listener_;
  std::string address_;
  std::mutex mu_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::shared_ptr<StreamReaderCore::State>> readers_;
  // I/O thread only: each writer connection and the streams it carries.
  std::map<wire::Connection*, std::pair<std::shared_ptr<wire::Connection>, std::shared_ptr<Streams>>> conns_;
  std::atomic<uint64_t> accepted_{0};
};

// This process's connection to one reader process, shared by its writers.
struct StreamLink {
  std::mutex mu;
  std::condition_variable cv;
  std::shared_ptr<wire::Connection> conn;  // once connected
  std::string error;                       // once it failed or closed
  // The writers it carries, by stream id. A writer that went before its
  // open was answered leaves an empty entry, which the answer removes: it
  // must not reach a later writer of that id (which is refused here).
  std::map<uint64_t, std::weak_ptr<StreamWriterCore::State>> writers;
  // Taken by a writer (under `mu`, waited for on `turn_cv`) from waiting
  // for room on the connection until its value is queued. (Not a
  // std::timed_mutex: ThreadSanitizer does not see its timed lock.)
  bool sending = false;
  std::condition_variable turn_cv;
  // Writers holding a copy of the connection on their own thread (in
  // write, close or fail), under `mu`: ~StreamLinks waits for them to let
  // go before the connection is destroyed, while its io_context exists.
  int conn_users = 0;
  std::condition_variable users_cv;
};

struct StreamWriterCore::State {
  // Held by write() and close() from taking a credit until the frame is
  // queued, so frames keep the order of the calls; fail() does not take it
  // (it must reach a write() that waits for credit).
  std::mutex send_mu;
  mutable std::mutex mu;
  std::condition_variable cv;
  size_t credits = 0;
  size_t in_flight = 0;
  size_t max_in_flight = 0;
  bool opened = false;    // kOpened came (before it: one credit, as every window has)
  bool answered = false;  // kOpened or the refusal came
  bool closed = false;
  bool failed = false;  // closed by fail()
  std::string error;
  uint64_t id = 0;
  std::shared_ptr<StreamLink> link;
  // The link's connection, kept here: the link lets go of its own copy
  // when the connection closes, and writes need it without the link's lock.
  std::shared_ptr<wire::Connection> conn;
};

class StreamLinks {
 public:
  explicit StreamLinks(Core& core) : core_(core) {}
  // Core::shutdown: fails every writer still registered, as above.
  ~StreamLinks();
  StreamLinks(const StreamLinks&) = delete;
  StreamLinks& operator=(const StreamLinks&) = delete;

  // Registers `st` (stream st->id at `address`) with the link to that
  // process, connecting it first if there is none; throws StreamError when
  // it cannot connect or the stream already has a writer in this process,
  // Timeout past `deadline`.
  void attach(const std::string& address, const std::shared_ptr<StreamWriterCore::State>& st,
              std::chrono::steady_clock::time_point deadline);
  // Unregisters `st` from its link.
  static void detach(StreamWriterCore::State& st);

 private:
  std::shared_ptr<StreamLink> link_to(const std::string& address);
  void on_frame(StreamLink& link, wire::Message&& m);
  // The link failed or closed: it leaves the table, its writers fail.
  void on_closed(const std::string& address, const std::shared_ptr<StreamLink>& link, const std::string& reason);

  Core& core_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<StreamLink>> links_;  // by reader address
};

}  // namespace troupe::client
