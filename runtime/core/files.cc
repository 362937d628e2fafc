#include "troupe/runtime/core/files.h"

#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <string>

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

}  // namespace troupe::core
