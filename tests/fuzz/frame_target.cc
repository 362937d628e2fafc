#include <cstring>

#include "tests/fuzz/targets.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/wire/frame.h"

namespace troupe::fuzz {

namespace {

// The Cap'n Proto part alone, at any length and alignment.
void decode_envelope(const std::byte* p, size_t n, const wire::FrameLimits& limits) {
  try {
    wire::Message m = wire::decode_message(p, n, limits);
    (void)m;
  } catch (const troupe::Error&) {
  }
}

}  // namespace

int frame_target(const uint8_t* data, size_t size) {
  const wire::FrameLimits& limits = wire::kHeadFrameLimits;
  const auto* p = reinterpret_cast<const std::byte*>(data);
  decode_envelope(p, size, limits);
  if (size < wire::kFrameHeaderBytes) return 0;
  uint32_t message_bytes = 0, count = 0;
  if (!wire::check_header(p, limits, &message_bytes, &count).empty()) return 0;
  size_t at = wire::kFrameHeaderBytes;
  if (size - at < size_t(count) * 8) return 0;
  std::vector<uint64_t> sizes(count);
  if (count) std::memcpy(sizes.data(), p + at, size_t(count) * 8);
  at += size_t(count) * 8;
  if (!wire::check_sizes(message_bytes, sizes, limits).empty()) return 0;
  if (size - at < message_bytes) return 0;
  decode_envelope(p + at, message_bytes, limits);
  return 0;
}

}  // namespace troupe::fuzz
