#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/wire/auth.h"
#include "troupe/runtime/wire/frame.h"
#include "troupe/runtime/wire/incoming.h"

namespace {

using namespace troupe::wire;

// Reassembles an OutFrame's bytes as they would cross the wire.
std::vector<std::byte> flatten(const OutFrame& f) {
  std::vector<std::byte> out(f.head.begin(), f.head.end());
  for (const auto& a : f.attachments) out.insert(out.end(), a.data(), a.data() + a.size());
  return out;
}

TEST(Frame, RoundTripWithAttachments) {
  Message m;
  m.kind = Kind::CALL;
  m.id = 77;
  m.op = 3;
  m.body = "args";
  m.attachments.push_back(troupe::Buffer::from_string(std::string(1000, 'a')));
  m.attachments.push_back(troupe::Buffer::from_string(""));
  OutFrame f = encode_frame(m);
  auto bytes = flatten(f);
  FrameLimits lim;
  uint32_t msg = 0, natt = 0;
  ASSERT_EQ(check_header(bytes.data(), lim, &msg, &natt), "");
  EXPECT_EQ(natt, 2u);
  std::vector<uint64_t> sizes(natt);
  std::memcpy(sizes.data(), bytes.data() + kFrameHeaderBytes, 8 * natt);
  EXPECT_EQ(sizes[0], 1000u);
  EXPECT_EQ(sizes[1], 0u);
  Message back = decode_message(bytes.data() + kFrameHeaderBytes + 8 * natt, msg, lim);
  EXPECT_EQ(back.kind, Kind::CALL);
  EXPECT_EQ(back.id, 77u);
  EXPECT_EQ(back.op, 3u);
  EXPECT_EQ(back.body, "args");
  EXPECT_EQ(f.total_bytes(), bytes.size());
}

TEST(Frame, HeaderLimits) {
  FrameLimits lim;
  lim.max_message_bytes = 1024;
  lim.max_attachments = 4;
  uint32_t msg = 0, natt = 0;
  auto header = [](uint32_t magic, uint32_t size, uint32_t natt) {
    std::vector<std::byte> h(16);
    uint32_t v[4] = {magic, size, natt, 0};
    std::memcpy(h.data(), v, 16);
    return h;
  };
  EXPECT_NE(check_header(header(0xdeadbeef, 64, 0).data(), lim, &msg, &natt), "");
  EXPECT_NE(check_header(header(kFrameMagic, 4096, 0).data(), lim, &msg, &natt), "");  // too large
  EXPECT_NE(check_header(header(kFrameMagic, 63, 0).data(), lim, &msg, &natt), "");    // not words
  EXPECT_NE(check_header(header(kFrameMagic, 0, 0).data(), lim, &msg, &natt), "");
  EXPECT_NE(check_header(header(kFrameMagic, 64, 5).data(), lim, &msg, &natt), "");  // too many attachments
  EXPECT_EQ(check_header(header(kFrameMagic, 64, 4).data(), lim, &msg, &natt), "");
  lim.max_frame_bytes = 1 << 20;
  EXPECT_NE(check_sizes(64, {1 << 19, 1 << 19}, lim), "");
  EXPECT_NE(check_sizes(64, {~uint64_t{0}}, lim), "");  // overflow attempt
  EXPECT_EQ(check_sizes(64, {1 << 19}, lim), "");
}

TEST(Frame, MalformedMessageThrows) {
  FrameLimits lim;
  std::vector<std::byte> junk(64, std::byte{0xff});
  EXPECT_THROW(decode_message(junk.data(), junk.size(), lim), troupe::DecodeError);
  // A valid message read with a traversal limit smaller than it is.
  Message m;
  m.body = std::string(4096, 'b');
  OutFrame f = encode_frame(m);
  lim.traversal_limit_words = 8;
  Message back;
  EXPECT_THROW({ back = decode_message(f.head.data() + kFrameHeaderBytes, f.head.size() - kFrameHeaderBytes, lim); },
               troupe::DecodeError);
}

// Found by the frame fuzz target: a size that is not whole words was copied
// past the words allocated for it.
TEST(Frame, MessageOfPartWordsIsRefused) {
  std::vector<std::byte> bytes(13, std::byte{0});
  EXPECT_THROW(decode_message(bytes.data(), bytes.size(), FrameLimits{}), troupe::DecodeError);
  // And no bytes at all (a null copy, found by the fuzzer under UBSan).
  EXPECT_THROW(decode_message(nullptr, 0, FrameLimits{}), troupe::DecodeError);
}

std::vector<std::byte> header(uint32_t magic, uint32_t size, uint32_t natt) {
  std::vector<std::byte> h(16);
  uint32_t v[4] = {magic, size, natt, 0};
  std::memcpy(h.data(), v, 16);
  return h;
}

TEST(Frame, HeadLimitsRefuseBigMessagesAndAttachments) {
  uint32_t msg = 0, natt = 0;
  EXPECT_NE(check_header(header(kFrameMagic, 64u << 20, 0).data(), kHeadFrameLimits, &msg, &natt), "");
  EXPECT_NE(check_header(header(kFrameMagic, 64, 4096).data(), kHeadFrameLimits, &msg, &natt), "");
  EXPECT_NE(check_sizes(64, {4ull << 30}, kHeadFrameLimits), "");
  EXPECT_EQ(check_header(header(kFrameMagic, 1u << 20, 1).data(), kHeadFrameLimits, &msg, &natt), "");
  EXPECT_EQ(check_sizes(64, {1u << 20}, kHeadFrameLimits), "");
}

// A reader that announces `expected` bytes and then receives them in reads
// of `step`: the buffer never holds much more than what arrived.
TEST(Incoming, ReadBufferGrowsWithArrivedBytesNotAnnouncedOnes) {
  const size_t chunk = 64 * 1024, expected = 64u << 20;
  size_t cap = grown_capacity(0, 0, 0, chunk);
  EXPECT_EQ(cap, chunk);
  size_t filled = kFrameHeaderBytes;
  cap = grown_capacity(cap, filled, expected, chunk);
  EXPECT_EQ(cap, chunk);  // the announcement alone commits nothing
  while (filled < expected) {
    cap = grown_capacity(cap, filled, expected, chunk);
    ASSERT_GT(cap, filled);
    ASSERT_LE(cap, std::max(expected, 2 * filled + chunk)) << "filled " << filled;
    ASSERT_LE(cap, 2 * filled + chunk) << "filled " << filled;
    filled = std::min(expected, cap);  // the read fills the room
  }
  EXPECT_GE(cap, expected);
  EXPECT_EQ(grown_capacity(cap, 0, 0, chunk), chunk);      // given back once empty
  EXPECT_EQ(grown_capacity(chunk, 100, 0, chunk), chunk);  // small frames never grow it
}

TEST(Incoming, AttachmentMemoryFollowsTheBytesThatArrive) {
  const size_t chunk = 64 * 1024;
  IncomingBlock block(4ull << 30);  // announced 4 GiB
  auto [p, room] = block.room(chunk);
  ASSERT_NE(p, nullptr);
  EXPECT_LE(block.capacity(), chunk);
  std::string sent;
  for (int i = 0; block.filled() < (3u << 20); ++i) {
    auto [dst, n] = block.room(chunk);
    ASSERT_GT(n, 0u);
    size_t k = std::min<size_t>(n, 10000);
    std::memset(dst, 'a' + i % 26, k);
    sent.append(k, static_cast<char>('a' + i % 26));
    block.commit(k);
    ASSERT_LE(block.capacity(), 2 * block.filled() + chunk);
  }
  EXPECT_FALSE(block.complete());
  // A block this large is a mapping of huge pages: the pages the kernel has
  // committed are those written, plus at most one huge page.
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::byte* base = block.room(chunk).first - block.filled();
  const size_t span = (block.capacity() + page - 1) / page * page;
  std::vector<unsigned char> resident(span / page);
  ASSERT_EQ(::mincore(base, span, resident.data()), 0) << std::strerror(errno);
  size_t committed = page * static_cast<size_t>(std::count_if(resident.begin(), resident.end(),
                                                              [](unsigned char r) { return (r & 1) != 0; }));
  EXPECT_GE(committed, block.filled());
  EXPECT_LE(committed, block.filled() + (2u << 20) + chunk);

  IncomingBlock small(sent.size());
  while (!small.complete()) {
    auto [dst, n] = small.room(chunk);
    size_t k = std::min(n, sent.size() - small.filled());
    std::memcpy(dst, sent.data() + small.filled(), k);
    small.commit(k);
  }
  EXPECT_EQ(small.capacity(), sent.size());
  troupe::Buffer b = small.take();
  EXPECT_EQ(b.to_string(), sent);

  IncomingBlock empty(0);
  EXPECT_TRUE(empty.complete());
  EXPECT_EQ(empty.take().size(), 0u);
}

// The mapping of a released large attachment is kept for the next one of
// about its size (no fresh pages to fault in and zero), never handed to a
// block announcing more than it holds or to one much smaller, and a kept
// block's bytes are the new attachment's.
TEST(Incoming, ReleasedMappingsServeTheNextLargeAttachment) {
  auto receive = [](size_t size, char fill) {
    IncomingBlock block(size);
    while (!block.complete()) {
      auto [dst, n] = block.room(64 * 1024);
      size_t k = std::min(n, block.size() - block.filled());
      std::memset(dst, fill, k);
      block.commit(k);
    }
    return block.take();
  };
  const size_t size = 16u << 20;
  troupe::Buffer first = receive(size, 'a');
  const std::byte* memory = first.data();
  first = troupe::Buffer();
  troupe::Buffer second = receive(size - 12345, 'b');
  EXPECT_EQ(second.data(), memory);
  EXPECT_EQ(second.size(), size - 12345);
  EXPECT_EQ(second.to_string(), std::string(size - 12345, 'b'));
  second = troupe::Buffer();
  // Announcing more than the kept mapping holds: not taken (the bytes that
  // arrive decide what is committed), nor by a block a quarter its size.
  IncomingBlock huge(4ull << 30);
  EXPECT_NE(huge.room(64 * 1024).first, memory);
  troupe::Buffer quarter = receive(size / 4 + 1, 'c');
  EXPECT_NE(quarter.data(), memory);
  quarter = troupe::Buffer();
  EXPECT_EQ(receive(size, 'd').data(), memory);
}

TEST(Handshake, ProofsBindTokenRoleAndNonces) {
  Nonce a = random_nonce(), b = random_nonce();
  EXPECT_NE(a, b);
  Proof p = make_proof("token", 'C', a, b);
  EXPECT_TRUE(proofs_equal(p, make_proof("token", 'C', a, b)));
  EXPECT_FALSE(proofs_equal(p, make_proof("other", 'C', a, b)));
  EXPECT_FALSE(proofs_equal(p, make_proof("token", 'S', a, b)));  // no reflection
  EXPECT_FALSE(proofs_equal(p, make_proof("token", 'C', b, a)));
  EXPECT_EQ(random_token().size(), 64u);
}

}  // namespace
