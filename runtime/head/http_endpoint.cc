#include "troupe/runtime/head/http_endpoint.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <strings.h>

#include <openssl/crypto.h>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/head/http_server.h"
#include "troupe/runtime/head/metrics.h"
#include "troupe/runtime/wire/address.h"

namespace troupe::head {

namespace {

constexpr const char* kCookie = "troupe_token";

bool same_token(const std::string& given, const std::string& token) {
  return given.size() == token.size() && !token.empty() && CRYPTO_memcmp(given.data(), token.data(), token.size()) == 0;
}

// The token a request carries: the bearer header, else the login cookie.
std::string token_of(const HttpRequest& req) {
  const std::string auth = req.header("Authorization");
  // The scheme's name is case-insensitive (RFC 7235): "bearer" too.
  if (auth.size() > 7 && strncasecmp(auth.c_str(), "Bearer ", 7) == 0) return auth.substr(7);
  const std::string cookies = req.header("Cookie");
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

namespace {

std::string host_of(const std::string& host_header) {
  std::string h = host_header;
  if (!h.empty() && h[0] == '[') {
    const size_t close = h.find(']');
    return close == std::string::npos ? h : h.substr(0, close + 1);
  }
  const size_t colon = h.find(':');
  if (colon != std::string::npos && h.find(':', colon + 1) == std::string::npos) h.resize(colon);
  return h;
}

// A Host naming this machine's loopback exactly: "localhost", or an
// address literal in 127/8 or ::1. Not a name that merely begins like one
// ("127.0.0.1.attacker.example" can be rebound to 127.0.0.1).
bool loopback_name(const std::string& host) {
  const std::string h = wire::strip_brackets(host);
  if (strcasecmp(h.c_str(), "localhost") == 0) return true;
  in_addr v4{};
  if (::inet_pton(AF_INET, h.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  return ::inet_pton(AF_INET6, h.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
}

}  // namespace

bool is_loopback_host(const std::string& host) {
  const std::string h = wire::strip_brackets(host);
  return h == "localhost" || h == "::1" || h.rfind("127.", 0) == 0;
}

class HttpEndpoint::Impl {
 public:
  Impl(HttpOptions o, Snapshot snapshot)
      : opts_(std::move(o)),
        snapshot_(std::move(snapshot)),
        server_(listen(opts_, [this](const HttpRequest& req, HttpResponse& res) { handle(req, res); })) {}

  void stop() { server_.stop(); }
  int port() const { return server_.port(); }

 private:
  static HttpServer listen(const HttpOptions& o, HttpServer::Handler handler) {
    try {
      return HttpServer(wire::strip_brackets(o.host), o.port, std::move(handler));
    } catch (const ConfigError& e) {
      throw ConfigError("dashboard: " + std::string(e.what()) +
                        " (in use, or not an address of this machine); pick another with --dashboard-port");
    }
  }

  // A 401 (or 403) unless the request may pass; true when it may.
  bool allowed(const HttpRequest& req, HttpResponse& res) {
    if (!opts_.require_token) return loopback_allowed(req, res);
    // A loopback head asked for the token as well keeps its Host check: it
    // answered a rebound name that brought a token (README's promise).
    if (is_loopback_host(opts_.host) && !loopback_host_allowed(req, res)) return false;
    const std::string given = token_of(req);
    if (same_token(given, opts_.token)) return true;
    res.status = 401;
    res.set_header("WWW-Authenticate", "Bearer realm=\"troupe\"");
    // A browser (no token, or the cookie of an earlier cluster on this
    // port and its token): to the login form. A wrong bearer token is a
    // program's, told so.
    const std::string auth = req.header("Authorization");
    const bool bearer = auth.size() > 7 && strncasecmp(auth.c_str(), "Bearer ", 7) == 0;
    if (req.path == "/" && (given.empty() || !bearer)) {
      res.status = 303;
      res.set_header("Location", "/login");
      return false;
    }
    res.set_content(given.empty() ? "troupe dashboard: missing token (send Authorization: Bearer TOKEN, or log in "
                                    "at /login)\n"
                                  : "troupe dashboard: wrong token (log in again at /login)\n",
                    "text/plain");
    return false;
  }

  // A head serving on loopback needs no token: any program of this machine
  // may read its status. A web page from elsewhere may not: one that
  // rebinds its own DNS name to 127.0.0.1 still sends that name as Host.
  // A client that sends a token is told when it is wrong.
  bool loopback_allowed(const HttpRequest& req, HttpResponse& res) {
    if (!loopback_host_allowed(req, res)) return false;
    const std::string auth = req.header("Authorization");
    if (auth.size() > 7 && strncasecmp(auth.c_str(), "Bearer ", 7) == 0 && !same_token(auth.substr(7), opts_.token)) {
      res.status = 401;
      res.set_header("WWW-Authenticate", "Bearer realm=\"troupe\"");
      res.set_content("troupe dashboard: wrong token\n", "text/plain");
      return false;
    }
    return true;
  }

  // A 403 (false) for a Host that is not a loopback name.
  static bool loopback_host_allowed(const HttpRequest& req, HttpResponse& res) {
    const std::string host = host_of(req.header("Host"));
    if (host.empty() || loopback_name(host)) return true;
    res.status = 403;
    res.set_content("troupe dashboard: Host '" + host +
                        "' is not a loopback name; this head serves its dashboard to this machine only "
                        "(open it as http://127.0.0.1:PORT/; a head on another address serves it to all, with the "
                        "token)\n",
                    "text/plain");
    return false;
  }

  // The snapshot, or a 503 (false) when the head did not answer in time.
  bool with_snapshot(HttpResponse& res, nlohmann::json& out) {
    out = snapshot_();
    if (!out.is_null()) return true;
    res.status = 503;
    res.set_content("troupe dashboard: the head did not answer in time\n", "text/plain");
    return false;
  }

  void login(const HttpRequest& req, HttpResponse& res) {
    const std::string given = req.form_value("token");
    if (!same_token(given, opts_.token)) {
      res.status = 401;
      res.set_content("troupe dashboard: wrong token\n", "text/plain");
      return;
    }
    res.status = 303;
    res.set_header("Set-Cookie", std::string(kCookie) + "=" + given + "; HttpOnly; SameSite=Strict; Path=/");
    res.set_header("Location", "/");
  }

  // Repeated slashes as one: the session's `dashboard` file holds the URL
  // with its '/', so "$(cat dashboard)/metrics" asks for //metrics.
  static std::string collapse_slashes(const std::string& path) {
    std::string out;
    for (char c : path)
      if (!(c == '/' && !out.empty() && out.back() == '/')) out += c;
    return out;
  }

  void handle(const HttpRequest& given, HttpResponse& res) {
    HttpRequest req = given;
    req.path = collapse_slashes(given.path);
    const bool get = req.method == "GET" || req.method == "HEAD";  // the server leaves HEAD's body out
    nlohmann::json s;
    if (req.path == "/metrics" && get) {
      if (allowed(req, res) && with_snapshot(res, s))
        res.set_content(prometheus_text(s), "text/plain; version=0.0.4; charset=utf-8");
    } else if (req.path == "/api/status" && get) {
      if (allowed(req, res) && with_snapshot(res, s))
        res.set_content(s.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), "application/json");
    } else if (req.path == "/" && get) {
      if (allowed(req, res)) res.set_content(dashboard_html(), "text/html; charset=utf-8");
    } else if (req.path == "/login" && get) {
      res.set_content(kLoginPage, "text/html; charset=utf-8");
    } else if (req.path == "/login" && req.method == "POST") {
      login(req, res);
    } else if (req.path == "/metrics" || req.path == "/api/status" || req.path == "/" || req.path == "/login") {
      res.status = 405;
      res.set_header("Allow", req.path == "/login" ? "GET, HEAD, POST" : "GET, HEAD");
      res.set_content("troupe dashboard: " + req.method + " is not served at " + req.path + "\n", "text/plain");
    } else {
      res.status = 404;
      res.set_content("troupe dashboard: nothing at " + req.path + " (try /, /metrics or /api/status)\n", "text/plain");
    }
  }

  HttpOptions opts_;
  Snapshot snapshot_;
  HttpServer server_;
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
