// Fuzz targets for the files users and earlier runs bring: .npy images,
// .npz archives and checkpoint manifests. Refusing bad bytes with a
// troupe::Error is the expected answer; anything else (a crash, a sanitizer
// report, an allocation the file did not pay for, a manifest that does not
// read back as itself) is a finding.
#include <cstdlib>
#include <string_view>

#include "tests/fuzz/targets.h"
#include "troupe/actors/npy_format.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/trainer/checkpoint_manifest.h"

namespace troupe::fuzz {

namespace {

// What a data set does with an image: the header, then the data's size.
void read_npy_image(const std::byte* image, size_t size, const std::string& label) {
  const actors::NpyFormat f = actors::parse_npy_format(image, size, label);
  (void)actors::npy_data_bytes(f, size, label);
}

void read_npz_archive(const std::byte* base, size_t size) {
  for (const auto& m : actors::read_npz_directory(base, size, "fuzz.npz")) {
    const std::string label = "fuzz.npz:" + m.name;
    try {
      if (!m.deflated) {
        read_npy_image(base + m.data_offset, m.compressed, label);
        continue;
      }
      try {
        // What open_npz reads first: the header, from a prefix.
        const auto head = actors::inflate_npz_prefix(base, m, "fuzz.npz", 64 * 1024);
        (void)actors::parse_npy_format(head.data(), head.size(), label);
      } catch (const troupe::Error&) {
        // The whole member is still read below.
      }
      const auto inflated = actors::inflate_npz_member(base, m, "fuzz.npz");
      read_npy_image(inflated.data(), inflated.size(), label);
    } catch (const troupe::Error&) {
      // One bad member; the others are still read (an archive is refused
      // as a whole by the loader, but each member's bytes get fuzzed).
    }
  }
}

}  // namespace

int npy_target(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const auto* bytes = reinterpret_cast<const std::byte*>(data + 1);
  try {
    if (data[0] & 1)
      read_npz_archive(bytes, size - 1);
    else
      read_npy_image(bytes, size - 1, "fuzz.npy");
  } catch (const troupe::Error&) {
  }
  return 0;
}

int manifest_target(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  trainer::CheckpointManifest m;
  try {
    m = trainer::parse_manifest(text, "fuzz/manifest.json");
  } catch (const troupe::Error&) {
    return 0;
  }
  // What was accepted writes and reads back as itself.
  const std::string again = trainer::manifest_text(m);
  const trainer::CheckpointManifest m2 = trainer::parse_manifest(again, "fuzz/manifest.json (rewritten)");
  if (trainer::manifest_text(m2) != again) std::abort();
  return 0;
}

}  // namespace troupe::fuzz
