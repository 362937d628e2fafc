// FaultInjector: failures on demand for tests and experiments. It kills an
// actor's worker process (SIGKILL) or a node agent, stalls a process
// (SIGSTOP, then SIGCONT after a while: a straggler), drops an actor's
// connections (a network fault), now, after a delay, or
// when a job reports reaching a step (on_step). Every injected fault is
// recorded with its time, so tests can measure recovery from it.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "troupe/runtime/client/runtime.h"

namespace troupe::testing {

class LocalCluster;

class FaultInjector {
 public:
  using Clock = std::chrono::steady_clock;
  struct Fault {
    std::string what;
    Clock::time_point at;
  };

  struct LiveActor {
    uint64_t id = 0;
    uint64_t node_id = 0;
    pid_t pid = -1;
  };

  explicit FaultInjector(Runtime& rt) : rt_(rt) {}
  ~FaultInjector();
  FaultInjector(const FaultInjector&) = delete;
  FaultInjector& operator=(const FaultInjector&) = delete;

  // The ALIVE actors of a class (ActorTraits' name, e.g.
  // "troupe::trainer::TrainerActor") with ids above `after`, oldest first:
  // pass last_actor_id() taken before a job starts to see only its actors,
  // not those of an earlier job still being torn down.
  std::vector<LiveActor> live_actors(const std::string& class_name, uint64_t after = 0);
  // The largest actor id the head has handed out so far (0 = none).
  uint64_t last_actor_id();

  // SIGKILLs the current worker process of the actor (it must run on this
  // machine, as in a LocalCluster). Returns the pid killed.
  pid_t kill_actor(uint64_t actor_id);
  // SIGKILLs node agent `index` of the cluster (its workers die with it).
  // troupe::Error when that agent is no longer running.
  void kill_node(LocalCluster& cluster, size_t index);
  // Closes every connection callers have open to the actor's worker (as a
  // network fault would), leaving the process running. Callers see their
  // calls in flight fail as if the actor had died (once the head has named
  // no death within ActorClient::kCauseWait).
  void drop_connections(uint64_t actor_id);
  // SIGSTOPs the actor's worker now and SIGCONTs it after `duration`, or
  // sooner when the injector is destroyed first (a test that ends early
  // leaves no process stopped).
  void stall_actor(uint64_t actor_id, std::chrono::milliseconds duration);

  // Runs `action` after `delay` on the injector's thread.
  void after(std::chrono::milliseconds delay, std::function<void()> action);
  // Runs `action` (once) when on_step reports `step` or later.
  void at_step(int64_t step, std::function<void()> action);
  // Called by the code under test at each step boundary.
  void on_step(int64_t step);

  std::vector<Fault> faults() const;

 private:
  void record(std::string what);
  pid_t pid_of(uint64_t actor_id);

  Runtime& rt_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Fault> faults_;
  std::vector<std::pair<int64_t, std::function<void()>>> step_actions_;
  std::vector<std::thread> timers_;
  std::vector<pid_t> stalled_;  // stall_actor's, until SIGCONTed
  bool stopping_ = false;
};

}  // namespace troupe::testing
