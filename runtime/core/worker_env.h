// WorkerEnv: the environment one troupe process hands to another. The
// launcher, LocalCluster and node agents start heads, node agents and
// workers by exec with TROUPE_* variables; every such name is spelled here
// once, and to_env()/from_env() are the only code that writes or parses
// them, so a name or a format cannot drift between the two sides.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "troupe/runtime/core/heartbeat.h"

namespace troupe::core {

// The variables' names. Drivers and users set the last four by hand.
inline constexpr const char* kEnvRole = "TROUPE_ROLE";
inline constexpr const char* kEnvToken = "TROUPE_TOKEN";
inline constexpr const char* kEnvHeadAddress = "TROUPE_HEAD_ADDRESS";
inline constexpr const char* kEnvHeadHost = "TROUPE_HEAD_HOST";
inline constexpr const char* kEnvHeadPort = "TROUPE_HEAD_PORT";
inline constexpr const char* kEnvHeartbeatMs = "TROUPE_HEARTBEAT_MS";
inline constexpr const char* kEnvHeartbeatMisses = "TROUPE_HEARTBEAT_MISSES";
inline constexpr const char* kEnvMaxDeadActors = "TROUPE_MAX_DEAD_ACTORS";
inline constexpr const char* kEnvHeadStateDb = "TROUPE_HEAD_STATE_DB";
inline constexpr const char* kEnvHeadReconnectMs = "TROUPE_HEAD_RECONNECT_MS";
inline constexpr const char* kEnvHeadSupervise = "TROUPE_HEAD_SUPERVISE";
inline constexpr const char* kEnvHeadHangTimeoutMs = "TROUPE_HEAD_HANG_TIMEOUT_MS";
// Head: the HTTP endpoint's port (absent = off, 0 = any free one), "1" to
// ask for the token even on loopback, "1" to take a free port when the
// given one is taken.
inline constexpr const char* kEnvDashboardPort = "TROUPE_DASHBOARD_PORT";
inline constexpr const char* kEnvDashboardAuth = "TROUPE_DASHBOARD_AUTH";
inline constexpr const char* kEnvDashboardFallback = "TROUPE_DASHBOARD_FALLBACK";
inline constexpr const char* kEnvResources = "TROUPE_RESOURCES";
inline constexpr const char* kEnvBindHost = "TROUPE_BIND_HOST";
inline constexpr const char* kEnvAdvertiseHost = "TROUPE_ADVERTISE_HOST";
inline constexpr const char* kEnvActorId = "TROUPE_ACTOR_ID";
inline constexpr const char* kEnvIncarnation = "TROUPE_INCARNATION";
inline constexpr const char* kEnvNodeId = "TROUPE_NODE_ID";
inline constexpr const char* kEnvGpuIds = "TROUPE_GPU_IDS";
inline constexpr const char* kEnvReadyFd = "TROUPE_READY_FD";
inline constexpr const char* kEnvPoolFd = "TROUPE_POOL_FD";
inline constexpr const char* kEnvServingFd = "TROUPE_SERVING_FD";
// A worker's counter page (node/stats_pages.h): a descriptor the worker maps
// and closes at start (client/process_stats.cc).
inline constexpr const char* kEnvStatsFd = "TROUPE_STATS_FD";
inline constexpr const char* kEnvWorkerPoolSize = "TROUPE_WORKER_POOL_SIZE";
inline constexpr const char* kEnvWorkerIdleTimeoutMs = "TROUPE_WORKER_IDLE_TIMEOUT_MS";
inline constexpr const char* kEnvWorkerAssignTimeoutMs = "TROUPE_WORKER_ASSIGN_TIMEOUT_MS";
inline constexpr const char* kEnvLogLevel = "TROUPE_LOG_LEVEL";
// A daemon's log file is rotated past this many bytes (logging.h).
inline constexpr const char* kEnvLogMaxBytes = "TROUPE_LOG_MAX_BYTES";
// "1": this process's output is a log file of its own, given to it by
// whoever started it (a daemon of `troupe start`: head.log, node-*.log),
// which it may rotate, serve to `troupe logs` and put its workers' files
// beside. Unset, output that happens to be a file (a test's `> out.log`,
// which a LocalCluster's processes inherit) is left alone (logging.h).
inline constexpr const char* kEnvOwnLog = "TROUPE_OWN_LOG";
inline constexpr const char* kEnvSessionDir = "TROUPE_SESSION_DIR";
inline constexpr const char* kEnvAddress = "TROUPE_ADDRESS";
// A job's runtime_env as JSON, for a Python driver's troupe.init (set by
// `troupe submit --runtime-env-json`).
inline constexpr const char* kEnvRuntimeEnv = "TROUPE_RUNTIME_ENV";
inline constexpr const char* kEnvWorkerBinary = "TROUPE_WORKER_BINARY";
inline constexpr const char* kEnvObjectStoreBytes = "TROUPE_OBJECT_STORE_BYTES";
inline constexpr const char* kEnvDigitsPath = "TROUPE_DIGITS_PATH";
// Shipped files (runtime/client/shipped_file.h, object_store.h): how long
// an unused copy stays, where a directory's archive is written, how long
// a borrower may leave what it asked for untaken. Read where the copies
// are made and served: workers too.
inline constexpr const char* kEnvShippedCopyGrace = "TROUPE_SHIPPED_COPY_GRACE_S";
inline constexpr const char* kEnvShippingDir = "TROUPE_SHIPPING_DIR";
inline constexpr const char* kEnvObjectSendTimeout = "TROUPE_OBJECT_SEND_TIMEOUT_S";
// Workers: "reuse" (default) or "system"; see malloc_policy.h.
inline constexpr const char* kEnvWorkerMalloc = "TROUPE_WORKER_MALLOC";
// Python workers: how many GiB of unpacked runtime_env packages a machine
// keeps (python_shim/troupe/_packages.py).
inline constexpr const char* kEnvRuntimeEnvCacheGb = "TROUPE_RUNTIME_ENV_CACHE_GB";

// What a role process needs to know. Fields left at their defaults are not
// written by to_env(); from_env() leaves absent variables at the defaults.
struct WorkerEnv {
  std::string role;  // head, node or worker
  std::string token;
  std::string head_address;  // node, worker: HOST:PORT of the head
  // Head.
  std::string head_host;  // address to listen on
  uint16_t head_port = 0;
  uint32_t heartbeat_ms = core::kHeartbeatMs;
  uint32_t heartbeat_misses = core::kHeartbeatMisses;
  uint64_t max_dead_actors = 1000;  // DEAD actors the head keeps (oldest go first)
  bool dashboard = false;           // the HTTP endpoint on dashboard_port (0 = any free)
  uint16_t dashboard_port = 0;
  bool dashboard_require_token = false;
  bool dashboard_port_fallback = false;
  // The SQLite file the head writes its tables through to and reloads them
  // from when restarted ("" = none: a head that dies ends the cluster).
  std::string head_state_db;
  // Run the head under a supervisor that starts it again when it dies
  // (client/head_supervisor.h); needs head_state_db.
  bool head_supervise = false;
  // Supervised head: its event loop silent this long counts as hung, and
  // the supervisor kills and restarts it (0 = never).
  uint64_t head_hang_timeout_ms = 30000;
  // Node agents, workers: how long to wait for a durable head that went
  // away (0 = the default, ConnectOptions::default_head_reconnect).
  uint64_t head_reconnect_ms = 0;
  // Node agent and its workers.
  std::string resources;                     // node: overrides, "CPU=2,GPU=0"
  std::string bind_host;                     // where the node's workers listen ("" = derive)
  std::string advertise_host;                // head, node, worker: the address others reach it at ("" = derive)
  uint32_t worker_pool_size = 2;             // node: idle workers per executable (0 = no pool)
  uint64_t worker_idle_timeout_ms = 300000;  // node: idle workers of an executable unused this long go
  // Node: a taken pooled worker that does not acknowledge its actor within
  // this is killed, and the actor started cold.
  uint64_t worker_assign_timeout_ms = 10000;
  // Worker.
  uint64_t actor_id = 0;
  uint32_t incarnation = 0;
  uint64_t node_id = 0;
  std::vector<int> gpu_ids;
  // Pooled worker: the socket its node agent sends its assignment on (-1 =
  // started for one actor, named above).
  int pool_fd = -1;
  // A worker started for one actor: the socket it writes one byte to once
  // its actor serves (its node agent counts it as starting until then).
  int serving_fd = -1;
  // Plumbing.
  int ready_fd = -1;  // where the process writes its ready line
  // A supervised head's event loop writes a byte here every second (set by
  // the supervisor in the forked head; never in the environment).
  int liveness_fd = -1;
  std::string log_level;    // spdlog level name
  std::string session_dir;  // passed through for --address auto
  // Any process: the limit of its object store (0 = the default).
  uint64_t object_store_bytes = 0;

  // KEY=VALUE strings, ready for an exec environment.
  std::vector<std::string> to_env() const;
  // From this process's environment; throws ConfigError naming the variable
  // and its value when one does not parse.
  static WorkerEnv from_env();
};

// How long a process waits for a durable head that went away before it
// counts as lost: TROUPE_HEAD_RECONNECT_MS, else 30 s (ConfigError naming
// the value when it is not a number).
std::chrono::milliseconds default_head_reconnect();

// The value of `name` in this process's environment, "" when unset.
std::string env_value(const char* name);

// This process's environment without troupe's own wiring (every TROUPE_*
// variable but the user settings that workers act on, kEnvForWorkers) and
// without the variables named in `drop` (e.g. CUDA_VISIBLE_DEVICES): the
// base a child's environment is built on, so that no role, address or token
// leaks by accident while a setting such as TROUPE_DIGITS_PATH reaches the
// trainer that reads it.
inline constexpr const char* kEnvForWorkers[] = {kEnvDigitsPath,  kEnvWorkerMalloc,     kEnvRuntimeEnvCacheGb,
                                                 kEnvLogMaxBytes, kEnvObjectStoreBytes, kEnvShippedCopyGrace,
                                                 kEnvShippingDir, kEnvObjectSendTimeout};
std::vector<std::string> clean_environment(const std::vector<std::string>& drop = {});

}  // namespace troupe::core
