#include "troupe/trainer/checkpoint.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/files.h"
#include "troupe/trainer/checkpoint_manifest.h"

namespace fs = std::filesystem;

namespace troupe::trainer {
namespace {

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%08lld", static_cast<long long>(step));
  return buf;
}

std::string sha256_hex(const std::vector<char>& data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(data.data(), data.size(), md, &len, EVP_sha256(), nullptr);
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned i = 0; i < len; ++i) {
    out += hex[md[i] >> 4];
    out += hex[md[i] & 15];
  }
  return out;
}

// A file system that reports a full disk or an I/O error only when the
// data is flushed (NFS, XFS and btrfs writeback) says so here: the
// checkpoint is not renamed into place.
void fsync_path(const fs::path& p, bool dir) {
  int fd = ::open(p.c_str(), dir ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) return;
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  // EINVAL: a file system that cannot sync (a directory on some): nothing lost.
  if (rc != 0 && err != EINVAL)
    throw CheckpointWriteError("cannot write checkpoint file " + p.string() + ": fsync: " + std::strerror(err));
}

void write_file(const fs::path& p, const std::vector<char>& data) {
  errno = 0;
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(data.data(), static_cast<std::streamsize>(data.size()));
  f.close();
  if (!f) {
    const int err = errno;  // what the failed open, write or close left
    throw CheckpointWriteError("cannot write checkpoint file " + p.string() +
                               (err != 0 ? std::string(": ") + std::strerror(err) : std::string()));
  }
  fsync_path(p, false);
}

std::vector<char> read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) throw Error("cannot read checkpoint file " + p.string());
  return std::vector<char>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// {name: tensor} as the bytes torch.save would write for a dict of tensors.
// This is torch::pickle_save without type tags: pickle_save tags a typed
// dict with the torch.jit._pickle.restore_type_tag global, which the
// default torch.load of PyTorch 2.6 and later (weights_only=True) refuses
// to call. Untagged, the file is a plain dict of tensors to every
// torch.load, and pickle_load (load_checkpoint) reads it as a dict too.
std::vector<char> pickle_dict(const std::map<std::string, torch::Tensor>& m) {
  c10::Dict<std::string, at::Tensor> d;
  for (const auto& [k, v] : m) d.insert(k, v.detach().to(torch::kCPU).contiguous());
  std::vector<char> pickled;
  torch::jit::Pickler pickler([&](const char* bytes, size_t n) { pickled.insert(pickled.end(), bytes, bytes + n); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
                              /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(c10::IValue(d));
  pickler.stop();
  std::vector<char> out;
  {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* bytes, size_t n) {
      const char* b = static_cast<const char*>(bytes);
      out.insert(out.end(), b, b + n);
      return n;
    });
    torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(), writer);
    writer.writeEndOfFile();  // here, where an error can throw, not in the destructor
  }
  return out;
}

std::map<std::string, torch::Tensor> unpickle_dict(const std::vector<char>& bytes, const std::string& what) {
  c10::IValue v;
  try {
    v = torch::pickle_load(bytes);
  } catch (const c10::Error& e) {
    throw Error("cannot unpickle " + what + ": " + e.what_without_backtrace());
  }
  if (!v.isGenericDict()) throw Error(what + " is not a dict of tensors");
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : v.toGenericDict()) out[item.key().toStringRef()] = item.value().toTensor();
  return out;
}

// Reads and verifies <dir>/manifest.json (every file's size and checksum
// when verify_files); throws Error naming the problem.
CheckpointManifest read_manifest(const fs::path& dir, bool verify_files) {
  auto mp = dir / "manifest.json";
  if (!fs::exists(mp)) throw Error("checkpoint " + dir.string() + " has no manifest.json");
  const auto bytes = read_file(mp);
  CheckpointManifest m = parse_manifest(std::string_view(bytes.data(), bytes.size()), mp.string());
  if (verify_files) {
    for (const auto& [name, f] : m.files) {
      std::error_code ec;
      const auto size = fs::file_size(dir / name, ec);
      if (ec) throw Error("checkpoint file " + (dir / name).string() + " is missing: " + ec.message());
      if (size != f.bytes)
        throw Error("checkpoint file " + (dir / name).string() + " has " + std::to_string(size) +
                    " bytes, its manifest says " + std::to_string(f.bytes));
      auto data = read_file(dir / name);
      if (sha256_hex(data) != f.sha256) throw Error("checkpoint file " + (dir / name).string() + " fails its checksum");
    }
  }
  return m;
}

CheckpointInfo info_of(const fs::path& dir, const CheckpointManifest& m) {
  CheckpointInfo info;
  info.path = dir.string();
  info.step = m.step;
  info.epoch = m.epoch;
  info.world_size = m.world_size;
  info.cursor = m.cursor;
  info.metrics = m.metrics;
  info.data_order = m.data_order;
  info.epoch_sums = m.epoch_sums;
  return info;
}

}  // namespace

CheckpointInfo save_checkpoint(const std::string& root, const TrainState& state,
                               const std::map<std::string, double>& metrics,
                               const std::map<std::string, int64_t>& data_order,
                               const std::map<std::string, double>& epoch_sums) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) throw CheckpointWriteError("cannot create checkpoint directory " + root + ": " + ec.message());
  fs::path final_dir = fs::path(root) / step_dir_name(state.step);
  std::random_device rd;
  fs::path tmp = fs::path(root) /
                 (".tmp-" + step_dir_name(state.step) + "-" + std::to_string(::getpid()) + "-" + std::to_string(rd()));
  try {
    fs::create_directory(tmp);
    std::map<std::string, std::vector<char>> files;
    files["model.pt"] = pickle_dict(state.model);
    files["optimizer.pt"] = pickle_dict(state.optimizer);
    std::map<std::string, torch::Tensor> rng;
    if (state.rng.defined()) rng["cpu"] = state.rng;
    files["rng.pt"] = pickle_dict(rng);
    // Only a step that keeps state writes it: checkpoints of the others
    // stay as they were.
    if (!state.step_state.empty()) files["step.pt"] = pickle_dict(state.step_state);
    CheckpointManifest m;
    m.step = state.step;
    m.epoch = state.epoch;
    m.world_size = state.world_size;
    m.cursor = state.cursor;
    m.metrics = metrics;
    m.data_order = data_order;
    m.epoch_sums = epoch_sums;
    for (const auto& [name, data] : files) {
      write_file(tmp / name, data);
      m.files[name] = {sha256_hex(data), data.size()};
    }
    std::string text = manifest_text(m);
    write_file(tmp / "manifest.json", std::vector<char>(text.begin(), text.end()));
    fsync_path(tmp, true);
    if (fs::exists(final_dir)) troupe::core::remove_tree(final_dir);
    fs::rename(tmp, final_dir);
    fsync_path(root, true);
    return info_of(final_dir, m);
  } catch (const fs::filesystem_error& e) {
    troupe::core::remove_tree(tmp, ec);
    throw CheckpointWriteError(std::string("writing checkpoint failed: ") + e.what());
  } catch (...) {
    troupe::core::remove_tree(tmp, ec);
    throw;
  }
}

TrainState load_checkpoint(const std::string& dir, CheckpointInfo* info_out) {
  auto m = read_manifest(dir, true);
  auto info = info_of(dir, m);
  TrainState s;
  s.step = info.step;
  s.epoch = info.epoch;
  s.world_size = info.world_size;
  s.cursor = info.cursor;
  s.model = unpickle_dict(read_file(fs::path(dir) / "model.pt"), dir + "/model.pt");
  s.optimizer = unpickle_dict(read_file(fs::path(dir) / "optimizer.pt"), dir + "/optimizer.pt");
  auto rng = unpickle_dict(read_file(fs::path(dir) / "rng.pt"), dir + "/rng.pt");
  if (rng.count("cpu")) s.rng = rng["cpu"];
  if (m.files.count("step.pt")) s.step_state = unpickle_dict(read_file(fs::path(dir) / "step.pt"), dir + "/step.pt");
  if (info_out) *info_out = info;
  return s;
}

std::vector<CheckpointInfo> list_checkpoints(const std::string& root, std::vector<SkippedCheckpoint>* skipped) {
  std::vector<CheckpointInfo> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    auto name = e.path().filename().string();
    if (!e.is_directory() || name.rfind("step-", 0) != 0) continue;
    try {
      out.push_back(info_of(e.path(), read_manifest(e.path(), true)));
    } catch (const std::exception& ex) {
      // Incomplete or corrupt: never a candidate.
      if (skipped) skipped->push_back({e.path().string(), ex.what()});
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.step < b.step; });
  if (skipped)
    std::sort(skipped->begin(), skipped->end(), [](const auto& a, const auto& b) { return a.path < b.path; });
  return out;
}

std::optional<CheckpointInfo> latest_checkpoint(const std::string& root, std::vector<SkippedCheckpoint>* skipped) {
  auto all = list_checkpoints(root, skipped);
  if (all.empty()) return std::nullopt;
  return all.back();
}

void prune_checkpoints(const std::string& root, int keep) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    auto name = e.path().filename().string();
    // Temporary directories of this process's finished writes, or of a
    // writer that crashed.
    if (name.rfind(".tmp-", 0) == 0) troupe::core::remove_tree(e.path(), ec);
  }
  if (keep <= 0) return;
  auto all = list_checkpoints(root);
  for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i) troupe::core::remove_tree(all[i].path, ec);
}

namespace {

// ROOT/.lock, made if need be and locked (flock, so it goes with the
// process however it ends), holding the locker's pid. Unlinked by its
// holder when the writer goes: a job that locked the file just before, by
// then no longer the one at ROOT/.lock, tries again with the new one.
int lock_checkpoint_dir(const std::string& root) {
  std::error_code ec;
  std::filesystem::create_directories(root, ec);
  if (ec) throw ConfigError("cannot make checkpoint directory " + root + ": " + ec.message());
  const std::string path = root + "/.lock";
  for (int attempt = 0;; ++attempt) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) throw ConfigError("cannot open " + path + ": " + std::strerror(errno));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      if (err == ENOLCK || err == ENOSYS || err == EOPNOTSUPP || err == EINVAL) {
        // A file system without flock (some network or FUSE mounts): the
        // job goes on unguarded, as before there was a lock.
        std::fprintf(stderr, "troupe: cannot lock %s (%s): not guarding it against a second job\n", path.c_str(),
                     std::strerror(err));
        return fd;
      }
      char pid[32] = {};
      const ssize_t n = ::pread(fd, pid, sizeof pid - 1, 0);
      ::close(fd);
      if (err != EWOULDBLOCK) throw ConfigError("cannot lock " + path + ": " + std::strerror(err));
      throw ConfigError("checkpoint directory " + root + " is in use by another running job" +
                        (n > 0 ? " (pid " + std::string(pid, static_cast<size_t>(n)) + ")" : std::string()) +
                        ": two jobs writing there would mix their checkpoints; name another directory");
    }
    struct stat held {
    }, named{};
    if (::fstat(fd, &held) == 0 && ::stat(path.c_str(), &named) == 0 && held.st_dev == named.st_dev &&
        held.st_ino == named.st_ino) {
      const std::string mine = std::to_string(::getpid());
      // The pid only names the holder in another job's message: best effort.
      if (::ftruncate(fd, 0) == 0) (void)!::pwrite(fd, mine.data(), mine.size(), 0);
      return fd;
    }
    ::close(fd);  // unlinked by its last holder meanwhile
    if (attempt == 100) throw ConfigError("cannot lock " + path + ": it keeps being replaced");
  }
}

}  // namespace

void refuse_if_checkpoint_dir_in_use(const std::string& root) {
  const std::string path = root + "/.lock";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  if (::flock(fd, LOCK_EX | LOCK_NB) == 0 || errno != EWOULDBLOCK) {
    ::close(fd);  // free (the lock goes with the descriptor), or no flock here
    return;
  }
  char pid[32] = {};
  const ssize_t n = ::pread(fd, pid, sizeof pid - 1, 0);
  ::close(fd);
  throw ConfigError("checkpoint directory " + root + " is in use by another running job" +
                    (n > 0 ? " (pid " + std::string(pid, static_cast<size_t>(n)) + ")" : std::string()) +
                    ": two jobs writing there would mix their checkpoints; name another directory");
}

std::string newest_checkpoint_folder(const std::string& root) {
  std::string newest;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) != 0 || !fs::exists(e.path() / "manifest.json", ec)) continue;
    // step-%08lld: longer is later, and names of one length sort as steps.
    const std::string was = fs::path(newest).filename().string();
    if (newest.empty() || name.size() > was.size() || (name.size() == was.size() && name > was))
      newest = e.path().string();
  }
  return newest;
}

CheckpointWriter::CheckpointWriter(std::string root, int keep, std::map<std::string, int64_t> data_order)
    : root_(std::move(root)),
      lock_fd_(lock_checkpoint_dir(root_)),
      keep_(keep),
      data_order_(std::move(data_order)),
      thread_([this] { run(); }) {}

CheckpointWriter::~CheckpointWriter() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  // While still held: no other job has it (one that opened it meanwhile
  // sees it is no longer ROOT/.lock and takes the next).
  ::unlink((root_ + "/.lock").c_str());
  ::close(lock_fd_);
}

void CheckpointWriter::submit(TrainState state, std::map<std::string, double> metrics,
                              std::map<std::string, double> epoch_sums) {
  {
    std::lock_guard lock(mu_);
    queue_.push_back(Item{std::move(state), std::move(metrics), std::move(epoch_sums)});
  }
  cv_.notify_all();
}

void CheckpointWriter::wait() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
  if (error_) {
    auto e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void CheckpointWriter::check() {
  std::lock_guard lock(mu_);
  if (error_) {
    auto e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

std::optional<CheckpointInfo> CheckpointWriter::last() const {
  std::lock_guard lock(mu_);
  return last_;
}

void CheckpointWriter::run() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and drained
    auto item = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    std::exception_ptr error;
    std::optional<CheckpointInfo> info;
    try {
      info = save_checkpoint(root_, item.state, item.metrics, data_order_, item.epoch_sums);
      prune_checkpoints(root_, keep_);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    busy_ = false;
    if (info) last_ = info;
    if (error && !error_) error_ = error;
    cv_.notify_all();
  }
}

}  // namespace troupe::trainer
