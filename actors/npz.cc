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

// Whether the .npy header of a member that starts with `head` reaches past
// it: only then can the whole member say more of it than `head` did.
bool header_reaches_past(const std::vector<std::byte>& head) {
  const auto* p = reinterpret_cast<const unsigned char*>(head.data());
  if (head.size() < 12) return false;
  if (p[6] == 1) return 10 + (size_t(p[8]) | size_t(p[9]) << 8) > head.size();
  if (p[6] == 2 || p[6] == 3)
    return 12 + (size_t(p[8]) | size_t(p[9]) << 8 | size_t(p[10]) << 16 | size_t(p[11]) << 24) > head.size();
  return false;
}
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
        // The archive stays mapped until its member is read: one written
        // in place meanwhile is said so (it read as a CRC error, or faulted
        // past a shorter end), as for the other .npy data.
        archive->check_unchanged();
        return inflate_npz_member(static_cast<const std::byte*>(archive->base), m, path);
      };
      try {
        out.emplace(m.key, from_header(label, head.data(), head.size(), inflated->size, inflated, allow_unsigned));
        continue;
      } catch (const Error&) {
        // A refused header (fortran order, a dtype not read, more data than
        // the member holds) is refused now: going on inflated the whole
        // member (4 GB of a 4 MB file of zeros) to say the same. One longer
        // than kHeaderBytes is read from the whole member below.
        if (!header_reaches_past(head)) throw;
      }
    }
    const size_t size = inflated->size;
    out.emplace(m.key, from_image(label, std::move(inflated), 0, size, allow_unsigned));
  }
  return out;
}

}  // namespace troupe::actors
