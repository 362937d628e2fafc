#include "troupe/runtime/head/head_state.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <iterator>
#include <optional>
#include <utility>

#include "troupe/runtime/client/actor_keys.h"
#include "troupe/runtime/client/process_stats.h"
#include "troupe/runtime/client/task.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/core/rate_limited_log.h"
#include "troupe/runtime/head/metrics.h"
#include "troupe/runtime/head/scheduler.h"

namespace troupe::head {

using namespace troupe::wire;

namespace {
// A task's worker that dies is retried by its caller: a program whose tasks
// kill their workers (a crash, os._exit) wrote one warning per task, on an
// embedded cluster into the driver's console. Bounded like refused
// connections.
core::RateLimitedLog& executor_end_log() {
  static auto* log = new core::RateLimitedLog("task executor ends");  // never destroyed: any thread may log at exit
  return *log;
}

const char* to_string(PlacementGroupState s) {
  return s == PlacementGroupState::kPending ? "PENDING" : s == PlacementGroupState::kCreated ? "CREATED" : "REMOVED";
}

bool restarts_left(const ActorInfo& info) { return info.max_restarts == -1 || info.restarts < info.max_restarts; }

// How long a restart waits after `early_deaths` workers in a row ended
// before the actor was ready: none for the first few (a crash while
// starting can be bad luck, and recovery is what restarts are for), then
// 100 ms doubling up to 5 s, so that a constructor that always crashes its
// process does not start workers twenty times a second for ever.
std::chrono::milliseconds restart_backoff(uint32_t early_deaths) {
  constexpr uint32_t kFree = 3;
  constexpr std::chrono::milliseconds kFirst{100}, kMost{5000};
  if (early_deaths < kFree) return std::chrono::milliseconds(0);
  const uint32_t doublings = std::min<uint32_t>(early_deaths - kFree, 6);
  return std::min(kFirst * (1 << doublings), kMost);
}
}  // namespace

HeadState::HeadState(HeadConfig config) : config_(config) {}

HeadOutputs HeadState::take_outputs() {
  // Once per call into the state, not per scheduling pass or kill: a
  // driver that goes with many waiting actors is one check, not one each.
  update_resources_wanted();
  return std::exchange(out_, HeadOutputs{});
}

// ---- nodes ------------------------------------------------------------------

uint64_t HeadState::register_node(PeerId peer, const Hello& hello, Time now) {
  validate_resources(hello.resources, "node " + hello.hostname + " (pid " + std::to_string(hello.pid) + ")");
  Node n;
  n.info.id = next_node_id_++;
  n.info.hostname = hello.hostname;
  n.info.address = hello.address;
  n.info.pid = hello.pid;
  n.peer = peer;
  n.pool = ResourcePool(hello.resources);
  n.last_heartbeat = now;
  uint64_t id = n.info.id;
  TROUPE_LOG_INFO("node {} joined from {} (pid {}) with {{{}}}", id, hello.hostname, hello.pid,
                  format_resources(hello.resources));
  nodes_[id] = std::move(n);
  schedule();
  return id;
}

void HeadState::heartbeat(uint64_t node_id, Time now, const NodeHeartbeat& report) {
  auto it = nodes_.find(node_id);
  if (it == nodes_.end()) return;
  it->second.last_heartbeat = now;
  it->second.info.idle_workers = report.idle_workers;
}

// Said with a node lost to silence: on a lossy or distant network a live
// node's heartbeats can be late by more than the default half second.
constexpr const char* kLossyHint =
    " (on a lossy or high-latency network, troupe start --head --heartbeat-misses N gives nodes longer)";

void HeadState::check_heartbeats(Time now) {
  auto limit = fence_time();
  // The time this check came later than due is the head's own stall, not
  // the nodes' silence: it is credited to every node (heartbeats sent
  // meanwhile may sit unread in the head's sockets still).
  const auto interval = std::chrono::milliseconds(config_.heartbeat_ms);
  const auto late = last_check_ ? now - *last_check_ - interval : Time::duration::zero();
  last_check_ = now;
  if (late > Time::duration::zero()) {
    for (auto& [id, n] : nodes_)
      // Never earlier than it was: a restored node's is in the future
      // (its grace), which the credit must not cut short.
      if (n.info.alive) n.last_heartbeat = std::max(n.last_heartbeat, std::min(now, n.last_heartbeat + late));
    if (late > limit / 2)
      TROUPE_LOG_WARN("the head's heartbeat check ran {} ms late; that time does not count against the nodes",
                      std::chrono::duration_cast<std::chrono::milliseconds>(late).count());
  }
  std::vector<std::pair<uint64_t, std::string>> dead;
  for (auto& [id, n] : nodes_)
    if (n.info.alive && now - n.last_heartbeat > limit)
      dead.emplace_back(id, n.awaiting ? n.awaiting_why : "no heartbeat for " + std::to_string(limit.count()) + " ms");
  for (auto& [id, why] : dead) node_lost(id, why);
  check_restored_owners(now);
  // A restart whose back-off has run out is placed now.
  const bool due = std::any_of(pending_actors_.begin(), pending_actors_.end(), [&](uint64_t id) {
    auto it = actors_.find(id);
    return it != actors_.end() && it->second.not_before && *it->second.not_before <= now;
  });
  if (due) schedule();
}

void HeadState::node_lost(uint64_t node_id, const std::string& why, bool left) {
  auto it = nodes_.find(node_id);
  if (it == nodes_.end() || !it->second.info.alive) return;
  Node& n = it->second;
  n.info.alive = false;
  if (left)
    TROUPE_LOG_INFO("node {} ({}) left: {}", node_id, n.info.hostname, why);
  else if (stopping_)
    TROUPE_LOG_DEBUG("node {} ({}) is gone with the head: {}", node_id, n.info.hostname, why);
  else
    TROUPE_LOG_WARN("node {} ({}) is dead: {}{}", node_id, n.info.hostname, why,
                    why.rfind("no heartbeat", 0) == 0 ? kLossyHint : "");
  out_.dead_nodes.emplace_back(node_id, why);
  dead_nodes_order_.push_back(node_id);
  // Every worker the node ran died with it (PR_SET_PDEATHSIG), whether or not
  // the actor still holds resources there.
  for (auto id : actor_ids_where([&](const Actor& a) { return a.worker_running && a.info.node_id == node_id; }))
    if (auto it = actors_.find(id); it != actors_.end())
      actor_lost(it->second, "node " + std::to_string(node_id) + " died (" + why + ")");
  // Bundles on the dead node must be placed again; the group's others stay.
  for (auto& [id, g] : groups_) {
    if (g.info.state == PlacementGroupState::kRemoved) continue;
    if (std::find(g.info.bundle_nodes.begin(), g.info.bundle_nodes.end(), node_id) == g.info.bundle_nodes.end())
      continue;
    lose_bundles(g, node_id);
  }
  forget_oldest(nodes_, dead_nodes_order_, config_.max_dead_nodes);
  drop_exited_workers();
  schedule();
}

void HeadState::drop_exited_workers() {
  while (!exited_workers_.empty()) {
    const uint64_t client = exited_workers_.back();
    exited_workers_.pop_back();
    drop_awaited(client, kOwnerExited);
  }
}

template <class Table>
void HeadState::forget_oldest(Table& table, std::deque<uint64_t>& order, size_t keep) {
  while (order.size() > keep) {
    table.erase(order.front());
    order.pop_front();
  }
}

void HeadState::peer_gone(PeerId peer, const std::string& reason, bool may_return, Time now) {
  if (peer == 0) return;
  PeerId heir = 0;  // the same process on another connection (a reconnect raced this close)
  uint64_t client_id = 0;
  if (auto it = clients_.find(peer); it != clients_.end()) {
    client_id = it->second;
    clients_.erase(it);
    for (const auto& [p, id] : clients_)
      if (id == client_id) heir = p;
  }
  told_wanted_.erase(peer);
  // Ids first, then the calls: each may forget old entries of the tables.
  std::vector<uint64_t> ids;
  for (auto& [id, n] : nodes_)
    if (n.peer == peer && n.info.alive) ids.push_back(id);
  const auto limit = fence_time();
  for (auto id : ids) {
    Node& n = nodes_.at(id);
    if (may_return && config_.client_grace.count() > 0) {
      // Its agent keeps its workers and joins again as this node: until
      // then (the heartbeat limit from its last heartbeat) nothing new is
      // placed here, and what runs here stays.
      n.awaiting = true;
      n.peer = 0;
      n.awaiting_why = "its agent's connection to the head dropped (" + reason + ") and it did not come back within " +
                       std::to_string(limit.count()) + " ms";
      TROUPE_LOG_WARN("node {} ({}): its agent's connection dropped ({}); waiting for it to come back", id,
                      n.info.hostname, reason);
    } else {
      node_lost(id, "node agent connection lost: " + reason);
    }
  }
  // Whoever created actors or groups (a driver, or an actor) owns them.
  auto actors = actor_ids_where([&](const Actor& a) { return a.owner == peer; });
  ids.clear();
  for (auto& [id, g] : groups_)
    if (g.owner == peer) ids.push_back(id);
  // A worker whose actor's worker is already gone (its node reported the
  // exit first) will not come back.
  if (auto w = worker_clients_.find(client_id); w != worker_clients_.end()) {
    auto it = actors_.find(w->second.first);
    may_return = may_return && it != actors_.end() && it->second.worker_running &&
                 it->second.info.incarnation == w->second.second;
  }
  if (client_id && (heir || (may_return && config_.client_grace.count() > 0))) {
    // Kept: for the connection the process already has, or for the one it
    // may make within the grace (a network blip, not an exit).
    for (auto id : actors) actors_.at(id).owner = heir;
    for (auto id : ids) groups_.at(id).owner = heir;
    if (heir) {
      if (!actors.empty()) tell_resources_wanted(heir);
      return;
    }
    awaited_owners_[client_id] = {now + config_.client_grace, "its driver's connection to the head dropped (" + reason +
                                                                  ") and it did not come back within " +
                                                                  std::to_string(config_.client_grace.count()) + " ms"};
    TROUPE_LOG_INFO(
        "client {}'s connection dropped ({}): it has {} ms to come back for its {} actors and {} placement "
        "groups",
        client_id, reason, config_.client_grace.count(), actors.size(), ids.size());
    return;
  }
  const std::string cause = owner_gone_cause(client_id);
  if (client_id) {
    worker_clients_.erase(client_id);
    client_gone(client_id);
  }
  for (auto id : actors)
    if (auto it = actors_.find(id); it != actors_.end()) {
      it->second.owner = 0;
      kill_actor(id, true, cause);
    }
  for (auto id : ids)
    if (auto it = groups_.find(id); it != groups_.end()) {
      it->second.owner = 0;
      remove_placement_group(id);
    }
}

std::vector<uint64_t> HeadState::live_nodes() const {
  std::vector<uint64_t> v;
  for (const auto& [id, n] : nodes_)
    if (n.info.alive) v.push_back(id);
  return v;
}

// ---- actors -----------------------------------------------------------------

HeadState::Actor& HeadState::actor(uint64_t id) {
  auto it = actors_.find(id);
  if (it == actors_.end()) throw ConfigError("no actor with id " + std::to_string(id));
  mark(it->second);  // whoever asks for it writable may change it
  return it->second;
}

const ActorInfo& HeadState::actor_info(uint64_t id) const {
  auto it = actors_.find(id);
  if (it == actors_.end()) throw ConfigError("no actor with id " + std::to_string(id));
  return it->second.info;
}

std::pair<uint64_t, int32_t> HeadState::actor_log_source(uint64_t id, bool previous) const {
  auto it = actors_.find(id);
  if (it == actors_.end()) throw ConfigError("no actor with id " + std::to_string(id));
  const Actor& a = it->second;
  // A live actor's log is its worker's, its previous one the last that
  // ended; a dead one's is the last that ended, its previous the one
  // before that.
  if (a.info.pid > 0) return previous ? std::pair{a.last_node, a.last_pid} : std::pair{a.info.node_id, a.info.pid};
  return previous ? std::pair{a.prev_node, a.prev_pid} : std::pair{a.last_node, a.last_pid};
}

const ActorInfo& HeadState::named_actor(const std::string& name) const {
  auto it = named_.find(name);
  if (it == named_.end()) throw ConfigError("no actor named '" + name + "'");
  return actor_info(it->second);
}

void HeadState::validate_actor(const ActorSpec& spec) {
  validate_shown_name(spec.class_name, "actor class name");
  validate_shown_name(spec.name, "actor name");
  validate_max_concurrency(spec.max_concurrency);
  validate_concurrency_groups(spec.concurrency_groups, spec.class_name);
  if (spec.max_restarts < -1) throw ConfigError("max_restarts must be >= -1, got " + std::to_string(spec.max_restarts));
  validate_resources(spec.resources, "actor " + spec.class_name + " options");
  if (spec.node_affinity) {
    if (spec.placement_group)
      throw ConfigError(spec.class_name + ": give a placement group or a node affinity, not both");
    auto it = nodes_.find(spec.node_affinity);
    if (!spec.affinity_soft && (it == nodes_.end() || !it->second.info.alive))
      throw ConfigError(spec.class_name + ": node " + std::to_string(spec.node_affinity) +
                        (it == nodes_.end() ? " does not exist" : " is dead") +
                        " (a hard node affinity; soft would place it elsewhere)");
    if (!spec.affinity_soft && !fits(it->second.pool.total(), spec.resources))
      throw ConfigError(spec.class_name + " asks for {" + format_resources(spec.resources) + "}, more than node " +
                        std::to_string(spec.node_affinity) + " has in all {" +
                        format_resources(it->second.pool.total()) + "} (a hard node affinity)");
  }
  // -1 is any bundle; another negative index was taken for it (a task's
  // options refused it), and an index without a group was ignored.
  if (spec.bundle_index < -1 || (spec.bundle_index >= 0 && !spec.placement_group))
    throw ConfigError("bundle index " + std::to_string(spec.bundle_index) +
                      (spec.placement_group ? " is out of range (-1 is any bundle of the group)"
                                            : " names a bundle of no placement group"));
  if (spec.placement_group) {
    auto& g = group(spec.placement_group);
    if (spec.bundle_index >= static_cast<int>(g.spec.bundles.size()))
      throw ConfigError("bundle index " + std::to_string(spec.bundle_index) + " out of range for placement group " +
                        std::to_string(g.info.id) + " with " + std::to_string(g.spec.bundles.size()) + " bundles");
    // A bundle never holds more than it was made with: an actor (or a
    // task's executor) larger than its bundle, or than every bundle for
    // index -1, would wait for ever.
    bool fits_one = false;
    for (size_t i = 0; i < g.spec.bundles.size(); ++i)
      if (spec.bundle_index < 0 || i == static_cast<size_t>(spec.bundle_index))
        fits_one = fits_one || fits(g.spec.bundles[i], spec.resources);
    if (!fits_one) {
      const std::string where = spec.bundle_index < 0 ? "any bundle of placement group " + std::to_string(g.info.id)
                                                      : "bundle " + std::to_string(spec.bundle_index) +
                                                            " of placement group " + std::to_string(g.info.id) + " {" +
                                                            format_resources(g.spec.bundles[spec.bundle_index]) + "}";
      throw ConfigError(spec.class_name + " asks for {" + format_resources(spec.resources) + "}, more than " + where +
                        " holds");
    }
  }
  if (!spec.name.empty()) {
    auto it = named_.find(spec.name);
    if (it != named_.end() && actors_.at(it->second).info.state != ActorState::kDead)
      throw ConfigError("actor name '" + spec.name + "' is already taken by actor " + std::to_string(it->second));
  }
}

ActorInfo HeadState::create_actor(PeerId owner, ActorSpec spec) {
  // Asked again (no answer came in time): the actor the first ask made, before
  // its name is found taken by itself.
  if (spec.request_id != 0)
    if (auto it = requests_.find(spec.request_id); it != requests_.end())
      if (auto a = actors_.find(it->second); a != actors_.end()) return a->second.info;
  validate_actor(spec);
  Actor a;
  a.info.id = next_actor_id_++;
  a.info.class_name = spec.class_name;
  a.info.name = spec.name;
  a.info.max_restarts = spec.max_restarts;
  a.info.max_task_retries = spec.max_task_retries;
  a.info.in_order = spec.max_concurrency <= 1 && spec.concurrency_groups.empty();
  a.spec = std::move(spec);
  // A detached actor has no owner: no one's exit kills it.
  if (!a.spec.detached) {
    a.owner = owner;
    if (auto c = clients_.find(owner); c != clients_.end()) a.owner_client = c->second;
  } else if (auto c = clients_.find(owner); c != clients_.end()) {
    a.creator_client = c->second;
  }
  uint64_t id = a.info.id;
  mark(a);
  if (!a.info.name.empty()) named_[a.info.name] = id;
  if (a.spec.request_id != 0) requests_[a.spec.request_id] = id;
  actors_[id] = std::move(a);
  pending_actors_.push_back(id);
  schedule();
  // A task executor's owner hears it again: its submitter, which leases
  // this one, may be newer than the last word it had.
  if (!actors_.at(id).spec.detached)
    tell_resources_wanted(owner, actors_.at(id).spec.type_key == client::kTaskExecutorKey);
  return actors_.at(id).info;
}

HelloReply HeadState::worker_hello(uint64_t actor_id, uint32_t incarnation) {
  Actor& a = actor(actor_id);
  if (a.info.incarnation != incarnation || a.info.state == ActorState::kDead || !a.worker_running)
    throw Error("worker for actor " + std::to_string(actor_id) + " incarnation " + std::to_string(incarnation) +
                " is stale");
  mark(a);
  a.said_hello = true;
  HelloReply reply;
  reply.spec = a.spec;
  reply.info = a.info;
  // This worker has its arguments; only a restart could need them again.
  drop_ctor_args_if_final(a);
  return reply;
}

bool HeadState::holds_ctor_args(uint64_t actor_id) const {
  const auto& s = actors_.at(actor_id).spec;
  return !s.ctor_args.empty() || !s.ctor_attachments.empty();
}

// Called when a worker has taken its arguments (hello) and when the actor is
// DEAD: from then on only a restart could need them.
void HeadState::drop_ctor_args_if_final(Actor& a) {
  if (a.info.state != ActorState::kDead && restarts_left(a.info)) return;
  a.spec.ctor_args = std::string();
  a.spec.ctor_attachments = {};
}

void HeadState::publish(Actor& a) {
  mark(a);
  ++a.info.version;
  out_.updates.push_back(a.info);
}

void HeadState::actor_ready(const ActorReady& r) {
  Actor& a = actor(r.actor_id);
  if (a.info.incarnation != r.incarnation || !a.worker_running || a.info.state == ActorState::kDead) return;
  // Killed for good while it started (its worker is being stopped): it
  // never serves, even briefly (its address was published until the node
  // reported the exit).
  if (a.kill_requested) return;
  // Told again by a worker whose head came back (it cannot know whether
  // the first one arrived).
  if (a.info.state == ActorState::kAlive && a.info.pid == r.pid && a.info.address == r.address) return;
  retire_stats(a.info.id, a.info.incarnation);  // a restarted actor's earlier processes
  a.info.state = ActorState::kAlive;
  a.early_deaths = 0;
  a.info.address = r.address;
  a.info.control_address = r.control_address;
  a.info.pid = r.pid;
  TROUPE_LOG_INFO("actor {} ({}{}) alive on node {} pid {} at {}{}", a.info.id, a.info.class_name,
                  a.info.name.empty() ? "" : " '" + a.info.name + "'", a.info.node_id, r.pid, r.address,
                  a.info.restarts ? " (restart " + std::to_string(a.info.restarts) + ")" : "");
  publish(a);
}

void HeadState::actor_init_failed(const ActorInitFailed& f) {
  Actor& a = actor(f.actor_id);
  if (a.info.incarnation != f.incarnation) return;
  const std::string cause = "constructor failed: " + f.error;
  if (a.kill_requested && a.info.death_cause == cause) return;  // told again (the worker could not tell it had it)
  // The worker logged the whole error (a Python traceback); its first line
  // is enough here, where an embedded cluster prints beside that log.
  const auto eol = f.error.find('\n');
  TROUPE_LOG_WARN("actor {} ({}) failed to start: {}{}", a.info.id, a.info.class_name, f.error.substr(0, eol),
                  eol == std::string::npos ? "" : " (the traceback is in its worker's log)");
  a.info.death_cause = cause;
  a.kill_requested = true;  // no restart: the constructor would fail again
  mark(a);                  // written down: a head restarted before the exit reads no crash
}

void HeadState::worker_exited(const WorkerExited& w, uint64_t from_node) {
  auto it = actors_.find(w.actor_id);
  if (it == actors_.end()) return;
  Actor& a = it->second;
  if (a.info.incarnation != w.incarnation || !a.worker_running) return;
  if (a.info.node_id != from_node) {
    // Its worker runs on another node, which alone can say it exited: taken
    // as said, the actor restarted while its worker lived on.
    // Once per node at warning level: a buggy agent repeating it would
    // flood the log.
    if (foreign_exit_warned_.insert(from_node).second) {
      TROUPE_LOG_WARN(
          "node {} reported the exit of actor {}'s worker, which runs on node {}: ignored (later such "
          "reports of this node are logged at debug level)",
          from_node, a.info.id, a.info.node_id);
    } else {
      TROUPE_LOG_DEBUG("node {} reported the exit of actor {}'s worker, which runs on node {}: ignored", from_node,
                       a.info.id, a.info.node_id);
    }
    return;
  }
  if (w.has_stats) last_stats(a.info.id, w.incarnation, w.calls, w.stream_bytes);
  // Also a worker that died before it was ready, whose pid the actor
  // never showed.
  remember_worker(a, w.pid);
  a.early_deaths = a.info.state == ActorState::kAlive ? 0 : a.early_deaths + 1;
  actor_lost(a, "worker pid " + std::to_string(w.pid) + " " + w.how);
  drop_exited_workers();
  schedule();
}

void HeadState::remember_worker(Actor& a, int32_t pid) {
  if (pid <= 0 || (pid == a.last_pid && a.info.node_id == a.last_node)) return;  // pids repeat across nodes
  a.prev_node = a.last_node;
  a.prev_pid = a.last_pid;
  a.last_node = a.info.node_id;
  a.last_pid = pid;
}

// The actor's current worker is gone; restart it or declare it dead.
void HeadState::actor_lost(Actor& a, const std::string& why, bool uses_restart) {
  mark(a);
  release(a);
  a.worker_running = false;
  a.info.address.clear();
  a.info.control_address.clear();
  remember_worker(a, a.info.pid);
  a.info.pid = 0;
  // The worker's client, if the head waits for it to come back, will not.
  // What it owns goes once the caller is done with this loss
  // (drop_exited_workers): a kill or group removal now could schedule into
  // a node that is half torn down.
  for (const auto& [client, awaited] : awaited_owners_)
    if (auto w = worker_clients_.find(client); w != worker_clients_.end() && w->second.first == a.info.id)
      exited_workers_.push_back(client);
  if (a.info.state == ActorState::kDead) return;
  if (!uses_restart && !a.kill_requested) {
    // A late exit report of the worker it may have had names the old
    // incarnation, and is ignored.
    a.info.incarnation++;
    TROUPE_LOG_INFO("actor {} ({}): {}; placing it again", a.info.id, a.info.class_name, why);
    publish(a);
    pending_actors_.push_back(a.info.id);
    return;
  }
  bool left = restarts_left(a.info);
  if (a.kill_requested || !left) {
    // A task's executor never restarts: its caller retries the task (or
    // not) and says so; "no restarts left" would read as the task's end.
    // Nor does an actor that asked for none (a training job's workers,
    // whose job recovers): "no restarts left: 0 of 0 used" read as the
    // job's end, the line before the job said it was recovering.
    const bool executor = a.info.class_name == client::kTaskExecutorClass;
    const bool restartable = a.info.max_restarts != 0;
    if (a.info.death_cause.empty() || !a.kill_requested)
      a.info.death_cause =
          why + (left || executor || !restartable ? ""
                                                  : " (no restarts left: " + std::to_string(a.info.restarts) + " of " +
                                                        std::to_string(a.info.max_restarts) + " used)");
    // A kill somebody asked for is routine, and so is what a stopping
    // cluster takes with it (a detached actor at an embedded cluster's
    // end); a death with no restarts left is worth a warning.
    if (a.kill_requested || stopping_)
      TROUPE_LOG_INFO("actor {} ({}) is DEAD: {}", a.info.id, a.info.class_name, a.info.death_cause);
    else if (executor)
      executor_end_log().warn("task executor {} ended: {} (its caller retries the task if it has retries left)",
                              a.info.id, a.info.death_cause);
    else
      TROUPE_LOG_WARN("actor {} ({}) is DEAD: {}", a.info.id, a.info.class_name, a.info.death_cause);
    set_dead(a);
    return;
  }
  a.info.restarts++;
  a.info.incarnation++;
  a.info.state = ActorState::kRestarting;
  a.info.death_cause = why;
  const auto wait = restart_backoff(a.early_deaths);
  a.not_before.reset();
  std::string when;
  if (wait.count() > 0 && last_check_) {
    a.not_before = *last_check_ + wait;
    when = " in " + std::to_string(wait.count()) + " ms (its last " + std::to_string(a.early_deaths) +
           " workers ended before it was ready)";
    a.info.pending_reason = "restarting" + when;
  }
  TROUPE_LOG_WARN("actor {} ({}) died ({}); restarting{} ({} of {})", a.info.id, a.info.class_name, why, when,
                  a.info.restarts,
                  a.info.max_restarts == -1 ? std::string("unlimited") : std::to_string(a.info.max_restarts));
  publish(a);
  pending_actors_.push_back(a.info.id);
}

void HeadState::release_name(const Actor& a) {
  if (a.info.name.empty()) return;
  auto it = named_.find(a.info.name);
  if (it != named_.end() && it->second == a.info.id) named_.erase(it);
}

void HeadState::set_dead(Actor& a) {
  retire_stats(a.info.id, UINT32_MAX);
  kv_erase_prefix(client::actor_key_prefix(a.info.id));
  a.info.state = ActorState::kDead;
  a.info.address.clear();
  a.info.pending_reason.clear();
  release_name(a);
  drop_ctor_args_if_final(a);
  publish(a);
  dead_order(a).push_back(a.info.id);
  evict_dead();
}

// A task executor its pool let go (killed on request, no reason given) is
// routine: such rows are kept apart, fewer of them, so that a workload's
// churn of tasks does not push a crashed actor's row (its cause, its log)
// out of status. An executor that failed to start, or was killed with a
// reason (a cancelled task), is not routine.
std::deque<uint64_t>& HeadState::dead_order(const Actor& a) {
  const bool routine =
      a.kill_requested && a.info.class_name == client::kTaskExecutorClass && a.info.death_cause == kKilledByRequest;
  return routine ? dead_routine_ : dead_order_;
}

void HeadState::evict_dead() {
  // The newest dead row stays whatever the limit (--max-dead-actors 0): it
  // is the actor set_dead was just given, which its caller still holds (a
  // schedule pass read its freed state; create_actor answered "map::at").
  const size_t cap = std::max<size_t>(1, config_.max_dead_actors);
  const size_t routine_cap = std::max<size_t>(1, config_.max_dead_actors / 10);
  for (;;) {
    std::deque<uint64_t>* order = nullptr;
    if (dead_order_.size() > cap) order = &dead_order_;
    if (dead_routine_.size() > routine_cap) order = &dead_routine_;
    if (!order) break;
    uint64_t id = order->front();
    order->pop_front();
    // Its restarts still count in troupe_actor_restarts_total (a counter).
    retired_restarts_ += actors_.at(id).info.restarts;
    requests_.erase(actors_.at(id).spec.request_id);
    actors_.erase(id);
    out_.evicted.push_back(id);
    if (write_through_) dirty_actors_.insert(id);
  }
}

void HeadState::kill_actor(uint64_t actor_id, bool no_restart, const std::string& why) {
  Actor& a = actor(actor_id);
  if (a.info.state == ActorState::kDead) return;
  // Killed for good already (e.g. its driver left, then its group went):
  // the first cause stands and the worker was told once.
  if (no_restart && a.kill_requested) return;
  if (no_restart) {
    a.kill_requested = true;
    a.info.death_cause = why;
    // As Ray's: once kill returns, get_actor no longer finds it and its
    // name may be taken again, while its worker is still being stopped.
    release_name(a);
  }
  if (a.worker_running) {
    // DEAD once the node reports the exit (or the node itself is lost).
    out_.kills.emplace_back(a.info.node_id, KillWorker{a.info.id, a.info.incarnation});
    a.kill_sent = a.info.incarnation;
  } else if (no_restart) {
    set_dead(a);  // no process: nothing to wait for
  }
}

void HeadState::kill_all(const std::string& why) {
  for (auto id : actor_ids_where([](const Actor& a) { return a.info.state != ActorState::kDead; }))
    if (actors_.count(id)) kill_actor(id, true, why);
}

// ---- placement of actors ----------------------------------------------------

std::optional<HeadState::Allocation> HeadState::allocate_in_group(const Actor& a, std::string* reason) {
  auto& g = groups_.at(a.spec.placement_group);
  // A group placing again the bundles a node took with it still holds the
  // others: an actor may start (or restart) in one of those.
  const bool placing = g.info.state == PlacementGroupState::kPending && !kept_bundles(g).empty();
  auto waiting = [&] {
    *reason = "waiting for placement group " + std::to_string(g.info.id) + ": " + g.info.pending_reason;
    return std::nullopt;
  };
  if (g.info.state != PlacementGroupState::kCreated && !placing) return waiting();
  for (size_t b = 0; b < g.bundles.size(); ++b) {
    if (a.spec.bundle_index >= 0 && static_cast<size_t>(a.spec.bundle_index) != b) continue;
    if (g.info.bundle_nodes[b] == 0) continue;  // lost with its node
    const Node& n = nodes_.at(g.info.bundle_nodes[b]);
    if (!g.bundles[b].fits(a.spec.resources) || n.awaiting || !n.info.alive) continue;
    return Allocation{g.info.bundle_nodes[b], g.info.id, b, g.epoch, g.bundles[b].take(a.spec.resources)};
  }
  // Waiting for the group only when what it asks for is still to be placed
  // (any bundle, or a lost one); a full kept bundle is said to be full.
  if (placing && (a.spec.bundle_index < 0 || g.info.bundle_nodes[static_cast<size_t>(a.spec.bundle_index)] == 0))
    return waiting();
  // Any bundle (index -1) was said as "bundle -1", which does not exist.
  *reason = (a.spec.bundle_index < 0
                 ? std::string("no bundle of placement group ") + std::to_string(g.info.id) + " has room for {"
                 : "bundle " + std::to_string(a.spec.bundle_index) + " of placement group " +
                       std::to_string(g.info.id) + " has no room for {") +
            format_resources(a.spec.resources) + "}";
  return std::nullopt;
}

std::optional<HeadState::Allocation> HeadState::allocate(const Actor& a, std::string* reason) {
  if (a.spec.placement_group) return allocate_in_group(a, reason);
  std::vector<NodeView> views;  // the actors placed on each break ties of load (SPREAD)
  for (const auto& [id, n] : nodes_)
    if (n.info.alive && !n.awaiting)
      views.push_back({id, n.pool.total(), n.pool.available(), n.pool.gpu_free(), n.placed});
  auto pick = pick_node(keeps_affinity(a.spec) ? affine_views(a.spec, views) : views, a.spec.resources, reason);
  if (!pick) return std::nullopt;
  return Allocation{*pick, 0, 0, 0, nodes_.at(*pick).pool.take(a.spec.resources)};
}

bool HeadState::keeps_affinity(const ActorSpec& spec) const {
  if (!spec.node_affinity) return false;
  if (!spec.affinity_soft) return true;
  // Soft, as Ray's: its node while that is alive and could ever hold it
  // (waiting there for room), else anywhere.
  auto it = nodes_.find(spec.node_affinity);
  return it != nodes_.end() && it->second.info.alive && fits(it->second.pool.total(), spec.resources);
}

bool HeadState::could_ever_hold(const Resources& req) const {
  for (const auto& [id, n] : nodes_)
    if (n.info.alive && fits(n.pool.total(), req)) return true;
  return false;
}

// Tries to give `a` a node; true when placed.
bool HeadState::try_place(Actor& a) {
  if (a.spec.placement_group) {
    auto git = groups_.find(a.spec.placement_group);
    if (git == groups_.end() || git->second.info.state == PlacementGroupState::kRemoved) {
      a.info.death_cause = placement_group_removed_cause(a.spec.placement_group);
      set_dead(a);
      return false;
    }
  }
  if (a.spec.node_affinity && !a.spec.affinity_soft) {
    auto it = nodes_.find(a.spec.node_affinity);
    if (it == nodes_.end() || !it->second.info.alive) {
      // Its node is gone (a restart after the node died): nowhere else.
      a.info.death_cause =
          "node " + std::to_string(a.spec.node_affinity) + " is dead, and the actor has a hard affinity to it";
      set_dead(a);
      return false;
    }
  }
  std::string reason;
  auto alloc = allocate(a, &reason);
  if (!alloc) {
    if (a.info.pending_reason != reason) {
      a.info.pending_reason = reason;
      // Waiting for a busy cluster is queueing, not a problem: a warning
      // only when no live node could hold the actor even when idle.
      const bool unplaceable = !a.spec.placement_group && !could_ever_hold(a.spec.resources);
      if (unplaceable && !a.warned_unplaceable)
        TROUPE_LOG_WARN("actor {} ({}) is {}: {}", a.info.id, a.info.class_name, to_string(a.info.state), reason);
      else
        TROUPE_LOG_INFO("actor {} ({}) is {}: {}", a.info.id, a.info.class_name, to_string(a.info.state), reason);
      a.warned_unplaceable = a.warned_unplaceable || unplaceable;
      publish(a);
    }
    return false;
  }
  start_worker(a, std::move(*alloc));
  return true;
}

void HeadState::start_worker(Actor& a, Allocation alloc) {
  mark(a);
  a.info.node_id = alloc.node_id;
  a.info.gpu_ids = alloc.grant.gpu_ids;
  a.info.pending_reason.clear();
  a.allocation = std::move(alloc);
  count_placed(*a.allocation, 1);
  a.worker_running = true;
  a.said_hello = false;
  SpawnWorker s;
  s.actor_id = a.info.id;
  s.incarnation = a.info.incarnation;
  s.executable = a.spec.executable;
  s.gpu_ids = a.info.gpu_ids;
  s.env = a.spec.env;
  s.class_name = a.info.class_name;
  out_.spawns.emplace_back(a.info.node_id, std::move(s));
  TROUPE_LOG_DEBUG("actor {} ({}) incarnation {} placed on node {}", a.info.id, a.info.class_name, a.info.incarnation,
                   a.info.node_id);
}

ResourcePool* HeadState::pool_of(const Allocation& al) {
  if (al.group_id) {
    auto git = groups_.find(al.group_id);
    // A reservation that was given up took the actor's share with it.
    // A kept bundle of a group placing its lost ones counts as well.
    if (git != groups_.end() && git->second.info.state != PlacementGroupState::kRemoved &&
        git->second.epoch == al.epoch && al.bundle < git->second.bundles.size() &&
        git->second.info.bundle_nodes[al.bundle] != 0)
      return &git->second.bundles[al.bundle];
    return nullptr;
  }
  auto it = nodes_.find(al.node_id);
  return it != nodes_.end() && it->second.info.alive ? &it->second.pool : nullptr;
}

void HeadState::count_placed(const Allocation& al, int delta) {
  if (al.group_id) return;
  auto it = nodes_.find(al.node_id);
  if (it == nodes_.end()) return;
  size_t& placed = it->second.placed;
  placed = delta > 0 ? placed + 1 : (placed > 0 ? placed - 1 : 0);
}

void HeadState::release(Actor& a) {
  if (!a.allocation) return;
  mark(a);
  count_placed(*a.allocation, -1);
  if (ResourcePool* pool = pool_of(*a.allocation)) {
    pool->reclaim(a.lent);  // the lent part is in the pool already
    pool->give_back(a.allocation->grant);
  }
  a.lent.clear();
  a.lenders = 0;
  a.info.blocked = false;
  a.allocation.reset();
  a.info.gpu_ids.clear();
}

void HeadState::lend_resources(const wire::LendResources& l, PeerId owner) {
  auto it = actors_.find(l.actor_id);
  if (it == actors_.end()) return;
  Actor& a = it->second;
  if (a.info.incarnation != l.incarnation || !a.allocation || (owner != 0 && owner != a.owner)) return;
  ResourcePool* pool = pool_of(*a.allocation);
  if (!pool) return;
  // The owner lends an idle executor it keeps, the worker lends while its
  // task waits, each on its own connection: when the owner gives the
  // executor a task whose first thing is to wait, the two tellings may come
  // in either order. The CPU is lent while either lends, taken back when
  // neither does (one slot for both took the owner's take-back for the end
  // of the worker's lend, and ignored the worker's lend: its task waited
  // with no CPU lent and was never known as blocked).
  const uint8_t who = owner ? kLentByOwner : kLentByWorker;
  if (!l.lend) {
    a.lenders &= static_cast<uint8_t>(~who);
    if (!a.lent.empty() && a.lenders == 0) {
      pool->reclaim(a.lent);
      TROUPE_LOG_DEBUG("actor {} took back {{{}}}", a.info.id, format_resources(a.lent));
      a.lent.clear();
    }
    if (owner == 0 && std::exchange(a.info.blocked, false)) return publish(a);
    mark(a);
    return;
  }
  if (a.info.state != ActorState::kAlive) return;
  auto cpu = a.allocation->grant.resources.find("CPU");
  if (cpu == a.allocation->grant.resources.end() || cpu->second <= 0) return;
  a.lenders |= who;
  if (a.lent.empty()) {
    a.lent = {{"CPU", cpu->second}};
    pool->give_back(Grant{a.lent, {}});
    TROUPE_LOG_DEBUG("actor {} lent {{{}}} ({})", a.info.id, format_resources(a.lent),
                     owner ? "idle, kept by its owner" : "its task waits");
  }
  // Its submitter hears that its task waits (and sends it no more).
  if (owner == 0 && !a.info.blocked) {
    a.info.blocked = true;
    publish(a);
  } else {
    mark(a);
  }
  schedule();
}

void HeadState::schedule() {
  std::deque<uint64_t> still;
  for (auto id : pending_groups_) {
    auto it = groups_.find(id);
    if (it == groups_.end() || it->second.info.state != PlacementGroupState::kPending) continue;
    if (!try_place_group(it->second)) still.push_back(id);
  }
  pending_groups_.swap(still);
  still.clear();
  for (auto id : pending_actors_) {
    auto it = actors_.find(id);
    if (it == actors_.end()) continue;
    Actor& a = it->second;
    if (a.info.state == ActorState::kDead || a.worker_running) continue;
    if (a.kill_requested) {
      set_dead(a);
      continue;
    }
    if (backing_off(a)) {
      still.push_back(id);  // backing off (restart_backoff); check_heartbeats places it when due
      continue;
    }
    a.not_before.reset();
    if (!try_place(a) && a.info.state != ActorState::kDead) still.push_back(id);
  }
  pending_actors_.swap(still);
}

bool HeadState::backing_off(const Actor& a) const {
  return a.not_before && (!last_check_ || *last_check_ < *a.not_before);
}

// Whether an actor or placement group waits for room that task executors
// hold: it would be placed if every task executor gave back what it holds
// (one idle in some process may be what it waits for). Demand that no
// executor's resources could meet (a GPU none holds, more than a node has)
// does not count: releasing executors for it would only cost their reuse.
bool HeadState::waits_for_room() const {
  if (pending_actors_.empty() && pending_groups_.empty()) return false;
  std::map<uint64_t, ResourcePool> nodes;
  for (const auto& [id, n] : nodes_)
    if (n.info.alive && !n.awaiting) nodes.emplace(id, n.pool);
  std::map<std::pair<uint64_t, size_t>, ResourcePool> bundles;
  // Every bundle a group holds (a PENDING one's kept bundles too).
  for (const auto& [id, g] : groups_)
    if (g.info.state != PlacementGroupState::kRemoved)
      for (size_t b = 0; b < g.bundles.size(); ++b)
        if (g.info.bundle_nodes[b] != 0) bundles.emplace(std::pair{id, b}, g.bundles[b]);
  bool held = false;
  for (const auto& [id, a] : actors_) {
    if (a.spec.type_key != client::kTaskExecutorKey || !a.allocation || a.info.state == ActorState::kDead) continue;
    const Allocation& al = *a.allocation;
    ResourcePool* pool = nullptr;
    if (al.group_id == 0) {
      if (auto it = nodes.find(al.node_id); it != nodes.end()) pool = &it->second;
    } else if (auto g = groups_.find(al.group_id); g != groups_.end() && g->second.epoch == al.epoch) {
      if (auto it = bundles.find({al.group_id, al.bundle}); it != bundles.end()) pool = &it->second;
    }
    if (!pool) continue;
    pool->reclaim(a.lent);  // as release() does
    pool->give_back(al.grant);
    held = true;
  }
  if (!held) return false;
  std::vector<NodeView> views;
  for (const auto& [id, p] : nodes) views.push_back({id, p.total(), p.available(), p.gpu_free()});
  for (auto id : pending_actors_) {
    auto it = actors_.find(id);
    if (it == actors_.end()) continue;
    const Actor& a = it->second;
    if (a.info.state == ActorState::kDead || a.worker_running || a.kill_requested || backing_off(a)) continue;
    if (a.spec.placement_group == 0) {
      if (pick_node(keeps_affinity(a.spec) ? affine_views(a.spec, views) : views, a.spec.resources, nullptr))
        return true;
      continue;
    }
    for (const auto& [key, pool] : bundles)
      if (key.first == a.spec.placement_group &&
          (a.spec.bundle_index < 0 || key.second == static_cast<size_t>(a.spec.bundle_index)) &&
          pool.fits(a.spec.resources))
        return true;
  }
  for (auto id : pending_groups_)
    if (auto it = groups_.find(id);
        it != groups_.end() && it->second.info.state == PlacementGroupState::kPending &&
        place_bundles(views, it->second.spec.bundles, it->second.spec.strategy, nullptr, kept_bundles(it->second)))
      return true;
  return false;
}

void HeadState::update_resources_wanted() {
  const bool wanted = waits_for_room();
  if (wanted == resources_wanted_) return;
  resources_wanted_ = wanted;
  if (wanted) {
    for (const auto& [id, a] : actors_)
      if (a.info.state != ActorState::kDead) tell_resources_wanted(a.owner);
  } else {
    for (PeerId p : told_wanted_) out_.resources_wanted.emplace_back(p, false);
    told_wanted_.clear();
  }
}

void HeadState::tell_resources_wanted(PeerId owner, bool again) {
  if (resources_wanted_ && owner != 0 && (told_wanted_.insert(owner).second || again))
    out_.resources_wanted.emplace_back(owner, true);
}

// ---- placement groups -------------------------------------------------------

HeadState::Group& HeadState::group(uint64_t id) {
  auto it = groups_.find(id);
  if (it == groups_.end()) throw ConfigError("no placement group with id " + std::to_string(id));
  return it->second;
}

const PlacementGroupInfo& HeadState::placement_group(uint64_t id) const {
  auto it = groups_.find(id);
  if (it == groups_.end()) throw ConfigError("no placement group with id " + std::to_string(id));
  return it->second.info;
}

PlacementGroupInfo HeadState::create_placement_group(PeerId owner, PlacementGroupSpec spec) {
  if (spec.bundles.empty()) throw ConfigError("a placement group needs at least one bundle");
  for (size_t i = 0; i < spec.bundles.size(); ++i)
    validate_resources(spec.bundles[i], "placement group bundle " + std::to_string(i));
  // Asked again (no answer came in time): the group the first ask made. A
  // scan: groups are few, and made seldom.
  if (spec.request_id != 0)
    for (const auto& [id, g] : groups_)
      if (g.spec.request_id == spec.request_id) return g.info;
  Group g;
  g.info.id = next_group_id_++;
  g.spec = std::move(spec);
  // A detached group has no owner: no one's exit removes it.
  if (!g.spec.detached) {
    g.owner = owner;
    if (auto c = clients_.find(owner); c != clients_.end()) g.owner_client = c->second;
    job_owns(g);
  }
  uint64_t id = g.info.id;
  groups_[id] = std::move(g);
  pending_groups_.push_back(id);
  schedule();
  return groups_.at(id).info;
}

// A group made inside a task or an actor is its job's, as Ray's: owned by
// the driver its creator's owners lead to, while that driver is connected.
// Owned by the worker, it went with the worker's process (a task executor
// released when idle, an actor that restarted), and so did everything
// placed in it. A detached actor on the way keeps it the worker's (the
// actor outlives its job).
void HeadState::job_owns(Group& g) {
  auto w = worker_clients_.find(g.owner_client);
  if (w == worker_clients_.end()) return;  // a driver's own
  auto a = actors_.find(w->second.first);
  if (a == actors_.end() || a->second.spec.detached) return;
  const uint64_t client = driver_of(a->second, /*through_detached=*/false);
  if (client == 0 || worker_clients_.count(client)) return;
  for (const auto& [peer, id] : clients_)
    if (id == client) {
      g.owner = peer;
      g.owner_client = client;
      return;
    }
}

bool HeadState::try_place_group(Group& g) {
  std::vector<NodeView> views;
  for (const auto& [id, n] : nodes_)
    if (n.info.alive && !n.awaiting) views.push_back({id, n.pool.total(), n.pool.available(), n.pool.gpu_free()});
  std::string reason;
  const auto kept = kept_bundles(g);
  auto placed = place_bundles(views, g.spec.bundles, g.spec.strategy, &reason, kept);
  if (!placed) {
    if (g.info.pending_reason != reason) {
      g.info.pending_reason = reason;
      // As for actors: a warning only when the live nodes, idle, could not
      // hold it either.
      if (could_ever_place(g) || std::exchange(g.warned, true))
        TROUPE_LOG_INFO("placement group {} ({} bundles, {}) is PENDING: {}", g.info.id, g.spec.bundles.size(),
                        to_string(g.spec.strategy), reason);
      else
        TROUPE_LOG_WARN("placement group {} ({} bundles, {}) is PENDING: {}", g.info.id, g.spec.bundles.size(),
                        to_string(g.spec.strategy), reason);
    }
    return false;
  }
  g.info.bundle_nodes = *placed;
  // A new epoch voids allocations in the bundles that were lost (a share
  // given back late must not land in the bundle placed in their stead);
  // the actors in kept bundles move to it with theirs.
  g.epoch++;
  for (auto& [aid, a] : actors_)
    if (a.allocation && a.allocation->group_id == g.info.id && a.allocation->bundle < kept.size() &&
        kept[a.allocation->bundle] != 0) {
      a.allocation->epoch = g.epoch;
      mark(a);
    }
  g.reserved.resize(g.spec.bundles.size());
  g.bundles.resize(g.spec.bundles.size());
  // In the order place_bundles planned them, so every take fits.
  for (size_t b : placement_order(g.spec.bundles)) {
    if (b < kept.size() && kept[b] != 0) continue;
    Grant grant = nodes_.at(g.info.bundle_nodes[b]).pool.take(g.spec.bundles[b]);
    g.bundles[b] = ResourcePool(grant.resources, grant.gpu_ids);
    g.reserved[b] = std::move(grant);
  }
  g.info.state = PlacementGroupState::kCreated;
  g.info.pending_reason.clear();
  TROUPE_LOG_INFO("placement group {} created ({}): bundles on nodes {}", g.info.id, to_string(g.spec.strategy),
                  nlohmann::json(g.info.bundle_nodes).dump());
  out_.groups_settled.push_back(g.info);
  return true;
}

bool HeadState::could_ever_place(const Group& g) const {
  std::vector<NodeView> idle;
  for (const auto& [id, n] : nodes_)
    if (n.info.alive && !n.awaiting) {
      idle.push_back({id, n.pool.total(), n.pool.total(), n.pool.gpu_free()});
      std::fill(idle.back().gpu_free.begin(), idle.back().gpu_free.end(), 1.0);
    }
  return place_bundles(idle, g.spec.bundles, g.spec.strategy, nullptr).has_value();
}

std::vector<uint64_t> HeadState::kept_bundles(const Group& g) {
  if (g.reserved.size() != g.spec.bundles.size()) return {};
  return g.info.bundle_nodes;
}

void HeadState::lose_bundles(Group& g, uint64_t node) {
  for (size_t b = 0; b < g.info.bundle_nodes.size(); ++b) {
    if (g.info.bundle_nodes[b] != node) continue;
    // The node's pool went with it: nothing to give back.
    if (b < g.reserved.size()) g.reserved[b] = Grant{};
    if (b < g.bundles.size()) g.bundles[b] = ResourcePool{};
    g.info.bundle_nodes[b] = 0;
    for (auto& [id, a] : actors_)
      if (a.allocation && a.allocation->group_id == g.info.id && a.allocation->bundle == b) {
        mark(a);
        a.allocation.reset();
        a.info.gpu_ids.clear();
      }
  }
  if (g.info.state == PlacementGroupState::kCreated) {
    g.info.state = PlacementGroupState::kPending;
    pending_groups_.push_back(g.info.id);
  }
  g.info.pending_reason = "bundles lost with node " + std::to_string(node) + " are placed again";
}

// Gives the whole reservation back to the live nodes; the actors' shares in
// it go with it (their allocations become void).
void HeadState::unreserve_group(Group& g) {
  for (size_t b = 0; b < g.reserved.size(); ++b) {
    auto it = nodes_.find(g.info.bundle_nodes[b]);
    if (it != nodes_.end() && it->second.info.alive) it->second.pool.give_back(g.reserved[b]);
  }
  for (auto& [id, a] : actors_)
    if (a.allocation && a.allocation->group_id == g.info.id) {
      mark(a);
      a.allocation.reset();
      a.info.gpu_ids.clear();
    }
  g.reserved.clear();
  g.bundles.clear();
  g.info.bundle_nodes.assign(g.spec.bundles.size(), 0);
}

// `a`, whose group's bundles went back to their nodes, holds `al`'s grant
// of its node's pool instead, lent part and all, until release().
void HeadState::hold_on_node(Actor& a, Allocation al) {
  auto n = nodes_.find(al.node_id);
  if (n == nodes_.end() || !n->second.info.alive) return;
  try {
    n->second.pool.retake(al.grant);
  } catch (const ConfigError& e) {  // never expected: the bundle just gave it back
    TROUPE_LOG_WARN("actor {}: its share of a removed group cannot be held on node {}: {}", a.info.id, al.node_id,
                    e.what());
    return;
  }
  if (!a.lent.empty()) n->second.pool.give_back(Grant{a.lent, {}});
  al.group_id = 0;
  al.bundle = 0;
  al.epoch = 0;
  a.info.gpu_ids = al.grant.gpu_ids;
  a.allocation = std::move(al);
  count_placed(*a.allocation, 1);
  mark(a);
}

void HeadState::remove_placement_group(uint64_t id) {
  Group& g = group(id);
  if (g.info.state == PlacementGroupState::kRemoved) return;
  // Kill first: the workers keep running until their exit is reported.
  // Until then each keeps what it holds of its bundle, as a killed actor
  // outside a group keeps its resources: its part (its GPU ids among it)
  // goes back to the node held by it, and is free only at its exit. (It
  // went back free with the bundle: a new actor got the GPU of a worker
  // still running on it, and ran out of device memory.)
  for (auto aid : actor_ids_where([&](const Actor& a) { return a.spec.placement_group == id; }))
    if (actors_.count(aid)) kill_actor(aid, true, placement_group_removed_cause(id));
  std::vector<std::pair<uint64_t, Allocation>> held;
  for (const auto& [aid, a] : actors_)
    if (a.allocation && a.allocation->group_id == id && a.worker_running && pool_of(*a.allocation))
      held.emplace_back(aid, *a.allocation);
  if (!g.reserved.empty()) unreserve_group(g);  // a PENDING group may keep some bundles
  for (auto& [aid, al] : held) hold_on_node(actors_.at(aid), al);
  g.info.state = PlacementGroupState::kRemoved;
  g.info.pending_reason.clear();  // it waits for nothing now
  out_.groups_settled.push_back(g.info);
  removed_groups_order_.push_back(id);
  forget_oldest(groups_, removed_groups_order_, config_.max_removed_groups);
  schedule();
}

// ---- KV ---------------------------------------------------------------------

void HeadState::kv_set(const std::string& key, const std::string& value) {
  if (kv_.insert_or_assign(key, value).second) kv_added(key);
  if (write_through_) dirty_kv_.insert(key);
  out_.kv_set.push_back({key, value});
}

void HeadState::kv_put(const std::string& key, const std::string& value) {
  // A worker's last stats may land after its actor died (or was restarted)
  // and its numbers were retired: dropped (at most its last second's
  // calls), so no key outlives its process and nothing counts twice.
  const std::string prefix = client::kStatsKeyPrefix;
  if (key.compare(0, prefix.size(), prefix) == 0) {
    const char* p = key.c_str() + prefix.size();
    char* dot = nullptr;
    const uint64_t id = std::strtoull(p, &dot, 10);
    const auto inc = static_cast<uint32_t>(dot && *dot == '.' ? std::strtoul(dot + 1, nullptr, 10) : 0);
    auto it = actors_.find(id);
    if (it == actors_.end() || it->second.info.state == ActorState::kDead || inc < it->second.info.incarnation) return;
  }
  if (!scoped_key_allowed(key)) return;
  kv_set(key, value);
  if (key.rfind(kJobKeyPrefix, 0) == 0) trim_jobs();
}

// A job document that is not a running job's: ended, not a document, over
// the size a status reads, or running with its driver gone (a killed
// driver's job, which status shows as lost: its document said "running"
// for ever and was never trimmed, and every job's put parsed it again).
bool HeadState::job_document_spent(const std::string& value) const {
  if (value.size() > kMaxJobDocument) return true;
  auto doc = nlohmann::json::parse(value, nullptr, /*allow_exceptions=*/false);
  if (!doc.is_object() || doc.value("state", nlohmann::json()) != "running") return true;
  const auto driver = doc.find("driver_key");
  return driver != doc.end() && driver->is_string() && !kv_.count(driver->get<std::string>());
}

void HeadState::trim_jobs() {
  while (job_keys_.size() > kMaxJobDocuments) {
    auto ended = std::find_if(job_keys_.begin(), job_keys_.end(),
                              [&](const std::string& key) { return job_document_spent(kv_.at(key)); });
    if (ended == job_keys_.end()) return;
    kv_erase(std::string(*ended));
  }
}

namespace {

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// A key under troupe.actor/<id>/ or troupe.client/<id>/ (client/actor_keys.h).
struct ScopedKey {
  bool actor = false;
  uint64_t id = 0;
  bool well_formed = false;           // <prefix><digits>/...
  std::optional<std::string> target;  // of <prefix><id>/ref/<target>
};

std::optional<ScopedKey> scoped(const std::string& key) {
  ScopedKey k;
  k.actor = starts_with(key, client::kActorKeyPrefix);
  if (!k.actor && !starts_with(key, client::kClientKeyPrefix)) return std::nullopt;
  const char* digits = key.c_str() + std::strlen(k.actor ? client::kActorKeyPrefix : client::kClientKeyPrefix);
  char* end = nullptr;
  k.id = std::strtoull(digits, &end, 10);
  k.well_formed = end != digits && *end == '/' && *digits >= '0' && *digits <= '9';
  if (k.well_formed && std::strncmp(end + 1, client::kRefInfix, std::strlen(client::kRefInfix)) == 0)
    k.target = std::string(end + 1 + std::strlen(client::kRefInfix));
  return k;
}

// A reference's target may not be, or hold, a scoped key: erasing it would
// erase references and keys that other rules keep.
bool target_allowed(const std::string& t) {
  auto overlaps = [&](const char* prefix) {
    const std::string p = prefix;
    return t.compare(0, p.size(), p) == 0 || p.compare(0, t.size(), t) == 0;
  };
  return !t.empty() && !overlaps(client::kActorKeyPrefix) && !overlaps(client::kClientKeyPrefix);
}

}  // namespace

bool HeadState::scoped_key_allowed(const std::string& key) const {
  // A key that lives as long as its actor or client is made only for one
  // that is there, and only in that form: nothing would erase it otherwise.
  const auto k = scoped(key);
  if (!k) return true;
  if (!k->well_formed || (k->target && !target_allowed(*k->target))) return false;
  if (k->target && !ref_counts_.count(*k->target)) {
    // A new target may not hold, or be held by, another one: the erasure of
    // one would take keys the other's references keep. Live targets never
    // nest, so a live prefix of `t` would be the greatest target below it
    // (one between them would start with that prefix too): two look-ups,
    // whatever the key's length.
    const std::string& t = *k->target;
    auto next = ref_counts_.lower_bound(t);
    if (next != ref_counts_.end() && next->first.compare(0, t.size(), t) == 0) return false;
    if (next != ref_counts_.begin()) {
      const std::string& below = std::prev(next)->first;
      if (t.compare(0, below.size(), below) == 0) return false;
    }
  }
  if (k->actor) {
    auto it = actors_.find(k->id);
    return it != actors_.end() && it->second.info.state != ActorState::kDead;
  }
  if (awaited_owners_.count(k->id)) return true;
  for (const auto& [peer, id] : clients_)
    if (id == k->id) return true;
  return false;
}

namespace {

// The target of `key` if it is a reference counted as one (a put checks
// more; a restore brings back what an earlier head let in).
std::optional<std::string> counted_target(const std::string& key) {
  auto k = scoped(key);
  if (!k || !k->well_formed || !k->target || !target_allowed(*k->target)) return std::nullopt;
  return k->target;
}

}  // namespace

void HeadState::kv_added(const std::string& key) {
  if (auto t = counted_target(key)) ++ref_counts_[*t];
  if (starts_with(key, kJobKeyPrefix)) job_keys_.push_back(key);
}

void HeadState::kv_removed(const std::string& key) {
  if (starts_with(key, kJobKeyPrefix))
    if (auto it = std::find(job_keys_.begin(), job_keys_.end(), key); it != job_keys_.end()) job_keys_.erase(it);
  auto t = counted_target(key);
  if (!t) return;
  auto it = ref_counts_.find(*t);
  if (it == ref_counts_.end() || --it->second > 0) return;
  ref_counts_.erase(it);
  TROUPE_LOG_DEBUG("kv: the last reference to '{}' went; its keys go", *t);
  kv_erase_prefix(*t);
}

void HeadState::client_gone(uint64_t client_id) { kv_erase_prefix(client::client_key_prefix(client_id)); }

void HeadState::kv_erase_prefix(const std::string& prefix) {
  std::vector<std::string> erased;
  for (auto it = kv_.lower_bound(prefix); it != kv_.end() && it->first.compare(0, prefix.size(), prefix) == 0;) {
    if (write_through_) dirty_kv_.insert(it->first);
    erased.push_back(it->first);
    it = kv_.erase(it);
  }
  // After the walk: a last reference's target is erased in turn.
  for (const auto& key : erased) kv_removed(key);
}

std::vector<std::pair<std::string, std::string>> HeadState::kv_with_prefix(const std::string& prefix) const {
  std::vector<std::pair<std::string, std::string>> out;
  for (auto it = kv_.lower_bound(prefix); it != kv_.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it)
    out.emplace_back(it->first, it->second);
  return out;
}

void HeadState::retire_stats(uint64_t actor_id, uint32_t incarnation) {
  const std::string prefix = std::string(client::kStatsKeyPrefix) + std::to_string(actor_id) + ".";
  for (auto it = kv_.lower_bound(prefix); it != kv_.end() && it->first.compare(0, prefix.size(), prefix) == 0;) {
    uint64_t calls = 0, bytes = 0;
    const auto inc = std::strtoull(it->first.c_str() + prefix.size(), nullptr, 10);
    if (inc >= incarnation) {
      ++it;
      continue;
    }
    if (client::parse_stats(it->second, &calls, &bytes)) {
      retired_calls_ += calls;
      retired_stream_bytes_ += bytes;
    }
    if (write_through_) dirty_kv_.insert(it->first);  // or the store brings it back after a restart
    it = kv_.erase(it);
  }
}

// A worker's counters as it left them (its agent read them after the exit):
// they replace what it last published, unless that was more (the page and
// the publication count the same calls, so the larger is the later).
void HeadState::last_stats(uint64_t actor_id, uint32_t incarnation, uint64_t calls, uint64_t stream_bytes) {
  const std::string key =
      std::string(client::kStatsKeyPrefix) + std::to_string(actor_id) + "." + std::to_string(incarnation);
  uint64_t had_calls = 0, had_bytes = 0;
  if (auto it = kv_.find(key); it != kv_.end()) client::parse_stats(it->second, &had_calls, &had_bytes);
  if (calls <= had_calls && stream_bytes <= had_bytes) return;
  kv_set(key, client::format_stats(std::max(calls, had_calls), std::max(stream_bytes, had_bytes)));
}

std::pair<uint64_t, uint64_t> HeadState::worker_stats() const {
  uint64_t calls = retired_calls_, bytes = retired_stream_bytes_;
  const std::string prefix = client::kStatsKeyPrefix;
  for (auto it = kv_.lower_bound(prefix); it != kv_.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it) {
    uint64_t c = 0, b = 0;
    if (client::parse_stats(it->second, &c, &b)) {
      calls += c;
      bytes += b;
    }
  }
  return {calls, bytes};
}

std::optional<std::string> HeadState::kv_get(const std::string& key) const {
  auto it = kv_.find(key);
  if (it == kv_.end()) return std::nullopt;
  return it->second;
}

void HeadState::kv_erase(const std::string& key) {
  if (!kv_.erase(key)) return;
  if (write_through_) dirty_kv_.insert(key);
  kv_removed(key);
}

int64_t HeadState::kv_add(const std::string& key, int64_t delta) {
  if (!scoped_key_allowed(key))
    throw ConfigError("kv add: key '" + key +
                      "' is not troupe.actor/<id>/... of an actor that is not dead, or troupe.client/<id>/... of "
                      "a connected client, or it is a reference (.../ref/<target>) to a target that overlaps "
                      "those");
  int64_t v = 0;
  if (auto it = kv_.find(key); it != kv_.end()) {
    const std::string& s = it->second;
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || end != s.data() + s.size())
      throw ConfigError("kv add: key '" + key + "' holds a non-integer value");
  }
  // Values come from clients: a sum past int64 is refused, not wrapped.
  int64_t sum = 0;
  if (__builtin_add_overflow(v, delta, &sum))
    throw ConfigError("kv add: key '" + key + "' holds " + std::to_string(v) + "; adding " + std::to_string(delta) +
                      " overflows a 64-bit integer");
  kv_set(key, std::to_string(sum));
  return sum;
}

// ---- queries ----------------------------------------------------------------

std::vector<NodeInfo> HeadState::nodes() const {
  std::vector<NodeInfo> v;
  for (const auto& [id, n] : nodes_) {
    NodeInfo i = n.info;
    i.total = n.pool.total();
    i.available = n.pool.available();
    i.used = n.pool.used();
    i.gpu_ids = n.pool.gpu_ids();
    i.free_gpu_ids = n.pool.free_gpus();
    v.push_back(std::move(i));
  }
  return v;
}

nlohmann::json HeadState::actors_json(const StatusRequest& request, size_t* matching) const {
  std::vector<const Actor*> shown;
  for (const auto& [id, a] : actors_) {
    if (!request.state.empty() && request.state != to_string(a.info.state)) continue;
    if (request.driver == 0 || request.driver == driver_of(a)) shown.push_back(&a);
  }
  *matching = shown.size();
  if (request.limit && shown.size() > request.limit) shown.erase(shown.begin(), shown.end() - request.limit);
  auto j = nlohmann::json::array();
  for (const Actor* actor : shown) {
    const ActorInfo* a = &actor->info;
    j.push_back({{"id", a->id},
                 {"class", a->class_name},
                 {"name", a->name},
                 {"state", to_string(a->state)},
                 {"node", a->node_id},
                 {"pid", a->pid},
                 {"address", a->address},
                 {"restarts", a->restarts},
                 {"max_restarts", a->max_restarts},
                 {"pending_reason", a->pending_reason},
                 {"death_cause", a->death_cause},
                 {"driver", driver_of(*actor)}});
  }
  return j;
}

uint64_t HeadState::driver_of(const Actor& a, bool through_detached) const {
  uint64_t client = a.owner_client ? a.owner_client : a.creator_client;
  // Bounded: owners form a tree, but a table restored half-way must not
  // loop.
  for (int depth = 0; depth < 64; ++depth) {
    auto w = worker_clients_.find(client);
    if (w == worker_clients_.end()) return client;
    auto owner = actors_.find(w->second.first);
    if (owner == actors_.end() || (!through_detached && owner->second.spec.detached)) return 0;
    client = owner->second.owner_client ? owner->second.owner_client : owner->second.creator_client;
  }
  return 0;
}

nlohmann::json HeadState::status(const StatusRequest& request) const {
  using nlohmann::json;
  static const std::vector<std::string> kStates = {"PENDING", "ALIVE", "RESTARTING", "DEAD"};
  if (!request.state.empty() && std::find(kStates.begin(), kStates.end(), request.state) == kStates.end())
    throw ConfigError("status: unknown actor state '" + request.state + "' (PENDING, ALIVE, RESTARTING or DEAD)");
  json j;
  j["nodes"] = json::array();
  // A dead node's pool stays as it was when the node died (nothing is
  // placed there again), but nothing on it runs: it shows nothing in use,
  // and no idle workers (its last heartbeat's count stayed).
  for (const auto& n : nodes())
    j["nodes"].push_back({{"id", n.id},
                          {"hostname", n.hostname},
                          {"address", n.address},
                          {"pid", n.pid},
                          {"alive", n.alive},
                          {"total", n.total},
                          {"used", n.alive ? json(n.used) : json::object()},
                          {"idle_workers", n.alive ? n.idle_workers : 0}});
  size_t matching = 0;
  j["actors"] = actors_json(request, &matching);
  j["actors_matching"] = matching;  // more than "actors" holds when --limit cut the list
  j["actors_total"] = actors_.size();
  uint64_t restarts = retired_restarts_;
  for (const auto& [id, a] : actors_) restarts += a.info.restarts;
  j["actor_restarts_total"] = restarts;  // of every actor, those evicted included
  j["placement_groups"] = json::array();
  for (const auto& [id, g] : groups_)
    j["placement_groups"].push_back({{"id", id},
                                     {"name", g.spec.name},
                                     {"strategy", to_string(g.spec.strategy)},
                                     {"state", to_string(g.info.state)},
                                     {"bundles", g.spec.bundles},
                                     {"bundle_nodes", g.info.bundle_nodes},
                                     {"pending_reason", g.info.pending_reason}});
  j["kv_keys"] = kv_.size();
  j["tables"] = {{"actors", actors_.size()},
                 {"dead_actors", dead_order_.size() + dead_routine_.size()},
                 {"nodes", nodes_.size()},
                 {"dead_nodes", dead_nodes_order_.size()},
                 {"placement_groups", groups_.size()},
                 {"removed_groups", removed_groups_order_.size()},
                 {"named_actors", named_.size()},
                 {"kv_keys", kv_.size()},
                 {"kv_ref_targets", ref_counts_.size()},
                 {"pending_actors", pending_actors_.size()},
                 {"pending_groups", pending_groups_.size()}};
  return j;
}

}  // namespace troupe::head
