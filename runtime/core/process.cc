#include "troupe/runtime/core/process.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string_view>
#include <thread>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/logging.h"

namespace troupe::core {

namespace {

// Closes [from, to]. Runs in a forked child: async-signal-safe calls only.
void close_fd_range(unsigned from, unsigned to, long max_fd) {
#ifdef SYS_close_range
  if (::syscall(SYS_close_range, from, to, 0) == 0) return;
#endif
  // Kernels before 5.9: close one by one up to the descriptor limit.
  for (long fd = from; fd <= static_cast<long>(to) && fd < max_fd; ++fd) ::close(static_cast<int>(fd));
}

// Closes every descriptor above 2 except `keep` (sorted, unique, all > 2).
void close_all_but(const std::vector<int>& keep, long max_fd) {
  unsigned from = 3;
  for (int k : keep) {
    if (static_cast<unsigned>(k) > from) close_fd_range(from, static_cast<unsigned>(k) - 1, max_fd);
    from = static_cast<unsigned>(k) + 1;
  }
  close_fd_range(from, UINT_MAX, max_fd);
}

struct ChildSetup {
  pid_t parent;
  int log_fd;
  int null_fd;
  int error_fd;  // write end of the exec-error pipe (close-on-exec)
  std::vector<int> keep;
  long max_fd;
  int death_signal = SIGKILL;  // PR_SET_PDEATHSIG's, when die_with_parent
};

// Between fork and execve. The parent is threaded, so only
// async-signal-safe calls; everything else was prepared before fork.
[[noreturn]] void exec_child(const SpawnOptions& o, const ChildSetup& c, const std::string& exe, char* const* argv,
                             char* const* envp) {
  if (o.die_with_parent) {
    ::prctl(PR_SET_PDEATHSIG, c.death_signal);
    if (::getppid() != c.parent) ::_exit(127);
  }
  if (o.new_session) ::setsid();
  if (o.own_process_group && !o.new_session) {
    ::setpgid(0, 0);
    // A background group writing to (or setting) the parent's terminal
    // would be stopped by SIGTTOU under `stty tostop`; ignored survives exec.
    ::signal(SIGTTOU, SIG_IGN);
    if (c.null_fd >= 0) ::dup2(c.null_fd, 0);  // a background group reading the terminal would be stopped
  }
  if (c.log_fd >= 0) {
    ::dup2(c.log_fd, 1);
    ::dup2(c.log_fd, 2);
    ::dup2(c.null_fd, 0);
  }
  if (o.stdout_fd >= 0) ::dup2(o.stdout_fd, 1);
  if (o.stderr_fd >= 0) ::dup2(o.stderr_fd, 2);
  if (!o.working_dir.empty() && ::chdir(o.working_dir.c_str()) != 0) {
    int err = errno;
    (void)!::write(c.error_fd, &err, sizeof(err));
    ::_exit(127);
  }
  for (int fd : o.keep_fds)
    if (fd > 2) ::fcntl(fd, F_SETFD, 0);
  close_all_but(c.keep, c.max_fd);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::execve(exe.c_str(), argv, envp);
  int err = errno;
  (void)!::write(c.error_fd, &err, sizeof(err));
  ::_exit(127);
}

// A worker's handler of group_death_signal(): its whole group goes.
void kill_own_group(int) { ::kill(0, SIGKILL); }

// Opens what the child's 0, 1 and 2 become (-1, -1 when it inherits ours).
std::pair<int, int> open_log(const std::string& log_file) {
  if (log_file.empty()) return {-1, -1};
  int log_fd = ::open(log_file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (log_fd < 0) throw Error("cannot open log " + log_file + ": " + std::strerror(errno));
  int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (null_fd < 0) {
    ::close(log_fd);
    throw Error(std::string("cannot open /dev/null: ") + std::strerror(errno));
  }
  return {log_fd, null_fd};
}

// Waits for the exec-error pipe: EOF means execve succeeded; an errno means
// it failed, and the child is reaped.
void check_exec(int error_read_fd, pid_t pid, const std::string& exe) {
  int err = 0;
  ssize_t n;
  do {
    n = ::read(error_read_fd, &err, sizeof(err));
  } while (n < 0 && errno == EINTR);
  ::close(error_read_fd);
  if (n != static_cast<ssize_t>(sizeof(err))) return;
  wait_child(pid);
  throw Error("cannot run " + exe + ": " + std::strerror(err));
}

// Up to the last `max_lines` lines of what `path` gained after `from`.
std::string log_tail(const std::string& path, std::streamoff from, size_t max_lines = 6) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return "";
  f.seekg(0, std::ios::end);
  std::streamoff end = f.tellg();
  std::streamoff start = std::max(from, end - static_cast<std::streamoff>(2048));
  f.seekg(start);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  while (!text.empty() && text.back() == '\n') text.pop_back();
  size_t pos = text.size(), lines = 0;
  while (pos > 0 && lines < max_lines) {
    pos = text.rfind('\n', pos - 1);
    if (pos == std::string::npos) {
      pos = 0;
      break;
    }
    ++lines;
  }
  return text.substr(pos == 0 ? 0 : pos + 1);
}

std::streamoff file_size(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? st.st_size : 0;
}

// Reads from `fd` until a newline, EOF or the deadline; sets `eof` on EOF.
std::string read_ready_line(int fd, std::chrono::milliseconds timeout, bool& eof) {
  std::string got;
  eof = false;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (got.find('\n') == std::string::npos) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd p{fd, POLLIN, 0};
    int r = ::poll(&p, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    char buf[256];
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      eof = true;
      break;
    }
    got.append(buf, n);
  }
  return got;
}

// The child closed its ready pipe without a ready line: it is exiting (or
// closed the pipe by mistake). Reports how it ended, with its last words.
// Why a log may be empty: its file system is full (the process could not
// say why it failed). "" otherwise.
std::string full_disk_note(const std::string& log_file) {
  struct statvfs fs {};
  const std::string dir = log_file.substr(0, log_file.rfind('/') + 1);
  if (::statvfs(dir.empty() ? "." : dir.c_str(), &fs) != 0 || fs.f_bavail > 0) return "";
  return ": its file system is full, so it could not say why; free some space there";
}

[[noreturn]] void report_early_exit(pid_t pid, const RoleProcessOptions& o, const std::string& what,
                                    std::streamoff log_start) {
  int st = 0;
  pid_t r = 0;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while ((r = ::waitpid(pid, &st, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  std::string how = r == pid ? describe_exit_status(st) : "closed its ready pipe without a ready line";
  if (r != pid) {
    ::kill(pid, SIGKILL);
    reap_process(pid);
  }
  std::string msg = what + " " + how + " before it was ready";
  if (!o.log_file.empty()) {
    std::string tail = log_tail(o.log_file, log_start);
    msg += tail.empty() ? " (log " + o.log_file + " is empty" + full_disk_note(o.log_file) + ")"
                        : "; the end of " + o.log_file + ":\n" + tail;
  }
  throw Error(msg);
}

// remember_args()'s: where argv's strings begin, and their bytes from
// argv[0] to the end of the last one.
char* g_args_begin = nullptr;
size_t g_args_room = 0;

}  // namespace

int group_death_signal() { return SIGRTMIN + 4; }

void kill_group_when_parent_dies() {
  if (::getpgrp() != ::getpid()) return;  // not a group's leader: its group is another's
  struct sigaction sa {};
  sa.sa_handler = kill_own_group;
  sigemptyset(&sa.sa_mask);
  ::sigaction(group_death_signal(), &sa, nullptr);
}

void remember_args(int argc, char** argv) {
  if (argc <= 0 || argv == nullptr || argv[0] == nullptr) return;
  // Only strings that lie one after the other, as the kernel lays them out.
  char* end = argv[0] + std::strlen(argv[0]) + 1;
  for (int i = 1; i < argc && argv[i] == end; ++i) end = argv[i] + std::strlen(argv[i]) + 1;
  g_args_begin = argv[0];
  g_args_room = static_cast<size_t>(end - argv[0]);
}

void set_process_title(const std::string& title) {
  if (g_args_begin == nullptr || g_args_room == 0) return;
  const size_t n = std::min(title.size(), g_args_room - 1);
  std::memcpy(g_args_begin, title.data(), n);
  std::memset(g_args_begin + n, 0, g_args_room - n);
}

std::string executable_from_link(const std::string& link) {
  static constexpr std::string_view kDeleted = " (deleted)";
  if (link.size() <= kDeleted.size() || link.compare(link.size() - kDeleted.size(), kDeleted.size(), kDeleted) != 0)
    return link;
  std::string path = link.substr(0, link.size() - kDeleted.size());
  struct stat st {};
  // A file named "... (deleted)" itself, or none at the path any more:
  // the text as it is (an exec of it names it).
  if (::stat(link.c_str(), &st) == 0 || ::stat(path.c_str(), &st) != 0) return link;
  static std::once_flag warned;
  std::call_once(warned, [&] {
    TROUPE_LOG_WARN(
        "this program's file {} was replaced since it started; workers started from now on run the "
        "file there now",
        path);
  });
  return path;
}

std::string self_executable_path() {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? executable_from_link(std::string(buf, n)) : "/proc/self/exe";
}

std::string describe_exit_status(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    return "killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "ended (status " + std::to_string(status) + ")";
}

namespace {

// The state (field 3), parent (field 4) and start time (field 22) in a
// /proc/PID/stat line.
struct StatFields {
  std::string state;
  pid_t parent = 0;
  uint64_t start_time = 0;
};
std::optional<StatFields> parse_stat(const std::string& stat) {
  // The command name (field 2) may hold spaces and parentheses; the fields
  // after its closing parenthesis are plain. Field 3 is the first of them.
  auto close = stat.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  std::istringstream rest(stat.substr(close + 1));
  StatFields f;
  std::string field;
  if (!(rest >> f.state >> f.parent)) return std::nullopt;
  for (int i = 5; i <= 22; ++i)
    if (!(rest >> field)) return std::nullopt;
  try {
    f.start_time = std::stoull(field);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  return f;
}

}  // namespace

namespace {
std::optional<StatFields> stat_of(pid_t pid) {
  if (pid <= 0) return std::nullopt;
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!f || !std::getline(f, stat)) return std::nullopt;
  return parse_stat(stat);
}
}  // namespace

std::optional<uint64_t> process_start_time(pid_t pid) {
  auto fields = stat_of(pid);
  if (!fields) return std::nullopt;
  return fields->start_time;
}

std::optional<pid_t> parent_pid(pid_t pid) {
  auto fields = stat_of(pid);
  if (!fields) return std::nullopt;
  return fields->parent;
}

bool process_running(pid_t pid, uint64_t start_time) {
  if (pid <= 0) return false;
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  // Only "no such process" says it is gone; any other failure (out of
  // descriptors, a /proc that hides it) says nothing, and it counts as there.
  if (fd < 0) return errno != ENOENT && errno != ESRCH;
  char buf[1024];
  ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  const int read_errno = errno;
  ::close(fd);
  if (n < 0) return read_errno != ESRCH;
  auto fields = parse_stat(std::string(buf, static_cast<size_t>(n)));
  if (!fields) return true;
  if (fields->state == "Z" || fields->state == "X" || fields->state == "x") return false;
  return fields->start_time == start_time;
}

namespace {

// A cgroup limit file's number; nullopt for "max", a missing file or junk.
std::optional<uint64_t> read_limit(const std::string& path) {
  std::ifstream f(path);
  std::string text;
  if (!f || !(f >> text) || text.empty() || text.find_first_not_of("0123456789") != std::string::npos)
    return std::nullopt;
  try {
    return std::stoull(text);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

}  // namespace

uint64_t memory_limit_bytes() {
  uint64_t bytes = 0;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page > 0) bytes = uint64_t(pages) * uint64_t(page);
  std::optional<uint64_t> limit;
  std::ifstream cgroup("/proc/self/cgroup");
  for (std::string line; !limit && std::getline(cgroup, line);) {
    if (line.rfind("0::", 0) == 0)
      limit = read_limit("/sys/fs/cgroup" + line.substr(3) + "/memory.max");  // v2
    else if (auto c = line.find(":memory:"); c != std::string::npos)
      limit = read_limit("/sys/fs/cgroup/memory" + line.substr(c + 8) + "/memory.limit_in_bytes");  // v1
  }
  if (limit && *limit > 0 && (bytes == 0 || *limit < bytes)) bytes = *limit;
  return bytes;
}

namespace {

// The CPUs a quota of `quota` µs per `period` µs gives, rounded up; 0 for
// none (-1 or "max": no limit).
long quota_cpus(long long quota, long long period) {
  return quota > 0 && period > 0 ? static_cast<long>((quota + period - 1) / period) : 0;
}

// The lowest CPU quota on the way from cgroup directory `dir` up to
// `root` (a limit set on a parent, a pod's or a slice's, binds too): v2's
// cpu.max ("QUOTA PERIOD" or "max PERIOD"), v1's cfs_quota_us and
// cfs_period_us. 0 when none is set.
long cgroup_cpus(const std::string& root, std::string dir, bool v2) {
  long lowest = 0;
  for (;;) {
    long n = 0;
    if (v2) {
      std::ifstream max(root + dir + "/cpu.max");
      std::string quota;
      long long period = 0;
      if (max >> quota >> period && quota != "max") n = quota_cpus(std::atoll(quota.c_str()), period);
    } else {
      std::ifstream q(root + dir + "/cpu.cfs_quota_us"), p(root + dir + "/cpu.cfs_period_us");
      long long quota = 0, period = 0;
      if (q >> quota && p >> period) n = quota_cpus(quota, period);
    }
    if (n > 0 && (lowest == 0 || n < lowest)) lowest = n;
    if (dir.empty() || dir == "/") return lowest;
    const auto slash = dir.rfind('/');
    dir = slash == std::string::npos || slash == 0 ? std::string() : dir.substr(0, slash);
  }
}

}  // namespace

int cpu_limit(const std::string& cgroup_root, const std::string& proc_cgroup) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) == 0) n = CPU_COUNT(&set);
  std::ifstream cgroup(proc_cgroup);
  for (std::string line; std::getline(cgroup, line);) {
    // "ID:CONTROLLERS:PATH": v2's is "0::PATH"; v1's cpu controller (alone
    // or with cpuacct) is mounted at /sys/fs/cgroup/cpu.
    const auto first = line.find(':'), second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    const std::string controllers = "," + line.substr(first + 1, second - first - 1) + ",";
    const std::string path = line.substr(second + 1);
    long quota = 0;
    if (controllers == ",,")
      quota = cgroup_cpus(cgroup_root, path, true);
    else if (controllers.find(",cpu,") != std::string::npos)
      quota = cgroup_cpus(cgroup_root + "/cpu", path, false);
    if (quota > 0) n = std::min(n, quota);
  }
  return static_cast<int>(std::max(1L, n));
}

std::string host_key() {
  std::string boot;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  if (!f || !std::getline(f, boot) || boot.empty()) return "";  // no /proc: pids are not compared
  struct stat ns {};
  if (::stat("/proc/self/ns/pid", &ns) != 0) return "";
  return boot + "/" + std::to_string(ns.st_dev) + ":" + std::to_string(ns.st_ino);
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
  wait_child(pid);
}

pid_t wait_child(pid_t pid, int* status) {
  int st = 0;
  pid_t r;
  do {
    r = ::waitpid(pid, &st, 0);
  } while (r < 0 && errno == EINTR);
  if (status) *status = st;
  return r;
}

std::vector<std::string> last_setting_wins(const std::vector<std::string>& env) {
  std::map<std::string, size_t> last;
  for (size_t i = 0; i < env.size(); ++i) last[env[i].substr(0, env[i].find('='))] = i;
  std::vector<std::string> out;
  for (size_t i = 0; i < env.size(); ++i)
    if (last[env[i].substr(0, env[i].find('='))] == i) out.push_back(env[i]);
  return out;
}

pid_t spawn_process(const SpawnOptions& o) {
  // Everything the child needs is prepared before fork.
  std::vector<std::string> env = last_setting_wins(o.env);
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string exe = o.executable;
  std::string arg0 = o.arg0.empty() ? exe : o.arg0;
  std::vector<std::string> args = o.args;
  std::vector<char*> argv{arg0.data()};
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  int error_pipe[2];
  if (::pipe2(error_pipe, O_CLOEXEC) != 0) throw Error(std::string("pipe: ") + std::strerror(errno));
  long open_max = ::sysconf(_SC_OPEN_MAX);
  ChildSetup c{::getpid(), -1, -1, error_pipe[1], {}, open_max > 0 ? std::min(open_max, 1L << 20) : 65536};
  // A process in a group of its own (a worker) takes its group with it
  // when its parent dies (kill_group_when_parent_dies); until it has said
  // so, the signal's default action ends it alone, as SIGKILL did.
  if (o.own_process_group && !o.new_session) c.death_signal = group_death_signal();
  try {
    std::tie(c.log_fd, c.null_fd) = open_log(o.log_file);
    if (c.null_fd < 0 && o.own_process_group) c.null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  } catch (...) {
    ::close(error_pipe[0]);
    ::close(error_pipe[1]);
    throw;
  }
  for (int fd : o.keep_fds)
    if (fd > 2) c.keep.push_back(fd);
  c.keep.push_back(error_pipe[1]);
  std::sort(c.keep.begin(), c.keep.end());
  c.keep.erase(std::unique(c.keep.begin(), c.keep.end()), c.keep.end());

  pid_t pid = ::fork();
  if (pid == 0) exec_child(o, c, exe, argv.data(), envp.data());
  int fork_errno = errno;
  ::close(error_pipe[1]);
  if (c.log_fd >= 0) ::close(c.log_fd);
  if (c.null_fd >= 0) ::close(c.null_fd);
  if (pid < 0) {
    ::close(error_pipe[0]);
    throw Error("cannot start " + exe + ": fork: " + std::strerror(fork_errno));
  }
  check_exec(error_pipe[0], pid, exe);
  return pid;
}

RoleProcess start_role_process(const RoleProcessOptions& o, const std::string& what) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw Error(std::string("pipe: ") + std::strerror(errno));
  WorkerEnv role_env = o.env;
  role_env.ready_fd = fds[1];
  if (role_env.log_level.empty()) role_env.log_level = env_value(kEnvLogLevel);
  if (role_env.session_dir.empty()) role_env.session_dir = env_value(kEnvSessionDir);
  SpawnOptions s;
  s.executable = o.executable.empty() ? self_executable_path() : o.executable;
  s.env = clean_environment();
  for (auto& kv : role_env.to_env()) s.env.push_back(std::move(kv));
  s.env.insert(s.env.end(), o.extra_env.begin(), o.extra_env.end());
  if (!o.log_file.empty()) {
    std::string own = kEnvOwnLog;  // (a `+` here trips GCC 12's -Warray-bounds)
    s.env.push_back(own.append("=1"));
  }
  s.log_file = o.log_file;
  s.keep_fds = {fds[1]};
  s.die_with_parent = o.die_with_parent;
  s.new_session = o.new_session;
  // What `ps` shows: the role, not only the binary's path (workers title
  // themselves "troupe-worker:<class>").
  if (!role_env.role.empty()) s.arg0 = "troupe-" + role_env.role;
  std::streamoff log_start = o.log_file.empty() ? 0 : file_size(o.log_file);
  pid_t pid = -1;
  try {
    pid = spawn_process(s);
  } catch (...) {
    ::close(fds[0]);
    ::close(fds[1]);
    throw;
  }
  ::close(fds[1]);
  bool eof = false;
  std::string got = read_ready_line(fds[0], o.ready_timeout, eof);
  ::close(fds[0]);
  auto nl = got.find('\n');
  if (nl != std::string::npos) return {pid, got.substr(0, nl)};
  if (eof) report_early_exit(pid, o, what, log_start);
  ::kill(pid, SIGKILL);
  reap_process(pid);
  throw Error(what + " did not become ready within " + std::to_string(o.ready_timeout.count()) + " ms" +
              (o.log_file.empty() ? "" : " (see " + o.log_file + ")"));
}

}  // namespace troupe::core
