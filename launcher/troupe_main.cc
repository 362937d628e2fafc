// `troupe`: start and stop clusters by hand, look at them, run drivers
// against them.
//
//   troupe start --head [--host H] [--advertise-address A] [--port P] [--resources CPU=2,GPU=0] [--no-node]
//                [--max-dead-actors N] [--worker-pool-size N] [--worker-idle-timeout S]
//                [--worker-assign-timeout S]
//   troupe start --address HOST:PORT [--host H] [--advertise-address A] [--resources ...]
//                [--worker-pool-size N] [--worker-idle-timeout S] [--worker-assign-timeout S]
//   troupe status [--json] [--state ALIVE|PENDING|RESTARTING|DEAD] [--limit N]
//   troupe stop
//   troupe submit -- ./my_driver args...
//   troupe torchrun [--nproc-per-node N] [--nnodes MIN:MAX] [--max-restarts K] [--address HOST:PORT]
//                   [--python PATH] [--run-id ID] script.py args...   (docs/torchrun.md)
//   troupe train --model step.pt --data train.npz ... (troupe-train --help)
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>

#include "cli_message.h"
#include "head_probe.h"
#include "slurm.h"
#include "torchrun_job.h"
#include "torchrun_options.h"
#include "torchrun_slot.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/client/shipped_copies.h"
#include "troupe/runtime/core/heartbeat.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/core/process.h"
#include "troupe/runtime/core/session.h"
#include "troupe/runtime/core/worker_env.h"
#include "troupe/runtime/head/http_endpoint.h"
#include "troupe/runtime/head/resource_pool.h"
#include "troupe/runtime/head/scheduler.h"
#include "troupe/runtime/node/node_agent.h"
#include "troupe/runtime/node/worker_pool.h"
#include "troupe/runtime/wire/address.h"
#include "troupe/runtime/wire/auth.h"

namespace fs = std::filesystem;
using troupe::core::read_session_file;
using troupe::core::session_dir;
using troupe::core::write_session_file;

namespace {

constexpr int kDefaultDashboardPort = 8265;  // Ray's, so operators find it where they look

// What this `troupe start` started (for --block): a pid and its pid file.
std::vector<std::pair<pid_t, std::string>> g_started;

struct Args {
  bool head = false;
  bool block = false;
  std::string host;  // "" = 127.0.0.1 for a head; the interface that routes to the head for a node
  std::string advertise_address;
  int port = 6380;
  std::string state_db;  // "" = <session>/head.sqlite
  bool no_state_db = false;
  bool supervise = false;
  double hang_timeout_s = 30;
  std::string address;
  std::string resources;
  bool no_node = false;
  bool json = false;
  troupe::wire::StatusRequest status;  // --state, --limit
  size_t max_dead_actors = 1000;
  uint32_t heartbeat_ms = troupe::core::WorkerEnv{}.heartbeat_ms;
  uint32_t heartbeat_misses = troupe::core::WorkerEnv{}.heartbeat_misses;
  int dashboard_port = kDefaultDashboardPort;  // -1 = off, 0 = any free port
  bool dashboard_port_given = false;
  bool dashboard_require_token = false;
  // The token stays out of the session directory (it comes from
  // TROUPE_TOKEN): troupe slurm's head and agents, whose files a scancel's
  // SIGKILL leaves behind.
  bool no_token_file = false;
  uint32_t worker_pool_size = 2;
  double worker_idle_timeout_s = 300;
  double worker_assign_timeout_s = troupe::core::WorkerEnv{}.worker_assign_timeout_ms / 1000.0;
  double wait_for_head_s = 0;  // start --address: how long to try a head that is not up yet
  std::vector<std::string> command;
  std::string runtime_env_json;  // submit: the job's runtime_env for a Python driver
  double grace_period_s = 30;    // stop: SIGTERM, then after this SIGKILL
  bool force = false;            // stop: SIGKILL at once
  // `troupe start` options given on the command line that only a head
  // (--head) or only a node agent takes: given to the other, an error.
  std::vector<std::string> head_options_given;
  std::vector<std::string> node_options_given;
};

// The options of `troupe start` that only --head takes, and those that only
// a node agent takes (refused with --head --no-node, which starts none).
// clang-format off
const std::vector<std::string> kHeadOnlyOptions = {
    "--port", "--no-node", "--dashboard-port", "--dashboard-require-token", "--state-db", "--supervise",
    "--hang-timeout", "--no-state-db", "--max-dead-actors", "--heartbeat-ms", "--heartbeat-misses"};
// clang-format on
const std::vector<std::string> kNodeOnlyOptions = {"--resources", "--worker-pool-size", "--worker-idle-timeout",
                                                   "--worker-assign-timeout"};

std::string token_for(const std::string& dir) {
  if (std::string t =
          troupe::core::clean_token(troupe::core::env_value(troupe::core::kEnvToken), troupe::core::kEnvToken);
      !t.empty())
    return t;
  // A token file that cannot be read is named (it read as no token at all:
  // "needs the cluster token").
  const fs::path file = fs::path(dir) / "token";
  std::error_code ec;
  const auto status = fs::symlink_status(file, ec);
  if (!ec && fs::exists(status) && !fs::is_regular_file(status))
    throw troupe::ConfigError(file.string() + " is " +
                              (fs::is_symlink(status) ? "a symbolic link" : "not a regular file") +
                              ", which troupe does not read as the cluster token: remove it, or set TROUPE_TOKEN");
  if (!ec && fs::is_regular_file(status) && ::access(file.c_str(), R_OK) != 0)
    throw troupe::ConfigError("cannot read " + file.string() + ": " + std::strerror(errno) + " (set TROUPE_TOKEN)");
  return read_session_file(dir, "token");
}

// An --advertise-address that does not lead back to what listens here
// starts a cluster nobody can use from elsewhere; said at once, not found
// out from a driver's failed calls. A warning: behind a NAT without
// hairpinning a good address fails the check too.
void warn_if_advertised_unreachable(const std::string& what, const std::string& bind_host, const Args& a) {
  if (a.advertise_address.empty() || bind_host.empty()) return;
  std::string why;
  try {
    why = troupe::wire::advertised_unreachable(bind_host, a.advertise_address);
  } catch (const std::exception& e) {
    why = e.what();
  }
  if (!why.empty())
    std::fprintf(stderr,
                 "troupe: warning: --advertise-address %s does not reach this %s from here (%s); drivers and "
                 "nodes will not reach it there unless a NAT forwards it: give an address of this machine's "
                 "interface (see --host)\n",
                 a.advertise_address.c_str(), what.c_str(), why.c_str());
}

// Where a node agent joining `head` listens: --host, else the interface
// that routes to the head (as the agent chooses); "" when there is none.
std::string node_bind_host(const Args& a, const std::string& head) {
  if (!a.host.empty()) return a.host;
  try {
    const auto [host, port] = troupe::wire::parse_address(head);
    return troupe::wire::local_address_towards(host, port);
  } catch (const std::exception&) {
    return "";  // the agent names a head it cannot route to when it starts
  }
}

// Whether `host` is this machine: loopback, or an address one of its
// interfaces holds (a socket binds to it).
bool names_this_machine(const std::string& host) {
  try {
    const auto ip = troupe::wire::resolve_host(host);
    if (ip.is_loopback()) return true;
    sockaddr_storage sa{};
    const socklen_t len = troupe::wire::to_sockaddr(ip, 0, sa);
    const int fd = ::socket(sa.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return false;
    const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&sa), len) == 0;
    ::close(fd);
    return bound;
  } catch (const std::exception&) {
    return false;
  }
}

// Whether two HOST:PORT name one head: the same text, or the same port on
// hosts that are both this machine (a head's own agent joins it where it
// listens, others where it is advertised).
bool same_head(const std::string& a, const std::string& b) {
  if (a == b) return true;
  try {
    const auto [ha, pa] = troupe::wire::parse_address(a);
    const auto [hb, pb] = troupe::wire::parse_address(b);
    return pa == pb && names_this_machine(ha) && names_this_machine(hb);
  } catch (const std::exception&) {
    return false;
  }
}

// A live node agent of this session joined to the head at `address` (its
// pid, read from its pid file; its head from its environment), if any.
std::optional<pid_t> live_agent_of(const std::string& dir, const std::string& address) {
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename();
    if (name.rfind("node-", 0) != 0 || entry.path().extension() != ".pid") continue;
    const auto f = troupe::core::check_pid_file(dir, name);
    if (!f.alive) continue;
    std::ifstream in("/proc/" + std::to_string(f.pid) + "/environ");
    const std::string key = std::string(troupe::core::kEnvHeadAddress) + "=";
    for (std::string var; std::getline(in, var, '\0');)
      if (var.rfind(key, 0) == 0 && same_head(var.substr(key.size()), address)) return f.pid;
  }
  return std::nullopt;
}

// Starts a node agent that joins `address`; persists nothing until it has.
pid_t start_node(const std::string& dir, const std::string& address, const std::string& token, const Args& a) {
  troupe::core::RoleProcessOptions o;
  o.env.role = "node";
  o.env.head_address = address;
  o.env.token = token;
  o.env.resources = a.resources;
  o.env.bind_host = a.host;
  o.env.advertise_host = troupe::wire::strip_brackets(a.advertise_address);
  o.env.worker_pool_size = a.worker_pool_size;
  o.env.worker_idle_timeout_ms = static_cast<uint64_t>(a.worker_idle_timeout_s * 1000.0);
  o.env.worker_assign_timeout_ms = static_cast<uint64_t>(a.worker_assign_timeout_s * 1000.0);
  // How long the agent (and its workers) wait for a durable head that went
  // away: this command's TROUPE_HEAD_RECONNECT_MS, which the daemon's
  // cleaned environment would not carry (checked in bad_start_value).
  o.env.head_reconnect_ms = static_cast<uint64_t>(troupe::core::default_head_reconnect().count());
  if (!a.advertise_address.empty()) warn_if_advertised_unreachable("node's workers", node_bind_host(a, address), a);
  o.log_file = dir + "/node-" + std::to_string(::time(nullptr)) + "-" + std::to_string(getpid()) + ".log";
  // Daemons, unless --block keeps this command as their parent (then they
  // die with it: a container or Slurm task killed leaves nothing behind).
  o.die_with_parent = a.block;
  o.new_session = !a.block;
  auto p = troupe::core::start_role_process(o, "node agent");
  // Named by the agent's pid too: a session may run a head and join
  // another cluster, whose node ids start at 1 as well.
  g_started.emplace_back(p.pid, "node-" + p.ready_line + "-" + std::to_string(p.pid) + ".pid");
  troupe::core::write_pid_file(dir, g_started.back().second, p.pid);
  std::printf("node %s started (pid %d), joined %s; log %s\n", p.ready_line.c_str(), p.pid, address.c_str(),
              o.log_file.c_str());
  return p.pid;
}

// Where a head's own node agent joins it: where the head listens (loopback
// when that is every interface), not the address it advertises, which
// behind a NAT without hairpinning does not lead back from this machine.
// The agent's workers still advertise the interface that routes to the
// advertised address, as an agent joining from elsewhere would (not
// loopback, when the head listens everywhere).
void join_own_head(Args& node, const std::string& bind_host, const std::string& advertised, std::string& join) {
  namespace wire = troupe::wire;
  const auto [host, port] = wire::parse_address(advertised);
  node.host = bind_host;  // the node's workers listen where the head does
  node.advertise_address = "";
  if (!wire::is_wildcard_host(bind_host)) {
    join = wire::format_address(wire::strip_brackets(bind_host), port);
    return;
  }
  join = wire::format_address(bind_host.find(':') != std::string::npos ? "::1" : "127.0.0.1", port);
  try {
    node.advertise_address = wire::local_address_towards(host, port);
  } catch (const std::exception&) {
    join = advertised;  // no route to it: as before, the agent finds out by joining
  }
}

// Held while a `troupe start --head` checks for a running head and starts
// one, so that two at once in one session cannot both start a head: the
// second waits, then finds the first's. Released when this goes.
class StartLock {
 public:
  explicit StartLock(const std::string& dir)
      : fd_(::open((dir + "/start.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600)) {
    if (fd_ < 0) throw troupe::ConfigError("cannot open " + dir + "/start.lock: " + std::strerror(errno));
    while (::flock(fd_, LOCK_EX) != 0)
      if (errno != EINTR) throw troupe::ConfigError("cannot lock " + dir + "/start.lock: " + std::strerror(errno));
  }
  ~StartLock() { ::close(fd_); }
  StartLock(const StartLock&) = delete;
  StartLock& operator=(const StartLock&) = delete;

 private:
  int fd_;
};

// Undoes a head start whose node agent failed: stops the head and removes
// what was written of it, so the session is as before. A head that
// reloaded a cluster's state (a restart after a crash) is SIGKILLed, its
// process group with it (a supervisor's head): a stop signal ends a
// cluster for good, emptying the state db and telling the nodes and
// drivers that had come back that it had ended. A fresh one is stopped.
void undo_head_start(const std::string& dir, pid_t head, bool reloaded, bool own_group) {
  if (reloaded && own_group)
    ::kill(-head, SIGKILL);
  else
    ::kill(head, reloaded ? SIGKILL : SIGTERM);
  troupe::core::reap_process(head, std::chrono::seconds(10));
  for (const char* f : {"head.pid", "address", "dashboard", "state_db"}) fs::remove(fs::path(dir) / f);
  g_started.clear();
}

int start_head(const std::string& dir, const Args& a) {
  StartLock lock(dir);
  auto running = troupe::core::check_pid_file(dir, "head.pid");
  if (running.alive) {
    std::fprintf(stderr, "troupe: a head is already running (pid %d, %s); troupe stop first\n", running.pid,
                 read_session_file(dir, "address").c_str());
    return 1;
  }
  std::string token = token_for(dir);
  if (token.empty()) token = troupe::wire::random_token();
  troupe::core::RoleProcessOptions o;
  o.env.role = "head";
  o.env.token = token;
  o.env.head_host = a.host.empty() ? "127.0.0.1" : a.host;
  o.env.head_port = static_cast<uint16_t>(a.port);
  o.env.advertise_host = troupe::wire::strip_brackets(a.advertise_address);
  warn_if_advertised_unreachable("head", o.env.head_host, a);
  o.env.max_dead_actors = a.max_dead_actors;
  o.env.heartbeat_ms = a.heartbeat_ms;
  o.env.heartbeat_misses = a.heartbeat_misses;
  // Absolute: the head and a later `troupe stop` (which empties it) run
  // elsewhere than this command; a relative path named another file there,
  // and the next head reloaded the stopped cluster.
  if (!a.no_state_db)
    o.env.head_state_db =
        a.state_db.empty() ? dir + "/head.sqlite" : fs::absolute(fs::path(a.state_db)).lexically_normal().string();
  o.env.head_supervise = a.supervise;
  o.env.head_hang_timeout_ms = static_cast<uint64_t>(a.hang_timeout_s * 1000);
  o.env.dashboard = a.dashboard_port >= 0;
  o.env.dashboard_port = static_cast<uint16_t>(std::max(a.dashboard_port, 0));
  // The default port falls back to a free one when taken (another cluster
  // on this machine); a port given on the command line does not.
  o.env.dashboard_port_fallback = !a.dashboard_port_given;
  o.env.dashboard_require_token = a.dashboard_require_token;
  o.log_file = dir + "/head.log";
  // Daemons, unless --block keeps this command as their parent (then they
  // die with it: a container or Slurm task killed leaves nothing behind).
  o.die_with_parent = a.block;
  o.new_session = !a.block;
  std::error_code db_ec;
  const bool reloads = !o.env.head_state_db.empty() && fs::exists(o.env.head_state_db, db_ec);
  auto p = troupe::core::start_role_process(o, "head");
  g_started.emplace_back(p.pid, "head.pid");
  // The ready line: "ADDRESS" or "ADDRESS DASHBOARD_URL".
  const size_t space = p.ready_line.find(' ');
  const std::string address = p.ready_line.substr(0, space);
  const std::string dashboard = space == std::string::npos ? "" : p.ready_line.substr(space + 1);
  troupe::core::write_pid_file(dir, "head.pid", p.pid);
  if (!a.no_token_file) write_session_file(dir, "token", token, 0600);
  write_session_file(dir, "address", address, 0600);
  write_session_file(dir, "dashboard", dashboard, 0600);
  write_session_file(dir, "state_db", o.env.head_state_db, 0600);
  // With --supervise, p.pid is the supervisor's: the head is its child.
  std::printf("head started (%s %d) at %s; session %s (token %s)\n",
              a.supervise ? "supervised: the supervisor is pid" : "pid", p.pid, address.c_str(), dir.c_str(),
              a.no_token_file ? "in TROUPE_TOKEN only" : ("in " + dir + "/token").c_str());
  if (!dashboard.empty())
    std::printf("dashboard at %s%s\n", dashboard.c_str(),
                troupe::head::is_loopback_host(o.env.head_host) && !a.dashboard_require_token
                    ? ""
                    : " (needs the token: Authorization: Bearer TOKEN, or log in there)");
  if (!a.no_node) {
    Args node = a;
    std::string join;
    join_own_head(node, o.env.head_host, address, join);
    // A head started again on its port (it died) finds its agent there,
    // which rejoins it: another would count the machine twice.
    if (const auto agent = live_agent_of(dir, join)) {
      std::printf("node agent pid %d of this session still runs and rejoins this head: not starting another\n",
                  static_cast<int>(*agent));
    } else {
      try {
        start_node(dir, join, token, node);
      } catch (const std::exception& e) {
        undo_head_start(dir, p.pid, reloads, o.new_session);
        throw troupe::ConfigError(std::string(e.what()) + "; the head (pid " + std::to_string(p.pid) +
                                  ") started with it is stopped again");
      }
    }
  }
  std::printf("drivers connect with --address %s (or --address auto on this machine)\n", address.c_str());
  return 0;
}

// An --address flag as the user gave it: "" or "auto" is the session's
// cluster (the address `troupe start --head` recorded; "" when none).
std::string session_address(const std::string& dir, const std::string& flag) {
  if (!flag.empty() && flag != "auto") return flag;
  return read_session_file(dir, "address");
}

// False, having said why as "troupe CMD: --address A: ..." (a usage
// error), unless `address` reads as HOST:PORT.
bool address_is_well_formed(const char* cmd, const std::string& address) {
  try {
    troupe::wire::parse_address(address);
    return true;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe %s: --address %s: %s\n", cmd, address.c_str(), e.what());
    return false;
  }
}

int join_head(const std::string& dir, const Args& given) {
  Args a = given;
  a.address = session_address(dir, given.address);
  if (a.address.empty()) {
    std::fprintf(stderr, "troupe start: --address auto: no running cluster in %s (troupe start --head)\n", dir.c_str());
    return 2;
  }
  if (!address_is_well_formed("start", a.address)) return 2;
  std::string token = token_for(dir);
  if (token.empty()) {
    std::fprintf(stderr,
                 "troupe start: no cluster token: set TROUPE_TOKEN to the head's token (the file `token` in the "
                 "directory `troupe session` prints on the head's machine), or copy that file to %s/token\n",
                 dir.c_str());
    return 2;
  }
  // A second agent of this session on one head offers this machine twice:
  // said, since it is most likely a mistake (a start typed twice), but done,
  // since nodes with resources of their own (--resources) on one machine
  // are how a cluster of several nodes is tried on one.
  if (const auto agent = live_agent_of(dir, a.address))
    std::fprintf(stderr,
                 "troupe start: warning: node agent pid %d of this session has joined %s already: this machine is "
                 "offered twice unless --resources splits it (troupe stop ends both)\n",
                 static_cast<int>(*agent), a.address.c_str());
  // Fails fast at a foreign service or with a wrong token, before anything
  // is started or written; a head not up yet is waited for if asked.
  troupe::launcher::wait_for_head(
      a.address, token, std::chrono::milliseconds(static_cast<int64_t>(a.wait_for_head_s * 1000.0)), "troupe start");
  start_node(dir, a.address, token, a);
  // The token is proven right now: the node joined with it.
  if (read_session_file(dir, "address").empty()) write_session_file(dir, "address", a.address, 0600);
  if (!a.no_token_file && read_session_file(dir, "token").empty()) write_session_file(dir, "token", token, 0600);
  return 0;
}

// --block: stays in the foreground while what it started runs (a
// container's main process, a Slurm task). SIGTERM or SIGINT stops them;
// when one of them exits the others are stopped, and its exit code is
// this command's. Their pid files (and a head's address) go with them, so
// that the session reads as stopped, not as a head that refuses.
int block_on(const std::string& dir, const std::vector<std::pair<pid_t, std::string>>& started) {
  std::vector<pid_t> pids;
  for (const auto& [pid, file] : started) pids.push_back(pid);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  // The terminal or ssh session closing: stopped as by Ctrl-C (its default
  // action ended this process alone, the head's state db not emptied and
  // the session's files left for the next head to reload).
  sigaddset(&set, SIGHUP);
  sigaddset(&set, SIGCHLD);
  sigprocmask(SIG_BLOCK, &set, nullptr);
  std::printf("troupe start: running in the foreground; SIGTERM or Ctrl-C stops it\n");
  std::fflush(stdout);
  int rc = 0;
  // As a container's PID 1 (deploy/kubernetes), the orphans of the
  // container are this process's to reap: they piled up as zombies.
  const bool init = ::getpid() == 1;
  for (bool done = false; !done;) {
    auto ended = [&](pid_t pid, int st) {
      auto it = std::find(pids.begin(), pids.end(), pid);
      if (it == pids.end()) return;  // an orphan, reaped
      std::fprintf(stderr, "troupe start: process %d %s; stopping the rest\n", pid,
                   troupe::core::describe_exit_status(st).c_str());
      rc = WIFEXITED(st) ? WEXITSTATUS(st) : 1;
      pids.erase(it);
      done = true;
    };
    if (init) {
      int st = 0;
      for (pid_t p; !done && (p = ::waitpid(-1, &st, WNOHANG)) > 0;) ended(p, st);
    } else {
      for (size_t i = 0; i < pids.size() && !done; ++i) {
        int st = 0;
        if (::waitpid(pids[i], &st, WNOHANG) == pids[i]) ended(pids[i], st);
      }
    }
    if (done) break;
    timespec wait{1, 0};  // SIGCHLD wakes it; the timeout covers a missed one
    int sig = sigtimedwait(&set, nullptr, &wait);
    if (sig == SIGTERM || sig == SIGINT || sig == SIGHUP) done = true;
  }
  for (pid_t p : pids) ::kill(p, SIGTERM);
  for (pid_t p : pids) troupe::core::reap_process(p, std::chrono::seconds(10));
  for (const auto& [pid, file] : started) {
    fs::remove(fs::path(dir) / file);
    if (file == "head.pid")
      for (const char* f : {"address", "dashboard"}) fs::remove(fs::path(dir) / f);
  }
  return rc;
}

// "" when the options fit together, else why not.
std::string conflicting_start_options(const Args& a) {
  if (a.head && !a.address.empty())
    return "--head starts a head and --address " + a.address + " joins one; give one of them";
  if (!a.head && !a.head_options_given.empty())
    return a.head_options_given.front() + " is an option of the head: give it with --head (a node agent joining " +
           a.address + " takes the head's settings from it)";
  if (a.head && a.wait_for_head_s > 0)
    return "--wait-for-head is for a node agent joining a head (--address), and --head starts the head";
  if (a.head && a.no_node && !a.node_options_given.empty())
    return a.node_options_given.front() + " is an option of the node agent, and --no-node starts none";
  return "";
}

// "" when every value given to `troupe start` is one it takes, else why
// not, naming the option and the value: a usage error like CLI11's.
std::string bad_start_value(const Args& a) {
  try {
    troupe::core::default_head_reconnect();
  } catch (const troupe::ConfigError& e) {
    return e.what();
  }
  // Each is in range (CLI11 checked it); their product is the fence time.
  if (const uint64_t fence = uint64_t(a.heartbeat_ms) * a.heartbeat_misses; fence > troupe::core::kMaxFenceMs)
    return "--heartbeat-ms " + std::to_string(a.heartbeat_ms) + " × --heartbeat-misses " +
           std::to_string(a.heartbeat_misses) + " = " + std::to_string(fence) +
           " ms before a silent node is fenced, over " + std::to_string(troupe::core::kMaxFenceMs) + " (a day)";
  try {
    troupe::head::validate_resources(troupe::head::parse_resources(a.resources), "--resources");
  } catch (const troupe::ConfigError& e) {
    const std::string why = e.what();
    return why.rfind("--resources", 0) == 0 ? why : "--resources: " + why;
  }
  if (!(a.worker_idle_timeout_s >= 0.001 && a.worker_idle_timeout_s <= 30.0 * 24 * 3600)) {
    char buf[128];
    std::snprintf(buf, sizeof(buf), "--worker-idle-timeout %g is out of range [0.001, 2592000] seconds",
                  a.worker_idle_timeout_s);
    return buf;
  }
  if (!(a.worker_assign_timeout_s >= 0.001 && a.worker_assign_timeout_s <= 30.0 * 24 * 3600)) {
    char buf[128];
    std::snprintf(buf, sizeof(buf), "--worker-assign-timeout %g is out of range [0.001, 2592000] seconds",
                  a.worker_assign_timeout_s);
    return buf;
  }
  try {  // the timeouts are in range (above): what is left is the size
    troupe::node::validate_pool_options(
        {a.worker_pool_size, std::chrono::milliseconds(static_cast<int64_t>(a.worker_idle_timeout_s * 1000.0)),
         std::chrono::milliseconds(static_cast<int64_t>(a.worker_assign_timeout_s * 1000.0))});
  } catch (const troupe::ConfigError& e) {
    return std::string("--worker-pool-size: ") + e.what();
  }
  if (a.advertise_address.empty()) return "";
  if (troupe::wire::is_wildcard_host(a.advertise_address))
    return "--advertise-address " + a.advertise_address + " is a wildcard; give an address others can reach";
  try {
    troupe::wire::check_host("--advertise-address", a.advertise_address);
  } catch (const troupe::ConfigError& e) {
    return e.what();
  }
  return "";
}

int cmd_start(const Args& a) {
  std::string dir = session_dir();
  troupe::core::ensure_session_dir(dir);
  // Validate before starting anything.
  if (const std::string why = bad_start_value(a); !why.empty()) {
    std::fprintf(stderr, "troupe start: %s\n", why.c_str());
    return 2;
  }
  if (!a.head && a.address.empty()) {
    // A head's option given alone most likely meant --head: say so.
    const std::string hint = a.head_options_given.empty()
                                 ? ""
                                 : " (" + a.head_options_given.front() + " is an option of the head: add --head)";
    std::fprintf(stderr, "troupe start: give --head, or --address HOST:PORT of a head%s\n", hint.c_str());
    return 2;
  }
  if (const std::string why = conflicting_start_options(a); !why.empty()) {
    std::fprintf(stderr, "troupe start: %s\n", why.c_str());
    return 2;
  }
  if (a.no_token_file && troupe::core::env_value(troupe::core::kEnvToken).empty()) {
    std::fprintf(stderr, "troupe start: --no-token-file needs the token in TROUPE_TOKEN\n");
    return 2;
  }
  // A container's PID 1 gets no signal whose action is the default: a
  // SIGTERM (the pod deleted) while it waited for its head was dropped,
  // and the container waited out its grace period. Blocked, it is taken.
  if (a.block && ::getpid() == 1) {
    sigset_t stop;
    sigemptyset(&stop);
    for (int sig : {SIGTERM, SIGINT, SIGHUP}) sigaddset(&stop, sig);
    sigprocmask(SIG_BLOCK, &stop, nullptr);
  }
  int rc = 0;
  try {
    rc = a.head ? start_head(dir, a) : join_head(dir, a);
  } catch (const troupe::launcher::StopSignal& s) {
    std::fprintf(stderr, "troupe start: %s while waiting for the head: stopped\n", strsignal(s.signal));
    return 0;
  }
  if (rc != 0 || !a.block) return rc;
  return block_on(dir, g_started);
}

// A malformed --address: a usage error (exit 2), as `troupe stop` says it,
// where a cluster that is not there is a failure (1).
struct UsageError : troupe::ConfigError {
  using troupe::ConfigError::ConfigError;
};

troupe::Runtime connect_session(const std::string& address_flag) {
  if (!address_flag.empty() && address_flag != "auto") try {
      troupe::wire::parse_address(address_flag);
    } catch (const troupe::ConfigError& e) {
      throw UsageError("--address " + address_flag + ": " + e.what());
    }
  std::string dir = session_dir();
  troupe::core::check_session_dir(dir);
  troupe::InitOptions o;
  o.address = session_address(dir, address_flag);
  o.token = token_for(dir);
  if (o.address.empty()) throw troupe::ConfigError("no running cluster in " + dir + " (troupe start --head)");
  try {
    if (!o.token.empty()) troupe::launcher::probe_head(o.address, o.token);
  } catch (const troupe::launcher::HeadUnreachable& e) {
    // The session's own head, which this session started, has exited
    // without a `troupe stop` here (one from another host stops it, and
    // leaves its files): say that rather than "connection refused".
    const auto head = troupe::core::check_pid_file(dir, "head.pid");
    if (address_flag.empty() || address_flag == "auto")
      if (head.pid > 0 && !head.alive && !troupe::core::has_live_pid_file(dir))
        throw troupe::ConnectionError("no cluster runs in session " + dir + ": its head (pid " +
                                      std::to_string(head.pid) +
                                      ") has exited (stopped from another host?); `troupe stop` clears what it "
                                      "left, `troupe start --head` starts one (" +
                                      e.what() + ")");
    throw;
  }
  return troupe::Runtime::connect(o);
}

// `troupe logs [head | node N | ACTOR] [-f]`: the head relays the read to
// the node agent that has the file, so no ssh is needed.
struct LogsArgs {
  std::vector<std::string> target;
  bool follow = false;
  bool previous = false;
  uint32_t tail = 64 * 1024;
  std::string name;  // --name: an actor by name, whatever it looks like ("7", "head")
};

// The actor named `name`: the live one, or else the newest the head still
// keeps of that name (a dead actor's log is the one most worth reading,
// and a name is free again once its actor died).
uint64_t actor_by_name(troupe::Runtime& rt, const std::string& name) {
  try {
    return rt.core()->head().call<troupe::wire::ActorInfo>(troupe::wire::Op::kGetActor, name).id;
  } catch (const troupe::ConfigError&) {
    uint64_t newest = 0;
    const auto status = nlohmann::json::parse(rt.status_json());  // kept: the loop reads into it
    for (const auto& a : status["actors"])
      if (a["name"] == name) newest = std::max(newest, a["id"].get<uint64_t>());
    if (newest != 0) return newest;
    // A name given without its namespace ("p1" for an actor a driver
    // named in namespace "probe", kept as "probe/p1"): found when one
    // namespace has it, else the candidates are named. The live holders
    // first: a name a dead actor held in another namespace does not make
    // it ambiguous.
    std::map<std::string, uint64_t> in_namespaces;
    for (const bool live_only : {true, false}) {
      if (!in_namespaces.empty() || name.find('/') != std::string::npos) break;
      for (const auto& a : status["actors"]) {
        if (live_only && a.value("state", std::string()) == "DEAD") continue;
        const std::string full = a.value("name", std::string());
        if (full.size() > name.size() + 1 &&
            full.compare(full.size() - name.size() - 1, std::string::npos, "/" + name) == 0) {
          auto& id = in_namespaces[full];
          id = std::max(id, a["id"].get<uint64_t>());
        }
      }
    }
    if (in_namespaces.size() == 1) return in_namespaces.begin()->second;
    if (in_namespaces.empty()) throw;
    std::string names;
    for (const auto& [full, id] : in_namespaces) names += (names.empty() ? "" : ", ") + full;
    throw troupe::ConfigError("no actor named '" + name + "' outside a namespace; in namespaces: " + names +
                              " (give one, as NAMESPACE/NAME)");
  }
}

troupe::wire::ReadLog log_request(troupe::Runtime& rt, const LogsArgs& l) {
  troupe::wire::ReadLog r;
  // One byte before the tail too: whether the tail begins a line.
  r.max_bytes = l.tail < (4u << 20) ? l.tail + 1 : l.tail;
  const auto& t = l.target;
  // Digits only: stoull takes "-1" as 2^64 - 1 ("node 18446744073709551615").
  auto number = [](const std::string& s, const char* what) {
    try {
      size_t used = 0;
      if (!s.empty() && s.find_first_not_of("0123456789") == std::string::npos) {
        const uint64_t v = std::stoull(s, &used);
        if (used == s.size()) return v;
      }
    } catch (const std::exception&) {
    }
    throw troupe::ConfigError("'" + s + "' is not " + what);
  };
  if (!l.name.empty()) {
    if (!t.empty()) throw troupe::ConfigError("give an actor's --name or a target, not both");
    r.target = l.previous ? "actor_previous" : "actor";
    r.id = actor_by_name(rt, l.name);
  } else if (t.empty() || (t.size() == 1 && t[0] == "head")) {
    r.target = "head";
  } else if (t.size() == 2 && t[0] == "node") {
    r.target = "node";
    r.id = number(t[1], "a node id (troupe status lists them)");
  } else if (t.size() == 1) {
    r.target = "actor";
    bool numeric = !t[0].empty() && t[0].find_first_not_of("0123456789") == std::string::npos;
    try {
      r.id = numeric ? number(t[0], "an actor id") : actor_by_name(rt, t[0]);
    } catch (const troupe::ConfigError& e) {
      // `troupe logs node` most likely meant a node's log, not an actor.
      if (t[0] != "node") throw;
      throw troupe::ConfigError(std::string(e.what()) + " (a node's log: troupe logs node N, N from troupe status)");
    }
    if (l.previous) r.target = "actor_previous";
  } else {
    throw troupe::ConfigError("give head, node N, or an actor's id or name");
  }
  if (l.previous && r.target != "actor_previous") throw troupe::ConfigError("--previous is for an actor's log");
  if (l.previous && l.follow) throw troupe::ConfigError("--previous reads a worker that ended: it takes no --follow");
  return r;
}

// Why actor `id` is dead for good, or nothing while it lives (or restarts).
std::optional<std::string> dead_actor_cause(troupe::Runtime& rt, uint64_t id) {
  troupe::wire::StatusRequest dead;
  dead.state = "DEAD";
  const auto status = nlohmann::json::parse(rt.status_json(dead), nullptr, false);
  if (!status.is_object() || !status.contains("actors")) return std::nullopt;
  for (const auto& a : status["actors"])
    if (a.value("id", uint64_t{0}) == id) return a.value("death_cause", std::string("dead"));
  return std::nullopt;
}

// Whether node `id` is known to the head and dead.
bool node_is_dead(troupe::Runtime& rt, uint64_t id) {
  for (const auto& n : rt.nodes())
    if (n.id == id) return !n.alive;
  return false;
}

int cmd_logs(const Args& a, const LogsArgs& l) {
  auto rt = connect_session(a.address);
  troupe::wire::ReadLog req;
  try {
    req = log_request(rt, l);
  } catch (const troupe::ConfigError& e) {  // a target that names no log
    std::fprintf(stderr, "troupe logs: %s\n", e.what());
    return 2;
  }
  auto read = [&](const troupe::wire::ReadLog& r) {
    return rt.core()->head().call<troupe::wire::LogChunk>(troupe::wire::Op::kReadLog, r);
  };
  // Prints the rest of the file `rest` reads, to its end or until a read
  // is of another file than the one followed (`same` says).
  auto print_rest = [&](troupe::wire::ReadLog rest, auto same) {
    for (;;) {
      auto old = read(rest);
      if (!same(old)) break;
      std::fwrite(old.text.data(), 1, old.text.size(), stdout);
      rest.offset = old.next_offset;
      if (old.text.empty() || old.next_offset >= old.size) break;
    }
    std::fflush(stdout);
  };
  std::string path;      // the file followed
  uint64_t file_id = 0;  // and its inode
  bool waiting = false;
  auto next_liveness_check = std::chrono::steady_clock::now();
  for (bool first = true;; first = false) {
    troupe::wire::LogChunk chunk;
    try {
      chunk = read(req);
      if (!first && chunk.path != path && req.target == "actor") {
        // A new worker (the actor restarted): the rest of the file
        // followed, then the new one from its start.
        troupe::wire::ReadLog rest = req;
        rest.target = "actor_previous";
        // Restarted more than once meanwhile: that file is gone by.
        print_rest(rest, [&](const troupe::wire::LogChunk& c) { return c.path == path; });
        std::fprintf(stderr, "troupe logs: actor %llu has a new worker (%s): following it from its start\n",
                     static_cast<unsigned long long>(req.id), chunk.path.c_str());
        path = chunk.path;
        req.offset = 0;
        continue;
      }
    } catch (const troupe::Error& e) {
      // Following, a read that fails after one went well is a moment of
      // change (a new worker whose file is not there yet, a node agent
      // reconnecting): tried again, said once. An actor that is gone, or
      // the first read, ends it (no such actor or node, no log file).
      // A connection error ends it only when the head is gone for good: a
      // durable head's restart fails the reads in flight while its client
      // reconnects (the follower ended, exit 1, at every such restart).
      const bool gone = std::string_view(e.what()).find("no actor with id") != std::string_view::npos ||
                        (dynamic_cast<const troupe::ConnectionError*>(&e) != nullptr && rt.core()->head().is_closed());
      if (!l.follow || first || gone) {
        std::fprintf(stderr, "troupe logs: %s\n", e.what());
        return dynamic_cast<const troupe::ConfigError*>(&e) ? 2 : 1;
      }
      // Nor does a node that is gone, nor an actor dead for good whose
      // file can no longer be read: each read failed again every 300 ms,
      // for ever (the end of a followed actor was only seen after a read
      // that went well).
      // (An agent reconnecting to a durable head is not gone: waited for.)
      if (std::chrono::steady_clock::now() >= next_liveness_check) {
        next_liveness_check = std::chrono::steady_clock::now() + std::chrono::seconds(2);
        if (req.target == "node" && node_is_dead(rt, req.id)) {
          std::fprintf(stderr, "troupe logs: node %llu is dead: no more output (%s)\n",
                       static_cast<unsigned long long>(req.id), e.what());
          return 1;
        }
        if (req.target == "actor")
          if (const auto cause = dead_actor_cause(rt, req.id)) {
            std::fprintf(stderr, "troupe logs: actor %llu is dead (%s): no more output (%s)\n",
                         static_cast<unsigned long long>(req.id), cause->c_str(), e.what());
            return 0;
          }
      }
      if (!waiting) std::fprintf(stderr, "troupe logs: waiting for the log (%s)\n", e.what());
      waiting = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      continue;
    }
    waiting = false;
    if (!first && chunk.path == path && chunk.file_id != file_id) {
      // Rotated under us: the rest of the file followed is PATH.1 now
      // (unless it rotated twice meanwhile), then the new one from its
      // start. Lines written just before the rotation were lost here.
      troupe::wire::ReadLog rest = req;
      rest.rotated = true;
      try {
        print_rest(rest, [&](const troupe::wire::LogChunk& c) { return c.file_id == file_id; });
      } catch (const troupe::Error&) {
        std::fflush(stdout);  // PATH.1 gone: rotated again
      }
      file_id = chunk.file_id;
      req.offset = 0;
      continue;
    }
    if (!first && chunk.size < req.offset) {
      // The same file, shorter: truncated. Read from its start.
      std::fprintf(stderr, "troupe logs: %s was truncated; reading it from its start\n", chunk.path.c_str());
      req.offset = 0;
      continue;
    }
    path = chunk.path;
    file_id = chunk.file_id;
    std::string_view text = chunk.text;
    if (first && chunk.next_offset > text.size() && !text.empty()) {
      // It began one byte before the tail: the tail from its first whole
      // line; all of it when no line starts in it (a tail shorter than
      // the last line shows that line's end, not nothing).
      const size_t newline = text.find('\n');
      const bool a_line_starts = newline != std::string_view::npos && newline + 1 < text.size();
      text = a_line_starts ? text.substr(newline + 1) : text.substr(1);
    }
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
    if (!l.follow) return 0;
    req.offset = chunk.next_offset;
    if (chunk.next_offset < chunk.size) continue;
    // At the end of an actor's file: an actor dead for good writes no more
    // (following it waited for ever, without a word). Its file is read to
    // its end once more (lines written before it died), and that is said.
    if (req.target == "actor" && std::chrono::steady_clock::now() >= next_liveness_check) {
      next_liveness_check = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      if (const auto cause = dead_actor_cause(rt, req.id)) {
        print_rest(req, [&](const troupe::wire::LogChunk& c) { return c.path == path; });
        std::fprintf(stderr, "troupe logs: actor %llu is dead (%s): no more output\n",
                     static_cast<unsigned long long>(req.id), cause->c_str());
        return 0;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
}

// "CPU 1/2  GPU 0/0  " for a status row: used/total of each resource. A
// dead node shows "-" for used: nothing on it runs (its JSON shows nothing
// in use either).
std::string node_resources_text(const nlohmann::json& n) {
  const bool alive = n["alive"].get<bool>();
  std::string res;
  for (auto& [k, v] : n["total"].items()) {
    char buf[128];
    // Memory is counted in bytes and shown in GiB.
    const bool bytes = k == "memory";
    const double scale = bytes ? 1.0 / (1ull << 30) : 1.0;
    const char* unit = bytes ? " GiB" : "";
    if (!alive) {
      std::snprintf(buf, sizeof(buf), bytes ? "%s -/%.1f%s  " : "%s -/%g%s  ", k.c_str(), v.get<double>() * scale,
                    unit);
    } else {
      double used = n["used"].contains(k) ? n["used"][k].get<double>() : 0.0;
      std::snprintf(buf, sizeof(buf), bytes ? "%s %.1f/%.1f%s  " : "%s %g/%g%s  ", k.c_str(), used * scale,
                    v.get<double>() * scale, unit);
    }
    res += buf;
  }
  return res;
}

// Text from the cluster as one line of the table: its first line (a
// traceback goes on), other control characters (a terminal's escapes) as
// '?'.
std::string one_line(const std::string& text) {
  const size_t newline = text.find_first_of("\r\n");
  std::string line = text.substr(0, newline);
  for (char& c : line)
    if (static_cast<unsigned char>(c) < ' ' || c == 0x7f) c = '?';
  if (newline != std::string::npos && text.find_first_not_of(" \r\n\t", newline) != std::string::npos) line += " ...";
  return line;
}
// A job document's fields, as a job published them in the KV store (any
// client may write one there, so any field may be missing or of another
// type: shown as "?" or 0). A null number was not finite (JSON has no
// NaN: a diverged job's loss) and shows as nan.
std::string job_text(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? one_line(it->get<std::string>()) : "?";
}
double job_number(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end()) return 0;
  if (it->is_number()) return it->get<double>();
  return it->is_null() ? std::numeric_limits<double>::quiet_NaN() : 0;
}
long long job_count(const nlohmann::json& j, const char* key) {
  const double v = job_number(j, key);
  return std::isfinite(v) && std::fabs(v) < 9e18 ? static_cast<long long>(v) : 0;
}

int cmd_status(const Args& a) {
  auto rt = connect_session(a.address);
  auto j = nlohmann::json::parse(rt.status_json(a.status));
  if (a.json) {
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::printf("head %s\n", j["address"].get<std::string>().c_str());
  // A durable head that could not write its state db goes on as a
  // non-durable one: said first, since a restart would lose the cluster.
  if (const auto db = j.value("state_db", nlohmann::json::object()); db.contains("error"))
    std::printf(
        "warning: the head's state db %s failed a write (%s): its tables are no longer saved, and a "
        "head restarted now starts empty\n",
        db.value("path", std::string()).c_str(), one_line(db["error"].get<std::string>()).c_str());
  std::printf("\nnodes:\n");
  for (auto& n : j["nodes"]) {
    const std::string res = node_resources_text(n);
    std::printf("  node %-3llu %-6s %-20s pid %-7d %s\n", (unsigned long long)n["id"].get<uint64_t>(),
                n["alive"].get<bool>() ? "ALIVE" : "DEAD", one_line(n["hostname"].get<std::string>()).c_str(),
                n["pid"].get<int>(), res.c_str());
  }
  std::printf("\nactors:\n");
  // The class column as wide as the longest class shown (C++ classes are
  // qualified: troupe::trainer::TrainerActor).
  int class_width = 20;
  for (auto& x : j["actors"])
    class_width = std::max(class_width, static_cast<int>(x["class"].get<std::string>().size()));
  for (auto& x : j["actors"]) {
    std::string extra = one_line(x["pending_reason"].get<std::string>());
    if (extra.empty()) extra = one_line(x["death_cause"].get<std::string>());
    const std::string name = one_line(x["name"].get<std::string>());
    std::printf("  actor %-4llu %-*s %-10s node %-3llu restarts %d/%d%s%s%s\n",
                (unsigned long long)x["id"].get<uint64_t>(), class_width, x["class"].get<std::string>().c_str(),
                x["state"].get<std::string>().c_str(), (unsigned long long)x["node"].get<uint64_t>(),
                x["restarts"].get<int>(), x["max_restarts"].get<int>(),
                name.empty() ? "" : ("  \"" + name + "\"").c_str(), extra.empty() ? "" : "  ", extra.c_str());
  }
  if (const size_t matching = j.value("actors_matching", size_t{0}); matching > j["actors"].size())
    std::printf("  (%zu more not shown: --limit %zu shows the newest)\n", matching - j["actors"].size(),
                j["actors"].size());
  if (j.contains("jobs") && !j["jobs"].empty()) {
    std::printf("\njobs:\n");
    for (auto& x : j["jobs"]) {
      if (x.contains("error") && x["error"].is_string()) {
        // A document the head did not read (over its size limit): no figures.
        std::printf("  job %-16s %-9s %s\n", job_text(x, "name").c_str(), job_text(x, "state").c_str(),
                    one_line(x["error"].get<std::string>()).c_str());
        continue;
      }
      // Counted from 1, as the job's console counts them ("epoch 2/3").
      std::string epoch = std::to_string(job_count(x, "epoch") + 1);
      if (x.contains("epochs")) epoch += "/" + std::to_string(job_count(x, "epochs"));
      std::printf(
          "  job %-16s %-9s step %-7lld epoch %-5s %8.0f samples/s  step loss %-9.4f %lld worker(s)  %lld "
          "recoveries\n",
          job_text(x, "name").c_str(), job_text(x, "state").c_str(), job_count(x, "step"), epoch.c_str(),
          job_number(x, "samples_per_s"), job_number(x, "loss"), job_count(x, "world_size"),
          job_count(x, "recoveries"));
    }
  }
  if (j.contains("dashboard")) std::printf("\ndashboard: %s\n", j["dashboard"].get<std::string>().c_str());
  if (!j["placement_groups"].empty()) {
    std::printf("\nplacement groups:\n");
    for (auto& g : j["placement_groups"])
      std::printf("  group %-4llu %-14s %-8s %s\n", (unsigned long long)g["id"].get<uint64_t>(),
                  g["strategy"].get<std::string>().c_str(), g["state"].get<std::string>().c_str(),
                  one_line(g["pending_reason"].get<std::string>()).c_str());
  }
  return 0;
}

// SIGTERMs the processes this session's pid files name, each only when it
// is provably the process recorded (same pid and start time); a stale or
// planted pid file is reported and removed, its pid left alone.
//
// Then waits (up to 30 s) for them to be gone: a head that is still
// exiting holds its state file, so a `troupe start --head` right after
// `troupe stop` would be refused; as `ray stop` does, stop returns once
// they have ended, naming any that did not.
struct Stopped {
  int stopped = 0;  // signalled
  int killed = 0;   // still running after the grace period: SIGKILLed
  int left = 0;     // running even after SIGKILL (their pid files stay)
};

Stopped stop_local_processes(const std::string& dir, std::chrono::milliseconds grace, bool force) {
  Stopped r;
  if (!fs::exists(dir)) return r;
  troupe::core::check_session_dir(dir);
  struct Proc {
    pid_t pid;
    uint64_t started;
    fs::path pid_file;
  };
  std::vector<Proc> signalled;
  for (auto& entry : fs::directory_iterator(dir)) {
    std::string name = entry.path().filename();
    if (name.size() < 4 || name.substr(name.size() - 4) != ".pid") continue;
    auto f = troupe::core::check_pid_file(dir, name);
    if (!f.alive) {
      std::fprintf(stderr, "troupe stop: ignoring %s/%s: %s; not signalling it\n", dir.c_str(), name.c_str(),
                   f.problem.c_str());
      fs::remove(entry.path());
      continue;
    }
    const auto started = troupe::core::process_start_time(f.pid);
    if (::kill(f.pid, force ? SIGKILL : SIGTERM) != 0) {
      fs::remove(entry.path());
      continue;
    }
    ++r.stopped;
    if (started)
      signalled.push_back({f.pid, *started, entry.path()});
    else
      fs::remove(entry.path());
  }
  // What named the stopped head's endpoints, so that nothing finds them.
  for (const char* f : {"address", "dashboard"}) fs::remove(fs::path(dir) / f);
  // Waits until every signalled process has ended (its pid file goes then)
  // or `within` has passed; whether any is still running.
  auto wait_for_ends = [&](std::chrono::milliseconds within) {
    const auto deadline = std::chrono::steady_clock::now() + within;
    for (;;) {
      std::erase_if(signalled, [](const Proc& p) {
        if (troupe::core::process_running(p.pid, p.started)) return false;
        fs::remove(p.pid_file);
        return true;
      });
      if (signalled.empty() || std::chrono::steady_clock::now() >= deadline) return !signalled.empty();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  };
  if (!wait_for_ends(force ? std::chrono::milliseconds(5000) : grace) || force) {
    r.left = static_cast<int>(signalled.size());
  } else {
    // Hung (or stopped: SIGSTOP): as `ray stop` does after its grace period.
    for (const auto& p : signalled) {
      std::fprintf(stderr, "troupe stop: pid %d (%s) did not exit within %.0f s of SIGTERM: killing it (SIGKILL)\n",
                   static_cast<int>(p.pid), p.pid_file.filename().c_str(), grace.count() / 1000.0);
      if (troupe::core::process_running(p.pid, p.started)) ::kill(p.pid, SIGKILL);
    }
    r.killed = static_cast<int>(signalled.size());
    wait_for_ends(std::chrono::milliseconds(5000));
    r.left = static_cast<int>(signalled.size());
  }
  for (const auto& p : signalled)
    std::fprintf(stderr, "troupe stop: pid %d (%s) is still running; its pid file stays\n", static_cast<int>(p.pid),
                 p.pid_file.filename().c_str());
  return r;
}

// Whether the session records a process it started (a head, a node agent).
bool has_pid_file(const std::string& dir) {
  if (!fs::exists(dir)) return false;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().extension() == ".pid") return true;
  return false;
}

// The state db of the session's head, emptied as the head empties it when
// told to shut down: its files removed (SQLite's journal files with it).
void remove_state_db(const std::string& dir) {
  const std::string db = read_session_file(dir, "state_db");
  if (db.empty()) return;
  // PATH.lock stays: a head that has not exited yet holds it, and a new
  // file of that name would let another head in beside it.
  bool removed = false;
  for (const char* suffix : {"", "-wal", "-shm", "-journal"}) {
    std::error_code ec;
    removed = fs::remove(db + suffix, ec) || removed;
  }
  if (removed) std::printf("removed the head's state db %s\n", db.c_str());
}

// What stop_local_processes did, said; the exit status (1 when a process
// is left running). With none left, the copies of files drivers shipped
// to this host's trainers (SESSION/shipped, shipped_file.h) go too.
int report_stopped(const Stopped& r, const std::string& dir) {
  std::printf("stopped %d local troupe process(es)%s\n", r.stopped,
              r.killed > 0 ? (" (" + std::to_string(r.killed) + " killed after the grace period)").c_str() : "");
  if (r.left == 0) {
    troupe::remove_shipped_copies(dir);
    return 0;
  }
  std::fprintf(stderr, "troupe stop: %d process(es) still running: see above\n", r.left);
  return 1;
}

// A session whose pid files are gone (its directory removed while its
// cluster ran) left its head and node agents running where `troupe stop`
// found nothing to stop. They are found by what they write to: this
// binary's processes whose output is a log of the session's (head.log,
// node-*.log; "(deleted)" when removed), and pid files are written for
// them again: the head's (a supervisor's, when the head under it writes
// there too), and the agents'.
void adopt_orphans(const std::string& dir) {
  if (has_pid_file(dir)) return;
  std::error_code ec;
  const auto self = fs::read_symlink("/proc/self/exe", ec);
  std::vector<std::pair<pid_t, bool>> found;  // pid, is a head (or supervisor)
  for (const auto& entry : fs::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = std::stoi(name);
    if (pid == ::getpid() || fs::read_symlink(entry.path() / "exe", ec) != self || ec) continue;
    const std::string out = fs::read_symlink(entry.path() / "fd" / "1", ec).string();
    if (ec || out.rfind(dir + "/", 0) != 0) continue;
    const std::string file = out.substr(dir.size() + 1);
    if (file.rfind("head.log", 0) == 0 || file.rfind("node-", 0) == 0) found.emplace_back(pid, file[0] == 'h');
  }
  if (found.empty()) return;
  troupe::core::ensure_session_dir(dir);
  for (const auto& [pid, head] : found) {
    // A supervised head's head runs under its supervisor: the supervisor's
    // pid file stops both.
    if (head && std::any_of(found.begin(), found.end(),
                            [&, p = pid](const auto& f) { return f.second && troupe::core::parent_pid(p) == f.first; }))
      continue;
    const std::string file = head ? "head.pid" : "node-adopted-" + std::to_string(pid) + ".pid";
    troupe::core::write_pid_file(dir, file, pid);
    std::printf("troupe stop: found %s pid %d by its log in %s (the session's pid files were gone)\n",
                head ? "the head" : "node agent", static_cast<int>(pid), dir.c_str());
  }
}

int cmd_stop(const Args& a) {
  std::string dir = session_dir();
  troupe::core::check_session_dir(dir);
  adopt_orphans(dir);
  const auto grace = std::chrono::milliseconds(static_cast<int64_t>(a.grace_period_s * 1000));
  // `auto` is the session's head, as the default is.
  const std::string address = a.address == "auto" ? "" : a.address;
  // A session that joined a cluster (`troupe start --address`) and runs no
  // head of its own stops its node agents alone, as `ray stop` does: the
  // cluster goes on without this machine. --address stops that cluster.
  if (address.empty() && !fs::exists(fs::path(dir) / "head.pid")) {
    if (!has_pid_file(dir)) {
      std::printf("nothing to stop: session %s runs no troupe process\n", dir.c_str());
      troupe::remove_shipped_copies(dir);  // as report_stopped does
      return 0;
    }
    std::printf(
        "this session runs no head: stopping its local processes only (the cluster goes on; `troupe stop "
        "--address HOST:PORT` stops the whole cluster)\n");
    return report_stopped(stop_local_processes(dir, grace, a.force), dir);
  }
  // Another cluster than this session's, named by --address: only its
  // head is told; this session's processes are none of its business.
  const bool elsewhere = !address.empty() && address != read_session_file(dir, "address");
  if (elsewhere && !address_is_well_formed("stop", address)) return 2;
  bool head_told = false;
  if (!a.force) try {
      auto rt = connect_session(address);
      rt.core()->head().call_empty<void>(troupe::wire::Op::kShutdown, std::chrono::seconds(5));
      head_told = true;
    } catch (const std::exception& e) {
      if (elsewhere) {
        std::fprintf(stderr, "troupe stop: the head at %s was not stopped: %s\n", address.c_str(), e.what());
        return 1;
      }
      std::fprintf(stderr, "troupe stop: head not reachable (%s); stopping local processes\n", e.what());
    }
  if (elsewhere) {
    if (a.force) {
      std::fprintf(stderr, "troupe stop: --force kills this session's processes; --address %s is another cluster\n",
                   address.c_str());
      return 2;
    }
    std::printf("told the head at %s to stop its cluster\n", address.c_str());
    return 0;
  }
  const Stopped r = stop_local_processes(dir, grace, a.force);
  // A head that could not be told, or was killed, did not empty its state
  // db: a head started next in this session would reload the stopped
  // cluster. One still running holds it: it stays.
  if (r.left == 0) {
    if (!head_told || r.killed > 0) remove_state_db(dir);
    fs::remove(fs::path(dir) / "state_db");
  }
  return report_stopped(r, dir);
}

int cmd_submit(const Args& a) {
  if (a.command.empty()) {
    std::fprintf(stderr, "troupe submit: give the driver command after --\n");
    return 2;
  }
  if (!a.runtime_env_json.empty()) {
    // Checked here, so that a typo is one line before the driver starts;
    // the values are troupe.init's to check, but for a working_dir that
    // is not a directory here.
    nlohmann::json env;
    try {
      env = nlohmann::json::parse(a.runtime_env_json);
      if (!env.is_object()) throw std::runtime_error("not a JSON object");
    } catch (const std::exception& e) {
      std::fprintf(stderr,
                   "troupe submit: --runtime-env-json '%s' is not a JSON object such as {\"working_dir\": \".\"}: %s\n",
                   a.runtime_env_json.c_str(), e.what());
      return 2;
    }
    // The Python shim's _RUNTIME_ENV_KEYS.
    static const std::set<std::string> kKeys = {"env_vars", "working_dir", "py_modules", "excludes", "pip"};
    for (const auto& [key, value] : env.items()) {
      if (kKeys.count(key)) continue;
      std::fprintf(stderr,
                   "troupe submit: --runtime-env-json: key \"%s\" is not one troupe takes (env_vars, working_dir, "
                   "py_modules, excludes, pip)\n",
                   key.c_str());
      return 2;
    }
    std::error_code ec;
    if (env.contains("working_dir") && env["working_dir"].is_string() &&
        !std::filesystem::is_directory(env["working_dir"].get<std::string>(), ec)) {
      std::fprintf(stderr, "troupe submit: --runtime-env-json: working_dir \"%s\" is not a directory here\n",
                   env["working_dir"].get<std::string>().c_str());
      return 2;
    }
    setenv(troupe::core::kEnvRuntimeEnv, a.runtime_env_json.c_str(), 1);
  }
  std::string dir = session_dir();
  troupe::core::check_session_dir(dir);
  std::string address = session_address(dir, a.address);
  if (address.empty()) {
    // As status and logs: a state to change (start one), not a usage error.
    std::fprintf(stderr, "troupe submit: no running cluster in %s (troupe start --head)\n", dir.c_str());
    return 1;
  }
  if (!address_is_well_formed("submit", address)) return 2;  // here, not as the driver's first error
  setenv(troupe::core::kEnvAddress, address.c_str(), 1);
  setenv(troupe::core::kEnvToken, token_for(dir).c_str(), 1);
  std::vector<char*> argv;
  for (auto& s : a.command) argv.push_back(const_cast<char*>(s.c_str()));
  argv.push_back(nullptr);
  execvp(argv[0], argv.data());
  std::perror(("troupe submit: cannot run " + a.command[0]).c_str());
  return 127;
}

// `troupe torchrun ...`: parsed by hand rather than by CLI11, since
// everything after the script is the script's and torchrun's spellings
// (--nproc_per_node=2) must pass. Bad input is one line and exit code 2,
// before anything starts.
int cmd_torchrun(const std::vector<std::string>& args) {
  namespace tl = troupe::launcher;
  tl::TorchrunOptions o;
  try {
    o = tl::parse_torchrun_args(args, [](const char* name) { return std::getenv(name); });
  } catch (const tl::TorchrunUsageError& e) {
    std::fprintf(stderr, "troupe torchrun: %s\n", e.what());
    return 2;
  }
  if (o.help) {
    std::fputs(tl::torchrun_usage().c_str(), stdout);
    return 0;
  }
  try {
    if (!o.nproc_word.empty()) {
      const auto here = troupe::node::detect_resources({});
      tl::resolve_nproc(o, static_cast<int>(here.count("CPU") ? here.at("CPU") : 1),
                        static_cast<int>(here.count("GPU") ? here.at("GPU") : 0));
    }
  } catch (const tl::TorchrunUsageError& e) {
    std::fprintf(stderr, "troupe torchrun: %s\n", e.what());
    return 2;
  }
  if (!o.ignored.empty()) {
    std::string given;
    for (const auto& g : o.ignored) given += (given.empty() ? "" : ", ") + g;
    std::fprintf(stderr,
                 "troupe torchrun: ignoring %s (troupe places and connects the ranks itself; --address names the "
                 "cluster)\n",
                 given.c_str());
  }
  const char* path = std::getenv("PATH");
  if (o.no_python && o.script.find('/') == std::string::npos) {
    // A program on the nodes' PATH: on an embedded cluster, this one's.
    if (o.address.empty() && tl::find_executable(o.script, path ? path : "").empty()) {
      std::fprintf(stderr, "troupe torchrun: --no-python %s: no such program on PATH\n", o.script.c_str());
      return 2;
    }
  } else if (!o.module) {
    // The script must be a file: a directory (a project's folder given for
    // its main script) is named as such, not as missing.
    std::error_code ec;
    fs::file_status st = fs::status(o.script, ec);
    std::string why;
    if (fs::is_directory(st)) {
      why = "is a directory; expected a script file (troupe torchrun [options] script.py args...)";
    } else if (!fs::exists(st)) {
      bool missing = !ec || ec == std::errc::no_such_file_or_directory || ec == std::errc::not_a_directory;
      why = missing ? "no such file" : "cannot be read (" + ec.message() + ")";
    } else if (!fs::is_regular_file(st)) {
      why = "is not a regular file; expected a script file";
    } else if (o.no_python && ::access(o.script.c_str(), X_OK) != 0) {
      why = "is not executable, and --no-python runs it as a program (chmod +x it, or drop --no-python)";
    }
    if (!why.empty()) {
      std::fprintf(stderr, "troupe torchrun: script %s: %s\n", o.script.c_str(), why.c_str());
      return 2;
    }
  }
  if (o.address.empty() && o.max_nodes > 1) {
    // An embedded cluster is this machine: it would wait for nodes that
    // never come; and `--nnodes 1:4`, run on each machine of a Slurm job
    // (srun torchrun ...), trained one whole job per machine, each writing
    // the same checkpoints.
    const std::string nnodes = o.min_nodes == o.max_nodes
                                   ? std::to_string(o.min_nodes)
                                   : std::to_string(o.min_nodes) + ":" + std::to_string(o.max_nodes);
    std::fprintf(stderr,
                 "troupe torchrun: --nnodes %s needs a cluster of up to %d nodes: give --address of one (troupe "
                 "start); without it the ranks run on this machine alone (--nnodes 1)\n",
                 nnodes.c_str(), o.max_nodes);
    return 2;
  }
  // A path is where the command runs, as the script's is: a node agent
  // started elsewhere looked it up in its own directory ("interpreter
  // .venv/bin/python not found", or another venv's).
  if (!o.no_python && o.python.find('/') != std::string::npos) {
    std::error_code ec;
    const auto absolute = std::filesystem::absolute(o.python, ec);
    if (!ec) o.python = absolute.lexically_normal().string();
  }
  if (!o.no_python && o.address.empty() && tl::find_executable(o.python, path ? path : "").empty()) {
    std::fprintf(stderr, "troupe torchrun: --python %s: no such interpreter%s\n", o.python.c_str(),
                 o.python.find('/') == std::string::npos ? " on PATH" : "");
    return 2;
  }
  // Before the runtime's threads start, so that they leave the signals to it.
  tl::StopSignals stop("troupe torchrun", "sending SIGTERM to every rank (SIGKILL after " +
                                              std::to_string(tl::kFinalGraceMs / 1000) + " s)");
  auto rt = [&] {
    if (!o.address.empty()) return connect_session(o.address);
    troupe::InitOptions io;
    io.node_resources = tl::torchrun_local_resources(o);
    return troupe::init(io);
  }();
  int rc = tl::run_torchrun(rt, o, &stop);
  rt.shutdown();
  return rc;
}

// `troupe train ...` is `troupe-train ...`: training needs LibTorch, which
// this binary does not link; troupe-train is installed next to it.
int exec_train(int argc, char** argv) {
  std::error_code ec;
  fs::path self = fs::read_symlink("/proc/self/exe", ec);
  fs::path train = (ec ? fs::path(argv[0]) : self).parent_path() / "troupe-train";
  std::vector<char*> args = {const_cast<char*>("troupe-train")};
  for (int i = 2; i < argc; ++i) args.push_back(argv[i]);
  args.push_back(nullptr);
  // The stop signals stay blocked across exec until troupe-train takes
  // them (launcher/stop_signals.h, once LibTorch has loaded): one that
  // comes in its first half second waits for that, rather than killing
  // it without a word.
  sigset_t stop;
  sigemptyset(&stop);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT}) sigaddset(&stop, sig);
  sigset_t was;
  sigprocmask(SIG_BLOCK, &stop, &was);
  execv(train.c_str(), args.data());
  sigprocmask(SIG_SETMASK, &was, nullptr);
  std::fprintf(stderr, "troupe train: cannot run %s (%s); it is built with LibTorch (TROUPE_WITH_TORCH=ON)\n",
               train.c_str(), std::strerror(errno));
  return 127;
}

// Parses the command line: nullopt when it parsed, else the exit code.
// --help and --version exit 0 as CLI11 prints them; a bad command line (a
// value out of range or not a number, an unknown option) is a usage error,
// exit code 2 as for troupe's own checks, in one line naming the option
// (CLI11's own codes, 104 for a conversion error and so on, mean nothing
// to a shell script).
// `troupe submit` takes every word after its options as the driver's
// command, so a misspelt option before `--` became part of it and CLI11
// complained of the driver's first word instead ("argument not expected:
// /bin/true"). Its options are checked by name first.
std::optional<int> unknown_submit_option(CLI::App& submit, int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) != "submit") return std::nullopt;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--" || arg.empty() || arg[0] != '-') return std::nullopt;  // the command begins
    const std::string name = arg.substr(0, arg.find('='));
    const CLI::Option* known = submit.get_option_no_throw(name);
    if (known == nullptr && name != "-h" && name != "--help") {
      std::fprintf(stderr,
                   "troupe submit: unknown option %s (troupe submit --help; the driver's command goes after --)\n",
                   name.c_str());
      return 2;
    }
    if (known != nullptr && known->get_type_size() > 0 && arg.find('=') == std::string::npos) ++i;  // its value
  }
  return std::nullopt;
}

std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv) {
  // A misspelt command is named, --help or not (`troupe job --help`
  // printed the usage and exited 0, so a script could not tell).
  std::string names;
  bool known = argc < 2 || argv[1][0] == '-';
  for (const auto* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    names += (names.empty() ? "" : ", ") + sub->get_name();
    known = known || sub->get_name() == argv[1];
  }
  if (!known) {
    std::fprintf(stderr, "troupe: unknown command '%s' (commands: %s; troupe --help)\n", argv[1], names.c_str());
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
    if (argc < 2) {  // a bare `troupe` gets the usage
      std::fputs(app.help().c_str(), stderr);
      return 2;
    }
    std::fprintf(stderr, "troupe: %s\n", troupe::launcher::cli_message(e).c_str());
    return 2;
  }
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  // First: the signals it blocks for troupe-train are blocked the sooner.
  if (argc >= 2 && std::string(argv[1]) == "train") return exec_train(argc, argv);
  troupe::run_role_if_requested(argc, argv);
  bool torchrun = argc >= 2 && std::string(argv[1]) == "torchrun";
  // The script's output is what a torchrun user reads: the runtime says
  // only what went wrong unless asked for more.
  if (torchrun) setenv(troupe::core::kEnvLogLevel, "warn", 0);
  troupe::core::init_logging("troupe");
  if (torchrun) {
    try {
      return cmd_torchrun(std::vector<std::string>(argv + 2, argv + argc));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "troupe torchrun: %s\n", e.what());
      return 1;
    }
  }
  CLI::App app{"troupe: a C++ actor runtime for data-parallel training"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "troupe " TROUPE_VERSION);
  Args a;
  auto* start = app.add_subcommand("start", "start a head (--head) or a node agent (--address) in the background");
  start->add_flag("--head", a.head, "start the head (and a node agent on this machine)");
  start->add_option("--host", a.host,
                    "address to listen on (0.0.0.0 = every interface); default: 127.0.0.1 with --head, else the "
                    "local address of the interface that routes to the head");
  start->add_option("--advertise-address", a.advertise_address,
                    "address others reach this head's or node's processes at (host name, IPv4, or IPv6 in "
                    "brackets); default: --host, or when it is 0.0.0.0 the first non-loopback interface's "
                    "address (127.0.0.1 if none) for a head, the interface that routes to the head for a node");
  start->add_option("--port", a.port, "head port (0 = any)")
      ->capture_default_str()
      ->check(troupe::launcher::in_range(0, 65535));
  start->add_option("--address", a.address, "HOST:PORT of the head to join (auto: the session's)");
  start->add_option("--resources", a.resources, "resource overrides, e.g. CPU=2,GPU=0,custom=1");
  start
      ->add_option("--worker-pool-size", a.worker_pool_size,
                   "warm idle workers the node keeps per worker executable (0 = start every worker on demand)")
      ->capture_default_str()
      ->check(troupe::launcher::in_range(0u, 64u));
  start
      ->add_option("--worker-idle-timeout", a.worker_idle_timeout_s,
                   "seconds an executable's idle workers outlive its last spawn")
      ->capture_default_str();
  start
      ->add_option("--worker-assign-timeout", a.worker_assign_timeout_s,
                   "seconds a warm worker has to take an actor it was given before it is killed and the actor "
                   "started cold")
      ->capture_default_str();
  start
      ->add_option("--wait-for-head", a.wait_for_head_s,
                   "with --address: seconds to keep trying a head that does not answer yet (refused, timed out, "
                   "or a name that does not resolve), as when agents start before the head; 0 = fail at once")
      ->capture_default_str()
      ->check(troupe::launcher::in_range(0.0, 86400.0));
  start->add_flag("--no-node", a.no_node, "with --head: start no node agent");
  start->add_flag("--block", a.block,
                  "stay in the foreground until what was started exits; SIGTERM/Ctrl-C stops it (containers, srun)");
  start
      ->add_option("--dashboard-port", a.dashboard_port,
                   "with --head: port of the dashboard, /metrics and /api/status (0 = any free port, -1 = off; the "
                   "default falls back to a free port when taken)")
      ->capture_default_str()
      ->check(troupe::launcher::in_range(-1, 65535))
      ->each([&a](const std::string&) { a.dashboard_port_given = true; });
  start->add_flag("--no-token-file", a.no_token_file,
                  "keep the cluster token (from TROUPE_TOKEN) out of the session directory: for a head or agent "
                  "whose environment carries it, as troupe slurm's do");
  start->add_flag("--dashboard-require-token", a.dashboard_require_token,
                  "with --head: the dashboard asks for the token even when the head listens on loopback only");
  auto* state_db =
      start->add_option("--state-db", a.state_db,
                        "with --head: SQLite file the head writes its tables through to; a head started again on the "
                        "same port after it died reloads them, and node agents, workers and drivers reconnect to it "
                        "(default: SESSION/head.sqlite; troupe stop empties it)");
  auto* supervise =
      start->add_flag("--supervise", a.supervise,
                      "with --head: a supervisor process (the pid in SESSION/head.pid) starts the head again at once "
                      "on the same address whenever it dies other than by troupe stop; the new head reloads the state "
                      "db and the cluster goes on");
  start
      ->add_option("--hang-timeout", a.hang_timeout_s,
                   "with --supervise: seconds the head's event loop may give no sign of life before the supervisor "
                   "counts it as hung, kills it and starts it again (0 = never)")
      ->check(troupe::launcher::in_range(0.0, 86400.0))
      ->needs(supervise)
      ->default_val(30);
  start
      ->add_flag("--no-state-db", a.no_state_db,
                 "with --head: keep the tables in memory only (a head that dies ends the cluster)")
      ->excludes(supervise)
      ->excludes(state_db);  // the file given was ignored without a word
  start
      ->add_option("--max-dead-actors", a.max_dead_actors, "with --head: DEAD actors kept for status (oldest go first)")
      ->capture_default_str()
      ->check(troupe::launcher::in_range(size_t(0), size_t(1) << 30));
  start
      ->add_option("--heartbeat-ms", a.heartbeat_ms,
                   "with --head: how often node agents report to the head (the head tells each agent)")
      ->capture_default_str()
      ->check(troupe::launcher::in_range(10u, 60000u));
  start
      ->add_option("--heartbeat-misses", a.heartbeat_misses,
                   "with --head: a node silent for this many intervals is declared dead and fenced (its actors "
                   "restart elsewhere); raise it where agents may be starved of CPU for longer")
      ->capture_default_str()
      ->check(troupe::launcher::in_range(1u, 100000u));
  auto* status = app.add_subcommand("status", "show nodes, resources and actors");
  status->add_flag("--json", a.json, "machine-readable output");
  status->add_option("--address", a.address, "HOST:PORT of the head (default, or auto: the session's)");
  status->add_option("--state", a.status.state, "list only actors in this state")
      ->transform(CLI::IsMember({"PENDING", "ALIVE", "RESTARTING", "DEAD"}, CLI::ignore_case));
  status->add_option("--limit", a.status.limit, "list at most N actors, the newest (0 = all)")
      ->check(troupe::launcher::in_range(0u, 1u << 30));
  auto* stop = app.add_subcommand("stop",
                                  "stop the cluster of this session (in a session that only joined a cluster: its "
                                  "node agents alone)");
  auto* session =
      app.add_subcommand("session",
                         "print this session's directory ($TROUPE_SESSION_DIR, else $XDG_RUNTIME_DIR/troupe, else "
                         "/tmp/troupe-UID): its token, address, pid and log files");
  stop->add_option("--address", a.address,
                   "HOST:PORT of another cluster's head, to stop that cluster (default, or auto: this session's "
                   "cluster; in a session that only joined a cluster, its node agents alone)");
  stop->add_option("--grace-period", a.grace_period_s,
                   "seconds the session's processes have to exit after SIGTERM before they are killed (SIGKILL)")
      ->default_val(30)
      ->check(troupe::launcher::in_range(0.0, 3600.0));
  stop->add_flag("--force", a.force, "kill the session's processes at once (SIGKILL), without telling the head")
      ->excludes("--grace-period");
  auto* submit = app.add_subcommand("submit", "run a driver against the session's cluster");
  submit->add_option("--address", a.address, "HOST:PORT of the head (default, or auto: the session's)");
  submit->add_option("--runtime-env-json", a.runtime_env_json,
                     "the job's runtime_env for a Python driver, as JSON, e.g. '{\"working_dir\": \".\"}' "
                     "(env_vars, working_dir, py_modules, excludes, pip; what troupe.init(runtime_env=...) gives "
                     "wins key by key)");
  submit->add_option("command", a.command, "driver command")->required();
  LogsArgs la;
  auto* logs = app.add_subcommand("logs", "print a log of the cluster: the head's, a node agent's, or an actor's");
  logs->add_option("target", la.target, "head (default), node N, or an actor's id or name");
  logs->add_flag("-f,--follow", la.follow,
                 "keep printing what is appended (Ctrl-C ends); an actor's new worker is followed after a restart");
  logs->add_flag("--previous", la.previous,
                 "an actor's worker before its current one (what a crash printed, after a restart)");
  logs->add_option("--name", la.name, "an actor by its name, also one that reads as a number or as head")
      ->check([](const std::string& name) {
        // An empty name read as no name: the head's log was printed.
        return name.empty() ? std::string("an actor's name is not empty") : std::string();
      });
  logs->add_option("--tail", la.tail, "bytes from the end to start with (and per read)")
      ->capture_default_str()
      ->check(troupe::launcher::in_range(1u, 4u << 20));
  logs->add_option("--address", a.address, "HOST:PORT of the head (default, or auto: the session's)");
  troupe::launcher::SlurmOptions so;
  auto* slurm = app.add_subcommand(
      "slurm",
      "inside a Slurm allocation: a cluster on its nodes (head here, an agent per node via srun) for one driver");
  slurm
      ->add_option("--port", so.port,
                   "head port (0 = any free, so that jobs sharing a node do not collide; the agents and the driver "
                   "are told it)")
      ->capture_default_str()
      ->check(troupe::launcher::in_range(0, 65535));
  slurm->add_option("--dashboard-port", so.dashboard_port, "the head's dashboard port (0 = any free, -1 = off)")
      ->capture_default_str()
      ->check(troupe::launcher::in_range(-1, 65535));
  slurm
      ->add_option("--gpus-per-node", so.gpus_per_node,
                   "GPUs each node agent offers; an error when the allocation has fewer (default: what it has)")
      ->check(troupe::launcher::in_range(0, 64));
  slurm->add_option("--start-timeout", so.start_timeout_s, "seconds for the head and every agent to come up")
      ->capture_default_str();
  slurm->add_flag("--print-sbatch", so.print_sbatch, "print an sbatch script that runs this command, and exit");
  slurm->add_option("command", so.command, "driver command (after --)");
  // Listed for --help only: main() hands `troupe torchrun` to cmd_torchrun.
  app.add_subcommand("torchrun", "run an unmodified torchrun script on the cluster (troupe torchrun --help)");
  // Only for --help: `troupe train` is handed to troupe-train before parsing.
  app.add_subcommand("train", "train a TorchScript step module on .npz arrays (troupe train --help)");
  if (const auto rc = unknown_submit_option(*submit, argc, argv)) return *rc;
  if (const auto rc = parse_command_line(app, argc, argv)) return *rc;
  for (const auto& name : kHeadOnlyOptions)
    if (start->count(name) > 0) a.head_options_given.push_back(name);
  for (const auto& name : kNodeOnlyOptions)
    if (start->count(name) > 0) a.node_options_given.push_back(name);
  // A head that listens beyond loopback serves agents across a network,
  // where a lost packet is resent after 200 ms and more: half a second of
  // silence there is a blip, not a dead node (a 250 ms outage fenced a
  // healthy node 2 times in 3). Unless told, such a head gives its nodes
  // 20 heartbeats.
  if (a.head && start->count("--heartbeat-misses") == 0 && !a.host.empty() && !troupe::head::is_loopback_host(a.host))
    a.heartbeat_misses = troupe::core::kNetworkHeartbeatMisses;
  try {
    if (*start) return cmd_start(a);
    if (*status) return cmd_status(a);
    if (*stop) return cmd_stop(a);
    if (*session) {
      std::printf("%s\n", session_dir().c_str());
      return 0;
    }
    if (*submit) return cmd_submit(a);
    if (*logs) return cmd_logs(a, la);
    if (*slurm) {
      std::error_code ec;
      const std::string self = fs::read_symlink("/proc/self/exe", ec).string();
      if (const std::string why = troupe::launcher::bad_slurm_value(so); !why.empty()) {
        std::fprintf(stderr, "troupe slurm: %s\n", why.c_str());
        return 2;
      }
      if (so.print_sbatch) {
        std::fputs(troupe::launcher::sbatch_script(so, self).c_str(), stdout);
        return 0;
      }
      return troupe::launcher::run_slurm(so, self);
    }
  } catch (const UsageError& e) {
    std::fprintf(stderr, "troupe: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe: %s\n", e.what());
    return 1;
  }
  return 0;
}
