#include "troupe/runtime/head/http_endpoint.h"

#include <httplib.h>
#include <openssl/crypto.h>

#include <thread>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/head/metrics.h"
#include "troupe/runtime/wire/address.h"

namespace troupe::head {

namespace {

constexpr const char* kCookie = "troupe_token";

bool same_token(const std::string& given, const std::string& token) {
  return given.size() == token.size() && !token.empty() && CRYPTO_memcmp(given.data(), token.data(), token.size()) == 0;
}

// The token a request carries: the bearer header, else the login cookie.
std::string token_of(const httplib::Request& req) {
  const std::string auth = req.get_header_value("Authorization");
  if (auth.rfind("Bearer ", 0) == 0) return auth.substr(7);
  const std::string cookies = req.get_header_value("Cookie");
  const std::string key = std::string(kCookie) + "=";
  for (size_t at = 0; at < cookies.size();) {
    size_t end = cookies.find(';', at);
    if (end == std::string::npos) end = cookies.size();
    std::string part = cookies.substr(at, end - at);
    part.erase(0, part.find_first_not_of(' '));
    if (part.rfind(key, 0) == 0) return part.substr(key.size());
    at = end + 1;
  }
  return "";
}

const char* kLoginPage = R"(<!doctype html><html><head><meta charset="utf-8"><title>troupe: log in</title>
<style>body{font-family:sans-serif;margin:4em}input{font-size:1em;padding:.3em;width:28em}</style></head>
<body><h1>troupe dashboard</h1><p>This head needs the cluster token (the session directory's <code>token</code> file).</p>
<form method="post" action="/login"><input type="password" name="token" placeholder="cluster token" autofocus>
<button type="submit">Log in</button></form></body></html>)";

}  // namespace

bool is_loopback_host(const std::string& host) {
  const std::string h = wire::strip_brackets(host);
  return h == "localhost" || h == "::1" || h.rfind("127.", 0) == 0;
}

class HttpEndpoint::Impl {
 public:
  Impl(HttpOptions o, Snapshot snapshot) : opts_(std::move(o)), snapshot_(std::move(snapshot)) {
    // Two threads: an operator's browser and a Prometheus scraper.
    server_.new_task_queue = [] { return new httplib::ThreadPool(2); };
    server_.set_read_timeout(5, 0);
    server_.set_write_timeout(5, 0);
    server_.set_payload_max_length(64 * 1024);
    // SO_REUSEADDR only: cpp-httplib's default adds SO_REUSEPORT, with which
    // a second head would share a taken port instead of being refused.
    server_.set_socket_options([](socket_t sock) {
      int yes = 1;
      ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    });
    routes();
    const std::string host = wire::strip_brackets(opts_.host);
    port_ =
        opts_.port == 0 ? server_.bind_to_any_port(host) : (server_.bind_to_port(host, opts_.port) ? opts_.port : -1);
    if (port_ <= 0)
      throw ConfigError("dashboard: cannot listen on " + wire::format_address(opts_.host, opts_.port) +
                        " (in use, or not an address of this machine); pick another with --dashboard-port");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
  }
  ~Impl() { stop(); }

  void stop() {
    server_.stop();
    if (thread_.joinable()) thread_.join();
  }
  int port() const { return port_; }

 private:
  // A 401 unless the request may pass; true when it may.
  bool allowed(const httplib::Request& req, httplib::Response& res) {
    if (!opts_.require_token) return true;
    const std::string given = token_of(req);
    if (same_token(given, opts_.token)) return true;
    res.status = 401;
    res.set_header("WWW-Authenticate", "Bearer realm=\"troupe\"");
    if (req.path == "/" && given.empty()) {
      res.status = 303;  // a browser: to the login form
      res.set_header("Location", "/login");
      return false;
    }
    res.set_content(given.empty() ? "troupe dashboard: missing token (send Authorization: Bearer TOKEN, or log in "
                                    "at /login)\n"
                                  : "troupe dashboard: wrong token\n",
                    "text/plain");
    return false;
  }

  // The snapshot, or a 503 (false) when the head did not answer in time.
  bool with_snapshot(httplib::Response& res, nlohmann::json& out) {
    out = snapshot_();
    if (!out.is_null()) return true;
    res.status = 503;
    res.set_content("troupe dashboard: the head did not answer in time\n", "text/plain");
    return false;
  }

  void routes() {
    server_.Get("/metrics", [this](const httplib::Request& req, httplib::Response& res) {
      nlohmann::json s;
      if (allowed(req, res) && with_snapshot(res, s))
        res.set_content(prometheus_text(s), "text/plain; version=0.0.4; charset=utf-8");
    });
    server_.Get("/api/status", [this](const httplib::Request& req, httplib::Response& res) {
      nlohmann::json s;
      if (allowed(req, res) && with_snapshot(res, s)) res.set_content(s.dump(), "application/json");
    });
    server_.Get("/", [this](const httplib::Request& req, httplib::Response& res) {
      if (allowed(req, res)) res.set_content(dashboard_html(), "text/html; charset=utf-8");
    });
    server_.Get("/login", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(kLoginPage, "text/html; charset=utf-8");
    });
    server_.Post("/login", [this](const httplib::Request& req, httplib::Response& res) {
      const std::string given = req.get_param_value("token");
      if (!same_token(given, opts_.token)) {
        res.status = 401;
        res.set_content("troupe dashboard: wrong token\n", "text/plain");
        return;
      }
      res.status = 303;
      res.set_header("Set-Cookie", std::string(kCookie) + "=" + given + "; HttpOnly; SameSite=Strict; Path=/");
      res.set_header("Location", "/");
    });
  }

  HttpOptions opts_;
  Snapshot snapshot_;
  httplib::Server server_;
  int port_ = -1;
  std::thread thread_;
};

HttpEndpoint::HttpEndpoint(HttpOptions options, Snapshot snapshot)
    : impl_(std::make_unique<Impl>(std::move(options), std::move(snapshot))) {}
HttpEndpoint::~HttpEndpoint() = default;
int HttpEndpoint::port() const { return impl_->port(); }
std::string HttpEndpoint::url(const std::string& advertise_host) const {
  return "http://" + wire::format_address(advertise_host, static_cast<uint16_t>(port())) + "/";
}
void HttpEndpoint::stop() { impl_->stop(); }

}  // namespace troupe::head
