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
#include <cstdio>
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
#include "troupe/runtime/core/worker_env.h"

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

}  // namespace

LocalCluster::LocalCluster(LocalClusterOptions options)
    : options_(std::move(options)), spawner_(std::make_unique<Spawner>()) {
  if (const std::string role = core::env_value(core::kEnvRole); !role.empty()) {
    // A test binary whose main() does not serve the role first runs its
    // tests again in every head it starts, each starting another head:
    // this process ends, and the cluster that started it says why.
    std::fprintf(stderr,
                 "troupe: a LocalCluster in a process troupe started as a %s (%s=%s): the test binary's main() must "
                 "call troupe::run_role_if_requested(argc, argv) before anything else (as tests/test_main.cc does), "
                 "not gtest_main's\n",
                 role.c_str(), core::kEnvRole, role.c_str());
    std::_Exit(2);
  }
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
    head.head_state_db = head_state_db();
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

// A durable head's state directory, /tmp/troupe-head-PID-XXXXXX: those
// that crashed clusters left go first (core::remove_orphaned_dirs).
void LocalCluster::make_state_dir() {
  core::remove_orphaned_dirs("/tmp", kStateDirPrefix);
  state_dir_ = core::OwnedDir::make("/tmp", kStateDirPrefix);
}

void LocalCluster::remove_state_dir() { state_dir_.remove(); }

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
