#include "tests/fuzz/targets.h"
#include "troupe/runtime/head/http_server.h"

namespace troupe::fuzz {

int http_target(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  head::HttpRequest req;
  if (head::parse_request_head(text, req)) {
    (void)req.header("Content-Length");
    (void)req.header("Authorization");
  }
  req.body = text;
  (void)req.form_value("token");
  (void)head::url_decode(text);
  return 0;
}

}  // namespace troupe::fuzz
