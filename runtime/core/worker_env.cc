#include "troupe/runtime/core/worker_env.h"

#include <cstdlib>
#include <limits>

#include "troupe/runtime/core/errors.h"

extern char** environ;

namespace troupe::core {

namespace {

// Parses an unsigned decimal no larger than `max`; throws ConfigError naming
// the variable.
uint64_t parse_unsigned(const char* name, const std::string& text, uint64_t max) {
  size_t used = 0;
  unsigned long long v = 0;
  try {
    if (text.empty() || text[0] == '-' || text[0] == '+') throw std::invalid_argument(text);
    v = std::stoull(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || v > max)
    throw ConfigError(std::string(name) + "='" + text + "' is not a number in [0, " + std::to_string(max) + "]");
  return v;
}

template <typename T>
void read_number(const char* name, T& out) {
  std::string text = env_value(name);
  if (!text.empty()) out = static_cast<T>(parse_unsigned(name, text, std::numeric_limits<T>::max()));
}

// A descriptor number, -1 when the variable is absent.
int read_fd(const char* name) {
  std::string text = env_value(name);
  if (text.empty()) return -1;
  return static_cast<int>(parse_unsigned(name, text, static_cast<uint64_t>(std::numeric_limits<int>::max())));
}

std::vector<int> parse_gpu_ids(const std::string& text) {
  std::vector<int> ids;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string::npos) comma = text.size();
    if (comma > pos) {
      auto id = parse_unsigned(kEnvGpuIds, text.substr(pos, comma - pos), std::numeric_limits<int>::max());
      ids.push_back(static_cast<int>(id));
    }
    pos = comma + 1;
  }
  return ids;
}

std::string join_gpu_ids(const std::vector<int>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

}  // namespace

std::string env_value(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

std::vector<std::string> WorkerEnv::to_env() const {
  std::vector<std::string> env;
  auto put = [&env](const char* name, const std::string& value) {
    if (!value.empty()) env.push_back(std::string(name) + "=" + value);
  };
  put(kEnvRole, role);
  put(kEnvToken, token);
  put(kEnvHeadAddress, head_address);
  put(kEnvHeadHost, head_host);
  if (head_port != 0) put(kEnvHeadPort, std::to_string(head_port));
  if (heartbeat_ms != WorkerEnv{}.heartbeat_ms) put(kEnvHeartbeatMs, std::to_string(heartbeat_ms));
  if (heartbeat_misses != WorkerEnv{}.heartbeat_misses) put(kEnvHeartbeatMisses, std::to_string(heartbeat_misses));
  if (max_dead_actors != WorkerEnv{}.max_dead_actors) put(kEnvMaxDeadActors, std::to_string(max_dead_actors));
  if (dashboard) put(kEnvDashboardPort, std::to_string(dashboard_port));
  if (dashboard_require_token) put(kEnvDashboardAuth, "1");
  if (dashboard_port_fallback) put(kEnvDashboardFallback, "1");
  put(kEnvHeadStateDb, head_state_db);
  if (head_supervise) put(kEnvHeadSupervise, "1");
  if (head_reconnect_ms != 0) put(kEnvHeadReconnectMs, std::to_string(head_reconnect_ms));
  if (head_hang_timeout_ms != WorkerEnv{}.head_hang_timeout_ms)
    put(kEnvHeadHangTimeoutMs, std::to_string(head_hang_timeout_ms));
  put(kEnvResources, resources);
  put(kEnvBindHost, bind_host);
  put(kEnvAdvertiseHost, advertise_host);
  if (worker_pool_size != WorkerEnv{}.worker_pool_size) put(kEnvWorkerPoolSize, std::to_string(worker_pool_size));
  if (worker_idle_timeout_ms != WorkerEnv{}.worker_idle_timeout_ms)
    put(kEnvWorkerIdleTimeoutMs, std::to_string(worker_idle_timeout_ms));
  if (worker_assign_timeout_ms != WorkerEnv{}.worker_assign_timeout_ms)
    put(kEnvWorkerAssignTimeoutMs, std::to_string(worker_assign_timeout_ms));
  if (role == "worker") {
    put(kEnvActorId, std::to_string(actor_id));
    put(kEnvIncarnation, std::to_string(incarnation));
    put(kEnvNodeId, std::to_string(node_id));
    // Always present for workers, empty when the actor has no GPU.
    env.push_back(std::string(kEnvGpuIds) + "=" + join_gpu_ids(gpu_ids));
  }
  if (pool_fd >= 0) put(kEnvPoolFd, std::to_string(pool_fd));
  if (serving_fd >= 0) put(kEnvServingFd, std::to_string(serving_fd));
  if (ready_fd >= 0) put(kEnvReadyFd, std::to_string(ready_fd));
  put(kEnvLogLevel, log_level);
  put(kEnvSessionDir, session_dir);
  if (object_store_bytes != 0) put(kEnvObjectStoreBytes, std::to_string(object_store_bytes));
  return env;
}

WorkerEnv WorkerEnv::from_env() {
  WorkerEnv e;
  e.role = env_value(kEnvRole);
  e.token = env_value(kEnvToken);
  e.head_address = env_value(kEnvHeadAddress);
  e.head_host = env_value(kEnvHeadHost);
  read_number(kEnvHeadPort, e.head_port);
  read_number(kEnvHeartbeatMs, e.heartbeat_ms);
  read_number(kEnvHeartbeatMisses, e.heartbeat_misses);
  read_number(kEnvMaxDeadActors, e.max_dead_actors);
  e.dashboard = !env_value(kEnvDashboardPort).empty();
  read_number(kEnvDashboardPort, e.dashboard_port);
  e.dashboard_require_token = env_value(kEnvDashboardAuth) == "1";
  e.dashboard_port_fallback = env_value(kEnvDashboardFallback) == "1";
  e.head_state_db = env_value(kEnvHeadStateDb);
  e.head_supervise = env_value(kEnvHeadSupervise) == "1";
  read_number(kEnvHeadReconnectMs, e.head_reconnect_ms);
  read_number(kEnvHeadHangTimeoutMs, e.head_hang_timeout_ms);
  e.resources = env_value(kEnvResources);
  e.bind_host = env_value(kEnvBindHost);
  e.advertise_host = env_value(kEnvAdvertiseHost);
  read_number(kEnvWorkerPoolSize, e.worker_pool_size);
  read_number(kEnvWorkerIdleTimeoutMs, e.worker_idle_timeout_ms);
  read_number(kEnvWorkerAssignTimeoutMs, e.worker_assign_timeout_ms);
  read_number(kEnvActorId, e.actor_id);
  read_number(kEnvIncarnation, e.incarnation);
  read_number(kEnvNodeId, e.node_id);
  e.gpu_ids = parse_gpu_ids(env_value(kEnvGpuIds));
  e.ready_fd = read_fd(kEnvReadyFd);
  e.pool_fd = read_fd(kEnvPoolFd);
  e.serving_fd = read_fd(kEnvServingFd);
  e.log_level = env_value(kEnvLogLevel);
  e.session_dir = env_value(kEnvSessionDir);
  read_number(kEnvObjectStoreBytes, e.object_store_bytes);
  return e;
}

std::chrono::milliseconds default_head_reconnect() {
  uint64_t ms = 30000;
  read_number(kEnvHeadReconnectMs, ms);
  return std::chrono::milliseconds(ms);
}

std::vector<std::string> clean_environment(const std::vector<std::string>& drop) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    if (kv.rfind("TROUPE_", 0) == 0) {
      bool passed = false;
      for (const char* name : kEnvForWorkers) passed = passed || kv.rfind(std::string(name) + "=", 0) == 0;
      if (!passed) continue;
    }
    bool dropped = false;
    for (const auto& name : drop) dropped = dropped || kv.rfind(name + "=", 0) == 0;
    if (!dropped) env.push_back(std::move(kv));
  }
  return env;
}

}  // namespace troupe::core
