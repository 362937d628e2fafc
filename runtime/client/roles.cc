// Role dispatch: any troupe binary can serve as a head, a node agent or a
// worker when started with TROUPE_ROLE set (LocalCluster and node agents
// re-execute binaries this way).
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <functional>
#include <mutex>
#include <thread>

#include "troupe/runtime/client/head_supervisor.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/client/shipped_copies.h"
#include "troupe/runtime/core/files.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/core/process.h"
#include "troupe/runtime/core/session.h"
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

// Blocks SIGTERM/SIGINT in every thread started after it and waits for
// them on a thread of its own, which then calls `stop`. Joined when it
// goes: a waiter that saw no signal is woken by one sent to it alone, and
// then does nothing.
class SignalWaiter {
 public:
  explicit SignalWaiter(std::function<void()> stop) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    thread_ = std::thread([this, set, stop = std::move(stop)] {
      int sig = 0;
      sigwait(&set, &sig);
      if (!leaving_.load()) stop();
    });
  }
  SignalWaiter(const SignalWaiter&) = delete;
  SignalWaiter& operator=(const SignalWaiter&) = delete;
  ~SignalWaiter() {
    leaving_.store(true);
    // Stays pending (and is dropped) if the thread is past its sigwait.
    pthread_kill(thread_.native_handle(), SIGTERM);
    thread_.join();
  }

 private:
  std::atomic<bool> leaving_{false};
  std::thread thread_;
};

[[noreturn]] void run_head(core::WorkerEnv env) {
  // Before any thread starts: the supervisor forks the head processes.
  if (env.head_supervise) env = client::supervise_head(std::move(env));
  core::init_logging("head");
  core::rotate_own_log_in_background();
  head::HeadOptions o;
  o.host = env.head_host.empty() ? "127.0.0.1" : env.head_host;
  o.advertise_host = env.advertise_host;
  o.port = env.head_port;
  o.token = env.token;
  o.heartbeat_ms = env.heartbeat_ms;
  o.heartbeat_misses = env.heartbeat_misses;
  o.max_dead_actors = env.max_dead_actors;
  o.state_db = env.head_state_db;
  o.liveness_fd = env.liveness_fd;
  if (env.dashboard) o.dashboard_port = env.dashboard_port;
  o.dashboard_require_token = env.dashboard_require_token;
  o.dashboard_port_fallback = env.dashboard_port_fallback;
  if (o.token.empty()) {
    TROUPE_LOG_ERROR("head: {} is not set", core::kEnvToken);
    std::_Exit(2);
  }
  try {
    // Block TERM/INT before the head's threads start (its dashboard's
    // server starts one in the constructor): a signal that such a thread
    // took would end the process at once, and the stop would not empty the
    // state db, so the next head of the session reloaded the stopped cluster.
    std::mutex mu;
    head::Head* running = nullptr;
    bool stop_asked = false;
    SignalWaiter waiter([&] {
      std::lock_guard lock(mu);
      if (running)
        running->stop();
      else
        stop_asked = true;
    });
    head::Head h(o);
    {
      std::lock_guard lock(mu);
      running = &h;
      if (stop_asked) h.stop();
    }
    TROUPE_LOG_INFO("head listening on {}", h.address());
    // The ready line: the address, then the dashboard's URL when it is on.
    const std::string url = h.dashboard_url();
    if (!url.empty()) TROUPE_LOG_INFO("dashboard at {}", url);
    signal_ready(env.ready_fd, url.empty() ? h.address() : h.address() + " " + url);
    h.run();
    std::lock_guard lock(mu);
    running = nullptr;
  } catch (const std::exception& e) {
    TROUPE_LOG_ERROR("head failed: {}", e.what());
    std::_Exit(1);
  }
  std::_Exit(0);
}

// The copies of files drivers shipped to this host's workers
// (shipped_file.h) go with the node: nobody runs `troupe stop` on every
// host of a cluster stopped from its head. Not while another process of
// the session runs (a head and its own agent beside an agent that joined
// another cluster): its workers may be reading or fetching them, and
// `troupe stop` removes them once none runs.
void remove_copies_unless_session_runs(std::string dir) {
  if (dir.empty()) dir = core::session_dir();  // where this agent's workers put them
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.path().extension() != ".pid") continue;
    const auto f = core::check_pid_file(dir, entry.path().filename().string());
    if (f.alive && f.pid != ::getpid()) return;
  }
  remove_shipped_copies(dir);
}

[[noreturn]] void run_node(const core::WorkerEnv& env) {
  core::init_logging("node");
  core::rotate_own_log_in_background();
  node::NodeOptions o;
  o.head_address = env.head_address;
  o.token = env.token;
  o.bind_host = env.bind_host;
  o.advertise_host = env.advertise_host;
  o.worker_pool.size = env.worker_pool_size;
  o.worker_pool.idle_timeout = std::chrono::milliseconds(env.worker_idle_timeout_ms);
  o.worker_pool.assign_timeout = std::chrono::milliseconds(env.worker_assign_timeout_ms);
  o.worker_logs_beside_own_output = true;
  o.session_dir = env.session_dir;
  if (env.head_reconnect_ms) o.head_reconnect = std::chrono::milliseconds(env.head_reconnect_ms);
  try {
    o.resources = node::detect_resources(head::parse_resources(env.resources));
    // Block TERM/INT before the agent's threads start so they inherit it.
    std::function<void()> stop;
    std::mutex mu;
    node::NodeAgent* agent_ptr = nullptr;
    SignalWaiter waiter([&] {
      std::lock_guard lock(mu);
      if (agent_ptr)
        agent_ptr->stop();
      else
        std::_Exit(0);
    });
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
    remove_copies_unless_session_runs(o.session_dir);
  } catch (const std::exception& e) {
    TROUPE_LOG_ERROR("node agent failed: {}", e.what());
    std::_Exit(1);
  }
  std::_Exit(0);
}

}  // namespace

void run_role_if_requested(int argc, char** argv) {
  std::string role = core::env_value(core::kEnvRole);
  if (role.empty()) return;
  core::remember_args(argc, argv);  // a pooled worker retitles itself for its actor
  // An actor's output goes to a file or a pipe, where stdio would hold it
  // in a 4 KiB buffer: a line at a time, so what `troupe logs` shows is
  // what ran, and a worker killed with SIGKILL (how workers are stopped)
  // loses none of it. std::cout, synced with stdio, follows.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  core::WorkerEnv env;
  try {
    env = core::WorkerEnv::from_env();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe %s: %s\n", role.c_str(), e.what());
    std::_Exit(2);
  }
  // A worker has the default action of SIGUSR1 and SIGUSR2 whatever its
  // agent has: troupe slurm's node script ignores them for the agent (a
  // time-limit warning for the driver), and an ignored signal is
  // inherited. (SIGPWR, the script's own stop, stays ignored.)
  if (role == "worker")
    for (const int sig : {SIGUSR1, SIGUSR2}) ::signal(sig, SIG_DFL);
  // Its node agent dying takes the actor's own processes too.
  if (role == "worker") core::kill_group_when_parent_dies();
  if (role == "worker" && env.pool_fd >= 0) worker::run_pooled_worker(env);
  if (role == "worker") worker::run_worker(env, env.serving_fd);
  if (role == "head") run_head(env);
  if (role == "node") run_node(env);
  std::fprintf(stderr, "troupe: unknown %s '%s' (head, node, worker)\n", core::kEnvRole, role.c_str());
  std::_Exit(2);
}

}  // namespace troupe
