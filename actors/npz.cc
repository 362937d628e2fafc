// NpyArray::open_npz: the arrays of a .npz archive, on npz_format.cc's
// reading of its zip directory.
#include "troupe/actors/npy.h"
#include "troupe/actors/npy_format.h"
#include "troupe/actors/npy_mapping.h"
#include "troupe/runtime/core/errors.h"

namespace troupe::actors {

namespace {
// What is inflated of a deflated member to read its .npy header: NumPy's
// headers are a few hundred bytes.
constexpr uint64_t kHeaderBytes = 64 * 1024;
}  // namespace

std::map<std::string, NpyArray> NpyArray::open_npz(const std::string& path, bool allow_unsigned) {
  auto archive = Mapping::map(path, "npz file");
  const auto* base = static_cast<const std::byte*>(archive->base);
  std::map<std::string, NpyArray> out;
  for (const NpzMember& m : read_npz_directory(base, archive->size, path)) {
    const std::string label = path + ":" + m.name;
    if (!m.deflated) {
      out.emplace(m.key, from_image(label, archive, m.data_offset, m.compressed, allow_unsigned));
      continue;
    }
    // A deflated member is inflated into memory of its own when its data is
    // first read; its header now, from the first bytes of the stream.
    auto inflated = std::make_shared<Mapping>();
    inflated->size = static_cast<size_t>(m.uncompressed);
    auto head = inflate_npz_prefix(base, m, path, kHeaderBytes);
    if (head.size() == m.uncompressed) {
      // A small member: the prefix is all of it.
      inflated->owned = std::move(head);
      inflated->base = inflated->owned.data();
    } else {
      inflated->lazy = true;
      inflated->fill = [archive, m, path] {
        return inflate_npz_member(static_cast<const std::byte*>(archive->base), m, path);
      };
      try {
        out.emplace(m.key, from_header(label, head.data(), head.size(), inflated->size, inflated, allow_unsigned));
        continue;
      } catch (const Error&) {
        // A header longer than kHeaderBytes (or a bad one): read it from
        // the whole member below, which names the problem.
      }
    }
    const size_t size = inflated->size;
    out.emplace(m.key, from_image(label, std::move(inflated), 0, size, allow_unsigned));
  }
  return out;
}

}  // namespace troupe::actors
