// RawClient: a blocking TCP client for tests that speaks troupe's
// handshake by hand and then sends arbitrary bytes (bad frames, floods,
// half-written messages) to a head, node agent or worker.
#pragma once

#include <asio.hpp>

#include <chrono>
#include <cstring>
#include <functional>
#include <thread>

#include "tests/support/wait.h"
#include "troupe/runtime/wire/auth.h"
#include "troupe/runtime/wire/connection.h"

namespace troupe::test {

// A blocking TCP client that authenticates with `token` (true when the peer
// accepted) and then writes raw bytes.
class RawClient {
 public:
  explicit RawClient(const std::string& address) : socket_(io_) {
    auto [host, port] = wire::parse_address(address);
    socket_.connect({asio::ip::make_address(host), port});
  }
  bool handshake(const std::string& token) {
    wire::Nonce mine = wire::random_nonce();
    std::array<uint8_t, 40> hello{};
    std::memcpy(hello.data(), wire::kAuthMagic, 8);
    std::memcpy(hello.data() + 8, mine.data(), 32);
    asio::write(socket_, asio::buffer(hello));
    std::array<uint8_t, 40> theirs_msg{};
    asio::read(socket_, asio::buffer(theirs_msg));
    wire::Nonce theirs;
    std::memcpy(theirs.data(), theirs_msg.data() + 8, 32);
    wire::Proof p = wire::make_proof(token, 'C', mine, theirs);
    asio::write(socket_, asio::buffer(p));
    wire::Proof in;
    asio::error_code ec;
    asio::read(socket_, asio::buffer(in), ec);
    return !ec;
  }
  void write(const void* p, size_t n) { asio::write(socket_, asio::buffer(p, n)); }
  // Blocking read of what is there; 0 at end of stream or on error.
  size_t read_some(void* p, size_t n) {
    asio::error_code ec;
    size_t got = socket_.read_some(asio::buffer(p, n), ec);
    return ec ? 0 : got;
  }
  // Ends both directions (wakes a thread blocked in read_some).
  void shutdown() {
    asio::error_code ec;
    socket_.shutdown(asio::ip::tcp::socket::shutdown_both, ec);
  }
  // True when the peer closes the connection within `timeout`.
  bool closed_by_peer(std::chrono::milliseconds timeout = kWaitBound) {
    socket_.non_blocking(true);
    auto deadline = std::chrono::steady_clock::now() + timeout;
    char buf[256];
    while (std::chrono::steady_clock::now() < deadline) {
      asio::error_code ec;
      size_t n = socket_.read_some(asio::buffer(buf), ec);
      if (ec == asio::error::would_block) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        continue;
      }
      if (ec) return true;  // eof or reset
      (void)n;
    }
    return false;
  }

 private:
  asio::io_context io_;
  asio::ip::tcp::socket socket_;
};

}  // namespace troupe::test
