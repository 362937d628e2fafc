// NumPy .npy files (and .npz archives of them): reading them memory-mapped,
// and writing them. Training
// sets exported from Python (`np.save`) load without a copy of the file in
// memory; the mapping is shared by every tensor view of it, so pages are read
// on demand and dropped by the kernel under pressure.
//
// Supported: format versions 1.0, 2.0 and 3.0; little-endian (or
// single-byte) bool, int8/16/32/64, uint8, float16/32/64; C order.
// Everything else (Fortran order, big-endian, structured or object dtypes,
// unsigned types LibTorch lacks, truncated files) is a troupe::Error whose
// message names the file and the problem.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "troupe/actors/dataset.h"

namespace troupe::actors {

// A parsed .npy header.
struct NpyHeader {
  torch::ScalarType dtype = torch::kFloat;
  std::vector<int64_t> shape;
  int major_version = 1;
  size_t data_offset = 0;  // bytes from the file start to the array data
  // The file holds unsigned integers (uint16/32/64, which LibTorch lacks)
  // and dtype is the signed type of the same width: the tensor's bits are
  // the unsigned values'. Only when the reader allowed it (allow_unsigned).
  bool unsigned_ints = false;
};

// Parses the header at the start of `bytes` (the file's first `size` bytes,
// or all of it). `path` only names the file in error messages. Unsigned
// dtypes other than uint8 are an error unless `allow_unsigned`.
NpyHeader parse_npy_header(const void* bytes, size_t size, const std::string& path, bool allow_unsigned = false);

class NpyArray;

// Runs `read`, which reads mapped bytes of `files`. A SIGBUS while it runs
// (a file cut short under its mapping: np.save truncates a file and then
// writes it again) ends it with the ConfigError of the file that changed,
// instead of killing the process: the 100 ms between check_unchanged()'s
// looks left a loader reading rows a window in which to die, and its
// replacement read the new file's data unsaid. A SIGBUS elsewhere is as
// fatal as before.
// `files` are `count` arrays side by side (one, or a vector's data());
// only a fault reads them. Nothing is allocated per read: it runs for
// every row a loader loads.
template <class Read>
void read_mapped(const NpyArray* files, size_t count, Read&& read);

// A read-only memory-mapped .npy array. A cheap handle: copies share the
// mapping, and tensor views returned by tensor() keep it alive on their own.
class NpyArray {
 public:
  // Maps `path`; throws troupe::Error naming the file when it is missing,
  // unreadable, truncated, or in an unsupported layout.
  static NpyArray open(const std::string& path, bool allow_unsigned = false);
  // A headerless file of `dtype` elements as a 1-d array (a raw token
  // stream, e.g. nanoGPT's uint16 train.bin: dtype kShort, unsigned_ints).
  static NpyArray open_raw(const std::string& path, torch::ScalarType dtype, bool unsigned_ints);
  // The arrays of a .npz archive (np.savez, stored, or np.savez_compressed,
  // deflated) by key: the member's name without ".npy". Stored members are
  // views of the mapped archive; deflated ones are inflated into memory.
  // Throws troupe::Error naming the archive (and member) when it is not a
  // zip, uses an unsupported compression, or holds something else than .npy.
  static std::map<std::string, NpyArray> open_npz(const std::string& path, bool allow_unsigned = false);

  const std::string& path() const { return path_; }
  torch::ScalarType dtype() const { return header_.dtype; }
  bool unsigned_ints() const { return header_.unsigned_ints; }
  const std::vector<int64_t>& shape() const { return header_.shape; }
  // shape[0], or 1 for a 0-d array.
  int64_t rows() const;
  const std::byte* data() const;
  size_t nbytes() const;

  // A zero-copy view of the whole array. The memory is mapped read-only:
  // writing into the view faults, so clone() before modifying.
  torch::Tensor tensor() const;
  // A copy of row `i` (shape[1:]), independent of the mapping. Throws
  // ConfigError, naming the file, once the file was written in place since
  // it was opened (checked at most every 100 ms: check_unchanged()).
  torch::Tensor row(int64_t i) const;
  // Throws ConfigError naming the file when it was written in place (same
  // inode, another size or modification time) since it was mapped; at
  // most one look every 100 ms. A file renamed over it changes nothing.
  void check_unchanged() const;
  // The same look now, whenever the last one was.
  void check_unchanged_now() const;

 private:
  struct Mapping;
  NpyArray(std::string path, NpyHeader header, std::shared_ptr<const Mapping> mapping)
      : path_(std::move(path)), header_(std::move(header)), mapping_(std::move(mapping)) {}
  static std::shared_ptr<Mapping> map_file(const std::string& path);
  // The .npy image at mapping[offset, offset + size).
  static NpyArray from_image(const std::string& path, std::shared_ptr<const Mapping> mapping, size_t offset,
                             size_t size, bool allow_unsigned);
  // An image of `size` bytes of which only the first `head_size` (`head`,
  // holding at least the .npy header) are at hand; its bytes come from
  // `mapping` when first read (a lazily inflated .npz member).
  static NpyArray from_header(const std::string& path, const std::byte* head, size_t head_size, size_t size,
                              std::shared_ptr<const Mapping> mapping, bool allow_unsigned);

  std::string path_;
  NpyHeader header_;
  std::shared_ptr<const Mapping> mapping_;
};

// Writes `t` as a version 1.0 .npy file in C order (non-contiguous tensors
// are made contiguous first). Throws troupe::Error naming the file on I/O
// failure or for a dtype NumPy cannot read back the same way.
void write_npy(const std::string& path, const torch::Tensor& t);

// Throws ConfigError, naming `what` and each array's shape, when the
// arrays have rows but not one byte among them: a header such as
// (2**40, 0) claims rows no file backs, and a sampler's order of them
// would not fit in memory. A data set whose rows are samples calls it.
void require_data_in_rows(const std::vector<const NpyArray*>& arrays, const std::string& what);

// Rows of one .npy file as inputs and, optionally, rows of another as
// targets (the same number of rows). Samples are copies of the rows.
class NpyDataset final : public Dataset {
 public:
  explicit NpyDataset(const std::string& inputs_path, const std::string& targets_path = "");
  int64_t size() const override { return inputs_.rows(); }
  std::string describe() const override;

 protected:
  Sample load(int64_t index, int64_t epoch) const override;

 private:
  NpyArray inputs_;
  std::unique_ptr<NpyArray> targets_;
};

namespace detail {
void read_mapped(const NpyArray* files, size_t count, void (*read)(void*), void* context);
}  // namespace detail

template <class Read>
void read_mapped(const NpyArray* files, size_t count, Read&& read) {
  using R = std::remove_reference_t<Read>;
  detail::read_mapped(
      files, count, [](void* context) { (*static_cast<R*>(context))(); },
      const_cast<void*>(static_cast<const void*>(&read)));
}

}  // namespace troupe::actors
