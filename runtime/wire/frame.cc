#include "troupe/runtime/wire/frame.h"

#include <kj/exception.h>

#include <cstdio>
#include <cstring>

#include "troupe/runtime/core/errors.h"

namespace troupe::wire {

size_t OutFrame::total_bytes() const {
  size_t n = head.size();
  for (const auto& a : attachments) n += a.size();
  return n;
}

std::string too_big_for_a_message(const std::string& what, uint64_t bytes) {
  char size[32];
  std::snprintf(size, sizeof size, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return what + ": " + size + " encoded, more than the " + std::to_string(FrameLimits{}.max_message_bytes >> 20) +
         " MiB one message carries: put a large value in the object store (rt.put / troupe.put, or call_ref) and "
         "pass its ref, or send bytes as a troupe::Buffer (which travels beside the message)";
}

uint64_t payload_bytes(const std::string& body, const std::vector<Buffer>& attachments) {
  uint64_t n = body.size();
  for (const auto& a : attachments) n += a.size();
  return n;
}

std::string too_big_for_a_frame(const std::string& what, uint64_t bytes) {
  char size[32];
  std::snprintf(size, sizeof size, "%.2f GiB", static_cast<double>(bytes) / (1ull << 30));
  return what + ": " + size + " with buffers, more than the " + std::to_string(FrameLimits{}.max_frame_bytes >> 30) +
         " GiB one message carries to another process: split it into several values, each put on its own";
}

OutFrame encode_frame(const Message& m) {
  // A stack-sized first segment covers calls and replies without growing.
  capnp::word scratch[128];
  std::memset(scratch, 0, sizeof(scratch));
  capnp::MallocMessageBuilder builder(kj::arrayPtr(scratch, 128));
  auto env = builder.initRoot<Envelope>();
  env.setKind(m.kind);
  env.setId(m.id);
  env.setOp(m.op);
  env.setStatus(m.status);
  env.setErrorKind(m.error_kind);
  if (!m.error_type.empty()) env.setErrorType(m.error_type);
  if (!m.error_message.empty()) env.setErrorMessage(m.error_message);
  if (!m.body.empty())
    env.setBody(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(m.body.data()), m.body.size()));

  auto segments = builder.getSegmentsForOutput();
  size_t msg_bytes = capnp::computeSerializedSizeInWords(builder) * sizeof(capnp::word);
  OutFrame f;
  f.head.resize(kFrameHeaderBytes + 8 * m.attachments.size() + msg_bytes);
  std::byte* p = f.head.data();
  uint32_t hdr[4] = {kFrameMagic, static_cast<uint32_t>(msg_bytes), static_cast<uint32_t>(m.attachments.size()), 0};
  std::memcpy(p, hdr, sizeof(hdr));
  p += sizeof(hdr);
  for (const auto& a : m.attachments) {
    uint64_t s = a.size();
    std::memcpy(p, &s, 8);
    p += 8;
  }
  // Segment table then segments, as capnp::writeMessage would produce.
  uint32_t nseg = segments.size();
  std::vector<uint32_t> table(((nseg + 2) & ~size_t(1)), 0);
  table[0] = nseg - 1;
  for (uint32_t i = 0; i < nseg; ++i) table[i + 1] = segments[i].size();
  std::memcpy(p, table.data(), table.size() * 4);
  p += table.size() * 4;
  for (auto seg : segments) {
    std::memcpy(p, seg.begin(), seg.size() * sizeof(capnp::word));
    p += seg.size() * sizeof(capnp::word);
  }
  f.attachments = m.attachments;
  return f;
}

std::string check_header(const std::byte* p, const FrameLimits& limits, uint32_t* message_bytes,
                         uint32_t* attachments) {
  uint32_t hdr[4];
  std::memcpy(hdr, p, sizeof(hdr));
  if (hdr[0] != kFrameMagic)
    return "bad frame magic 0x" + ([&] {
             char b[16];
             std::snprintf(b, sizeof(b), "%08x", hdr[0]);
             return std::string(b);
           })();
  if (hdr[1] == 0 || hdr[1] % 8 != 0)
    return "message size " + std::to_string(hdr[1]) + " is not a positive multiple of 8";
  if (hdr[1] > limits.max_message_bytes)
    return "message size " + std::to_string(hdr[1]) + " exceeds limit " + std::to_string(limits.max_message_bytes);
  if (hdr[2] > limits.max_attachments)
    return "attachment count " + std::to_string(hdr[2]) + " exceeds limit " + std::to_string(limits.max_attachments);
  if (hdr[3] != 0) return "reserved header field is not zero";
  *message_bytes = hdr[1];
  *attachments = hdr[2];
  return "";
}

std::string check_sizes(uint32_t message_bytes, const std::vector<uint64_t>& sizes, const FrameLimits& limits) {
  uint64_t total = message_bytes;
  for (uint64_t s : sizes) {
    if (s > limits.max_frame_bytes || total + s > limits.max_frame_bytes)
      return "frame size exceeds limit " + std::to_string(limits.max_frame_bytes);
    total += s;
  }
  return "";
}

Message decode_message(const std::byte* p, size_t n, const FrameLimits& limits) {
  // A flat message is whole words; anything else would be copied past the
  // words allocated for it.
  if (n % sizeof(capnp::word) != 0)
    throw DecodeError("message size " + std::to_string(n) + " is not a multiple of " +
                      std::to_string(sizeof(capnp::word)));
  // FlatArrayMessageReader needs word alignment; the copy is small.
  std::vector<capnp::word> words(n / sizeof(capnp::word));
  if (n) std::memcpy(words.data(), p, n);  // an empty vector's data() may be null
  capnp::ReaderOptions opts;
  opts.traversalLimitInWords = limits.traversal_limit_words;
  opts.nestingLimit = limits.nesting_limit;
  try {
    capnp::FlatArrayMessageReader reader(kj::arrayPtr(words.data(), words.size()), opts);
    auto env = reader.getRoot<Envelope>();
    Message m;
    m.kind = env.getKind();
    m.id = env.getId();
    m.op = env.getOp();
    m.status = env.getStatus();
    m.error_kind = env.getErrorKind();
    if (env.hasErrorType()) m.error_type = env.getErrorType();
    if (env.hasErrorMessage()) m.error_message = env.getErrorMessage();
    if (env.hasBody()) {
      auto b = env.getBody();
      m.body.assign(reinterpret_cast<const char*>(b.begin()), b.size());
    }
    return m;
  } catch (const kj::Exception& e) {
    throw DecodeError(std::string("malformed Cap'n Proto message: ") + e.getDescription().cStr());
  }
}

}  // namespace troupe::wire
