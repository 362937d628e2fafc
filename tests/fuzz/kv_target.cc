#include <cstring>

#include "tests/fuzz/targets.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/head/head_state.h"

namespace troupe::fuzz {

namespace {

// Reads the input as a short script of KV operations.
class Script {
 public:
  Script(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  bool done() const { return p_ == end_; }
  uint8_t byte() { return p_ < end_ ? *p_++ : 0; }
  std::string text() {
    size_t want = byte();  // read before the bytes left are counted
    size_t n = std::min<size_t>(want, end_ - p_);
    std::string s(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return s;
  }
  int64_t number() {
    int64_t v = 0;
    size_t n = std::min<size_t>(sizeof(v), end_ - p_);
    std::memcpy(&v, p_, n);
    p_ += n;
    return v;
  }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
};

}  // namespace

int kv_target(const uint8_t* data, size_t size) {
  head::HeadState state;
  Script s(data, size);
  // Few keys, so that operations meet on the same ones.
  auto key = [&] { return std::string(1, char('a' + s.byte() % 4)); };
  while (!s.done()) {
    try {
      switch (s.byte() % 4) {
        case 0: {
          std::string k = key();
          state.kv_put(k, s.text());
          break;
        }
        case 1: {
          std::string k = key();
          state.kv_add(k, s.number());
          break;
        }
        case 2:
          (void)state.kv_get(key());
          break;
        default:
          state.kv_erase(key());
      }
    } catch (const troupe::Error&) {
    }
  }
  (void)state.take_outputs();
  return 0;
}

}  // namespace troupe::fuzz
