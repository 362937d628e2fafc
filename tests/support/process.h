// Whether a process has ended, for tests that kill processes. Two traps:
// a process whose parent died is reparented to init (or a subreaper), and
// where that does not reap it stays a zombie, on which kill(pid, 0) still
// succeeds; and pids wrap (pid_max is often 32768), so over a long test run
// a dead process's pid can name a newer one. A zombie counts as gone, and
// given the start time a process was seen with, so does a newer process
// that took its pid.
#pragma once

#include <fcntl.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <sstream>
#include <string>

namespace troupe::test {

// The whole of a /proc file, "" when it cannot be read. A process that exits
// between the open and the read makes read() fail with ESRCH; through an
// istreambuf_iterator libstdc++ throws that out of the stream buffer, so
// /proc is read with read(2) here.
inline std::string read_proc_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  std::string out;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

// The start time of live process `pid` (/proc/PID/stat field 22, in clock
// ticks since boot); -1 when it is gone or a zombie.
inline long long process_start_time(pid_t pid) {
  if (pid <= 0) return -1;
  std::string stat = read_proc_file("/proc/" + std::to_string(pid) + "/stat");
  auto close = stat.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos) return -1;
  std::istringstream rest(stat.substr(close + 1));
  std::string state, field;
  rest >> state;
  if (!rest || state == "Z") return -1;
  for (int i = 4; i < 22; ++i) rest >> field;  // fields 4..21
  long long start = -1;
  rest >> start;
  return rest ? start : -1;
}

// Gone, a zombie, or (with `started` >= 0) a process other than the one
// that started then.
inline bool process_gone(pid_t pid, long long started = -1) {
  if (pid <= 0) return true;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;  // EPERM: there, another user's
  long long now = process_start_time(pid);
  return now < 0 || (started >= 0 && now != started);
}

}  // namespace troupe::test
