#include "troupe/runtime/client/shipped_file.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <openssl/evp.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "troupe/runtime/client/object_store.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/client/shipped_copies.h"
#include "troupe/runtime/core/dir_pack.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/files.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/core/session.h"
#include "troupe/runtime/core/worker_env.h"

namespace troupe {
namespace {

std::string hex(const unsigned char* md, unsigned int len) {
  std::string out;
  char byte[3];
  for (unsigned int i = 0; i < len; ++i) {
    std::snprintf(byte, sizeof byte, "%02x", md[i]);
    out += byte;
  }
  return out;
}

struct Digest {
  std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)> ctx{EVP_MD_CTX_new(), EVP_MD_CTX_free};
  Digest() {
    if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) throw Error("cannot start a SHA-256 digest");
  }
  void add(const std::byte* data, size_t n) { EVP_DigestUpdate(ctx.get(), data, n); }
  std::string hex_digest() {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    EVP_DigestFinal_ex(ctx.get(), md, &len);
    return hex(md, len);
  }
};

// The size and SHA-256 of `path`, read through once in pieces (never held
// whole: the pieces are read again when they are served).
std::pair<uint64_t, std::string> size_and_digest(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw ConfigError("cannot ship " + path + " to the actors: " + std::strerror(errno));
  std::unique_ptr<int, void (*)(int*)> closer(&fd, [](int* p) { ::close(*p); });
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
    throw ConfigError("cannot ship " + path + " to the actors: not a regular file");
  Digest digest;
  std::vector<std::byte> piece(size_t(std::min<uint64_t>(uint64_t(st.st_size), 8u << 20)) + 1);
  uint64_t n = 0;
  for (ssize_t r; (r = ::read(fd, piece.data(), piece.size())) != 0;) {
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw ConfigError("cannot ship " + path + " to the actors: " + std::strerror(errno));
    digest.add(piece.data(), size_t(r));
    n += uint64_t(r);
  }
  return {n, digest.hex_digest()};
}

// A name for the local copy: the digest's first 16 digits and the file's
// own name (a name of a path's last part only, nothing to climb with).
std::string copy_name(const ShippedFile& f) {
  bool digest_ok = f.sha256.size() == 64;
  for (char c : f.sha256) digest_ok = digest_ok && ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'));
  if (!digest_ok) throw Error("a shipped file's digest is not a SHA-256 (" + f.path + ")");
  std::string name = std::filesystem::path(f.path).filename().string();
  if (name.empty() || name == "." || name == "..") name = "file";
  // Room for ".lock" and ".<pid>.tmp" within NAME_MAX (255): the end of
  // the name, which holds its extension, is kept.
  constexpr size_t kMaxName = 200;
  if (name.size() > kMaxName) name = name.substr(name.size() - kMaxName);
  return f.sha256.substr(0, 16) + "-" + name;
}

bool has_size(const std::string& path, uint64_t size) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && uint64_t(st.st_size) == size;
}

std::string owner_of(const ShippedFile& f) {
  if (f.chunks.empty() || !f.chunks.front().valid()) return "the driver";
  const auto& o = f.chunks.front().info();
  return "the driver (pid " + std::to_string(o.owner_pid) + " at " + o.owner_address + ")";
}

// Fetches the chunks into `tmp`, checking sizes and the digest.
void fetch_into(const ShippedFile& f, const std::string& tmp) {
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) throw Error("cannot write " + tmp + " (a copy of " + f.path + "): " + std::strerror(errno));
  std::unique_ptr<int, void (*)(int*)> closer(&fd, [](int* p) { ::close(*p); });
  Digest digest;
  uint64_t got = 0;
  for (const auto& chunk : f.chunks) {
    Buffer b;
    try {
      b = chunk.get(std::chrono::minutes(5));
    } catch (const std::exception& e) {
      throw Error("cannot fetch " + f.path + " from " + owner_of(f) + ": " + e.what());
    }
    if (got + b.size() > f.size) break;
    digest.add(b.data(), b.size());
    for (size_t n = 0; n < b.size();) {
      ssize_t w = ::write(fd, b.data() + n, b.size() - n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) throw Error("cannot write " + tmp + " (a copy of " + f.path + "): " + std::strerror(errno));
      n += size_t(w);
    }
    got += b.size();
  }
  if (got != f.size || digest.hex_digest() != f.sha256)
    throw Error("the copy of " + f.path + " fetched from " + owner_of(f) + " does not match it (" +
                std::to_string(got) + " of " + std::to_string(f.size) +
                " bytes, or a different SHA-256: did the file change after it was shipped?)");
}

std::string this_host() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return host;
}
}  // namespace

ShippedFile ship_file(Runtime& rt, const std::string& path) {
  ShippedFile f;
  f.path = path;
  std::tie(f.size, f.sha256) = size_and_digest(path);
  // Pieces of the file, read again each time a host fetches one: the
  // driver holds none of it (a host's copy that does not match the digest,
  // the file changed since, is refused there).
  auto store = rt.core()->service<client::ObjectStore>();
  for (uint64_t off = 0; off < f.size; off += kShippedChunkBytes)
    f.chunks.emplace_back(store->put(client::file_piece_value(path, off, std::min(kShippedChunkBytes, f.size - off))));
  return f;
}

namespace {

// Removes the parts (NAME.<pid>.tmp: a fetch, an unpack or a removal cut
// short) that processes which no longer run left: those of `dest` (called
// under its lock, so no live fetcher's file is among them), and any other
// whose process is gone from this host (a part of a file no later job
// fetches again stayed until the node agent stopped: a probe found 115 MB
// left by a driver killed mid-fetch).
void remove_stale_parts(const std::string& dir, const std::string& dest) {
  const std::string own = std::filesystem::path(dest).filename().string() + ".";
  std::error_code ec;
  std::vector<std::filesystem::path> stale;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    // .NAME.<pid>.<n>.tmp are write_session_file's, not parts.
    if (!name.ends_with(".tmp") || name[0] == '.') continue;
    const size_t dot = name.rfind('.', name.size() - 5);
    if (dot == std::string::npos || dot + 1 >= name.size() - 4) continue;
    const std::string pid = name.substr(dot + 1, name.size() - dot - 5);
    if (pid.find_first_not_of("0123456789") != std::string::npos || pid.size() > 9) continue;
    const bool gone = ::kill(pid_t(std::stol(pid)), 0) != 0 && errno == ESRCH;
    // Exactly dest.<pid>.tmp (not another copy whose name dest begins).
    const bool dests = dot + 1 == own.size() && name.compare(0, own.size(), own) == 0;
    if (dests || gone) stale.push_back(entry.path());
  }
  for (const auto& path : stale) core::remove_tree(path, ec);
}

// What a checked copy looked like when it was renamed into place (size,
// modification time, inode): a copy changed since (written over in place,
// even at the same size) no longer matches and is fetched again rather
// than trained on.
std::string fingerprint(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return "";
  return std::to_string(st.st_size) + " " + std::to_string(st.st_mtim.tv_sec) + "." +
         std::to_string(st.st_mtim.tv_nsec) + " " + std::to_string(st.st_ino) + "\n";
}

bool checked_copy(const std::string& dest, uint64_t size) {
  if (!has_size(dest, size)) return false;
  std::ifstream in(dest + ".ok");
  std::string seen((std::istreambuf_iterator<char>(in)), {});
  return !seen.empty() && seen == fingerprint(dest);
}

// The shipped/ folder: made (0700) if absent, and refused unless it is a
// directory of this user's closed to others.
void private_folder(const std::string& dir) {
  // Made with its mode at once: another fetcher of the host must never see
  // it open to others, even for an instant.
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    throw Error("cannot make " + dir + ": " + std::strerror(errno));
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) throw Error("cannot make " + dir + ": " + std::strerror(errno));
  if (!S_ISDIR(st.st_mode) || st.st_uid != ::getuid() || (st.st_mode & 077))
    throw Error(dir + " must be a directory of this user's with mode 0700 (remove it: it only holds copies)");
}

// A descriptor of `path` (made if absent) holding flock `operation`
// (LOCK_EX, LOCK_SH), waited for; Error naming the path. The file locked
// is the one at `path` when the lock is had: a sweep removes the lock
// files of a copy it removed while it holds them (forget_copy), and a
// lock taken on such a file, opened before it went, is taken again on the
// file now there.
int locked_file(const std::string& path, int operation) {
  for (;;) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) throw Error("cannot open " + path + ": " + std::strerror(errno));
    while (::flock(fd, operation) != 0) {
      if (errno == EINTR) continue;
      const std::string why = std::strerror(errno);
      ::close(fd);
      throw Error("cannot lock " + path + ": " + why);
    }
    struct stat held {
    }, named{};
    if (::fstat(fd, &held) == 0 && ::lstat(path.c_str(), &named) == 0 && held.st_dev == named.st_dev &&
        held.st_ino == named.st_ino)
      return fd;
    ::close(fd);
  }
}

// An exclusive flock on `path` (made if absent) for as long as it lives:
// one process of the host makes a copy while the others wait for it.
class HostLock {
 public:
  explicit HostLock(const std::string& path) : fd_(locked_file(path, LOCK_EX)) {}
  ~HostLock() { ::close(fd_); }  // closing drops the lock
  HostLock(const HostLock&) = delete;
  HostLock& operator=(const HostLock&) = delete;

 private:
  int fd_;
};

void hold_copy(const std::string& copy);
void remove_unused_copies(const std::string& dir, const std::string& keep);

// This host's copy of `f` (fetched when absent or changed). With
// `under_lock`, the lock is taken even when the copy is there, and
// `under_lock(copy)` runs while it is held.
std::string fetch_copy(const ShippedFile& f, const std::function<void(const std::string&)>& under_lock = nullptr) {
  // The session directory may not exist yet (an embedded cluster's
  // workers fall back to this user's default one).
  const std::string session = core::session_dir();
  core::ensure_session_dir(session);
  const std::string dir = shipped_copies_dir(session);
  private_folder(dir);
  const std::string dest = dir + "/" + copy_name(f);
  // Held before it is looked at: no sweep removes it while this process
  // lives.
  hold_copy(dest);
  if (!under_lock && checked_copy(dest, f.size)) return dest;
  // One process of the host fetches; the others wait here and read its copy.
  const HostLock lock(dest + ".lock");
  if (checked_copy(dest, f.size)) {
    if (under_lock) under_lock(dest);
    return dest;
  }
  remove_stale_parts(dir, dest);
  const std::string tmp = dest + "." + std::to_string(::getpid()) + ".tmp";
  try {
    fetch_into(f, tmp);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  if (::rename(tmp.c_str(), dest.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    throw Error("cannot write " + dest + " (a copy of " + f.path + "): " + why);
  }
  try {
    core::write_session_file(dir, std::filesystem::path(dest).filename().string() + ".ok", fingerprint(dest));
  } catch (const Error&) {
    // The copy is whole and checked; without its record the next user
    // fetches it again.
  }
  if (under_lock) {
    under_lock(dest);  // a directory's archive: its unpacker sweeps once, with its copy in place
  } else {
    remove_unused_copies(dir, dest);
  }
  return dest;
}

}  // namespace

std::string local_copy(const ShippedFile& f) {
  try {
    return fetch_copy(f);
  } catch (const Error& e) {
    throw Error("on " + this_host() + ", making this host's copy of " + f.path + ": " + e.what());
  }
}

namespace {

bool writable_folder(const std::string& dir) {
  struct stat st {};
  return !dir.empty() && ::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode) &&
         ::access(dir.c_str(), W_OK | X_OK) == 0;
}

bool in_memory(const std::string& dir) {
  struct statfs fs {};
  return ::statfs(dir.c_str(), &fs) == 0 && (fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC);
}

}  // namespace

std::string shipping_folder() {
  const std::string given = core::env_value(core::kEnvShippingDir);
  if (!given.empty()) return given;
  const std::vector<std::string> candidates = {core::env_value("TMPDIR"), "/var/tmp", "/tmp"};
  for (const auto& dir : candidates)
    if (writable_folder(dir) && !in_memory(dir)) return dir;
  for (const auto& dir : candidates)
    if (writable_folder(dir)) return dir;
  const std::string session = core::session_dir();
  core::ensure_session_dir(session);
  return session;
}

namespace {

// The archive of `files`, written to a file of shipping_folder() that is
// unlinked at once: its pieces are read through the descriptor when hosts
// fetch them (the driver holds none of it in memory), and its disk is
// freed when the last of them goes. ConfigError when it cannot be
// written, or would not fit the folder's free space (checked before).
ShippedFile ship_archive(Runtime& rt, const std::string& root, const std::vector<core::PackedFile>& files) {
  const std::string folder = shipping_folder();
  ShippedFile f;
  f.path = root;
  f.size = core::packed_size(files);
  struct statvfs room {};
  if (::statvfs(folder.c_str(), &room) == 0 && f.size > uint64_t(room.f_bavail) * room.f_frsize)
    throw ConfigError("its archive (" + std::to_string(f.size) + " bytes) does not fit " + folder + " (" +
                      std::to_string(uint64_t(room.f_bavail) * room.f_frsize) +
                      " bytes free; set TROUPE_SHIPPING_DIR to another folder)");
  std::string name = folder + "/.shipping-XXXXXX";
  const int fd = ::mkostemp(name.data(), O_CLOEXEC);
  if (fd < 0)
    throw ConfigError("cannot ship the directory " + root + ": cannot make its archive in " + folder + ": " +
                      std::strerror(errno) + " (set TROUPE_SHIPPING_DIR to another folder)");
  ::unlink(name.c_str());
  auto file = std::make_shared<const client::OpenFile>(fd);
  // Reserved before it is written: two drivers that passed the check
  // above at once both failed half way (probe 27a).
  if (const int err = f.size ? ::posix_fallocate(fd, 0, off_t(f.size)) : 0; err == ENOSPC)
    throw ConfigError("its archive (" + std::to_string(f.size) + " bytes) does not fit " + folder +
                      " (set TROUPE_SHIPPING_DIR to another folder)");
  Digest digest;
  uint64_t written = 0;
  core::pack_files(files, [&](const std::byte* p, size_t n) {
    digest.add(p, n);
    for (size_t done = 0; done < n;) {
      const ssize_t w = ::write(fd, p + done, n - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0)
        throw ConfigError("cannot ship the directory " + root + ": cannot write its archive in " + folder + ": " +
                          std::strerror(errno) + " (set TROUPE_SHIPPING_DIR to another folder)");
      done += size_t(w);
    }
    written += n;
  });
  if (written != f.size)
    throw Error("the archive of " + root + " came out " + std::to_string(written) + " bytes, not " +
                std::to_string(f.size));
  f.sha256 = digest.hex_digest();
  auto store = rt.core()->service<client::ObjectStore>();
  for (uint64_t off = 0; off < f.size; off += kShippedChunkBytes)
    f.chunks.emplace_back(store->put(
        client::file_piece_value(file, root + " (packed)", off, std::min(kShippedChunkBytes, f.size - off))));
  return f;
}

}  // namespace

ShippedDir ship_dir(Runtime& rt, const std::string& dir, const DirShipping& how, std::vector<std::string>* names) {
  std::error_code ec;
  std::string root = std::filesystem::absolute(dir, ec).lexically_normal().string();
  if (ec) root = dir;
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  const std::string leave_out = "leave files out with " + how.leave_out;
  ShippedDir d;
  d.path = root;
  std::random_device random;
  char shipment[17];
  std::snprintf(shipment, sizeof shipment, "%08x%08x", random(), random());
  d.shipment = shipment;
  try {
    const auto files = core::files_to_pack(root, how.excludes);
    d.files = files.size();
    for (const auto& f : files) d.bytes += f.size;
    d.archive = ship_archive(rt, root, files);
    if (names)
      for (const auto& f : files) names->push_back(f.name);
  } catch (const ConfigError& e) {
    // Its own (the folder for the archive, not which files go) as they are.
    const std::string what = e.what();
    if (what.rfind("cannot ship " + root, 0) == 0 || what.rfind("cannot ship the directory " + root, 0) == 0) throw;
    throw ConfigError("cannot ship the directory " + root + ": " + what + " (" + leave_out + ")");
  }
  return d;
}

namespace {

// The copies this process runs in: a shared flock on each NAME.d.use, held
// until the process ends (the kernel lets go however it ends).
void hold_copy(const std::string& copy) {
  static std::mutex mu;
  static std::set<std::string> held;
  std::lock_guard lock(mu);
  if (held.count(copy)) return;
  locked_file(copy + ".use", LOCK_SH);  // never closed: the lock lasts as long as the process
  // In use again: a sweep that saw it unused starts counting anew.
  ::unlink((copy + ".unused").c_str());
  held.insert(copy);
}

// How long a copy must have been seen unused before a sweep removes it
// (TROUPE_SHIPPED_COPY_GRACE_S, 600 s by default): a run whose group is
// placed anew after a failure holds no copy between its slots' release
// and the new slots' prepare, and must find what its ranks wrote there.
std::chrono::seconds unused_grace() {
  const std::string v = core::env_value(core::kEnvShippedCopyGrace);
  char* end = nullptr;
  const long long s = v.empty() ? -1 : std::strtoll(v.c_str(), &end, 10);
  return std::chrono::seconds(s >= 0 && end && *end == '\0' ? s : 600);
}

// Removes `path` (a copy, or a part a killed unpacker left): renamed
// aside first, so that a tree only half removed never keeps a copy's name
// (the next sweep finishes it).
void remove_aside(const std::string& path, const std::string& why) {
  std::string doomed = path;
  if (!path.ends_with(".tmp")) {
    doomed = path + "." + std::to_string(::getpid()) + ".tmp";
    if (::rename(path.c_str(), doomed.c_str()) != 0) {
      TROUPE_LOG_WARN("shipped copies: cannot remove {}: {}", path, std::strerror(errno));
      return;
    }
  }
  std::error_code ec;
  core::remove_tree(doomed, ec);
  if (ec)
    TROUPE_LOG_WARN("shipped copies: cannot remove {} ({}): {}", doomed, why, ec.message());
  else
    TROUPE_LOG_INFO("shipped copies: removed {} ({})", path, why);
}

// The copy a name of SESSION/shipped belongs to: itself for a copy (a
// file DIGEST16-NAME, a directory DIGEST16-NAME.SHIPMENT.d), NAME.d for the
// parts NAME.d.<pid>.tmp of an unpack (or a removal) cut short; "" for the
// rest (records, locks, markers, a file fetch's parts, which
// remove_stale_parts clears).
std::string copy_of(const std::string& name) {
  for (const char* record : {".lock", ".ok", ".use", ".unused"})
    if (name.ends_with(record)) return "";
  if (name.ends_with(".d")) return name;
  const size_t d = name.rfind(".d.");
  if (d != std::string::npos && name.ends_with(".tmp")) {
    const std::string pid = name.substr(d + 3, name.size() - d - 3 - 4);
    if (pid.empty() || pid.find_first_not_of("0123456789") != std::string::npos) return "";
    return name.substr(0, d + 2);
  }
  if (name.ends_with(".tmp") || name.size() < 18 || name[16] != '-') return "";
  for (size_t i = 0; i < 16; ++i)
    if (!std::isxdigit(static_cast<unsigned char>(name[i])) || std::isupper(static_cast<unsigned char>(name[i])))
      return "";
  return name;
}

// Removes the records of the copy `base`, which is gone: its .ok and
// .unused, and its .use and .lock (each one shipment's, so they piled up
// per run on a long-lived node) while this process holds them, so that
// no other holds a lock on a file no longer there (locked_file takes its
// lock again on the new file). Called with base.use held exclusively, or
// with base.use absent.
void forget_copy(const std::string& base) {
  ::unlink((base + ".unused").c_str());
  ::unlink((base + ".ok").c_str());
  const int lock = ::open((base + ".lock").c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (lock >= 0) {
    if (::flock(lock, LOCK_EX | LOCK_NB) == 0) ::unlink((base + ".lock").c_str());
    ::close(lock);
  }
  ::unlink((base + ".use").c_str());
}

// The records of copies that are gone (a .use with no copy beside it: one
// removed before forget_copy, or by an older troupe), dropped when no
// process holds them.
void forget_gone_copies(const std::string& dir, const std::vector<std::filesystem::directory_entry>& entries) {
  std::set<std::string> names;
  for (const auto& entry : entries) names.insert(entry.path().filename().string());
  for (const auto& name : names) {
    // A copy of a shipped file named *.use has a .use of its own.
    if (!name.ends_with(".use") || names.count(name + ".use")) continue;
    const std::string copy = name.substr(0, name.size() - 4);
    if (copy_of(copy) != copy || names.count(copy)) continue;
    const std::string base = dir + "/" + copy;
    const int fd = ::open((base + ".use").c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) continue;
    struct stat use {
    }, st{};
    // Empty (a record), held by none, and still no copy (a fetcher holds
    // .use before it makes one).
    if (::fstat(fd, &use) == 0 && S_ISREG(use.st_mode) && use.st_size == 0 && ::flock(fd, LOCK_EX | LOCK_NB) == 0 &&
        ::lstat(base.c_str(), &st) != 0 && errno == ENOENT)
      forget_copy(base);
    ::close(fd);
  }
}

// Removes the host's other copies, files and directories, that no process
// has used for unused_grace() (a finished job's data set, a working
// directory and what its ranks wrote there), and parts that killed
// unpackers left. A copy is first marked NAME.d.unused
// by a sweep that finds it unused; a later sweep past the grace removes
// it, and its records (forget_copy).
void remove_unused_copies(const std::string& dir, const std::string& keep) {
  const auto grace = unused_grace();
  std::error_code ec;
  std::vector<std::filesystem::directory_entry> entries;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) entries.push_back(entry);
  forget_gone_copies(dir, entries);
  for (const auto& entry : entries) {
    const std::string name = entry.path().filename().string(), copy = copy_of(name);
    if (copy.empty() || dir + "/" + copy == keep || entry.is_symlink(ec)) continue;
    const std::string base = dir + "/" + copy;
    int fd = ::open((base + ".use").c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) continue;
    // Closed (and the lock let go) however this ends: a lock kept would
    // block every later user of the copy.
    std::unique_ptr<int, void (*)(int*)> closer(&fd, [](int* p) { ::close(*p); });
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) continue;
    if (name != copy) {
      remove_aside(entry.path().string(), "left by a process that was killed");
      struct stat gone {};
      if (::lstat(base.c_str(), &gone) != 0 && errno == ENOENT) forget_copy(base);
      continue;
    }
    const std::string marker = base + ".unused";
    struct stat st {};
    if (::stat(marker.c_str(), &st) != 0) {
      // Best effort: a sweep that cannot mark leaves the copy for later.
      const int m = ::open(marker.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
      if (m >= 0) ::close(m);
    } else if (std::chrono::system_clock::now() - std::chrono::system_clock::from_time_t(st.st_mtime) >= grace) {
      remove_aside(base, "no process has used it for " + std::to_string(grace.count()) + " s");
      forget_copy(base);
    }
  }
}

std::string unpack_copy(const ShippedDir& d) {
  const std::string session = core::session_dir();
  core::ensure_session_dir(session);
  const std::string dir = shipped_copies_dir(session);
  private_folder(dir);
  bool shipment_ok = d.shipment.size() == 16;
  for (char c : d.shipment) shipment_ok = shipment_ok && ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'));
  if (!shipment_ok) throw Error("a shipped directory's shipment id is not 16 hex digits (" + d.path + ")");
  const std::string dest = dir + "/" + copy_name(d.archive) + "." + d.shipment.substr(0, 8) + ".d";
  // Held before the copy is looked at: no other process removes it from
  // here on.
  hold_copy(dest);
  struct stat st {};
  if (::lstat(dest.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return dest;
  const HostLock lock(dest + ".lock");
  if (::lstat(dest.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return dest;
  remove_stale_parts(dir, dest);
  // The archive, checked against its digest; unpacked, it is not needed.
  // Read and removed under its lock: another shipment of the same files
  // (the same archive) may be unpacking it too, and fetches it again if
  // this one removed it first.
  // Mapped, not read into memory: a folder of gigabytes unpacks through
  // the page cache.
  std::unique_ptr<void, std::function<void(void*)>> mapped;
  fetch_copy(d.archive, [&](const std::string& archive) {
    const int fd = ::open(archive.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw Error("cannot read " + archive + ": " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || uint64_t(st.st_size) != d.archive.size || st.st_size == 0) {
      ::close(fd);
      throw Error("cannot read " + archive + ": it is not the " + std::to_string(d.archive.size) +
                  " bytes it was checked at");
    }
    void* p = ::mmap(nullptr, size_t(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
    const std::string why = std::strerror(errno);
    ::close(fd);  // the mapping keeps the file
    if (p == MAP_FAILED) throw Error("cannot read " + archive + ": " + why);
    mapped = {p, [size = size_t(st.st_size)](void* q) { ::munmap(q, size); }};
    ::unlink(archive.c_str());
    ::unlink((archive + ".ok").c_str());
  });
  const std::string staging = dest + "." + std::to_string(::getpid()) + ".tmp";
  std::error_code ec;
  try {
    core::unpack_files(static_cast<const std::byte*>(mapped.get()), size_t(d.archive.size), staging);
  } catch (...) {
    core::remove_tree(staging, ec);
    throw;
  }
  if (::rename(staging.c_str(), dest.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    core::remove_tree(staging, ec);
    throw Error("cannot make " + dest + ": " + why);
  }
  remove_unused_copies(dir, dest);
  return dest;
}

}  // namespace

std::string local_dir(const ShippedDir& d) {
  try {
    return unpack_copy(d);
  } catch (const Error& e) {
    throw Error("on " + this_host() + ", making this host's copy of the directory " + d.path + ": " + e.what());
  }
}

std::string path_in_copy(const ShippedDir& d, const std::string& copy, const std::string& given) {
  if (d.path.empty()) return given;
  // "/dir/../x" is not inside /dir.
  const std::string path = std::filesystem::path(given).lexically_normal().string();
  if (path == d.path) return copy;
  const std::string prefix = d.path == "/" ? "/" : d.path + "/";
  if (path.rfind(prefix, 0) == 0) return copy + "/" + path.substr(prefix.size());
  return given;
}

std::string shipped_copies_dir(const std::string& session_dir) { return session_dir + "/shipped"; }

void remove_shipped_copies(const std::string& session_dir) {
  std::error_code ec;
  core::remove_tree(shipped_copies_dir(session_dir), ec);
}

std::string shipped_path(const std::vector<ShippedFile>& files, const std::string& path) {
  for (const auto& f : files)
    if (f.path == path) return local_copy(f);
  return path;
}

std::string DriverPaths::use(const std::vector<ShippedFile>& files, const std::string& path) {
  std::string local = shipped_path(files, path);
  std::lock_guard lock(mu_);
  if (local != path && std::find(copies_.begin(), copies_.end(), std::pair(local, path)) == copies_.end())
    copies_.emplace_back(local, path);
  return local;
}

std::string DriverPaths::named(std::string text) const {
  std::lock_guard lock(mu_);
  for (const auto& [copy, original] : copies_)
    for (size_t at = text.find(copy); at != std::string::npos; at = text.find(copy, at + original.size()))
      text.replace(at, copy.size(), original);
  return text;
}

void DriverPaths::rethrow(const std::exception& e) const {
  const std::string text = named(e.what());
  if (text == e.what()) throw;
  // A registered class as itself; troupe's own kinds as the kind the wire
  // carries them as (which is all the driver sees of them).
  if (const std::string name = core::registered_error_name(e); !name.empty())
    if (auto renamed = core::make_registered_error(name, text)) std::rethrow_exception(renamed);
  if (dynamic_cast<const ActorDied*>(&e)) throw ActorDied(text);
  if (dynamic_cast<const Timeout*>(&e)) throw Timeout(text);
  if (dynamic_cast<const ConfigError*>(&e)) throw ConfigError(text);
  if (dynamic_cast<const Aborted*>(&e)) throw Aborted(text);
  if (dynamic_cast<const DecodeError*>(&e)) throw DecodeError(text);
  if (dynamic_cast<const ConnectionError*>(&e)) throw ConnectionError(text);
  if (dynamic_cast<const Error*>(&e)) throw Error(text);
  throw;
}

}  // namespace troupe
