// The control-plane protocol between drivers, the head, node agents and
// workers: operation codes and the Codec-encoded bodies they carry in an
// Envelope. Calls and replies (the hot path) use the Envelope fields alone.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "troupe/runtime/core/heartbeat.h"
#include "troupe/runtime/wire/codec.h"

namespace troupe::wire {

using Resources = std::map<std::string, double>;

enum class Op : uint32_t {
  kHello = 1,                  // request any -> head: Hello -> HelloReply
  kHeartbeat = 2,              // event node -> head: NodeHeartbeat (or empty)
  kCreateActor = 3,            // request driver -> head: ActorSpec -> ActorInfo
  kActorReady = 4,             // event worker -> head: ActorReady
  kActorInitFailed = 5,        // event worker -> head: ActorInitFailed
  kWorkerExited = 6,           // event node -> head: WorkerExited
  kSpawnWorker = 7,            // event head -> node: SpawnWorker
  kKillWorker = 8,             // event head -> node: KillWorker
  kSubscribeActor = 9,         // request -> head: uint64 id -> ActorInfo, then kActorUpdate events
  kActorUpdate = 10,           // event head -> subscriber: ActorInfo
  kGetActor = 11,              // request -> head: name -> ActorInfo
  kKillActor = 12,             // request -> head: KillActor -> void
  kCreatePlacementGroup = 13,  // request: PlacementGroupSpec -> PlacementGroupInfo
  kGetPlacementGroup = 14,     // request: uint64 id -> PlacementGroupInfo
  kRemovePlacementGroup = 15,  // request: uint64 id -> void
  kKvPut = 16,                 // request: KvEntry -> void
  kKvGet = 17,                 // request: key -> optional<string>
  kKvWait = 18,                // request: KvWait -> string (error Timeout)
  kKvErase = 19,               // request: key -> void
  kKvAdd = 20,                 // request: KvAdd -> int64
  kStatus = 21,                // request: StatusRequest (or empty) -> JSON text
  kShutdown = 22,  // request: -> void; the head stops the cluster (as an event from the head: it is going for good)
  kControl = 23,   // request caller -> worker: ControlRequest (bypasses the mailbox)
  kWaitPlacementGroup = 24,  // request: WaitPlacementGroup -> PlacementGroupInfo
  kNodes = 25,               // request: -> std::vector<NodeInfo>
  kNodeFenced = 26,          // event head -> node: NodeFenced (then the head closes)
  kReadLog = 27,             // request driver -> head (-> node): ReadLog -> LogChunk
  kLendResources = 28,       // event worker -> head: LendResources
  kResourcesWanted = 29,     // event head -> actor owner: ResourcesWanted
  kGoodbye = 30,             // request driver/worker -> head: -> void; it leaves for good (see Hello::host_key)
  kPing = 31,                // request worker -> head: -> void; a stalled worker still serves (StallGuard)
  kLastOp = kPing,           // the highest op (tables indexed by op)
};

// The op's name in snake case ("create_actor"); "op_N" for an unknown one.
std::string op_name(uint32_t op);
inline std::string op_name(Op op) { return op_name(static_cast<uint32_t>(op)); }

enum class Role : uint8_t { kDriver = 0, kNode = 1, kWorker = 2 };

// A worker a node agent still runs, told to a head that restarted.
struct LiveWorker {
  uint64_t actor_id = 0;
  uint32_t incarnation = 0;
  int32_t pid = 0;
  TROUPE_FIELDS(actor_id, incarnation, pid)
};

struct Hello {
  Role role = Role::kDriver;
  uint64_t actor_id = 0;     // worker
  uint32_t incarnation = 0;  // worker
  Resources resources;       // node
  std::string hostname;      // node
  int32_t pid = 0;
  // node: the address its workers advertise, the one peers reach them at
  // (never a wildcard such as 0.0.0.0).
  std::string address;
  // A node coming back to a restarted head: the id it had (0 = a new node)
  // and the workers it still runs.
  uint64_t resume_node_id = 0;
  std::vector<LiveWorker> workers;
  // Drivers and workers: the process's own id, the same on every
  // connection it makes, so a restarted head knows who owns what.
  uint64_t client_id = 0;
  // The machine and pid namespace the process runs in (core::host_key()).
  // A durable head gives a client whose connection drops without a
  // kGoodbye, or a node agent whose connection drops, time to come back;
  // when the process shares the head's host key the head watches its pid
  // and ends the wait once the process is gone.
  std::string host_key;
  // A driver or worker coming back: the cluster it joined
  // (HelloReply::cluster_id). A head of another refuses it before taking
  // anything of it (a worker's hello would take a constructor's arguments).
  uint64_t cluster_id = 0;
  TROUPE_FIELDS(role, actor_id, incarnation, resources, hostname, pid, address, resume_node_id, workers, client_id,
                host_key, cluster_id)
};

enum class ActorState : uint8_t { kPending = 0, kAlive = 1, kRestarting = 2, kDead = 3 };
const char* to_string(ActorState s);

// One of an actor's concurrency groups (Ray's concurrency_groups): its
// calls run on threads of their own, at most max_concurrency at once, beside
// the other groups' and the default group's (ActorSpec::max_concurrency).
// A call goes to the group its caller names (client::call_op's group), else
// to the group listing its method (a C++ actor's methods by name), else to
// the default group.
struct ConcurrencyGroup {
  std::string name;
  int32_t max_concurrency = 1;
  std::vector<std::string> methods;
  TROUPE_FIELDS(name, max_concurrency, methods)
};
// A call names its group in 8 bits of its op (client::kCallGroupShift).
inline constexpr uint32_t kMaxConcurrencyGroups = 255;

struct ActorSpec {
  std::string type_key;  // constructor registry key
  std::string class_name;
  std::string ctor_args;  // Codec-encoded constructor arguments
  std::vector<Buffer> ctor_attachments;
  Resources resources;
  std::string name;  // named actor ("" = anonymous)
  int32_t max_restarts = 0;
  int32_t max_task_retries = 0;
  int32_t max_concurrency = 1;
  uint64_t placement_group = 0;
  int32_t bundle_index = -1;
  std::string executable;
  std::vector<std::string> env;  // extra KEY=VALUE for the worker
  // Outlives the process that created it (Ray's lifetime="detached"): it
  // has no owner, and only a kill or the cluster's end stops it.
  bool detached = false;
  // Node affinity (Ray's NodeAffinitySchedulingStrategy): run on node
  // `node_affinity` (0 = any). Hard (soft = false): only there, waiting
  // for room, and DEAD if that node is gone; soft: there (waiting for
  // room) while that node is alive and big enough in all, else wherever
  // the head would place it.
  uint64_t node_affinity = 0;
  bool affinity_soft = false;
  // Groups beside the default one (head::validate_concurrency_groups).
  std::vector<ConcurrencyGroup> concurrency_groups;
  // The creating process's id for this request (0: none). The head makes
  // one actor per id: a request asked again after no answer (a head that
  // stalled past the call's timeout, or restarted) gets the actor the first
  // one made, not a second (client::Core::create_actor).
  uint64_t request_id = 0;
  TROUPE_FIELDS(type_key, class_name, ctor_args, ctor_attachments, resources, name, max_restarts, max_task_retries,
                max_concurrency, placement_group, bundle_index, executable, env, detached, node_affinity, affinity_soft,
                concurrency_groups, request_id)
};

struct ActorInfo {
  uint64_t id = 0;
  std::string class_name;
  std::string name;
  ActorState state = ActorState::kPending;
  uint64_t node_id = 0;
  std::string address;  // host:port where the worker takes calls
  int32_t pid = 0;
  uint32_t incarnation = 0;  // 0 for the first process, +1 per restart
  int32_t restarts = 0;
  int32_t max_restarts = 0;
  int32_t max_task_retries = 0;
  std::string pending_reason;  // why it is PENDING
  std::string death_cause;     // why it is DEAD (or why it last died)
  std::vector<int32_t> gpu_ids;
  std::string control_address;  // host:port for control messages
  // Bumped by the head on every published change, so a process applies
  // updates in order even when a subscribe reply and an event cross.
  uint64_t version = 0;
  // A task executor whose task waits in get() and lent its CPU
  // (LendResources): its submitter sends it nothing more meanwhile.
  bool blocked = false;
  // Runs one call at a time in the order each caller sent them
  // (max_concurrency 1, no concurrency groups): a caller then keeps its
  // calls in the order made (client::CallOrder); Ray promises no order for
  // threaded, async or grouped actors, and keeping one could deadlock them.
  bool in_order = true;
  TROUPE_FIELDS(id, class_name, name, state, node_id, address, pid, incarnation, restarts, max_restarts,
                max_task_retries, pending_reason, death_cause, gpu_ids, control_address, version, blocked, in_order)
};

struct HelloReply {
  uint64_t node_id = 0;  // node
  // node: how often it heartbeats; the head answers each heartbeat with
  // an empty one, by which the node knows the head still hears it.
  uint32_t heartbeat_ms = core::kHeartbeatMs;
  ActorSpec spec;  // worker
  ActorInfo info;  // worker
  // The head writes its tables through to a store and reloads them when it
  // is restarted: whoever loses it should wait for it to come back.
  bool durable = false;
  // How long a node may stay silent before the head fences it
  // (heartbeat_ms × misses). A worker that stalled for half of it confirms
  // it still serves before its next call (StallGuard); a node agent that
  // hears nothing from the head for one heartbeat less kills its workers
  // (node::HeadLease), so that they stop before the head restarts their
  // actors elsewhere.
  uint32_t fence_after_ms = core::kHeartbeatMs * core::kHeartbeatMisses;
  // The tables' identity: drawn at random by a head that starts with none,
  // kept in a durable head's state file. A head that comes back with
  // another (its state file was lost, or removed after a failed write)
  // holds none of this cluster's actors, nodes or keys, and its ids (from
  // 1 again) name other things: whoever reconnects to it gives it up.
  uint64_t cluster_id = 0;
  TROUPE_FIELDS(node_id, heartbeat_ms, spec, info, durable, fence_after_ms, cluster_id)
};

struct ActorReady {
  uint64_t actor_id = 0;
  uint32_t incarnation = 0;
  std::string address;
  int32_t pid = 0;
  std::string control_address;
  TROUPE_FIELDS(actor_id, incarnation, address, pid, control_address)
};

struct ActorInitFailed {
  uint64_t actor_id = 0;
  uint32_t incarnation = 0;
  std::string error;
  TROUPE_FIELDS(actor_id, incarnation, error)
};

struct SpawnWorker {
  uint64_t actor_id = 0;
  uint32_t incarnation = 0;
  std::string executable;
  std::vector<int32_t> gpu_ids;
  std::vector<std::string> env;
  std::string class_name;
  TROUPE_FIELDS(actor_id, incarnation, executable, gpu_ids, env, class_name)
};

struct KillWorker {
  uint64_t actor_id = 0;
  uint32_t incarnation = 0;
  TROUPE_FIELDS(actor_id, incarnation)
};

struct WorkerExited {
  uint64_t actor_id = 0;
  uint32_t incarnation = 0;
  int32_t pid = 0;
  std::string how;  // "killed by signal 9", "exited with code 1", "failed to start: ..."
  // The worker's counters as it left them (its stats page; has_stats 0
  // when it had none): what it served after its last publication counts.
  uint8_t has_stats = 0;
  uint64_t calls = 0;
  uint64_t stream_bytes = 0;
  TROUPE_FIELDS(actor_id, incarnation, pid, how, has_stats, calls, stream_bytes)
};

// A task executor's task started (lend) or stopped (!lend) waiting in get():
// while it waits, the head counts the executor's CPU as free, as Ray does,
// so that the tasks it waits for can run (nested tasks cannot deadlock a
// small cluster); taking it back may run a node over its CPUs for a while.
struct LendResources {
  uint64_t actor_id = 0;
  uint32_t incarnation = 0;
  bool lend = false;
  TROUPE_FIELDS(actor_id, incarnation, lend)
};

// Something waits for resources (an actor, a task executor or a placement
// group that would fit an idle cluster), or no longer does. Every process
// that owns actors hears it: while it lasts, its task submitter releases an
// executor as soon as it has no work, rather than keep it for reuse, so that
// CPUs held idle in one process go to the tasks another one waits for.
struct ResourcesWanted {
  bool wanted = false;
  TROUPE_FIELDS(wanted)
};

struct KillActor {
  uint64_t actor_id = 0;
  bool no_restart = true;
  std::string why;  // the death cause; "" = "killed by request"
  TROUPE_FIELDS(actor_id, no_restart, why)
};

enum class PlacementStrategy : uint8_t { kPack = 0, kSpread = 1, kStrictPack = 2, kStrictSpread = 3 };
const char* to_string(PlacementStrategy s);

struct PlacementGroupSpec {
  std::vector<Resources> bundles;
  PlacementStrategy strategy = PlacementStrategy::kPack;
  std::string name;
  // Outlives the process that created it (Ray's lifetime="detached"): it
  // has no owner, and only a removal or the cluster's end frees it.
  bool detached = false;
  // As ActorSpec::request_id: the head makes one group per id.
  uint64_t request_id = 0;
  TROUPE_FIELDS(bundles, strategy, name, detached, request_id)
};

enum class PlacementGroupState : uint8_t { kPending = 0, kCreated = 1, kRemoved = 2 };

struct PlacementGroupInfo {
  uint64_t id = 0;
  PlacementGroupState state = PlacementGroupState::kPending;
  std::vector<uint64_t> bundle_nodes;  // node of each bundle (0 = unplaced)
  std::string pending_reason;
  TROUPE_FIELDS(id, state, bundle_nodes, pending_reason)
};

struct WaitPlacementGroup {
  uint64_t id = 0;
  uint32_t timeout_ms = 0;
  TROUPE_FIELDS(id, timeout_ms)
};

struct KvEntry {
  std::string key;
  std::string value;
  TROUPE_FIELDS(key, value)
};

struct KvWait {
  std::string key;
  uint32_t timeout_ms = 0;
  TROUPE_FIELDS(key, timeout_ms)
};

struct KvAdd {
  std::string key;
  int64_t delta = 0;
  TROUPE_FIELDS(key, delta)
};

// One node as the head sees it (the typed cluster query, Op::kNodes).
struct NodeInfo {
  uint64_t id = 0;
  std::string hostname;
  std::string address;  // the host its workers listen on
  int32_t pid = 0;
  bool alive = true;
  Resources total;
  Resources used;
  Resources available;
  std::vector<int32_t> gpu_ids;       // every GPU id of the node
  std::vector<int32_t> free_gpu_ids;  // those no actor or bundle holds
  uint32_t idle_workers = 0;          // warm pooled workers, as of its last heartbeat
  TROUPE_FIELDS(id, hostname, address, pid, alive, total, used, available, gpu_ids, free_gpu_ids, idle_workers)
};

// The head declared this node agent's incarnation dead (missed heartbeats:
// a SIGSTOP, a partition, a stall): its workers have been replaced or
// given up. The agent kills every worker it runs and registers again as a
// new node, or exits.
struct NodeFenced {
  uint64_t node_id = 0;
  std::string reason;
  TROUPE_FIELDS(node_id, reason)
};

// `troupe logs`: a piece of the head's log ("head"), a node agent's
// ("node", id = node id) or an actor's worker's ("actor", id = actor id;
// the head turns it into "worker", id = the worker's pid, for its node).
struct ReadLog {
  std::string target;
  uint64_t id = 0;
  uint64_t offset = UINT64_MAX;  // UINT64_MAX: the last max_bytes
  uint32_t max_bytes = 64 * 1024;
  // The file's rotated part, PATH.1 (`troupe logs -f` reads the rest of a
  // file that rotated under it there).
  bool rotated = false;
  TROUPE_FIELDS(target, id, offset, max_bytes, rotated)
};

struct LogChunk {
  std::string path;  // the file, on its machine
  std::string text;
  uint64_t next_offset = 0;  // where the next read starts
  uint64_t size = 0;         // the file's size when read
  uint64_t file_id = 0;      // its inode: another one at the same path after a rotation
  TROUPE_FIELDS(path, text, next_offset, size, file_id)
};

// What a node agent reports with each heartbeat.
struct NodeHeartbeat {
  uint32_t idle_workers = 0;  // its warm pool's ready workers
  TROUPE_FIELDS(idle_workers)
};

// Filters of the status document: actors in `state` only ("" = any, else
// PENDING, ALIVE, RESTARTING or DEAD), whose work is client `driver`'s
// (0 = anyone's; HeadState::driver_of), at most `limit` of them, the
// newest (0 = all).
struct StatusRequest {
  std::string state;
  uint32_t limit = 0;
  uint64_t driver = 0;
  TROUPE_FIELDS(state, limit, driver)
};

// A message for the worker's control plane, handled on its I/O thread
// without waiting for the actor's current call (e.g. abort a collective):
// the message type's tag and its Codec-encoded body (client/control.h).
struct ControlRequest {
  std::string tag;
  std::string body;
  TROUPE_FIELDS(tag, body)
};

}  // namespace troupe::wire
