// LocalCluster: a whole cluster in one process tree, for tests, benchmarks
// and examples. A real head process and N real node-agent processes on
// loopback, each node with its own resource set, so multi-node placement
// and node failures are tested on one machine. Head and nodes are this very
// binary re-executed in a role (it must call troupe::init or
// troupe::run_role_if_requested first thing in main); workers are, as
// always, real processes started by the node agents.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/core/files.h"
#include "troupe/runtime/core/heartbeat.h"
#include "troupe/runtime/core/worker_env.h"

namespace troupe::testing {

struct LocalClusterOptions {
  // One entry per node.
  std::vector<Resources> nodes = {{{"CPU", 2}}, {{"CPU", 2}}};
  // Every node runs on this machine: as an embedded cluster, 100 ms × 30
  // (core::kOneMachineHeartbeatMisses), so a loaded machine's starved agent
  // is not fenced. A test of fencing (SIGSTOP of an agent) sets fewer.
  uint32_t heartbeat_ms = core::kHeartbeatMs;
  uint32_t heartbeat_misses = core::kOneMachineHeartbeatMisses;
  std::chrono::milliseconds start_timeout{20000};
  // Extra KEY=VALUE for head and nodes (e.g. TROUPE_LOG_LEVEL=debug).
  std::vector<std::string> env;
  // Where the head and the nodes' workers listen ("0.0.0.0", "::1", ...);
  // each advertises a reachable address of its own choosing.
  std::string host = "127.0.0.1";
  // Each node's warm workers per executable (0 = none), their idle
  // timeout, and how long a taken one may take to acknowledge its actor
  // (WorkerPoolOptions::assign_timeout).
  uint32_t worker_pool_size = 2;
  std::chrono::milliseconds worker_idle_timeout{std::chrono::minutes(5)};
  std::chrono::milliseconds worker_assign_timeout{std::chrono::seconds(10)};
  // The head's HTTP endpoint (dashboard, /metrics) on a free port, and
  // whether it asks for the token although it is on loopback.
  bool dashboard = false;
  bool dashboard_require_token = false;
  // The head writes its tables through to a SQLite file in a directory of
  // the cluster's own, so restart_head() brings back the same cluster.
  bool durable_head = false;
  // How long node agents and workers wait for a durable head that went
  // away (0 = the default, 30 s).
  std::chrono::milliseconds head_reconnect{0};
};

class LocalCluster {
 public:
  explicit LocalCluster(LocalClusterOptions options = {});
  ~LocalCluster();
  LocalCluster(const LocalCluster&) = delete;
  LocalCluster& operator=(const LocalCluster&) = delete;

  const std::string& address() const { return address_; }
  const std::string& token() const { return token_; }
  // http://HOST:PORT/ of the head's dashboard ("" unless options.dashboard).
  const std::string& dashboard_url() const { return dashboard_url_; }
  // A driver runtime connected to this cluster.
  Runtime connect() const;

  // Starts another node, its agent connecting to `head_address` (a proxy in
  // front of the head; "" = the head's address); returns its index.
  size_t add_node(const Resources& resources, const std::string& head_address = "");
  size_t node_count() const;
  pid_t head_pid() const;
  pid_t node_pid(size_t i) const;
  uint64_t node_id(size_t i) const;
  // Sends `sig` to node agent i and, for SIGKILL/SIGTERM, reaps it.
  void kill_node(size_t i, int sig = 9);
  void kill_head(int sig = 9);
  // Starts the head again, on the same address and (durable_head) with the
  // tables the last one wrote; returns once it listens.
  void restart_head();
  // durable_head: the SQLite file the head writes its tables to ("" otherwise).
  std::string head_state_db() const { return options_.durable_head ? state_dir_.path() + "/head.sqlite" : ""; }

 private:
  struct Proc {
    pid_t pid = -1;
    uint64_t id = 0;
  };
  class Spawner;
  pid_t start(core::WorkerEnv env, std::string* ready_line);
  void reap(pid_t pid);

  LocalClusterOptions options_;
  std::string token_;
  std::string address_;
  std::string dashboard_url_;
  core::WorkerEnv head_env_;
  // durable_head: holds head.sqlite; its owner.lock held while the cluster
  // lives, so that another process's cleanup (in a PID namespace where this
  // pid means nothing) sees the directory is in use.
  core::OwnedDir state_dir_;
  void make_state_dir();
  void remove_state_dir();
  // The node list and the head's pid, for calls from any thread (a test's
  // and a FaultInjector::after action's at once). Not held while a process
  // starts or is reaped.
  mutable std::mutex mu_;
  pid_t head_pid_ = -1;
  std::vector<Proc> nodes_;
  // Every process is started on this thread, which lives as long as the
  // cluster: a child dies with the thread that forked it (PR_SET_PDEATHSIG),
  // so add_node or restart_head from a short-lived thread (a
  // FaultInjector::after action) must not start it there.
  std::unique_ptr<Spawner> spawner_;
};

}  // namespace troupe::testing
