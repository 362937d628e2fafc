// The session directory: where `troupe start` keeps the head's address, the
// cluster token and the pids of the processes it started, so that later
// commands (`troupe status`, `troupe stop`, drivers with --address auto)
// find the cluster. The token gives full control of the cluster, so the
// directory is used only when it is this user's own with mode 0700, and its
// files are created fresh (O_EXCL, O_NOFOLLOW, 0600) and renamed into place:
// nobody else can read them, plant them or redirect them with a symlink.
#pragma once

#include <sys/types.h>

#include <string>

namespace troupe::core {

// $TROUPE_SESSION_DIR; else $XDG_RUNTIME_DIR/troupe when XDG_RUNTIME_DIR is
// set and is a directory of this user's; else /tmp/troupe-<uid>.
std::string session_dir();
// Creates the directory with mode 0700 when absent; throws troupe::Error
// naming its path, owner and mode unless it is a directory (not a symlink)
// owned by this user with mode 0700.
void ensure_session_dir(const std::string& dir);
// The same check for a directory that may not exist (absent is fine).
void check_session_dir(const std::string& dir);
// Writes `text` to dir/name: a new temp file (O_CREAT|O_EXCL|O_NOFOLLOW,
// `mode`) renamed over the name. Throws troupe::Error on any failure,
// including a failed fchmod.
void write_session_file(const std::string& dir, const std::string& name, const std::string& text, int mode = 0600);
// Reads dir/name without following a symlink ("" when absent).
std::string read_session_file(const std::string& dir, const std::string& name);

// A cluster token is printable characters without spaces: one holding
// whitespace or a control character is refused with a ConfigError naming
// `source`.
void check_token(const std::string& token, const std::string& source);
// A token as given in the environment (`source`: TROUPE_TOKEN): without
// the trailing newline and spaces a Secret or `$(cat token)` may carry, as
// the session's token file is read, then checked; one that was only
// whitespace is refused. "" stays "".
std::string clean_token(std::string token, const std::string& source);

// Pid files record the pid and its start time (/proc/PID/stat field 22), so
// that a later `troupe stop` signals that process and no other.
void write_pid_file(const std::string& dir, const std::string& name, pid_t pid);

struct PidFile {
  pid_t pid = -1;       // recorded pid (-1 when unreadable)
  bool alive = false;   // true only when that very process still runs
  std::string problem;  // why not: absent, malformed, exited, pid reused
};
PidFile check_pid_file(const std::string& dir, const std::string& name);
// Whether a process of session `dir` whose pid file's name starts with
// `prefix` ("" = any: the head's, a node agent's) still runs.
bool has_live_pid_file(const std::string& dir, const std::string& prefix = "");

}  // namespace troupe::core
