#include <asio.hpp>

#include <chrono>
#include <cstdlib>
#include <future>
#include <thread>

#include "tests/fuzz/targets.h"
#include "tests/support/raw_client.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/wire/connection.h"
#include "troupe/runtime/wire/protocol.h"

namespace troupe::fuzz {

namespace {

constexpr const char* kToken = "fuzz-token";

// An accepting side as the head has one: a loopback listener on its own
// I/O thread, the head's limits, and frames decoded as the head would.
class Server {
 public:
  Server() : acceptor_(io_, {asio::ip::make_address("127.0.0.1"), 0}) {
    thread_ = std::thread([this] {
      auto guard = asio::make_work_guard(io_);
      io_.run();
    });
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(acceptor_.local_endpoint().port()); }

  // Accepts the next connection and runs it; the future is ready when it
  // has closed.
  std::future<void> accept_one() {
    auto closed = std::make_shared<std::promise<void>>();
    auto result = closed->get_future();
    acceptor_.async_accept([this, closed](asio::error_code ec, asio::ip::tcp::socket socket) {
      if (ec) return closed->set_value();
      wire::ConnectionOptions options{.limits = wire::kHeadFrameLimits};
      current_ = std::make_shared<wire::Connection>(std::move(socket), kToken, true, options);
      current_->start([] {}, [](wire::Message&& m) { decode_body(m); },
                      [closed](const std::string&) { closed->set_value(); });
    });
    return result;
  }

 private:
  static void decode_body(const wire::Message& m) {
    try {
      if (m.op == static_cast<uint32_t>(wire::Op::kHello))
        (void)wire::decode_value<wire::Hello>(m.body.data(), m.body.size(), &m.attachments);
      else
        (void)wire::decode_value<wire::ActorSpec>(m.body.data(), m.body.size(), &m.attachments);
    } catch (const troupe::Error&) {
    }
  }

  asio::io_context io_;
  asio::ip::tcp::acceptor acceptor_;
  std::thread thread_;
  std::shared_ptr<wire::Connection> current_;  // io thread only
};

}  // namespace

int connection_target(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static Server* server = new Server();  // lives for the process: its thread never stops
  auto closed = server->accept_one();
  try {
    test::RawClient client(server->address());
    if (!(data[0] & 1) || client.handshake(kToken)) client.write(data + 1, size - 1);
    client.shutdown();
  } catch (const asio::system_error&) {
    // The server closed first (a bad frame): what it does then is the test.
  }
  // A connection that neither finishes nor closes at the end of its input
  // hangs its peer: a bug.
  if (closed.wait_for(std::chrono::seconds(20)) != std::future_status::ready) std::abort();
  return 0;
}

}  // namespace troupe::fuzz
