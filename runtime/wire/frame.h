// Frames: the unit that crosses a troupe connection.
//
// Layout on the wire (little-endian):
//   u32 magic "TRP1" | u32 message bytes | u32 attachment count | u32 0
//   u64 attachment size × count
//   Cap'n Proto flat message (Envelope, a multiple of 8 bytes)
//   attachment bytes, one block after another
//
// Every reader checks FrameLimits before allocating anything, and decodes
// the Cap'n Proto message with traversal and nesting limits, so a malformed
// or oversized frame costs only the connection that sent it.
#pragma once

#include <capnp/message.h>
#include <capnp/serialize.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "troupe/runtime/core/buffer.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/wire/envelope.capnp.h"

namespace troupe::wire {

inline constexpr uint32_t kFrameMagic = 0x31505254;  // "TRP1"
inline constexpr size_t kFrameHeaderBytes = 16;

struct FrameLimits {
  uint64_t max_message_bytes = 64ull << 20;  // the Cap'n Proto part
  uint64_t max_frame_bytes = 4ull << 30;     // message + attachments
  uint32_t max_attachments = 4096;
  uint64_t traversal_limit_words = 16ull << 20;
  int nesting_limit = 32;
};

// The most a message's body may hold to pass a worker's limit, with room
// for the envelope: a sender refuses more, naming the size, rather than
// have the receiver close the connection (which fails every call on it,
// as if the actor had died).
inline constexpr uint64_t kMaxInlineBody = FrameLimits{}.max_message_bytes - (64u << 10);
// "a call's arguments: 100.0 MiB encoded, more than the 64 MiB one
// message carries; ..." for ConfigErrors of senders.
std::string too_big_for_a_message(const std::string& what, uint64_t bytes);

// The same for a whole frame: a message and its attachments (buffers,
// tensors) together, which a receiver refuses past max_frame_bytes by
// closing the connection (read as the death of whoever sent it).
inline constexpr uint64_t kMaxFramePayload = FrameLimits{}.max_frame_bytes - (64u << 10);
uint64_t payload_bytes(const std::string& body, const std::vector<Buffer>& attachments);
// ConfigError text: "an object: 4.06 GiB with buffers, more than the 4 GiB
// one message carries to another process: ...".
std::string too_big_for_a_frame(const std::string& what, uint64_t bytes);

// What a sender checks before it sends a body and its attachments: a
// ConfigError, naming what() (made only then: this is on every call), when
// the receiver's message or frame limit would refuse them.
template <class What>
void check_sendable(const std::string& body, const std::vector<Buffer>& attachments, What&& what) {
  if (body.size() > kMaxInlineBody) throw ConfigError(too_big_for_a_message(what(), body.size()));
  if (attachments.size() > FrameLimits{}.max_attachments)
    throw ConfigError(what() + ": " + std::to_string(attachments.size()) + " buffers, more than the " +
                      std::to_string(FrameLimits{}.max_attachments) + " one message carries");
  if (const uint64_t n = payload_bytes(body, attachments); n > kMaxFramePayload)
    throw ConfigError(too_big_for_a_frame(what(), n));
}

// The head carries control messages and constructor arguments, never
// tensors or batches: its frames are small, so one connection cannot make
// it hold much (workers and streams keep the defaults above).
inline constexpr FrameLimits kHeadFrameLimits{
    .max_message_bytes = 16ull << 20, .max_frame_bytes = 64ull << 20, .max_attachments = 64};

// What a message looks like to the code that builds or reads it, before
// and after Cap'n Proto: plain fields, cheap to construct.
struct Message {
  Kind kind = Kind::EVENT;
  uint64_t id = 0;
  uint32_t op = 0;
  Status status = Status::OK;
  ErrorKind error_kind = ErrorKind::NONE;
  std::string error_type;
  std::string error_message;
  std::string body;
  std::vector<Buffer> attachments;
};

// A frame ready to write: the header + segment bytes and the attachments.
struct OutFrame {
  std::vector<std::byte> head;  // frame header, attachment sizes, message
  std::vector<Buffer> attachments;
  size_t total_bytes() const;
};

// Serializes a message into an OutFrame.
OutFrame encode_frame(const Message& m);

// Parsed frame header.
struct FrameHeader {
  uint32_t message_bytes = 0;
  std::vector<uint64_t> attachment_sizes;
};

// Checks the fixed 16-byte header; returns an error text or "" and fills
// message_bytes/attachment count.
std::string check_header(const std::byte* p, const FrameLimits& limits, uint32_t* message_bytes, uint32_t* attachments);
// Checks attachment sizes against the limits; returns error text or "".
std::string check_sizes(uint32_t message_bytes, const std::vector<uint64_t>& sizes, const FrameLimits& limits);

// Decodes the Cap'n Proto part (bytes need not be aligned; their count must
// be a multiple of 8). Throws troupe::DecodeError on malformed input.
Message decode_message(const std::byte* p, size_t n, const FrameLimits& limits);

}  // namespace troupe::wire
