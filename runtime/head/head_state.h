// HeadState: the head's tables and every decision made on them, as a pure
// object. It owns the nodes (with their ResourcePool), the actors (spec,
// state, restarts, where they run), the placement groups (bundle pools),
// named actors and the KV store. It has no sockets, clocks or threads: the
// server (Head) names each connection by a PeerId, passes the time in, calls
// one method per message, and then carries out what take_outputs() returns
// (workers to spawn or kill, actor updates to publish, waiters to answer).
// That makes every transition testable deterministically
// (tests/runtime/head_state_test.cc).
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "troupe/runtime/core/heartbeat.h"
#include "troupe/runtime/head/resource_pool.h"
#include "troupe/runtime/wire/protocol.h"

namespace troupe::head {

// The cause of death of an actor killed with no reason given (KillActor's
// `why` empty): what the task pool's release of an idle executor says.
inline constexpr const char* kKilledByRequest = "killed by request";

// The server's name for one connection (0 = none).
using PeerId = uint64_t;
using Time = std::chrono::steady_clock::time_point;

struct HeadConfig {
  uint32_t heartbeat_ms = core::kHeartbeatMs;          // nodes heartbeat this often
  uint32_t heartbeat_misses = core::kHeartbeatMisses;  // silent for this many intervals = dead
  size_t max_dead_actors = 1000;                       // DEAD actors kept for status; oldest go first
  // Dead nodes and removed placement groups kept for status (and for late
  // lookups); the oldest are forgotten first. A fenced node that joins
  // again is a new node, so dead nodes add up on a long-running cluster.
  size_t max_dead_nodes = 100;
  size_t max_removed_groups = 1000;
  // How long a driver or worker whose connection dropped without a goodbye
  // keeps what it owns (its actors, groups and keys) to come back on a new
  // connection (0: it is gone at once). A durable head sets it, since its
  // clients reconnect (HeadOptions::restore_grace).
  std::chrono::milliseconds client_grace{0};
};

// What the server must do after a HeadState call.
struct HeadOutputs {
  std::vector<std::pair<uint64_t, wire::SpawnWorker>> spawns;  // node id, worker
  std::vector<std::pair<uint64_t, wire::KillWorker>> kills;    // node id, worker
  std::vector<wire::ActorInfo> updates;                        // publish to the actor's subscribers
  std::vector<uint64_t> evicted;                               // actors forgotten: drop their subscribers
  std::vector<wire::PlacementGroupInfo> groups_settled;        // no longer PENDING: answer waiters
  std::vector<wire::KvEntry> kv_set;                           // answer waiters on the key
  std::vector<std::pair<uint64_t, std::string>> dead_nodes;    // node id, why: close its connection
  std::vector<std::pair<PeerId, bool>> resources_wanted;       // tell an owner: ResourcesWanted
};

class HeadState {
 public:
  // Ended TrainJob documents kept (running ones are never erased).
  static constexpr size_t kMaxJobDocuments = 100;
  // The largest job document a status parses (a buggy writer's 15 MB one
  // stalled the head past the nodes' lease on every poll).
  static constexpr size_t kMaxJobDocument = 1 << 20;

  explicit HeadState(HeadConfig config = {});

  // ---- nodes ----
  // A node agent said hello on `peer`; returns its node id.
  uint64_t register_node(PeerId peer, const wire::Hello& hello, Time now);
  void heartbeat(uint64_t node_id, Time now, const wire::NodeHeartbeat& report = {});
  // Declares dead every node silent for heartbeat_ms * heartbeat_misses.
  // Silence counts only while the head was checking: the time a call comes
  // later than heartbeat_ms after the one before is the head's own stall
  // (starved of CPU, stopped, its loop blocked), with heartbeats perhaps
  // unread in its sockets, and does not count against any node.
  void check_heartbeats(Time now);
  // `left`: its agent said it is stopping (logged as routine, not as a
  // failure).
  void node_lost(uint64_t node_id, const std::string& why, bool left = false);
  // The connection `peer` closed: its node (if it is one) is dead and the
  // actors and groups it owns are killed / removed. With `may_return` (the
  // client did not say goodbye, and the head did not close it) and a
  // client_grace, a client gets client_grace from `now` to come back to
  // what it owns, and a node agent the heartbeat limit from its last
  // heartbeat to come back as the node it was (resume_node).
  void peer_gone(PeerId peer, const std::string& reason, bool may_return = false, Time now = {});
  // Live node ids (the server tells them to shut down).
  std::vector<uint64_t> live_nodes() const;
  // The head is stopping on purpose (troupe stop, SIGTERM, an embedded
  // cluster's shutdown): the nodes it loses from now on go with it, which is
  // logged at debug, not warned about.
  void stopping() { stopping_ = true; }

  // ---- actors ----
  wire::ActorInfo create_actor(PeerId owner, wire::ActorSpec spec);
  // The worker of (actor, incarnation) said hello: its spec and info.
  wire::HelloReply worker_hello(uint64_t actor_id, uint32_t incarnation);
  const wire::ActorInfo& actor_info(uint64_t actor_id) const;
  // The node and pid of the worker whose log `troupe logs ACTOR` reads: the
  // actor's worker, or its last one when it has none now (dead, or waiting
  // to restart); pid 0 when no worker of it has run (ConfigError naming an
  // unknown id).
  // With `previous`: the worker before its current one, whose log a
  // follower that saw the actor restart finishes reading (pid 0: none).
  std::pair<uint64_t, int32_t> actor_log_source(uint64_t actor_id, bool previous = false) const;
  // The live actor registered under `name`; ConfigError when none.
  const wire::ActorInfo& named_actor(const std::string& name) const;
  void kill_actor(uint64_t actor_id, bool no_restart, const std::string& why);
  void actor_ready(const wire::ActorReady& r);
  void actor_init_failed(const wire::ActorInitFailed& f);
  // From node `from_node`'s agent: a report about a worker of another
  // node (a buggy agent's) is ignored, saying so.
  void worker_exited(const wire::WorkerExited& w, uint64_t from_node);
  // A task executor's task blocks in get() (lend) or resumes: its CPU goes
  // back to its node's (or bundle's) pool meanwhile and is taken back on
  // resume, over what is free if need be. Stale incarnations, unknown
  // actors and a second lend are ignored. `owner`: 0 when the actor's
  // worker sends it; else the sender, which must own the actor (a
  // submitter lending an idle executor it keeps for its objects).
  void lend_resources(const wire::LendResources& l, PeerId owner = 0);
  // Kills every actor for good (cluster shutdown).
  void kill_all(const std::string& why);
  // True while the actor keeps its constructor arguments (a restart may need them).
  bool holds_ctor_args(uint64_t actor_id) const;
  size_t actor_count() const { return actors_.size(); }

  // ---- placement groups ----
  wire::PlacementGroupInfo create_placement_group(PeerId owner, wire::PlacementGroupSpec spec);
  const wire::PlacementGroupInfo& placement_group(uint64_t id) const;
  void remove_placement_group(uint64_t id);

  // ---- KV ----
  void kv_put(const std::string& key, const std::string& value);
  std::optional<std::string> kv_get(const std::string& key) const;
  void kv_erase(const std::string& key);
  int64_t kv_add(const std::string& key, int64_t delta);
  // Every (key, value) whose key starts with `prefix`, in key order.
  std::vector<std::pair<std::string, std::string>> kv_with_prefix(const std::string& prefix) const;
  // Calls served and stream bytes received by every worker so far: the
  // workers' published numbers (client/process_stats.h) plus those of
  // processes that ended.
  std::pair<uint64_t, uint64_t> worker_stats() const;

  // ---- queries ----
  std::vector<wire::NodeInfo> nodes() const;
  // The status document of `troupe status` (without the head's address).
  nlohmann::json status(const wire::StatusRequest& request) const;

  // What to send since the last call; clears it.
  HeadOutputs take_outputs();

  // ---- write-through (head_state_rows.cc; Head keeps the rows in SQLite) ----
  // Rows are "a/<id>" (actor), "g/<id>" (group), "n/<id>" (node), "k/<key>"
  // (KV) and "m/counters", each a Codec-encoded record.
  using Row = std::pair<std::string, std::optional<std::string>>;  // no value: delete the row
  // The rows' format. Bump it whenever a row's record (or the meaning of
  // its fields) changes: a head refuses a state file of another format by
  // name instead of misreading it. HeadStateTest.RowFormatIsKnown trips
  // when the encoded rows change and the number did not.
  static constexpr int kRowFormat = 8;
  // The oldest format this head reads as well: its rows mean the same here
  // (8 only added meaning: a PENDING group may hold bundles it kept when a
  // node took others with it, which a format-7 head would not count).
  static constexpr int kOldestReadableRowFormat = 7;
  // Turns change tracking on; every row is due at the next take_rows.
  void enable_write_through();
  // The rows changed since the last call (all of them the first time).
  std::vector<Row> take_rows();
  // A restarted head: loads the rows an earlier one wrote, before anyone
  // connects. Its nodes (live then) and the processes that owned actors
  // and groups get until now + grace to come back (resume_node,
  // bind_client); a node that does not is dead, and what an owner that
  // does not owned is killed, as if they had gone while the head was up.
  // `written_order`: the rows' keys, oldest write first (HeadStore::load),
  // so that "the oldest ended job documents" are the oldest after a
  // restart too (without it, the keys' order).
  void restore(const std::map<std::string, std::string>& rows, Time now, std::chrono::milliseconds grace,
               const std::vector<std::string>& written_order = {});
  // Counts restore()'s grace from `now` instead (never shorter): from when
  // the head serves, once it has written its tables back, which for a
  // large store on a slow disk can take longer than the grace itself.
  void restart_grace(Time now, std::chrono::milliseconds grace);
  // The process `client_id` said hello on `peer` (a worker: of actor
  // `worker_actor`): what it created before a restart, or before its last
  // connection dropped, is its own again.
  void bind_client(PeerId peer, uint64_t client_id, uint64_t worker_actor = 0, uint32_t incarnation = 0);
  // Whether the head keeps what client `client_id` owns until it comes back.
  bool awaits_client(uint64_t client_id) const { return awaited_owners_.count(client_id) > 0; }
  // The awaited client's process is known to have exited (the server watched
  // its pid): what it owns goes now.
  void client_exited(uint64_t client_id);
  // Owners not back by their deadline (after a restore, or a dropped
  // connection) lose what they own (check_heartbeats calls it).
  void check_restored_owners(Time now);
  // Death causes of an owner's actors.
  static constexpr const char* kOwnerExited = "its driver exited";
  // The death cause of what client `client_id` owned, now gone:
  // kOwnerExited for a driver's, naming the owner for an actor's (a child
  // actor of an actor killed said "its driver exited").
  std::string owner_gone_cause(uint64_t client_id) const;
  static constexpr const char* kNotBackAfterRestore = "its driver did not come back after the head restarted";
  // A node agent came back to a restarted head (or after its connection
  // dropped) as node `hello.resume_node_id` with `hello.workers`: its
  // workers the head knows stay (told again to go if their actor was killed
  // meanwhile), the ones it does not are killed, and actors whose workers
  // are gone are lost (restarted or dead). A node the head declared dead
  // meanwhile joins as a new node (the agent sees another id and kills what
  // it runs). Returns the id.
  uint64_t resume_node(PeerId peer, const wire::Hello& hello, Time now);
  // Its agent said goodbye: nothing new is placed on the node until its
  // connection closes (then node_lost); not closed within the heartbeat
  // limit, it is dead then.
  void node_leaving(uint64_t node_id);
  // Whether node `node_id` is alive but its agent not connected (see Node).
  bool node_awaited(uint64_t node_id) const {
    auto it = nodes_.find(node_id);
    return it != nodes_.end() && it->second.info.alive && it->second.awaiting;
  }

 private:
  // Resources an actor holds: from its node's pool, or from a bundle of a
  // group's reservation `epoch`.
  struct Allocation {
    uint64_t node_id = 0;
    uint64_t group_id = 0;
    size_t bundle = 0;
    uint64_t epoch = 0;
    Grant grant;
  };
  struct Node {
    wire::NodeInfo info;
    PeerId peer = 0;
    ResourcePool pool;
    // Actors holding an allocation from the pool (not a group's): they
    // break ties of load when placing (NodeView::actors).
    size_t placed = 0;
    Time last_heartbeat;
    // Restored by a restarted head, or its connection dropped, its agent
    // not back yet: nothing new is placed on it, and past the heartbeat
    // limit it is dead, for `awaiting_why`.
    bool awaiting = false;
    std::string awaiting_why;
  };
  // Actor::lenders' bits.
  static constexpr uint8_t kLentByWorker = 1, kLentByOwner = 2;
  struct Actor {
    wire::ActorInfo info;
    wire::ActorSpec spec;
    PeerId owner = 0;
    uint64_t owner_client = 0;  // the owner's client id, which outlives a head restart
    // A detached actor's creator's client id (it has no owner): whose
    // driver its output goes to (driver_of). Not kept across a head restart.
    uint64_t creator_client = 0;
    std::optional<Allocation> allocation;
    // The part of allocation->grant given back while its task waits
    // (lend_resources); release() gives back only the rest.
    Resources lent;
    // Who lends it now (kLentByWorker, kLentByOwner; not kept across a
    // restart, where both tell again): it is taken back when neither does.
    uint8_t lenders = 0;
    // A worker process of this incarnation was started on info.node_id and
    // its exit has not been reported: the actor cannot be DEAD yet.
    bool worker_running = false;
    // Its current worker said hello (took its arguments): it started.
    bool said_hello = false;
    bool kill_requested = false;
    // Warned that no live node could hold it: once, not at every change of
    // the free resources its pending reason quotes.
    bool warned_unplaceable = false;
    // The incarnation a KillWorker was last sent for (none: none was): one
    // sent while its node's agent was away is sent again when it is back.
    std::optional<uint32_t> kill_sent;
    // The last worker that ran it and ended, for `troupe logs` of an actor
    // that has none now.
    uint64_t last_node = 0;
    int32_t last_pid = 0;
    // The one that ended before it (`troupe logs --previous` of an actor
    // that has no worker now); kept in memory only: a restarted head
    // knows the last one.
    uint64_t prev_node = 0;
    int32_t prev_pid = 0;
    // Its workers that ended before it was ready, in a row (a constructor
    // that crashes its process): past a few, each restart waits longer
    // (restart_backoff), until `not_before`, in the head's check time.
    uint32_t early_deaths = 0;
    std::optional<Time> not_before;
  };
  struct Group {
    wire::PlacementGroupInfo info;
    wire::PlacementGroupSpec spec;
    PeerId owner = 0;
    uint64_t owner_client = 0;
    uint64_t epoch = 0;  // bumped at every reservation
    // One per bundle, or empty when none is reserved. A group that lost
    // some bundles with a node keeps the others (PENDING, the lost ones'
    // node 0 and grant empty) until those are placed again.
    std::vector<Grant> reserved;
    std::vector<ResourcePool> bundles;
    // It was warned of as placeable nowhere: said once, not again each
    // time the free amounts in its pending reason change.
    bool warned = false;
  };

  template <class Pred>
  std::vector<uint64_t> actor_ids_where(Pred pred) const;
  Actor& actor(uint64_t id);
  // Keeps `pid` (> 0), on the actor's current node, as its last worker.
  void remember_worker(Actor& a, int32_t pid);
  Group& group(uint64_t id);
  void validate_actor(const wire::ActorSpec& spec);
  void publish(Actor& a);
  void schedule();
  bool try_place(Actor& a);
  // Whether some live node holds `req` in total (idle, it could run it).
  bool could_ever_hold(const Resources& req) const;
  // Whether `spec` is placed on its affinity node only: hard, or soft with
  // that node alive and big enough for it in all.
  bool keeps_affinity(const wire::ActorSpec& spec) const;
  std::optional<Allocation> allocate(const Actor& a, std::string* reason);
  std::optional<Allocation> allocate_in_group(const Actor& a, std::string* reason);
  void start_worker(Actor& a, Allocation alloc);
  void release(Actor& a);
  // The pool an allocation was taken from: its node's, or its bundle's;
  // nullptr when that is gone (a dead node, a given-up reservation).
  ResourcePool* pool_of(const Allocation& al);
  // Counts an allocation from a node's own pool in (+1) or out (-1) of
  // Node::placed.
  void count_placed(const Allocation& al, int delta);
  // Its worker is gone: a restart (when it has one left) or DEAD. With
  // `uses_restart` false (a spawn that may have been lost in flight, see
  // resume_node) it is placed again as a new incarnation, its restarts
  // untouched.
  void actor_lost(Actor& a, const std::string& why, bool uses_restart = true);
  void set_dead(Actor& a);
  // Frees `a`'s name, unless another actor holds it now.
  void release_name(const Actor& a);
  void drop_ctor_args_if_final(Actor& a);
  void evict_dead();
  std::deque<uint64_t>& dead_order(const Actor& a);
  template <class Table>
  static void forget_oldest(Table& table, std::deque<uint64_t>& order, size_t keep);
  bool try_place_group(Group& g);
  // How long a node may stay silent before it is dead (fenced).
  std::chrono::milliseconds fence_time() const {
    return std::chrono::milliseconds(uint64_t(config_.heartbeat_ms) * config_.heartbeat_misses);
  }
  // Whether `g` would fit the live nodes if they were idle.
  bool could_ever_place(const Group& g) const;
  // Whether an actor or group waits for room that task executors hold.
  bool waits_for_room() const;
  // Whether `a` waits out a restart back-off (restart_backoff) at the
  // head's last check.
  bool backing_off(const Actor& a) const;
  // In take_outputs: tells the owners of actors when the cluster starts or
  // stops waiting for room that task executors hold (wire::ResourcesWanted).
  void update_resources_wanted();
  // A process that owns actors now (created one, or came back to a
  // restarted head) hears that room is wanted, if it is and it was not
  // told yet (or `again`).
  void tell_resources_wanted(PeerId owner, bool again = false);
  void unreserve_group(Group& g);
  void hold_on_node(Actor& a, Allocation al);
  // `node` died: the bundles `g` had there go (the others, and the actors
  // in them, stay where they are) and `g` waits to place them again.
  void lose_bundles(Group& g, uint64_t node);
  // The node of each bundle that still holds its reservation (0: to place).
  static std::vector<uint64_t> kept_bundles(const Group& g);
  void kv_set(const std::string& key, const std::string& value);
  // The actors the request asks for, the newest `limit`; `matching`: how
  // many matched before the limit cut them.
  nlohmann::json actors_json(const wire::StatusRequest& request, size_t* matching) const;
  // The client id of the driver whose work `a` is: its owner (a detached
  // actor's: its creator), or its owner's owner when that is an actor's
  // worker, and so on (0: none; with !through_detached, also when a
  // detached actor is on the way: job_owns).
  uint64_t driver_of(const Actor& a, bool through_detached = true) const;
  void job_owns(Group& g);
  // A reaped worker's last counters (WorkerExited), counted in place of
  // what it last published.
  void last_stats(uint64_t actor_id, uint32_t incarnation, uint64_t calls, uint64_t stream_bytes);
  // Folds the published stats of `actor_id`'s processes older than
  // `incarnation` into the retired totals and drops their keys.
  void retire_stats(uint64_t actor_id, uint32_t incarnation);
  // Erases every KV key that starts with `prefix` (for the store too).
  void kv_erase_prefix(const std::string& prefix);
  // Whether `key` may be set: any key but troupe.actor/... and
  // troupe.client/..., which must be troupe.actor/<id>/... of an actor that
  // is not dead or troupe.client/<id>/... of a client that is connected (or
  // awaited after a restore), and a reference's target must be one that
  // holds no such key (client/actor_keys.h).
  bool scoped_key_allowed(const std::string& key) const;
  // A key came or went: counts the references (client/actor_keys.h), and
  // erases a target whose last reference went.
  void kv_added(const std::string& key);
  void kv_removed(const std::string& key);
  // Erases the oldest ended TrainJob documents (troupe.jobs/<name>) past
  // kMaxJobDocuments: a cluster that runs uniquely named jobs for weeks
  // kept every one, in status, the dashboard and /metrics.
  void trim_jobs();
  bool job_document_spent(const std::string& value) const;
  // The keys of client `client_id` go (it left, or did not come back).
  void client_gone(uint64_t client_id);

  // What awaited client `client_id` owns goes, each actor with `why`.
  void drop_awaited(uint64_t client_id, const std::string& why);
  // drop_awaited for the worker clients actor_lost found (see there).
  void drop_exited_workers();
  // restore()'s parts, in their order: counters, keys and nodes; then the
  // groups (they hold bundles on nodes); then the actors (they hold shares
  // of nodes or bundles).
  void restore_nodes_and_keys(const std::map<std::string, std::string>& rows, Time deadline);
  void restore_groups(const std::map<std::string, std::string>& rows, Time deadline);
  void restore_actors(const std::map<std::string, std::string>& rows, Time deadline);
  // Puts job_keys_ in the order their rows were last written (store keys
  // "k/<key>", oldest first); keys not in it keep their place, in front.
  void order_job_keys(const std::vector<std::string>& written_order);
  void mark(const Actor& a) {
    if (write_through_) dirty_actors_.insert(a.info.id);
  }

  HeadConfig config_;
  std::map<PeerId, uint64_t> clients_;  // peer -> its client id
  struct Awaited {
    Time deadline;
    std::string why;  // the death cause of its actors if it does not come back
  };
  std::map<uint64_t, Awaited> awaited_owners_;  // client id -> until when (after a restore or a drop)
  // A worker's client id -> its actor and incarnation: when that worker is
  // gone, so is the client, whether or not its connection was seen to close.
  std::map<uint64_t, std::pair<uint64_t, uint32_t>> worker_clients_;
  std::vector<uint64_t> exited_workers_;  // found by actor_lost, for drop_exited_workers
  bool write_through_ = false;
  std::set<uint64_t> dirty_actors_;
  // Nodes warned about for reporting another node's worker exit (once each).
  std::set<uint64_t> foreign_exit_warned_;
  std::set<std::string> dirty_kv_;
  std::map<std::string, std::string> written_;  // nodes, groups, counters: what the store has
  std::map<uint64_t, Node> nodes_;
  std::optional<Time> last_check_;  // of check_heartbeats (none yet: no stall to detect)
  bool stopping_ = false;           // see stopping()
  std::map<uint64_t, Actor> actors_;
  std::map<uint64_t, Group> groups_;
  std::map<std::string, uint64_t> named_;
  std::unordered_map<uint64_t, uint64_t> requests_;  // ActorSpec::request_id -> the actor that request made
  std::map<std::string, std::string> kv_;
  std::map<std::string, size_t> ref_counts_;  // reference target -> its references in kv_
  std::deque<std::string> job_keys_;          // the troupe.jobs/ keys in kv_, oldest first
  uint64_t retired_calls_ = 0, retired_stream_bytes_ = 0;
  uint64_t retired_restarts_ = 0;  // of the DEAD actors evicted from the table
  std::deque<uint64_t> pending_actors_;
  std::deque<uint64_t> pending_groups_;
  std::deque<uint64_t> dead_order_;            // DEAD actors, oldest first
  std::deque<uint64_t> dead_routine_;          // DEAD task executors the pool let go, oldest first
  std::deque<uint64_t> dead_nodes_order_;      // dead nodes, oldest first
  std::deque<uint64_t> removed_groups_order_;  // REMOVED placement groups, oldest first
  bool resources_wanted_ = false;              // see update_resources_wanted()
  std::set<PeerId> told_wanted_;               // owners told that room is wanted
  HeadOutputs out_;
  uint64_t next_node_id_ = 1, next_actor_id_ = 1, next_group_id_ = 1;
};

// Ids first, then the calls: a call may make an actor DEAD and evict an
// older one from the table being walked.
template <class Pred>
std::vector<uint64_t> HeadState::actor_ids_where(Pred pred) const {
  std::vector<uint64_t> ids;
  for (const auto& [id, a] : actors_)
    if (pred(a)) ids.push_back(id);
  return ids;
}

}  // namespace troupe::head
