// Whether a process has ended, for tests that kill processes. Two traps:
// a process whose parent died is reparented to init (or a subreaper), and
// where that does not reap it stays a zombie, on which kill(pid, 0) still
// succeeds; and pids wrap (pid_max is often 32768), so over a long test run
// a dead process's pid can name a newer one. A zombie counts as gone, and
// given the start time a process was seen with, so does a newer process
// that took its pid.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <sstream>
#include <string>
#include <thread>

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

// The state letter of a /proc stat line ('T' stopped, 'R' running, ...);
// '?' when it cannot be read.
inline char proc_state(const std::string& stat_path) {
  std::string stat = read_proc_file(stat_path);
  auto close = stat.rfind(')');
  return close == std::string::npos || close + 2 >= stat.size() ? '?' : stat[close + 2];
}

// Whether every thread of `pid` is stopped (or traced): SIGSTOP has taken
// the whole process, not only been sent.
inline bool all_threads_stopped(pid_t pid) {
  const std::string dir = "/proc/" + std::to_string(pid) + "/task";
  DIR* d = ::opendir(dir.c_str());
  if (!d) return false;
  bool all = true, any = false;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    any = true;
    const char s = proc_state(dir + "/" + e->d_name + "/stat");
    if (s != 'T' && s != 't') all = false;
  }
  ::closedir(d);
  return any && all;
}

// SIGSTOP `pid` and return once all its threads have stopped. kill()
// returns when the signal is sent: one thread takes it and stops the
// others, and until that thread runs (on a loaded machine, tens of ms
// later) the rest go on serving, so a call sent at once may still be run.
// False if it did not stop within `bound`.
inline bool stop_process(pid_t pid, std::chrono::milliseconds bound = std::chrono::seconds(30)) {
  if (::kill(pid, SIGSTOP) != 0) return false;
  const auto until = std::chrono::steady_clock::now() + bound;
  while (!all_threads_stopped(pid)) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

}  // namespace troupe::test
