// HttpServer: the small HTTP/1.1 server under the head's HTTP endpoint
// (http_endpoint.h). One request per connection (every answer says
// `Connection: close`), served on an asio event loop of its own thread, so
// that a connection costs a socket and a buffer, not a thread: clients that
// send slowly or not at all (a half-sent request dribbled a byte at a time)
// cannot keep others from being served.
//
// Limits, each ending only the connection that broke it:
//   - a connection has `deadline` in all to send its request and take the
//     answer, however steadily it sends;
//   - at most `max_connections` at once; one more closes the oldest that
//     is not being answered (the oldest of all when every one is);
//   - a request head (request line and headers) of at most `max_head_bytes`
//     (else 431) and a body of at most `max_body_bytes` (else 413);
//   - what does not parse as HTTP/1.x is a 400.
// The handler runs on the server's thread, one request at a time.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace troupe::head {

struct HttpRequest {
  std::string method;                          // "GET", "POST", ...
  std::string path;                            // without the query
  std::string query;                           // after '?', undecoded
  std::map<std::string, std::string> headers;  // names in lower case
  std::string body;

  // A header's value ("" when absent); `name` in any case.
  std::string header(const std::string& name) const;
  // A field of an application/x-www-form-urlencoded body, decoded ("" when
  // absent).
  std::string form_value(const std::string& name) const;
};

struct HttpResponse {
  int status = 200;
  std::vector<std::pair<std::string, std::string>> headers;
  std::string content_type = "text/plain";
  std::string body;

  void set_content(std::string text, std::string type) {
    body = std::move(text);
    content_type = std::move(type);
  }
  // Out of line: inlined into its callers, GCC 12 warns wrongly (-Warray-bounds).
  void set_header(std::string name, std::string value);
};

struct HttpServerOptions {
  std::chrono::milliseconds deadline{10000};
  size_t max_connections = 64;
  size_t max_head_bytes = 16 * 1024;
  size_t max_body_bytes = 64 * 1024;
};

class HttpServer {
 public:
  using Handler = std::function<void(const HttpRequest&, HttpResponse&)>;

  // Binds host:port (0 = any free port) at once, ConfigError naming both
  // when it cannot, and serves on a thread of its own.
  HttpServer(const std::string& host, int port, Handler handler, HttpServerOptions options = {});
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const;
  // Closes the listener and every connection, and joins the thread.
  void stop();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// A request head (the request line and header lines, without the blank
// line that ends them) into `req`; false when it is not HTTP/1.x: a bad
// request line, a target that is not a path, a header line without a name,
// a control character. What HttpServer reads from every client.
bool parse_request_head(const std::string& head, HttpRequest& req);

// "%41b+c" -> "Ab c" (application/x-www-form-urlencoded).
std::string url_decode(const std::string& text);

}  // namespace troupe::head
