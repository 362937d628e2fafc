// TaskSubmitter: how a process runs tasks, as Ray does it — with worker
// leases, not a head round trip per task. One submitter per client core
// (Core::service<TaskSubmitter>()). Per scheduling key (resources,
// placement group + bundle, executable, env) it keeps a set of leased task
// executors (hidden actors, client/task.h) and sends tasks straight to them:
//
// - a queued task goes to the least-busy ready executor; while more
//   executors may still be leased, each runs one task at a time from here
//   (so work spreads), once the key has all it can get, up to
//   pipeline_depth tasks travel to each (batched into few frames);
// - executors are leased (spawned with the key's resources) while tasks
//   queue and the cluster can fit more, and released (killed) after
//   idle_release without work, or at once when something this process
//   creates waits for resources that idle executors may hold
//   (release_idle), or while the head says that something anywhere in the
//   cluster does (set_resources_wanted);
// - a task in flight on an executor that dies runs again on another, at
//   most max_retries times, then fails with WorkerDied naming the cause;
// - a task queued on an executor whose task then waits in get() comes back
//   (kBounced) and goes to another executor, or a new one on the CPU that
//   the waiting task lends;
// - when an executor is idle and nothing is queued here, one whose task
//   has run for 50 ms with others pipelined behind it hands those back
//   (HandBackQueued) and they run on the idle one: a long task does not
//   hold up the short ones queued behind it while a CPU idles;
// - with a key's max_calls, an executor that was given that many tasks
//   takes no more and is released once they end, and another is leased in
//   its place (one that holds objects stays, and takes tasks again);
// - cancel() fails a task with TaskCancelled: one still queued here never
//   runs; one sent to an executor runs on there (the caller may interrupt
//   it) unless forced, which kills the executor; the other tasks in flight
//   there run again elsewhere, not counting as a retry.
//
// Spawning and killing executors (head calls) happen on a thread of the
// submitter's own, never on the I/O thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "troupe/runtime/client/core.h"

namespace troupe::client {

struct TaskSubmitterOptions {
  // An executor without work for this long is released.
  std::chrono::milliseconds idle_release{1000};
  // Tasks in flight per executor once a key cannot lease more executors.
  int pipeline_depth = 256;
  // Executors per key; 0 = as many as the cluster's nodes fit (for tasks
  // that ask for no resources: the cluster's CPU count).
  int max_executors = 0;
  // How long a key's executor may stay pending while no live node could
  // ever hold it (the node that could died) before the key's tasks fail
  // with ConfigError: long enough for a fenced node to rejoin.
  std::chrono::milliseconds infeasible_grace{30000};
};

// Where a task runs: TaskOptions without the per-task fields.
struct TaskPlacement {
  std::map<std::string, double> resources;
  uint64_t placement_group = 0;
  int32_t bundle_index = -1;
  std::string executable;
  std::vector<std::string> env;
  uint64_t node_affinity = 0;  // wire::ActorSpec::node_affinity
  bool affinity_soft = false;
  // Tasks an executor of this key runs before it is released (Ray's
  // max_calls: a fresh process for the next, e.g. to give back GPU memory
  // a library keeps); 0 = no limit.
  int32_t max_calls = 0;
  TROUPE_FIELDS(resources, placement_group, bundle_index, executable, env, node_affinity, affinity_soft, max_calls)
};

class TaskSubmitter {
 public:
  using Complete = ActorClient::Complete;
  using Fail = ActorClient::Fail;
  struct Key;

  explicit TaskSubmitter(Core& core);
  ~TaskSubmitter();
  TaskSubmitter(const TaskSubmitter&) = delete;
  TaskSubmitter& operator=(const TaskSubmitter&) = delete;

  void set_options(const TaskSubmitterOptions& options);

  // The scheduling key for `placement`, created on first use; checks then
  // (once per key) that some node could ever fit it: ConfigError naming the
  // resources otherwise. Asks the head: not to be called on the I/O thread.
  std::shared_ptr<Key> key_for(const TaskPlacement& placement);
  // Queues one task: `body` holds the task's name and encoded arguments;
  // `complete` gets the executor's reply (value or the task's error),
  // `fail` a WorkerDied (or TaskCancelled); with `keep_result` the executor
  // keeps the result and replies with a reference to it (submit_ref). Any
  // thread. Returns the task's id in this submitter, for cancel(). Exactly
  // one of complete and fail is called, once.
  uint64_t submit(const std::shared_ptr<Key>& key, const std::string& name, wire::Encoder&& body, int max_retries,
                  Complete complete, Fail fail, bool keep_result = false);
  // What cancel() did.
  struct Cancel {
    enum Outcome {
      kDone,      // finished (or failed) already, or not a task of this submitter: left as it is
      kDequeued,  // it had not been sent: it never runs
      kRunning,   // sent to `executor`, which runs it on: the caller may interrupt it there
      kKilled,    // sent to `executor`, which is being killed (force)
    } outcome = kDone;
    std::shared_ptr<ActorClient> executor;
  };
  // Cancels task `id`: unless done, it fails now with TaskCancelled (its
  // fail callback, on this thread) and is not retried; see Cancel for the
  // rest. Any thread but the I/O thread (a forced cancel calls the head).
  Cancel cancel(uint64_t id, bool force);
  // Where task `id` is, for a wait that timed out: sent to an executor
  // (its pid, and how many tasks are ahead of it there), or queued for one
  // (and why none takes it: the pending executor's reason). "" once it
  // ended or when it is not this submitter's. Any thread.
  std::string describe(uint64_t id) const;
  // Releases every executor and stops leasing (before the core closes).
  void release_all();
  // Releases every executor without work now rather than after
  // idle_release (on the submitter's thread; returns at once): an actor or
  // placement group that this process created waits for resources, and
  // idle executors may be what holds them.
  void release_idle();
  // The head says whether something waits for room in the cluster: while
  // it does, an executor is released as soon as it has no work (any
  // thread; returns at once).
  void set_resources_wanted(bool wanted);
  bool resources_wanted() const;
  // Tells a head that came back whether each executor kept for its objects
  // lends its resources now (one telling may have died unread with the
  // last head; a repeat changes nothing). On the I/O thread, after the
  // reconnect.
  void tell_lends_again();
  // A number no other TaskSubmitter of this process had or will have
  // (unlike its address): what a task's TaskCancel names its submitter by.
  uint64_t instance() const { return instance_; }
  // Executors leased now, over all keys (ready or starting).
  size_t executor_count() const;

 private:
  struct Executor;
  struct Task;
  using Send = std::pair<std::shared_ptr<Executor>, std::shared_ptr<Task>>;
  using Failures = std::vector<std::pair<std::shared_ptr<Task>, std::exception_ptr>>;

  std::vector<Send> pump_locked(const std::shared_ptr<Key>& key);
  void request_leases_locked(const std::shared_ptr<Key>& key);
  void steal_locked(const std::shared_ptr<Key>& key, std::chrono::steady_clock::time_point now);
  // The most executors a key may have: its cap (or max_executors), plus
  // those a resource-less key added beyond it (Key::surge).
  int effective_cap(const Key& k) const;
  void send(std::vector<Send> sends);
  void on_task_done(const std::shared_ptr<Task>& t, wire::Message& m);
  void on_task_bounced(const std::shared_ptr<Task>& t, wire::Message& m);
  void on_task_lost(const std::shared_ptr<Task>& t, const std::string& reason);
  // Ends `t` with its reply or an error unless it ended already (cancel()
  // may end a task while an executor still runs it).
  static void finish(const std::shared_ptr<Task>& t, wire::Message& m);
  static void fail_task(const std::shared_ptr<Task>& t, std::exception_ptr error);
  void on_executor_update(const std::shared_ptr<Key>& key, const std::shared_ptr<Executor>& e,
                          const wire::ActorInfo& info);
  std::vector<std::shared_ptr<Task>> drop_executor_locked(Key& key, Executor& e, const std::string& cause);
  Failures fail_queue_locked(Key& key, std::exception_ptr error);
  // Executors of `k` not blocked in get(): what counts against its cap.
  static int working_count(const Key& k);
  static std::exception_ptr head_gone(const Key& key, const std::string& cause);
  static std::exception_ptr worker_died(const std::string& task, const Executor& e, const std::string& cause);
  void lease_loop();
  void lease_one(const std::shared_ptr<Key>& key);
  // The executors a key may hold at once (Key::cap), from the head's node
  // list, for a key made while the head did not answer (Key::cap_unknown).
  void refresh_cap(const std::shared_ptr<Key>& key);
  void ask_objects_held(const std::vector<std::shared_ptr<Executor>>& asks);
  // Releases executors idle for idle_release, or all idle ones after
  // release_idle().
  void reap_idle(std::unique_lock<std::mutex>& lock);
  void kill_executor(uint64_t id, const std::string& why = "");
  // Tells the head that executor `id`, idle and kept for its objects, lends
  // its resources (or takes them back before it gets a task). Called under
  // mu_ with the change it tells (never blocks), so that the head hears an
  // executor's lends and take-backs in their order.
  void lend(uint64_t id, bool lend);
  // On the lease thread: when no live node could hold `key` for
  // infeasible_grace, its queued tasks fail and its pending executors go.
  void check_feasible(const std::shared_ptr<Key>& key);

  Core& core_;
  const uint64_t instance_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  TaskSubmitterOptions options_;
  std::map<std::string, std::shared_ptr<Key>> keys_;
  std::deque<std::shared_ptr<Key>> lease_requests_;
  // Keys whose executor waits with a pending reason: is any live node
  // still able to hold them (check_feasible)?
  std::deque<std::shared_ptr<Key>> feasibility_checks_;
  // Dead executors whose lost tasks wait for the head's cause of death.
  std::vector<std::shared_ptr<Executor>> awaiting_cause_;
  // Executors whose connection failed: dropped from their key, and killed
  // at the head once kDeathCauseWait passes without word of their death
  // (a connection cut while the worker lives held its CPUs for ever).
  std::vector<std::shared_ptr<Executor>> cut_off_;
  // Executors to ask for their queued tasks (steal_locked): send() asks.
  std::vector<std::shared_ptr<ActorClient>> hand_backs_;
  // Idle executors kept for their objects, to ask outside mu_ whether any
  // are left (reap_idle, ask_objects_held).
  std::vector<std::shared_ptr<Executor>> objects_asks_;
  bool stopping_ = false;
  // How long key_for waits for the head's node list before taking the
  // tasks anyway (refresh_cap counts the key's executors at its first lease).
  static constexpr std::chrono::milliseconds kNodeListWait{2000};
  bool release_idle_requested_ = false;  // release_idle(): reap_idle takes every idle executor
  bool retire_requested_ = false;        // a spent executor became idle: reap_idle takes it
  bool resources_wanted_ = false;        // set_resources_wanted()
  // Tasks by id, for cancel(); ended ones are swept now and then.
  std::unordered_map<uint64_t, std::weak_ptr<Task>> tasks_;
  uint64_t next_task_id_ = 1;
  size_t sweep_at_ = 1024;
  std::thread leaser_;
};

}  // namespace troupe::client
