#include "bench/peer_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>

extern char** environ;

namespace troupe::bench {
namespace {

using Clock = std::chrono::steady_clock;

std::string errno_text(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

}  // namespace

std::string describe_exit(int wait_status) {
  if (WIFEXITED(wait_status)) return "exited with status " + std::to_string(WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) return "killed by signal " + std::to_string(WTERMSIG(wait_status));
  return "wait status " + std::to_string(wait_status);
}

PeerProcess::PeerProcess(const std::vector<std::string>& argv, const PeerOptions& options) {
  if (argv.empty()) throw PeerFailed("peer: empty command");
  name_ = options.name.empty() ? argv[0] : options.name;
  // Everything exec needs is built before fork: the parent may have threads,
  // and the child may only call async-signal-safe functions.
  std::vector<std::string> env_text;
  for (char** e = environ; *e; ++e) env_text.emplace_back(*e);
  for (const auto& kv : options.env) {
    const std::string key = kv.substr(0, kv.find('=') + 1);
    std::erase_if(env_text, [&](const std::string& e) { return e.rfind(key, 0) == 0; });
    env_text.push_back(kv);
  }
  std::vector<char*> args, envp;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  for (const auto& e : env_text) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  start(
      [&] {
        ::execvpe(args[0], args.data(), envp.data());
        const char msg[] = "peer: exec failed\n";
        [[maybe_unused]] ssize_t n = ::write(2, msg, sizeof msg - 1);
        ::_exit(127);
      },
      options);
}

PeerProcess::PeerProcess(const std::function<int()>& body, const PeerOptions& options) {
  name_ = options.name.empty() ? "forked peer" : options.name;
  start(
      [&] {
        int code = 1;
        try {
          code = body();
        } catch (const std::exception& e) {
          std::fprintf(stderr, "%s: %s\n", name_.c_str(), e.what());
        }
        std::fflush(stdout);
        ::_exit(code);
      },
      options);
}

void PeerProcess::start(const std::function<void()>& run_child, const PeerOptions& options) {
  int out[2] = {-1, -1}, in[2] = {-1, -1};
  if (::pipe2(out, O_CLOEXEC) != 0) throw PeerFailed(errno_text("peer: pipe"));
  if (options.stdin_pipe && ::pipe2(in, O_CLOEXEC) != 0) {
    ::close(out[0]);
    ::close(out[1]);
    throw PeerFailed(errno_text("peer: pipe"));
  }
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t parent = ::getpid();
  pid_ = ::fork();
  if (pid_ < 0) throw PeerFailed(errno_text("peer: fork"));
  if (pid_ == 0) {
    // Its own process group, so the ranks it starts die with it; and it
    // dies with the benchmark.
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);
    int null_fd = options.stdin_pipe ? -1 : ::open("/dev/null", O_RDONLY);
    ::dup2(options.stdin_pipe ? in[0] : null_fd, 0);
    ::dup2(out[1], 1);
    // Nothing else of the parent's: a peer holding another peer's pipe would
    // keep it from seeing EOF.
    ::syscall(SYS_close_range, 3U, ~0U, 0U);
    run_child();
    ::_exit(127);
  }
  ::setpgid(pid_, pid_);  // also here: no race with the first kill_group()
  ::close(out[1]);
  stdout_fd_ = out[0];
  if (options.stdin_pipe) {
    ::close(in[0]);
    stdin_fd_ = in[1];
  }
}

PeerProcess::~PeerProcess() {
  close_fd(stdin_fd_);
  close_fd(stdout_fd_);
  kill_group();
}

std::optional<std::string> PeerProcess::read_line(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (auto nl = pending_.find('\n'); nl != std::string::npos) {
      std::string line = pending_.substr(0, nl);
      pending_.erase(0, nl + 1);
      return line;
    }
    if (stdout_fd_ < 0) {
      if (pending_.empty()) return std::nullopt;
      return std::exchange(pending_, {});
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    pollfd p{stdout_fd_, POLLIN, 0};
    const int ready = left > 0 ? ::poll(&p, 1, static_cast<int>(left)) : 0;
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) {
      kill_group();
      throw PeerFailed(name_ + ": no output within " + std::to_string(timeout.count()) + " ms; killed");
    }
    char buf[4096];
    const ssize_t n = ::read(stdout_fd_, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      close_fd(stdout_fd_);
      continue;
    }
    pending_.append(buf, static_cast<size_t>(n));
  }
}

bool PeerProcess::write(const std::string& text) {
  size_t off = 0;
  while (off < text.size()) {
    if (stdin_fd_ < 0) return false;
    // MSG_NOSIGNAL does not exist for pipes: a dead reader must not SIGPIPE
    // the benchmark.
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &block, &old);
    const ssize_t n = ::write(stdin_fd_, text.data() + off, text.size() - off);
    const int saved = errno;
    if (n < 0 && saved == EPIPE) {
      timespec zero{0, 0};
      sigtimedwait(&block, nullptr, &zero);  // drop the pending SIGPIPE
    }
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    if (n < 0 && saved == EINTR) continue;
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

void PeerProcess::close_stdin() { close_fd(stdin_fd_); }

int PeerProcess::wait(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!reaped_) {
    const pid_t r = ::waitpid(pid_, &status_, WNOHANG);
    if (r == pid_ || (r < 0 && errno != EINTR)) {
      reaped_ = true;
      break;
    }
    if (Clock::now() >= deadline) {
      kill_group();
      throw PeerFailed(name_ + ": did not exit within " + std::to_string(timeout.count()) + " ms; killed");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  // The leader is gone; ranks it left behind (stuck in a destructor) are not
  // waited for.
  ::kill(-pid_, SIGKILL);
  return status_;
}

void PeerProcess::kill_group() {
  // Once the leader is reaped its pid may be reused: wait() has already
  // killed what was left of the group then.
  if (pid_ <= 0 || reaped_) return;
  ::kill(-pid_, SIGKILL);
  // SIGKILL cannot be ignored: this returns as soon as the kernel has
  // torn the leader down.
  while (::waitpid(pid_, &status_, 0) < 0 && errno == EINTR) {
  }
  reaped_ = true;
}

nlohmann::ordered_json run_peer_json(const std::vector<std::string>& argv, const PeerOptions& options,
                                     std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  auto left = [&] {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
  };
  PeerProcess peer(argv, options);
  nlohmann::ordered_json row;
  std::string last;
  // Up to the first JSON object: the result. Reading on to EOF could wait
  // for a rank stuck at exit that still holds the pipe.
  while (auto line = peer.read_line(left())) {
    if (line->empty()) continue;
    last = *line;
    auto j = nlohmann::ordered_json::parse(*line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object()) {
      row = std::move(j);
      break;
    }
  }
  if (!row.is_object()) {
    const int status = peer.wait(left());
    throw PeerFailed(peer.name() + " " + describe_exit(status) + " without printing a JSON object" +
                     (last.empty() ? "" : "; last line: " + last));
  }
  if (row.contains("error")) throw PeerFailed(peer.name() + ": " + row["error"].dump());
  // The result is in: a peer (or a rank) that does not exit soon is killed.
  try {
    peer.wait(std::min(left(), std::chrono::milliseconds(10'000)));
  } catch (const PeerFailed&) {
  }
  return row;
}

}  // namespace troupe::bench
