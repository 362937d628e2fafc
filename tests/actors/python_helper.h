// Runs short scripts with Debian's /usr/bin/python3 (which has python3-torch,
// numpy and sklearn; the python3 first on PATH may not) so tests can compare
// against the real PyTorch/NumPy. Tests skip when it is missing.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>

namespace troupe::actors {

inline constexpr const char* kSystemPython = "/usr/bin/python3";

// Runs `script`; returns its stdout; throws with the exit status on failure.
inline std::string run_python(const std::string& script) {
  char path[] = "/tmp/troupe_py_XXXXXX";
  int fd = mkstemp(path);
  if (fd < 0) throw std::runtime_error("mkstemp failed");
  ::close(fd);
  {
    std::ofstream f(path);
    f << script;
  }
  std::string cmd = std::string(kSystemPython) + " " + path + " 2>&1";
  std::FILE* p = popen(cmd.c_str(), "r");
  if (!p) {
    std::remove(path);
    throw std::runtime_error("popen failed");
  }
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int status = pclose(p);
  std::remove(path);
  if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    throw std::runtime_error("python script failed: " + out);
  }
  return out;
}

inline bool python_can_import(const std::string& modules) {
  if (::access(kSystemPython, X_OK) != 0) return false;
  std::string cmd = std::string(kSystemPython) + " -c 'import " + modules + "' >/dev/null 2>&1";
  return std::system(cmd.c_str()) == 0;
}

inline bool python_has_torch() {
  static const bool has = python_can_import("torch");
  return has;
}

inline bool python_has_numpy() {
  static const bool has = python_can_import("numpy");
  return has;
}

}  // namespace troupe::actors
