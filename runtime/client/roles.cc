// Role dispatch: any troupe binary can serve as a head, a node agent or a
// worker when started with TROUPE_ROLE set (LocalCluster and node agents
// re-execute binaries this way).
#include <signal.h>
#include <unistd.h>

#include <thread>

#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/core/worker_env.h"
#include "troupe/runtime/head/head.h"
#include "troupe/runtime/head/scheduler.h"
#include "troupe/runtime/node/node_agent.h"
#include "troupe/runtime/worker/worker.h"

namespace troupe {

namespace {

// Tells whoever started us (through TROUPE_READY_FD) that we are serving.
void signal_ready(int fd, const std::string& text) {
  if (fd < 0) return;
  std::string line = text + "\n";
  (void)!::write(fd, line.data(), line.size());
  ::close(fd);
}

// Blocks SIGTERM/SIGINT in every thread and waits for them on one thread,
// which then calls `stop`.
std::thread stop_on_signal(std::function<void()> stop) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return std::thread([set, stop] {
    int sig = 0;
    sigwait(&set, &sig);
    stop();
  });
}

[[noreturn]] void run_head(const core::WorkerEnv& env) {
  core::init_logging("head");
  head::HeadOptions o;
  o.host = env.head_host.empty() ? "127.0.0.1" : env.head_host;
  o.advertise_host = env.advertise_host;
  o.port = env.head_port;
  o.token = env.token;
  o.heartbeat_ms = env.heartbeat_ms;
  o.heartbeat_misses = env.heartbeat_misses;
  if (o.token.empty()) {
    TROUPE_LOG_ERROR("head: {} is not set", core::kEnvToken);
    std::_Exit(2);
  }
  try {
    head::Head h(o);
    auto waiter = stop_on_signal([&h] { h.stop(); });
    waiter.detach();
    TROUPE_LOG_INFO("head listening on {}", h.address());
    signal_ready(env.ready_fd, h.address());
    h.run();
  } catch (const std::exception& e) {
    TROUPE_LOG_ERROR("head failed: {}", e.what());
    std::_Exit(1);
  }
  std::_Exit(0);
}

[[noreturn]] void run_node(const core::WorkerEnv& env) {
  core::init_logging("node");
  node::NodeOptions o;
  o.head_address = env.head_address;
  o.token = env.token;
  o.bind_host = env.bind_host;
  o.advertise_host = env.advertise_host;
  try {
    o.resources = node::detect_resources(head::parse_resources(env.resources));
    // Block TERM/INT before the agent's threads start so they inherit it.
    std::function<void()> stop;
    std::mutex mu;
    node::NodeAgent* agent_ptr = nullptr;
    auto waiter = stop_on_signal([&] {
      std::lock_guard lock(mu);
      if (agent_ptr)
        agent_ptr->stop();
      else
        std::_Exit(0);
    });
    waiter.detach();
    node::NodeAgent agent(o);
    {
      std::lock_guard lock(mu);
      agent_ptr = &agent;
    }
    TROUPE_LOG_INFO("node {} serving with {{{}}}", agent.node_id(), head::format_resources(o.resources));
    signal_ready(env.ready_fd, std::to_string(agent.node_id()));
    agent.run();
    std::lock_guard lock(mu);
    agent_ptr = nullptr;
  } catch (const std::exception& e) {
    TROUPE_LOG_ERROR("node agent failed: {}", e.what());
    std::_Exit(1);
  }
  std::_Exit(0);
}

}  // namespace

void run_role_if_requested(int, char**) {
  std::string role = core::env_value(core::kEnvRole);
  if (role.empty()) return;
  core::WorkerEnv env;
  try {
    env = core::WorkerEnv::from_env();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe %s: %s\n", role.c_str(), e.what());
    std::_Exit(2);
  }
  if (role == "worker") worker::run_worker(env);
  if (role == "head") run_head(env);
  if (role == "node") run_node(env);
  std::fprintf(stderr, "troupe: unknown %s '%s' (head, node, worker)\n", core::kEnvRole, role.c_str());
  std::_Exit(2);
}

}  // namespace troupe
