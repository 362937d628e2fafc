// Streaming generators (Ray's num_returns="streaming"): a generator task or
// actor method sends each value it yields to its caller as it yields it,
// one item of a runtime stream (client/stream.h), and the caller's
// ObjectRefGenerator hands out one ref per item. The stream's credits bound
// what the caller holds unread: a generator ahead of its consumer waits.
//
// PyStream is the caller's half. It reads the items and watches the call's
// own result (`done`): a call that ends without writing (an argument that
// failed, a worker that died, a cancel) fails the stream, and the last ref
// handed out is then one that raises what ended it. PyStreamWriter is the
// worker's half, which troupe/_worker_hooks.py feeds.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "python_shim/src/py_ref.h"
#include "troupe/runtime/client/stream.h"

namespace troupe::py {

class PyStream {
 public:
  enum Kind : int { kItem = 0, kEnd = 1, kFailed = 2 };
  using Next = std::pair<Kind, std::shared_ptr<PyRef>>;

  PyStream(std::shared_ptr<client::Core> core, size_t credits);
  StreamRef ref() const { return reader_->ref(); }
  // The call that writes this stream: its failure ends the stream (once the
  // items already received are read).
  void watch(std::shared_ptr<PyRef> done);
  // The next item's ref, the end (no ref), or the ref of what ended the
  // stream early (the call's own error, else the stream's); nullopt if none
  // of them came within `slice`. Call from one thread at a time.
  // Dropping the stream fails the writer's next write, so the generator
  // stops (its finally blocks run).
  std::optional<Next> next(std::chrono::milliseconds slice);
  // Whether next() would return at once (troupe.wait's readiness).
  bool ready() const;
  // Bumps ready_signal() whenever the stream may have become ready
  // (registered once), as PyRef::signal_when_ready does for a ref.
  void signal_when_ready();

 private:
  std::shared_ptr<client::Core> core_;
  std::shared_ptr<client::StreamReaderCore> reader_;
  std::shared_ptr<PyRef> done_;
  std::optional<std::string> stream_error_;  // set once the stream failed
  std::atomic<bool> signalling_{false};
};

// A stream item: a yielded value, or the error the generator raised.
class PyStreamWriter {
 public:
  // Opens the caller's stream (StreamError when its process cannot be
  // reached; a refusal, the stream being gone, fails a write after it,
  // the second at the latest).
  PyStreamWriter(std::shared_ptr<client::Core> core, const std::string& address, uint64_t id);
  // Sends one item, waiting for credit (without limit: the consumer sets
  // the pace); StreamError once the reader is gone.
  void write(const PyReply& item);
  void close() { writer_.close(); }

 private:
  client::StreamWriterCore writer_;
};

}  // namespace troupe::py
