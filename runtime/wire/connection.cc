#include "troupe/runtime/wire/connection.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <system_error>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/core/rate_limited_log.h"

namespace troupe::wire {

namespace {
// Room kept for each read once a connection carries traffic (read_chunk_);
// buffers grow past it only with bytes that arrive (grown_capacity).
constexpr size_t kReadChunk = 64 * 1024;
constexpr size_t kLowWater = 256 * 1024;

// asio opens sockets without SOCK_CLOEXEC; a socket must never outlive an
// exec (spawn_process also closes stray descriptors in the child).
void set_cloexec(int fd) { ::fcntl(fd, F_SETFD, ::fcntl(fd, F_GETFD) | FD_CLOEXEC); }

// Bytes unacknowledged for `timeout` end the connection (TCP_USER_TIMEOUT);
// set before a connect, it bounds the SYN's retries too.
void set_user_timeout(int fd, std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0) return;
  const unsigned ms = unsigned(timeout.count());
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, sizeof ms);
}

// A peer whose host vanished (powered off, its cable pulled: no reset, no
// close) is found out on a connection that carries nothing: after 60 s of
// silence the kernel probes every 10 s, and 6 unanswered probes end it
// (about 2 minutes; where TCP_USER_TIMEOUT is set, that time since the
// last byte received instead). Without, such a connection waited for
// ever: a stream's reader, a borrower that had asked for nothing yet. A
// live peer's kernel answers the probes, stopped or not, and a network
// outage shorter than that leaves idle connections be, as before.
void set_keepalive(int fd) {
  const int on = 1, idle_s = 60, interval_s = 10, count = 6;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof idle_s);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval_s, sizeof interval_s);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
}

std::string endpoint_text(const asio::ip::tcp::socket& s) {
  asio::error_code ec;
  auto ep = s.remote_endpoint(ec);
  if (ec) return "?";
  return ep.address().to_string() + ":" + std::to_string(ep.port());
}

// Why a connection closed whose peer sent nothing at all.
constexpr const char* kSilentPeer = "closed before sending anything (a port check)";
// On the accepting side, a connecting peer that went away before its proof:
// never a wrong token (the connecting side proves first, whatever its
// token), but a process that exited or gave up while connecting.
constexpr const char* kLeftMidHandshake =
    "the peer closed the connection before proving its token (it exited or gave up while connecting)";

core::RateLimitedLog& refusal_log() {
  static core::RateLimitedLog log("refused connections");
  return log;
}

core::RateLimitedLog& bad_frame_log() {
  static core::RateLimitedLog log("connections closed for a bad frame");
  return log;
}

// Accept failures that mean "out of descriptors or kernel memory": retrying
// at once would spin, so the listener pauses instead.
bool is_resource_exhaustion(const asio::error_code& ec) {
  int v = ec.value();
  return ec.category() == asio::system_category() && (v == EMFILE || v == ENFILE || v == ENOBUFS || v == ENOMEM);
}
}  // namespace

Connection::Connection(asio::ip::tcp::socket socket, std::string token, bool accepting, ConnectionOptions options)
    : io_(static_cast<asio::io_context&>(socket.get_executor().context())),
      socket_(std::move(socket)),
      token_(std::move(token)),
      accepting_(accepting),
      opts_(options),
      handshake_timer_(io_) {
  peer_ = endpoint_text(socket_);
  asio::error_code ec;
  socket_.set_option(asio::ip::tcp::no_delay(true), ec);
  set_user_timeout(socket_.native_handle(), opts_.send_timeout);
  set_keepalive(socket_.native_handle());
}

Connection::~Connection() = default;

void Connection::start(ReadyHandler on_ready, FrameHandler on_frame, CloseHandler on_close) {
  on_ready_ = std::move(on_ready);
  on_frame_ = std::move(on_frame);
  on_close_ = std::move(on_close);
  if (accepting_) arm_handshake_deadline();
  do_handshake();
}

// An accepted peer that neither proves the token nor goes away would hold
// its socket for ever; the deadline closes it.
void Connection::arm_handshake_deadline() {
  if (opts_.handshake_timeout.count() <= 0) return;
  handshake_timer_.expires_after(opts_.handshake_timeout);
  handshake_timer_.async_wait([self = shared_from_this()](asio::error_code ec) {
    if (ec || self->ready_) return;
    self->fail("handshake not finished within " + std::to_string(self->opts_.handshake_timeout.count()) + " ms");
  });
}

void Connection::do_handshake() {
  my_nonce_ = random_nonce();
  std::memcpy(hello_out_.data(), kAuthMagic, 8);
  std::memcpy(hello_out_.data() + 8, my_nonce_.data(), kNonceBytes);
  auto self = shared_from_this();
  asio::async_write(socket_, asio::buffer(hello_out_), [self](asio::error_code ec, size_t) {
    if (ec) return self->fail("handshake write failed: " + ec.message());
  });
  asio::async_read(socket_, asio::buffer(hello_in_), [self](asio::error_code ec, size_t got) {
    // A peer silent from the start: on the accepting side most likely a
    // port check; on the connecting side a peer that went away (a process
    // that died, or a port that another took over) while we connected.
    if (ec && got == 0 && (ec == asio::error::eof || ec == asio::error::connection_reset))
      return self->fail(self->accepting_ ? std::string(kSilentPeer)
                                         : "the peer closed the connection before its handshake (" + ec.message() +
                                               "): it exited, or it is no troupe process");
    if (ec) return self->fail("handshake read failed: " + ec.message());
    if (std::string why = check_magic(self->hello_in_.data()); !why.empty())
      return self->fail("handshake refused: " + why);
    Nonce theirs;
    std::memcpy(theirs.data(), self->hello_in_.data() + 8, kNonceBytes);
    self->proof_out_ = make_proof(self->token_, self->accepting_ ? 'S' : 'C', self->my_nonce_, theirs);
    auto send_proof = [self] {
      asio::async_write(self->socket_, asio::buffer(self->proof_out_), [self](asio::error_code ec, size_t) {
        if (ec) return self->fail("handshake write failed: " + ec.message());
      });
    };
    // The connecting side proves first; the accepting side answers only a
    // correct proof, so a client with a wrong token learns nothing.
    if (!self->accepting_) send_proof();
    asio::async_read(self->socket_, asio::buffer(self->proof_in_),
                     [self, theirs, send_proof](asio::error_code ec, size_t) {
                       if (ec && self->accepting_) return self->fail(kLeftMidHandshake);
                       if (ec)
                         return self->fail(
                             "handshake failed: the peer closed the connection after the first exchange (a wrong "
                             "cluster token, or a head shedding handshakes under a flood of connections)");
                       Proof expect = make_proof(self->token_, self->accepting_ ? 'C' : 'S', theirs, self->my_nonce_);
                       if (!proofs_equal(expect, self->proof_in_))
                         return self->fail("handshake refused: wrong cluster token");
                       if (self->accepting_) send_proof();
                       self->handshake_done();
                     });
  });
}

void Connection::handshake_done() {
  if (closed_) return;
  handshake_timer_.cancel();
  {
    std::lock_guard lock(write_mu_);
    ready_ = true;
    reader_thread_ = std::this_thread::get_id();
    // Frames queued before the handshake finished can go now.
    if (!queue_.empty() && !writing_) {
      writing_ = true;
      asio::post(io_, [self = shared_from_this()] { self->flush(); });
    }
  }
  // Called once, then dropped: what it captured (often this connection
  // itself) must not stay reachable from the connection.
  auto ready = std::move(on_ready_);
  on_ready_ = nullptr;
  if (ready) ready();
  read_more();
}

void Connection::set_low_water(size_t bytes) {
  int want = static_cast<int>(std::max<size_t>(1, bytes));
  if (want == low_water_) return;
  if (::setsockopt(socket_.native_handle(), SOL_SOCKET, SO_RCVLOWAT, &want, sizeof(want)) == 0) low_water_ = want;
}

void Connection::read_more() {
  if (closed_) return;
  set_low_water(1);
  // Compact the unparsed bytes to the front; make room for what is arriving.
  if (rpos_ > 0) {
    std::memmove(rbuf_.data(), rbuf_.data() + rpos_, rend_ - rpos_);
    rend_ -= rpos_;
    rpos_ = 0;
  }
  size_t want = grown_capacity(rbuf_.size(), rend_, head_expected_, read_chunk_);
  if (want != rbuf_.size()) {
    rbuf_.resize(want);
    if (want < rbuf_.capacity()) rbuf_.shrink_to_fit();
  }
  auto self = shared_from_this();
  socket_.async_read_some(
      asio::buffer(rbuf_.data() + rend_, rbuf_.size() - rend_), [self](asio::error_code ec, size_t n) {
        if (ec) {
          self->fail(ec == asio::error::eof ? "peer closed the connection" : "read failed: " + ec.message());
          return;
        }
        // A read that filled the room: this connection carries traffic.
        if (self->rend_ + n == self->rbuf_.size()) self->read_chunk_ = kReadChunk;
        self->on_read(n);
      });
}

void Connection::on_read(size_t n) {
  count_read(n);
  rend_ += n;
  in_read_batch_ = true;
  bool more = false;
  try {
    more = parse_frames();
    in_read_batch_ = false;
    std::lock_guard lock(write_mu_);
    if (!writing_ && ready_ && !closed_) write_direct_locked();
  } catch (const std::exception& e) {
    in_read_batch_ = false;
    // At a bounded rate, as refusals: a peer past the token that opens
    // connection after connection to send a bad frame grew the log 20 MB a
    // minute.
    bad_frame_log().warn("closing connection from {}: bad frame: {}", peer_, e.what());
    fail(std::string("bad frame: ") + e.what());
    return;
  }
  if (closed_) return;
  if (more) {
    // This turn's frame budget is spent: let the other connections of this
    // loop have theirs, then go on with the buffered bytes.
    asio::post(io_, [self = shared_from_this()] { self->on_read(0); });
  } else if (block_ && !block_->complete()) {
    read_attachment_tail();
  } else {
    read_more();
  }
}

// Handles up to max_frames_per_turn frames from the buffer; true when it
// stopped for the budget and more may be parsed at once.
bool Connection::parse_frames() {
  for (uint32_t i = 0; i < opts_.max_frames_per_turn; ++i)
    if (closed_ || !parse_one()) return false;
  return !closed_;
}

// Parses at most one frame (or advances the current one) from the buffer.
// Returns true when it delivered a frame and may be called again.
bool Connection::parse_one() {
  if (pending_sizes_.empty()) {
    if (!parse_head(rbuf_.data() + rpos_, rend_ - rpos_)) return false;
    if (pending_sizes_.empty()) {
      deliver();
      return true;
    }
  }
  return fill_attachments();
}

// Start of a frame: header, sizes and message must be buffered whole. The
// limits are checked as soon as the header, then the sizes, are in; the
// buffer grows only as the bytes arrive (read_more).
bool Connection::parse_head(const std::byte* p, size_t avail) {
  if (avail < kFrameHeaderBytes) return false;
  uint32_t msg_bytes = 0, natt = 0;
  std::string err = check_header(p, opts_.limits, &msg_bytes, &natt);
  if (!err.empty()) throw DecodeError(err);
  size_t sizes_end = kFrameHeaderBytes + 8ull * natt;
  size_t need = sizes_end + msg_bytes;
  head_expected_ = need;
  if (avail < sizes_end) return false;
  std::vector<uint64_t> sizes(natt);
  if (natt) std::memcpy(sizes.data(), p + kFrameHeaderBytes, 8ull * natt);
  err = check_sizes(msg_bytes, sizes, opts_.limits);
  if (!err.empty()) throw DecodeError(err);
  if (avail < need) return false;
  pending_ = decode_message(p + sizes_end, msg_bytes, opts_.limits);
  rpos_ += need;
  head_expected_ = 0;
  pending_sizes_ = std::move(sizes);
  pending_next_ = 0;
  pending_.attachments.reserve(natt);
  return true;
}

// Fills the frame's attachments from buffered bytes; true when the frame was
// delivered, false when the rest must be read (read_attachment_tail).
bool Connection::fill_attachments() {
  while (pending_next_ < pending_sizes_.size()) {
    if (!block_) block_.emplace(pending_sizes_[pending_next_]);
    while (rend_ > rpos_ && !block_->complete()) {
      auto [dst, room] = block_->room(std::max(kReadChunk, rend_ - rpos_));
      size_t n = std::min(room, rend_ - rpos_);
      std::memcpy(dst, rbuf_.data() + rpos_, n);
      block_->commit(n);
      rpos_ += n;
    }
    if (!block_->complete()) return false;
    pending_.attachments.push_back(block_->take());
    block_.reset();
    ++pending_next_;
  }
  deliver();
  return true;
}

// Reads the rest of an attachment straight into its block, which grows with
// what arrives.
void Connection::read_attachment_tail() {
  std::pair<std::byte*, size_t> room;
  try {
    room = block_->room(kReadChunk);
  } catch (const std::exception& e) {
    return fail(std::string("bad frame: ") + e.what());
  }
  set_low_water(std::min(block_->size() - block_->filled(), kLowWater));
  auto self = shared_from_this();
  socket_.async_read_some(asio::buffer(room.first, room.second), [self](asio::error_code ec, size_t n) {
    if (ec) return self->fail("read failed: " + ec.message());
    self->count_read(n);
    self->block_->commit(n);
    if (self->block_->complete()) return self->on_read(0);
    self->read_attachment_tail();
  });
}

void Connection::deliver() {
  pending_sizes_.clear();
  pending_next_ = 0;
  Message m = std::move(pending_);
  pending_ = Message{};
  if (on_frame_) on_frame_(std::move(m));
}

void Connection::send(const Message& m, bool direct) { send(encode_frame(m), direct); }

void Connection::send(OutFrame f, bool direct) {
  if (closed_) return;
  uint64_t bytes = f.total_bytes();
  std::lock_guard lock(write_mu_);
  // fail() closes the socket under write_mu_: checked again here, a direct
  // write never reaches a descriptor that was closed (and perhaps reused).
  if (closed_ || over_write_bound_locked(bytes)) return;
  queued_bytes_ += bytes;
  queue_.push_back(std::move(f));
  if (writing_ || !ready_) return;
  // Replies made while the reader thread works through a batch of frames go
  // out together when the batch ends (on_read), or earlier by send_held().
  if (std::this_thread::get_id() == reader_thread_ && in_read_batch_) return;
  if (direct) {
    write_direct_locked();
  } else {
    writing_ = true;
    asio::post(io_, [self = shared_from_this()] { self->flush(); });
  }
}

void Connection::send_held() {
  std::lock_guard lock(write_mu_);
  if (closed_ || writing_ || !ready_ || queue_.empty()) return;
  write_direct_locked();
}

bool Connection::wait_for_room(uint64_t bytes, std::chrono::steady_clock::time_point deadline, uint64_t bound) {
  if (io_.get_executor().running_in_this_thread()) return true;
  if (bound == 0) bound = opts_.max_queued_bytes;
  std::unique_lock lock(write_mu_);
  return room_cv_.wait_until(lock, deadline, [&] {
    return closed_ || overflowed_ || room_released_ || queued_bytes_ == 0 || queued_bytes_ + bytes <= bound;
  });
}

void Connection::release_room_waiters() {
  {
    std::lock_guard lock(write_mu_);
    room_released_ = true;
  }
  room_cv_.notify_all();
}

// A peer that does not read lets replies pile up here without end; past the
// bound it is dropped (a lone frame always goes, however large).
bool Connection::over_write_bound_locked(uint64_t bytes) {
  if (overflowed_) return true;
  if (queued_bytes_ == 0) {
    if (bytes > opts_.max_queued_bytes) lone_left_ = bytes;
    return false;
  }
  // A lone frame over the bound does not count against the frames behind
  // it: a small one (a stream's open, a credit, an answer) tripped the
  // bound while it was being written, and dropped a peer that was reading
  // it, with the value half sent.
  const uint64_t behind = queued_bytes_ - std::min(queued_bytes_, lone_left_);
  if (behind + bytes <= opts_.max_queued_bytes) return false;
  overflowed_ = true;
  queue_.clear();
  std::string why = "peer does not read: " + std::to_string(queued_bytes_ + bytes) +
                    " bytes queued for it exceed the write bound of " + std::to_string(opts_.max_queued_bytes);
  TROUPE_LOG_WARN("dropping connection {}: {}", peer_, why);
  asio::post(io_, [self = shared_from_this(), why] { self->fail(why); });
  return true;
}

// `n` queued bytes were written: a lone frame's first (it was queued
// first, into an empty queue).
void Connection::written_out_locked(uint64_t n) {
  queued_bytes_ -= std::min(queued_bytes_, n);
  lone_left_ -= std::min(lone_left_, n);
}

// Writes the queue with one non-blocking sendmsg on the calling thread: the
// cheapest path for a lone message (no wake-up of the I/O thread). Whatever
// the socket does not take now is finished by the I/O thread.
void Connection::write_direct_locked() {
  if (queue_.empty()) return;
  std::vector<iovec> iov;
  iov.reserve(queue_.size() * 2);
  for (const auto& f : queue_) {
    iov.push_back({const_cast<std::byte*>(f.head.data()), f.head.size()});
    for (const auto& a : f.attachments)
      if (a.size()) iov.push_back({const_cast<std::byte*>(a.data()), a.size()});
  }
  size_t total = 0;
  for (const auto& v : iov) total += v.iov_len;
  msghdr mh{};
  mh.msg_iov = iov.data();
  mh.msg_iovlen = std::min<size_t>(iov.size(), IOV_MAX);
  ssize_t n = ::sendmsg(socket_.native_handle(), &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
    std::string why = std::string("write failed: ") + std::strerror(errno);
    asio::post(io_, [self = shared_from_this(), why] { self->fail(why); });
    return;
  }
  size_t written = n < 0 ? 0 : static_cast<size_t>(n);
  count_written(written);
  if (written == total) {
    queue_.clear();
    queued_bytes_ = 0;
    lone_left_ = 0;
    room_cv_.notify_all();
    return;
  }
  // The I/O thread writes the rest, starting `written` bytes in.
  written_out_locked(written);
  if (written > 0) room_cv_.notify_all();
  writing_ = true;
  inflight_.swap(queue_);
  queue_.clear();
  inflight_offset_ = written;
  asio::post(io_, [self = shared_from_this()] { self->write_inflight(); });
}

void Connection::flush() {
  {
    std::lock_guard lock(write_mu_);
    inflight_.swap(queue_);
    queue_.clear();
    inflight_offset_ = 0;
    if (inflight_.empty() || closed_) {
      writing_ = false;
      if (finishing_ && !closed_) {
        asio::error_code ec;
        socket_.shutdown(asio::ip::tcp::socket::shutdown_send, ec);
      }
      return;
    }
  }
  write_inflight();
}

void Connection::write_inflight() {
  std::vector<asio::const_buffer> bufs;
  bufs.reserve(inflight_.size() * 2);
  size_t skip = inflight_offset_;
  auto add = [&](const std::byte* p, size_t n) {
    if (n == 0) return;
    if (skip >= n) {
      skip -= n;
      return;
    }
    bufs.emplace_back(p + skip, n - skip);
    skip = 0;
  };
  for (const auto& f : inflight_) {
    add(f.head.data(), f.head.size());
    for (const auto& a : f.attachments) add(a.data(), a.size());
  }
  inflight_left_ = asio::buffer_size(bufs);
  asio::async_write(socket_, bufs, [self = shared_from_this()](asio::error_code ec, size_t n) {
    self->count_written(n);
    self->inflight_.clear();
    self->inflight_offset_ = 0;
    {
      std::lock_guard lock(self->write_mu_);
      self->written_out_locked(self->inflight_left_);
      self->room_cv_.notify_all();
    }
    if (ec) return self->fail("write failed: " + ec.message());
    self->flush();
  });
}

void Connection::finish() {
  std::lock_guard lock(write_mu_);
  finishing_ = true;
  if (!writing_ && queue_.empty())
    asio::post(io_, [self = shared_from_this()] {
      asio::error_code ec;
      self->socket_.shutdown(asio::ip::tcp::socket::shutdown_send, ec);
    });
}

void Connection::close(const std::string& reason) {
  asio::post(io_, [self = shared_from_this(), reason] { self->fail(reason); });
}

void Connection::sever(const std::string& reason) {
  {
    // Under write_mu_: fail() closes the descriptor under it, so it is
    // still this socket's here.
    std::lock_guard lock(write_mu_);
    if (!closed_) ::shutdown(socket_.native_handle(), SHUT_RDWR);
  }
  close(reason);
}

void Connection::fail(const std::string& reason) {
  if (closed_.exchange(true)) return;
  asio::error_code ec;
  handshake_timer_.cancel();
  {
    // Under write_mu_: another thread may be inside write_direct_locked()
    // on this socket's descriptor.
    std::lock_guard lock(write_mu_);
    socket_.shutdown(asio::ip::tcp::socket::shutdown_both, ec);
    socket_.close(ec);
    queue_.clear();
    queued_bytes_ = 0;
    lone_left_ = 0;
    room_cv_.notify_all();
  }
  if (!ready_ && accepting_) {
    // A port check (a load balancer's or a readiness probe's connect and
    // close, every few seconds) is not worth a warning each time.
    // Nor is a peer that exited while it connected (a worker ending as a
    // cluster shrinks); a wrong token is still named when its proof comes.
    if (reason == kSilentPeer || reason == kLeftMidHandshake)
      TROUPE_LOG_DEBUG("connection from {} closed: {}", peer_, reason);
    else
      refusal_log().warn("connection from {} refused: {}", peer_, reason);
  }
  auto cb = std::move(on_close_);
  on_close_ = nullptr;
  if (cb) cb(reason);
  // Drop the handlers (they may own whoever owns this connection) once no
  // handler is running any more.
  asio::post(io_, [self = shared_from_this()] {
    self->on_frame_ = nullptr;
    self->on_ready_ = nullptr;
  });
}

void Connection::connect(asio::io_context& io, const std::string& host, uint16_t port, const std::string& token,
                         FrameLimits limits, FrameHandler on_frame, CloseHandler on_close,
                         std::function<void(std::shared_ptr<Connection>, std::string)> done) {
  connect(io, host, port, token, ConnectionOptions{.limits = limits}, std::move(on_frame), std::move(on_close),
          std::move(done));
}

void Connection::connect(asio::io_context& io, const std::string& host, uint16_t port, const std::string& token,
                         ConnectionOptions options, FrameHandler on_frame, CloseHandler on_close,
                         std::function<void(std::shared_ptr<Connection>, std::string)> done) {
  auto socket = std::make_shared<asio::ip::tcp::socket>(io);
  asio::ip::address addr;
  try {
    addr = resolve_host(host);
  } catch (const std::exception& e) {
    asio::post(io, [done, why = std::string(e.what())] { done(nullptr, why); });
    return;
  }
  asio::ip::tcp::endpoint ep(addr, port);
  asio::error_code ec;
  socket->open(ep.protocol(), ec);
  if (!ec) {
    set_cloexec(socket->native_handle());
    set_user_timeout(socket->native_handle(), options.send_timeout);
  }
  socket->async_connect(ep, [&io, socket, token, options, on_frame, on_close, done, host, port](asio::error_code ec) {
    if (ec) return done(nullptr, "connect to " + host + ":" + std::to_string(port) + " failed: " + ec.message());
    auto conn = std::make_shared<Connection>(std::move(*socket), token, false, options);
    auto done_once = std::make_shared<std::function<void(std::shared_ptr<Connection>, std::string)>>(done);
    std::weak_ptr<Connection> weak = conn;
    conn->start(
        [weak, done_once] {
          auto d = std::move(*done_once);
          *done_once = nullptr;
          if (auto c = weak.lock(); c && d) d(std::move(c), "");
        },
        on_frame,
        [done_once, on_close](const std::string& reason) {
          if (*done_once) {
            auto d = std::move(*done_once);
            *done_once = nullptr;
            d(nullptr, reason);
          } else if (on_close) {
            on_close(reason);
          }
        });
  });
}

Listener::Listener(asio::io_context& io, const std::string& host, uint16_t port, std::string token,
                   ListenerOptions options, AcceptHandler on_accept)
    : acceptor_(io),
      backoff_timer_(io),
      host_(host),
      token_(std::move(token)),
      opts_(options),
      on_accept_(std::move(on_accept)) {
  asio::ip::tcp::endpoint ep(resolve_host(host), port);
  acceptor_.open(ep.protocol());
  set_cloexec(acceptor_.native_handle());
  acceptor_.set_option(asio::socket_base::reuse_address(true));
  // The error names the address: "bind 127.0.0.1:6380: Address already in use".
  asio::error_code ec;
  acceptor_.bind(ep, ec);
  if (ec) throw std::system_error(ec, "bind " + format_address(host, port));
  acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) throw std::system_error(ec, "listen on " + format_address(host, port));
  port_ = acceptor_.local_endpoint().port();
  accept_next();
}

void Listener::accept_next() {
  acceptor_.async_accept([this](asio::error_code ec, asio::ip::tcp::socket s) {
    if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
    if (is_resource_exhaustion(ec)) return back_off(ec);
    if (ec) {
      refusal_log().warn("accept on {}:{} failed: {}", host_, port_, ec.message());
    } else {
      backoff_ = std::chrono::milliseconds(0);
      set_cloexec(s.native_handle());
      admit(std::move(s));
    }
    accept_next();
  });
}

// Counts the new connection against the pending handshakes (dropping the
// oldest when full) and hands it over.
void Listener::admit(asio::ip::tcp::socket s) {
  std::erase_if(pending_, [](const std::weak_ptr<Connection>& w) {
    auto c = w.lock();
    return !c || !c->handshake_pending();
  });
  while (pending_.size() >= std::max<size_t>(opts_.max_pending_handshakes, 1))
    drop_oldest_pending("too many pending handshakes (limit " + std::to_string(opts_.max_pending_handshakes) + ")");
  auto conn = std::make_shared<Connection>(std::move(s), token_, true, opts_.connection);
  pending_.push_back(conn);
  on_accept_(std::move(conn));
}

void Listener::drop_oldest_pending(const std::string& reason) {
  if (pending_.empty()) return;
  if (auto c = pending_.front().lock(); c && c->handshake_pending()) c->close(reason);
  pending_.pop_front();
}

// Out of descriptors: retrying at once would spin on the same error. Pause
// (doubling up to max_accept_backoff) and give up the oldest pending
// handshake, so the descriptor goes to a peer that may finish one.
void Listener::back_off(const asio::error_code& ec) {
  backoff_ = std::min(std::max(backoff_ * 2, std::chrono::milliseconds(10)), opts_.max_accept_backoff);
  refusal_log().warn("accept on {}:{} failed: {}; pausing accepts for {} ms", host_, port_, ec.message(),
                     backoff_.count());
  drop_oldest_pending("out of file descriptors");
  backoff_timer_.expires_after(backoff_);
  backoff_timer_.async_wait([this](asio::error_code ec) {
    if (ec || !acceptor_.is_open()) return;
    accept_next();
  });
}

void Listener::close() {
  asio::error_code ec;
  acceptor_.close(ec);
  backoff_timer_.cancel();
}

}  // namespace troupe::wire
