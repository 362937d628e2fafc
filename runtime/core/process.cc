#include "troupe/runtime/core/process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <thread>

#include "troupe/runtime/core/errors.h"

extern char** environ;

namespace troupe::core {

std::string self_executable_path() {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, n) : "/proc/self/exe";
}

void reap_process(pid_t pid, std::chrono::milliseconds grace) {
  auto deadline = std::chrono::steady_clock::now() + grace;
  while (std::chrono::steady_clock::now() < deadline) {
    int st = 0;
    pid_t r = ::waitpid(pid, &st, WNOHANG);
    if (r == pid || r < 0) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ::kill(pid, SIGKILL);
  int st = 0;
  ::waitpid(pid, &st, 0);
}

RoleProcess start_role_process(const RoleProcessOptions& o, const std::string& what) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw Error(std::string("pipe: ") + std::strerror(errno));
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    if (kv.rfind("TROUPE_", 0) == 0 && kv.rfind("TROUPE_LOG_LEVEL=", 0) != 0 && kv.rfind("TROUPE_SESSION_DIR=", 0) != 0)
      continue;
    env.push_back(kv);
  }
  env.push_back("TROUPE_READY_FD=" + std::to_string(fds[1]));
  for (const auto& e : o.env) env.push_back(e);
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string exe = o.executable.empty() ? self_executable_path() : o.executable;
  std::string arg0 = exe;
  char* argv[] = {arg0.data(), nullptr};
  int log_fd = -1;
  if (!o.log_file.empty()) {
    log_fd = ::open(o.log_file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (log_fd < 0) throw Error("cannot open log " + o.log_file + ": " + std::strerror(errno));
  }
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) throw Error(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    if (o.die_with_parent) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);
    }
    if (o.new_session) setsid();
    if (log_fd >= 0) {
      dup2(log_fd, 1);
      dup2(log_fd, 2);
      int devnull = ::open("/dev/null", O_RDONLY);
      if (devnull >= 0) dup2(devnull, 0);
    }
    int flags = fcntl(fds[1], F_GETFD);
    fcntl(fds[1], F_SETFD, flags & ~FD_CLOEXEC);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execve(exe.c_str(), argv, envp.data());
    _exit(127);
  }
  if (log_fd >= 0) ::close(log_fd);
  ::close(fds[1]);
  std::string got;
  auto deadline = std::chrono::steady_clock::now() + o.ready_timeout;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd p{fds[0], POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
    char buf[256];
    ssize_t n = ::read(fds[0], buf, sizeof(buf));
    if (n <= 0) break;
    got.append(buf, n);
    if (got.find('\n') != std::string::npos) break;
  }
  ::close(fds[0]);
  auto nl = got.find('\n');
  if (nl == std::string::npos) {
    ::kill(pid, SIGKILL);
    reap_process(pid);
    throw Error(what + " did not become ready within " + std::to_string(o.ready_timeout.count()) + " ms" +
                (o.log_file.empty() ? "" : " (see " + o.log_file + ")"));
  }
  return {pid, got.substr(0, nl)};
}

}  // namespace troupe::core
