#include "troupe/runtime/client/task_submitter.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>
#include <set>
#include <utility>

#include "troupe/runtime/client/task.h"
#include "troupe/runtime/client/task_controls.h"
#include "troupe/runtime/core/exception_text.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/core/process.h"
#include "troupe/runtime/head/resource_pool.h"
#include "troupe/runtime/head/scheduler.h"

namespace troupe::client {

using namespace troupe::wire;
using Clock = std::chrono::steady_clock;

namespace {
// Executors in a row that die before running anything make a key give up
// (a worker executable that cannot start would otherwise be respawned
// forever).
constexpr int kMaxFailedLeases = 3;
// How long a task whose worker died waits for the head to say why before
// it fails with what the connection saw.
constexpr auto kDeathCauseWait = std::chrono::seconds(2);
// How often an idle executor kept for its objects is asked whether any
// are left (ObjectsHeld).
constexpr auto kAskObjectsEvery = std::chrono::seconds(1);
// An executor that has answered nothing for this long, with tasks queued
// behind the one it runs, hands them to an idle one (steal_locked): short
// enough that a long task holds up little, long enough that executors
// draining a burst of short tasks are never asked.
constexpr auto kStealAfter = std::chrono::milliseconds(50);
// Tasks that ask for zero of every resource they name (Ray's num_cpus=0:
// {"CPU": 0}; an empty request, C++'s default, is held to the CPU count)
// are not held to the cluster's CPUs, as Ray's are not: while every
// executor of such a key is busy and tasks wait behind one that has run
// kSurgeAfter, another executor is leased, up to kZeroRequestCeiling in
// all (processes, not CPUs, bound it). Shorter tasks keep to the CPU count.
constexpr auto kSurgeAfter = std::chrono::milliseconds(500);
constexpr int kZeroRequestCeiling = 64;
}  // namespace

struct TaskSubmitter::Executor {
  std::shared_ptr<ActorClient> client;
  uint64_t id = 0;
  int32_t pid = 0;
  int inflight = 0;
  bool ready = false;
  bool gone = false;
  // It ran a submit_ref, or a task that left objects in its store, so it
  // may own objects others still refer to: kept until the runtime shuts
  // down rather than reaped when idle; idle that long, it lends its CPU
  // (LendResources) until it gets work again.
  bool holds_objects = false;
  bool lent_idle = false;
  // Kept for its objects: when it was last asked whether any are left
  // (ObjectsHeld), and how many tasks it had been sent then (an answer
  // that tasks sent since may have outdated is not taken).
  Clock::time_point objects_asked_at{};
  uint64_t sent_count = 0;
  uint64_t sent_when_asked = 0;
  // Its task waits in get() (ActorInfo::blocked): no task is sent to it,
  // and the key may lease one more executor in its place.
  bool blocked = false;
  // It handed a task back (kBounced) because its task waits: treated as
  // blocked until the head says so or it answers a task.
  bool bounced = false;
  std::string death_cause;
  Clock::time_point idle_since = Clock::now();
  // Tasks that died with it and wait for the head's cause of death.
  std::vector<std::pair<std::shared_ptr<Task>, std::string>> lost;
  Clock::time_point lost_since;
  // Its connection failed: when, and why (see cut_off_).
  Clock::time_point cut_off_since;
  std::string cut_off_why;

  // cancel(force) is killing it: the other tasks in flight here run again
  // elsewhere without spending a retry.
  bool killed_for_cancel = false;
  // Asked to hand back its queued tasks (HandBackQueued) for an idle
  // executor: asked once until it answers a task, and sent no more than
  // the task it runs until then.
  bool handing_back = false;
  // When it last answered a task, or got one while it had none: how long
  // its current task has run, at most.
  Clock::time_point progress_at = Clock::now();
  // Its tasks in flight, in the order sent: it runs them one at a time in
  // that order, so the first is the one running (what a forced cancel may
  // kill it for).
  std::deque<Task*> sent;
  // When it was lost: whether that was seen yet, and the task it ran then
  // (the first sent). The others had not started: they run again
  // elsewhere without spending a retry, as Ray spends only the crashing
  // task's (one segfault failed or cost a retry to up to 255 tasks queued
  // behind it).
  bool loss_seen = false;
  Task* running_when_lost = nullptr;
  // Of `lost`, those that had not started: run again once the head says
  // the worker died (a cut connection's worker may still run them).
  std::set<Task*> lost_not_started;
  void unsend(Task* t) {
    if (auto it = std::find(sent.begin(), sent.end(), t); it != sent.end()) sent.erase(it);
  }

  // Tasks given to it (max_calls counts them).
  int given = 0;
  // It was given the key's max_calls: it takes no more, and goes once idle.
  bool spent = false;

  // It takes no task now, and does not count against the key's cap: its
  // task waits in get(), or it is spent.
  bool sidelined() const { return blocked || bounced || spent; }
};

struct TaskSubmitter::Task {
  uint64_t id = 0;
  std::shared_ptr<Key> key;
  std::string name;  // for messages
  std::string body;
  std::vector<Buffer> attachments;
  int retries_left = 0;
  uint32_t op = 0;  // 0, or kKeepResult for submit_ref
  Complete complete;
  Fail fail;
  // Given back if it goes never sent (Encoder::take_unsent): cancelled or
  // failed while queued. Sent once, its first receiver gives them back.
  wire::Unsent unsent;
  std::shared_ptr<Executor> on;
  bool ran = false;                // it lost a worker it ran on, and waits for its retry (mu_)
  bool cancelled = false;          // by cancel(): ended, never retried or queued again (mu_)
  std::atomic<bool> ended{false};  // complete or fail was called (finish, fail_task)
};

struct TaskSubmitter::Key {
  std::string text;  // for messages: "{CPU: 1}" and the group
  ActorSpec spec;    // of its executors
  int cap = 1;
  bool zero_request = false;  // asks for zero explicitly, outside any group: may grow past cap (kSurgeAfter)
  int surge = 0;              // executors leased beyond cap for waiting tasks (back down as they go)
  int max_calls = 0;          // TaskPlacement::max_calls
  std::deque<std::shared_ptr<Task>> queue;
  std::vector<std::shared_ptr<Executor>> executors;  // not gone
  int requested = 0;                                 // leases asked of the lease thread, not yet made
  int failed_leases = 0;
  bool cap_unknown = false;   // the head did not answer key_for's node list in time: cap counted at the first lease
  bool check_queued = false;  // in feasibility_checks_
  // Since when no live node could hold it (check_feasible); unset while one can.
  std::optional<Clock::time_point> infeasible_since;
  // While infeasible: when the head's node list is asked again (not on
  // every turn of the lease loop, up to four times a second).
  Clock::time_point next_feasibility_check{};
};

namespace {

// How many executors asking for `r` the live nodes fit at once; 0 when no
// node could ever run one.
int fit_count(const Resources& r, const std::vector<NodeInfo>& nodes) {
  int total = 0;
  for (const auto& n : nodes) {
    if (!n.alive) continue;
    double fits = 1e9;
    for (const auto& [name, amount] : r) {
      if (amount <= 0) continue;
      auto it = n.total.find(name);
      double have = it == n.total.end() ? 0 : it->second;
      // A part of a GPU is placed on one device (scheduler.cc's
      // pick_gpus): a whole device holds floor(1 / part) of them, so two
      // GPUs hold two of 0.6, not three; a node's share of a device (GPU
      // 0.5) holds what fits in it.
      if (name == "GPU" && amount < 1 - 1e-9) {
        const double devices = std::floor(have + 1e-9);
        const double share = std::max(0.0, have - devices);
        fits = std::min(fits, devices * std::floor(1 / amount + 1e-9) + std::floor(share / amount + 1e-9));
      } else {
        fits = std::min(fits, std::floor(have / amount + 1e-9));
      }
    }
    if (r.empty() || fits >= 1e9) {
      auto cpu = n.total.find("CPU");
      fits = cpu == n.total.end() ? 1 : std::max(1.0, std::floor(cpu->second));
    }
    total += static_cast<int>(std::min(fits, 1e6));
  }
  return total;
}

std::string describe_nodes(const std::vector<NodeInfo>& nodes) {
  std::string out;
  for (const auto& n : nodes)
    if (n.alive) out += (out.empty() ? "{" : ", {") + head::format_resources(n.total) + "}";
  return out.empty() ? "no live nodes" : out;
}

}  // namespace

int TaskSubmitter::effective_cap(const Key& k) const {
  const int base = options_.max_executors > 0 ? options_.max_executors : k.cap;
  return k.surge > 0 ? std::max(base, std::min(base + k.surge, kZeroRequestCeiling)) : base;
}

int TaskSubmitter::working_count(const Key& k) {
  return static_cast<int>(
      std::count_if(k.executors.begin(), k.executors.end(), [](const auto& e) { return !e->sidelined(); }));
}

std::exception_ptr TaskSubmitter::worker_died(const std::string& task, const Executor& e, const std::string& cause) {
  return std::make_exception_ptr(WorkerDied("task '" + task + "' failed: its worker (task executor actor " +
                                            std::to_string(e.id) + ", pid " + std::to_string(e.pid) +
                                            ") died while running it: " + cause));
}

std::exception_ptr TaskSubmitter::head_gone(const Key& key, const std::string& cause) {
  return std::make_exception_ptr(WorkerDied("tasks " + key.text +
                                            " cannot run: the cluster's head is gone (the cluster was stopped, or its "
                                            "head was lost for longer than drivers wait for it): " +
                                            cause));
}

namespace {
std::atomic<uint64_t> next_submitter_instance{1};
}  // namespace

TaskSubmitter::TaskSubmitter(Core& core) : core_(core), instance_(next_submitter_instance.fetch_add(1)) {
  leaser_ = std::thread([this] { lease_loop(); });
}

TaskSubmitter::~TaskSubmitter() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (leaser_.joinable()) leaser_.join();
}

void TaskSubmitter::set_options(const TaskSubmitterOptions& options) {
  if (options.pipeline_depth < 1)
    throw ConfigError("pipeline_depth must be >= 1, got " + std::to_string(options.pipeline_depth));
  std::lock_guard lock(mu_);
  options_ = options;
}

std::shared_ptr<TaskSubmitter::Key> TaskSubmitter::key_for(const TaskPlacement& p) {
  std::string id = encode_inline(p);
  {
    std::lock_guard lock(mu_);
    auto it = keys_.find(id);
    if (it != keys_.end()) return it->second;
  }
  head::validate_resources(p.resources, "task options");
  auto key = std::make_shared<Key>();
  key->text = "{" + head::format_resources(p.resources) + "}";
  if (p.placement_group) key->text += " in placement group " + std::to_string(p.placement_group);
  if (p.node_affinity)
    key->text += std::string(" on node ") + std::to_string(p.node_affinity) + (p.affinity_soft ? " (soft)" : "");
  if (p.max_calls < 0)
    throw ConfigError("task max_calls must be >= 0 (0 = no limit), got " + std::to_string(p.max_calls));
  if (p.max_calls > 0) key->text += " max_calls " + std::to_string(p.max_calls);
  key->max_calls = p.max_calls;
  std::vector<NodeInfo> nodes;
  try {
    nodes = core_.head().call_empty<std::vector<NodeInfo>>(Op::kNodes, kNodeListWait);
  } catch (const ConnectionError& e) {
    if (core_.head().is_closed()) std::rethrow_exception(head_gone(*key, e.what()));
    throw;
  } catch (const Timeout&) {
    // A head that stalls: the tasks are taken (.remote() blocked for the
    // call's 30 s, then failed) and wait for their executors; what fits
    // where is counted at the first lease (refresh_cap).
    key->cap_unknown = true;
  }
  // Hard affinity: only that node's room counts (the head refuses a node
  // that is not alive, naming it).
  if (p.node_affinity && !p.affinity_soft)
    std::erase_if(nodes, [&](const NodeInfo& n) { return n.id != p.node_affinity; });
  int fits = fit_count(p.resources, nodes);
  if (fits == 0 && !p.placement_group && !nodes.empty()) {
    if (p.node_affinity && !p.affinity_soft)
      throw ConfigError("task resources " + key->text + " do not fit on node " + std::to_string(p.node_affinity) +
                        " (" + describe_nodes(nodes) + "), which a hard node affinity allows alone");
    throw ConfigError("task resources " + key->text + " fit on no node of the cluster (" + describe_nodes(nodes) + ")");
  }
  key->cap = std::max(1, fits);
  key->zero_request = !p.placement_group && !p.resources.empty() &&
                      std::none_of(p.resources.begin(), p.resources.end(), [](const auto& r) { return r.second > 0; });
  key->spec.type_key = kTaskExecutorKey;
  key->spec.class_name = kTaskExecutorClass;
  key->spec.resources = p.resources;
  key->spec.placement_group = p.placement_group;
  key->spec.bundle_index = p.bundle_index;
  key->spec.executable = p.executable.empty() ? core::self_executable_path() : p.executable;
  key->spec.env = p.env;
  key->spec.node_affinity = p.node_affinity;
  key->spec.affinity_soft = p.affinity_soft;
  std::lock_guard lock(mu_);
  return keys_.emplace(id, key).first->second;  // a racing caller's key wins
}

uint64_t TaskSubmitter::submit(const std::shared_ptr<Key>& key, const std::string& name, Encoder&& body,
                               int max_retries, Complete complete, Fail fail, bool keep_result) {
  wire::Unsent unsent = body.take_unsent();
  check_sendable(body.bytes(), body.attachments(), [&] { return "the arguments of task '" + name + "'"; });
  auto t = std::make_shared<Task>();
  t->op = keep_result ? kKeepResult : 0;
  t->key = key;
  t->name = name;
  t->body = std::move(body.bytes());
  t->attachments = std::move(body.attachments());
  t->retries_left = max_retries;
  t->complete = std::move(complete);
  t->fail = std::move(fail);
  t->unsent = std::move(unsent);
  std::vector<Send> sends;
  uint64_t id = 0;
  {
    std::lock_guard lock(mu_);
    if (!stopping_) {
      id = t->id = next_task_id_++;
      if (tasks_.size() >= sweep_at_) {
        std::erase_if(tasks_, [](const auto& entry) { return entry.second.expired(); });
        sweep_at_ = std::max<size_t>(1024, 2 * tasks_.size());
      }
      tasks_.emplace(id, t);
      key->queue.push_back(std::move(t));
      sends = pump_locked(key);
    }
  }
  if (t) {
    fail_task(t, std::make_exception_ptr(Error("task '" + name + "' submitted after the runtime shut down")));
    return 0;
  }
  send(std::move(sends));
  return id;
}

void TaskSubmitter::finish(const std::shared_ptr<Task>& t, Message& m) {
  // Even when cancel() ended it first: `complete` decodes the reply (its
  // future keeps the first completion), so that the refs inside it are
  // registered and then let go, rather than stay pinned at the executor.
  t->ended = true;
  t->complete(m);
}

void TaskSubmitter::fail_task(const std::shared_ptr<Task>& t, std::exception_ptr error) {
  if (!t->ended.exchange(true)) t->fail(std::move(error));
}

std::string TaskSubmitter::describe(uint64_t id) const {
  std::vector<std::shared_ptr<ActorClient>> starting;  // asked outside mu_ (their own lock)
  std::string text;
  {
    std::lock_guard lock(mu_);
    auto it = tasks_.find(id);
    std::shared_ptr<Task> t;
    if (it == tasks_.end() || !(t = it->second.lock()) || t->ended || t->cancelled) return "";
    const Key& key = *t->key;
    if (const auto& e = t->on) {
      const auto at = std::find(e->sent.begin(), e->sent.end(), t.get());
      const auto ahead = at == e->sent.end() ? 0 : at - e->sent.begin();
      return "task '" + t->name + "' " +
             (ahead == 0 ? std::string("runs")
                         : "waits behind " + std::to_string(ahead) + " task" + (ahead == 1 ? "" : "s")) +
             " on its executor, worker pid " + std::to_string(e->pid);
    }
    if (t->ran) return "task '" + t->name + "' lost its worker and waits to run again";
    int ready = 0;
    for (const auto& e : key.executors) {
      if (e->ready) {
        ++ready;
      } else if (e->client) {
        starting.push_back(e->client);
      }
    }
    text = "task '" + t->name + "' is queued (" + std::to_string(key.queue.size()) + " queued) for an executor of " +
           key.text + "; " + std::to_string(ready) + " busy, " + std::to_string(starting.size()) + " starting";
  }
  for (const auto& c : starting) {
    const auto info = c->info();
    if (!info.pending_reason.empty()) return text + " (" + info.pending_reason + ")";
  }
  return text;
}

TaskSubmitter::Cancel TaskSubmitter::cancel(uint64_t id, bool force) {
  Cancel out;
  std::shared_ptr<Task> t;
  std::shared_ptr<Executor> to_kill;
  {
    std::lock_guard lock(mu_);
    auto it = tasks_.find(id);
    if (it == tasks_.end() || !(t = it->second.lock()) || t->ended || t->cancelled) return out;
    tasks_.erase(it);
    t->cancelled = true;
    if (const auto& e = t->on) {
      out.executor = e->client;
      // Only the task it runs is worth its process: one still waiting in
      // its mailbox is skipped there as without force.
      bool running = !e->sent.empty() && e->sent.front() == t.get();
      out.outcome = force && running ? Cancel::kKilled : Cancel::kRunning;
      if (out.outcome == Cancel::kKilled) to_kill = e;
    } else {
      // Queued, or lost with its executor and waiting for the cause of
      // death (then it is no longer in the queue).
      auto& q = t->key->queue;
      q.erase(std::remove(q.begin(), q.end(), t), q.end());
      out.outcome = Cancel::kDequeued;
    }
  }
  std::string how = out.outcome == Cancel::kKilled ? " (its worker was killed)" : "";
  if (t->ended.exchange(true)) {
    out.outcome = Cancel::kDone;  // its answer came meanwhile
    return out;
  }
  t->fail(std::make_exception_ptr(TaskCancelled("task '" + t->name + "' was cancelled" + how)));
  if (to_kill) {
    {
      // The other tasks in flight there run again elsewhere (on_task_lost).
      std::lock_guard lock(mu_);
      to_kill->killed_for_cancel = true;
    }
    kill_executor(to_kill->id, "its task '" + t->name + "' was cancelled");
  }
  return out;
}

std::vector<TaskSubmitter::Send> TaskSubmitter::pump_locked(const std::shared_ptr<Key>& key) {
  std::vector<Send> out;
  Key& k = *key;
  bool can_grow = working_count(k) + k.requested < effective_cap(k);
  // While executors may still come (leasable or starting), tasks wait here
  // rather than queue behind others on the first one ready.
  bool more_coming = can_grow || k.requested > 0 ||
                     std::any_of(k.executors.begin(), k.executors.end(), [](const auto& e) { return !e->ready; });
  int depth = more_coming ? 1 : options_.pipeline_depth;
  while (!k.queue.empty()) {
    Executor* best = nullptr;
    std::shared_ptr<Executor> best_ptr;
    for (auto& e : k.executors)
      if (e->ready && !e->sidelined() && !(e->handing_back && e->inflight > 0) &&
          (!best || e->inflight < best->inflight)) {
        best = e.get();
        best_ptr = e;
      }
    if (!best || best->inflight >= depth) break;
    // Told under mu_, as lends are (reap_idle): the head hears this
    // process's lends and take-backs of an executor in their order.
    if (std::exchange(best->lent_idle, false)) lend(best->id, false);
    if (best->inflight++ == 0) best->progress_at = Clock::now();
    ++best->sent_count;
    if (k.max_calls > 0 && !best->holds_objects && ++best->given >= k.max_calls) best->spent = true;
    auto t = std::move(k.queue.front());
    k.queue.pop_front();
    t->unsent.sent();
    best->sent.push_back(t.get());
    t->on = best_ptr;
    out.emplace_back(std::move(best_ptr), std::move(t));
  }
  if (can_grow && !k.queue.empty()) request_leases_locked(key);
  if (k.queue.empty()) steal_locked(key, Clock::now());
  return out;
}

// Nothing queued here, an executor idle, and another with tasks queued
// behind one that has run for kStealAfter (pipelined behind a long task):
// that one hands them back (HandBackQueued, sent by send()) and they go to
// the idle one, rather than wait while a CPU stays idle. Checked when a
// task ends and by the lease thread's periodic pass.
void TaskSubmitter::steal_locked(const std::shared_ptr<Key>& key, Clock::time_point now) {
  Key& k = *key;
  Executor* victim = nullptr;
  bool idle = false;
  bool starting = false;
  for (auto& e : k.executors) {
    starting = starting || !e->ready;
    // A spent one takes no tasks, but what it has queued may be handed back.
    if (!e->ready || e->blocked || e->bounced) continue;
    if (e->inflight == 0 && !e->spent) idle = true;
    if (e->inflight >= 2 && !e->handing_back && now - e->progress_at >= kStealAfter &&
        (!victim || e->inflight > victim->inflight))
      victim = e.get();
  }
  if (victim && !idle && !starting && k.zero_request && k.requested == 0 && !stopping_ &&
      now - victim->progress_at >= kSurgeAfter && options_.max_executors == 0 &&
      static_cast<int>(k.executors.size()) < kZeroRequestCeiling) {
    // Nothing idle to take them: one more executor, which takes them once
    // ready (this runs again then).
    ++k.surge;
    ++k.requested;
    lease_requests_.push_back(key);
    cv_.notify_all();
    return;
  }
  if (!idle || !victim) return;
  victim->handing_back = true;
  hand_backs_.push_back(victim->client);
}

void TaskSubmitter::request_leases_locked(const std::shared_ptr<Key>& key) {
  Key& k = *key;
  if (stopping_) return;
  int starting = k.requested;
  for (auto& e : k.executors)
    if (!e->ready) ++starting;
  int room = effective_cap(k) - working_count(k) - k.requested;
  int want = std::min<int>(room, static_cast<int>(k.queue.size()) - starting);
  if (want <= 0) return;
  k.requested += want;
  for (int i = 0; i < want; ++i) lease_requests_.push_back(key);
  cv_.notify_all();
}

void TaskSubmitter::send(std::vector<Send> sends) {
  std::vector<std::shared_ptr<ActorClient>> hand_backs;
  {
    std::lock_guard lock(mu_);
    hand_backs.swap(hand_backs_);
  }
  // The tasks come back as bounced replies. None back (they were still on
  // their way into its mailbox): it may be asked again.
  for (const auto& c : hand_backs) {
    auto answer = c->control(HandBackQueued{});
    answer.on_ready([this, answer, c]() mutable {
      int32_t n = 0;
      try {
        n = answer.get();
      } catch (const std::exception&) {
        return;  // gone: nothing to take
      }
      if (n > 0) return;
      std::lock_guard lock(mu_);
      for (auto& [id, key] : keys_)
        for (auto& e : key->executors)
          if (e->client == c) e->handing_back = false;
    });
  }
  for (auto& [e, t] : sends) {
    // A copy (attachments are shared, not copied): the task may run again
    // on another executor should this one die, as a retry or because
    // another task's forced cancel killed it.
    Encoder body;
    body.bytes() = t->body;
    body.attachments() = t->attachments;
    // A copy to capture: clang before 16 cannot capture a structured binding.
    auto task = t;
    e->client->submit(
        task->op, std::move(body), [this, task](Message& m) { on_task_done(task, m); },
        [this, task](std::exception_ptr ex) { on_task_lost(task, core::exception_text(ex)); });
  }
}

void TaskSubmitter::on_task_done(const std::shared_ptr<Task>& t, Message& m) {
  if (m.op & kBounced) return on_task_bounced(t, m);
  finish(t, m);
  std::vector<Send> sends;
  bool wake = false;
  {
    std::lock_guard lock(mu_);
    if (auto& e = t->on) {
      // As its store is now: objects it held once may all be freed (kept
      // for good, it held its GPU or custom resources, which no lend gives
      // back, for as long as this process lived).
      e->holds_objects = (t->op & kKeepResult) || (m.op & kHoldsObjects);
      // Released, its objects would go with it; kept spent, it would hold
      // its resources (a GPU) for good. It stays and takes tasks again.
      if (e->spent && e->holds_objects) {
        e->spent = false;
        TROUPE_LOG_WARN(
            "tasks {}: executor {} keeps objects its tasks returned by reference, so it stays and runs more than "
            "max_calls {} tasks",
            t->key->text, e->id, t->key->max_calls);
      }
      e->bounced = false;
      e->handing_back = false;
      e->progress_at = Clock::now();
      e->unsend(t.get());
      if (--e->inflight == 0) e->idle_since = Clock::now();
      // Spent and done: the lease thread releases it now.
      if (e->spent && e->inflight == 0) wake = retire_requested_ = true;
      e.reset();
    }
    sends = pump_locked(t->key);
    // Room is wanted: an executor left without work goes now.
    if (resources_wanted_ && sends.empty()) wake = release_idle_requested_ = true;
  }
  if (wake) cv_.notify_all();
  send(std::move(sends));
}

// The executor's task waits in get(), and `t` was queued behind it: it goes
// to the front of the queue again, with its body as the executor handed it
// back, and does not count as a retry.
void TaskSubmitter::on_task_bounced(const std::shared_ptr<Task>& t, Message& m) {
  std::vector<Send> sends;
  std::exception_ptr error;
  {
    std::lock_guard lock(mu_);
    std::shared_ptr<Executor> e = std::move(t->on);
    if (!e) return;
    e->unsend(t.get());
    // A bounce can trail the waiting task's own answer (the executor's I/O
    // thread refused it just before the task resumed): then nothing waits
    // there any more. One handed back on request says nothing of waiting.
    if (--e->inflight > 0) {
      if (!(m.op & kHandedBack)) e->bounced = true;
    } else {
      e->idle_since = Clock::now();
    }
    if (t->cancelled) {
      // Ended by cancel(): it does not queue again.
    } else if (stopping_) {
      // release_all failed the queues already: this one would wait for ever.
      error = std::make_exception_ptr(Error("task '" + t->name + "' did not run: the runtime shut down"));
    } else {
      t->body = std::move(m.body);
      t->attachments = std::move(m.attachments);
      t->key->queue.push_front(t);
      sends = pump_locked(t->key);
    }
  }
  send(std::move(sends));
  if (error) fail_task(t, error);
}

void TaskSubmitter::on_task_lost(const std::shared_ptr<Task>& t, const std::string& reason) {
  std::vector<Send> sends;
  std::exception_ptr error;
  {
    std::lock_guard lock(mu_);
    std::shared_ptr<Executor> e = std::move(t->on);
    if (!e) return;
    if (!std::exchange(e->loss_seen, true)) e->running_when_lost = e->sent.empty() ? nullptr : e->sent.front();
    const bool started = e->running_when_lost == t.get();
    e->unsend(t.get());
    --e->inflight;
    if (!e->gone && e->death_cause.empty() && !e->killed_for_cancel && !stopping_) {
      // The worker may live on (a connection cut, not a crash): killed
      // unless the head says it died first (reap_idle).
      e->cut_off_since = Clock::now();
      e->cut_off_why = reason;
      cut_off_.push_back(e);
    }
    drop_executor_locked(*t->key, *e, "");
    if (t->cancelled) {
      // Ended by cancel() (whose forced kill may be what ended the worker).
    } else if (e->killed_for_cancel && !stopping_) {
      // Another task's cancel killed the worker: not this task's failure.
      t->key->queue.push_front(t);
      sends = pump_locked(t->key);
    } else if (stopping_) {
      error =
          std::make_exception_ptr(Error("task '" + t->name + "' did not finish: the runtime shut down while it ran"));
    } else if (t->retries_left != 0) {
      // One that had not started spends no retry.
      if (t->retries_left > 0 && started) --t->retries_left;
      t->ran = t->ran || started;
      TROUPE_LOG_INFO("task '{}' lost its worker ({}); running it again", t->name, reason);
      t->key->queue.push_front(t);
      sends = pump_locked(t->key);
    } else if (!started && !e->death_cause.empty()) {
      t->key->queue.push_front(t);  // its worker died before it started
      sends = pump_locked(t->key);
    } else if (e->death_cause.empty()) {
      // The head's word on why the worker died is usually a moment behind
      // the connection's; the task waits for it (bounded) to report it.
      if (e->lost.empty()) {
        e->lost_since = Clock::now();
        awaiting_cause_.push_back(e);
      }
      e->lost.emplace_back(t, reason);
      if (!started) e->lost_not_started.insert(t.get());
    } else {
      error = worker_died(t->name, *e, e->death_cause);
    }
  }
  send(std::move(sends));
  if (error) fail_task(t, error);
}

std::vector<std::shared_ptr<TaskSubmitter::Task>> TaskSubmitter::drop_executor_locked(Key& key, Executor& e,
                                                                                      const std::string& cause) {
  if (!cause.empty() && e.death_cause.empty()) e.death_cause = cause;
  if (!e.gone) {
    e.gone = true;
    auto& v = key.executors;
    v.erase(std::remove_if(v.begin(), v.end(), [&](const auto& p) { return p.get() == &e; }), v.end());
    if (key.surge > 0) --key.surge;
  }
  // Tasks that waited for the cause of death can now be told it.
  std::vector<std::shared_ptr<Task>> lost;
  if (e.death_cause.empty()) return lost;
  for (auto& [t, reason] : e.lost) lost.push_back(t);
  e.lost.clear();
  return lost;
}

TaskSubmitter::Failures TaskSubmitter::fail_queue_locked(Key& key, std::exception_ptr error) {
  Failures out;
  for (auto& t : key.queue) out.emplace_back(t, error);
  key.queue.clear();
  return out;
}

void TaskSubmitter::on_executor_update(const std::shared_ptr<Key>& key, const std::shared_ptr<Executor>& e,
                                       const ActorInfo& info) {
  std::vector<Send> sends;
  Failures failures;
  bool died = false;
  {
    std::lock_guard lock(mu_);
    if (info.state == ActorState::kAlive && !e->gone && !e->ready) {
      e->ready = true;
      e->pid = info.pid;
      e->blocked = info.blocked;
      e->idle_since = Clock::now();
      key->failed_leases = 0;
      sends = pump_locked(key);
    } else if (info.state == ActorState::kAlive && !e->gone && e->blocked != info.blocked) {
      // Its task waits (or resumed): the tasks queued here go elsewhere,
      // to a new executor if need be, which the lent CPU may hold.
      e->blocked = info.blocked;
      e->bounced = false;
      sends = pump_locked(key);
    } else if (info.state == ActorState::kPending && !info.pending_reason.empty() && !e->gone &&
               !key->spec.placement_group && !std::exchange(key->check_queued, true)) {
      // Waiting for resources: perhaps for a node that is gone for good.
      feasibility_checks_.push_back(key);
      cv_.notify_all();
    } else if (info.state == ActorState::kDead && e->death_cause.empty()) {
      died = true;
      std::string cause = info.death_cause.empty() ? "the head reports it dead" : info.death_cause;
      bool never_started = !e->ready;
      // Those that had not started run again: their worker is dead, so
      // they cannot run twice.
      for (auto& t : drop_executor_locked(*key, *e, cause)) {
        if (e->lost_not_started.erase(t.get()))
          key->queue.push_front(t);
        else
          failures.emplace_back(t, worker_died(t->name, *e, cause));
      }
      std::erase(awaiting_cause_, e);
      if (never_started && core_.head_lost()) {
        // Not the executors' fault, and no retry can start one: say what
        // happened (it read "died 3 times in a row before starting").
        auto queued = fail_queue_locked(*key, head_gone(*key, cause));
        failures.insert(failures.end(), queued.begin(), queued.end());
      } else if (never_started && key->spec.placement_group &&
                 cause == head::placement_group_removed_cause(key->spec.placement_group)) {
        // Nor can one start in a group that is gone (it read "task
        // executors ... died 3 times in a row", a WorkerCrashedError). A
        // task that ran there, whose worker the removal killed, failed as
        // if it never had: it is a WorkerCrashedError, as in Ray.
        const auto never_ran = std::make_exception_ptr(
            ConfigError("tasks " + key->text + " cannot run: " + cause + " (Ray's TaskPlacementGroupRemoved)"));
        for (auto& t : key->queue)
          failures.emplace_back(
              t, t->ran ? std::make_exception_ptr(WorkerDied("task '" + t->name + "' ran, and its worker was killed: " +
                                                             cause + "; no retry can run in a group that is gone"))
                        : never_ran);
        key->queue.clear();
      } else if (never_started && ++key->failed_leases >= kMaxFailedLeases) {
        auto error = std::make_exception_ptr(WorkerDied("task executors for " + key->text + " died " +
                                                        std::to_string(kMaxFailedLeases) +
                                                        " times in a row before starting; the last: " + cause));
        key->failed_leases = 0;
        auto queued = fail_queue_locked(*key, error);
        failures.insert(failures.end(), queued.begin(), queued.end());
      } else {
        sends = pump_locked(key);
      }
    }
  }
  if (died) core_.forget_actor(e->id);
  send(std::move(sends));
  for (auto& [t, error] : failures) fail_task(t, error);
}

void TaskSubmitter::lease_loop() {
  std::unique_lock lock(mu_);
  while (!stopping_) {
    auto period = std::clamp<std::chrono::milliseconds>(options_.idle_release / 4, std::chrono::milliseconds(10),
                                                        std::chrono::milliseconds(250));
    cv_.wait_for(lock, period,
                 [&] { return stopping_ || !lease_requests_.empty() || release_idle_requested_ || retire_requested_; });
    while (!stopping_ && !lease_requests_.empty()) {
      auto key = std::move(lease_requests_.front());
      lease_requests_.pop_front();
      lock.unlock();
      lease_one(key);
      lock.lock();
    }
    for (size_t n = feasibility_checks_.size(); !stopping_ && n > 0; --n) {
      auto key = std::move(feasibility_checks_.front());
      feasibility_checks_.pop_front();
      lock.unlock();
      check_feasible(key);
      lock.lock();
    }
    if (!stopping_) reap_idle(lock);
    if (!stopping_ && !objects_asks_.empty()) {
      auto asks = std::exchange(objects_asks_, {});
      lock.unlock();
      ask_objects_held(asks);
      lock.lock();
    }
    if (!stopping_) {
      auto now = Clock::now();
      for (auto& [id, key] : keys_)
        if (key->queue.empty()) steal_locked(key, now);
      if (!hand_backs_.empty()) {
        lock.unlock();
        send({});
        lock.lock();
      }
    }
  }
}

void TaskSubmitter::lease_one(const std::shared_ptr<Key>& key) {
  ActorInfo info;
  std::shared_ptr<ActorClient> client;
  std::exception_ptr error;
  try {
    info = core_.create_actor(key->spec, [this] {
      std::lock_guard lock(mu_);
      return stopping_;
    });
    client = core_.actor(info);
    client->stop_awaiting_causes();  // a lost task waits for its cause here (kDeathCauseWait)
  } catch (const ConfigError& e) {
    // The head speaks of the executor actor; the tasks are what was asked.
    error = std::make_exception_ptr(ConfigError("tasks " + key->text + ": " + e.what()));
  } catch (const ConnectionError& e) {
    // The head closed as it went (`troupe stop`): its channel fails the
    // call before the core hears of the loss, so say it here.
    error = core_.head().is_closed() ? head_gone(*key, e.what()) : std::current_exception();
  } catch (...) {
    error = std::current_exception();
  }
  auto e = std::make_shared<Executor>();
  Failures failures;
  {
    std::lock_guard lock(mu_);
    --key->requested;
    if (error && key->surge > 0) --key->surge;
    if (error) {
      failures = fail_queue_locked(*key, error);
    } else {
      // Waiting for resources: executors of other keys, idle, may hold them.
      if (info.state == ActorState::kPending && !info.pending_reason.empty()) release_idle_requested_ = true;
      e->client = client;
      e->id = info.id;
      key->executors.push_back(e);
    }
  }
  for (auto& [t, x] : failures) fail_task(t, x);
  if (error) return;
  if (key->cap_unknown) refresh_cap(key);
  std::weak_ptr<Executor> weak = e;
  std::weak_ptr<Key> weak_key = key;
  client->add_listener([this, weak, weak_key](const ActorInfo& i) {
    auto e = weak.lock();
    auto k = weak_key.lock();
    if (e && k) on_executor_update(k, e, i);
  });
  // It may have started before the listener was in place.
  on_executor_update(key, e, client->info());
}

void TaskSubmitter::refresh_cap(const std::shared_ptr<Key>& key) {
  std::vector<NodeInfo> nodes;
  try {
    nodes = core_.head().call_empty<std::vector<NodeInfo>>(Op::kNodes, kNodeListWait);
  } catch (const std::exception&) {
    return;  // at the next lease
  }
  if (key->spec.node_affinity && !key->spec.affinity_soft)
    std::erase_if(nodes, [&](const NodeInfo& n) { return n.id != key->spec.node_affinity; });
  const int fits = fit_count(key->spec.resources, nodes);
  std::lock_guard lock(mu_);
  key->cap = std::max(1, fits);
  key->cap_unknown = false;
}

// Idle executors kept for their objects: one whose store is empty now (its
// refs fetched and let go), and that took no task since it was asked, goes
// at the next reap like any idle one.
void TaskSubmitter::ask_objects_held(const std::vector<std::shared_ptr<Executor>>& asks) {
  for (const auto& e : asks) {
    Future<int64_t> answer;
    try {
      answer = e->client->control(ObjectsHeld{});
    } catch (const std::exception&) {
      continue;  // gone: its death is handled as any
    }
    std::weak_ptr<Executor> weak = e;
    answer.on_ready([this, answer, weak]() mutable {
      int64_t held = 1;
      try {
        held = answer.get();
      } catch (const std::exception&) {
        return;  // an older worker without the control, or gone: kept as it was
      }
      auto e = weak.lock();
      if (!e || held != 0) return;
      std::lock_guard lock(mu_);
      if (!e->gone && e->inflight == 0 && e->sent_count == e->sent_when_asked) e->holds_objects = false;
    });
  }
}

void TaskSubmitter::reap_idle(std::unique_lock<std::mutex>& lock) {
  auto now = Clock::now();
  const auto idle_for = std::exchange(release_idle_requested_, false) || resources_wanted_
                            ? Clock::duration::zero()
                            : Clock::duration(options_.idle_release);
  retire_requested_ = false;
  std::vector<uint64_t> idle;
  for (auto& [id, key] : keys_) {
    auto& v = key->executors;
    for (auto it = v.begin(); it != v.end();) {
      Executor& e = **it;
      if (e.ready && e.inflight == 0 && (e.spent || now - e.idle_since >= idle_for)) {
        if (e.holds_objects) {
          if (!std::exchange(e.lent_idle, true)) lend(e.id, true);  // under mu_: see pump_locked
          if (e.client && now - e.objects_asked_at >= kAskObjectsEvery) {
            e.objects_asked_at = now;
            e.sent_when_asked = e.sent_count;
            objects_asks_.push_back(*it);
          }
          ++it;
          continue;
        }
        e.gone = true;
        idle.push_back(e.id);
        it = v.erase(it);
        if (key->surge > 0) --key->surge;  // back toward the CPU count
      } else {
        ++it;
      }
    }
  }
  Failures overdue;
  for (auto it = awaiting_cause_.begin(); it != awaiting_cause_.end();) {
    Executor& e = **it;
    if (now - e.lost_since < kDeathCauseWait) {
      ++it;
      continue;
    }
    for (auto& [t, reason] : e.lost) overdue.emplace_back(t, worker_died(t->name, e, reason));
    e.lost.clear();
    it = awaiting_cause_.erase(it);
  }
  // Executors whose connection failed and whose death the head has not
  // reported within kDeathCauseWait live on, cut off from this driver,
  // holding resources nobody would release: killed.
  std::vector<std::pair<uint64_t, std::string>> cut;
  for (auto it = cut_off_.begin(); it != cut_off_.end();) {
    Executor& e = **it;
    if (e.death_cause.empty() && now - e.cut_off_since < kDeathCauseWait) {
      ++it;
      continue;
    }
    if (e.death_cause.empty()) cut.emplace_back(e.id, e.cut_off_why);
    it = cut_off_.erase(it);
  }
  if (idle.empty() && overdue.empty() && cut.empty()) return;
  lock.unlock();
  for (uint64_t id : idle) kill_executor(id);
  for (const auto& [id, why] : cut) {
    TROUPE_LOG_WARN(
        "task executor {}: its connection failed ({}) but its worker lives on; killing it so that its "
        "resources come back",
        id, why);
    kill_executor(id, "its driver's connection to it failed (" + why + ")");
  }
  for (auto& [t, error] : overdue) fail_task(t, error);
  lock.lock();
}

void TaskSubmitter::check_feasible(const std::shared_ptr<Key>& key) {
  {
    std::lock_guard lock(mu_);
    if (Clock::now() < key->next_feasibility_check) {
      feasibility_checks_.push_back(key);
      return;
    }
  }
  std::vector<NodeInfo> nodes;
  try {
    nodes = core_.head().call_empty<std::vector<NodeInfo>>(Op::kNodes);
  } catch (const std::exception&) {
    // Asked again in a second: no update may come to ask (the executor
    // stays PENDING with the same reason).
    std::lock_guard lock(mu_);
    key->next_feasibility_check = Clock::now() + std::chrono::seconds(1);
    feasibility_checks_.push_back(key);
    return;
  }
  if (key->spec.node_affinity && !key->spec.affinity_soft)
    std::erase_if(nodes, [&](const NodeInfo& n) { return n.id != key->spec.node_affinity; });
  const bool feasible = fit_count(key->spec.resources, nodes) > 0;
  Failures failures;
  std::vector<uint64_t> pending;
  {
    std::lock_guard lock(mu_);
    const bool waiting =
        std::any_of(key->executors.begin(), key->executors.end(), [](const auto& e) { return !e->ready && !e->gone; });
    const auto now = Clock::now();
    if (!waiting) {
      key->infeasible_since.reset();
      key->check_queued = false;
      return;
    }
    if (feasible) {
      // Still waiting for room that exists: asked again in a second while
      // an executor waits, so that a node's death seen after this answer
      // (no new update need come) still fails the queue.
      key->infeasible_since.reset();
      key->next_feasibility_check = now + std::chrono::seconds(1);
      feasibility_checks_.push_back(key);
      return;
    }
    if (!key->infeasible_since) key->infeasible_since = now;
    if (now - *key->infeasible_since < options_.infeasible_grace) {
      // Asked again until it is one or the other, a tenth of the grace
      // (at most a second) later.
      key->next_feasibility_check =
          now + std::min<Clock::duration>(std::chrono::seconds(1), options_.infeasible_grace / 10);
      feasibility_checks_.push_back(key);
      return;
    }
    key->infeasible_since.reset();
    key->check_queued = false;
    auto error = std::make_exception_ptr(
        ConfigError("task resources " + key->text + " fit on no live node of the cluster any more (" +
                    (describe_nodes(nodes).empty() ? std::string("no node alive") : describe_nodes(nodes)) +
                    ") after " + std::to_string(options_.infeasible_grace.count() / 1000) +
                    " s of waiting: the node that could hold them is gone"));
    failures = fail_queue_locked(*key, error);
    // Dropped here, not when their deaths are heard: kill_executor forgets
    // them, so no update comes, and a pending executor left in the key
    // would hold the next task of these resources for ever.
    std::vector<std::shared_ptr<Executor>> waiting_ones;
    for (auto& e : key->executors)
      if (!e->ready && !e->gone) waiting_ones.push_back(e);
    for (auto& e : waiting_ones) {
      drop_executor_locked(*key, *e, "no live node can hold it");
      pending.push_back(e->id);
    }
  }
  for (uint64_t id : pending) kill_executor(id, "no live node can hold it");
  for (auto& [t, error] : failures) fail_task(t, error);
}

void TaskSubmitter::lend(uint64_t id, bool lend) {
  try {
    // Executors never restart: incarnation 0.
    core_.head().send(make_event_value(Op::kLendResources, LendResources{id, 0, lend}));
  } catch (const std::exception& x) {
    TROUPE_LOG_DEBUG("lending task executor {}'s resources: {}", id, x.what());
  }
}

void TaskSubmitter::kill_executor(uint64_t id, const std::string& why) {
  try {
    core_.head().call<void>(Op::kKillActor, KillActor{id, true, why});
  } catch (const std::exception& x) {
    TROUPE_LOG_DEBUG("releasing task executor {}: {}", id, x.what());
  }
  core_.forget_actor(id);
}

void TaskSubmitter::release_idle() {
  {
    std::lock_guard lock(mu_);
    release_idle_requested_ = true;
  }
  cv_.notify_all();
}

void TaskSubmitter::set_resources_wanted(bool wanted) {
  {
    std::lock_guard lock(mu_);
    resources_wanted_ = wanted;
    if (wanted) release_idle_requested_ = true;
  }
  if (wanted) cv_.notify_all();
}

void TaskSubmitter::tell_lends_again() {
  // Under mu_, as every change of lent_idle and its telling are.
  std::lock_guard lock(mu_);
  for (auto& [name, key] : keys_)
    for (auto& e : key->executors)
      if (e->ready && !e->gone && e->holds_objects) lend(e->id, e->lent_idle);
}

bool TaskSubmitter::resources_wanted() const {
  std::lock_guard lock(mu_);
  return resources_wanted_;
}

void TaskSubmitter::release_all() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (leaser_.joinable()) leaser_.join();
  std::vector<std::shared_ptr<ActorClient>> clients;
  Failures failures;
  {
    std::lock_guard lock(mu_);
    auto error = std::make_exception_ptr(Error("the runtime shut down before the task ran"));
    for (auto& [id, key] : keys_) {
      for (auto& e : key->executors) {
        e->gone = true;
        clients.push_back(e->client);
      }
      key->executors.clear();
      auto queued = fail_queue_locked(*key, error);
      failures.insert(failures.end(), queued.begin(), queued.end());
    }
    // Tasks that lost their worker and wait for the head's word on its
    // death: the lease thread that would end the wait is gone, and their
    // gets would wait for ever.
    for (auto& e : std::exchange(awaiting_cause_, {}))
      for (auto& [t, reason] : std::exchange(e->lost, {}))
        failures.emplace_back(t, worker_died(t->name, *e, reason + "; the runtime shut down before the head said why"));
  }
  for (auto& [t, error] : failures) fail_task(t, error);
  for (const auto& c : clients) {
    kill_executor(c->id());
    // The core no longer knows the client (it will not detach it): the
    // tasks still running there fail now (on_task_lost), rather than wait
    // for a reply that the stopped I/O loop would never deliver.
    c->detach("the runtime shut down");
  }
}

size_t TaskSubmitter::executor_count() const {
  std::lock_guard lock(mu_);
  size_t n = 0;
  for (const auto& [id, key] : keys_) n += key->executors.size();
  return n;
}

}  // namespace troupe::client
