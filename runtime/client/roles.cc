// Role dispatch: any troupe binary can serve as a head, a node agent or a
// worker when started with TROUPE_ROLE set (LocalCluster and node agents
// re-execute binaries this way).
#include <signal.h>
#include <unistd.h>

#include <thread>

#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/head/head.h"
#include "troupe/runtime/head/scheduler.h"
#include "troupe/runtime/node/node_agent.h"
#include "troupe/runtime/worker/worker.h"

namespace troupe {

namespace {

std::string env_or(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

// Tells whoever started us (through TROUPE_READY_FD) that we are serving.
void signal_ready(const std::string& text) {
  std::string fd_text = env_or("TROUPE_READY_FD");
  if (fd_text.empty()) return;
  int fd = std::stoi(fd_text);
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

[[noreturn]] void run_head() {
  core::init_logging("head");
  head::HeadOptions o;
  o.host = env_or("TROUPE_HEAD_HOST", "127.0.0.1");
  o.port = static_cast<uint16_t>(std::stoi(env_or("TROUPE_HEAD_PORT", "0")));
  o.token = env_or("TROUPE_TOKEN");
  o.heartbeat_ms = std::stoul(env_or("TROUPE_HEARTBEAT_MS", "100"));
  o.heartbeat_misses = std::stoul(env_or("TROUPE_HEARTBEAT_MISSES", "5"));
  o.max_dead_actors = std::stoul(env_or("TROUPE_MAX_DEAD_ACTORS", "1000"));
  if (o.token.empty()) {
    TROUPE_LOG_ERROR("head: TROUPE_TOKEN is not set");
    std::_Exit(2);
  }
  try {
    head::Head h(o);
    auto waiter = stop_on_signal([&h] { h.stop(); });
    waiter.detach();
    TROUPE_LOG_INFO("head listening on {}", h.address());
    signal_ready(h.address());
    h.run();
  } catch (const std::exception& e) {
    TROUPE_LOG_ERROR("head failed: {}", e.what());
    std::_Exit(1);
  }
  std::_Exit(0);
}

[[noreturn]] void run_node() {
  core::init_logging("node");
  node::NodeOptions o;
  o.head_address = env_or("TROUPE_HEAD_ADDRESS");
  o.token = env_or("TROUPE_TOKEN");
  o.bind_host = env_or("TROUPE_BIND_HOST", "127.0.0.1");
  try {
    o.resources = node::detect_resources(head::parse_resources(env_or("TROUPE_RESOURCES")));
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
    signal_ready(std::to_string(agent.node_id()));
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
  std::string role = env_or("TROUPE_ROLE");
  if (role.empty()) return;
  if (role == "worker") worker::run_worker();
  if (role == "head") run_head();
  if (role == "node") run_node();
  std::fprintf(stderr, "troupe: unknown TROUPE_ROLE '%s' (head, node, worker)\n", role.c_str());
  std::_Exit(2);
}

}  // namespace troupe
