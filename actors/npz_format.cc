// The zip container of NumPy's .npz archives (npy_format.h). Only what
// np.savez and np.savez_compressed write is read: stored or deflated
// members, zip64 records (NumPy forces them), no encryption, no spanning.
#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "troupe/actors/npy_format.h"
#include "troupe/runtime/core/errors.h"

namespace troupe::actors {

namespace {

constexpr uint64_t kMaxDeflateRatio = 1032;
constexpr uint32_t kEndOfCentralDir = 0x06054b50;
constexpr uint32_t kZip64Locator = 0x07064b50;
constexpr uint32_t kZip64EndOfCentralDir = 0x06064b50;
constexpr uint32_t kCentralHeader = 0x02014b50;
constexpr uint32_t kLocalHeader = 0x04034b50;

[[noreturn]] void fail(const std::string& path, const std::string& problem) {
  throw Error("npz file '" + path + "': " + problem);
}

// Bounds-checked little-endian reads from the mapped archive.
class ZipReader {
 public:
  ZipReader(const std::byte* base, size_t size, const std::string& path) : base_(base), size_(size), path_(path) {}

  template <class T>
  T read(uint64_t at) const {
    need(at, sizeof(T));
    T v;
    std::memcpy(&v, base_ + at, sizeof(T));
    return v;
  }
  void need(uint64_t at, uint64_t bytes) const {
    if (at > size_ || bytes > size_ - at) fail(path_, "corrupt archive: a record runs past the end of the file");
  }
  std::string string(uint64_t at, uint64_t bytes) const {
    need(at, bytes);
    return std::string(reinterpret_cast<const char*>(base_ + at), bytes);
  }
  size_t size() const { return size_; }
  const std::byte* at(uint64_t offset) const { return base_ + offset; }

 private:
  const std::byte* base_;
  size_t size_;
  const std::string& path_;
};

struct Directory {
  uint64_t entries = 0;
  uint64_t offset = 0;
};

Directory find_directory(const ZipReader& z, const std::string& path) {
  if (z.size() < 22) fail(path, "not a zip archive (too short)");
  // The end record sits within the last 22 + 65535 (comment) bytes.
  uint64_t lowest = z.size() > 22 + 0xFFFF ? z.size() - 22 - 0xFFFF : 0;
  for (uint64_t at = z.size() - 22 + 1; at-- > lowest;) {
    if (z.read<uint32_t>(at) != kEndOfCentralDir) continue;
    Directory d{z.read<uint16_t>(at + 10), z.read<uint32_t>(at + 16)};
    if (at >= 20 && z.read<uint32_t>(at - 20) == kZip64Locator) {
      uint64_t end64 = z.read<uint64_t>(at - 20 + 8);
      if (z.read<uint32_t>(end64) != kZip64EndOfCentralDir) fail(path, "corrupt zip64 end record");
      d.entries = z.read<uint64_t>(end64 + 32);
      d.offset = z.read<uint64_t>(end64 + 48);
    }
    return d;
  }
  fail(path, "not a zip archive (no end of central directory record)");
}

struct Member {
  std::string name;
  uint16_t method = 0;
  uint16_t flags = 0;
  uint64_t compressed = 0;
  uint64_t uncompressed = 0;
  uint64_t local_offset = 0;
  uint32_t crc32 = 0;
};

// Replaces the 0xFFFFFFFF fields of `m` from the zip64 extra field (id 1),
// which lists them in this order.
void apply_zip64(const ZipReader& z, uint64_t extra, uint64_t extra_len, Member& m, bool big_u, bool big_c,
                 bool big_o) {
  for (uint64_t p = extra; p + 4 <= extra + extra_len;) {
    uint16_t id = z.read<uint16_t>(p);
    uint16_t len = z.read<uint16_t>(p + 2);
    if (id == 1) {
      uint64_t q = p + 4;
      if (big_u) m.uncompressed = z.read<uint64_t>(q), q += 8;
      if (big_c) m.compressed = z.read<uint64_t>(q), q += 8;
      if (big_o) m.local_offset = z.read<uint64_t>(q);
      return;
    }
    p += 4 + uint64_t(len);
  }
}

// The central directory entry at `at`; advances `at` past it.
Member read_member(const ZipReader& z, uint64_t& at, const std::string& path) {
  if (z.read<uint32_t>(at) != kCentralHeader) fail(path, "corrupt central directory");
  Member m;
  m.flags = z.read<uint16_t>(at + 8);
  m.method = z.read<uint16_t>(at + 10);
  m.crc32 = z.read<uint32_t>(at + 16);
  m.compressed = z.read<uint32_t>(at + 20);
  m.uncompressed = z.read<uint32_t>(at + 24);
  const uint64_t name_len = z.read<uint16_t>(at + 28), extra_len = z.read<uint16_t>(at + 30),
                 comment_len = z.read<uint16_t>(at + 32);
  m.local_offset = z.read<uint32_t>(at + 42);
  m.name = z.string(at + 46, name_len);
  constexpr uint64_t kBig = 0xFFFFFFFF;
  apply_zip64(z, at + 46 + name_len, extra_len, m, m.uncompressed == kBig, m.compressed == kBig,
              m.local_offset == kBig);
  at += 46 + name_len + extra_len + comment_len;
  return m;
}

// Offset of the member's data: past its local header.
uint64_t member_data(const ZipReader& z, const Member& m, const std::string& path) {
  if (z.read<uint32_t>(m.local_offset) != kLocalHeader) fail(path, "member '" + m.name + "': corrupt local header");
  uint64_t start = m.local_offset + 30 + z.read<uint16_t>(m.local_offset + 26) + z.read<uint16_t>(m.local_offset + 28);
  z.need(start, m.compressed);
  return start;
}

}  // namespace

namespace {

// Inflates m's first `want` bytes (all of it when want == m.uncompressed,
// which must then end the stream exactly).
std::vector<std::byte> inflate_npz(const std::byte* archive, const NpzMember& m, const std::string& path,
                                   uint64_t want) {
  if (m.uncompressed > (uint64_t(1) << 40)) fail(path, "member '" + m.name + "' is too large to inflate");
  // Deflate expands at most 1032-fold: a larger claim is a corrupt (or
  // hostile) directory, refused before the memory is taken.
  if (m.uncompressed / kMaxDeflateRatio > m.compressed + 1)
    fail(path, "member '" + m.name + "' claims " + std::to_string(m.uncompressed) + " bytes inflated from " +
                   std::to_string(m.compressed) + ", more than deflate can produce");
  const bool whole = want == m.uncompressed;
  const std::byte* data = archive + m.data_offset;
  std::vector<std::byte> out(want);
  z_stream s{};
  if (inflateInit2(&s, -MAX_WBITS) != Z_OK) fail(path, "zlib could not start");
  s.next_in = reinterpret_cast<Bytef*>(const_cast<std::byte*>(data));
  s.next_out = reinterpret_cast<Bytef*>(out.data());
  uint64_t in_left = m.compressed, out_left = want;
  int rc = Z_OK;
  // zlib counts in uInt: feed and drain in chunks for members over 4 GiB.
  // A prefix is done once its bytes are out.
  while (rc == Z_OK && (whole || out_left > 0)) {
    const uInt chunk = std::numeric_limits<uInt>::max();
    s.avail_in = in_left > chunk ? chunk : static_cast<uInt>(in_left);
    s.avail_out = out_left > chunk ? chunk : static_cast<uInt>(out_left);
    const uInt in0 = s.avail_in, out0 = s.avail_out;
    rc = inflate(&s, Z_NO_FLUSH);
    in_left -= in0 - s.avail_in;
    out_left -= out0 - s.avail_out;
    if (rc == Z_OK && in0 == s.avail_in && out0 == s.avail_out) rc = Z_BUF_ERROR;
  }
  inflateEnd(&s);
  if (out_left != 0 || (whole && rc != Z_STREAM_END) || (!whole && rc != Z_OK && rc != Z_STREAM_END))
    fail(path, "member '" + m.name + "': corrupt deflate data");
  if (whole) {
    // A deflate stream can decode cleanly to the wrong bytes: the zip's
    // CRC-32 says whether these are the ones written.
    uLong crc = crc32(0L, Z_NULL, 0);
    for (uint64_t done = 0; done < out.size();) {
      const uInt chunk = static_cast<uInt>(std::min<uint64_t>(out.size() - done, std::numeric_limits<uInt>::max()));
      crc = crc32(crc, reinterpret_cast<const Bytef*>(out.data() + done), chunk);
      done += chunk;
    }
    if (static_cast<uint32_t>(crc) != m.crc32)
      fail(path, "member '" + m.name + "': its bytes do not match the archive's CRC-32 (corrupt data)");
  }
  return out;
}

}  // namespace

std::vector<std::byte> inflate_npz_member(const std::byte* archive, const NpzMember& m, const std::string& path) {
  return inflate_npz(archive, m, path, m.uncompressed);
}

std::vector<std::byte> inflate_npz_prefix(const std::byte* archive, const NpzMember& m, const std::string& path,
                                          uint64_t bytes) {
  return inflate_npz(archive, m, path, std::min(bytes, m.uncompressed));
}

std::vector<NpzMember> read_npz_directory(const std::byte* base, size_t size, const std::string& path) {
  ZipReader z(base, size, path);
  Directory dir = find_directory(z, path);
  std::vector<NpzMember> out;
  uint64_t at = dir.offset;
  for (uint64_t i = 0; i < dir.entries; ++i) {
    Member m = read_member(z, at, path);
    if (m.name.size() < 5 || m.name.compare(m.name.size() - 4, 4, ".npy") != 0)
      fail(path, "member '" + m.name + "' is not a .npy array");
    if (m.flags & 1) fail(path, "member '" + m.name + "' is encrypted");
    if (m.method != 0 && m.method != 8)
      fail(path, "member '" + m.name + "' uses compression method " + std::to_string(m.method) +
                     " (only stored and deflated members are read)");
    NpzMember n;
    n.key = m.name.substr(0, m.name.size() - 4);
    n.name = std::move(m.name);
    n.deflated = m.method == 8;
    n.data_offset = member_data(z, m, path);
    n.compressed = m.compressed;
    n.uncompressed = n.deflated ? m.uncompressed : m.compressed;
    n.crc32 = m.crc32;
    out.push_back(std::move(n));
  }
  if (out.empty()) fail(path, "holds no arrays");
  return out;
}

}  // namespace troupe::actors
