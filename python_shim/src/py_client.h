// PyClient: the driver side of the Python shim, on the C++ client core. It
// holds the Runtime (embedded local cluster or a connection) of a Python
// driver, or the worker's own core inside a Python worker, and runs the
// runtime's operations for troupe/__init__.py: spawn Python actors, call
// them, submit Python tasks through the TaskSubmitter (leased executors,
// retries), put objects, kill, look up actors. Nothing here schedules,
// retries or detects failures: the runtime does.
//
// Every method is called with the GIL released (module.cc converts the
// Python values first) and never touches Python objects.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "python_shim/src/py_ref.h"
#include "troupe/runtime/client/runtime.h"

namespace troupe::py {

using RefList = std::vector<std::shared_ptr<PyRef>>;

// The type key and the hidden task name the Python worker serves.
inline constexpr const char* kPyActorKey = "troupe.PyActor";
inline constexpr const char* kPyTaskName = "troupe.python_task";

// Where and how an actor or a task's executors run.
struct PyOptions {
  Resources resources;
  std::string name;
  int max_restarts = 0;
  int max_task_retries = 0;
  int max_retries = 0;
  int max_concurrency = 1;
  std::vector<wire::ConcurrencyGroup> concurrency_groups;  // an actor's, beside its default group
  std::string executable;                                  // the Python worker launcher
  std::vector<std::string> env;
  uint64_t placement_group = 0;  // 0 = none
  int bundle_index = -1;         // -1 = any bundle of the group
  bool detached = false;         // lifetime="detached"
  uint64_t node_affinity = 0;    // NodeAffinitySchedulingStrategy (0 = none)
  bool affinity_soft = false;
  int max_calls = 0;  // a task's (TaskPlacement::max_calls)
};

// A scheduling key of the task submitter (placement of Python tasks).
struct PyTaskKey {
  std::shared_ptr<client::TaskSubmitter::Key> key;
  std::string name;
  int max_retries = 0;
};

class PyClient {
 public:
  // A driver: an embedded cluster (empty address) or a connection.
  explicit PyClient(const InitOptions& options);
  // Inside a Python worker: the worker's own core (never shut down here).
  explicit PyClient(std::shared_ptr<client::Core> core);
  ~PyClient();

  // Creates a Python actor; returns its client once the head has it.
  std::shared_ptr<client::ActorClient> spawn(const std::string& class_name, PyActorSpec spec, const PyOptions& o);
  // A call of method `call.target` with `top` as the top-level refs; the
  // call holds `keep` (an actor's lifetime ref, or null) until answered.
  // `group`: the concurrency group the call names (client::kCallGroupShift;
  // 0 = the default one). `max_retries` (-1: without limit) replaces the
  // actor's max_task_retries for this call (a method's or a call's own).
  std::shared_ptr<PyRef> call(client::ActorClient& actor, PyCall call, const RefList& top,
                              std::shared_ptr<PyRef> keep = nullptr, uint32_t group = 0,
                              std::optional<int> max_retries = std::nullopt);
  // The lifetime ref of actor `actor_id`, which this process created: a
  // stored object that every handle holds (a handle sent to another
  // process carries it as a borrowed ref, calls hold it until answered).
  // When the last reference anywhere goes, the actor is killed, as Ray ends
  // an actor whose handles all went out of scope.
  std::shared_ptr<PyRef> actor_lifetime(uint64_t actor_id);
  PyTaskKey task_key(const PyOptions& o);
  std::shared_ptr<PyRef> submit(const PyTaskKey& key, PyCall call, const RefList& top);
  // troupe.cancel of a task's or an actor call's ref: "done" (it had
  // ended: nothing to do), "dequeued" (it never runs), "started" (a task
  // gets KeyboardInterrupt, an async method's coroutine is cancelled, a
  // plain method runs on and may ask is_canceled()), "killed" (a task with
  // force: its executor is killed). With `recursive`, a started task's or
  // plain method's worker cancels the tasks it submitted that have not
  // finished. Unless done, the ref fails with TaskCancelled at once. ConfigError when `ref` is not the result of a
  // task or call made here, or for force on an actor call.
  std::string cancel(const PyRef& ref, bool force, bool recursive);
  std::shared_ptr<PyRef> put(PyValue value);

  std::shared_ptr<client::ActorClient> get_actor(const std::string& name);

  // Placement groups, as the runtime's (Runtime::create_placement_group):
  // `strategy` is Ray's name (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD).
  wire::PlacementGroupInfo create_placement_group(const std::vector<Resources>& bundles, const std::string& strategy,
                                                  const std::string& name, bool detached);
  // The group's state once it is reserved, or at the timeout.
  wire::PlacementGroupInfo wait_placement_group(uint64_t id, std::chrono::milliseconds timeout);
  wire::PlacementGroupInfo placement_group_info(uint64_t id);
  void remove_placement_group(uint64_t id);
  // A ref that resolves to `value` once group `id` is reserved, or fails
  // if the group is removed first (Ray's PlacementGroup.ready()).
  std::shared_ptr<PyRef> placement_group_ready(uint64_t id, PyValue value);
  // The latest view of an actor (state, node, restarts).
  wire::ActorInfo actor_info(uint64_t id);

  Runtime& runtime() { return runtime_; }
  std::shared_ptr<client::Core> core() const { return runtime_.core(); }
  bool embedded_driver() const { return driver_; }
  void shutdown();

 private:
  Runtime runtime_;
  bool driver_ = false;
  pid_t pid_ = 0;  // the process that made it (a fork's child does not shut it down)
};

// "HOST:PORT", "auto" or "" (embedded) and a token ("" = TROUPE_TOKEN or the
// session directory's), as troupe::init resolves them for C++ drivers.
InitOptions resolve_init_options(std::string address, std::string token);

}  // namespace troupe::py
