// Connection: one authenticated TCP connection carrying frames, owned by an
// asio io_context (one thread). send() may be called from any thread: frames
// queue up and go out together in one scatter/gather write, which is what
// makes pipelined calls cheap. A bad frame, a failed handshake or a peer that
// goes away closes this connection with a logged reason and nothing else.
//
// What a connection may cost its process is bounded (ConnectionOptions):
// before the handshake it holds no read buffer and has a deadline; after it,
// buffers grow only with the bytes that arrive, a read turn handles a
// bounded number of frames before other connections get theirs, and a peer
// that does not read its replies is dropped once they exceed a bytes bound.
// A Listener adds the accept side: a cap on pending handshakes (the oldest
// is dropped) and a back-off when the process runs out of descriptors.
#pragma once

#include <asio.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "troupe/runtime/wire/address.h"
#include "troupe/runtime/wire/auth.h"
#include "troupe/runtime/wire/frame.h"
#include "troupe/runtime/wire/incoming.h"

namespace troupe::wire {

// Bytes a set of connections read and wrote (frames, handshakes excluded):
// a client core shares one among the connections it makes and accepts, so a
// test can tell which process carried a value.
struct ByteCounters {
  std::atomic<uint64_t> read{0};
  std::atomic<uint64_t> written{0};
};

// What one connection may cost the process that holds it.
struct ConnectionOptions {
  FrameLimits limits;
  // An accepted connection that has not proven the token by then is closed.
  std::chrono::milliseconds handshake_timeout{5000};
  // Bytes queued for a peer (beyond a lone frame, which always goes) after
  // which the peer counts as not reading and is dropped.
  uint64_t max_queued_bytes = 256ull << 20;
  // Frames handled per read turn before the loop serves other connections.
  uint32_t max_frames_per_turn = 64;
  // Bytes written that the peer has not acknowledged, or not taken (its
  // window stays shut: it stopped reading), for this long end the
  // connection (TCP_USER_TIMEOUT). 0: the kernel's default, about 15
  // minutes of retransmissions, and never for a shut window.
  std::chrono::milliseconds send_timeout{0};
  // Where this connection adds the bytes it reads and writes (none: nowhere).
  std::shared_ptr<ByteCounters> counters;
};

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  using FrameHandler = std::function<void(Message&&)>;
  using CloseHandler = std::function<void(const std::string& reason)>;
  using ReadyHandler = std::function<void()>;

  Connection(asio::ip::tcp::socket socket, std::string token, bool accepting, ConnectionOptions options = {});
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
  // Frames the reader thread sends amid a batch of frames read together
  // (replies) go out together when the batch is done.
  void send(const Message& m, bool direct = false);
  void send(OutFrame f, bool direct = false);
  // Thread-safe: writes now what the reader thread's batch holds back (its
  // replies so far), on the calling thread, unless a write is under way.
  void send_held();
  // Blocks until `bytes` more fit under the write bound (max_queued_bytes)
  // or nothing is queued, or the connection closed; false when `deadline`
  // passed first. For flow-controlled senders (streams), whose own credits
  // may allow more bytes in flight than the bound: they wait here for the
  // peer to take them instead of tripping the bound, which is for peers
  // that stop reading. Returns at once on the I/O thread (which drains the
  // queue and must not wait for itself). `bound`, when not 0, stands for
  // the write bound (a sender whose connection has none keeps its own).
  bool wait_for_room(uint64_t bytes, std::chrono::steady_clock::time_point deadline, uint64_t bound = 0);
  // Wakes every thread in wait_for_room, and lets any later one return at
  // once (as if there were room): for a shutdown that stopped the I/O
  // thread, which alone would have drained the queue. The senders check
  // their own state (failed by the shutdown) before sending.
  void release_room_waiters();
  // Thread-safe; the close handler runs with `reason`.
  void close(const std::string& reason);
  // As close, but the socket is shut both ways now, on the calling thread,
  // not when the I/O thread comes to it: a peer sees the end at once even
  // while that thread is busy (it runs an inline actor's call).
  void sever(const std::string& reason);
  // Thread-safe: once everything queued is written, sends FIN but keeps
  // reading until the peer closes too. Closing hard with unread bytes in
  // the receive buffer would make the kernel reset the connection and could
  // drop frames the peer has not read yet.
  void finish();

  bool is_open() const { return !closed_.load(); }
  // True until the handshake succeeds or the connection closes (io thread).
  bool handshake_pending() const { return !ready_ && !closed_.load(); }
  const std::string& peer() const { return peer_; }
  asio::io_context& io() { return io_; }

  // Connects to host:port and runs the handshake; `done` gets the ready
  // connection or an error text. Callbacks run on io's thread.
  static void connect(asio::io_context& io, const std::string& host, uint16_t port, const std::string& token,
                      FrameLimits limits, FrameHandler on_frame, CloseHandler on_close,
                      std::function<void(std::shared_ptr<Connection>, std::string error)> done);
  // The same with all of the connection's options (limits, byte counters).
  static void connect(asio::io_context& io, const std::string& host, uint16_t port, const std::string& token,
                      ConnectionOptions options, FrameHandler on_frame, CloseHandler on_close,
                      std::function<void(std::shared_ptr<Connection>, std::string error)> done);

 private:
  void do_handshake();
  void arm_handshake_deadline();
  void handshake_done();
  void read_more();
  void set_low_water(size_t bytes);
  void on_read(size_t n);
  bool parse_frames();
  bool parse_one();
  bool parse_head(const std::byte* p, size_t avail);
  bool fill_attachments();
  void read_attachment_tail();
  void deliver();
  void flush();
  void write_direct_locked();
  void write_inflight();
  bool over_write_bound_locked(uint64_t bytes);
  void written_out_locked(uint64_t n);
  void fail(const std::string& reason);
  void count_read(size_t n) {
    if (opts_.counters) opts_.counters->read.fetch_add(n, std::memory_order_relaxed);
  }
  void count_written(size_t n) {
    if (opts_.counters) opts_.counters->written.fetch_add(n, std::memory_order_relaxed);
  }

  asio::io_context& io_;
  asio::ip::tcp::socket socket_;
  std::string token_;
  bool accepting_;
  ConnectionOptions opts_;
  std::string peer_;
  asio::steady_timer handshake_timer_;

  ReadyHandler on_ready_;
  FrameHandler on_frame_;
  CloseHandler on_close_;

  // Handshake scratch.
  Nonce my_nonce_{};
  std::array<uint8_t, 8 + kNonceBytes> hello_in_{};
  std::array<uint8_t, 8 + kNonceBytes> hello_out_{};
  Proof proof_out_{};
  Proof proof_in_{};

  // Read state (io thread only). Bytes [rpos_, rend_) of rbuf_ are unparsed;
  // rbuf_ stays empty until the handshake succeeds.
  std::vector<std::byte> rbuf_;
  size_t rpos_ = 0, rend_ = 0;
  size_t head_expected_ = 0;  // bytes the frame at rpos_ needs buffered (0: unknown)
  // Room each read keeps: small until a read fills it (an idle connection
  // holds 4 KiB, not 64; read_more), then kReadChunk.
  size_t read_chunk_ = 4096;
  Message pending_;                      // frame being assembled
  std::vector<uint64_t> pending_sizes_;  // its attachment sizes
  size_t pending_next_ = 0;              // next attachment to fill
  std::optional<IncomingBlock> block_;   // attachment being received
  int low_water_ = 1;                    // the socket's SO_RCVLOWAT
  bool ready_ = false;

  // Write state.
  std::mutex write_mu_;
  std::vector<OutFrame> queue_;     // guarded by write_mu_
  std::vector<OutFrame> inflight_;  // being written by the io thread
  size_t inflight_offset_ = 0;      // bytes of inflight_ already written
  uint64_t inflight_left_ = 0;      // bytes of inflight_ not yet written
  uint64_t queued_bytes_ = 0;       // queue_ + inflight_ not yet written, guarded by write_mu_
  // Of queued_bytes_, what is left of a frame over the write bound that was
  // queued alone (and so went): the bound counts the frames behind it
  // without it. Guarded by write_mu_.
  uint64_t lone_left_ = 0;
  std::condition_variable room_cv_;  // with write_mu_: queued_bytes_ went down, or the connection closed
  bool overflowed_ = false;          // guarded by write_mu_
  bool room_released_ = false;       // guarded by write_mu_ (release_room_waiters)
  std::atomic<bool> in_read_batch_{false};
  std::thread::id reader_thread_;
  bool writing_ = false;    // guarded by write_mu_
  bool finishing_ = false;  // guarded by write_mu_

  std::atomic<bool> closed_{false};
};

// What a listener admits: each connection's options, how many connections
// may be in their handshake at once (a new one drops the oldest), and the
// longest pause of accepting when the process is out of descriptors.
struct ListenerOptions {
  ConnectionOptions connection;
  size_t max_pending_handshakes = 128;
  std::chrono::milliseconds max_accept_backoff{1000};
};

// Accepts connections on host:port and hands each over as a Connection made
// with the listener's options and token, not yet started: the handler calls
// start(). Connections still in their handshake are counted against
// max_pending_handshakes; fd exhaustion pauses accepting (doubling up to
// max_accept_backoff) instead of retrying at once. Refusals are logged at a
// bounded rate.
class Listener {
 public:
  using AcceptHandler = std::function<void(std::shared_ptr<Connection>)>;
  Listener(asio::io_context& io, const std::string& host, uint16_t port, std::string token, ListenerOptions options,
           AcceptHandler on_accept);
  uint16_t port() const { return port_; }
  const std::string& host() const { return host_; }
  void close();

 private:
  void accept_next();
  void admit(asio::ip::tcp::socket s);
  void back_off(const asio::error_code& ec);
  void drop_oldest_pending(const std::string& reason);
  asio::ip::tcp::acceptor acceptor_;
  asio::steady_timer backoff_timer_;
  std::string host_;
  uint16_t port_;
  std::string token_;
  ListenerOptions opts_;
  AcceptHandler on_accept_;
  std::deque<std::weak_ptr<Connection>> pending_;  // oldest first
  std::chrono::milliseconds backoff_{0};
};

}  // namespace troupe::wire
