// Process-wide logging through spdlog. Every process names its role in the
// log pattern ("head", "node 2", "worker a7 Counter") so interleaved output
// of a local cluster stays readable. Level from TROUPE_LOG_LEVEL.
#pragma once

#include <spdlog/spdlog.h>

#include <string>

namespace troupe::core {

// Sets the role shown in every log line of this process and the level from
// TROUPE_LOG_LEVEL (trace, debug, info, warn, error; default info).
void init_logging(const std::string& role);
// init_logging(role) unless this process already has a troupe logger: a
// driver that connects without troupe::init (tests, benchmarks) still logs
// to stderr, never into its stdout.
void init_logging_once(const std::string& role);

}  // namespace troupe::core

#define TROUPE_LOG_TRACE(...) SPDLOG_TRACE(__VA_ARGS__)
#define TROUPE_LOG_DEBUG(...) spdlog::debug(__VA_ARGS__)
#define TROUPE_LOG_INFO(...) spdlog::info(__VA_ARGS__)
#define TROUPE_LOG_WARN(...) spdlog::warn(__VA_ARGS__)
#define TROUPE_LOG_ERROR(...) spdlog::error(__VA_ARGS__)
