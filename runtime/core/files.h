// Removing a directory tree without libstdc++'s filesystem library.
//
// A binary linked against PyPI's LibTorch 2.x can bind std::filesystem calls
// to the copies that libtorch.so exports (built by its own toolchain), and
// std::filesystem::remove_all on a non-empty directory jumped to address 0
// there (the GPU lane, docs/runtime.md). remove_tree does the same work
// through POSIX nftw(), which LibTorch does not carry.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <system_error>

namespace troupe::core {

// Removes `path` and everything under it, not following symbolic links (a
// link is removed, not its target). Returns the entries removed: 0 when the
// path does not exist, which is not an error. On failure sets `ec` (the
// first error) and returns what was removed before it.
std::uintmax_t remove_tree(const std::filesystem::path& path, std::error_code& ec);
// As above; throws std::filesystem::filesystem_error naming the path.
std::uintmax_t remove_tree(const std::filesystem::path& path);

// A scratch directory of this process's own, PARENT/PREFIX<pid>-XXXXXX,
// holding PATH/owner.lock (flock) while the object lives: its lock goes
// with the process however it ends, which is how remove_orphaned_dirs
// tells a dead owner's directory from a live one's, also a live one in
// another PID namespace sharing PARENT (whose pid means nothing here).
class OwnedDir {
 public:
  OwnedDir() = default;
  // Error naming the directory when it cannot be made or locked.
  static OwnedDir make(const std::string& parent, const std::string& prefix);
  ~OwnedDir() { remove(); }
  OwnedDir(OwnedDir&& o) noexcept;
  OwnedDir& operator=(OwnedDir&& o) noexcept;
  OwnedDir(const OwnedDir&) = delete;
  OwnedDir& operator=(const OwnedDir&) = delete;

  const std::string& path() const { return path_; }
  bool empty() const { return path_.empty(); }
  // Removes the tree, then lets the lock go (until the tree is gone no one
  // else removes it).
  void remove();

 private:
  std::string path_;
  int lock_fd_ = -1;
};

// Removes PARENT/PREFIX<pid>-* directories of this user that an OwnedDir's
// process left (it crashed, or was killed): its pid no longer runs and its
// owner.lock is free; one without the lock file (an older troupe's, or one
// not locked yet) once it is 10 minutes old.
void remove_orphaned_dirs(const std::string& parent, const std::string& prefix);

}  // namespace troupe::core
