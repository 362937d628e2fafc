// Streams between actors: a StreamReader in one process, a StreamWriter in
// another, over a direct authenticated connection (one per pair of
// processes, shared by all the streams between them), with credit-based
// flow control. The reader grants credits (its buffer size); a writer without
// credit waits, so a slow reader bounds the writer's memory. End-of-stream
// and errors travel in-band; a writer that dies makes read() throw, a
// reader that dies makes write() throw.
//
//   StreamReader<Batch> r(rt, /*credits=*/4);      // in the consumer
//   producer.call(&Loader::feed, r.ref());         // hand the ref over
//   StreamWriter<Batch> w(rt, ref); w.write(b);   // in the producer
//   while (auto b = r.read()) ...                   // nullopt at the end
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "troupe/runtime/client/runtime.h"

namespace troupe {

// Where a writer connects: the reader process's stream listener and the
// stream's id there. Pass it to the producer in a call.
struct StreamRef {
  std::string address;
  uint64_t id = 0;
  TROUPE_FIELDS(address, id)
};

// The reader or writer's peer went away, or the writer reported an error.
class StreamError : public Error {
 public:
  using Error::Error;
};

// write() refused a value over the frame limits (wire/frame.h): nothing was
// sent and the stream is as it was. Not the reader's doing: the value is
// too large whoever reads it, so sending it again fails again.
class StreamValueRefused : public StreamError {
 public:
  using StreamError::StreamError;
};

namespace client {

class StreamServer;

// Untyped halves; the templates below encode and decode.
class StreamReaderCore {
 public:
  StreamReaderCore(const std::shared_ptr<Core>& core, size_t credits);
  ~StreamReaderCore();
  StreamRef ref() const { return ref_; }
  // Next message body, nullopt at end of stream; throws StreamError.
  std::optional<wire::Message> read(std::chrono::milliseconds timeout);
  // Fails the stream from the reader's side: a read() waiting now or later
  // throws StreamError(reason) once the values already received are read.
  // Thread-safe (for a control handler unblocking a reader whose writer
  // never came).
  void cancel(const std::string& reason);
  size_t buffered() const;
  // What a read() would do now: wait, return an item, return the end, or
  // throw (the stream failed). Thread-safe.
  enum class Peek { kWait, kItem, kEnd, kFailed };
  Peek peek() const;
  // `fn` is called each time the stream may have become readable (an item
  // came, it ended, it failed, its writer's connection closed), on the
  // thread that saw it (the I/O thread, or a cancel()'s), outside the
  // stream's lock; it replaces an earlier one, and an empty `fn` removes
  // it. For a waiter over many streams (Python's troupe.wait) that sleeps
  // on a signal of its own. The reader's destructor removes it, but a call
  // under way then may still finish: `fn` must own what it uses.
  void on_change(std::function<void()> fn);
  // The reader process's client core, which decoding an ObjectRef inside a
  // value needs; null once the process's runtime is gone.
  std::shared_ptr<Core> core() const { return core_.lock(); }
  struct State;

 private:
  std::shared_ptr<State> state_;
  StreamRef ref_;
  std::weak_ptr<Core> core_;
  // The process's stream listener (owned by its client core).
  std::weak_ptr<StreamServer> server_;
};

class StreamWriterCore {
 public:
  StreamWriterCore(const std::shared_ptr<Core>& core, const StreamRef& ref, std::chrono::milliseconds timeout);
  ~StreamWriterCore();
  void write(wire::Encoder&& e, std::chrono::milliseconds timeout);
  void close();
  void fail(const std::string& error);
  size_t in_flight() const;
  size_t max_in_flight() const;
  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace client

template <class T>
class StreamReader {
 public:
  explicit StreamReader(Runtime& rt, size_t credits = 8) : core_(rt.core(), credits) {}
  StreamRef ref() const { return core_.ref(); }
  // See StreamReaderCore::cancel.
  void cancel(const std::string& reason) { core_.cancel(reason); }
  // The next value; nullopt once the writer closed the stream. Throws
  // StreamError when the writer died or failed, Timeout after `timeout`.
  std::optional<T> read(std::chrono::milliseconds timeout = std::chrono::hours(24)) {
    auto m = core_.read(timeout);
    if (!m) return std::nullopt;
    // With the core, object refs inside the value decode (and register
    // with their owners) as they do in call arguments.
    auto core = core_.core();
    return wire::decode_value<T>(m->body.data(), m->body.size(), &m->attachments, core.get());
  }
  // Values received and not yet read (never more than the credits).
  size_t buffered() const { return core_.buffered(); }
  // See StreamReaderCore::peek and on_change: for a reader that waits on
  // many streams (and other things) at once.
  client::StreamReaderCore::Peek peek() const { return core_.peek(); }
  void on_change(std::function<void()> fn) { core_.on_change(std::move(fn)); }

 private:
  client::StreamReaderCore core_;
};

template <class T>
class StreamWriter {
 public:
  // Opens stream `ref`: connects to its reader's process if this process
  // has no connection there yet (StreamError when it cannot, Timeout past
  // `timeout`), sends the open and returns without waiting for its answer.
  StreamWriter(Runtime& rt, const StreamRef& ref, std::chrono::milliseconds timeout = std::chrono::seconds(30))
      : core_(rt.core(), ref, timeout) {}
  // Sends v, waiting for credit first (and, for large values, for the
  // connection to drain under its write bound). Throws StreamError when the
  // reader is gone, Timeout when either wait outlasts `timeout`: nothing
  // was sent then, and writing v again is safe. The first value goes
  // without waiting for the open's answer (every stream's window holds
  // one). A stream whose reader's process refused the open (it is gone,
  // over, or has another writer) drops what came, and the next write after
  // the refusal throws StreamError saying why: the second write at the
  // latest, since it waits for the window. A value over the frame limits
  // (wire/frame.h) throws StreamValueRefused and is not sent.
  void write(const T& v, std::chrono::milliseconds timeout = std::chrono::hours(24)) {
    wire::Encoder e;
    wire::encode(e, v);
    core_.write(std::move(e), timeout);
  }
  // End of stream: the reader's read() returns nullopt after the last value.
  void close() { core_.close(); }
  // Ends the stream with an error the reader sees as StreamError.
  void fail(const std::string& error) { core_.fail(error); }
  // Values sent whose credit has not come back (the reader's buffer use).
  size_t in_flight() const { return core_.in_flight(); }
  size_t max_in_flight() const { return core_.max_in_flight(); }

 private:
  client::StreamWriterCore core_;
};

}  // namespace troupe
