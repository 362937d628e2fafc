#include "torchrun_slot.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
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

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/files.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/core/process.h"
#include "troupe/runtime/core/worker_env.h"
#include "troupe/runtime/wire/local_host.h"

namespace troupe::launcher {

namespace {

// The slots' scratch directories, /tmp/troupe-torchrun-PID-XXXXXX.
constexpr const char* kScratchPrefix = "troupe-torchrun-";

}  // namespace

namespace {

// Gloo and NCCL pick their interface from the host name, which often
// resolves to 127.0.1.1: ranks on other machines could not reach it. The
// script gets the interface of this node's address (where its worker
// listens), unless the node's environment or the launch's variables (the
// driver's, docs/torchrun.md) name one already.
void add_socket_interfaces(std::vector<std::string>& vars) {
  std::string host = core::env_value(core::kEnvAdvertiseHost);
  if (host.empty()) host = core::env_value(core::kEnvBindHost);
  if (host.empty() || host.rfind("127.", 0) == 0 || host == "::1") return;
  const std::string ifname = wire::interface_of(host);
  if (ifname.empty()) return;
  auto given = [&](const std::string& var) {
    for (const auto& kv : vars)
      if (kv.rfind(var + "=", 0) == 0) return true;
    return !core::env_value(var.c_str()).empty();
  };
  for (const char* var : {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"})
    if (!given(var)) vars.push_back(std::string(var) + "=" + ifname);
}

using Clock = std::chrono::steady_clock;

std::string this_host() {
  char name[256] = {};
  return ::gethostname(name, sizeof name - 1) == 0 ? std::string(name) : std::string("this host");
}

// Longer lines go out in pieces of this size, which the launcher joins.
constexpr size_t kMaxLine = 64 * 1024;
// A progress bar's redrawn line goes out at most this often.
constexpr auto kProgressEvery = std::chrono::seconds(1);
// How long output is still forwarded after the script exits, from
// descendants that keep its pipes open.
constexpr auto kDrainBound = std::chrono::seconds(2);

// Reads a script's stdout and stderr until both end, splits them into lines
// and writes those to the driver's stream. When the driver is gone it stops
// sending but keeps draining, so the script never blocks on a full pipe.
//
// A progress bar (tqdm) redraws one line with '\r' and ends it with '\n'
// only when it is done: its latest frame goes out as a line at most once a
// second while it runs, and a line sends only its last frame, so the
// driver's console shows progress as it comes and never a raw '\r'.
class OutputPump {
 public:
  // `note`: a line of the slot's own for the driver's console, sent as the
  // rank's first line of stderr ("" = none).
  OutputPump(int32_t rank, int out_fd, int err_fd, StreamRef ref, std::string note = "")
      : rank_(rank), fds_{out_fd, err_fd}, ref_(std::move(ref)), note_(std::move(note)) {
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
    if (!note_.empty()) send(true, note_);
    while (fds_[0] >= 0 || fds_[1] >= 0) {
      if (Clock::now().time_since_epoch().count() >= give_up_at_.load()) break;
      pollfd p[2] = {{fds_[0], POLLIN, 0}, {fds_[1], POLLIN, 0}};
      int n = ::poll(p, 2, 50);
      if (n < 0 && errno != EINTR) break;
      for (int i = 0; i < 2 && n > 0; ++i)
        if (fds_[i] >= 0 && (p[i].revents & (POLLIN | POLLHUP | POLLERR))) read_from(i);
      for (int i = 0; i < 2; ++i) progress(i, false);
    }
    for (int i = 0; i < 2; ++i) {
      progress(i, true);
      const std::string& b = bufs_[i];
      if (!b.empty() && !(b.find('\r') != std::string::npos && last_frame(b) == sent_frame_[i]))
        send(i == 1, last_frame(b));
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
      // The line's end shows its last frame, unless that went out already.
      std::string line = last_frame(b.substr(start, nl - start));
      const bool redrawn = b.find('\r', start) < nl;
      if (!(redrawn && line == sent_frame_[i])) send(i == 1, std::move(line));
      frame_[i].clear();
      sent_frame_[i].clear();
      start = nl + 1;
    }
    b.erase(0, start);
    if (const size_t cr = b.rfind('\r'); cr != std::string::npos) {
      // Redrawn: the newest frame is the one after the last '\r' (a write
      // holds a whole frame), or the one before it when none follows yet.
      std::string newest = cr + 1 < b.size() ? b.substr(cr + 1) : last_frame(b.substr(0, cr));
      if (!newest.empty()) frame_[i] = std::move(newest);
      b.erase(0, cr);
    }
    while (b.size() >= kMaxLine && b.find('\r') == std::string::npos) {
      send(i == 1, b.substr(0, kMaxLine), true);
      b.erase(0, kMaxLine);
    }
    while (b.size() >= kMaxLine) {  // a redrawn line this long: its frames in pieces
      send(i == 1, last_frame(b.substr(0, kMaxLine)));
      b.erase(0, kMaxLine);
    }
  }
  // The text a terminal would show of `line`: what follows its last '\r'
  // ("\r 40%\r 50%" is " 50%"), or the frame before a trailing '\r'.
  static std::string last_frame(const std::string& line) {
    size_t end = line.size();
    while (end > 0 && line[end - 1] == '\r') --end;
    const size_t cr = line.rfind('\r', end == 0 ? 0 : end - 1);
    const size_t from = (cr == std::string::npos || end == 0) ? 0 : cr + 1;
    return line.substr(from, end - from);
  }
  // Sends a redrawn line's newest frame, once a second (or now: `all`).
  void progress(int i, bool all) {
    if (frame_[i].empty()) return;
    const auto now = Clock::now();
    if (!all && now - shown_[i] < kProgressEvery) return;
    shown_[i] = now;
    if (frame_[i] != sent_frame_[i]) send(i == 1, frame_[i]);
    sent_frame_[i] = std::move(frame_[i]);
    frame_[i].clear();
  }
  void send(bool is_stderr, std::string text, bool continues = false) {
    if (!writer_) return;
    try {
      writer_->write(OutputLine{rank_, is_stderr, std::move(text), continues});
    } catch (const std::exception&) {
      writer_.reset();  // the driver is gone; keep draining
    }
  }

  int32_t rank_;
  int fds_[2];
  std::string bufs_[2];
  std::string frame_[2];          // a redrawn line's newest frame, not yet sent
  std::string sent_frame_[2];     // the frame of the line being redrawn that went out last
  Clock::time_point shown_[2]{};  // when a frame of each was last sent
  StreamRef ref_;
  std::string note_;
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

// The node's environment less troupe's own variables and what torchrun
// sets, then torchrun's. (clean_environment keeps the TROUPE_ settings
// meant for workers, TROUPE_OBJECT_STORE_BYTES and the like: every rank
// saw them.)
std::vector<std::string> script_environment(const std::vector<std::string>& vars) {
  std::vector<std::string> env = core::clean_environment();
  std::erase_if(env, [](const std::string& e) { return e.rfind("TROUPE_", 0) == 0; });
  auto key = [](const std::string& kv) { return kv.substr(0, kv.find('=')); };
  for (auto& v : vars) {
    std::string k = key(v);
    std::erase_if(env, [&](const std::string& e) { return key(e) == k; });
  }
  env.insert(env.end(), vars.begin(), vars.end());
  return env;
}

// Spawns `s` in a process group of its own (stopped as one), its stdout and
// stderr into pipes whose read ends come back as out_fd and err_fd.
pid_t spawn_with_output(core::SpawnOptions s, int& out_fd, int& err_fd) {
  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0) throw Error(std::string("pipe: ") + std::strerror(errno));
  if (::pipe2(err, O_CLOEXEC) != 0) {
    ::close(out[0]);
    ::close(out[1]);
    throw Error(std::string("pipe: ") + std::strerror(errno));
  }
  s.new_session = true;
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
  out_fd = out[0];
  err_fd = err[0];
  return pid;
}

// What a spare interpreter runs: it imports the modules named in
// TROUPE_TORCHRUN_PRELOAD (one that fails is skipped), then blocks reading
// its launch from the descriptor TROUPE_TORCHRUN_SPARE_FD names: fields
// ended by NUL (hand_over), bytes as given, decoded as Python decodes a
// fresh interpreter's argv and environment (os.fsdecode).
// EOF with nothing read (the slot let it go, or died) ends it. Otherwise it
// takes the launch's environment (whole), working directory and argv and
// runs the script or module as __main__, as `python script.py` would: its
// exceptions and SystemExit end the process the same way.
constexpr const char* kSpareBootstrap = R"PY(
import importlib, os, runpy, sys
_fd = int(os.environ.pop("TROUPE_TORCHRUN_SPARE_FD"))
for _m in os.environ.pop("TROUPE_TORCHRUN_PRELOAD", "").split(","):
    if _m:
        try:
            importlib.import_module(_m)
        except Exception:
            pass
with os.fdopen(_fd, "rb") as _f:
    _raw = _f.read()
if not _raw:
    os._exit(0)
_f = [os.fsdecode(p) for p in _raw.split(b"\0")[:-1]]
_module, _cwd, _script, _n = _f[0] == "1", _f[1], _f[2], int(_f[3])
os.environ.clear()
os.environ.update(kv.split("=", 1) for kv in _f[4 + _n:] if "=" in kv)
if _cwd:
    os.chdir(_cwd)
sys.argv = [_script] + _f[4:4 + _n]
if _module:
    sys.path[0] = os.getcwd()
    runpy.run_module(_script, run_name="__main__", alter_sys=True)
else:
    sys.path[0] = os.path.dirname(os.path.realpath(_script))
    runpy.run_path(_script, run_name="__main__")
)PY";

// A spare interpreter, started ahead of the next attempt: its pid (the
// leader of its own process group), the write end of its launch pipe, and
// the read ends of its stdout and stderr.
struct Spare {
  pid_t pid = -1;
  std::string exe;
  int launch_fd = -1;
  int out_fd = -1;
  int err_fd = -1;

  // Kills and reaps it and closes its descriptors.
  void discard() {
    if (pid > 0) {
      ::kill(-pid, SIGKILL);
      core::wait_child(pid);
    }
    for (int fd : {launch_fd, out_fd, err_fd})
      if (fd >= 0) ::close(fd);
    pid = -1;
    launch_fd = out_fd = err_fd = -1;
  }
};

// What the next spare is started with: the last script's interpreter,
// environment and working directory, and the modules to import.
struct SpareRecipe {
  std::string exe;
  std::string arg0;
  std::vector<std::string> env;
  std::string working_dir;
  std::vector<std::string> preload;
};

std::optional<Spare> start_spare(const SpareRecipe& r) {
  int launch[2];
  if (::pipe2(launch, O_CLOEXEC) != 0) return std::nullopt;
  core::SpawnOptions s;
  s.executable = r.exe;
  s.arg0 = r.arg0;
  s.args = {"-c", kSpareBootstrap};
  s.env = r.env;
  s.env.push_back("TROUPE_TORCHRUN_SPARE_FD=" + std::to_string(launch[0]));
  std::string preload;
  for (const auto& m : r.preload) preload += (preload.empty() ? "" : ",") + m;
  s.env.push_back("TROUPE_TORCHRUN_PRELOAD=" + preload);
  s.working_dir = r.working_dir;
  s.keep_fds = {launch[0]};
  Spare spare;
  try {
    spare.pid = spawn_with_output(std::move(s), spare.out_fd, spare.err_fd);
  } catch (const std::exception&) {
    ::close(launch[0]);
    ::close(launch[1]);
    return std::nullopt;
  }
  ::close(launch[0]);
  spare.exe = r.exe;
  spare.launch_fd = launch[1];
  return spare;
}

// Hands `l` to the spare; false (the spare discarded) when it is gone.
bool hand_over(Spare& spare, const ScriptLaunch& l, const std::vector<std::string>& env, const std::string& cwd) {
  int status = 0;
  if (::waitpid(spare.pid, &status, WNOHANG) == spare.pid) {
    spare.pid = -1;  // reaped: it died while idle
    spare.discard();
    return false;
  }
  // Bytes as given, each field ended by NUL (none holds one: they are argv
  // and environment strings): JSON replaced what was not UTF-8, so a warm
  // restart's script got U+FFFD where its first attempt got the bytes.
  std::string text;
  auto field = [&text](const std::string& s) {
    text += s;
    text.push_back('\0');
  };
  field(l.module ? "1" : "0");
  field(cwd);
  field(l.script);
  field(std::to_string(l.args.size()));
  for (const auto& a : l.args) field(a);
  for (const auto& kv : env) field(kv);
  size_t off = 0;
  while (off < text.size()) {
    ssize_t n = ::write(spare.launch_fd, text.data() + off, text.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      spare.discard();
      return false;
    }
    off += static_cast<size_t>(n);
  }
  ::close(spare.launch_fd);
  spare.launch_fd = -1;
  return true;
}

// Starts `python [-m] script args...` in a fresh interpreter (or, with
// no_python, `script args...`: `exe` is the script); its stdout and stderr
// come back as out_fd and err_fd.
pid_t spawn_script(const std::string& exe, const ScriptLaunch& l, std::vector<std::string> env, const std::string& cwd,
                   int& out_fd, int& err_fd) {
  core::SpawnOptions s;
  s.executable = exe;
  s.arg0 = l.no_python ? l.script : l.python;
  if (l.module) s.args.push_back("-m");
  if (!l.no_python) s.args.push_back(l.script);
  s.args.insert(s.args.end(), l.args.begin(), l.args.end());
  s.env = std::move(env);
  s.working_dir = cwd;
  return spawn_with_output(std::move(s), out_fd, err_fd);
}

}  // namespace

struct TorchrunSlot::State {
  std::mutex mu;
  pid_t pid = -1;
  bool reaped = false;
  int32_t running_restart = -1;  // the attempt of the script in `pid`
  int32_t stopped_through = -1;  // attempts up to this one are stopped
  std::optional<Clock::time_point> kill_at;
  std::unique_ptr<OutputPump> pump;
  // Holds TORCHELASTIC_ERROR_FILE: /tmp/troupe-torchrun-PID-XXXXXX, locked
  // while this worker lives, so that one killed without unwinding (at a
  // job's end) leaves it to the next slot's cleanup.
  core::OwnedDir dir;
  std::string error_file;
  std::optional<Spare> spare;
  std::optional<SpareRecipe> recipe;  // set while warm restarts are on
  Clock::time_point spare_due = Clock::time_point::max();

  int32_t stop(uint32_t grace_ms, int32_t restart_count, int32_t signal) {
    std::lock_guard lock(mu);
    stopped_through = std::max(stopped_through, restart_count);
    if (pid <= 0 || reaped || running_restart > restart_count) return 0;
    // SIGINT when the launcher had Ctrl-C (a script's `except
    // KeyboardInterrupt` saves), else SIGTERM; nothing else is sent.
    ::kill(-pid, signal == SIGINT ? SIGINT : SIGTERM);
    kill_at = Clock::now() + std::chrono::milliseconds(grace_ms);
    return 1;
  }

  // Starts the spare once it is due (under mu).
  void start_spare_if_due() {
    if (!recipe || spare || Clock::now() < spare_due) return;
    spare = start_spare(*recipe);
    spare_due = Clock::time_point::max();  // one try per script
  }

  // Forgets the previous, finished script (under mu).
  void clear_finished() {
    pid = -1;
    reaped = false;
    kill_at.reset();
    pump.reset();
    dir.remove();
    error_file.clear();
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
    return st ? st->stop(m.grace_ms, m.restart_count, m.signal) : 0;
  });
}

TorchrunSlot::~TorchrunSlot() {
  std::unique_lock lock(state_->mu);
  if (state_->pid > 0 && !state_->reaped) {
    ::kill(-state_->pid, SIGKILL);
    core::wait_child(state_->pid);
    state_->reaped = true;
  }
  if (state_->spare) state_->spare->discard();
  auto pump = std::move(state_->pump);
  lock.unlock();
  pump.reset();
  state_->dir.remove();
}

int32_t TorchrunSlot::free_port() { return wire::free_listen_port(); }

std::string TorchrunSlot::devices() { return core::env_value("CUDA_VISIBLE_DEVICES"); }

std::string TorchrunSlot::prepare(ShippedDir dir) {
  try {
    return local_dir(dir);
  } catch (const Error& e) {
    // No restart mends it: the job ends, naming the node.
    throw ConfigError(e.what());
  }
}

int64_t TorchrunSlot::start(ScriptLaunch l) {
  // The node's copy of the driver's directory (prepare() made it), looked
  // up before the lock is taken.
  if (!l.shipped.path.empty()) {
    const std::string copy = prepare(l.shipped);
    if (!l.module && !(l.no_python && l.script.find('/') == std::string::npos))
      l.script = path_in_copy(l.shipped, copy, l.script);
    l.working_dir = path_in_copy(l.shipped, copy, l.working_dir);
  }
  std::lock_guard lock(state_->mu);
  if (l.restart_count <= state_->stopped_through) return -1;
  if (state_->pid > 0 && !state_->reaped)
    throw ConfigError("torchrun slot: rank " + std::to_string(l.rank) + " already runs a script");
  state_->clear_finished();
  const char* path = std::getenv("PATH");
  const std::string& program = l.no_python ? l.script : l.python;
  std::string exe = find_executable(program, path ? path : "/usr/bin:/bin");
  if (exe.empty() && l.no_python)
    throw ConfigError(
        "program " + program +
        (program.find('/') == std::string::npos ? " not found on PATH" : " is not an executable file (chmod +x?)") +
        " (--no-python runs the script as a program)");
  std::error_code script_ec;
  if (!l.no_python && !l.module && !l.shipped.path.empty() && !std::filesystem::is_regular_file(l.script, script_ec))
    throw ConfigError("script " + l.script + " is not in " + this_host() + "'s copy of " + l.shipped.path +
                      " (did a rank remove it?)");
  if (!l.no_python && !l.module && !std::filesystem::is_regular_file(l.script, script_ec))
    throw ConfigError("script " + l.script + " is not on this node (" + this_host() +
                      "): troupe torchrun runs the driver's script at the same path on every node; put it there "
                      "(a folder every node shares), or give --ship-working-dir to send the driver's working "
                      "directory to the nodes");
  if (exe.empty())
    throw ConfigError("interpreter " + l.python + " not found" +
                      (l.python.find('/') == std::string::npos ? " on PATH" : "") + " (give --python PATH)");
  core::remove_orphaned_dirs("/tmp", kScratchPrefix);
  state_->dir = core::OwnedDir::make("/tmp", kScratchPrefix);
  state_->error_file = state_->dir.path() + "/error.json";
  std::vector<std::string> vars = l.env;
  vars.push_back("TORCHELASTIC_ERROR_FILE=" + state_->error_file);
  add_socket_interfaces(vars);
  std::vector<std::string> env = script_environment(vars);
  std::string cwd;
  std::string note;  // for the driver's console
  std::error_code ec;
  if (!l.working_dir.empty() && std::filesystem::is_directory(l.working_dir, ec)) {
    cwd = l.working_dir;
  } else if (!l.working_dir.empty()) {
    // The driver's working directory is not on this node: the script's
    // own folder (where relative paths most likely point), said on the
    // driver's console and in the worker's log, rather than / without a
    // word.
    const auto folder = std::filesystem::path(l.script).parent_path();
    if (!l.module && std::filesystem::is_directory(folder, ec)) cwd = folder.string();
    note = "troupe torchrun: the driver's working directory " + l.working_dir + " is not on " + this_host() +
           "; rank " + std::to_string(l.rank) + " runs in " + (cwd.empty() ? "its node agent's" : cwd);
    TROUPE_LOG_WARN("torchrun slot: {}", note);
  }

  auto& spare = state_->spare;
  if (spare && (!l.warm || spare->exe != exe)) {
    spare->discard();
    spare.reset();
  }
  pid_t pid = -1;
  int out_fd = -1, err_fd = -1;
  if (spare && hand_over(*spare, l, env, cwd)) {
    pid = spare->pid;
    out_fd = spare->out_fd;
    err_fd = spare->err_fd;
    TROUPE_LOG_INFO("torchrun slot: rank {} attempt {} runs in the spare interpreter (pid {})", l.rank, l.restart_count,
                    pid);
  } else {
    pid = spawn_script(exe, l, env, cwd, out_fd, err_fd);
  }
  spare.reset();
  state_->pid = pid;
  state_->running_restart = l.restart_count;
  state_->pump = std::make_unique<OutputPump>(l.rank, out_fd, err_fd, l.output, std::move(note));
  if (l.warm) {
    state_->recipe = SpareRecipe{exe, l.python, env, cwd, l.preload};
    state_->spare_due = Clock::now() + std::chrono::milliseconds(l.spare_delay_ms);
    state_->start_spare_if_due();
  } else {
    state_->recipe.reset();
  }
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
      state_->start_spare_if_due();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::unique_lock lock(state_->mu);
  state_->reaped = true;
  // Whatever the script left in its process group goes with it.
  ::kill(-pid, SIGKILL);
  auto pump = std::move(state_->pump);
  // This attempt's: a start() while the output drains makes its own.
  const std::string dir = state_->dir.path(), error_file = state_->error_file;
  lock.unlock();
  if (pump) pump->finish(std::chrono::duration_cast<std::chrono::milliseconds>(kDrainBound));
  ScriptExit exit{true, status, read_small_file(error_file)};
  // Read: the directory goes now, not with the slot, whose worker is
  // killed at the job's end without unwinding.
  lock.lock();
  if (state_->dir.path() == dir) state_->dir.remove();
  return exit;
}

}  // namespace troupe::launcher
