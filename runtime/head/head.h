// The head: the cluster directory. It knows the nodes and their resources,
// every actor (spec, state, address, restarts), placement groups, named
// actors and a small KV store; it places actors on nodes, restarts them when
// their worker dies, and declares a node dead when its heartbeats stop.
// All its state belongs to one event-loop thread.
#pragma once

#include <asio.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "troupe/runtime/wire/connection.h"

namespace troupe::head {

struct HeadOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;  // 0 = any free port
  std::string token;
  uint32_t heartbeat_ms = 100;    // nodes heartbeat this often
  uint32_t heartbeat_misses = 5;  // silent for this many intervals = dead
  // What a connection may cost the head: small frames, a modest write bound
  // (its replies are small too) and the default handshake rules.
  wire::ListenerOptions listener{.connection = {.limits = wire::kHeadFrameLimits, .max_queued_bytes = 64ull << 20}};
};

class Head {
 public:
  explicit Head(HeadOptions options);
  ~Head();
  Head(const Head&) = delete;
  Head& operator=(const Head&) = delete;

  // "host:port" the head listens on.
  std::string address() const;
  // Runs the event loop on a background thread.
  void start();
  // Runs the event loop on this thread until stop() or a Shutdown request.
  void run();
  void stop();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
  std::thread thread_;
};

}  // namespace troupe::head
