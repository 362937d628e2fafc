// The head: the cluster directory's server. Its tables and decisions (nodes
// and their resources, actors, placement groups, named actors, the KV store)
// are a HeadState; Head owns the listener, the connections and the timers,
// turns each message into a HeadState call and sends what the state says to
// send. All of it belongs to one event-loop thread.
#pragma once

#include <asio.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "troupe/runtime/core/heartbeat.h"
#include "troupe/runtime/wire/connection.h"

namespace troupe::head {

struct HeadOptions {
  std::string host = "127.0.0.1";  // address to listen on (0.0.0.0, :: = every interface)
  // The address address() reports ("" = host, or for a wildcard host the
  // first non-loopback interface's, else 127.0.0.1). Never the wildcard.
  std::string advertise_host;
  uint16_t port = 0;  // 0 = any free port
  std::string token;
  uint32_t heartbeat_ms = core::kHeartbeatMs;          // nodes heartbeat this often
  uint32_t heartbeat_misses = core::kHeartbeatMisses;  // silent for this many intervals = dead
  size_t max_dead_actors = 1000;                       // DEAD actors kept for status (oldest forgotten first)
  // The HTTP endpoint (/metrics, /api/status, the dashboard at /; see
  // http_endpoint.h): -1 = off, 0 = any free port. It listens on `host`
  // and asks for the token unless `host` is loopback only, or always with
  // dashboard_require_token.
  int dashboard_port = -1;
  bool dashboard_require_token = false;
  // When dashboard_port is taken, take any free one instead of failing
  // (the default port of `troupe start`: a second cluster on the machine).
  bool dashboard_port_fallback = false;
  // The SQLite file its tables are written through to ("" = none). When it
  // holds an earlier head's tables, they are reloaded: node agents, workers
  // and drivers that lost that head reconnect, and those that do not within
  // restore_grace are treated as gone. A stop (troupe stop, SIGTERM) ends the
  // cluster and empties the file. A driver or worker whose connection to a
  // durable head drops without a goodbye (a network blip) gets restore_grace
  // too to come back to what it owns; when it runs where the head runs and
  // its process is seen gone, what it owned goes at once.
  std::string state_db;
  std::chrono::milliseconds restore_grace{5000};
  // A pipe the event loop writes a byte to every second, for a supervisor
  // that restarts a hung head (client/head_supervisor.h); -1 = none.
  int liveness_fd = -1;
  // A connection that authenticated but sent no hello within this is
  // closed: a token holder's idle connections held a descriptor and its
  // buffers each for ever, and 20,000 of them locked every client out.
  std::chrono::milliseconds hello_timeout{30000};
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

  // "host:port" others reach the head at: the advertise host and the port.
  std::string address() const;
  // http://HOST:PORT/ of the dashboard ("" when it is off).
  std::string dashboard_url() const;
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
