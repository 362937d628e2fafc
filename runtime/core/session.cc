#include "troupe/runtime/core/session.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "troupe/runtime/core/errors.h"

namespace troupe::core {

std::string session_dir() {
  if (const char* d = std::getenv("TROUPE_SESSION_DIR"); d && *d) return d;
  return "/tmp/troupe-" + std::to_string(getuid());
}

void ensure_session_dir(const std::string& dir) {
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    throw Error("cannot create session directory " + dir + ": " + std::strerror(errno));
}

void write_session_file(const std::string& dir, const std::string& name, const std::string& text, int mode) {
  std::string tmp = dir + "/." + name + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, mode);
  if (fd < 0) throw Error("cannot write " + tmp + ": " + std::strerror(errno));
  fchmod(fd, mode);
  size_t off = 0;
  while (off < text.size()) {
    ssize_t n = ::write(fd, text.data() + off, text.size() - off);
    if (n <= 0) {
      ::close(fd);
      throw Error("cannot write " + tmp + ": " + std::strerror(errno));
    }
    off += n;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), (dir + "/" + name).c_str()) != 0)
    throw Error("cannot rename " + tmp + ": " + std::strerror(errno));
}

std::string read_session_file(const std::string& dir, const std::string& name) {
  std::ifstream f(dir + "/" + name);
  if (!f) return "";
  std::stringstream s;
  s << f.rdbuf();
  std::string t = s.str();
  while (!t.empty() && (t.back() == '\n' || t.back() == ' ')) t.pop_back();
  return t;
}

}  // namespace troupe::core
