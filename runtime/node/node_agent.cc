#include "troupe/runtime/node/node_agent.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <future>
#include <map>
#include <set>
#include <thread>

#include "troupe/runtime/core/cuda_devices.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/core/malloc_policy.h"
#include "troupe/runtime/core/process.h"
#include "troupe/runtime/core/worker_env.h"
#include "troupe/runtime/node/script_executable.h"
#include "troupe/runtime/node/stats_pages.h"
#include "troupe/runtime/node/worker_assignment.h"
#include "troupe/runtime/wire/address.h"
#include "troupe/runtime/wire/rpc.h"

namespace troupe::node {

using namespace troupe::wire;

namespace {

// How long a stopping agent waits for the head to take its goodbye.
constexpr std::chrono::milliseconds kGoodbyeTimeout{1000};
// How long a fenced agent keeps trying to join the head again (the head is
// alive: it sent the fence, but the network that cut the node off may take
// a while to heal).
constexpr std::chrono::milliseconds kRejoinAfterFence{60000};

// HeadLease: how long an agent may hear nothing from the head before it
// kills its workers. One heartbeat less than the head's fence time, so that
// they are gone before the head declares the node dead and gives their
// actors to other nodes; never under half of it, and none at all when the
// fence is under three heartbeats.
std::chrono::milliseconds head_lease(uint32_t fence_after_ms, uint32_t heartbeat_ms) {
  // Fewer than three heartbeats to the fence (--heartbeat-misses 1 or 2):
  // an answer can be due only just before the lease would end, so none.
  if (fence_after_ms == 0 || fence_after_ms < 3 * heartbeat_ms) return std::chrono::milliseconds(0);
  return std::chrono::milliseconds(
      std::max(fence_after_ms / 2, fence_after_ms - std::min(fence_after_ms, heartbeat_ms)));
}

// GPU count through the CUDA runtime, loaded lazily so that a node without
// CUDA (or a build without it) simply reports 0.
int cuda_device_count() {
  void* h = dlopen("libcudart.so", RTLD_LAZY | RTLD_LOCAL);
  for (const char* name : {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"})
    if (!h) h = dlopen(name, RTLD_LAZY | RTLD_LOCAL);
  if (!h) return 0;
  using Fn = int (*)(int*);
  auto fn = reinterpret_cast<Fn>(dlsym(h, "cudaGetDeviceCount"));
  int n = 0;
  if (!fn || fn(&n) != 0) n = 0;
  return n;
}

// GPU k of the node is the agent's k-th visible device (actor_env); with
// a CUDA_VISIBLE_DEVICES that names fewer than it offers (an override, a
// mask such as -1), the rest are left out of workers' lists: never a
// device the agent was not given. Said once, at the start.
void warn_of_gpus_beyond_visible(const Resources& offered, const std::vector<std::string>& visible, bool mask_set) {
  const auto gpus = offered.find("GPU");
  if (!mask_set || gpus == offered.end() || gpus->second <= static_cast<double>(visible.size())) return;
  TROUPE_LOG_WARN(
      "this node offers GPU={} but its CUDA_VISIBLE_DEVICES names {} devices: GPUs {} and up of the node are given "
      "to workers as no device",
      gpus->second, visible.size(), visible.size());
}

std::string hostname() {
  char buf[256] = {0};
  gethostname(buf, sizeof(buf) - 1);
  return buf;
}

// The executable a spawn runs: the actor's, or this agent's own program, by
// its real path, which also names its pool (a driver names its own binary
// by the path it was started with, a symlink or /proc/self/exe alike).
std::string executable_of(const std::string& given) {
  std::string path = given.empty() ? "/proc/self/exe" : given;
  char real[PATH_MAX];
  return ::realpath(path.c_str(), real) ? std::string(real) : path;
}

// Fills in the bind and advertise hosts left empty: the interface that
// routes to the head is the one the head and the other nodes can reach.
void choose_addresses(NodeOptions& o) {
  if (!o.advertise_host.empty()) check_host("advertise address", o.advertise_host);
  if (!o.bind_host.empty() && !o.advertise_host.empty()) return;
  auto [head_host, head_port] = parse_address(o.head_address);
  if (o.bind_host.empty()) o.bind_host = local_address_towards(head_host, head_port);
  if (o.advertise_host.empty())
    o.advertise_host =
        is_wildcard_host(o.bind_host) ? local_address_towards(head_host, head_port) : strip_brackets(o.bind_host);
}

}  // namespace

Resources detect_resources(const Resources& overrides) {
  Resources r;
  // The CPUs this agent may use (a container's CPU set or quota), not the
  // machine's: a pod limited to 4 of 64 offered 64.
  r["CPU"] = static_cast<double>(core::cpu_limit());
  r["GPU"] = cuda_device_count();
  // Bytes, as Ray's "memory": what actors and tasks ask with `memory=` (a
  // reservation the scheduler counts, not a limit it enforces).
  if (const uint64_t bytes = core::memory_limit_bytes()) r["memory"] = static_cast<double>(bytes);
  for (const auto& [k, v] : overrides) r[k] = v;
  return r;
}

class NodeAgent::Impl {
 public:
  using Clock = std::chrono::steady_clock;

  explicit Impl(NodeOptions o) : opts_(std::move(o)), signals_(io_, SIGCHLD), timer_(io_), lease_timer_(io_) {
    validate_pool_options(opts_.worker_pool);
    // A bad TROUPE_WORKER_MALLOC fails the agent's start, not each worker.
    (void)core::malloc_policy_from_env();
    // A daemon agent (its output a file) gives each worker a log file of its
    // own beside it, which `troupe logs ACTOR` reads.
    if (const std::string own = core::own_log_file();
        opts_.worker_logs_beside_own_output && !own.empty() && opts_.worker_pool.log_dir.empty())
      opts_.worker_pool.log_dir = std::filesystem::path(own).parent_path().string();
    if (opts_.resources.empty()) opts_.resources = detect_resources({});
    warn_of_gpus_beyond_visible(opts_.resources, visible_gpus_, gpu_mask_set_);
    choose_addresses(opts_);
    // Ray's node:<address> resource, one of it per node: what programs ask
    // a small part of ({"node:10.0.0.5": 0.01}) to run on that node.
    opts_.resources.emplace(std::string(kNodeResourcePrefix) + opts_.advertise_host, 1.0);
    // Before the event loop runs: a spawn may arrive as soon as the node is
    // registered. Pooled workers learn the node id with their assignment.
    pool_ = std::make_unique<WorkerPool>(io_, opts_.worker_pool, worker_env());
    pool_->on_assignment_taken([this](pid_t pid) { pooled_spawns_.erase(pid); });
    pool_->on_assignment_lost([this](pid_t pid, uint64_t actor, uint32_t inc) { assignment_lost(pid, actor, inc); });
    io_thread_ = std::thread([this] {
      auto guard = asio::make_work_guard(io_);
      io_.run();
    });
    try {
      Registration r = join_head(std::chrono::seconds(10));
      node_id_ = r.reply.node_id;
      asio::post(io_, [this, r] { install(r); });
    } catch (...) {
      io_.stop();
      io_thread_.join();
      throw;
    }
    asio::post(io_, [this] {
      wait_signal();
      heartbeat();
      arm_lease();
      // A change of the idle count reaches the head at once: the head's
      // view (Runtime::nodes) is what callers wait on for a filled pool.
      pool_->on_idle_count_change([this](uint32_t n) {
        if (!stopping_) head_->send(make_event_value(Op::kHeartbeat, NodeHeartbeat{n}));
      });
      if (opts_.prefill_own_executable) pool_->fill(executable_of(""));
    });
  }

  ~Impl() {
    shutdown();
    if (io_thread_.joinable()) io_thread_.join();
    if (rejoin_thread_.joinable()) rejoin_thread_.join();
  }

  void wait_done() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return done_; });
  }

  void shutdown() {
    leaving_ = true;
    asio::post(io_, [this] {
      if (stopping_) return;
      stopping_ = true;
      if (pool_) pool_->stop();
      kill_workers();
      if (head_) head_->close("node stopping");
      signals_.cancel();
      timer_.cancel();
      lease_timer_.cancel();
      io_.stop();
      std::lock_guard lock(mu_);
      done_ = true;
      cv_.notify_all();
    });
  }

  // Tells the head that the agent leaves for good, so that its node is
  // lost at once: without it a durable head takes the close for a blip and
  // waits the heartbeat limit, since it cannot see an agent's process end
  // on another machine (and any head logs the loss as a failure). Bounded: a head that does not answer within
  // kGoodbyeTimeout sees only the close. Not from io's thread (which
  // answers the request); the stops from there are the head's own doing.
  void say_goodbye() {
    if (io_.get_executor().running_in_this_thread() || io_.stopped() || leaving_) return;
    auto asked = std::make_shared<std::promise<Future<Message>>>();
    auto sent = asked->get_future();
    // The handler holds the only reference: one that sends nothing breaks
    // the promise as it ends, and the wait below ends with it.
    asio::post(io_, [this, asked = std::move(asked)] {
      if (!stopping_ && !rejoining_ && head_ && head_->is_open()) asked->set_value(head_->request(Op::kGoodbye));
    });
    const auto deadline = std::chrono::steady_clock::now() + kGoodbyeTimeout;
    try {
      if (sent.wait_until(deadline) != std::future_status::ready) return;
      const Future<Message> answer = sent.get();
      if (!answer.wait_for(std::chrono::duration_cast<std::chrono::milliseconds>(
              std::max(deadline - std::chrono::steady_clock::now(), std::chrono::steady_clock::duration::zero()))))
        // As at every `troupe stop`, which stops the head and the agents
        // at once: not worth a warning.
        TROUPE_LOG_INFO(
            "node: the head did not answer the goodbye within {} ms (it may be stopping too); leaving "
            "anyway",
            kGoodbyeTimeout.count());
    } catch (const std::future_error&) {
      // Not sent (no durable head to tell, or the agent is already going).
    }
  }

  uint64_t node_id() const { return node_id_; }

 private:
  struct WorkerProc {
    uint64_t actor_id;
    uint32_t incarnation;
  };
  // One registration with the head: its connection (events and close are
  // told apart from an earlier registration's by `generation`) and reply.
  struct Registration {
    uint64_t generation = 0;
    std::shared_ptr<RpcChannel> channel;
    HelloReply reply;
  };

  // Connects and says hello, as a new node or (resume_id) as the node it
  // was before the head restarted; blocks, so never on io's thread.
  Registration join_head(std::chrono::milliseconds timeout, uint64_t resume_id = 0,
                         std::vector<LiveWorker> workers = {}) {
    Registration r;
    r.generation = ++generations_;
    uint64_t gen = r.generation;
    r.channel = RpcChannel::connect(
        io_, opts_.head_address, opts_.token, timeout, [this, gen](Message&& m) { on_head_event(gen, std::move(m)); },
        [this, gen](const std::string& reason) { on_head_closed(gen, reason); });
    Hello h;
    h.role = Role::kNode;
    h.resources = opts_.resources;
    h.hostname = hostname();
    h.pid = getpid();
    h.host_key = core::host_key();
    h.address = opts_.advertise_host;
    h.resume_node_id = resume_id;
    h.workers = std::move(workers);
    try {
      r.reply = r.channel->call<HelloReply>(Op::kHello, h, timeout);
    } catch (...) {
      // Closed, not dropped: a head that reads this hello late (a slow
      // link) sees the connection gone with it, and does not keep a node
      // that no agent serves beside the one the next try registers.
      r.channel->close("the hello was not answered in time");
      throw;
    }
    return r;
  }

  // On io's thread: the registration becomes the current one, and the events
  // that came on it before this ran (a spawn can follow the hello reply at
  // once) are handled now, with the node id they are meant for.
  void install(const Registration& r) {
    if (stopping_) return r.channel->close("node stopping");
    // A head back with other tables (its state file lost: cluster_id) may
    // give this node its old id again, from 1, and knows none of its actors.
    const bool other_tables = cluster_id_ != 0 && r.reply.cluster_id != 0 && r.reply.cluster_id != cluster_id_;
    if (resuming_ && (r.reply.node_id != node_id_ || other_tables)) {
      // The head had declared this node dead meanwhile: its actors run
      // elsewhere now (or will), so none of its workers may go on.
      TROUPE_LOG_WARN("node {}: {} and took it back as a new node {}; killing its {} workers", node_id_.load(),
                      other_tables ? "the head came back without this cluster's tables (its state file was lost)"
                                   : "the head had declared it dead meanwhile",
                      r.reply.node_id, workers_.size());
      kill_workers();
      waiting_spawns_.clear();  // their actors are placed anew
      start_cold_.clear();
      pool_->recycle();
      missed_exits_.clear();
    }
    if (rejoining_)  // said when it went, so said when it is back
      TROUPE_LOG_INFO("node {}: joined the head again as node {} with {} workers", node_id_.load(), r.reply.node_id,
                      workers_.size());
    resuming_ = false;
    head_ = r.channel;
    generation_ = r.generation;
    node_id_ = r.reply.node_id;
    heartbeat_ms_ = r.reply.heartbeat_ms;
    lease_ = head_lease(r.reply.fence_after_ms, r.reply.heartbeat_ms);
    fence_after_ms_ = r.reply.fence_after_ms;
    last_heard_ = Clock::now();
    lease_spent_ = false;
    durable_ = r.reply.durable;
    cluster_id_ = r.reply.cluster_id;
    rejoining_ = false;
    for (auto& w : std::exchange(missed_exits_, {})) head_->send(make_event_value(Op::kWorkerExited, w));
    for (auto& m : std::exchange(early_events_, {})) on_event(std::move(m));
    if (!head_->is_open()) on_head_closed(generation_, "closed before the node was registered");
  }

  void on_head_event(uint64_t gen, Message&& m) {
    if (gen > generation_) return early_events_.push_back(std::move(m));
    if (gen != generation_) return;
    // Only a heartbeat's answer says the head hears this node (and so will
    // not fence it yet): its other messages (a spawn, a kill, a log read)
    // come as well while the link from this node is down.
    if (static_cast<Op>(m.op) == Op::kHeartbeat) {
      last_heard_ = Clock::now();
      lease_spent_ = false;
    }
    on_event(std::move(m));
  }

  // Only the current registration's connection matters: a fenced one is
  // expected to close, and a newer one not yet installed is checked then.
  void on_head_closed(uint64_t gen, const std::string& reason) {
    if (gen != generation_ || rejoining_) return;
    if (!stopping_ && durable_ && !told_to_stop_ && opts_.head_reconnect.count() > 0) return wait_for_head(reason);
    if (!stopping_) TROUPE_LOG_WARN("lost the head ({}); stopping node", reason);
    shutdown();
  }

  // The durable head went away: its workers go on, and the agent joins the
  // restarted head as the node it was, with the list of them (exits
  // meanwhile are told after). Not back within head_reconnect: it stops.
  void wait_for_head(const std::string& reason) {
    TROUPE_LOG_WARN("node {}: lost the head ({}); keeping {} workers and waiting up to {} ms for it to come back",
                    node_id_.load(), reason, workers_.size(), opts_.head_reconnect.count());
    rejoining_ = true;
    resuming_ = true;
    std::vector<LiveWorker> live;
    for (const auto& [pid, w] : workers_) live.push_back({w.actor_id, w.incarnation, pid});
    // Spawns waiting for a start slot are the head's actors too: it keeps
    // them (pid 0: none yet), and they start once it is back.
    for (const auto& s : waiting_spawns_) live.push_back({s.actor_id, s.incarnation, 0});
    rejoin_in_background(opts_.head_reconnect, node_id_.load(), std::move(live));
  }

  // Joins the head again from a thread of its own, trying until `window`
  // passes: as the node it was (resume_id, with its live workers) for a
  // restarted head, or as a new node (0) after a fence. Not back by then:
  // the agent stops.
  void rejoin_in_background(std::chrono::milliseconds window, uint64_t resume_id, std::vector<LiveWorker> live) {
    if (rejoin_thread_.joinable()) rejoin_thread_.join();  // the last rejoin has installed its registration
    rejoin_thread_ = std::thread([this, window, resume_id, live = std::move(live)] {
      const auto deadline = std::chrono::steady_clock::now() + window;
      std::string last;
      bool token_said = false;
      while (!leaving_.load()) {
        try {
          Registration r = join_head(std::chrono::seconds(2), resume_id, live);
          asio::post(io_, [this, r] { install(r); });
          return;
        } catch (const std::exception& e) {
          last = e.what();
        }
        // Said as soon as seen, not only when the wait is over: a head that
        // answers and refuses the handshake runs with another token.
        if (!token_said && last.find("cluster token") != std::string::npos) {
          token_said = true;
          TROUPE_LOG_WARN(
              "node {}: a head answers at {} again but refused this node's token ({}): most likely it "
              "was started again with another cluster token; trying until {} ms have passed",
              node_id_.load(), opts_.head_address, last, window.count());
        }
        if (resume_id != 0) head_down_or_cut_off();
        if (std::chrono::steady_clock::now() > deadline) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));  // a retry interval, not a wait for an event
      }
      if (leaving_.load()) return shutdown();
      if (token_said)
        TROUPE_LOG_WARN("node: the head at {} refused this node's cluster token for {} ms (last: {}); stopping node",
                        opts_.head_address, window.count(), last);
      else
        TROUPE_LOG_WARN("node: the head did not come back within {} ms ({}); stopping node", window.count(), last);
      shutdown();
    });
  }

  // While it waits for a durable head, the agent keeps its lease (below)
  // unless the head is known not to run: a connect to its address refused
  // (the host reached, nothing listening) means no head there can fence
  // this node, and a restarted one gives returning nodes a grace of seconds
  // before it does. Anything else (a timeout, a connection that goes
  // nowhere) may be a partition from a head that lives and fences: the
  // lease runs on, and the workers stop before their actors start elsewhere.
  // On the rejoin thread.
  void head_down_or_cut_off() {
    int err = 0;
    try {
      err = tcp_connect_error(opts_.head_address, std::chrono::milliseconds(500));
    } catch (const std::exception&) {
      return;  // an address that does not resolve proves nothing
    }
    if (err == ECONNREFUSED)
      asio::post(io_, [this] {
        if (resuming_) last_heard_ = Clock::now();
      });
  }

  // The head declared this incarnation of the node dead: its actors run
  // elsewhere now, so every worker here goes, before the node joins again
  // as a new node with its resources whole.
  void fenced(const NodeFenced& f) {
    if (stopping_ || rejoining_) return;
    TROUPE_LOG_WARN("node {}: the head declared it dead ({}); killing its {} workers and joining again", f.node_id,
                    f.reason, workers_.size());
    rejoining_ = true;
    kill_workers();
    waiting_spawns_.clear();  // the dead node's actors: restarted elsewhere
    start_cold_.clear();
    pool_->recycle();
    rejoin_in_background(kRejoinAfterFence, 0, {});
  }

  // HeadLease. The head answers every heartbeat; an agent that hears nothing
  // from it for lease_ is cut off from it (or the head is hung): the head
  // may be about to declare the node dead and restart its actors elsewhere,
  // so the workers here stop first, and their exits are told to the head
  // (a head that was only slow restarts their actors; a fencing one ignores
  // them). When the check itself comes late (the agent was stopped or
  // starved), answers may wait unread in its socket: it looks again once
  // they are read before it acts.
  void arm_lease(Clock::time_point due) {
    if (stopping_) return;
    lease_due_ = due;
    lease_timer_.expires_at(due);
    lease_timer_.async_wait([this](asio::error_code ec) {
      if (!ec) check_lease();
    });
  }
  // Due when the lease runs out; once it has (the workers killed, or none
  // to kill), every heartbeat interval.
  void arm_lease() {
    const auto now = Clock::now();
    const auto due = last_heard_ + lease_;
    arm_lease(lease_.count() && !lease_spent_ && due > now ? due : now + std::chrono::milliseconds(heartbeat_ms_));
  }

  void check_lease() {
    const auto now = Clock::now();
    const bool late = now - lease_due_ > std::chrono::milliseconds(heartbeat_ms_) / 2;
    const auto silent = now - last_heard_;
    // While rejoining after a fence there is nothing left to stop; while
    // waiting for a durable head, see head_down_or_cut_off.
    if (lease_.count() && !lease_spent_ && (!rejoining_ || resuming_) && silent >= lease_ &&
        !(workers_.empty() && waiting_spawns_.empty())) {
      if (late && !second_look_) {
        second_look_ = true;
        return arm_lease(now + std::chrono::milliseconds(10));
      }
      lease_expired(std::chrono::duration_cast<std::chrono::milliseconds>(silent));
    }
    second_look_ = false;
    arm_lease();
  }

  void lease_expired(std::chrono::milliseconds silent) {
    // The agent cannot tell a head that is cut off from one that only
    // stalls (starved of CPU, paused): the remedy for the second is named.
    const std::string why = "its node agent heard nothing from the head for " + std::to_string(silent.count()) +
                            " ms and stopped its workers (the head fences a node silent for " +
                            std::to_string(fence_after_ms_) +
                            " ms; a head that only stalls that long needs a larger `troupe start --head "
                            "--heartbeat-misses`)";
    TROUPE_LOG_WARN(
        "node {}: heard nothing from the head for {} ms: killing its {} workers before the head can "
        "restart their actors on other nodes (if the head was only slow, not cut off, start it with a larger "
        "--heartbeat-misses: it fences a node silent for {} ms)",
        node_id_.load(), silent.count(), workers_.size() + waiting_spawns_.size(), fence_after_ms_);
    for (auto& [pid, w] : workers_) {
      kill_worker(pid);
      kill_reasons_[pid] = why;
    }
    for (const auto& s : waiting_spawns_) report_exit(s.actor_id, s.incarnation, 0, "never started: " + why);
    waiting_spawns_.clear();
    start_cold_.clear();
    // A pooled worker killed here is not started again (assignment_lost).
    pooled_spawns_.clear();
    lease_spent_ = true;  // until the head is heard again
  }

  // A worker and what it started: its process group (a worker leads its
  // own), then itself. A DataLoader's workers, a subprocess an actor
  // started, go with it, as Ray's do (kill_child_processes_on_worker_exit).
  static void kill_worker(pid_t pid) {
    ::kill(-pid, SIGKILL);
    ::kill(pid, SIGKILL);
  }

  // Kills and reaps every worker without reporting their exits: the node is
  // stopping, or its incarnation is over and the head knows.
  void kill_workers() {
    for (auto& [pid, w] : workers_) kill_worker(pid);
    for (auto& [pid, w] : workers_) {
      core::wait_child(pid);
      pool_->worker_exited(pid);
    }
    workers_.clear();
    kill_reasons_.clear();
    pooled_spawns_.clear();
  }

  void on_event(Message&& m) {
    try {
      switch (static_cast<Op>(m.op)) {
        case Op::kSpawnWorker:
          return spawn(decode_value<SpawnWorker>(m.body));
        case Op::kKillWorker: {
          auto k = decode_value<KillWorker>(m.body);
          for (auto& [pid, w] : workers_)
            if (w.actor_id == k.actor_id && w.incarnation == k.incarnation) {
              kill_worker(pid);
              pooled_spawns_.erase(pid);  // not started again if its pooled worker never took it
            }
          // One still waiting to start never does.
          for (auto it = waiting_spawns_.begin(); it != waiting_spawns_.end();) {
            if (it->actor_id == k.actor_id && it->incarnation == k.incarnation) {
              report_exit(k.actor_id, k.incarnation, 0, "killed before its worker started");
              start_cold_.erase({it->actor_id, it->incarnation});
              it = waiting_spawns_.erase(it);
            } else {
              ++it;
            }
          }
          return;
        }
        case Op::kShutdown:
          // Said, since nothing else in this agent's log would say why it
          // exits (its host may not be the one where `troupe stop` ran).
          TROUPE_LOG_INFO("node {}: the head is stopping for good (troupe stop, or SIGTERM to it); stopping too",
                          node_id_.load());
          told_to_stop_ = true;
          return shutdown();
        case Op::kNodeFenced:
          return fenced(decode_value<NodeFenced>(m.body));
        case Op::kHeartbeat:
          return;  // the head's answer to one: it hears this node (HeadLease)
        case Op::kReadLog:
          return read_log(m);
        default:
          TROUPE_LOG_WARN("node: unknown event op {}", m.op);
      }
    } catch (const std::exception& e) {
      TROUPE_LOG_WARN("node: bad event from head: {}", e.what());
    }
  }

  // `troupe logs` (a request the head relays): a piece of this agent's log
  // or of one of its workers' (by pid).
  void read_log(const Message& m) {
    try {
      auto req = decode_value<ReadLog>(m.body);
      LogChunk c;
      if (req.target == "node") {
        c.path = core::own_log_file();
        if (c.path.empty()) throw ConfigError("node " + std::to_string(node_id_) + "'s output is not a file");
      } else if (req.target == "worker") {
        if (opts_.worker_pool.log_dir.empty())
          throw ConfigError("node " + std::to_string(node_id_) +
                            " keeps no worker log files (its output is no file, or it runs inside a driver, whose "
                            "output its workers share)");
        c.path = worker_log_path(opts_.worker_pool.log_dir, static_cast<pid_t>(req.id));
        if (!std::filesystem::exists(c.path))
          throw ConfigError("node " + std::to_string(node_id_) + " has no log file of worker " +
                            std::to_string(req.id) + " (it keeps those of its " +
                            std::to_string(opts_.worker_pool.max_exited_logs) + " latest exited workers)");
      } else {
        throw ConfigError("read log: unknown target '" + req.target + "' at the node");
      }
      if (req.rotated) c.path += ".1";
      c.text = core::read_log_piece(c.path, req.offset, req.max_bytes, &c.next_offset, &c.size, &c.file_id);
      head_->send(ok_response_value(m.id, c));
    } catch (const std::exception& e) {
      head_->send(error_response(m.id, e));
    }
  }

  // What every worker of this node gets: head, token, node, hosts.
  core::WorkerEnv worker_env() const {
    core::WorkerEnv w;
    w.role = "worker";
    w.head_address = opts_.head_address;
    w.token = opts_.token;
    w.node_id = node_id_;
    w.bind_host = opts_.bind_host;
    w.advertise_host = opts_.advertise_host;
    w.log_level = core::env_value(core::kEnvLogLevel);
    w.head_reconnect_ms = static_cast<uint64_t>(opts_.head_reconnect.count());
    // The agent's session: where a worker keeps what is this host's (the
    // copies of files a driver shipped, shipped_file.h).
    w.session_dir = opts_.session_dir;
    return w;
  }

  // The actor's part of a worker's environment: its GPUs, then its extra env.
  // The node's GPU k is the k-th device this agent sees: of its own
  // CUDA_VISIBLE_DEVICES when it was started with one (a Slurm step's GPUs,
  // a host's share given to one agent), where k itself named another GPU.
  // One past what that names is left out (the worker sees no device for
  // it: none when it is left with none), never the host's GPU k.
  std::vector<std::string> actor_env(const SpawnWorker& s) const {
    std::string gpus;
    for (const int id : s.gpu_ids) {
      const auto k = static_cast<size_t>(id);
      if (k >= visible_gpus_.size() && gpu_mask_set_) continue;
      gpus += (gpus.empty() ? "" : ",") + (k < visible_gpus_.size() ? visible_gpus_[k] : std::to_string(k));
    }
    std::vector<std::string> env{"CUDA_VISIBLE_DEVICES=" + gpus};
    env.insert(env.end(), s.env.begin(), s.env.end());
    return env;
  }

  // Where executables given as a script's text are written: the session
  // directory's launchers/, else one of this user's in the temp directory.
  std::string launcher_dir() const {
    if (!opts_.session_dir.empty()) return opts_.session_dir + "/launchers";
    if (!opts_.worker_pool.log_dir.empty()) return opts_.worker_pool.log_dir + "/launchers";
    std::error_code ec;
    auto tmp = std::filesystem::temp_directory_path(ec);
    return (ec ? std::filesystem::path("/tmp") : tmp).string() + "/troupe-launchers-" + std::to_string(::getuid());
  }

  // `cold`: not from the pool (its pooled worker did not take it).
  void spawn(const SpawnWorker& s, bool cold = false) {
    std::string executable;
    try {
      executable =
          is_script_text(s.executable) ? script_executable(s.executable, launcher_dir()) : executable_of(s.executable);
    } catch (const std::exception& e) {
      report_exit(s.actor_id, s.incarnation, 0, std::string("failed to start: ") + e.what());
      return;
    }
    std::optional<pid_t> pid;
    // Variables the loader or libc read at exec cannot reach a running
    // worker: such an actor starts cold.
    if (std::string late = exec_time_variable(s.env); !late.empty()) {
      TROUPE_LOG_DEBUG("node {}: actor {} sets {}, which must be there at exec; starting a worker for it", node_id_,
                       s.actor_id, late);
    } else if (!cold) {
      pid = pool_->take(executable,
                        WorkerAssignment{s.actor_id, s.incarnation, node_id_, s.gpu_ids, actor_env(s), s.class_name});
      // Kept until the worker acknowledges its assignment (assignment_lost).
      if (pid) pooled_spawns_[*pid] = s;
    }
    if (!pid && starting_.size() >= max_starting_) {
      // As many workers as the machine has cores start already: this one
      // waits (80 Python workers starting at once on two cores starved the
      // agent past its heartbeat timeout, and the head declared it dead).
      waiting_spawns_.push_back(s);
      if (cold) start_cold_.insert({s.actor_id, s.incarnation});
      return;
    }
    if (!pid) pid = cold_spawn(s, executable);
    if (!pid) return;
    workers_[*pid] = {s.actor_id, s.incarnation};
    TROUPE_LOG_DEBUG("node {}: worker pid {} serves actor {} ({})", node_id_, *pid, s.actor_id, s.class_name);
  }

  // The pooled worker `pid` did not acknowledge its assignment in time: the
  // pool killed and reaped it. It never ran the actor, so no exit is
  // reported (the actor is neither failed nor restarted): it starts in a
  // worker of its own. Unless the agent had killed that worker itself
  // meanwhile (KillWorker, HeadLease): then its exit is reported, as reap()
  // would have.
  void assignment_lost(pid_t pid, uint64_t actor, uint32_t inc) {
    auto kept = pooled_spawns_.extract(pid);
    auto w = workers_.find(pid);
    if (stopping_ || w == workers_.end() || w->second.actor_id != actor || w->second.incarnation != inc) return;
    workers_.erase(w);
    std::string how = "killed before its worker started";
    if (auto k = kill_reasons_.find(pid); k != kill_reasons_.end()) {
      how = k->second;
      kill_reasons_.erase(k);
    }
    if (kept.empty()) return report_exit(actor, inc, pid, how);
    TROUPE_LOG_DEBUG("node {}: starting actor {} (incarnation {}) cold: pooled worker {} did not take it", node_id_,
                     actor, inc, pid);
    spawn(kept.mapped(), /*cold=*/true);
  }

  // The CPUs this process may use: its affinity mask, or its cgroup's CPU
  // quota when lower (in a pod limited to 4 CPUs on 64 cores, 64 cold
  // starts ran at once).
  static size_t usable_cores() { return static_cast<size_t>(core::cpu_limit()); }

  // Fork + exec of a worker for this actor alone; a failure is the actor's
  // exit. It counts as starting (starting_) until it writes its serving
  // byte, dies, or kStartBound passes.
  std::optional<pid_t> cold_spawn(const SpawnWorker& s, const std::string& executable) {
    int fds[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
      report_exit(s.actor_id, s.incarnation, 0, std::string("failed to start: socketpair: ") + std::strerror(errno));
      return std::nullopt;
    }
    core::WorkerEnv w = worker_env();
    w.actor_id = s.actor_id;
    w.incarnation = s.incarnation;
    w.gpu_ids.assign(s.gpu_ids.begin(), s.gpu_ids.end());
    w.serving_fd = fds[1];
    core::SpawnOptions o;
    o.executable = executable;
    o.arg0 = "troupe-worker:" + s.class_name;
    o.own_process_group = true;
    o.env = core::clean_environment({"CUDA_VISIBLE_DEVICES"});
    for (auto& kv : w.to_env()) o.env.push_back(std::move(kv));
    for (auto& kv : actor_env(s)) o.env.push_back(std::move(kv));
    core::add_exec_time_malloc_settings(o.env);
    o.keep_fds = {fds[1]};
    const StatsPages::Page page = StatsPages::instance().prepare(o);
    pid_t pid = -1;
    try {
      pid = spawn_logged(std::move(o), opts_.worker_pool.log_dir);
    } catch (const std::exception& e) {
      ::close(fds[0]);
      ::close(fds[1]);
      StatsPages::discard(page);
      report_exit(s.actor_id, s.incarnation, 0, std::string("failed to start: ") + e.what());
      return std::nullopt;
    }
    StatsPages::instance().adopt(pid, page);
    ::close(fds[1]);
    watch_start(pid, fds[0]);
    return pid;
  }

  void watch_start(pid_t pid, int fd) {
    starting_[pid] = std::make_unique<ServingWatch>(
        io_, std::make_unique<asio::local::stream_protocol::socket>(io_, asio::local::stream_protocol(), fd),
        kStartBound, [this, pid] { started(pid); });
  }

  // Worker `pid` serves (or died, or is slow): the next waiting one starts.
  void started(pid_t pid) {
    starting_.erase(pid);
    while (!stopping_ && !waiting_spawns_.empty() && starting_.size() < max_starting_) {
      SpawnWorker s = std::move(waiting_spawns_.front());
      waiting_spawns_.pop_front();
      spawn(s, start_cold_.erase({s.actor_id, s.incarnation}) > 0);
    }
  }

  void wait_signal() {
    signals_.async_wait([this](asio::error_code ec, int) {
      if (ec) return;
      reap();
      wait_signal();
    });
  }

  void reap() {
    pool_->reap();
    // Only our own workers: the process may have other children (a driver
    // with an embedded node, a test harness) that are not ours to reap.
    for (auto it = workers_.begin(); it != workers_.end();) {
      // Seen ended but not reaped yet (WNOWAIT): while the zombie is there
      // its pid, and so its group's id, is no other process's. A worker
      // that ended by itself (its actor exited, an idle task executor
      // released, a crash) leaves nothing it started behind either.
      siginfo_t info{};
      if (::waitid(P_PID, static_cast<id_t>(it->first), &info, WEXITED | WNOHANG | WNOWAIT) != 0 ||
          info.si_pid != it->first) {
        ++it;
        continue;
      }
      ::kill(-it->first, SIGKILL);
      int status = 0;
      const pid_t pid = ::waitpid(it->first, &status, 0);
      if (pid != it->first) {
        ++it;
        continue;
      }
      std::string how = core::describe_exit_status(status);
      if (WIFEXITED(status) && WEXITSTATUS(status) == 127) how += " (could not exec the worker executable?)";
      if (auto k = kill_reasons_.find(pid); k != kill_reasons_.end()) {
        how = k->second + " (" + how + ")";
        kill_reasons_.erase(k);
      }
      report_exit(it->second.actor_id, it->second.incarnation, pid, how, StatsPages::instance().read(pid));
      pool_->worker_exited(pid);
      pooled_spawns_.erase(pid);
      it = workers_.erase(it);
    }
  }

  // `last`: the worker's counters as it left them (its stats page), which
  // the head counts in place of what it last published.
  void report_exit(uint64_t actor, uint32_t inc, int32_t pid, const std::string& how,
                   std::optional<StatsPages::Counts> last = std::nullopt) {
    WorkerExited w{actor, inc, pid, how};
    if (last) {
      w.has_stats = 1;
      w.calls = last->calls;
      w.stream_bytes = last->stream_bytes;
    }
    if (resuming_)
      missed_exits_.push_back(w);  // the restarted head hears of it once it is back
    else if (head_ && !rejoining_)
      head_->send(make_event_value(Op::kWorkerExited, w));
  }

  void heartbeat() {
    if (stopping_) return;
    if (!rejoining_) head_->send(make_event_value(Op::kHeartbeat, NodeHeartbeat{pool_->idle_count()}));
    timer_.expires_after(std::chrono::milliseconds(heartbeat_ms_));
    timer_.async_wait([this](asio::error_code ec) {
      if (!ec) heartbeat();
    });
  }

  NodeOptions opts_;
  // Its CUDA_VISIBLE_DEVICES when it was made (an agent may run inside a
  // driver's process, whose environment changes after): actor_env.
  const std::vector<std::string> visible_gpus_ = core::cuda_visible_devices(core::env_value("CUDA_VISIBLE_DEVICES"));
  // Set at all (if only to hide every device): GPUs past visible_gpus_ are
  // left out of a worker's list rather than given as the host's numbers.
  const bool gpu_mask_set_ = std::getenv("CUDA_VISIBLE_DEVICES") != nullptr;
  asio::io_context io_;
  asio::signal_set signals_;
  asio::steady_timer timer_;
  asio::steady_timer lease_timer_;  // HeadLease
  std::thread io_thread_;
  std::thread rejoin_thread_;  // joins the head again after a fence
  std::shared_ptr<RpcChannel> head_;
  std::atomic<uint64_t> generations_{0};    // registrations made
  uint64_t generation_ = 0;                 // the current one's (io thread)
  std::vector<Message> early_events_;       // from a registration not yet installed
  bool rejoining_ = false;                  // fenced, not yet registered again
  bool resuming_ = false;                   // waiting for a restarted head (rejoining_ too)
  bool durable_ = false;                    // the head reloads its tables when restarted
  uint64_t cluster_id_ = 0;                 // the head's tables' (HelloReply::cluster_id)
  bool told_to_stop_ = false;               // the head said it is going for good
  std::atomic<bool> leaving_{false};        // shutdown began (read by the rejoin thread)
  std::vector<WorkerExited> missed_exits_;  // while resuming
  std::atomic<uint64_t> node_id_{0};
  uint32_t heartbeat_ms_ = core::kHeartbeatMs;
  // HeadLease (io thread): how long the agent may hear nothing from the
  // head (0: no lease), when it last did, and when the check is due.
  std::chrono::milliseconds lease_{0};
  Clock::time_point last_heard_ = Clock::now();
  Clock::time_point lease_due_;
  bool second_look_ = false;  // the late check looks again before it acts
  bool lease_spent_ = false;  // the workers were killed; nothing heard since
  uint32_t fence_after_ms_ = 0;
  std::map<pid_t, std::string> kill_reasons_;  // why the agent killed a worker, for its exit report
  std::map<pid_t, WorkerProc> workers_;
  // Cold-started workers not yet serving, and spawns waiting for one of
  // them: at most max_starting_ start at once (Ray's
  // maximum_startup_concurrency, its CPU count).
  static constexpr auto kStartBound = std::chrono::seconds(2);
  std::map<pid_t, std::unique_ptr<ServingWatch>> starting_;
  std::deque<SpawnWorker> waiting_spawns_;
  // Waiting spawns whose pooled worker did not take them: they start cold.
  std::set<std::pair<uint64_t, uint32_t>> start_cold_;
  // Spawns handed to pooled workers that have not acknowledged them yet, by
  // pid: started again cold if the pool gives up on the worker.
  std::map<pid_t, SpawnWorker> pooled_spawns_;
  const size_t max_starting_ = std::max<size_t>(2, usable_cores());
  std::unique_ptr<WorkerPool> pool_;
  bool stopping_ = false;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
};

NodeAgent::NodeAgent(NodeOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
NodeAgent::~NodeAgent() { impl_->shutdown(); }
uint64_t NodeAgent::node_id() const { return impl_->node_id(); }
void NodeAgent::run() { impl_->wait_done(); }
void NodeAgent::stop() {
  impl_->say_goodbye();
  impl_->shutdown();
}

}  // namespace troupe::node
