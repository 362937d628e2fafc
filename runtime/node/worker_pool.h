// WorkerPool: a node agent's warm workers. Per executable it keeps `size`
// worker processes started and waiting (exec, dynamic loading — LibTorch
// included when the executable links it — and static initialisation done),
// each holding one end of a socketpair. A spawn takes an idle one of the
// right executable and sends it its WorkerAssignment; the pool refills in
// the background once that worker serves. A taken worker that does not
// acknowledge its assignment within `assign_timeout` (stopped, hung) is
// killed, and the agent starts the actor cold instead.
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
  // How long a taken worker may take to acknowledge its assignment (one
  // taken while still starting has a minute more to finish its start)
  // before the pool kills it and the agent starts the actor cold.
  std::chrono::milliseconds assign_timeout{std::chrono::seconds(10)};
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
// it) and stays. At its start it bounds what agents before it left in the
// directory (prune_left_behind).
class ExitedLogs {
 public:
  ExitedLogs(std::string dir, size_t keep);
  // The worker `pid` exited and was reaped.
  void exited(pid_t pid);
  size_t kept() const { return latest_.size(); }

 private:
  // The logs of workers no process runs any more that are already in the
  // directory (those of an agent killed or stopped before this one
  // started, which no live agent counts; the file names carry no agent):
  // the newest `keep` of them stay, by modification time.
  void prune_left_behind();

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
  using Socket = asio::local::stream_protocol::socket;
  // What ended the watch.
  enum class Seen { kByte, kClosed, kBound };
  ServingWatch(asio::io_context& io, std::unique_ptr<Socket> socket, std::chrono::steady_clock::duration bound,
               std::function<void()> done);
  // As above; `done` also learns what ended the watch, the byte (kByte), and
  // gets the socket back (for a watch of the next byte).
  ServingWatch(asio::io_context& io, std::unique_ptr<Socket> socket, std::chrono::steady_clock::duration bound,
               std::function<void(Seen, char, std::unique_ptr<Socket>)> done);
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
// 64, idle and assign timeouts between 1 ms and 30 days).
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
  // Called (on the event loop) when a taken worker acknowledged its
  // assignment: from then on it runs the actor.
  void on_assignment_taken(std::function<void(pid_t)> callback);
  // Called (on the event loop) when a taken worker did not acknowledge its
  // assignment within assign_timeout: the pool killed and reaped it (it
  // never ran the actor; its exit is no actor's), and the agent starts the
  // actor another way. A taken worker that dies by itself is the agent's
  // to reap and report, as before.
  void on_assignment_lost(std::function<void(pid_t, uint64_t actor_id, uint32_t incarnation)> callback);
  // A worker the pool handed out, or one the agent started cold, exited
  // and was reaped: its log file joins the exited ones kept (ExitedLogs).
  void worker_exited(pid_t pid);
  // Kills and reaps every idle worker; the pool starts nothing after it.
  void stop();
  // Kills and reaps every idle worker and refills the executables in use
  // (a fenced node keeps nothing it started before).
  void recycle();

 private:
  // Which file a path named when it was looked at: a rebuild puts a new
  // file (or new bytes) at the same path.
  struct FileId {
    dev_t dev = 0;
    ino_t ino = 0;
    off_t size = 0;
    int64_t mtime_ns = 0;
    bool operator==(const FileId&) const = default;
  };
  static std::optional<FileId> file_id(const std::string& path);
  struct Idle {
    std::string executable;
    std::unique_ptr<asio::local::stream_protocol::socket> socket;
    bool ready = false;
    std::optional<FileId> file;  // what `executable` was when it started
  };
  struct Executable {
    std::chrono::steady_clock::time_point last_used;
    bool active = false;     // refilled; false once idle past the timeout
    bool refilling = false;  // a refill is posted
    int failed_starts = 0;   // workers that failed to start or died before they were ready
    // When the last of kMaxFailedStarts failed: starts are tried again
    // kRetryStartsAfter later (a full disk, a process limit pass).
    std::chrono::steady_clock::time_point gave_up;
  };

  void start_one(const std::string& executable);
  void watch_ready(pid_t pid);
  void post_refill(const std::string& executable);
  void watch_assignment(pid_t pid, std::unique_ptr<asio::local::stream_protocol::socket> socket,
                        const std::string& executable, uint64_t actor_id, uint32_t incarnation, bool ready);
  void assignment_lost(pid_t pid, const std::string& executable, uint64_t actor_id, uint32_t incarnation, bool ready);
  void refill_when_serving(pid_t pid, std::unique_ptr<asio::local::stream_protocol::socket> socket,
                           const std::string& executable);
  void refill_after_take(pid_t pid, const std::string& executable);
  size_t count(const std::string& executable) const;
  void check_idle();
  void kill_idle(const std::string& executable);
  // Kills the idle workers of `executable` started from another file than
  // the one at its path now (it was rebuilt): they would run the old code.
  void drop_stale(const std::string& executable);
  // Counts a failed start of `executable`; the pool stops starting it at
  // kMaxFailedStarts, and says so.
  void start_failed(Executable& e, const std::string& executable, const std::string& why);
  void kill_all_idle();
  void report_idle_count();

  asio::io_context& io_;
  const WorkerPoolOptions opts_;
  const core::WorkerEnv base_;
  asio::steady_timer idle_timer_;
  std::map<pid_t, Idle> idle_;
  // Workers just taken, until they acknowledge their assignments, then until
  // their actors serve (see take()).
  std::map<pid_t, std::unique_ptr<ServingWatch>> taken_;
  std::map<std::string, Executable> executables_;
  std::function<void(uint32_t)> on_idle_count_change_;
  std::function<void(pid_t)> on_assignment_taken_;
  std::function<void(pid_t, uint64_t, uint32_t)> on_assignment_lost_;
  uint32_t reported_idle_ = 0;
  bool stopped_ = false;
  std::optional<ExitedLogs> exited_logs_;  // when log_dir is set
};

}  // namespace troupe::node
