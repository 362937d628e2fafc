#include <gtest/gtest.h>

#include <cstring>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/wire/auth.h"
#include "troupe/runtime/wire/frame.h"

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
