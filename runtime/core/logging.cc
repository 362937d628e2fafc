#include "troupe/runtime/core/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <unistd.h>

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "troupe/runtime/core/errors.h"

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

void init_logging(const std::string& role) {
  auto logger = spdlog::stderr_color_mt("troupe:" + role + ":" + std::to_string(::getpid()));
  logger->set_pattern("[%H:%M:%S.%e] [" + role + " pid %P] [%^%l%$] %v");
  const char* value = std::getenv(kEnvLogLevel);
  const auto level = value ? parse_log_level(value) : std::optional(spdlog::level::info);
  logger->set_level(level.value_or(spdlog::level::info));
  spdlog::set_default_logger(logger);
  if (!level)
    TROUPE_LOG_WARN("{}='{}' is not one of trace, debug, info, warn, error, critical, off: logging at info",
                    kEnvLogLevel, value);
}

void init_logging_once(const std::string& role) {
  // spdlog's own default logger has an empty name; ours never does.
  if (spdlog::default_logger()->name().empty()) init_logging(role);
}

std::string own_log_file() {
  std::error_code ec;
  auto path = std::filesystem::read_symlink("/proc/self/fd/1", ec);
  struct stat st {};
  if (ec || ::fstat(1, &st) != 0 || !S_ISREG(st.st_mode)) return "";
  return path.string();
}

std::string read_log_piece(const std::string& path, uint64_t offset, uint32_t max_bytes, uint64_t* next_offset,
                           uint64_t* size) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot read log file " + path);
  in.seekg(0, std::ios::end);
  *size = static_cast<uint64_t>(in.tellg());
  uint64_t from = offset == UINT64_MAX ? (*size > max_bytes ? *size - max_bytes : 0) : std::min(offset, *size);
  uint64_t n = std::min<uint64_t>(max_bytes, *size - from);
  std::string text(n, '\0');
  in.seekg(static_cast<std::streamoff>(from));
  in.read(text.data(), static_cast<std::streamsize>(n));
  *next_offset = from + n;
  return text;
}

}  // namespace troupe::core
