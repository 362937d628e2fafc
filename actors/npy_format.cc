#include "troupe/actors/npy_format.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <sstream>

#include "troupe/runtime/core/errors.h"

namespace troupe::actors {

void npy_fail(const std::string& path, const std::string& problem) {
  throw Error("npy file '" + path + "': " + problem);
}

namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicSize = 6;

// "<f4", "|u1", "<i8": byte order, kind, item size. Big-endian multi-byte
// data would need swapping, which the zero-copy views cannot do.
void parse_descr(const std::string& descr, const std::string& path, NpyFormat& f) {
  if (descr.size() < 3) npy_fail(path, "unsupported dtype '" + descr + "'");
  char order = descr[0];
  int size = 0;
  try {
    size_t used = 0;
    size = std::stoi(descr.substr(2), &used);
    if (used != descr.size() - 2) size = -1;
  } catch (const std::exception&) {
    size = -1;
  }
  if (size <= 0) npy_fail(path, "unsupported dtype '" + descr + "'");
  if (order == '>' && size > 1)
    npy_fail(path, "big-endian dtype '" + descr + "' is not supported (save it as '<' order)");
  if (order != '<' && order != '|' && order != '=' && order != '>') npy_fail(path, "unsupported dtype '" + descr + "'");
  f.kind = descr[1];
  f.item_size = size;
  f.descr = descr;
}

// A cursor over the header's Python dict literal, e.g.
// {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }
class HeaderParser {
 public:
  HeaderParser(std::string text, const std::string& path) : s_(std::move(text)), path_(path) {}

  NpyFormat parse() {
    NpyFormat h;
    bool have_descr = false, have_order = false, have_shape = false;
    expect('{');
    while (true) {
      skip_ws();
      if (peek() == '}') break;
      std::string key = parse_string();
      expect(':');
      skip_ws();
      if (key == "descr") {
        if (peek() == '[') npy_fail(path_, "structured dtypes are not supported");
        parse_descr(parse_string(), path_, h);
        have_descr = true;
      } else if (key == "fortran_order") {
        if (parse_bool())
          npy_fail(path_, "fortran_order is True; only C-order arrays are supported (use np.ascontiguousarray)");
        have_order = true;
      } else if (key == "shape") {
        h.shape = parse_shape();
        have_shape = true;
      } else {
        npy_fail(path_, "corrupt header: unexpected key '" + key + "'");
      }
      skip_ws();
      if (peek() == ',') ++i_;
    }
    if (!have_descr || !have_order || !have_shape) {
      npy_fail(path_, "corrupt header: missing 'descr', 'fortran_order' or 'shape'");
    }
    return h;
  }

 private:
  char peek() {
    if (i_ >= s_.size()) npy_fail(path_, "corrupt header: ends early in '" + s_ + "'");
    return s_[i_];
  }
  void skip_ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  void expect(char c) {
    skip_ws();
    if (peek() != c)
      npy_fail(path_, std::string("corrupt header: expected '") + c + "' at offset " + std::to_string(i_));
    ++i_;
  }
  std::string parse_string() {
    skip_ws();
    char q = peek();
    if (q != '\'' && q != '"') npy_fail(path_, "corrupt header: expected a string at offset " + std::to_string(i_));
    size_t end = s_.find(q, i_ + 1);
    if (end == std::string::npos) npy_fail(path_, "corrupt header: unterminated string");
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
    npy_fail(path_, "corrupt header: fortran_order is not True or False");
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
        if (v > (std::numeric_limits<int64_t>::max() - 9) / 10) npy_fail(path_, "corrupt header: dimension too large");
        v = v * 10 + (s_[i_++] - '0');
      }
      if (i_ == start) npy_fail(path_, "corrupt header: bad shape at offset " + std::to_string(i_));
      if (i_ < s_.size() && s_[i_] == 'L') ++i_;  // Python 2 longs
      shape.push_back(v);
      skip_ws();
      if (peek() == ',') {
        ++i_;
      } else if (peek() != ')') {
        npy_fail(path_, "corrupt header: bad shape at offset " + std::to_string(i_));
      }
    }
    return shape;
  }

  std::string s_;
  const std::string& path_;
  size_t i_ = 0;
};

}  // namespace

uint64_t npy_element_count(const std::vector<int64_t>& shape, const std::string& path) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d != 0 && n > std::numeric_limits<uint64_t>::max() / 16 / uint64_t(d))
      npy_fail(path, "corrupt header: shape too large");
    n *= uint64_t(d);
  }
  return n;
}

uint64_t npy_data_bytes(const NpyFormat& f, size_t image_size, const std::string& path) {
  if (f.item_size > 16) npy_fail(path, "unsupported dtype '" + f.descr + "'");
  const uint64_t need = npy_element_count(f.shape, path) * uint64_t(f.item_size);
  const uint64_t have = image_size - f.data_offset;
  if (have < need) {
    std::ostringstream os;
    os << "truncated: shape (";
    for (size_t i = 0; i < f.shape.size(); ++i) os << (i ? ", " : "") << f.shape[i];
    os << ") of '" << f.descr << "' needs " << need << " data bytes, file has " << have;
    npy_fail(path, os.str());
  }
  return need;
}

NpyFormat parse_npy_format(const void* bytes, size_t size, const std::string& path) {
  const auto* p = static_cast<const unsigned char*>(bytes);
  if (size < kMagicSize + 2 || std::memcmp(p, kMagic, kMagicSize) != 0) {
    if (size < kMagicSize + 2 && (size == 0 || std::memcmp(p, kMagic, std::min(size, kMagicSize)) == 0)) {
      npy_fail(path, "truncated: " + std::to_string(size) + " bytes, shorter than a .npy header");
    }
    npy_fail(path, "not a .npy file (bad magic string)");
  }
  int major = p[6];
  size_t prefix = 0;
  size_t header_len = 0;
  if (major == 1) {
    prefix = 10;
    if (size < prefix) npy_fail(path, "truncated inside the header");
    header_len = size_t(p[8]) | size_t(p[9]) << 8;
  } else if (major == 2 || major == 3) {
    prefix = 12;
    if (size < prefix) npy_fail(path, "truncated inside the header");
    header_len = size_t(p[8]) | size_t(p[9]) << 8 | size_t(p[10]) << 16 | size_t(p[11]) << 24;
  } else {
    npy_fail(path, "unsupported format version " + std::to_string(major) + "." + std::to_string(p[7]));
  }
  if (size < prefix + header_len) {
    npy_fail(path, "truncated inside the header (" + std::to_string(size) + " bytes, header needs " +
                       std::to_string(prefix + header_len) + ")");
  }
  std::string text(reinterpret_cast<const char*>(p + prefix), header_len);
  NpyFormat h = HeaderParser(std::move(text), path).parse();
  h.major_version = major;
  h.data_offset = prefix + header_len;
  return h;
}

}  // namespace troupe::actors
