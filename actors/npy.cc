#include "troupe/actors/npy.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <vector>

#include "troupe/actors/npy_mapping.h"
#include "troupe/runtime/core/check.h"
#include "troupe/runtime/core/errors.h"

namespace troupe::actors {

namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the .npy reader assumes a little-endian host");

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicSize = 6;

[[noreturn]] void fail(const std::string& path, const std::string& problem) {
  throw Error("npy file '" + path + "': " + problem);
}

struct DtypeInfo {
  char kind;
  int size;
  torch::ScalarType type;
  const char* name;
};

constexpr DtypeInfo kDtypes[] = {
    {'b', 1, torch::kBool, "bool"},
    {'i', 1, torch::kChar, "int8"},
    {'u', 1, torch::kByte, "uint8"},
    {'i', 2, torch::kShort, "int16"},
    {'i', 4, torch::kInt, "int32"},
    {'i', 8, torch::kLong, "int64"},
    {'f', 2, torch::kHalf, "float16"},
    {'f', 4, torch::kFloat, "float32"},
    {'f', 8, torch::kDouble, "float64"},
    {'c', 8, torch::kComplexFloat, "complex64"},
    {'c', 16, torch::kComplexDouble, "complex128"},
};

torch::ScalarType parse_descr(const std::string& descr, const std::string& path, bool allow_unsigned,
                              bool& unsigned_ints) {
  if (descr.size() < 3) fail(path, "unsupported dtype '" + descr + "'");
  char order = descr[0];
  char kind = descr[1];
  int size = 0;
  try {
    size_t used = 0;
    size = std::stoi(descr.substr(2), &used);
    if (used != descr.size() - 2) size = -1;
  } catch (const std::exception&) {
    size = -1;
  }
  if (size <= 0) fail(path, "unsupported dtype '" + descr + "'");
  if (order == '>' && size > 1) fail(path, "big-endian dtype '" + descr + "' is not supported (save it as '<' order)");
  if (order != '<' && order != '|' && order != '=' && order != '>') fail(path, "unsupported dtype '" + descr + "'");
  for (const auto& d : kDtypes) {
    if (d.kind == kind && d.size == size) return d.type;
  }
  if (kind == 'u' && allow_unsigned && (size == 2 || size == 4 || size == 8)) {
    unsigned_ints = true;
    return size == 2 ? torch::kShort : size == 4 ? torch::kInt : torch::kLong;
  }
  if (kind == 'u')
    fail(path, "dtype '" + descr + "' (unsigned " + std::to_string(size * 8) +
                   "-bit) has no LibTorch equivalent; convert it to a signed type");
  fail(path, "unsupported dtype '" + descr + "'");
}

const DtypeInfo& dtype_info(torch::ScalarType t) {
  for (const auto& d : kDtypes) {
    if (d.type == t) return d;
  }
  throw Error(std::string("dtype ") + c10::toString(t) + " cannot be written as .npy");
}

// A cursor over the header's Python dict literal, e.g.
// {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }
class HeaderParser {
 public:
  HeaderParser(std::string text, const std::string& path, bool allow_unsigned)
      : s_(std::move(text)), path_(path), allow_unsigned_(allow_unsigned) {}

  NpyHeader parse() {
    NpyHeader h;
    bool have_descr = false, have_order = false, have_shape = false;
    expect('{');
    while (true) {
      skip_ws();
      if (peek() == '}') break;
      std::string key = parse_string();
      expect(':');
      skip_ws();
      if (key == "descr") {
        if (peek() == '[') fail(path_, "structured dtypes are not supported");
        h.dtype = parse_descr(parse_string(), path_, allow_unsigned_, h.unsigned_ints);
        have_descr = true;
      } else if (key == "fortran_order") {
        if (parse_bool())
          fail(path_, "fortran_order is True; only C-order arrays are supported (use np.ascontiguousarray)");
        have_order = true;
      } else if (key == "shape") {
        h.shape = parse_shape();
        have_shape = true;
      } else {
        fail(path_, "corrupt header: unexpected key '" + key + "'");
      }
      skip_ws();
      if (peek() == ',') ++i_;
    }
    if (!have_descr || !have_order || !have_shape) {
      fail(path_, "corrupt header: missing 'descr', 'fortran_order' or 'shape'");
    }
    return h;
  }

 private:
  char peek() {
    if (i_ >= s_.size()) fail(path_, "corrupt header: ends early in '" + s_ + "'");
    return s_[i_];
  }
  void skip_ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  void expect(char c) {
    skip_ws();
    if (peek() != c) fail(path_, std::string("corrupt header: expected '") + c + "' at offset " + std::to_string(i_));
    ++i_;
  }
  std::string parse_string() {
    skip_ws();
    char q = peek();
    if (q != '\'' && q != '"') fail(path_, "corrupt header: expected a string at offset " + std::to_string(i_));
    size_t end = s_.find(q, i_ + 1);
    if (end == std::string::npos) fail(path_, "corrupt header: unterminated string");
    std::string out = s_.substr(i_ + 1, end - i_ - 1);
    i_ = end + 1;
    return out;
  }
  bool parse_bool() {
    if (s_.compare(i_, 4, "True") == 0) {
      i_ += 4;
      return true;
    }
    if (s_.compare(i_, 5, "False") == 0) {
      i_ += 5;
      return false;
    }
    fail(path_, "corrupt header: fortran_order is not True or False");
  }
  std::vector<int64_t> parse_shape() {
    std::vector<int64_t> shape;
    expect('(');
    while (true) {
      skip_ws();
      if (peek() == ')') {
        ++i_;
        break;
      }
      size_t start = i_;
      int64_t v = 0;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') {
        if (v > (std::numeric_limits<int64_t>::max() - 9) / 10) fail(path_, "corrupt header: dimension too large");
        v = v * 10 + (s_[i_++] - '0');
      }
      if (i_ == start) fail(path_, "corrupt header: bad shape at offset " + std::to_string(i_));
      if (i_ < s_.size() && s_[i_] == 'L') ++i_;  // Python 2 longs
      shape.push_back(v);
      skip_ws();
      if (peek() == ',') {
        ++i_;
      } else if (peek() != ')') {
        fail(path_, "corrupt header: bad shape at offset " + std::to_string(i_));
      }
    }
    return shape;
  }

  std::string s_;
  const std::string& path_;
  bool allow_unsigned_;
  size_t i_ = 0;
};

uint64_t element_count(const std::vector<int64_t>& shape, const std::string& path) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d != 0 && n > std::numeric_limits<uint64_t>::max() / 16 / uint64_t(d))
      fail(path, "corrupt header: shape too large");
    n *= uint64_t(d);
  }
  return n;
}

}  // namespace

NpyHeader parse_npy_header(const void* bytes, size_t size, const std::string& path, bool allow_unsigned) {
  const auto* p = static_cast<const unsigned char*>(bytes);
  if (size < kMagicSize + 2 || std::memcmp(p, kMagic, kMagicSize) != 0) {
    if (size < kMagicSize + 2 && (size == 0 || std::memcmp(p, kMagic, std::min(size, kMagicSize)) == 0)) {
      fail(path, "truncated: " + std::to_string(size) + " bytes, shorter than a .npy header");
    }
    fail(path, "not a .npy file (bad magic string)");
  }
  int major = p[6];
  size_t prefix = 0;
  size_t header_len = 0;
  if (major == 1) {
    prefix = 10;
    if (size < prefix) fail(path, "truncated inside the header");
    header_len = size_t(p[8]) | size_t(p[9]) << 8;
  } else if (major == 2 || major == 3) {
    prefix = 12;
    if (size < prefix) fail(path, "truncated inside the header");
    header_len = size_t(p[8]) | size_t(p[9]) << 8 | size_t(p[10]) << 16 | size_t(p[11]) << 24;
  } else {
    fail(path, "unsupported format version " + std::to_string(major) + "." + std::to_string(p[7]));
  }
  if (size < prefix + header_len) {
    fail(path, "truncated inside the header (" + std::to_string(size) + " bytes, header needs " +
                   std::to_string(prefix + header_len) + ")");
  }
  std::string text(reinterpret_cast<const char*>(p + prefix), header_len);
  NpyHeader h = HeaderParser(std::move(text), path, allow_unsigned).parse();
  h.major_version = major;
  h.data_offset = prefix + header_len;
  return h;
}

// --- NpyArray ---

std::shared_ptr<NpyArray::Mapping> NpyArray::map_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    fail(path, std::string("cannot stat: ") + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, "not a regular file");
  }
  auto mapping = std::make_shared<Mapping>();
  mapping->size = static_cast<size_t>(st.st_size);
  if (mapping->size > 0) {
    void* base = mmap(nullptr, mapping->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (base == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      fail(path, std::string("cannot mmap: ") + std::strerror(e));
    }
    mapping->base = base;
    mapping->mapped = true;
  }
  ::close(fd);  // the mapping stays valid without the descriptor
  return mapping;
}

NpyArray NpyArray::open(const std::string& path, bool allow_unsigned) {
  auto mapping = map_file(path);
  size_t size = mapping->size;
  return from_image(path, std::move(mapping), 0, size, allow_unsigned);
}

NpyArray NpyArray::open_raw(const std::string& path, torch::ScalarType dtype, bool unsigned_ints) {
  auto mapping = map_file(path);
  NpyHeader header;
  header.dtype = dtype;
  header.unsigned_ints = unsigned_ints;
  const auto item = torch::elementSize(dtype);
  if (mapping->size % item != 0) {
    fail(path, "raw file of " + std::to_string(mapping->size) + " bytes is not a whole number of " +
                   std::to_string(item) + "-byte elements");
  }
  header.shape = {static_cast<int64_t>(mapping->size / item)};
  return NpyArray(path, std::move(header), std::move(mapping));
}

NpyArray NpyArray::from_image(const std::string& path, std::shared_ptr<const Mapping> mapping, size_t offset,
                              size_t size, bool allow_unsigned) {
  const auto* image = static_cast<const std::byte*>(mapping->base) + offset;
  NpyHeader header = parse_npy_header(image, size, path, allow_unsigned);
  uint64_t elements = element_count(header.shape, path);
  uint64_t need = elements * uint64_t(torch::elementSize(header.dtype));
  uint64_t have = size - header.data_offset;
  header.data_offset += offset;
  if (have < need) {
    std::ostringstream os;
    os << "truncated: shape (";
    for (size_t i = 0; i < header.shape.size(); ++i) os << (i ? ", " : "") << header.shape[i];
    os << ") of " << c10::toString(header.dtype) << " needs " << need << " data bytes, file has " << have;
    fail(path, os.str());
  }
  return NpyArray(path, std::move(header), std::move(mapping));
}

int64_t NpyArray::rows() const { return header_.shape.empty() ? 1 : header_.shape[0]; }

const std::byte* NpyArray::data() const { return static_cast<const std::byte*>(mapping_->base) + header_.data_offset; }

size_t NpyArray::nbytes() const { return element_count(header_.shape, path_) * torch::elementSize(header_.dtype); }

torch::Tensor NpyArray::tensor() const {
  auto options = torch::TensorOptions().dtype(header_.dtype);
  auto* p = const_cast<std::byte*>(data());
  if (reinterpret_cast<uintptr_t>(p) % torch::elementSize(header_.dtype) != 0 || nbytes() == 0) {
    // NumPy aligns data to 64 bytes, but a hand-written header may not:
    // vectorised kernels assume aligned elements, so copy instead.
    auto t = torch::empty(header_.shape, options);
    if (nbytes()) std::memcpy(t.data_ptr(), p, nbytes());
    return t;
  }
  auto keep = mapping_;
  return torch::from_blob(
      p, header_.shape, [keep](void*) mutable { keep.reset(); }, options);
}

torch::Tensor NpyArray::row(int64_t i) const {
  TROUPE_CHECK(i >= 0 && i < rows()) << "row " << i << " out of range for '" << path_ << "' with " << rows() << " rows";
  std::vector<int64_t> shape;
  if (!header_.shape.empty()) shape.assign(header_.shape.begin() + 1, header_.shape.end());
  auto t = torch::empty(shape, torch::TensorOptions().dtype(header_.dtype));
  size_t row_bytes = t.numel() * t.element_size();
  if (row_bytes) std::memcpy(t.data_ptr(), data() + size_t(i) * row_bytes, row_bytes);
  return t;
}

void write_npy(const std::string& path, const torch::Tensor& tensor) {
  TROUPE_CHECK(tensor.defined()) << "write_npy('" << path << "') of an undefined tensor";
  auto t = tensor.detach().to(torch::kCPU).contiguous();
  const DtypeInfo& d = dtype_info(t.scalar_type());
  std::ostringstream dict;
  dict << "{'descr': '" << (d.size == 1 ? '|' : '<') << d.kind << d.size << "', 'fortran_order': False, 'shape': (";
  for (int64_t i = 0; i < t.dim(); ++i) dict << (i ? ", " : "") << t.size(i);
  if (t.dim() == 1) dict << ",";
  dict << "), }";
  std::string header = dict.str();
  // Pad with spaces and end with '\n' so the data starts 64-byte aligned, as NumPy does.
  size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  TROUPE_CHECK(header.size() <= 0xFFFF) << "npy header too long for '" << path << "'";

  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) fail(path, std::string("cannot create: ") + std::strerror(errno));
  unsigned char prefix[10] = {0x93,
                              'N',
                              'U',
                              'M',
                              'P',
                              'Y',
                              1,
                              0,
                              static_cast<unsigned char>(header.size() & 0xFF),
                              static_cast<unsigned char>(header.size() >> 8)};
  size_t bytes = t.numel() * t.element_size();
  bool ok = std::fwrite(prefix, 1, sizeof prefix, f) == sizeof prefix &&
            std::fwrite(header.data(), 1, header.size(), f) == header.size() &&
            (bytes == 0 || std::fwrite(t.data_ptr(), 1, bytes, f) == bytes);
  int e = errno;
  if (std::fclose(f) != 0 && ok) {
    ok = false;
    e = errno;
  }
  if (!ok) fail(path, std::string("write failed: ") + std::strerror(e));
}

// --- NpyDataset ---

NpyDataset::NpyDataset(const std::string& inputs_path, const std::string& targets_path)
    : inputs_(NpyArray::open(inputs_path)) {
  if (inputs_.shape().empty()) fail(inputs_path, "is 0-dimensional; a data set needs one row per sample");
  if (!targets_path.empty()) {
    targets_ = std::make_unique<NpyArray>(NpyArray::open(targets_path));
    if (targets_->shape().empty() || targets_->rows() != inputs_.rows()) {
      fail(targets_path, "has " + std::to_string(targets_->shape().empty() ? 0 : targets_->rows()) +
                             " rows but inputs '" + inputs_path + "' have " + std::to_string(inputs_.rows()));
    }
  }
}

std::string NpyDataset::describe() const {
  return "npy(inputs='" + inputs_.path() + "'" + (targets_ ? ", targets='" + targets_->path() + "'" : "") + ")";
}

Sample NpyDataset::load(int64_t index, int64_t /*epoch*/) const {
  Sample s;
  s.set("input", inputs_.row(index));
  if (targets_) s.set("target", targets_->row(index));
  return s;
}

}  // namespace troupe::actors
