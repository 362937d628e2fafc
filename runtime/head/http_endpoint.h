// HttpEndpoint: the head's HTTP side, for operators: `/metrics`
// (Prometheus text), `/api/status` (the status JSON plus jobs) and `/` (the
// dashboard page, dashboard_page.cc). Served by HttpServer (http_server.h:
// one event loop on a thread of its own, every connection bounded in time,
// so slow clients cannot starve the others); it never touches the head's
// tables: every request asks the head's event loop for a snapshot
// (Snapshot, run there) and renders that.
//
// Access: with `require_token`, every path but /login needs the cluster
// token, as `Authorization: Bearer TOKEN` or the cookie the /login form
// sets; a missing or wrong one is a 401 with a one-line reason. The head
// turns it on unless it binds to loopback only. Without it (loopback), a
// request naming a Host that is not a loopback name is a 403 (a web page
// that rebound its DNS name to 127.0.0.1 cannot read the status), and one
// with a wrong bearer token a 401.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

namespace troupe::head {

struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0 = any free port
  std::string token;
  bool require_token = false;
};

class HttpEndpoint {
 public:
  // The status snapshot, or a JSON null when the head could not answer in
  // time (a 503). Called on an HTTP thread.
  using Snapshot = std::function<nlohmann::json()>;

  // Binds at once (ConfigError naming host and port when it cannot) and
  // serves on a background thread.
  HttpEndpoint(HttpOptions options, Snapshot snapshot);
  ~HttpEndpoint();
  HttpEndpoint(const HttpEndpoint&) = delete;
  HttpEndpoint& operator=(const HttpEndpoint&) = delete;

  int port() const;
  // http://HOST:PORT/ with `advertise_host` (never a wildcard).
  std::string url(const std::string& advertise_host) const;
  void stop();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// Is `host` a loopback address (127.x, ::1, localhost)?
bool is_loopback_host(const std::string& host);

// The dashboard's HTML (one self-contained page: inline CSS and JS, no
// network beyond this head).
const std::string& dashboard_html();

}  // namespace troupe::head
