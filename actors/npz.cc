// NpyArray::open_npz: the arrays of a .npz archive, on npz_format.cc's
// reading of its zip directory.
#include "troupe/actors/npy.h"
#include "troupe/actors/npy_format.h"
#include "troupe/actors/npy_mapping.h"

namespace troupe::actors {

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
    // Deflated members are inflated into memory of their own.
    auto inflated = std::make_shared<Mapping>();
    inflated->owned = inflate_npz_member(base, m, path);
    inflated->base = inflated->owned.data();
    inflated->size = inflated->owned.size();
    const size_t size = inflated->size;
    out.emplace(m.key, from_image(label, std::move(inflated), 0, size, allow_unsigned));
  }
  return out;
}

}  // namespace troupe::actors
