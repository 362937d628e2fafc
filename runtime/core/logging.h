// Process-wide logging through spdlog. Every process names its role in the
// log pattern ("head", "node 2", "worker a7 Counter") so interleaved output
// of a local cluster stays readable. Level from TROUPE_LOG_LEVEL.
#pragma once

#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace troupe::core {

// Sets the role shown in every log line of this process and the level from
// TROUPE_LOG_LEVEL (trace, debug, info, warn, error; default info). A value
// that is none of them logs at info, and says so in a warning naming it.
void init_logging(const std::string& role);

// A TROUPE_LOG_LEVEL value, any case: trace, debug, info, warn or warning,
// error or err, critical, off. nullopt for anything else (spdlog's own
// parser maps an unknown name to "off", which would silence errors too).
std::optional<spdlog::level::level_enum> parse_log_level(const std::string& name);

// The file this process's stdout goes to when that is a log of its own (a
// daemon's: TROUPE_OWN_LOG=1, which start_role_process sets when it gives
// the process a log file), else "" (a terminal, a pipe, or a file the
// process only inherited, such as the output of the test that started it).
std::string own_log_file();

// A daemon whose output is a file (head.log, node-*.log of `troupe start`,
// a worker's worker-PID.log) keeps it under TROUPE_LOG_MAX_BYTES (64 MiB by default, at least 4 KiB):
// past that the file becomes PATH.1, replacing the one before, and the
// output goes on in a new PATH. A thread of its own checks every
// `interval`; nothing happens while the output is no regular file.
void rotate_own_log_in_background(std::chrono::milliseconds interval = std::chrono::seconds(1));
// Output (stdout, and stderr when it went to the same file) to `path` again
// unless it goes there already: a head supervisor, whose head rotated the
// log they share, before it starts the next head.
void write_output_to(const std::string& path);

// Up to `max_bytes` of `path` from `offset` (UINT64_MAX: the last
// max_bytes); sets `next_offset` and `size`. Error naming the file when it
// cannot be read.
// `file_id`: the file's inode (a rotation puts another file at `path`).
std::string read_log_piece(const std::string& path, uint64_t offset, uint32_t max_bytes, uint64_t* next_offset,
                           uint64_t* size, uint64_t* file_id);
// What every TROUPE_LOG_* line goes through: this process's troupe logger
// once init_logging has run, spdlog's default logger before. That logger
// is never destroyed: a thread that logs while static objects are being
// destroyed at exit (an embedded cluster held in a global, stopped by its
// destructor after spdlog's registry is gone) still writes its line.
spdlog::logger* logger();

// init_logging(role) unless this process already has a troupe logger: a
// driver that connects without troupe::init (tests, benchmarks) still logs
// to stderr, never into its stdout.
void init_logging_once(const std::string& role);

}  // namespace troupe::core

#define TROUPE_LOG_TRACE(...) SPDLOG_LOGGER_TRACE(::troupe::core::logger(), __VA_ARGS__)
#define TROUPE_LOG_DEBUG(...) ::troupe::core::logger()->debug(__VA_ARGS__)
#define TROUPE_LOG_INFO(...) ::troupe::core::logger()->info(__VA_ARGS__)
#define TROUPE_LOG_WARN(...) ::troupe::core::logger()->warn(__VA_ARGS__)
#define TROUPE_LOG_ERROR(...) ::troupe::core::logger()->error(__VA_ARGS__)
