// The stream listener of one process: a service of its client core (one per
// core, created with the first StreamReader) that accepts stream writers and
// routes each one's frames to the reader its first frame names. Internal to
// client/stream.cc; users see StreamReader/StreamWriter.
#pragma once

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

// The frames of a stream connection (in Message::op).
enum class StreamOp : uint32_t { kOpen = 100, kData = 101, kCredit = 102, kEnd = 103, kError = 104 };

wire::Message stream_event(StreamOp op, uint64_t id, std::string body = {});
// A grant of `credits` more values to the writer of stream `id`.
wire::Message credit_event(uint64_t id, uint64_t credits);

// What a reader and the listener share about one stream.
struct StreamReaderCore::State {
  mutable std::mutex mu;
  std::condition_variable cv;
  std::deque<wire::Message> items;
  size_t credits = 0;
  size_t consumed_since_grant = 0;
  bool ended = false;
  std::string error;
  std::shared_ptr<wire::Connection> conn;
  // StreamReaderCore::on_change's; called after `cv` is notified.
  std::shared_ptr<const std::function<void()>> on_change;
};

class StreamServer {
 public:
  // Listens on TROUPE_BIND_HOST (or loopback) on `core`'s I/O thread.
  explicit StreamServer(Core& core);
  StreamServer(const StreamServer&) = delete;
  StreamServer& operator=(const StreamServer&) = delete;

  std::string address() const { return address_; }
  // Registers a reader; returns the stream id a writer names.
  uint64_t add(std::shared_ptr<StreamReaderCore::State> st);
  // Unregisters a reader and closes its writer's connection.
  void remove(uint64_t id);

 private:
  void accept(std::shared_ptr<wire::Connection> c);
  void on_frame(const std::shared_ptr<wire::Connection>& c, std::shared_ptr<StreamReaderCore::State>& bound,
                wire::Message&& m);
  void bind(const std::shared_ptr<wire::Connection>& c, std::shared_ptr<StreamReaderCore::State>& bound,
            const wire::Message& m);
  // One frame of a bound writer, applied to its stream's state (under its
  // lock).
  void apply_frame(const std::shared_ptr<wire::Connection>& c, StreamReaderCore::State& st, wire::Message&& m);

  Core& core_;
  std::unique_ptr<wire::Listener> listener_;
  std::string address_;
  std::mutex mu_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::shared_ptr<StreamReaderCore::State>> readers_;
  std::map<wire::Connection*, std::shared_ptr<wire::Connection>> conns_;  // I/O thread only
};

}  // namespace troupe::client
