// Connection: one authenticated TCP connection carrying frames, owned by an
// asio io_context (one thread). send() may be called from any thread: frames
// queue up and go out together in one scatter/gather write, which is what
// makes pipelined calls cheap. A bad frame, a failed handshake or a peer that
// goes away closes this connection with a logged reason and nothing else.
#pragma once

#include <asio.hpp>

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "troupe/runtime/wire/address.h"
#include "troupe/runtime/wire/auth.h"
#include "troupe/runtime/wire/frame.h"

namespace troupe::wire {

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  using FrameHandler = std::function<void(Message&&)>;
  using CloseHandler = std::function<void(const std::string& reason)>;
  using ReadyHandler = std::function<void()>;

  Connection(asio::ip::tcp::socket socket, std::string token, bool accepting, FrameLimits limits = {});
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Runs the handshake, then delivers frames to on_frame on the io thread.
  // on_close runs once, on the io thread, whatever ends the connection
  // (including a failed handshake before on_ready).
  void start(ReadyHandler on_ready, FrameHandler on_frame, CloseHandler on_close);

  // Thread-safe. Frames sent after close are dropped. `direct` writes at
  // once on the calling thread when nothing else is queued (lowest latency);
  // otherwise the I/O thread writes, batching whatever queued up meanwhile.
  void send(const Message& m, bool direct = false);
  void send(OutFrame f, bool direct = false);
  // Thread-safe; the close handler runs with `reason`.
  void close(const std::string& reason);
  // Thread-safe: once everything queued is written, sends FIN but keeps
  // reading until the peer closes too. Closing hard with unread bytes in
  // the receive buffer would make the kernel reset the connection and could
  // drop frames the peer has not read yet.
  void finish();

  bool is_open() const { return !closed_.load(); }
  const std::string& peer() const { return peer_; }
  asio::io_context& io() { return io_; }

  // Connects to host:port and runs the handshake; `done` gets the ready
  // connection or an error text. Callbacks run on io's thread.
  static void connect(asio::io_context& io, const std::string& host, uint16_t port, const std::string& token,
                      FrameLimits limits, FrameHandler on_frame, CloseHandler on_close,
                      std::function<void(std::shared_ptr<Connection>, std::string error)> done);

 private:
  void do_handshake();
  void read_more();
  void on_read(size_t n);
  bool parse_one();
  void read_attachment_tail();
  void deliver();
  void flush();
  void write_direct_locked();
  void write_inflight();
  void fail(const std::string& reason);

  asio::io_context& io_;
  asio::ip::tcp::socket socket_;
  std::string token_;
  bool accepting_;
  FrameLimits limits_;
  std::string peer_;

  ReadyHandler on_ready_;
  FrameHandler on_frame_;
  CloseHandler on_close_;

  // Handshake scratch.
  Nonce my_nonce_{};
  std::array<uint8_t, 8 + kNonceBytes> hello_in_{};
  std::array<uint8_t, 8 + kNonceBytes> hello_out_{};
  Proof proof_out_{};
  Proof proof_in_{};

  // Read state (io thread only). Bytes [rpos_, rend_) of rbuf_ are unparsed.
  std::vector<std::byte> rbuf_;
  size_t rpos_ = 0, rend_ = 0;
  Message pending_;                      // frame being assembled
  std::vector<uint64_t> pending_sizes_;  // its attachment sizes
  size_t pending_next_ = 0;              // next attachment to fill
  std::byte* tail_dst_ = nullptr;        // attachment being read directly
  size_t tail_left_ = 0;
  bool ready_ = false;

  // Write state.
  std::mutex write_mu_;
  std::vector<OutFrame> queue_;     // guarded by write_mu_
  std::vector<OutFrame> inflight_;  // being written by the io thread
  size_t inflight_offset_ = 0;      // bytes of inflight_ already written
  std::atomic<bool> in_read_batch_{false};
  std::thread::id reader_thread_;
  bool writing_ = false;    // guarded by write_mu_
  bool finishing_ = false;  // guarded by write_mu_

  std::atomic<bool> closed_{false};
};

// Accepts connections on host:port and hands over each one that passes the
// handshake (failures are logged and closed).
class Listener {
 public:
  using AcceptHandler = std::function<void(asio::ip::tcp::socket)>;
  Listener(asio::io_context& io, const std::string& host, uint16_t port, AcceptHandler on_accept);
  uint16_t port() const { return port_; }
  const std::string& host() const { return host_; }
  void close();

 private:
  void accept_next();
  asio::ip::tcp::acceptor acceptor_;
  std::string host_;
  uint16_t port_;
  AcceptHandler on_accept_;
};

}  // namespace troupe::wire
