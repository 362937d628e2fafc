#include "troupe/runtime/core/session.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/process.h"
#include "troupe/runtime/core/worker_env.h"

namespace troupe::core {

namespace {

std::string octal_mode(mode_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

// "" when `dir` is a directory of ours with mode 0700, else what is wrong.
std::string unsafe_reason(const struct stat& st) {
  if (S_ISLNK(st.st_mode)) return "it is a symbolic link";
  if (!S_ISDIR(st.st_mode)) return "it is not a directory";
  if (st.st_uid != ::geteuid() || (st.st_mode & 07777) != 0700)
    return "it is owned by uid " + std::to_string(st.st_uid) + " with mode " + octal_mode(st.st_mode) +
           ", and must be owned by uid " + std::to_string(::geteuid()) + " with mode 0700";
  return "";
}

[[noreturn]] void refuse(const std::string& dir, const std::string& why) {
  throw Error("refusing session directory " + dir + ": " + why +
              " (another user could read the cluster token or plant pid files; remove it, or set " + kEnvSessionDir +
              " to a directory of yours with mode 0700)");
}

bool usable_xdg_dir(const std::string& xdg) {
  struct stat st {};
  return ::lstat(xdg.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == ::geteuid() &&
         ::access(xdg.c_str(), W_OK | X_OK) == 0;
}

void write_all(int fd, const std::string& text, const std::string& path) {
  size_t off = 0;
  while (off < text.size()) {
    ssize_t n = ::write(fd, text.data() + off, text.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw Error("cannot write " + path + ": " + std::strerror(errno));
    off += static_cast<size_t>(n);
  }
}

}  // namespace

std::string session_dir() {
  if (std::string d = env_value(kEnvSessionDir); !d.empty()) return d;
  if (std::string xdg = env_value("XDG_RUNTIME_DIR"); !xdg.empty() && usable_xdg_dir(xdg)) return xdg + "/troupe";
  return "/tmp/troupe-" + std::to_string(::geteuid());
}

void check_session_dir(const std::string& dir) {
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) {
    if (errno == ENOENT) return;
    refuse(dir, std::strerror(errno));
  }
  if (std::string why = unsafe_reason(st); !why.empty()) refuse(dir, why);
}

void ensure_session_dir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) == 0) {
    // mkdir's mode passes through the umask; make it exactly 0700.
    if (::chmod(dir.c_str(), 0700) != 0) refuse(dir, std::string("chmod failed: ") + std::strerror(errno));
  } else if (errno != EEXIST) {
    throw Error("cannot create session directory " + dir + ": " + std::strerror(errno));
  }
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) refuse(dir, std::strerror(errno));
  if (std::string why = unsafe_reason(st); !why.empty()) refuse(dir, why);
}

void write_session_file(const std::string& dir, const std::string& name, const std::string& text, int mode) {
  static std::atomic<unsigned> counter{0};
  std::string tmp = dir + "/." + name + "." + std::to_string(::getpid()) + "." + std::to_string(counter++) + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
  if (fd < 0) throw Error("cannot create " + tmp + ": " + std::strerror(errno));
  try {
    if (::fchmod(fd, static_cast<mode_t>(mode)) != 0)
      throw Error("cannot set mode " + octal_mode(mode) + " on " + tmp + ": " + std::strerror(errno));
    write_all(fd, text, tmp);
    if (::close(fd) != 0) {
      fd = -1;
      throw Error("cannot write " + tmp + ": " + std::strerror(errno));
    }
    fd = -1;
    // rename replaces a planted symlink itself, never its target.
    if (::rename(tmp.c_str(), (dir + "/" + name).c_str()) != 0)
      throw Error("cannot rename " + tmp + ": " + std::strerror(errno));
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
}

std::string read_session_file(const std::string& dir, const std::string& name) {
  int fd = ::open((dir + "/" + name).c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return "";
  std::string t;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof(buf))) > 0 || (n < 0 && errno == EINTR))
    if (n > 0) t.append(buf, static_cast<size_t>(n));
  ::close(fd);
  while (!t.empty() && (t.back() == '\n' || t.back() == ' ')) t.pop_back();
  return t;
}

void check_token(const std::string& token, const std::string& source) {
  for (size_t i = 0; i < token.size(); ++i) {
    const auto c = static_cast<unsigned char>(token[i]);
    if (c > 0x20 && c != 0x7f) continue;
    throw ConfigError(
        source + " holds " +
        (c == ' ' ? std::string("a space") : "a control character (" + std::to_string(unsigned(c)) + ")") +
        " at character " + std::to_string(i + 1) + " of " + std::to_string(token.size()) +
        ": a cluster token is printable characters without spaces");
  }
}

std::string clean_token(std::string token, const std::string& source) {
  const bool given = !token.empty();
  while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) token.pop_back();
  if (given && token.empty()) throw ConfigError(source + " is only whitespace: give the cluster token, or unset it");
  check_token(token, source);
  return token;
}

void write_pid_file(const std::string& dir, const std::string& name, pid_t pid) {
  auto start = process_start_time(pid);
  if (!start) throw Error("cannot record pid " + std::to_string(pid) + ": it is not running");
  write_session_file(dir, name, std::to_string(pid) + " " + std::to_string(*start) + "\n");
}

PidFile check_pid_file(const std::string& dir, const std::string& name) {
  PidFile f;
  std::string text = read_session_file(dir, name);
  if (text.empty()) {
    f.problem = "absent or empty";
    return f;
  }
  std::istringstream in(text);
  long long pid = 0;
  unsigned long long recorded = 0;
  std::string rest;
  if (!(in >> pid >> recorded) || (in >> rest) || pid <= 0 || pid > INT32_MAX) {
    f.problem = "malformed (want 'PID START_TIME', have '" + text.substr(0, 40) + "')";
    return f;
  }
  f.pid = static_cast<pid_t>(pid);
  auto now = process_start_time(f.pid);
  if (!now)
    f.problem = "pid " + std::to_string(pid) + " is not running";
  else if (*now != recorded)
    f.problem = "pid " + std::to_string(pid) + " is another process (started at " + std::to_string(*now) +
                ", the recorded one at " + std::to_string(recorded) + ")";
  else if (!process_running(f.pid, recorded))
    f.problem = "pid " + std::to_string(pid) + " has exited (a zombie its parent has not reaped yet)";
  else
    f.alive = true;
  return f;
}

bool has_live_pid_file(const std::string& dir, const std::string& prefix) {
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename();
    if (name.rfind(prefix, 0) == 0 && it->path().extension() == ".pid" && check_pid_file(dir, name).alive) return true;
  }
  return false;
}

}  // namespace troupe::core
