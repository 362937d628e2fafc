#include "runtime/testing/local_cluster.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include "runtime/head/scheduler.h"
#include "runtime/wire/auth.h"

extern char** environ;

namespace troupe::testing {

namespace {
std::string self_exe() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, n) : "/proc/self/exe";
}
}  // namespace

LocalCluster::LocalCluster(LocalClusterOptions options) : options_(std::move(options)) {
  token_ = wire::random_token();
  std::string line;
  head_pid_ = start({"TROUPE_ROLE=head", "TROUPE_HEARTBEAT_MS=" + std::to_string(options_.heartbeat_ms),
                     "TROUPE_HEARTBEAT_MISSES=" + std::to_string(options_.heartbeat_misses)},
                    &line);
  address_ = line;
  try {
    for (const auto& r : options_.nodes) add_node(r);
  } catch (...) {
    for (auto& n : nodes_) {
      ::kill(n.pid, SIGKILL);
      reap(n.pid);
    }
    ::kill(head_pid_, SIGKILL);
    reap(head_pid_);
    throw;
  }
}

LocalCluster::~LocalCluster() {
  // Node agents kill their workers when they stop; SIGTERM lets them.
  for (auto& n : nodes_)
    if (n.pid > 0) ::kill(n.pid, SIGTERM);
  for (auto& n : nodes_)
    if (n.pid > 0) reap(n.pid);
  if (head_pid_ > 0) {
    ::kill(head_pid_, SIGTERM);
    reap(head_pid_);
  }
}

Runtime LocalCluster::connect() const {
  InitOptions o;
  o.address = address_;
  o.token = token_;
  return Runtime::connect(o);
}

size_t LocalCluster::add_node(const Resources& resources) {
  std::string line;
  std::string res = head::format_resources(resources);
  for (auto& c : res)
    if (c == ' ') c = '\0';
  res.erase(std::remove(res.begin(), res.end(), '\0'), res.end());
  // Without GPU in the set the node would advertise what CUDA finds.
  if (!resources.count("GPU")) res += (res.empty() ? "" : ",") + std::string("GPU=0");
  pid_t pid = start({"TROUPE_ROLE=node", "TROUPE_HEAD_ADDRESS=" + address_, "TROUPE_RESOURCES=" + res}, &line);
  nodes_.push_back({pid, std::stoull(line)});
  return nodes_.size() - 1;
}

void LocalCluster::kill_node(size_t i, int sig) {
  auto& n = nodes_.at(i);
  if (n.pid <= 0) return;
  ::kill(n.pid, sig);
  if (sig == SIGKILL || sig == SIGTERM) {
    reap(n.pid);
    n.pid = -1;
  }
}

void LocalCluster::kill_head(int sig) {
  if (head_pid_ <= 0) return;
  ::kill(head_pid_, sig);
  if (sig == SIGKILL || sig == SIGTERM) {
    reap(head_pid_);
    head_pid_ = -1;
  }
}

void LocalCluster::reap(pid_t pid) {
  // Bounded: SIGKILL after 10 s of waiting.
  for (int i = 0; i < 1000; ++i) {
    int st = 0;
    pid_t r = ::waitpid(pid, &st, WNOHANG);
    if (r == pid || r < 0) return;
    struct timespec ts{0, 10'000'000};
    nanosleep(&ts, nullptr);
  }
  ::kill(pid, SIGKILL);
  int st = 0;
  ::waitpid(pid, &st, 0);
}

pid_t LocalCluster::start(const std::vector<std::string>& extra, std::string* ready_line) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw Error(std::string("pipe: ") + strerror(errno));
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    if (kv.rfind("TROUPE_", 0) == 0 && kv.rfind("TROUPE_LOG_LEVEL=", 0) != 0) continue;
    env.push_back(kv);
  }
  env.push_back("TROUPE_TOKEN=" + token_);
  env.push_back("TROUPE_READY_FD=" + std::to_string(fds[1]));
  for (const auto& e : extra) env.push_back(e);
  for (const auto& e : options_.env) env.push_back(e);
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string exe = self_exe();
  std::string arg0 = exe;
  char* argv[] = {arg0.data(), nullptr};
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) throw Error(std::string("fork: ") + strerror(errno));
  if (pid == 0) {
    // The cluster dies with the process that made it.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    int flags = fcntl(fds[1], F_GETFD);
    fcntl(fds[1], F_SETFD, flags & ~FD_CLOEXEC);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execve(exe.c_str(), argv, envp.data());
    _exit(127);
  }
  ::close(fds[1]);
  std::string got;
  auto deadline = std::chrono::steady_clock::now() + options_.start_timeout;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd p{fds[0], POLLIN, 0};
    int r = poll(&p, 1, static_cast<int>(left.count()));
    if (r <= 0) break;
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
    reap(pid);
    throw Error("LocalCluster: process (" + extra.front() + ") did not become ready within " +
                std::to_string(options_.start_timeout.count()) + " ms");
  }
  *ready_line = got.substr(0, nl);
  return pid;
}

}  // namespace troupe::testing
