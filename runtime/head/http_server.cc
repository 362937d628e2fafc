#include "troupe/runtime/head/http_server.h"

#include <fcntl.h>

#include <asio.hpp>

#include <algorithm>
#include <cctype>
#include <list>
#include <thread>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/wire/address.h"

namespace troupe::head {

namespace {

using asio::ip::tcp;

const char* reason(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 303:
      return "See Other";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 403:
      return "Forbidden";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 413:
      return "Payload Too Large";
    case 431:
      return "Request Header Fields Too Large";
    case 500:
      return "Internal Server Error";
    case 503:
      return "Service Unavailable";
    default:
      return "Status";
  }
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool is_control(char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; }
// A byte no request head holds (its lines end in CR LF; values may hold tabs).
bool foreign_to_a_head(char c) { return is_control(c) && c != '\n' && c != '\r' && c != '\t'; }

std::string trim(const std::string& s) {
  const size_t first = s.find_first_not_of(" \t");
  if (first == std::string::npos) return "";
  return s.substr(first, s.find_last_not_of(" \t") - first + 1);
}

// An absolute-form target ("http://host:port/path?q", which a server must
// take, RFC 9112 3.2.2: proxies send it) as its origin form ("/path?q");
// any other target as it is.
std::string origin_form(const std::string& target) {
  std::string scheme;
  for (const char c : target.substr(0, 8)) scheme += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const size_t skip = scheme.rfind("http://", 0) == 0 ? 7 : scheme.rfind("https://", 0) == 0 ? 8 : 0;
  if (skip == 0) return target;
  const size_t end = target.find_first_of("/?", skip);  // the authority ends here
  if (end == std::string::npos) return "/";
  return target[end] == '/' ? target.substr(end) : "/" + target.substr(end);
}

// The request line: METHOD TARGET HTTP/1.x, TARGET an origin path or an
// absolute URL.
bool parse_request_line(const std::string& line, HttpRequest& req) {
  const size_t a = line.find(' ');
  const size_t b = a == std::string::npos ? a : line.find(' ', a + 1);
  if (b == std::string::npos || line.find(' ', b + 1) != std::string::npos) return false;
  req.method = line.substr(0, a);
  const std::string target = origin_form(line.substr(a + 1, b - a - 1));
  const std::string version = line.substr(b + 1);
  if (req.method.empty() ||
      !std::all_of(req.method.begin(), req.method.end(), [](char c) { return c >= 'A' && c <= 'Z'; }))
    return false;
  if (target.empty() || target.front() != '/' || version.rfind("HTTP/1.", 0) != 0) return false;
  if (std::any_of(line.begin(), line.end(), is_control)) return false;
  const size_t q = target.find('?');
  req.path = target.substr(0, q);
  req.query = q == std::string::npos ? "" : target.substr(q + 1);
  return true;
}

// The body's length from Content-Length (0 when absent); -1 when it is not
// a number or the body comes chunked, which no route takes.
long long body_length(const HttpRequest& req) {
  if (!req.header("Transfer-Encoding").empty()) return -1;
  const std::string text = req.header("Content-Length");
  if (text.empty()) return 0;
  if (text.size() > 18 || !std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return -1;
  return std::stoll(text);
}

// Where a request head ends: at its empty line, CRLF CRLF or one made of
// bare LFs (a hand-typed request), which on_head refuses at once rather
// than waiting for a CRLF CRLF that never comes.
struct HeadEnd {
  using iterator = asio::buffers_iterator<asio::streambuf::const_buffers_type>;
  using result_type = std::pair<iterator, bool>;
  result_type operator()(iterator begin, iterator end) const {
    iterator resume = end;
    for (iterator i = begin; i != end; ++i) {
      // A control byte no request head holds: not HTTP, answered at once
      // (it waited for an empty line until the deadline).
      if (foreign_to_a_head(*i)) return {i + 1, true};
      if (*i != '\n') continue;
      resume = i;
      iterator next = i + 1;
      if (next != end && *next == '\n') return {next + 1, true};
      if (next != end && *next == '\r' && next + 1 != end && *(next + 1) == '\n') return {next + 2, true};
    }
    // An empty line starting at the last LF needs at most two bytes after
    // it; with more there, none starts before them. Resuming at the LF
    // itself scanned a long header line sent a byte at a time from its
    // start again on every read (quadratic, for 64 connections at once).
    if (resume != end && end - resume > 2) resume = end - 2;
    return {resume, false};
  }
};

void set_cloexec(int fd) { ::fcntl(fd, F_SETFD, ::fcntl(fd, F_GETFD) | FD_CLOEXEC); }

// One connection: read a request (head, then body), answer it, close.
class Exchange : public std::enable_shared_from_this<Exchange> {
 public:
  Exchange(tcp::socket s, const HttpServer::Handler& handler, const HttpServerOptions& opts)
      : socket_(std::move(s)),
        deadline_(socket_.get_executor()),
        head_(opts.max_head_bytes),
        handler_(handler),
        opts_(opts) {}

  void start() {
    auto self = shared_from_this();
    deadline_.expires_after(opts_.deadline);
    deadline_.async_wait([self](asio::error_code ec) {
      if (!ec) self->close();
    });
    asio::async_read_until(socket_, head_, HeadEnd{}, [self](asio::error_code ec, size_t n) { self->on_head(ec, n); });
  }

  void close() {
    asio::error_code ignored;
    socket_.close(ignored);
    deadline_.cancel();
  }

  // Whether its answer is being written: closing it then loses an answer
  // already made, where closing one still sending its request loses none.
  bool answering() const { return answering_; }

 private:
  void on_head(asio::error_code ec, size_t n) {
    if (ec == asio::error::not_found) return answer_error(431, "request head over the limit");
    if (ec) return close();
    const std::string all(asio::buffers_begin(head_.data()), asio::buffers_end(head_.data()));
    if (std::any_of(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(n), foreign_to_a_head))
      return answer_error(400, "not an HTTP/1.x request");
    if (n < 4 || all.compare(n - 4, 4, "\r\n\r\n") != 0)
      return answer_error(400, "the request's lines must end with CR LF");
    if (!parse_request_head(all.substr(0, n - 4), req_)) return answer_error(400, "not an HTTP/1.x request");
    const long long length = body_length(req_);
    if (length < 0) return answer_error(400, "a body needs a Content-Length (chunked bodies are not taken)");
    if (static_cast<unsigned long long>(length) > opts_.max_body_bytes)
      return answer_error(413, "body over " + std::to_string(opts_.max_body_bytes) + " bytes");
    req_.body = all.substr(n, static_cast<size_t>(length));
    const size_t have = req_.body.size();
    req_.body.resize(static_cast<size_t>(length));
    if (have == req_.body.size()) return answer();
    auto self = shared_from_this();
    asio::async_read(socket_, asio::buffer(req_.body.data() + have, req_.body.size() - have),
                     [self](asio::error_code ec, size_t) {
                       if (ec) return self->close();
                       self->answer();
                     });
  }

  void answer() {
    HttpResponse res;
    try {
      handler_(req_, res);
    } catch (const std::exception& e) {
      res = HttpResponse{};
      res.status = 500;
      res.set_content(std::string("troupe: ") + e.what() + "\n", "text/plain");
    }
    send(res);
  }

  void answer_error(int status, const std::string& why) {
    HttpResponse res;
    res.status = status;
    res.set_content("troupe: " + why + "\n", "text/plain");
    send(res);
  }

  void send(const HttpResponse& res) {
    out_ = "HTTP/1.1 " + std::to_string(res.status) + " " + reason(res.status) + "\r\n";
    out_ += "Content-Type: " + res.content_type + "\r\nContent-Length: " + std::to_string(res.body.size()) +
            "\r\nConnection: close\r\nCache-Control: no-store\r\n";
    for (const auto& [name, value] : res.headers) out_ += name + ": " + value + "\r\n";
    out_ += "\r\n";
    if (req_.method != "HEAD") out_ += res.body;  // HEAD: GET's head, its Content-Length too
    answering_ = true;
    auto self = shared_from_this();
    asio::async_write(socket_, asio::buffer(out_), [self](asio::error_code ec, size_t) {
      self->answering_ = false;
      if (ec) return self->close();
      asio::error_code ignored;
      self->socket_.shutdown(tcp::socket::shutdown_send, ignored);
      self->drain();
    });
  }

  // Reads to the client's end of the stream before closing, so that what
  // it sent and was not read (a refused body) does not reset the answer.
  void drain() {
    auto self = shared_from_this();
    socket_.async_read_some(asio::buffer(sink_), [self](asio::error_code ec, size_t) {
      if (ec) return self->close();
      self->drain();
    });
  }

  tcp::socket socket_;
  asio::steady_timer deadline_;
  asio::streambuf head_;
  HttpRequest req_;
  std::string out_;
  bool answering_ = false;  // the server's thread only
  char sink_[512];
  const HttpServer::Handler& handler_;
  const HttpServerOptions& opts_;
};

}  // namespace

std::string HttpRequest::header(const std::string& name) const {
  auto it = headers.find(lower(name));
  return it == headers.end() ? "" : it->second;
}

bool parse_request_head(const std::string& head, HttpRequest& req) {
  size_t at = head.find("\r\n");
  if (!parse_request_line(head.substr(0, at), req)) return false;
  while (at != std::string::npos && at + 2 < head.size()) {
    const size_t start = at + 2;
    at = head.find("\r\n", start);
    const std::string line = head.substr(start, at == std::string::npos ? std::string::npos : at - start);
    const size_t colon = line.find(':');
    if (colon == 0 || colon == std::string::npos) return false;
    const std::string name = line.substr(0, colon);
    const std::string value = trim(line.substr(colon + 1));
    auto bad = [](char c) { return is_control(c) || c == ' ' || c == '\t'; };
    if (std::any_of(name.begin(), name.end(), bad) ||
        std::any_of(value.begin(), value.end(), [](char c) { return is_control(c) && c != '\t'; }))
      return false;
    // Two lengths (or hosts, or transfer codings) that differ make the
    // request's end ambiguous (a smuggling vector, RFC 9112 6.3): refused.
    auto [it, fresh] = req.headers.emplace(lower(name), value);
    if (!fresh && it->second != value &&
        (it->first == "content-length" || it->first == "host" || it->first == "transfer-encoding"))
      return false;
    it->second = value;
  }
  return true;
}

std::string url_decode(const std::string& text) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '+') {
      out += ' ';
    } else if (c == '%' && i + 2 < text.size() && std::isxdigit(static_cast<unsigned char>(text[i + 1])) &&
               std::isxdigit(static_cast<unsigned char>(text[i + 2]))) {
      out += static_cast<char>(std::stoi(text.substr(i + 1, 2), nullptr, 16));
      i += 2;
    } else {
      out += c;
    }
  }
  return out;
}

std::string HttpRequest::form_value(const std::string& name) const {
  for (size_t at = 0; at <= body.size();) {
    size_t end = body.find('&', at);
    if (end == std::string::npos) end = body.size();
    const std::string part = body.substr(at, end - at);
    const size_t eq = part.find('=');
    if (url_decode(part.substr(0, eq)) == name) return eq == std::string::npos ? "" : url_decode(part.substr(eq + 1));
    at = end + 1;
  }
  return "";
}

class HttpServer::Impl {
 public:
  Impl(const std::string& host, int port, Handler handler, HttpServerOptions opts)
      : handler_(std::move(handler)), opts_(opts), acceptor_(io_) {
    const tcp::endpoint ep(wire::resolve_host(host), static_cast<uint16_t>(port));
    asio::error_code ec;
    acceptor_.open(ep.protocol(), ec);
    if (!ec) acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) acceptor_.bind(ep, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec)
      throw ConfigError("cannot listen on " + wire::format_address(host, static_cast<uint16_t>(port)) + ": " +
                        ec.message());
    set_cloexec(acceptor_.native_handle());
    port_ = acceptor_.local_endpoint().port();
    accept_next();
    thread_ = std::thread([this] { io_.run(); });
  }
  ~Impl() { stop(); }

  void stop() {
    if (!thread_.joinable()) return;
    asio::post(io_, [this] {
      asio::error_code ignored;
      acceptor_.close(ignored);
      for (auto& w : live_)
        if (auto x = w.lock()) x->close();
      io_.stop();
    });
    thread_.join();
  }
  int port() const { return port_; }

 private:
  void accept_next() {
    acceptor_.async_accept([this](asio::error_code ec, tcp::socket s) {
      if (!acceptor_.is_open()) return;
      if (ec) {
        TROUPE_LOG_DEBUG("dashboard: accept failed: {}", ec.message());
        // Out of descriptors: try again shortly rather than spin.
        auto t = std::make_shared<asio::steady_timer>(io_, std::chrono::milliseconds(50));
        t->async_wait([this, t](asio::error_code) { accept_next(); });
        return;
      }
      set_cloexec(s.native_handle());
      admit(std::move(s));
      accept_next();
    });
  }

  // The oldest connection not being answered makes room for the newest:
  // a client holding many open cannot keep a new one from being served,
  // nor cut off an answer another client is taking (a flood closed a
  // large log piece or /metrics mid-write). Only when every connection is
  // being answered does the oldest of those go.
  void admit(tcp::socket s) {
    live_.remove_if([](const std::weak_ptr<Exchange>& w) { return w.expired(); });
    while (live_.size() >= std::max<size_t>(opts_.max_connections, 1)) {
      auto victim = std::find_if(live_.begin(), live_.end(), [](const std::weak_ptr<Exchange>& w) {
        auto x = w.lock();
        return !x || !x->answering();
      });
      if (victim == live_.end()) victim = live_.begin();
      if (auto x = victim->lock()) x->close();
      live_.erase(victim);
    }
    auto x = std::make_shared<Exchange>(std::move(s), handler_, opts_);
    live_.push_back(x);
    x->start();
  }

  Handler handler_;
  HttpServerOptions opts_;
  asio::io_context io_;
  tcp::acceptor acceptor_;
  std::list<std::weak_ptr<Exchange>> live_;
  int port_ = 0;
  std::thread thread_;
};

HttpServer::HttpServer(const std::string& host, int port, Handler handler, HttpServerOptions options)
    : impl_(std::make_unique<Impl>(host, port, std::move(handler), options)) {}
HttpServer::~HttpServer() = default;
int HttpServer::port() const { return impl_->port(); }
void HttpServer::stop() { impl_->stop(); }

void HttpResponse::set_header(std::string name, std::string value) {
  headers.emplace_back(std::move(name), std::move(value));
}

}  // namespace troupe::head
