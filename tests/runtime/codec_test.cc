#include <gtest/gtest.h>

#include "troupe/runtime/wire/codec.h"

namespace {

using namespace troupe::wire;

struct Point {
  int x = 0;
  double y = 0;
  std::string label;
  std::vector<int64_t> tags;
  std::optional<std::map<std::string, float>> extra;
  TROUPE_FIELDS(x, y, label, tags, extra)
  bool operator==(const Point&) const = default;
};

struct Outer {
  std::vector<Point> points;
  std::pair<int, std::string> head;
  std::tuple<uint8_t, int16_t, bool> small;
  TROUPE_FIELDS(points, head, small)
  bool operator==(const Outer&) const = default;
};

template <class T>
T round_trip(const T& v) {
  Encoder e = encode_value(v);
  return decode_value<T>(e.bytes().data(), e.bytes().size(), &e.attachments());
}

TEST(Codec, Arithmetic) {
  EXPECT_EQ(round_trip(42), 42);
  EXPECT_EQ(round_trip(int64_t{-1} << 62), int64_t{-1} << 62);
  EXPECT_EQ(round_trip(3.25), 3.25);
  EXPECT_EQ(round_trip(true), true);
  EXPECT_EQ(round_trip(uint8_t{255}), 255);
}

TEST(Codec, StringsAndContainers) {
  EXPECT_EQ(round_trip(std::string()), "");
  EXPECT_EQ(round_trip(std::string("hello")), "hello");
  std::string big(5 << 20, 'x');
  big[12345] = 'y';
  EXPECT_EQ(round_trip(big), big);
  EXPECT_EQ(round_trip(std::vector<int>{}), std::vector<int>{});
  std::vector<std::string> vs{"a", "", "ccc"};
  EXPECT_EQ(round_trip(vs), vs);
  std::map<std::string, std::vector<double>> m{{"a", {1, 2}}, {"b", {}}};
  EXPECT_EQ(round_trip(m), m);
  std::optional<int> none;
  EXPECT_EQ(round_trip(none), none);
  EXPECT_EQ(round_trip(std::optional<int>(7)), std::optional<int>(7));
}

TEST(Codec, StructsWithFields) {
  Point p{3, -1.5, "p", {1, 2, 3}, std::map<std::string, float>{{"w", 0.5f}}};
  EXPECT_EQ(round_trip(p), p);
  Outer o{{p, Point{}}, {9, "nine"}, {1, -2, true}};
  EXPECT_EQ(round_trip(o), o);
  EXPECT_EQ(round_trip(Outer{}), Outer{});
}

TEST(Codec, LargeBuffersBecomeAttachments) {
  std::vector<std::byte> bytes(1 << 20);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = std::byte(i * 7);
  troupe::Buffer b = troupe::Buffer::from_vector(bytes);
  Encoder e = encode_value(b);
  ASSERT_EQ(e.attachments().size(), 1u);
  EXPECT_LT(e.bytes().size(), 64u);                // only the index is inline
  EXPECT_EQ(e.attachments()[0].data(), b.data());  // no copy on the way out
  auto back = decode_value<troupe::Buffer>(e.bytes().data(), e.bytes().size(), &e.attachments());
  ASSERT_EQ(back.size(), bytes.size());
  EXPECT_EQ(std::memcmp(back.data(), bytes.data(), bytes.size()), 0);
  // Small buffers stay inline.
  Encoder small = encode_value(troupe::Buffer::from_string("abc"));
  EXPECT_TRUE(small.attachments().empty());
  // encode_inline (messages that travel as a body alone) keeps large ones
  // inline too, so nothing is lost with the attachments.
  const std::string whole = troupe::wire::encode_inline(std::vector<troupe::Buffer>{b, b});
  EXPECT_GT(whole.size(), 2 * bytes.size());
  auto both = decode_value<std::vector<troupe::Buffer>>(whole.data(), whole.size());
  ASSERT_EQ(both.size(), 2u);
  ASSERT_EQ(both[1].size(), bytes.size());
  EXPECT_EQ(std::memcmp(both[1].data(), bytes.data(), bytes.size()), 0);
}

// Found by the codec fuzz target: a byte other than 0 or 1 was loaded as a
// bool (undefined behaviour).
TEST(Codec, BoolsAreZeroOrOne) {
  EXPECT_TRUE(decode_value<bool>(encode_value(true).bytes()));
  EXPECT_FALSE(decode_value<bool>(encode_value(false).bytes()));
  EXPECT_THROW(decode_value<bool>(std::string(1, '\x04')), troupe::DecodeError);
}

TEST(Codec, TruncatedInputThrows) {
  Point p{3, -1.5, "label", {1, 2, 3}, std::nullopt};
  Encoder e = encode_value(p);
  for (size_t cut = 0; cut < e.bytes().size(); ++cut)
    EXPECT_THROW(decode_value<Point>(e.bytes().data(), cut), troupe::DecodeError) << "cut at " << cut;
}

TEST(Codec, ForgedLengthsThrowWithoutHugeAllocation) {
  Encoder e;
  e.write_size(uint64_t(1) << 40);  // a vector claiming 2^40 elements
  EXPECT_THROW(decode_value<std::vector<int>>(e.bytes().data(), e.bytes().size()), troupe::DecodeError);
  Encoder e2;
  e2.write_size(1000000);  // strings claiming a million elements, none there
  EXPECT_THROW(decode_value<std::vector<std::string>>(e2.bytes().data(), e2.bytes().size()), troupe::DecodeError);
  Encoder e3;
  e3.write_pod<uint8_t>(1);
  e3.write_pod<uint64_t>(5);  // attachment 5 of none
  EXPECT_THROW(decode_value<troupe::Buffer>(e3.bytes().data(), e3.bytes().size()), troupe::DecodeError);
}

TEST(Codec, TrailingBytesAreAnError) {
  Encoder e = encode_value(std::make_tuple(1, 2));
  EXPECT_THROW(decode_value<int>(e.bytes().data(), e.bytes().size()), troupe::DecodeError);
  // Named as written in C++ (a corrupt state-db row read
  // "N6troupe4head12_GLOBAL__N_18ActorRowE").
  Encoder two = encode_value(std::make_tuple(Point{}, 7));
  try {
    decode_value<Point>(two.bytes().data(), two.bytes().size());
    ADD_FAILURE() << "no error";
  } catch (const troupe::DecodeError& x) {
    EXPECT_NE(std::string(x.what()).find("trailing bytes after decoding a (anonymous namespace)::Point"),
              std::string::npos)
        << x.what();
  }
}

}  // namespace
