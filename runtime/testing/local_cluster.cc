#include "troupe/runtime/testing/local_cluster.h"

#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "troupe/runtime/core/files.h"
#include "troupe/runtime/core/process.h"

#include "troupe/runtime/head/scheduler.h"
#include "troupe/runtime/node/worker_pool.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/wire/address.h"
#include "troupe/runtime/wire/auth.h"

namespace troupe::testing {

LocalCluster::LocalCluster(LocalClusterOptions options) : options_(std::move(options)) {
  node::validate_pool_options(
      {options_.worker_pool_size, options_.worker_idle_timeout, options_.worker_assign_timeout});
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
    char dir[] = "/tmp/troupe-head-XXXXXX";
    if (!::mkdtemp(dir)) throw Error(std::string("LocalCluster: mkdtemp: ") + std::strerror(errno));
    state_dir_ = dir;
    head.head_state_db = state_dir_ + "/head.sqlite";
  }
  head_pid_ = start(head, &line);
  // "ADDRESS" or "ADDRESS DASHBOARD_URL".
  const size_t space = line.find(' ');
  address_ = line.substr(0, space);
  head.head_port = wire::parse_address(address_).second;  // a restarted head listens where this one did
  head_env_ = head;
  if (space != std::string::npos) dashboard_url_ = line.substr(space + 1);
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
  if (!state_dir_.empty()) {
    std::error_code ec;
    troupe::core::remove_tree(state_dir_, ec);
  }
}

void LocalCluster::restart_head() {
  if (head_pid_ > 0) throw Error("LocalCluster::restart_head: the head (pid " + std::to_string(head_pid_) +
                                 ") is still running; kill_head first");
  std::string line;
  head_pid_ = start(head_env_, &line);
}

Runtime LocalCluster::connect() const {
  InitOptions o;
  o.address = address_;
  o.token = token_;
  return Runtime::connect(o);
}

size_t LocalCluster::add_node(const Resources& resources, const std::string& head_address) {
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

void LocalCluster::reap(pid_t pid) { core::reap_process(pid); }

pid_t LocalCluster::start(core::WorkerEnv env, std::string* ready_line) {
  core::RoleProcessOptions o;
  env.token = token_;
  o.env = env;
  o.extra_env = options_.env;
  o.ready_timeout = options_.start_timeout;
  auto p = core::start_role_process(o, "LocalCluster " + env.role);
  *ready_line = p.ready_line;
  return p.pid;
}

}  // namespace troupe::testing
