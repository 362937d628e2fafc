// The session directory: where `troupe start` keeps the head's address, the
// cluster token (mode 0600) and the pids of the processes it started, so
// that later commands (`troupe status`, `troupe stop`, drivers with
// --address auto) find the cluster.
#pragma once

#include <string>
#include <vector>

namespace troupe::core {

// $TROUPE_SESSION_DIR, or /tmp/troupe-<uid>.
std::string session_dir();
// Creates the directory (mode 0700).
void ensure_session_dir(const std::string& dir);
// Writes `text` to dir/name atomically with the given mode.
void write_session_file(const std::string& dir, const std::string& name, const std::string& text, int mode = 0600);
// Reads dir/name ("" when absent).
std::string read_session_file(const std::string& dir, const std::string& name);

}  // namespace troupe::core
