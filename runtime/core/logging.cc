#include "troupe/runtime/core/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <unistd.h>

#include <cstdlib>

#include "troupe/runtime/core/worker_env.h"

namespace troupe::core {

void init_logging(const std::string& role) {
  auto logger = spdlog::stderr_color_mt("troupe:" + role + ":" + std::to_string(::getpid()));
  logger->set_pattern("[%H:%M:%S.%e] [" + role + " pid %P] [%^%l%$] %v");
  const char* level = std::getenv(kEnvLogLevel);
  logger->set_level(level ? spdlog::level::from_str(level) : spdlog::level::info);
  spdlog::set_default_logger(logger);
}

void init_logging_once(const std::string& role) {
  // spdlog's own default logger has an empty name; ours never does.
  if (spdlog::default_logger()->name().empty()) init_logging(role);
}

}  // namespace troupe::core
