// The node agent: one per machine. It advertises the machine's resources to
// the head, gives each actor a worker process — a warm one from its
// WorkerPool when one of the actor's executable is idle, else one started
// for it (fork + exec through spawn_process, so that its own head connection
// never reaches them) — with CUDA_VISIBLE_DEVICES set from the actor's GPUs,
// reaps them on SIGCHLD and reports every exit at once, and heartbeats (with
// its idle worker count). Its workers die with it (PR_SET_PDEATHSIG), so a
// dead node takes its actors along. An agent the head declared dead while it
// was only stopped or cut off is told so (NodeFenced) when it wakes up: it
// kills every worker it still runs and registers again as a new node. A
// durable head that dies is waited for: the agent keeps its workers, joins
// the restarted head as the node it was, and tells it which workers it runs.
#pragma once

#include <memory>
#include <string>
#include <thread>

#include "troupe/runtime/core/worker_env.h"
#include "troupe/runtime/node/worker_pool.h"
#include "troupe/runtime/wire/protocol.h"

namespace troupe::node {

struct NodeOptions {
  std::string head_address;
  std::string token;
  wire::Resources resources;  // empty: detect (CPU = cores, GPU = CUDA devices)
  // Where its workers listen; "" = the local address of the interface that
  // routes to the head.
  std::string bind_host = "127.0.0.1";
  // The address its workers advertise; "" = bind_host, or for a wildcard
  // bind_host the local address of the interface that routes to the head.
  // Never 0.0.0.0.
  std::string advertise_host;
  // The session directory: worker launchers given as text go in its
  // launchers/ (script_executable.h).
  std::string session_dir;
  // A daemon agent (`troupe start`, a LocalCluster's) whose output is a
  // file gives each worker a log file beside it (what `troupe logs ACTOR`
  // reads). An agent embedded in a driver does not: its workers write to
  // the driver's output, and a driver run as `prog > out.log` (a batch
  // job's output) leaves no worker-PID.log files beside out.log.
  bool worker_logs_beside_own_output = false;
  // Warm workers per executable and their idle timeout; the pool of this
  // agent's own executable is filled at start.
  WorkerPoolOptions worker_pool;
  // Fill the pool of this agent's own executable at start. Off when that
  // program cannot serve as a worker (a Python driver's interpreter).
  bool prefill_own_executable = true;
  // A durable head (one that reloads its tables when restarted) that goes
  // away is waited for this long, its workers kept running; then, or at
  // once for a head that is not durable, the node stops.
  std::chrono::milliseconds head_reconnect = core::default_head_reconnect();
};

// Resources of this machine: CPU = online cores, GPU = CUDA devices (0 when
// CUDA is not there), memory = bytes of memory (core::memory_limit_bytes),
// with `overrides` replacing or adding entries.
wire::Resources detect_resources(const wire::Resources& overrides);
// Every node also offers one "node:<its advertise address>" (Ray's), unless
// its resources name that key already.
inline constexpr const char* kNodeResourcePrefix = "node:";

class NodeAgent {
 public:
  // Connects and registers; throws ConnectionError when the head is not there.
  explicit NodeAgent(NodeOptions options);
  ~NodeAgent();
  NodeAgent(const NodeAgent&) = delete;
  NodeAgent& operator=(const NodeAgent&) = delete;

  // The current registration's node id (a new one after a fence).
  uint64_t node_id() const;
  // Runs on this thread until the head goes away or tells it to stop; kills
  // its workers before returning. SIGCHLD must not be blocked in this thread.
  void run();
  void stop();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace troupe::node
