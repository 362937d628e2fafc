#include "python_shim/src/py_stream.h"

namespace troupe::py {

namespace {

// Whether a call's answer is a failure: a runtime error, or a Python
// exception the worker answered with.
bool failed(ReplyState& st) { return st.error() || st.value().error; }

std::shared_ptr<ReplyState> answered(PyReply reply) {
  auto st = std::make_shared<ReplyState>();
  st->set_value(std::move(reply));
  return st;
}

}  // namespace

PyStream::PyStream(std::shared_ptr<client::Core> core, size_t credits)
    : core_(std::move(core)), reader_(std::make_shared<client::StreamReaderCore>(core_, credits)) {}

void PyStream::watch(std::shared_ptr<PyRef> done) {
  done_ = std::move(done);
  auto st = done_->answer();
  std::weak_ptr<client::StreamReaderCore> weak = reader_;
  // On the thread that completes the call (the I/O thread): the reader's
  // cancel is thread-safe. A call that succeeded wrote its end of stream
  // before it answered. (The state is alive while its callbacks run.)
  st->on_ready([weak, raw = st.get()] {
    if (!failed(*raw)) return;
    if (auto reader = weak.lock()) reader->cancel("the streaming call ended without finishing its stream");
  });
}

std::optional<PyStream::Next> PyStream::next(std::chrono::milliseconds slice) {
  if (!stream_error_) {
    try {
      std::optional<wire::Message> m = reader_->read(slice);
      if (!m) return Next{kEnd, nullptr};
      // Refs inside the value register with their owners, as a call's
      // answer's do.
      auto reply = wire::decode_value<PyReply>(m->body.data(), m->body.size(), &m->attachments, core_.get());
      return Next{kItem, std::make_shared<PyRef>(core_, answered(std::move(reply)))};
    } catch (const Timeout&) {
      return std::nullopt;
    } catch (const StreamError& e) {
      stream_error_ = e.what();
    }
  }
  // The stream failed: say why with the call's own failure (a worker that
  // died is a WorkerCrashedError, which a retry can act on), once it is
  // known; else with the stream's.
  if (done_) {
    auto st = done_->answer();
    if (!st->wait_for(slice)) return std::nullopt;
    if (failed(*st)) return Next{kFailed, done_};
  }
  auto st = std::make_shared<ReplyState>();
  st->set_error(std::make_exception_ptr(StreamError(
      "the stream of a streaming call broke before its end (its worker died, or the connection was lost): " +
      *stream_error_)));
  return Next{kFailed, std::make_shared<PyRef>(core_, st)};
}

bool PyStream::ready() const {
  using Peek = client::StreamReaderCore::Peek;
  // A failed stream is ready once it can say why: with the call's own
  // failure (next() waits for it), or without a call to wait for.
  // (Once a read threw, peek() says kFailed for good: stream_error_, which
  // next() writes, is not read here.)
  auto why_known = [&] { return !done_ || done_->answer()->ready(); };
  switch (reader_->peek()) {
    case Peek::kItem:
    case Peek::kEnd:
      return true;
    case Peek::kFailed:
      return why_known();
    case Peek::kWait:
      break;
  }
  return false;
}

void PyStream::signal_when_ready() {
  if (signalling_.exchange(true)) return;
  reader_->on_change(bump_ready_signal);
  if (done_) done_->signal_when_ready();
}

PyStreamWriter::PyStreamWriter(std::shared_ptr<client::Core> core, const std::string& address, uint64_t id)
    : writer_(core, StreamRef{address, id}, std::chrono::seconds(30)) {}

void PyStreamWriter::write(const PyReply& item) {
  wire::Encoder e;
  wire::encode(e, item);
  writer_.write(std::move(e), std::chrono::hours(24 * 365));
}

}  // namespace troupe::py
