// WorkerPool: a node agent's warm workers. Per executable it keeps `size`
// worker processes started and waiting (exec, dynamic loading — LibTorch
// included when the executable links it — and static initialisation done),
// each holding one end of a socketpair. A spawn takes an idle one of the
// right executable and sends it its WorkerAssignment; the pool refills in
// the background once that worker serves.
// Workers of an executable unused for `idle_timeout` are
// killed and not refilled until it is used again. An idle worker's exit is
// the pool's business (it is never reported as an actor's exit); a taken
// worker belongs to the agent like a cold-started one. Lives on the agent's
// event loop thread; every method runs there.
#pragma once

#include <sys/types.h>

#include <asio.hpp>

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>

#include "troupe/runtime/core/process.h"
#include "troupe/runtime/core/worker_env.h"
#include "troupe/runtime/node/worker_assignment.h"

namespace troupe::node {

struct WorkerPoolOptions {
  uint32_t size = 2;  // idle workers per executable; 0 disables the pool
  std::chrono::milliseconds idle_timeout{std::chrono::minutes(5)};
  // Where each worker's stdout and stderr go, one file per worker
  // (worker_log_path); "" = the agent's own output.
  std::string log_dir;
  // Log files of exited workers kept in log_dir; older ones are deleted.
  size_t max_exited_logs = 1000;
};

// A worker's own log file, found again by its pid (`troupe logs ACTOR`).
std::string worker_log_path(const std::string& dir, pid_t pid);

// The log files of a node's exited workers: the newest `keep` stay (what
// `troupe logs` reads of dead actors), older ones are deleted, so a node
// running tasks for months does not fill its disk with them. A file whose
// pid a live process has again is that process's (spawn_logged replaced
// it) and stays.
class ExitedLogs {
 public:
  ExitedLogs(std::string dir, size_t keep);
  // The worker `pid` exited and was reaped.
  void exited(pid_t pid);
  size_t kept() const { return latest_.size(); }

 private:
  std::string dir_;
  size_t keep_;
  uint64_t seq_ = 0;
  std::deque<std::pair<pid_t, uint64_t>> order_;  // oldest first; stale entries skipped
  std::unordered_map<pid_t, uint64_t> latest_;    // pid -> its newest entry
};

// Waits for a started worker to serve: `done` runs once, on the event loop,
// at the first of the worker's byte on `socket` (or its closing it by
// dying) and `bound` passing. Destroying the watch cancels both; `done` may
// destroy it.
class ServingWatch {
 public:
  ServingWatch(asio::io_context& io, std::unique_ptr<asio::local::stream_protocol::socket> socket,
               std::chrono::steady_clock::duration bound, std::function<void()> done);
  ~ServingWatch();
  ServingWatch(const ServingWatch&) = delete;
  ServingWatch& operator=(const ServingWatch&) = delete;

 private:
  struct State;
  std::shared_ptr<State> state_;
};
// Spawns `o` with its output in a fresh file of `dir` (none when `dir` is
// empty), named worker_log_path(dir, pid) once the pid is known.
pid_t spawn_logged(core::SpawnOptions o, const std::string& dir);

// Throws ConfigError naming the value when `o` is out of range (size at most
// 64, idle timeout between 1 ms and 30 days).
void validate_pool_options(const WorkerPoolOptions& o);

class WorkerPool {
 public:
  // `base` is what every pooled worker gets in its environment (head, token,
  // node id, hosts, log level); the assignment adds the actor.
  WorkerPool(asio::io_context& io, WorkerPoolOptions options, core::WorkerEnv base);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Marks `executable` in use and starts idle workers for it up to the size.
  void fill(const std::string& executable);
  // Hands `a` to an idle worker of `executable` and returns its pid; nullopt
  // when none is idle. Either way the pool refills in the background: at
  // once when none was idle, else once the taken worker's actor serves.
  std::optional<pid_t> take(const std::string& executable, const WorkerAssignment& a);
  // Reaps idle workers that exited (SIGCHLD); they are not actors' exits.
  void reap();
  // Idle workers that are ready (past their start), over all executables.
  uint32_t idle_count() const;
  // Called (on the event loop) with the new idle_count() whenever it
  // changes, so the agent can report it at once rather than with its next
  // heartbeat.
  void on_idle_count_change(std::function<void(uint32_t)> callback);
  // A worker the pool handed out, or one the agent started cold, exited
  // and was reaped: its log file joins the exited ones kept (ExitedLogs).
  void worker_exited(pid_t pid);
  // Kills and reaps every idle worker; the pool starts nothing after it.
  void stop();
  // Kills and reaps every idle worker and refills the executables in use
  // (a fenced node keeps nothing it started before).
  void recycle();

 private:
  struct Idle {
    std::string executable;
    std::unique_ptr<asio::local::stream_protocol::socket> socket;
    bool ready = false;
  };
  struct Executable {
    std::chrono::steady_clock::time_point last_used;
    bool active = false;     // refilled; false once idle past the timeout
    bool refilling = false;  // a refill is posted
    int failed_starts = 0;   // workers that died before they were ready
  };

  void start_one(const std::string& executable);
  void watch_ready(pid_t pid);
  void post_refill(const std::string& executable);
  void refill_when_serving(pid_t pid, std::unique_ptr<asio::local::stream_protocol::socket> socket,
                           const std::string& executable);
  void refill_after_take(pid_t pid, const std::string& executable);
  size_t count(const std::string& executable) const;
  void check_idle();
  void kill_idle(const std::string& executable);
  void kill_all_idle();
  void report_idle_count();

  asio::io_context& io_;
  const WorkerPoolOptions opts_;
  const core::WorkerEnv base_;
  asio::steady_timer idle_timer_;
  std::map<pid_t, Idle> idle_;
  // Workers just taken, until their actors serve (see take()).
  std::map<pid_t, std::unique_ptr<ServingWatch>> taken_;
  std::map<std::string, Executable> executables_;
  std::function<void(uint32_t)> on_idle_count_change_;
  uint32_t reported_idle_ = 0;
  bool stopped_ = false;
  std::optional<ExitedLogs> exited_logs_;  // when log_dir is set
};

}  // namespace troupe::node
