// What the file-format fuzz targets (file_format_targets.cc) hold the
// readers to, asserted on inputs made on purpose: a checkpoint manifest
// that names files outside its directory or out-of-range numbers is
// refused with the problem named, and a .npz member that claims more than
// deflate can produce is refused before its memory is taken.
#include <gtest/gtest.h>

#include "tests/fuzz/targets.h"
#include "tests/support/error_text.h"
#include "troupe/actors/npy_format.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/trainer/checkpoint_manifest.h"

using troupe::test::error_of;
using troupe::trainer::parse_manifest;

namespace {

std::string manifest_with(const std::string& replace, const std::string& with) {
  std::string text = troupe::fuzz::seeds("manifest").at(0);
  const size_t at = text.find(replace);
  EXPECT_NE(at, std::string::npos) << replace;
  return text.replace(at, replace.size(), with);
}

}  // namespace

TEST(CheckpointManifest, WrittenTextReadsBackAsItself) {
  auto m = parse_manifest(troupe::fuzz::seeds("manifest").at(0), "m.json");
  EXPECT_EQ(m.step, 120);
  EXPECT_EQ(m.world_size, 2);
  EXPECT_EQ(m.cursor.segment_start, 64);
  EXPECT_EQ(m.metrics.at("loss"), 0.25);
  EXPECT_EQ(m.epoch_sums.at("loss_sum"), 12.5);
  EXPECT_EQ(m.epoch_sums.at("samples"), 64);
  // Older manifests have no epoch sums; a value that is no number is left out.
  EXPECT_TRUE(parse_manifest(manifest_with("\"epoch_sums\"", "\"unknown\""), "m.json").epoch_sums.empty());
  EXPECT_EQ(parse_manifest(manifest_with("12.5", "\"x\""), "m.json").epoch_sums.count("loss_sum"), 0u);
  EXPECT_EQ(m.files.at("model.pt").bytes, 1024u);
}

TEST(CheckpointManifest, FileNamesOutsideTheDirectoryAreRefused) {
  for (const std::string name : {"../model.pt", "/etc/passwd", "..", "a/b"}) {
    std::string e = error_of([&] { parse_manifest(manifest_with("\"model.pt\"", "\"" + name + "\""), "m.json"); });
    EXPECT_NE(e.find("m.json"), std::string::npos) << e;
    EXPECT_NE(e.find("not a plain file name"), std::string::npos) << name << ": " << e;
  }
}

TEST(CheckpointManifest, BadFieldsAreNamed) {
  EXPECT_NE(error_of([&] { parse_manifest(manifest_with("\"step\": 120", "\"step\": -1"), "m.json"); }).find("'step'"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              parse_manifest(manifest_with("\"world_size\": 2", "\"world_size\": \"2\""), "m.json");
            }).find("'world_size' is not an integer"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_manifest("[1, 2]", "m.json"); }).find("not an object"), std::string::npos);
  EXPECT_NE(error_of([&] { parse_manifest("{\"format\": 3}", "m.json"); }).find("unknown format"), std::string::npos);
  EXPECT_NE(error_of([&] { parse_manifest("{", "m.json"); }).find("not valid JSON"), std::string::npos);
  EXPECT_NE(error_of([&] { parse_manifest(manifest_with(std::string(64, 'a'), "xyz"), "m.json"); }).find("sha256"),
            std::string::npos);
}

TEST(NpzFormat, MemberClaimingMoreThanDeflateCanGiveIsRefused) {
  const std::byte archive[16] = {};
  troupe::actors::NpzMember m;
  m.name = "x.npy";
  m.deflated = true;
  m.compressed = 16;
  m.uncompressed = uint64_t(1) << 36;  // 64 GiB from 16 bytes
  const std::string e = error_of([&] { troupe::actors::inflate_npz_member(archive, m, "a.npz"); });
  EXPECT_NE(e.find("more than deflate can produce"), std::string::npos) << e;
}

TEST(NpyFormat, TruncatedDataNamesShapeAndSizes) {
  const std::string image = troupe::fuzz::seeds("npy").at(0).substr(1);  // (3, 4) float32
  const auto* p = reinterpret_cast<const std::byte*>(image.data());
  const auto f = troupe::actors::parse_npy_format(p, image.size(), "x.npy");
  EXPECT_EQ(troupe::actors::npy_data_bytes(f, image.size(), "x.npy"), 48u);
  const std::string e = error_of([&] { troupe::actors::npy_data_bytes(f, image.size() - 1, "x.npy"); });
  EXPECT_NE(e.find("shape (3, 4) of '<f4' needs 48 data bytes, file has 47"), std::string::npos) << e;
}
