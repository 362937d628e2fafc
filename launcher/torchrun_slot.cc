#include "torchrun_slot.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/process.h"
#include "troupe/runtime/core/worker_env.h"

namespace troupe::launcher {

namespace {

// The interface that carries `address` on this machine ("" when none does).
std::string interface_of(const std::string& address) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string name;
  for (ifaddrs* a = list; a && name.empty(); a = a->ifa_next) {
    if (!a->ifa_addr || (a->ifa_addr->sa_family != AF_INET && a->ifa_addr->sa_family != AF_INET6)) continue;
    char buf[INET6_ADDRSTRLEN] = {};
    const void* raw = a->ifa_addr->sa_family == AF_INET
                          ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr)
                          : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(a->ifa_addr)->sin6_addr);
    if (::inet_ntop(a->ifa_addr->sa_family, raw, buf, sizeof buf) && address == buf) name = a->ifa_name;
  }
  ::freeifaddrs(list);
  return name;
}

// Gloo and NCCL pick their interface from the host name, which often
// resolves to 127.0.1.1: ranks on other machines could not reach it. The
// script gets the interface of this node's address (where its worker
// listens), unless the environment names one already.
void add_socket_interfaces(std::vector<std::string>& vars) {
  std::string host = core::env_value(core::kEnvAdvertiseHost);
  if (host.empty()) host = core::env_value(core::kEnvBindHost);
  if (host.empty() || host.rfind("127.", 0) == 0 || host == "::1") return;
  const std::string ifname = interface_of(host);
  if (ifname.empty()) return;
  for (const char* var : {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"})
    if (core::env_value(var).empty()) vars.push_back(std::string(var) + "=" + ifname);
}

using Clock = std::chrono::steady_clock;

// Longer lines go out in pieces of this size.
constexpr size_t kMaxLine = 64 * 1024;
// How long output is still forwarded after the script exits, from
// descendants that keep its pipes open.
constexpr auto kDrainBound = std::chrono::seconds(2);

// Reads a script's stdout and stderr until both end, splits them into lines
// and writes those to the driver's stream. When the driver is gone it stops
// sending but keeps draining, so the script never blocks on a full pipe.
class OutputPump {
 public:
  OutputPump(int32_t rank, int out_fd, int err_fd, StreamRef ref)
      : rank_(rank), fds_{out_fd, err_fd}, ref_(std::move(ref)) {
    thread_ = std::thread([this] { run(); });
  }
  ~OutputPump() { finish(std::chrono::milliseconds(0)); }
  // Waits for both pipes to end, at most `bound`, then stops reading.
  void finish(std::chrono::milliseconds bound) {
    give_up_at_.store((Clock::now() + bound).time_since_epoch().count());
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run() {
    try {
      writer_.emplace(this_actor::runtime(), ref_);
    } catch (const std::exception&) {
      // The driver is gone: drain only.
    }
    while (fds_[0] >= 0 || fds_[1] >= 0) {
      if (Clock::now().time_since_epoch().count() >= give_up_at_.load()) break;
      pollfd p[2] = {{fds_[0], POLLIN, 0}, {fds_[1], POLLIN, 0}};
      int n = ::poll(p, 2, 50);
      if (n < 0 && errno != EINTR) break;
      for (int i = 0; i < 2 && n > 0; ++i)
        if (fds_[i] >= 0 && (p[i].revents & (POLLIN | POLLHUP | POLLERR))) read_from(i);
    }
    for (int i = 0; i < 2; ++i) {
      if (!bufs_[i].empty()) send(i == 1, std::move(bufs_[i]));
      if (fds_[i] >= 0) ::close(fds_[i]);
    }
    if (writer_) {
      try {
        writer_->close();
      } catch (const std::exception&) {
      }
    }
  }
  void read_from(int i) {
    char buf[16384];
    ssize_t n = ::read(fds_[i], buf, sizeof(buf));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (n <= 0) {
      ::close(fds_[i]);
      fds_[i] = -1;
      return;
    }
    std::string& b = bufs_[i];
    b.append(buf, static_cast<size_t>(n));
    size_t start = 0, nl;
    while ((nl = b.find('\n', start)) != std::string::npos) {
      send(i == 1, b.substr(start, nl - start));
      start = nl + 1;
    }
    b.erase(0, start);
    while (b.size() >= kMaxLine) {
      send(i == 1, b.substr(0, kMaxLine));
      b.erase(0, kMaxLine);
    }
  }
  void send(bool is_stderr, std::string text) {
    if (!writer_) return;
    try {
      writer_->write(OutputLine{rank_, is_stderr, std::move(text)});
    } catch (const std::exception&) {
      writer_.reset();  // the driver is gone; keep draining
    }
  }

  int32_t rank_;
  int fds_[2];
  std::string bufs_[2];
  StreamRef ref_;
  std::optional<StreamWriter<OutputLine>> writer_;
  std::atomic<Clock::rep> give_up_at_{Clock::time_point::max().time_since_epoch().count()};
  std::thread thread_;
};

std::string read_small_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return "";
  std::string text(64 * 1024, '\0');
  f.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(f.gcount()));
  return text;
}

// The node's environment less what torchrun sets, then torchrun's.
std::vector<std::string> script_environment(const std::vector<std::string>& vars) {
  std::vector<std::string> env = core::clean_environment();
  auto key = [](const std::string& kv) { return kv.substr(0, kv.find('=')); };
  for (auto& v : vars) {
    std::string k = key(v);
    std::erase_if(env, [&](const std::string& e) { return key(e) == k; });
  }
  env.insert(env.end(), vars.begin(), vars.end());
  return env;
}

}  // namespace

struct TorchrunSlot::State {
  std::mutex mu;
  pid_t pid = -1;
  bool reaped = false;
  bool stop_requested = false;
  std::optional<Clock::time_point> kill_at;
  std::unique_ptr<OutputPump> pump;
  std::string dir;  // holds TORCHELASTIC_ERROR_FILE
  std::string error_file;

  int32_t stop(uint32_t grace_ms) {
    std::lock_guard lock(mu);
    stop_requested = true;
    if (pid <= 0 || reaped) return 0;
    ::kill(-pid, SIGTERM);
    kill_at = Clock::now() + std::chrono::milliseconds(grace_ms);
    return 1;
  }
};

std::string find_executable(const std::string& name, const std::string& path) {
  auto runnable = [](const std::string& p) {
    struct stat st {};
    return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(p.c_str(), X_OK) == 0;
  };
  if (name.find('/') != std::string::npos) return runnable(name) ? name : "";
  std::stringstream dirs(path);
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    std::string p = (dir.empty() ? "." : dir) + "/" + name;
    if (runnable(p)) return p;
  }
  return "";
}

TorchrunSlot::TorchrunSlot() : state_(std::make_shared<State>()) {
  if (!this_actor::in_worker()) return;
  std::weak_ptr<State> weak = state_;
  this_actor::on_control<StopScript>([weak](const StopScript& m) {
    auto st = weak.lock();
    return st ? st->stop(m.grace_ms) : 0;
  });
}

TorchrunSlot::~TorchrunSlot() {
  std::unique_lock lock(state_->mu);
  if (state_->pid > 0 && !state_->reaped) {
    ::kill(-state_->pid, SIGKILL);
    ::waitpid(state_->pid, nullptr, 0);
    state_->reaped = true;
  }
  auto pump = std::move(state_->pump);
  lock.unlock();
  pump.reset();
  std::error_code ec;
  if (!state_->dir.empty()) std::filesystem::remove_all(state_->dir, ec);
}

int32_t TorchrunSlot::free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(std::string("torchrun slot: socket: ") + std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof(a);
  bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
            ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  int err = errno;
  ::close(fd);
  if (!ok) throw Error(std::string("torchrun slot: no free port: ") + std::strerror(err));
  return ntohs(a.sin_port);
}

int64_t TorchrunSlot::start(ScriptLaunch l) {
  std::lock_guard lock(state_->mu);
  if (state_->stop_requested) return -1;
  if (state_->pid > 0) throw ConfigError("torchrun slot: rank " + std::to_string(l.rank) + " already runs a script");
  const char* path = std::getenv("PATH");
  std::string exe = find_executable(l.python, path ? path : "/usr/bin:/bin");
  if (exe.empty())
    throw ConfigError("interpreter " + l.python + " not found" +
                      (l.python.find('/') == std::string::npos ? " on PATH" : "") + " (give --python PATH)");
  char dir[] = "/tmp/troupe-torchrun-XXXXXX";
  if (::mkdtemp(dir) == nullptr) throw Error(std::string("torchrun slot: mkdtemp: ") + std::strerror(errno));
  state_->dir = dir;
  state_->error_file = state_->dir + "/error.json";
  std::vector<std::string> vars = l.env;
  vars.push_back("TORCHELASTIC_ERROR_FILE=" + state_->error_file);
  add_socket_interfaces(vars);
  core::SpawnOptions s;
  s.executable = exe;
  s.arg0 = l.python;
  if (l.module) s.args.push_back("-m");
  s.args.push_back(l.script);
  s.args.insert(s.args.end(), l.args.begin(), l.args.end());
  s.env = script_environment(vars);
  std::error_code ec;
  if (!l.working_dir.empty() && std::filesystem::is_directory(l.working_dir, ec)) s.working_dir = l.working_dir;
  s.new_session = true;  // its own process group, stopped as one
  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0) throw Error(std::string("pipe: ") + std::strerror(errno));
  if (::pipe2(err, O_CLOEXEC) != 0) {
    ::close(out[0]);
    ::close(out[1]);
    throw Error(std::string("pipe: ") + std::strerror(errno));
  }
  s.stdout_fd = out[1];
  s.stderr_fd = err[1];
  pid_t pid = -1;
  try {
    pid = core::spawn_process(s);
  } catch (...) {
    for (int fd : {out[0], out[1], err[0], err[1]}) ::close(fd);
    throw;
  }
  ::close(out[1]);
  ::close(err[1]);
  state_->pid = pid;
  state_->pump = std::make_unique<OutputPump>(l.rank, out[0], err[0], l.output);
  return pid;
}

ScriptExit TorchrunSlot::wait_exit() {
  pid_t pid;
  {
    std::lock_guard lock(state_->mu);
    pid = state_->pid;
  }
  if (pid <= 0) return {};
  int status = 0;
  for (;;) {
    pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0 && errno != EINTR) throw Error(std::string("torchrun slot: waitpid: ") + std::strerror(errno));
    {
      std::lock_guard lock(state_->mu);
      if (state_->kill_at && Clock::now() >= *state_->kill_at) {
        ::kill(-pid, SIGKILL);
        state_->kill_at.reset();
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::unique_lock lock(state_->mu);
  state_->reaped = true;
  // Whatever the script left in its process group goes with it.
  ::kill(-pid, SIGKILL);
  auto pump = std::move(state_->pump);
  lock.unlock();
  if (pump) pump->finish(std::chrono::duration_cast<std::chrono::milliseconds>(kDrainBound));
  return {true, status, read_small_file(state_->error_file)};
}

}  // namespace troupe::launcher
