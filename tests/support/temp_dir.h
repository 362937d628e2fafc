// Scratch directories for tests: one per test process and name, emptied on
// creation, under the system's temporary directory.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>

namespace troupe::test {

// An empty directory troupe-test-PID-NAME in the temporary directory
// (whatever an earlier run left there is removed first).
inline std::filesystem::path fresh_dir(const std::string& name) {
  auto p = std::filesystem::temp_directory_path() / ("troupe-test-" + std::to_string(::getpid()) + "-" + name);
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p;
}

}  // namespace troupe::test
