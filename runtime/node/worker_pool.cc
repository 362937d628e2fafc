#include "troupe/runtime/node/worker_pool.h"

#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string_view>
#include <vector>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/core/malloc_policy.h"
#include "troupe/runtime/core/process.h"
#include "troupe/runtime/node/stats_pages.h"

namespace troupe::node {

namespace {

// After this many workers of one executable die before they are ready, the
// pool stops starting them (the executable cannot serve as a pooled worker)
// and spawns of it start cold.
constexpr int kMaxFailedStarts = 3;

// The longest a refill waits for the worker taken before it to serve.
constexpr std::chrono::milliseconds kRefillBound{500};

// How long after it gave up on an executable the pool tries it again: what
// failed may have been passing (a full log disk, the process limit), and
// the pool was off for that executable until the agent restarted.
constexpr std::chrono::seconds kRetryStartsAfter{30};

// What a worker taken before it was ready has, beyond assign_timeout, to
// finish its start (a Python worker's preload of torch takes 15 s on a
// loaded node): one killed for a slow start started again cold, slower.
constexpr std::chrono::seconds kStartingGrace{60};

}  // namespace

void validate_pool_options(const WorkerPoolOptions& o) {
  if (o.size > 64) throw ConfigError("worker pool size " + std::to_string(o.size) + " is out of range [0, 64]");
  auto ms = o.idle_timeout.count();
  if (ms < 1 || ms > 30LL * 24 * 3600 * 1000)
    throw ConfigError("worker idle timeout " + std::to_string(ms) + " ms is out of range [1 ms, 30 days]");
  auto assign_ms = o.assign_timeout.count();
  if (assign_ms < 1 || assign_ms > 30LL * 24 * 3600 * 1000)
    throw ConfigError("worker assign timeout " + std::to_string(assign_ms) + " ms is out of range [1 ms, 30 days]");
}

WorkerPool::WorkerPool(asio::io_context& io, WorkerPoolOptions options, core::WorkerEnv base)
    : io_(io), opts_(options), base_(std::move(base)), idle_timer_(io) {
  validate_pool_options(opts_);
  if (!opts_.log_dir.empty()) exited_logs_.emplace(opts_.log_dir, opts_.max_exited_logs);
  if (opts_.size > 0) check_idle();
}

WorkerPool::~WorkerPool() { stop(); }

void WorkerPool::fill(const std::string& executable) {
  if (stopped_ || opts_.size == 0) return;
  auto& e = executables_[executable];
  const auto now = std::chrono::steady_clock::now();
  e.last_used = now;
  e.active = true;
  if (e.failed_starts >= kMaxFailedStarts) {
    if (now - e.gave_up < kRetryStartsAfter) return;
    e.failed_starts = 0;
    TROUPE_LOG_INFO("worker pool: trying idle workers of {} again", executable);
  }
  drop_stale(executable);
  while (count(executable) < opts_.size && e.failed_starts < kMaxFailedStarts) {
    try {
      start_one(executable);
    } catch (const std::exception& ex) {
      start_failed(e, executable, ex.what());
    }
  }
}

void WorkerPool::start_failed(Executable& e, const std::string& executable, const std::string& why) {
  TROUPE_LOG_WARN("worker pool: cannot start an idle worker of {}: {}", executable, why);
  if (++e.failed_starts < kMaxFailedStarts) return;
  e.gave_up = std::chrono::steady_clock::now();
  TROUPE_LOG_WARN(
      "worker pool: {} idle workers of {} failed to start; its spawns start cold, and the pool tries it "
      "again in {} s",
      kMaxFailedStarts, executable, kRetryStartsAfter.count());
}

std::optional<WorkerPool::FileId> WorkerPool::file_id(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  return FileId{st.st_dev, st.st_ino, st.st_size, int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
}

void WorkerPool::drop_stale(const std::string& executable) {
  const auto now = file_id(executable);
  bool dropped = false;
  for (auto it = idle_.begin(); it != idle_.end();) {
    if (it->second.executable != executable || it->second.file == now) {
      ++it;
      continue;
    }
    TROUPE_LOG_INFO("worker pool: {} changed since idle worker {} started from it (rebuilt?); killing that worker",
                    executable, it->first);
    ::kill(it->first, SIGKILL);
    core::wait_child(it->first);
    worker_exited(it->first);
    it = idle_.erase(it);
    dropped = true;
  }
  if (dropped) {
    executables_[executable].failed_starts = 0;  // a new file: its own tries
    report_idle_count();
  }
}

namespace {

// A worker's log is <dir>/worker-<pid>.log (worker_log_path).
constexpr std::string_view kLogPrefix = "worker-", kLogSuffix = ".log";

// Whether a process has `pid` (the worker's, or a newer one's).
bool pid_alive(pid_t pid) { return ::kill(pid, 0) == 0 || errno == EPERM; }

// Deletes a worker's log and its rotated part.
void remove_log(const std::string& path) {
  ::unlink(path.c_str());
  ::unlink((path + ".1").c_str());
}

}  // namespace

std::string worker_log_path(const std::string& dir, pid_t pid) {
  return dir + "/" + std::string(kLogPrefix) + std::to_string(pid) + std::string(kLogSuffix);
}

ExitedLogs::ExitedLogs(std::string dir, size_t keep) : dir_(std::move(dir)), keep_(keep) { prune_left_behind(); }

void ExitedLogs::prune_left_behind() {
  std::vector<std::pair<std::filesystem::file_time_type, std::string>> dead;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir_, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() <= kLogPrefix.size() + kLogSuffix.size() || !name.starts_with(kLogPrefix) ||
        !name.ends_with(kLogSuffix))
      continue;
    pid_t pid = 0;
    const char* first = name.data() + kLogPrefix.size();
    const char* last = name.data() + name.size() - kLogSuffix.size();
    if (auto [end, err] = std::from_chars(first, last, pid); err != std::errc() || end != last || pid <= 0) continue;
    if (pid_alive(pid)) continue;  // a live process's (that pid again): its own
    std::error_code time_ec;
    const auto written = e.last_write_time(time_ec);
    if (!time_ec) dead.emplace_back(written, e.path().string());
  }
  if (dead.size() <= keep_) return;
  std::sort(dead.begin(), dead.end());  // oldest first
  const size_t drop = dead.size() - keep_;
  for (size_t i = 0; i < drop; ++i) remove_log(dead[i].second);
  TROUPE_LOG_INFO("removed {} log files of exited workers left in {} (the newest {} stay)", drop, dir_, keep_);
}

void ExitedLogs::exited(pid_t pid) {
  order_.emplace_back(pid, ++seq_);
  latest_[pid] = seq_;
  while (latest_.size() > keep_) {
    auto [old, seq] = order_.front();
    order_.pop_front();
    auto it = latest_.find(old);
    if (it == latest_.end() || it->second != seq) continue;  // that pid exited again since
    latest_.erase(it);
    if (!pid_alive(old)) remove_log(worker_log_path(dir_, old));
  }
  // Entries of pids that exited again pile up only while nothing is trimmed.
  if (order_.size() > 2 * latest_.size() + 64) {
    std::deque<std::pair<pid_t, uint64_t>> live;
    for (auto& e : order_)
      if (latest_[e.first] == e.second) live.push_back(e);
    order_.swap(live);
  }
}

void WorkerPool::worker_exited(pid_t pid) {
  StatsPages::instance().release(pid);
  if (exited_logs_) exited_logs_->exited(pid);
}

pid_t spawn_logged(core::SpawnOptions o, const std::string& dir) {
  if (dir.empty()) return core::spawn_process(o);
  static std::atomic<uint64_t> seq{0};
  const std::string fresh =
      dir + "/worker-starting-" + std::to_string(::getpid()) + "-" + std::to_string(seq++) + ".log";
  o.log_file = fresh;
  // Its own log, which it keeps under TROUPE_LOG_MAX_BYTES (run_worker).
  o.env.push_back(std::string(core::kEnvOwnLog) + "=1");
  pid_t pid = core::spawn_process(o);
  // The child holds the file open: renaming it now loses nothing (and
  // replaces the file of an older process that had this pid, whose
  // rotated part goes too).
  const std::string path = worker_log_path(dir, pid);
  std::rename(fresh.c_str(), path.c_str());
  ::unlink((path + ".1").c_str());
  return pid;
}

void WorkerPool::start_one(const std::string& executable) {
  const auto file = file_id(executable);  // before the exec: a rebuild after it is seen as one
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0)
    throw Error(std::string("socketpair: ") + std::strerror(errno));
  core::WorkerEnv env = base_;
  env.role = "worker";
  env.pool_fd = fds[1];
  core::SpawnOptions o;
  o.executable = executable;
  o.arg0 = "troupe-worker:pooled";
  // Room for "troupe-worker:<class>" once an actor takes it (ps shows the
  // idle worker's command line with trailing blanks).
  o.args = {std::string(core::kTitleRoom, ' ')};
  o.own_process_group = true;
  o.env = core::clean_environment({"CUDA_VISIBLE_DEVICES"});
  for (auto& kv : env.to_env()) o.env.push_back(std::move(kv));
  core::add_exec_time_malloc_settings(o.env);
  o.keep_fds = {fds[1]};
  const StatsPages::Page page = StatsPages::instance().prepare(o);
  pid_t pid = -1;
  try {
    pid = spawn_logged(std::move(o), opts_.log_dir);
  } catch (...) {
    ::close(fds[0]);
    ::close(fds[1]);
    StatsPages::discard(page);
    throw;
  }
  StatsPages::instance().adopt(pid, page);
  ::close(fds[1]);
  Idle idle;
  idle.executable = executable;
  idle.file = file;
  idle.socket = std::make_unique<asio::local::stream_protocol::socket>(io_, asio::local::stream_protocol(), fds[0]);
  idle_[pid] = std::move(idle);
  watch_ready(pid);
}

// The worker writes one byte when it waits for its assignment.
void WorkerPool::watch_ready(pid_t pid) {
  auto byte = std::make_shared<char>(0);
  asio::async_read(*idle_[pid].socket, asio::buffer(byte.get(), 1), [this, pid, byte](asio::error_code ec, size_t) {
    if (ec) return;  // taken, killed, or it died (reap() removes it)
    if (auto it = idle_.find(pid); it != idle_.end()) it->second.ready = true;
    report_idle_count();
  });
}

std::optional<pid_t> WorkerPool::take(const std::string& executable, const WorkerAssignment& a) {
  if (stopped_ || opts_.size == 0) return std::nullopt;
  auto& e = executables_[executable];
  e.last_used = std::chrono::steady_clock::now();
  e.active = true;
  drop_stale(executable);
  // A ready worker first; one still starting is still ahead of a cold start,
  // but for an assignment too large for the socket's buffer: writing it
  // would wait, on this I/O thread, for the worker to be ready to read.
  const bool large = large_assignment(a);
  auto eligible = [&](const Idle& w) { return w.executable == executable && (w.ready || !large); };
  auto chosen = idle_.end();
  for (auto it = idle_.begin(); it != idle_.end(); ++it)
    if (eligible(it->second) && (chosen == idle_.end() || (it->second.ready && !chosen->second.ready))) chosen = it;
  while (chosen != idle_.end()) {
    pid_t pid = chosen->first;
    const bool ready = chosen->second.ready;
    auto socket = std::move(chosen->second.socket);
    idle_.erase(chosen);
    asio::error_code ignored;
    socket->cancel(ignored);
    report_idle_count();
    try {
      send_assignment(socket->native_handle(), a);
      watch_assignment(pid, std::move(socket), executable, a.actor_id, a.incarnation, ready);
      return pid;
    } catch (const std::exception& ex) {
      // It died while idle: reap() will collect it; try another.
      TROUPE_LOG_DEBUG("worker pool: idle worker {} could not take actor {}: {}", pid, a.actor_id, ex.what());
      ::kill(pid, SIGKILL);
      core::wait_child(pid);
      worker_exited(pid);
    }
    chosen = idle_.end();
    for (auto it = idle_.begin(); it != idle_.end(); ++it)
      if (eligible(it->second)) chosen = it;
  }
  post_refill(executable);
  return std::nullopt;
}

// The taken worker acknowledges its assignment with one byte (a worker of
// an older build, with its serving byte); one taken before it was ready
// sends its ready byte ('R') first. Each within assign_timeout, else it is
// stuck (stopped, hung): the pool kills it and the agent starts the actor
// cold, so a frozen idle worker delays an actor but never holds it. Then
// the refill waits for the actor to serve.
void WorkerPool::watch_assignment(pid_t pid, std::unique_ptr<asio::local::stream_protocol::socket> socket,
                                  const std::string& executable, uint64_t actor_id, uint32_t incarnation, bool ready) {
  using Seen = ServingWatch::Seen;
  const auto bound = ready
                         ? opts_.assign_timeout
                         : std::chrono::duration_cast<std::chrono::milliseconds>(opts_.assign_timeout + kStartingGrace);
  taken_[pid] = std::make_unique<ServingWatch>(
      io_, std::move(socket), bound,
      [this, pid, executable, actor_id, incarnation, ready](Seen seen, char byte,
                                                            std::unique_ptr<ServingWatch::Socket> s) {
        switch (seen) {
          case Seen::kByte:
            if (!ready && byte == 'R')
              return watch_assignment(pid, std::move(s), executable, actor_id, incarnation, true);
            if (on_assignment_taken_) on_assignment_taken_(pid);
            return refill_when_serving(pid, std::move(s), executable);
          case Seen::kClosed:
            // It died: the agent reaps it and reports the actor's exit.
            return refill_after_take(pid, executable);
          case Seen::kBound:
            return assignment_lost(pid, executable, actor_id, incarnation, ready);
        }
      });
}

void WorkerPool::assignment_lost(pid_t pid, const std::string& executable, uint64_t actor_id, uint32_t incarnation,
                                 bool ready) {
  if (ready)
    TROUPE_LOG_WARN(
        "worker pool: pooled worker {} did not take its assignment (actor {}, incarnation {}) within {} ms (stopped "
        "or hung?); killing it, the actor starts in a fresh worker",
        pid, actor_id, incarnation, opts_.assign_timeout.count());
  else
    TROUPE_LOG_WARN(
        "worker pool: pooled worker {}, taken for actor {} (incarnation {}) while it started, did not finish its "
        "start within {} s (stopped or hung?); killing it, the actor starts in a fresh worker",
        pid, actor_id, incarnation,
        std::chrono::duration_cast<std::chrono::seconds>(opts_.assign_timeout + kStartingGrace).count());
  taken_.erase(pid);
  ::kill(pid, SIGKILL);
  core::wait_child(pid);
  worker_exited(pid);
  post_refill(executable);
  if (on_assignment_lost_) on_assignment_lost_(pid, actor_id, incarnation);
}

// The taken worker writes one byte once its actor serves (or closes the
// socket by dying first); the refill starts then, or after kRefillBound
// when the actor's constructor takes longer. Starting workers while the
// taken one starts its actor would compete with it for the CPU.
void WorkerPool::refill_when_serving(pid_t pid, std::unique_ptr<asio::local::stream_protocol::socket> socket,
                                     const std::string& executable) {
  taken_[pid] = std::make_unique<ServingWatch>(io_, std::move(socket), kRefillBound,
                                               [this, pid, executable] { refill_after_take(pid, executable); });
}

void WorkerPool::refill_after_take(pid_t pid, const std::string& executable) {
  taken_.erase(pid);
  post_refill(executable);
}

struct ServingWatch::State {
  using Done = std::function<void(Seen, char, std::unique_ptr<Socket>)>;
  std::unique_ptr<Socket> socket;  // handed to `done`
  asio::steady_timer bound;
  Done done;
  char byte = 0;
  bool over = false;  // done ran, or the watch was destroyed

  State(asio::io_context& io, std::unique_ptr<Socket> s, Done d)
      : socket(std::move(s)), bound(io), done(std::move(d)) {}
  void finish(Seen seen) {
    if (std::exchange(over, true)) return;
    asio::error_code ignored;
    socket->cancel(ignored);
    bound.cancel();
    auto run = std::move(done);
    run(seen, byte, std::move(socket));  // may destroy the watch: the handlers hold this state
  }
};

ServingWatch::ServingWatch(asio::io_context& io, std::unique_ptr<Socket> socket,
                           std::chrono::steady_clock::duration bound, std::function<void()> done)
    : ServingWatch(io, std::move(socket), bound,
                   [done = std::move(done)](Seen, char, std::unique_ptr<Socket>) { done(); }) {}

ServingWatch::ServingWatch(asio::io_context& io, std::unique_ptr<Socket> socket,
                           std::chrono::steady_clock::duration bound,
                           std::function<void(Seen, char, std::unique_ptr<Socket>)> done)
    : state_(std::make_shared<State>(io, std::move(socket), std::move(done))) {
  state_->bound.expires_after(bound);
  asio::async_read(*state_->socket, asio::buffer(&state_->byte, 1), [st = state_](asio::error_code ec, size_t) {
    if (ec != asio::error::operation_aborted) st->finish(ec ? Seen::kClosed : Seen::kByte);
  });
  state_->bound.async_wait([st = state_](asio::error_code ec) {
    if (ec) return;
    // A byte or close that came just in time (in the socket, or read and
    // its handler queued ahead of this one) ends the watch as such.
    asio::post(st->bound.get_executor(), [st] {
      if (st->over) return;
      char c;
      if (::recv(st->socket->native_handle(), &c, 1, MSG_PEEK | MSG_DONTWAIT) >= 0 ||
          (errno != EAGAIN && errno != EWOULDBLOCK))
        return;  // the read sees it
      st->finish(Seen::kBound);
    });
  });
}

ServingWatch::~ServingWatch() {
  state_->over = true;
  asio::error_code ignored;
  if (state_->socket) state_->socket->cancel(ignored);
  state_->bound.cancel();
}

void WorkerPool::post_refill(const std::string& executable) {
  auto& e = executables_[executable];
  if (e.refilling) return;
  e.refilling = true;
  asio::post(io_, [this, executable] {
    executables_[executable].refilling = false;
    if (!stopped_ && executables_[executable].active) fill(executable);
  });
}

void WorkerPool::reap() {
  for (auto it = idle_.begin(); it != idle_.end();) {
    int status = 0;
    if (::waitpid(it->first, &status, WNOHANG) != it->first) {
      ++it;
      continue;
    }
    auto& e = executables_[it->second.executable];
    TROUPE_LOG_DEBUG("worker pool: idle worker {} of {} {}", it->first, it->second.executable,
                     core::describe_exit_status(status));
    std::string executable = it->second.executable;
    if (!it->second.ready)
      start_failed(e, executable, "it " + core::describe_exit_status(status) + " before it was ready");
    worker_exited(it->first);
    it = idle_.erase(it);
    if (e.active) post_refill(executable);
  }
  report_idle_count();
}

void WorkerPool::on_idle_count_change(std::function<void(uint32_t)> callback) {
  on_idle_count_change_ = std::move(callback);
}

void WorkerPool::on_assignment_taken(std::function<void(pid_t)> callback) {
  on_assignment_taken_ = std::move(callback);
}

void WorkerPool::on_assignment_lost(std::function<void(pid_t, uint64_t, uint32_t)> callback) {
  on_assignment_lost_ = std::move(callback);
}

void WorkerPool::report_idle_count() {
  uint32_t n = idle_count();
  if (n == reported_idle_ || stopped_) return;
  reported_idle_ = n;
  if (on_idle_count_change_) on_idle_count_change_(n);
}

uint32_t WorkerPool::idle_count() const {
  uint32_t n = 0;
  for (const auto& [pid, w] : idle_) n += w.ready ? 1 : 0;
  return n;
}

size_t WorkerPool::count(const std::string& executable) const {
  size_t n = 0;
  for (const auto& [pid, w] : idle_) n += w.executable == executable ? 1 : 0;
  return n;
}

// Every so often (a fraction of the timeout, at most a second): executables
// unused for the timeout lose their idle workers.
void WorkerPool::check_idle() {
  auto now = std::chrono::steady_clock::now();
  for (auto& [exe, e] : executables_)
    if (e.active && now - e.last_used >= opts_.idle_timeout) {
      e.active = false;
      kill_idle(exe);
    }
  auto period = std::clamp<std::chrono::milliseconds>(opts_.idle_timeout / 4, std::chrono::milliseconds(5),
                                                      std::chrono::seconds(1));
  idle_timer_.expires_after(period);
  idle_timer_.async_wait([this](asio::error_code ec) {
    if (!ec && !stopped_) check_idle();
  });
}

void WorkerPool::kill_idle(const std::string& executable) {
  for (auto it = idle_.begin(); it != idle_.end();) {
    if (it->second.executable != executable) {
      ++it;
      continue;
    }
    TROUPE_LOG_DEBUG("worker pool: idle worker {} of {} unused for {} ms; killing it", it->first, executable,
                     opts_.idle_timeout.count());
    ::kill(it->first, SIGKILL);
    core::wait_child(it->first);
    worker_exited(it->first);
    it = idle_.erase(it);
  }
  report_idle_count();
}

void WorkerPool::recycle() {
  if (stopped_) return;
  kill_all_idle();
  report_idle_count();
  for (auto& [exe, e] : executables_)
    if (e.active) post_refill(exe);
}

void WorkerPool::stop() {
  if (stopped_) return;
  stopped_ = true;
  idle_timer_.cancel();
  kill_all_idle();
}

void WorkerPool::kill_all_idle() {
  for (auto& [pid, w] : idle_) ::kill(pid, SIGKILL);
  for (auto& [pid, w] : idle_) {
    core::wait_child(pid);
    worker_exited(pid);
  }
  idle_.clear();
  taken_.clear();
}

}  // namespace troupe::node
