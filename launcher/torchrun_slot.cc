#include "torchrun_slot.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <utility>

#include <nlohmann/json.hpp>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/process.h"
#include "troupe/runtime/core/worker_env.h"

namespace troupe::launcher {

namespace {

using Clock = std::chrono::steady_clock;

// Longer lines go out in pieces of this size.
constexpr size_t kMaxLine = 64 * 1024;
// How long a script runs before its slot starts the next attempt's spare
// interpreter.
constexpr auto kSpareDelay = std::chrono::seconds(3);
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

// A child interpreter and our ends of its pipes (-1 = none).
struct Child {
  pid_t pid = -1;
  int in = -1;  // its stdin (spares only)
  int out = -1;
  int err = -1;
  std::string python;  // what it was started as
};

// What a spare interpreter runs: it imports torch ahead of time, then waits
// for one JSON line on stdin (environment, working directory, argv) and
// runs the script as `python script.py` or `python -m module` would.
constexpr const char* kSpareBoot = R"PY(
import json, os, sys
try:
    import torch  # noqa: F401  what a restart would spend its time on
except Exception:
    pass
line = sys.stdin.readline()
if not line:
    sys.exit(0)
spec = json.loads(line)
sys.stdin = open(os.devnull)
os.environ.clear()
os.environ.update(spec["env"])
if spec["cwd"]:
    os.chdir(spec["cwd"])
import runpy
sys.argv = list(spec["argv"])
if spec["module"]:
    sys.path[0] = os.getcwd()
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    runpy.run_path(sys.argv[0], run_name="__main__")
)PY";

void close_child(Child& c) {
  for (int* fd : {&c.in, &c.out, &c.err})
    if (*fd >= 0) ::close(std::exchange(*fd, -1));
}

// Starts `exe args...` in a process group of its own with its stdout and
// stderr (and, for a spare, its stdin) on pipes.
Child spawn_child(const std::string& exe, const std::string& python, std::vector<std::string> args,
                  std::vector<std::string> env, const std::string& cwd, bool with_stdin) {
  int pipes[3][2] = {{-1, -1}, {-1, -1}, {-1, -1}};
  auto close_all = [&] {
    for (auto& p : pipes)
      for (int fd : p)
        if (fd >= 0) ::close(fd);
  };
  for (int i = with_stdin ? 0 : 1; i < 3; ++i)
    if (::pipe2(pipes[i], O_CLOEXEC) != 0) {
      int e = errno;
      close_all();
      throw Error(std::string("pipe: ") + std::strerror(e));
    }
  core::SpawnOptions s;
  s.executable = exe;
  s.arg0 = python;
  s.args = std::move(args);
  s.env = std::move(env);
  s.working_dir = cwd;
  s.new_session = true;  // its own process group, stopped as one
  s.stdin_fd = pipes[0][0];
  s.stdout_fd = pipes[1][1];
  s.stderr_fd = pipes[2][1];
  Child c;
  c.python = python;
  try {
    c.pid = core::spawn_process(s);
  } catch (...) {
    close_all();
    throw;
  }
  // The child's ends.
  for (int fd : {pipes[0][0], pipes[1][1], pipes[2][1]})
    if (fd >= 0) ::close(fd);
  c.in = pipes[0][1];
  c.out = pipes[1][0];
  c.err = pipes[2][0];
  return c;
}

// The launch line a spare reads.
std::string spare_spec(const std::vector<std::string>& env, const std::string& cwd,
                       const std::vector<std::string>& argv, bool module) {
  nlohmann::json e = nlohmann::json::object();
  for (auto& kv : env) {
    auto eq = kv.find('=');
    if (eq != std::string::npos) e[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  nlohmann::json spec = {{"env", e}, {"cwd", cwd}, {"argv", argv}, {"module", module}};
  return spec.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

// Runs in the slot's call thread (wait_exit), as every child of the slot
// does: PR_SET_PDEATHSIG follows the thread that forked.
template <class State>
void start_planned_spare(State& st) {
  if (!st.spare_plan || Clock::now() < st.spare_plan->at) return;
  auto plan = std::move(*st.spare_plan);
  st.spare_plan.reset();
  try {
    st.spare = spawn_child(plan.exe, plan.python, {"-c", kSpareBoot}, plan.env, "", true);
  } catch (const std::exception&) {
    // No spare: the next attempt starts cold.
  }
}

bool write_all(int fd, const std::string& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += size_t(n);
  }
  return true;
}

}  // namespace

struct TorchrunSlot::State {
  std::mutex mu;
  pid_t pid = -1;
  bool reaped = true;
  int32_t attempt = -1;          // of the script started last
  int32_t stopped_attempt = -1;  // the last attempt told to stop
  std::optional<Clock::time_point> kill_at;
  std::unique_ptr<OutputPump> pump;
  Child spare;
  // The spare to start once the script has run kSpareDelay (not before:
  // its import of torch would slow the script's own start).
  struct SparePlan {
    std::string exe, python;
    std::vector<std::string> env;
    Clock::time_point at;
  };
  std::optional<SparePlan> spare_plan;
  std::string dir;  // holds TORCHELASTIC_ERROR_FILE
  std::string error_file;

  int32_t stop(int32_t of_attempt, uint32_t grace_ms) {
    std::lock_guard lock(mu);
    stopped_attempt = std::max(stopped_attempt, of_attempt);
    if (pid <= 0 || reaped || attempt > of_attempt) return 0;
    ::kill(-pid, SIGTERM);
    kill_at = Clock::now() + std::chrono::milliseconds(grace_ms);
    return 1;
  }

  // The spare, when it runs `python` and is still alive; else none (reaped).
  std::optional<Child> take_spare(const std::string& python) {
    Child c = std::exchange(spare, Child{});
    if (c.pid <= 0) return std::nullopt;
    if (c.python == python && ::waitpid(c.pid, nullptr, WNOHANG) == 0) return c;
    drop(c);
    return std::nullopt;
  }

  static void drop(Child& c) {
    if (c.pid > 0) {
      ::kill(-c.pid, SIGKILL);
      ::waitpid(c.pid, nullptr, 0);
    }
    close_child(c);
  }

  // A fresh folder for this attempt's TORCHELASTIC_ERROR_FILE.
  void new_error_dir() {
    std::error_code ec;
    if (!dir.empty()) std::filesystem::remove_all(dir, ec);
    char d[] = "/tmp/troupe-torchrun-XXXXXX";
    if (::mkdtemp(d) == nullptr) throw Error(std::string("torchrun slot: mkdtemp: ") + std::strerror(errno));
    dir = d;
    error_file = dir + "/error.json";
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
    return st ? st->stop(m.attempt, m.grace_ms) : 0;
  });
}

TorchrunSlot::~TorchrunSlot() {
  std::unique_lock lock(state_->mu);
  if (state_->pid > 0 && !state_->reaped) {
    ::kill(-state_->pid, SIGKILL);
    ::waitpid(state_->pid, nullptr, 0);
    state_->reaped = true;
  }
  State::drop(state_->spare);
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
  if (state_->stopped_attempt >= l.restart_count) return -1;
  if (state_->pid > 0 && !state_->reaped)
    throw ConfigError("torchrun slot: rank " + std::to_string(l.rank) + " already runs a script");
  const char* path = std::getenv("PATH");
  std::string exe = find_executable(l.python, path ? path : "/usr/bin:/bin");
  if (exe.empty())
    throw ConfigError("interpreter " + l.python + " not found" +
                      (l.python.find('/') == std::string::npos ? " on PATH" : "") + " (give --python PATH)");
  state_->new_error_dir();
  std::vector<std::string> vars = l.env;
  vars.push_back("TORCHELASTIC_ERROR_FILE=" + state_->error_file);
  std::vector<std::string> env = script_environment(vars);
  std::error_code ec;
  std::string cwd = !l.working_dir.empty() && std::filesystem::is_directory(l.working_dir, ec) ? l.working_dir : "";
  std::vector<std::string> argv{l.script};
  argv.insert(argv.end(), l.args.begin(), l.args.end());
  Child c;
  if (auto spare = state_->take_spare(l.python); spare && write_all(spare->in, spare_spec(env, cwd, argv, l.module))) {
    c = *spare;
    ::close(std::exchange(c.in, -1));
  } else {
    if (spare) State::drop(*spare);
    if (l.module) argv.insert(argv.begin(), "-m");
    c = spawn_child(exe, l.python, argv, env, cwd, false);
  }
  state_->pid = c.pid;
  state_->reaped = false;
  state_->attempt = l.restart_count;
  state_->kill_at.reset();
  state_->pump = std::make_unique<OutputPump>(l.rank, c.out, c.err, l.output);
  state_->spare_plan.reset();
  if (l.keep_spare) state_->spare_plan = State::SparePlan{exe, l.python, env, Clock::now() + kSpareDelay};
  return c.pid;
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
      start_planned_spare(*state_);
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
