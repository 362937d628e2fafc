#include "troupe/actors/npy.h"

#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <sstream>
#include <vector>

#include "troupe/actors/npy_format.h"
#include "troupe/actors/npy_mapping.h"
#include "troupe/runtime/core/check.h"
#include "troupe/runtime/core/errors.h"

namespace troupe::actors {

namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the .npy reader assumes a little-endian host");

[[noreturn]] void fail(const std::string& path, const std::string& problem) { npy_fail(path, problem); }

// An error about the file at `path`, read as a `kind` ("npy file", ...).
[[noreturn]] void fail_as(const std::string& kind, const std::string& path, const std::string& problem) {
  throw Error(kind + " '" + path + "': " + problem);
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

// The LibTorch type of the file's elements. Unsigned types wider than a
// byte have none: with allow_unsigned they load as the signed type of the
// same width, their bits unchanged (unsigned_ints says so).
torch::ScalarType torch_dtype(const NpyFormat& f, const std::string& path, bool allow_unsigned, bool& unsigned_ints) {
  for (const auto& d : kDtypes) {
    if (d.kind == f.kind && d.size == f.item_size) return d.type;
  }
  const int size = f.item_size;
  if (f.kind == 'u' && allow_unsigned && (size == 2 || size == 4 || size == 8)) {
    unsigned_ints = true;
    return size == 2 ? torch::kShort : size == 4 ? torch::kInt : torch::kLong;
  }
  if (f.kind == 'u')
    fail(path, "dtype '" + f.descr + "' (unsigned " + std::to_string(size * 8) +
                   "-bit) has no LibTorch equivalent; convert it to a signed type");
  fail(path, "unsupported dtype '" + f.descr + "'");
}

const DtypeInfo& dtype_info(torch::ScalarType t) {
  for (const auto& d : kDtypes) {
    if (d.type == t) return d;
  }
  throw Error(std::string("dtype ") + c10::toString(t) + " cannot be written as .npy");
}

NpyHeader to_header(const NpyFormat& f, const std::string& path, bool allow_unsigned) {
  NpyHeader h;
  h.dtype = torch_dtype(f, path, allow_unsigned, h.unsigned_ints);
  h.shape = f.shape;
  h.major_version = f.major_version;
  h.data_offset = f.data_offset;
  return h;
}

}  // namespace

NpyHeader parse_npy_header(const void* bytes, size_t size, const std::string& path, bool allow_unsigned) {
  return to_header(parse_npy_format(bytes, size, path), path, allow_unsigned);
}

// --- NpyArray ---

std::shared_ptr<NpyArray::Mapping> NpyArray::Mapping::map(const std::string& path, const std::string& kind) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail_as(kind, path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    fail_as(kind, path, std::string("cannot stat: ") + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail_as(kind, path, "not a regular file");
  }
  auto mapping = std::make_shared<Mapping>();
  mapping->size = static_cast<size_t>(st.st_size);
  if (mapping->size > 0) {
    void* base = mmap(nullptr, mapping->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (base == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      fail_as(kind, path, std::string("cannot mmap: ") + std::strerror(e));
    }
    mapping->base = base;
    mapping->mapped = true;
    mapping->path = path;
    mapping->kind = kind;
    mapping->mapped_stat = st;
  }
  ::close(fd);  // the mapping stays valid without the descriptor
  return mapping;
}

void NpyArray::Mapping::check_unchanged(bool at_once) const {
  if (!mapped) return;
  using namespace std::chrono;
  const int64_t now = duration_cast<nanoseconds>(steady_clock::now().time_since_epoch()).count();
  int64_t due = next_check_ns.load(std::memory_order_relaxed);
  if (!at_once && (now < due || !next_check_ns.compare_exchange_strong(due, now + 100'000'000))) return;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || st.st_dev != mapped_stat.st_dev || st.st_ino != mapped_stat.st_ino) return;
  const auto& was = mapped_stat;
  if (st.st_size == was.st_size && st.st_mtim.tv_sec == was.st_mtim.tv_sec && st.st_mtim.tv_nsec == was.st_mtim.tv_nsec)
    return;
  throw ConfigError(kind + " '" + path + "' was written while the job read it (" + std::to_string(was.st_size) +
                    " bytes when opened, " + std::to_string(st.st_size) +
                    " now): what it reads from here on is not the data it began with. Write a new file and rename it "
                    "over the old one (a running job keeps reading the old), or stop the job first");
}

void NpyArray::check_unchanged() const { mapping_->check_unchanged(); }
void NpyArray::check_unchanged_now() const { mapping_->check_unchanged(true); }

namespace {
// The jump of the guarded read running on this thread (read_mapped), or null.
thread_local sigjmp_buf* t_mapped_read = nullptr;
struct sigaction g_previous_bus {};

void on_bus(int, siginfo_t*, void*) {
  if (sigjmp_buf* jump = t_mapped_read) siglongjmp(*jump, 1);
  // Not a guarded read: the access runs again under what was there before.
  ::sigaction(SIGBUS, &g_previous_bus, nullptr);
}

void take_bus_faults() {
  static std::once_flag once;
  std::call_once(once, [] {
    // SA_NODEFER: SIGBUS stays unblocked in the handler, so the jump out
    // of it need not restore the signal mask (sigsetjmp's savemask, a
    // system call on every guarded read).
    struct sigaction sa {};
    sa.sa_sigaction = on_bus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGBUS, &sa, &g_previous_bus);
  });
}
}  // namespace

namespace detail {
void read_mapped(const NpyArray* files, size_t count, void (*read)(void*), void* context) {
  take_bus_faults();
  sigjmp_buf jump;
  sigjmp_buf* const outer = t_mapped_read;
  if (sigsetjmp(jump, 0) != 0) {
    t_mapped_read = outer;
    for (size_t i = 0; i < count; ++i) files[i].check_unchanged_now();
    throw ConfigError("reading " + (count == 0 ? std::string("a mapped file") : "'" + files[0].path() + "'") +
                      " faulted (SIGBUS): a file was cut short while the job read it. Write a new file and rename it "
                      "over the old one (a running job keeps reading the old), or stop the job first");
  }
  t_mapped_read = &jump;
  try {
    read(context);
  } catch (...) {
    t_mapped_read = outer;
    throw;
  }
  t_mapped_read = outer;
}
}  // namespace detail

std::shared_ptr<NpyArray::Mapping> NpyArray::map_file(const std::string& path) {
  return Mapping::map(path, "npy file");
}

NpyArray NpyArray::open(const std::string& path, bool allow_unsigned) {
  auto mapping = map_file(path);
  size_t size = mapping->size;
  return from_image(path, std::move(mapping), 0, size, allow_unsigned);
}

NpyArray NpyArray::open_raw(const std::string& path, torch::ScalarType dtype, bool unsigned_ints) {
  // Not a .npy file: its errors say what it is.
  auto mapping = Mapping::map(path, "raw token file");
  NpyHeader header;
  header.dtype = dtype;
  header.unsigned_ints = unsigned_ints;
  const auto item = torch::elementSize(dtype);
  if (mapping->size % item != 0) {
    fail_as(
        "raw token file", path,
        std::to_string(mapping->size) + " bytes, not a whole number of " + std::to_string(item) + "-byte token ids");
  }
  header.shape = {static_cast<int64_t>(mapping->size / item)};
  return NpyArray(path, std::move(header), std::move(mapping));
}

NpyArray NpyArray::from_image(const std::string& path, std::shared_ptr<const Mapping> mapping, size_t offset,
                              size_t size, bool allow_unsigned) {
  const auto* image = mapping->bytes() + offset;
  const NpyFormat format = parse_npy_format(image, size, path);
  NpyHeader header = to_header(format, path, allow_unsigned);
  (void)npy_data_bytes(format, size, path);
  header.data_offset += offset;
  return NpyArray(path, std::move(header), std::move(mapping));
}

NpyArray NpyArray::from_header(const std::string& path, const std::byte* head, size_t head_size, size_t size,
                               std::shared_ptr<const Mapping> mapping, bool allow_unsigned) {
  const NpyFormat format = parse_npy_format(head, head_size, path);
  NpyHeader header = to_header(format, path, allow_unsigned);
  (void)npy_data_bytes(format, size, path);
  return NpyArray(path, std::move(header), std::move(mapping));
}

int64_t NpyArray::rows() const { return header_.shape.empty() ? 1 : header_.shape[0]; }

const std::byte* NpyArray::data() const { return mapping_->bytes() + header_.data_offset; }

size_t NpyArray::nbytes() const { return npy_element_count(header_.shape, path_) * torch::elementSize(header_.dtype); }

torch::Tensor NpyArray::tensor() const {
  auto options = torch::TensorOptions().dtype(header_.dtype);
  auto* p = const_cast<std::byte*>(data());
  if (reinterpret_cast<uintptr_t>(p) % torch::elementSize(header_.dtype) != 0 || nbytes() == 0) {
    // NumPy aligns data to 64 bytes, but a hand-written header may not:
    // vectorised kernels assume aligned elements, so copy instead.
    auto t = torch::empty(header_.shape, options);
    if (nbytes()) read_mapped(this, 1, [&] { std::memcpy(t.data_ptr(), p, nbytes()); });
    return t;
  }
  auto keep = mapping_;
  return torch::from_blob(
      p, header_.shape, [keep](void*) mutable { keep.reset(); }, options);
}

torch::Tensor NpyArray::row(int64_t i) const {
  TROUPE_CHECK(i >= 0 && i < rows()) << "row " << i << " out of range for '" << path_ << "' with " << rows() << " rows";
  mapping_->check_unchanged();
  std::vector<int64_t> shape;
  if (!header_.shape.empty()) shape.assign(header_.shape.begin() + 1, header_.shape.end());
  auto t = torch::empty(shape, torch::TensorOptions().dtype(header_.dtype));
  size_t row_bytes = t.numel() * t.element_size();
  if (row_bytes) read_mapped(this, 1, [&] { std::memcpy(t.data_ptr(), data() + size_t(i) * row_bytes, row_bytes); });
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

void require_data_in_rows(const std::vector<const NpyArray*>& arrays, const std::string& what) {
  if (arrays.empty() || arrays.front()->shape().empty() || arrays.front()->rows() == 0) return;
  std::string shapes;
  for (const NpyArray* a : arrays) {
    if (a->nbytes() > 0) return;
    std::string shape;
    for (int64_t d : a->shape()) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
    if (a->shape().size() == 1) shape += ",";
    shapes += (shapes.empty() ? "'" : ", '") + a->path() + "' has shape (" + shape + ")";
  }
  throw ConfigError(what + ": " + std::to_string(arrays.front()->rows()) + " rows hold no data (" + shapes +
                    "); a sample needs at least one element");
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
  std::vector<const NpyArray*> arrays{&inputs_};
  if (targets_) arrays.push_back(targets_.get());
  require_data_in_rows(arrays, describe());
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
