// The bytes of NumPy's .npy and .npz files, read without LibTorch: the .npy
// header (magic, version, the dict literal) and the .npz zip directory.
// npy.h builds its memory-mapped arrays and tensors on these; they stand
// apart so that the fuzz lane (clang, no LibTorch) exercises exactly the
// parsers the data sets use on files users bring. Every offset and size read
// from a file is checked before use: bad bytes are a troupe::Error naming the
// file and the problem, never a read out of bounds or an unbounded
// allocation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace troupe::actors {

// A .npy header as written: the dtype as NumPy's kind and item size, the
// shape, where the data starts. Byte order and C order are checked here
// (little-endian or single-byte, C order only); which kinds a reader takes
// is its own business.
struct NpyFormat {
  char kind = 'f';    // NumPy's dtype kind: 'b', 'i', 'u', 'f', 'c', ...
  int item_size = 4;  // bytes per element
  std::string descr;  // as in the file, e.g. "<f4", for messages
  std::vector<int64_t> shape;
  int major_version = 1;
  size_t data_offset = 0;  // bytes from the image start to the array data
};

// Parses the header at the start of `bytes` (the first `size` bytes of the
// image). `path` only names the file in error messages.
NpyFormat parse_npy_format(const void* bytes, size_t size, const std::string& path);

// The product of `shape`; an Error when the data could not be addressed
// (the element count times 16 bytes would overflow).
uint64_t npy_element_count(const std::vector<int64_t>& shape, const std::string& path);

// The data bytes the header asks for; an Error naming the shape and dtype
// when the `image_size` bytes of the image hold fewer.
uint64_t npy_data_bytes(const NpyFormat& f, size_t image_size, const std::string& path);

// Throws the reader's error: "npy file '<path>': <problem>".
[[noreturn]] void npy_fail(const std::string& path, const std::string& problem);

// One array of a .npz archive, as its central directory describes it.
struct NpzMember {
  std::string name;  // "x.npy"
  std::string key;   // "x"
  bool deflated = false;
  uint64_t data_offset = 0;  // of its (compressed) bytes in the archive
  uint64_t compressed = 0;
  uint64_t uncompressed = 0;
  uint32_t crc32 = 0;  // of the uncompressed bytes, as the directory says
};

// The members of the archive at base[0, size): only what np.savez and
// np.savez_compressed write (stored or deflated .npy members, zip64
// records, no encryption). Each member's bytes lie inside the archive.
std::vector<NpzMember> read_npz_directory(const std::byte* base, size_t size, const std::string& path);

// A deflated member's bytes, inflated. Its uncompressed size is checked
// against what deflate can produce from its compressed size before any
// memory is taken.
std::vector<std::byte> inflate_npz_member(const std::byte* archive, const NpzMember& m, const std::string& path);
// The first min(bytes, m.uncompressed) bytes of a deflated member, inflated
// (enough for its .npy header without inflating the array). The same checks
// as inflate_npz_member; a stream that ends early is corrupt.
std::vector<std::byte> inflate_npz_prefix(const std::byte* archive, const NpzMember& m, const std::string& path,
                                          uint64_t bytes);

}  // namespace troupe::actors
