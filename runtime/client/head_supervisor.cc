#include "troupe/runtime/client/head_supervisor.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <ctime>
#include <deque>
#include <string>

#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/core/process.h"
#include "troupe/runtime/wire/address.h"

namespace troupe::client {

namespace {

constexpr size_t kMaxQuickRestarts = 5;
constexpr std::chrono::seconds kQuickWindow{10};

// A line of head.log in the form every other line there has (the time,
// who, the level), written with stdio: the supervisor forks the head and
// keeps no logger of its own.
[[gnu::format(printf, 1, 2)]] void say(const char* format, ...) {
  timespec now{};
  ::clock_gettime(CLOCK_REALTIME, &now);
  tm local{};
  ::localtime_r(&now.tv_sec, &local);
  std::fprintf(stderr, "[%02d:%02d:%02d.%03ld] [head-supervisor pid %d] [warning] ", local.tm_hour, local.tm_min,
               local.tm_sec, now.tv_nsec / 1000000, static_cast<int>(::getpid()));
  va_list args;
  va_start(args, format);
  std::vfprintf(stderr, format, args);
  va_end(args);
  std::fputc('\n', stderr);
  std::fflush(stderr);
}

// A stop signal (troupe stop, ^C) ends the head and then the supervisor.
// SIGCONT too: a stopped head (SIGSTOP, a debugger gone) takes the SIGTERM
// only once it runs.
[[noreturn]] void stop_head(pid_t head, int sig) {
  say("signal %d; stopping the head (pid %d)", sig, head);
  ::kill(head, SIGTERM);
  ::kill(head, SIGCONT);
  core::wait_child(head);
  std::_Exit(0);
}

// A stop signal waiting, looked at for up to `wait`: its number, or 0
// when none came in that time or a SIGCHLD came first (the head may have
// ended: the caller looks at once rather than at the end of `wait`).
int stop_signal(const sigset_t& signals, std::chrono::milliseconds wait) {
  const auto until = std::chrono::steady_clock::now() + wait;
  for (;;) {
    const auto left = std::max(std::chrono::nanoseconds(0), until - std::chrono::steady_clock::now());
    const timespec t{static_cast<time_t>(left.count() / 1000000000), static_cast<long>(left.count() % 1000000000)};
    const int sig = sigtimedwait(&signals, nullptr, &t);
    if (sig == SIGCHLD) return 0;
    if (sig > 0) return sig;
    if (errno != EINTR || std::chrono::steady_clock::now() >= until) return 0;
  }
}

// The head's ready line, or "" when it exited first (end of file). However
// long its tables take to load, a stop signal meanwhile is heeded.
std::string read_ready_line(int fd, pid_t head, const sigset_t& signals) {
  std::string line;
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, 100);
    if (ready < 0 && errno != EINTR) return line;
    if (ready > 0) {
      char c = 0;
      const ssize_t n = ::read(fd, &c, 1);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0 || c == '\n') return line;
      line += c;
      continue;  // the rest of the line is there already
    }
    if (const int sig = stop_signal(signals, std::chrono::milliseconds(0))) stop_head(head, sig);
  }
}

// A restarted head listens where the first one did: the ready line is
// "HOST:PORT" or "HOST:PORT http://HOST:PORT/".
void pin_ports(const std::string& ready, core::WorkerEnv& env) {
  const size_t space = ready.find(' ');
  env.head_port = wire::parse_address(ready.substr(0, space)).second;
  if (space == std::string::npos) return;
  const std::string url = ready.substr(space + 1);
  const size_t colon = url.rfind(':');
  if (colon == std::string::npos) return;
  env.dashboard_port = static_cast<uint16_t>(std::atoi(url.c_str() + colon + 1));
  env.dashboard_port_fallback = false;
}

// Whether the head's event loop wrote to the liveness pipe since the last
// look (its bytes drained). False at end of file too: the exit shows soon.
bool heard_from(int liveness) {
  char buf[256];
  bool heard = false;
  for (;;) {
    const ssize_t n = ::read(liveness, buf, sizeof buf);
    if (n > 0) {
      heard = true;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return heard;
  }
}

// Waits for the head's exit (its wait status) or for a stop signal, which is
// passed on to the head before the supervisor exits. A head whose event loop
// gives no sign of life for hang_timeout (0 = no limit) is hung: it is
// SIGKILLed, and its status returned like any other death.
int wait_for_head(pid_t head, const sigset_t& signals, int liveness, std::chrono::milliseconds hang_timeout) {
  using Clock = std::chrono::steady_clock;
  auto last_sign = Clock::now();
  for (;;) {
    int status = 0;
    if (::waitpid(head, &status, WNOHANG) == head) return status;
    if (heard_from(liveness)) last_sign = Clock::now();
    const auto silent = Clock::now() - last_sign;
    if (hang_timeout.count() > 0 && silent >= hang_timeout) {
      say("the head (pid %d) gave no sign of life for %lld ms (its event loop is stuck; "
          "--hang-timeout is %lld ms); killing it",
          head, static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(silent).count()),
          static_cast<long long>(hang_timeout.count()));
      ::kill(head, SIGKILL);
      core::wait_child(head, &status);
      return status;
    }
    // The liveness pipe is read this often.
    if (const int sig = stop_signal(signals, std::chrono::milliseconds(250))) stop_head(head, sig);
  }
}

// How long to wait before the next start, after `quick` restarts within
// kQuickWindow: none after a first death; then 250 ms, doubling to 2 s, so
// that a cause that passes (a full disk, a port still held) can pass, while
// a head that dies at every start still ends supervision within the window.
std::chrono::milliseconds restart_delay(size_t quick) {
  if (quick == 0) return std::chrono::milliseconds(0);
  return std::min(std::chrono::milliseconds(2000),
                  std::chrono::milliseconds(250) * (1 << std::min<size_t>(quick - 1, 3)));
}

}  // namespace

core::WorkerEnv supervise_head(core::WorkerEnv env) {
  sigset_t signals, old;
  sigemptyset(&signals);
  for (int s : {SIGTERM, SIGINT, SIGCHLD}) sigaddset(&signals, s);
  sigprocmask(SIG_BLOCK, &signals, &old);
  const pid_t self = ::getpid();
  int ready_fd = env.ready_fd;
  std::deque<std::chrono::steady_clock::time_point> restarts;
  const std::string log = core::own_log_file();  // the head may rotate it (rotate_own_log_in_background)
  for (bool served = false;;) {
    core::write_output_to(log);
    int pipe_fds[2];
    if (::pipe2(pipe_fds, O_CLOEXEC) != 0) std::_Exit(1);
    int liveness_fds[2];
    if (::pipe2(liveness_fds, O_CLOEXEC | O_NONBLOCK) != 0) std::_Exit(1);
    const pid_t head = ::fork();
    if (head < 0) std::_Exit(1);
    if (head == 0) {
      sigprocmask(SIG_SETMASK, &old, nullptr);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // a supervisor killed outright takes its head along
      if (::getppid() != self) std::_Exit(1);
      ::close(pipe_fds[0]);
      ::close(liveness_fds[0]);
      if (ready_fd >= 0) ::close(ready_fd);
      env.ready_fd = pipe_fds[1];
      env.liveness_fd = liveness_fds[1];
      env.head_supervise = false;
      return env;
    }
    ::close(pipe_fds[1]);
    ::close(liveness_fds[1]);
    const std::string ready = read_ready_line(pipe_fds[0], head, signals);
    ::close(pipe_fds[0]);
    if (!ready.empty()) {
      pin_ports(ready, env);
      if (ready_fd >= 0) {
        const std::string line = ready + "\n";
        (void)!::write(ready_fd, line.data(), line.size());
        ::close(ready_fd);
        ready_fd = -1;
      }
      served = true;
    }
    const int status =
        wait_for_head(head, signals, liveness_fds[0], std::chrono::milliseconds(env.head_hang_timeout_ms));
    ::close(liveness_fds[0]);
    core::write_output_to(log);  // what follows belongs in head.log, not in a file the head rotated away
    // A head that never served fails the start as an unsupervised one would;
    // one that exits 0 was stopped (troupe stop).
    if (!served) std::_Exit(WIFEXITED(status) ? WEXITSTATUS(status) : 1);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) std::_Exit(0);
    const auto now = std::chrono::steady_clock::now();
    while (!restarts.empty() && now - restarts.front() > kQuickWindow) restarts.pop_front();
    if (restarts.size() >= kMaxQuickRestarts) {
      say("the head (pid %d) %s: %zu deaths within %lld s, after %zu restarts; giving up", head,
          core::describe_exit_status(status).c_str(), restarts.size() + 1, static_cast<long long>(kQuickWindow.count()),
          restarts.size());
      std::_Exit(1);
    }
    const auto delay = restart_delay(restarts.size());
    restarts.push_back(now);
    if (delay.count() == 0) {
      say("the head (pid %d) %s; starting it again on port %u", head, core::describe_exit_status(status).c_str(),
          unsigned(env.head_port));
    } else {
      say("the head (pid %d) %s; starting it again on port %u in %lld ms (restart %zu within %lld s)", head,
          core::describe_exit_status(status).c_str(), unsigned(env.head_port), static_cast<long long>(delay.count()),
          restarts.size(), static_cast<long long>(kQuickWindow.count()));
      // A stray SIGCHLD (no head runs now) ends stop_signal early: waited out.
      for (const auto until = std::chrono::steady_clock::now() + delay;;) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
        if (left.count() <= 0) break;
        if (const int sig = stop_signal(signals, left)) {
          say("signal %d while waiting to start the head again; stopping", sig);
          std::_Exit(0);
        }
      }
    }
  }
}

}  // namespace troupe::client
