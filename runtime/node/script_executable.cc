#include "troupe/runtime/node/script_executable.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "troupe/runtime/core/errors.h"

namespace troupe::node {
namespace {

constexpr size_t kMaxScript = 64 * 1024;

std::string content_name(const std::string& text) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(text.data(), text.size(), md, &len, EVP_sha256(), nullptr);
  std::string hex;
  char byte[3];
  for (unsigned int i = 0; i < 8 && i < len; ++i) {
    std::snprintf(byte, sizeof byte, "%02x", md[i]);
    hex += byte;
  }
  return "launcher-" + hex;
}

void private_directory(const std::string& dir) {
  std::error_code ec;
  const bool made = std::filesystem::create_directories(dir, ec);
  if (ec) throw Error("cannot make the worker launchers' directory " + dir + ": " + ec.message());
  if (made) ::chmod(dir.c_str(), 0700);  // an older one is checked, not changed
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) throw Error("cannot read " + dir + ": " + std::strerror(errno));
  if (!S_ISDIR(st.st_mode) || st.st_uid != ::getuid() || (st.st_mode & 077))
    throw Error("the worker launchers' directory " + dir + " must be a directory of this user's with mode 0700");
}

bool same_content(const std::string& path, const std::string& text) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return false;
  std::string got(text.size() + 1, '\0');
  size_t n = 0;
  for (ssize_t r; n < got.size() && (r = ::read(fd, got.data() + n, got.size() - n)) > 0;) n += size_t(r);
  ::close(fd);
  got.resize(n);
  return got == text;
}

}  // namespace

bool is_script_text(const std::string& executable) { return executable.rfind("#!", 0) == 0; }

std::string script_executable(const std::string& text, const std::string& dir) {
  if (text.size() > kMaxScript)
    throw Error("a worker launcher script of " + std::to_string(text.size()) + " bytes (at most " +
                std::to_string(kMaxScript) + ")");
  private_directory(dir);
  const std::string path = dir + "/" + content_name(text);
  if (same_content(path, text)) return path;
  // Written whole under a name of its own, then renamed: a worker started
  // meanwhile from another spawn never runs half a script.
  const std::string tmp = path + "." + std::to_string(::getpid()) + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0700);
  if (fd < 0) throw Error("cannot write the worker launcher " + tmp + ": " + std::strerror(errno));
  size_t n = 0;
  for (ssize_t w; n < text.size() && (w = ::write(fd, text.data() + n, text.size() - n)) > 0;) n += size_t(w);
  const bool whole = n == text.size();
  const int saved = errno;
  ::close(fd);
  if (!whole || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(whole ? errno : saved);
    ::unlink(tmp.c_str());
    throw Error("cannot write the worker launcher " + path + ": " + why);
  }
  return path;
}

}  // namespace troupe::node
