// Scratch directories for tests, under the system's temporary directory:
// fresh_dir() for one per test process and name, emptied on creation;
// make_temp_dir() for a new unique one (safe to call from forked ranks).
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>

#include "troupe/runtime/core/files.h"

namespace troupe::test {

// An empty directory troupe-test-PID-NAME in the temporary directory
// (whatever an earlier run left there is removed first).
inline std::filesystem::path fresh_dir(const std::string& name) {
  auto p = std::filesystem::temp_directory_path() / ("troupe-test-" + std::to_string(::getpid()) + "-" + name);
  troupe::core::remove_tree(p);
  std::filesystem::create_directories(p);
  return p;
}

// A new, empty directory troupe-TAG-XXXXXX (mkdtemp), removed by the caller
// with remove_dir().
inline std::string make_temp_dir(const std::string& tag) {
  std::string templ = (std::filesystem::temp_directory_path() / ("troupe-" + tag + "-XXXXXX")).string();
  if (::mkdtemp(templ.data()) == nullptr) throw std::system_error(errno, std::generic_category(), "mkdtemp " + templ);
  return templ;
}

// Removes `dir` and what is in it; errors are ignored (cleanup only).
inline void remove_dir(const std::string& dir) {
  std::error_code ec;
  troupe::core::remove_tree(dir, ec);
}

}  // namespace troupe::test
