#include "troupe/runtime/core/files.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <string>
#include <utility>
#include <vector>

#include "troupe/runtime/core/errors.h"

namespace troupe::core {

namespace {

// nftw's callback has no user argument: the walk's state, per thread.
thread_local std::uintmax_t removed_count = 0;
thread_local int first_error = 0;

int remove_entry(const char* path, const struct stat* /*st*/, int type, struct FTW* /*ftw*/) {
  // Post-order (FTW_DEPTH): a directory comes after everything in it. One
  // nftw could not read (FTW_DNR) is still removed when it is empty.
  int rc = (type == FTW_DP || type == FTW_DNR) ? ::rmdir(path) : ::unlink(path);
  if (rc == 0) {
    ++removed_count;
  } else if (errno != ENOENT && first_error == 0) {
    first_error = errno;
  }
  return 0;  // keep going: remove as much as possible
}

}  // namespace

std::uintmax_t remove_tree(const std::filesystem::path& given, std::error_code& ec) {
  ec.clear();
  // "link/" would make lstat follow a link to a directory and empty its
  // target: look at the path without trailing separators.
  std::string text = given.native();
  while (text.size() > 1 && text.back() == '/') text.pop_back();
  const std::filesystem::path path(text);
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno != ENOENT) ec = std::error_code(errno, std::generic_category());
    return 0;
  }
  if (!S_ISDIR(st.st_mode)) {
    if (::unlink(path.c_str()) != 0) {
      ec = std::error_code(errno, std::generic_category());
      return 0;
    }
    return 1;
  }
  removed_count = 0;
  first_error = 0;
  if (::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS) != 0 && first_error == 0) first_error = errno;
  if (first_error != 0) ec = std::error_code(first_error, std::generic_category());
  return removed_count;
}

std::uintmax_t remove_tree(const std::filesystem::path& path) {
  std::error_code ec;
  auto n = remove_tree(path, ec);
  if (ec) throw std::filesystem::filesystem_error("cannot remove", path, ec);
  return n;
}

namespace {

constexpr const char* kOwnerLock = "owner.lock";

// Whether a directory's owner still holds its lock. One without the lock
// file was made by an older troupe, or a moment ago and is not locked yet:
// only an old one is taken as orphaned.
bool still_owned(const std::string& dir, const struct stat& st) {
  const int fd = ::open((dir + "/" + kOwnerLock).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return ::time(nullptr) - st.st_mtime < 600;
  const bool held = ::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  ::close(fd);
  return held;
}

}  // namespace

OwnedDir OwnedDir::make(const std::string& parent, const std::string& prefix) {
  OwnedDir d;
  std::string dir = parent + "/" + prefix + std::to_string(::getpid()) + "-XXXXXX";
  if (!::mkdtemp(dir.data())) throw Error("cannot make a directory " + dir + ": " + std::strerror(errno));
  d.path_ = dir;
  d.lock_fd_ = ::open((dir + "/" + kOwnerLock).c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (d.lock_fd_ < 0 || ::flock(d.lock_fd_, LOCK_EX) != 0)
    throw Error("cannot lock " + dir + "/" + kOwnerLock + ": " + std::strerror(errno));  // d removes it
  return d;
}

OwnedDir::OwnedDir(OwnedDir&& o) noexcept
    : path_(std::exchange(o.path_, std::string())), lock_fd_(std::exchange(o.lock_fd_, -1)) {}

OwnedDir& OwnedDir::operator=(OwnedDir&& o) noexcept {
  if (this != &o) {
    remove();
    path_ = std::exchange(o.path_, std::string());
    lock_fd_ = std::exchange(o.lock_fd_, -1);
  }
  return *this;
}

void OwnedDir::remove() {
  if (!path_.empty()) {
    std::error_code ec;
    remove_tree(path_, ec);
    path_.clear();
  }
  if (lock_fd_ >= 0) ::close(std::exchange(lock_fd_, -1));
}

// Through POSIX readdir, as remove_tree (no std::filesystem here).
void remove_orphaned_dirs(const std::string& parent, const std::string& prefix) {
  DIR* d = ::opendir(parent.c_str());
  if (!d) return;
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d))
    if (std::string(e->d_name).rfind(prefix, 0) == 0) names.emplace_back(e->d_name);
  ::closedir(d);
  for (const std::string& name : names) {
    const std::string path = parent + "/" + name;
    const std::string rest = name.substr(prefix.size());
    const size_t dash = rest.find('-');
    if (dash == 0 || dash == std::string::npos || rest.find_first_not_of("0123456789") != dash) continue;
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::getuid()) continue;
    pid_t owner = 0;
    if (std::from_chars(rest.data(), rest.data() + dash, owner).ec != std::errc() || owner <= 0) continue;
    if (::kill(owner, 0) == 0 || errno != ESRCH || still_owned(path, st)) continue;
    std::error_code ignored;
    remove_tree(path, ignored);
  }
}

}  // namespace troupe::core
