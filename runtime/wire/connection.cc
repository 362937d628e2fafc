#include "troupe/runtime/wire/connection.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>
#include <climits>
#include <cstring>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/logging.h"

namespace troupe::wire {

namespace {
constexpr size_t kReadChunk = 256 * 1024;

// asio opens sockets without SOCK_CLOEXEC; a socket must never outlive an
// exec (spawn_process also closes stray descriptors in the child).
void set_cloexec(int fd) { ::fcntl(fd, F_SETFD, ::fcntl(fd, F_GETFD) | FD_CLOEXEC); }

std::string endpoint_text(const asio::ip::tcp::socket& s) {
  asio::error_code ec;
  auto ep = s.remote_endpoint(ec);
  if (ec) return "?";
  return ep.address().to_string() + ":" + std::to_string(ep.port());
}
}  // namespace

Connection::Connection(asio::ip::tcp::socket socket, std::string token, bool accepting, FrameLimits limits)
    : io_(static_cast<asio::io_context&>(socket.get_executor().context())),
      socket_(std::move(socket)),
      token_(std::move(token)),
      accepting_(accepting),
      limits_(limits) {
  peer_ = endpoint_text(socket_);
  asio::error_code ec;
  socket_.set_option(asio::ip::tcp::no_delay(true), ec);
  rbuf_.resize(kReadChunk);
}

Connection::~Connection() = default;

void Connection::start(ReadyHandler on_ready, FrameHandler on_frame, CloseHandler on_close) {
  on_ready_ = std::move(on_ready);
  on_frame_ = std::move(on_frame);
  on_close_ = std::move(on_close);
  do_handshake();
}

void Connection::do_handshake() {
  my_nonce_ = random_nonce();
  std::memcpy(hello_out_.data(), kAuthMagic, 8);
  std::memcpy(hello_out_.data() + 8, my_nonce_.data(), kNonceBytes);
  auto self = shared_from_this();
  asio::async_write(socket_, asio::buffer(hello_out_), [self](asio::error_code ec, size_t) {
    if (ec) return self->fail("handshake write failed: " + ec.message());
  });
  asio::async_read(socket_, asio::buffer(hello_in_), [self](asio::error_code ec, size_t) {
    if (ec) return self->fail("handshake read failed: " + ec.message());
    if (std::memcmp(self->hello_in_.data(), kAuthMagic, 8) != 0)
      return self->fail("handshake refused: peer did not speak the troupe protocol");
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
                       if (ec) return self->fail("handshake failed: peer closed the connection (wrong cluster token?)");
                       Proof expect = make_proof(self->token_, self->accepting_ ? 'C' : 'S', theirs, self->my_nonce_);
                       if (!proofs_equal(expect, self->proof_in_))
                         return self->fail("handshake refused: wrong cluster token");
                       if (self->accepting_) send_proof();
                       {
                         std::lock_guard lock(self->write_mu_);
                         self->ready_ = true;
                         self->reader_thread_ = std::this_thread::get_id();
                         // Frames queued before the handshake finished can go now.
                         if (!self->queue_.empty() && !self->writing_) {
                           self->writing_ = true;
                           asio::post(self->io_, [self] { self->flush(); });
                         }
                       }
                       if (self->on_ready_) self->on_ready_();
                       self->read_more();
                     });
  });
}

void Connection::read_more() {
  if (closed_) return;
  // Compact the unparsed bytes to the front, grow if a frame needs more.
  if (rpos_ > 0) {
    std::memmove(rbuf_.data(), rbuf_.data() + rpos_, rend_ - rpos_);
    rend_ -= rpos_;
    rpos_ = 0;
  }
  if (rbuf_.size() - rend_ < kReadChunk / 4) rbuf_.resize(std::max(rbuf_.size() * 2, rend_ + kReadChunk));
  auto self = shared_from_this();
  socket_.async_read_some(
      asio::buffer(rbuf_.data() + rend_, rbuf_.size() - rend_), [self](asio::error_code ec, size_t n) {
        if (ec) {
          self->fail(ec == asio::error::eof ? "peer closed the connection" : "read failed: " + ec.message());
          return;
        }
        self->on_read(n);
      });
}

void Connection::on_read(size_t n) {
  rend_ += n;
  in_read_batch_ = true;
  try {
    while (!closed_ && parse_one()) {
    }
    in_read_batch_ = false;
    std::lock_guard lock(write_mu_);
    if (!writing_ && ready_ && !closed_) write_direct_locked();
  } catch (const std::exception& e) {
    in_read_batch_ = false;
    TROUPE_LOG_WARN("closing connection from {}: bad frame: {}", peer_, e.what());
    fail(std::string("bad frame: ") + e.what());
    return;
  }
  if (closed_) return;
  if (tail_left_ > 0) {
    read_attachment_tail();
  } else {
    read_more();
  }
}

// Parses at most one frame (or advances the current one) from the buffer.
// Returns true when it made progress and may be called again.
bool Connection::parse_one() {
  size_t avail = rend_ - rpos_;
  const std::byte* p = rbuf_.data() + rpos_;
  if (pending_sizes_.empty() && pending_next_ == 0 && !tail_dst_) {
    // Start of a frame: header, sizes and message must be buffered whole.
    if (avail < kFrameHeaderBytes) return false;
    uint32_t msg_bytes = 0, natt = 0;
    std::string err = check_header(p, limits_, &msg_bytes, &natt);
    if (!err.empty()) throw DecodeError(err);
    size_t sizes_end = kFrameHeaderBytes + 8ull * natt;
    size_t need = sizes_end + msg_bytes;
    if (rbuf_.size() < need) rbuf_.resize(need + kReadChunk);
    if (avail < sizes_end) return false;
    // Refuse an oversized frame as soon as its sizes are known.
    std::vector<uint64_t> sizes(natt);
    if (natt) std::memcpy(sizes.data(), p + kFrameHeaderBytes, 8ull * natt);
    err = check_sizes(msg_bytes, sizes, limits_);
    if (!err.empty()) throw DecodeError(err);
    if (avail < need) return false;
    pending_ = decode_message(p + kFrameHeaderBytes + 8ull * natt, msg_bytes, limits_);
    rpos_ += need;
    if (natt == 0) {
      deliver();
      return true;
    }
    pending_sizes_ = std::move(sizes);
    pending_next_ = 0;
    pending_.attachments.reserve(natt);
    return true;
  }
  // Filling attachments from buffered bytes.
  while (pending_next_ < pending_sizes_.size()) {
    uint64_t size = pending_sizes_[pending_next_];
    std::byte* dst = nullptr;
    Buffer b = Buffer::allocate(size, &dst);
    size_t have = std::min<uint64_t>(size, rend_ - rpos_);
    if (have) std::memcpy(dst, rbuf_.data() + rpos_, have);
    rpos_ += have;
    pending_.attachments.push_back(std::move(b));
    ++pending_next_;
    if (have < size) {
      // Read the rest straight into the attachment.
      tail_dst_ = dst + have;
      tail_left_ = size - have;
      return false;
    }
  }
  deliver();
  return true;
}

void Connection::read_attachment_tail() {
  auto self = shared_from_this();
  asio::async_read(socket_, asio::buffer(tail_dst_, tail_left_), [self](asio::error_code ec, size_t) {
    if (ec) return self->fail("read failed: " + ec.message());
    self->tail_dst_ = nullptr;
    self->tail_left_ = 0;
    if (self->pending_next_ == self->pending_sizes_.size()) {
      self->deliver();
    }
    self->on_read(0);
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
  std::lock_guard lock(write_mu_);
  queue_.push_back(std::move(f));
  if (writing_ || !ready_) return;
  // Replies made while the reader thread works through a batch of frames go
  // out together when the batch ends (on_read).
  if (std::this_thread::get_id() == reader_thread_ && in_read_batch_) return;
  if (direct) {
    write_direct_locked();
  } else {
    writing_ = true;
    asio::post(io_, [self = shared_from_this()] { self->flush(); });
  }
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
  if (written == total) {
    queue_.clear();
    return;
  }
  // The I/O thread writes the rest, starting `written` bytes in.
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
  asio::async_write(socket_, bufs, [self = shared_from_this()](asio::error_code ec, size_t) {
    self->inflight_.clear();
    self->inflight_offset_ = 0;
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

void Connection::fail(const std::string& reason) {
  if (closed_.exchange(true)) return;
  asio::error_code ec;
  socket_.shutdown(asio::ip::tcp::socket::shutdown_both, ec);
  socket_.close(ec);
  {
    std::lock_guard lock(write_mu_);
    queue_.clear();
  }
  if (!ready_ && accepting_) TROUPE_LOG_WARN("connection from {} refused: {}", peer_, reason);
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
  if (!ec) set_cloexec(socket->native_handle());
  socket->async_connect(ep, [&io, socket, token, limits, on_frame, on_close, done, host, port](asio::error_code ec) {
    if (ec) return done(nullptr, "connect to " + host + ":" + std::to_string(port) + " failed: " + ec.message());
    auto conn = std::make_shared<Connection>(std::move(*socket), token, false, limits);
    auto done_once = std::make_shared<std::function<void(std::shared_ptr<Connection>, std::string)>>(done);
    conn->start(
        [conn, done_once] {
          auto d = std::move(*done_once);
          *done_once = nullptr;
          if (d) d(conn, "");
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

Listener::Listener(asio::io_context& io, const std::string& host, uint16_t port, AcceptHandler on_accept)
    : acceptor_(io), host_(host), on_accept_(std::move(on_accept)) {
  asio::ip::tcp::endpoint ep(resolve_host(host), port);
  acceptor_.open(ep.protocol());
  set_cloexec(acceptor_.native_handle());
  acceptor_.set_option(asio::socket_base::reuse_address(true));
  acceptor_.bind(ep);
  acceptor_.listen(asio::socket_base::max_listen_connections);
  port_ = acceptor_.local_endpoint().port();
  accept_next();
}

void Listener::accept_next() {
  acceptor_.async_accept([this](asio::error_code ec, asio::ip::tcp::socket s) {
    if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
    if (!ec) {
      set_cloexec(s.native_handle());
      on_accept_(std::move(s));
    }
    accept_next();
  });
}

void Listener::close() {
  asio::error_code ec;
  acceptor_.close(ec);
}

}  // namespace troupe::wire
