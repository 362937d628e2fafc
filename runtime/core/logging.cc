#include "troupe/runtime/core/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <unistd.h>

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>
#include <vector>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/signal_free_thread.h"

#include "troupe/runtime/core/worker_env.h"

namespace troupe::core {

std::optional<spdlog::level::level_enum> parse_log_level(const std::string& name) {
  std::string n = name;
  for (auto& c : n) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (n == "off") return spdlog::level::off;
  const auto level = spdlog::level::from_str(n);
  if (level == spdlog::level::off) return std::nullopt;  // from_str's answer for a name it does not know
  return level;
}

namespace {
std::atomic<spdlog::logger*> g_logger{nullptr};
}  // namespace

spdlog::logger* logger() {
  if (spdlog::logger* l = g_logger.load(std::memory_order_acquire)) return l;
  return spdlog::default_logger_raw();
}

void init_logging(const std::string& role) {
  auto logger = spdlog::stderr_color_mt("troupe:" + role + ":" + std::to_string(::getpid()));
  logger->set_pattern("[%H:%M:%S.%e] [" + role + " pid %P] [%^%l%$] %v");
  const char* value = std::getenv(kEnvLogLevel);
  const auto level = value ? parse_log_level(value) : std::optional(spdlog::level::info);
  logger->set_level(level.value_or(spdlog::level::info));
  spdlog::set_default_logger(logger);
  {
    // Kept for the whole life of the process and past spdlog's registry
    // (logger(), above): the list is deliberately never destroyed.
    static std::mutex mu;
    static auto* kept = new std::vector<std::shared_ptr<spdlog::logger>>;
    std::lock_guard lock(mu);
    kept->push_back(logger);
  }
  g_logger.store(logger.get(), std::memory_order_release);
  if (!level)
    TROUPE_LOG_WARN("{}='{}' is not one of trace, debug, info, warn, error, critical, off: logging at info",
                    kEnvLogLevel, value);
}

void init_logging_once(const std::string& role) {
  // spdlog's own default logger has an empty name; ours never does. Two
  // drivers connecting at once on two threads make one logger.
  static std::mutex mu;
  std::lock_guard lock(mu);
  if (spdlog::default_logger()->name().empty()) init_logging(role);
}

std::string own_log_file() {
  const char* own = std::getenv(kEnvOwnLog);
  if (!own || std::string(own) != "1") return "";
  std::error_code ec;
  auto path = std::filesystem::read_symlink("/proc/self/fd/1", ec);
  struct stat st {};
  if (ec || ::fstat(1, &st) != 0 || !S_ISREG(st.st_mode)) return "";
  return path.string();
}

namespace {

// Points stdout, and stderr when it went to the same file as stdout, at
// `path` (appended to, created with `mode`). False when it cannot be opened.
bool point_output_at(const std::string& path, mode_t mode) {
  struct stat out {
  }, err{};
  const bool same =
      ::fstat(1, &out) == 0 && ::fstat(2, &err) == 0 && err.st_dev == out.st_dev && err.st_ino == out.st_ino;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, mode);
  if (fd < 0) return false;
  std::fflush(stdout);
  std::fflush(stderr);
  ::dup2(fd, 1);
  if (same) ::dup2(fd, 2);
  ::close(fd);
  return true;
}

// Moves the output file, `path`, to PATH.1 and goes on in a new PATH once
// it is over `max_bytes`.
void rotate_own_log_if_over(uint64_t max_bytes, const std::string& path) {
  struct stat out {};
  if (::fstat(1, &out) != 0 || !S_ISREG(out.st_mode) || static_cast<uint64_t>(out.st_size) <= max_bytes) return;
  const std::string older = path + ".1";
  if (std::rename(path.c_str(), older.c_str()) != 0) return;
  if (!point_output_at(path, out.st_mode & 07777)) return;  // goes on in PATH.1
  TROUPE_LOG_INFO("log over {} bytes: its earlier part is now {}", max_bytes, older);
}

}  // namespace

void write_output_to(const std::string& path) {
  if (path.empty() || own_log_file() == path) return;
  point_output_at(path, 0600);
}

void rotate_own_log_in_background(std::chrono::milliseconds interval) {
  uint64_t max_bytes = 64ull << 20;
  if (const char* v = std::getenv(kEnvLogMaxBytes)) {
    char* end = nullptr;
    errno = 0;
    const unsigned long long n = std::strtoull(v, &end, 10);
    if (*v >= '0' && *v <= '9' && *end == '\0' && errno == 0 && n >= 4096)
      max_bytes = n;
    else
      TROUPE_LOG_WARN("{}='{}' is not a byte count of at least 4096: rotating the log at {} bytes", kEnvLogMaxBytes, v,
                      max_bytes);
  }
  const std::string first = own_log_file();
  if (first.empty()) return;
  signal_free_thread([interval, max_bytes, first] {
    const auto dir = std::filesystem::path(first).parent_path();
    std::string path = first;
    for (;;) {
      std::this_thread::sleep_for(interval);
      // The file's name now: a node agent names a cold worker's log after
      // its pid once it has started it (from a temporary name, which the
      // worker may have read first: every rename of that name failed, and
      // the log grew without end). Followed within its directory only.
      std::error_code ec;
      const auto now = std::filesystem::read_symlink("/proc/self/fd/1", ec);
      if (!ec && now.parent_path() == dir && now.string().find(" (deleted)") == std::string::npos) path = now.string();
      rotate_own_log_if_over(max_bytes, path);
    }
  }).detach();
}

std::string read_log_piece(const std::string& path, uint64_t offset, uint32_t max_bytes, uint64_t* next_offset,
                           uint64_t* size, uint64_t* file_id) {
  // The file's identity and size from the file read (fstat), not from its
  // name: a rotation between an open and a stat(path) paired the new
  // file's inode with the old file's text, and a follower took the
  // rotation for a truncation and lost the old file's last lines.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error("cannot read log file " + path + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw Error("cannot read log file " + path + ": " + std::strerror(err));
  }
  *file_id = static_cast<uint64_t>(st.st_ino);
  *size = static_cast<uint64_t>(st.st_size);
  uint64_t from = offset == UINT64_MAX ? (*size > max_bytes ? *size - max_bytes : 0) : std::min(offset, *size);
  uint64_t n = std::min<uint64_t>(max_bytes, *size - from);
  std::string text(n, '\0');
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(fd, text.data() + got, n - got, static_cast<off_t>(from + got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;  // shorter than its size a moment ago (truncated): what was there
    got += static_cast<size_t>(r);
  }
  ::close(fd);
  text.resize(got);
  *next_offset = from + got;
  return text;
}

}  // namespace troupe::core
