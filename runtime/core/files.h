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
#include <system_error>

namespace troupe::core {

// Removes `path` and everything under it, not following symbolic links (a
// link is removed, not its target). Returns the entries removed: 0 when the
// path does not exist, which is not an error. On failure sets `ec` (the
// first error) and returns what was removed before it.
std::uintmax_t remove_tree(const std::filesystem::path& path, std::error_code& ec);
// As above; throws std::filesystem::filesystem_error naming the path.
std::uintmax_t remove_tree(const std::filesystem::path& path);

}  // namespace troupe::core
