#include "troupe/runtime/testing/local_cluster.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <utility>

#include "troupe/runtime/core/files.h"
#include "troupe/runtime/core/heartbeat.h"
#include "troupe/runtime/core/process.h"

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/head/resource_pool.h"
#include "troupe/runtime/head/scheduler.h"
#include "troupe/runtime/node/worker_pool.h"
#include "troupe/runtime/wire/address.h"
#include "troupe/runtime/wire/auth.h"

namespace troupe::testing {

// A thread that runs the cluster's process starts, one at a time, for as
// long as the cluster lives (local_cluster.h says why).
class LocalCluster::Spawner {
 public:
  Spawner()
      : thread_([this] {
          for (;;) {
            std::packaged_task<void()> job;
            {
              std::unique_lock lock(mu_);
              cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
              if (jobs_.empty()) return;
              job = std::move(jobs_.front());
              jobs_.pop_front();
            }
            job();
          }
        }) {}
  ~Spawner() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  // Runs `f` on the spawner's thread and waits for it; its exception is
  // thrown here.
  void run(std::function<void()> f) {
    std::packaged_task<void()> job(std::move(f));
    auto done = job.get_future();
    {
      std::lock_guard lock(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_all();
    done.get();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<void()>> jobs_;
  bool stopping_ = false;
  std::thread thread_;  // last: it starts once the members above exist
};

namespace {

constexpr const char* kStateDirPrefix = "troupe-head-";

// The state directories of durable heads whose LocalCluster's process died
// without its destructor (a crash, SIGKILL): "troupe-head-PID-XXXXXX" in
// `dir`, this user's, PID no longer running and its lock not held.
constexpr const char* kOwnerLock = "owner.lock";

// Whether a state directory's owner still holds its lock: a process whose
// pid means nothing here (another PID namespace sharing /tmp) is alive all
// the same. One without the lock file was made by an older troupe, or was
// made a moment ago and is not locked yet: only an old one is taken as
// orphaned.
bool still_owned(const std::filesystem::path& dir, const struct stat& st) {
  const int fd = ::open((dir / kOwnerLock).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return ::time(nullptr) - st.st_mtime < 600;
  const bool held = ::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  ::close(fd);
  return held;
}

void remove_orphaned_state_dirs(const std::filesystem::path& dir) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(kStateDirPrefix, 0) != 0) continue;
    const std::string rest = name.substr(std::strlen(kStateDirPrefix));
    const size_t dash = rest.find('-');
    if (dash == 0 || dash == std::string::npos || rest.find_first_not_of("0123456789") != dash) continue;
    struct stat st {};
    if (::lstat(entry.path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::getuid()) continue;
    pid_t owner = 0;
    if (std::from_chars(rest.data(), rest.data() + dash, owner).ec != std::errc() || owner <= 0) continue;
    if (::kill(owner, 0) == 0 || errno != ESRCH || still_owned(entry.path(), st)) continue;
    std::error_code ignored;
    troupe::core::remove_tree(entry.path(), ignored);
  }
}

}  // namespace

LocalCluster::LocalCluster(LocalClusterOptions options)
    : options_(std::move(options)), spawner_(std::make_unique<Spawner>()) {
  node::validate_pool_options(
      {options_.worker_pool_size, options_.worker_idle_timeout, options_.worker_assign_timeout});
  core::validate_heartbeat(options_.heartbeat_ms, options_.heartbeat_misses, "LocalClusterOptions");
  for (size_t i = 0; i < options_.nodes.size(); ++i)
    head::validate_resources(options_.nodes[i], "LocalClusterOptions node " + std::to_string(i));
  token_ = wire::random_token();
  std::string line;
  core::WorkerEnv head;
  head.role = "head";
  head.head_host = options_.host;
  head.heartbeat_ms = options_.heartbeat_ms;
  head.heartbeat_misses = options_.heartbeat_misses;
  head.dashboard = options_.dashboard;
  head.dashboard_require_token = options_.dashboard_require_token;
  if (options_.durable_head) {
    make_state_dir();
    head.head_state_db = state_dir_ + "/head.sqlite";
  }
  try {
    head_pid_ = start(head, &line);
    // "ADDRESS" or "ADDRESS DASHBOARD_URL".
    const size_t space = line.find(' ');
    address_ = line.substr(0, space);
    head.head_port = wire::parse_address(address_).second;  // a restarted head listens where this one did
    head_env_ = head;
    if (space != std::string::npos) dashboard_url_ = line.substr(space + 1);
    for (const auto& r : options_.nodes) add_node(r);
  } catch (...) {
    for (auto& n : nodes_) {
      ::kill(n.pid, SIGKILL);
      reap(n.pid);
    }
    if (head_pid_ > 0) {
      ::kill(head_pid_, SIGKILL);
      reap(head_pid_);
    }
    remove_state_dir();
    throw;
  }
}

LocalCluster::~LocalCluster() {
  // Node agents kill their workers when they stop; SIGTERM lets them, and
  // SIGCONT wakes one a test stopped (SIGSTOP), which would otherwise take
  // the signal only when killed.
  for (auto& n : nodes_)
    if (n.pid > 0) {
      ::kill(n.pid, SIGTERM);
      ::kill(n.pid, SIGCONT);
    }
  for (auto& n : nodes_)
    if (n.pid > 0) reap(n.pid);
  if (head_pid_ > 0) {
    ::kill(head_pid_, SIGTERM);
    ::kill(head_pid_, SIGCONT);
    reap(head_pid_);
  }
  remove_state_dir();
}

void LocalCluster::make_state_dir() {
  remove_orphaned_state_dirs("/tmp");
  std::string dir = "/tmp/" + std::string(kStateDirPrefix) + std::to_string(::getpid()) + "-XXXXXX";
  if (!::mkdtemp(dir.data())) throw Error(std::string("LocalCluster: mkdtemp: ") + std::strerror(errno));
  state_dir_ = dir;
  state_lock_fd_ = ::open((dir + "/" + kOwnerLock).c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (state_lock_fd_ < 0 || ::flock(state_lock_fd_, LOCK_EX) != 0) {
    const int e = errno;
    remove_state_dir();
    throw Error("LocalCluster: cannot lock " + dir + "/" + kOwnerLock + ": " + std::strerror(e));
  }
}

// The lock goes last: until the directory is gone, no one else removes it.
void LocalCluster::remove_state_dir() {
  if (!state_dir_.empty()) {
    std::error_code ec;
    troupe::core::remove_tree(state_dir_, ec);
  }
  if (state_lock_fd_ >= 0) ::close(std::exchange(state_lock_fd_, -1));
}

void LocalCluster::restart_head() {
  {
    std::lock_guard lock(mu_);
    if (head_pid_ == 0) throw Error("LocalCluster::restart_head: another restart_head is starting the head");
    if (head_pid_ > 0)
      throw Error("LocalCluster::restart_head: the head (pid " + std::to_string(head_pid_) +
                  ") is still running; kill_head first");
    head_pid_ = 0;  // starting: a second restart_head is refused
  }
  std::string line;
  pid_t pid = -1;
  try {
    pid = start(head_env_, &line);
  } catch (...) {
    std::lock_guard lock(mu_);
    head_pid_ = -1;
    throw;
  }
  std::lock_guard lock(mu_);
  head_pid_ = pid;
}

size_t LocalCluster::node_count() const {
  std::lock_guard lock(mu_);
  return nodes_.size();
}

pid_t LocalCluster::head_pid() const {
  std::lock_guard lock(mu_);
  return head_pid_;
}

pid_t LocalCluster::node_pid(size_t i) const {
  std::lock_guard lock(mu_);
  return nodes_.at(i).pid;
}

uint64_t LocalCluster::node_id(size_t i) const {
  std::lock_guard lock(mu_);
  return nodes_.at(i).id;
}

Runtime LocalCluster::connect() const {
  InitOptions o;
  o.address = address_;
  o.token = token_;
  return Runtime::connect(o);
}

size_t LocalCluster::add_node(const Resources& resources, const std::string& head_address) {
  head::validate_resources(resources, "LocalCluster::add_node");
  std::string line;
  std::string res = head::format_resources(resources);
  for (auto& c : res)
    if (c == ' ') c = '\0';
  res.erase(std::remove(res.begin(), res.end(), '\0'), res.end());
  // Without GPU in the set the node would advertise what CUDA finds.
  if (!resources.count("GPU")) res += (res.empty() ? "" : ",") + std::string("GPU=0");
  core::WorkerEnv node;
  node.role = "node";
  node.head_address = head_address.empty() ? address_ : head_address;
  node.resources = res;
  node.bind_host = options_.host;
  node.worker_pool_size = options_.worker_pool_size;
  node.worker_idle_timeout_ms = static_cast<uint64_t>(options_.worker_idle_timeout.count());
  node.worker_assign_timeout_ms = static_cast<uint64_t>(options_.worker_assign_timeout.count());
  node.head_reconnect_ms = static_cast<uint64_t>(options_.head_reconnect.count());
  pid_t pid = start(node, &line);
  std::lock_guard lock(mu_);
  nodes_.push_back({pid, std::stoull(line)});
  return nodes_.size() - 1;
}

// Signals that end a process: its pid leaves the table before it is
// reaped, so that two callers never reap it both.
static bool ends(int sig) { return sig == SIGKILL || sig == SIGTERM; }

void LocalCluster::kill_node(size_t i, int sig) {
  pid_t pid;
  {
    std::lock_guard lock(mu_);
    auto& n = nodes_.at(i);
    pid = n.pid;
    if (pid > 0 && ends(sig)) n.pid = -1;
  }
  if (pid <= 0) return;
  ::kill(pid, sig);
  if (ends(sig)) reap(pid);
}

void LocalCluster::kill_head(int sig) {
  pid_t pid;
  {
    std::lock_guard lock(mu_);
    pid = head_pid_;
    if (pid > 0 && ends(sig)) head_pid_ = -1;
  }
  if (pid <= 0) return;
  ::kill(pid, sig);
  if (ends(sig)) reap(pid);
}

void LocalCluster::reap(pid_t pid) { core::reap_process(pid); }

pid_t LocalCluster::start(core::WorkerEnv env, std::string* ready_line) {
  core::RoleProcessOptions o;
  env.token = token_;
  o.env = env;
  o.extra_env = options_.env;
  o.ready_timeout = options_.start_timeout;
  core::RoleProcess p;
  spawner_->run([&] { p = core::start_role_process(o, "LocalCluster " + env.role); });
  *ready_line = p.ready_line;
  return p.pid;
}

}  // namespace troupe::testing
