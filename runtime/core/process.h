// Starting processes. spawn_process() is the one fork + exec in troupe: the
// node agent starts workers with it and start_role_process() starts heads
// and node agents with it. A child gets exactly the environment it is given
// and only the file descriptors meant for it (0, 1, 2 and `keep_fds`), so
// no socket, pipe or file of the parent (such as a node agent's
// authenticated head connection) reaches user code.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "troupe/runtime/core/worker_env.h"

namespace troupe::core {

struct SpawnOptions {
  std::string executable;         // path given to execve
  std::string arg0;               // argv[0]; "" = executable
  std::vector<std::string> args;  // argv[1...]
  std::vector<std::string> env;   // the child's whole environment, KEY=VALUE
  std::string log_file;           // "" = inherit 0, 1, 2; else stdin /dev/null, stdout+stderr appended here
  // Descriptors that become the child's stdout and stderr (-1 = as
  // log_file says); for a parent that reads the child's output (the
  // `troupe torchrun` slot forwards its script's lines).
  int stdout_fd = -1;
  int stderr_fd = -1;
  std::string working_dir;    // "" = the parent's
  std::vector<int> keep_fds;  // descriptors above 2 the child keeps, under the same numbers
  // PR_SET_PDEATHSIG: SIGKILL, or group_death_signal() for a process in a
  // group of its own (own_process_group), which takes its group with it.
  bool die_with_parent = true;
  bool new_session = false;  // setsid(), for daemons
  // setpgid(0, 0), stdin /dev/null: a worker. What a terminal sends the
  // parent's process group (Ctrl-C's SIGINT, a batch system's or
  // `timeout`'s group SIGTERM) does not kill it under the program that
  // handles those signals (a driver, `troupe torchrun`); its node agent
  // stops it, and it dies with it (die_with_parent).
  bool own_process_group = false;
};

// The signal a process started in a group of its own gets when its parent
// dies (a node agent killed with SIGKILL, out of memory): a worker whose
// handler (kill_group_when_parent_dies) kills its whole group, so what the
// actor started (a server, a data loader's workers, a tool holding a GPU)
// does not outlive it, reparented to init.
int group_death_signal();
// Installs that handler in a process that leads its own group (a worker,
// at its start); does nothing in one that does not.
void kill_group_when_parent_dies();

// `env` with one entry per name, the last one given (a later setting, such
// as an actor's own `env` after the inherited environment, overrides an
// earlier one; getenv would see the first). spawn_process applies it.
std::vector<std::string> last_setting_wins(const std::vector<std::string>& env);

// Forks and execs. Returns the child's pid once it has exec'd; throws
// troupe::Error (and reaps the child) when fork or execve fails, naming the
// executable and the reason.
pid_t spawn_process(const SpawnOptions& options);

struct RoleProcessOptions {
  std::string executable;              // "" = this binary
  WorkerEnv env;                       // role, token, ...; ready_fd is set by start_role_process
  std::vector<std::string> extra_env;  // KEY=VALUE appended (e.g. TROUPE_LOG_LEVEL=debug)
  std::string log_file;                // "" = inherit stdout/stderr
  bool die_with_parent = true;         // off for daemons
  bool new_session = false;            // on for daemons
  std::chrono::milliseconds ready_timeout{20000};
};

struct RoleProcess {
  pid_t pid = -1;
  std::string ready_line;  // what the process wrote to its ready pipe
};

// Starts a troupe binary in a role and waits for its ready line. A child
// that exits first is reported with its exit status and the end of its log;
// one that stays silent past the timeout is killed. Both throw troupe::Error
// naming `what`.
RoleProcess start_role_process(const RoleProcessOptions& options, const std::string& what);

// waitpid(pid, status, 0), again each time a signal interrupts it: asio's
// signal_set installs its handlers without SA_RESTART, so in a process that
// watches SIGCHLD a child's exit can cut a plain waitpid short and leave
// the child a zombie. Returns waitpid's result (-1 with errno otherwise).
pid_t wait_child(pid_t pid, int* status = nullptr);

// Waits for pid to exit, SIGKILLing it after `grace`.
void reap_process(pid_t pid, std::chrono::milliseconds grace = std::chrono::seconds(10));

// "exited with code 1", "killed by signal 9 (Killed)".
std::string describe_exit_status(int status);

// Field 22 of /proc/PID/stat: when the process started, in clock ticks since
// boot. Together with the pid it names one process for the life of the
// machine (pids are reused, start times of a reused pid differ).
std::optional<uint64_t> process_start_time(pid_t pid);
// Field 4: the pid of its parent.
std::optional<pid_t> parent_pid(pid_t pid);

// Whether `pid` is still the process that started at `start_time` (from
// process_start_time) and has not exited: false once it is gone, a zombie,
// or the pid names another process; true when /proc cannot tell.
bool process_running(pid_t pid, uint64_t start_time);

// The memory this process's machine gives it, in bytes: physical memory,
// or its cgroup's limit (v2 memory.max, v1 memory.limit_in_bytes) when that
// is lower. 0 when neither can be read.
uint64_t memory_limit_bytes();

// The CPUs this process may use: its affinity mask's count (taskset, a
// container's CPU set), or the lowest CPU quota of its cgroup and the
// cgroups above it (v2 cpu.max, v1 cpu.cfs_quota_us), rounded up, when that
// is lower (a container's or a pod's CPU limit). At least 1. The cgroup
// file system's root and this process's cgroup list may be given (tests).
int cpu_limit(const std::string& cgroup_root = "/sys/fs/cgroup", const std::string& proc_cgroup = "/proc/self/cgroup");

// This machine's boot and this process's pid namespace, as one string: two
// processes with equal keys see each other's pids in /proc.
std::string host_key();

// Absolute path of the running binary. When its file was replaced since
// it started (a rebuild, an upgrade in place), the kernel names it
// "PATH (deleted)": the path is then PATH, the file there now (warned
// about once), which workers started from now on run.
std::string self_executable_path();
// self_executable_path's reading of a /proc/PID/exe link's text.
std::string executable_from_link(const std::string& link);

// The command line `ps` and /proc/<pid>/cmdline show for this process:
// remember_args() keeps main's argv (run_role_if_requested does), then
// set_process_title() writes `title` over its strings, cut to the room
// they have (all of argv's strings together, NUL-terminated; nothing is
// moved), the rest zeroed. A pooled worker is started with a spare
// argument for the room its actor's class name needs (kTitleRoom).
void remember_args(int argc, char** argv);
void set_process_title(const std::string& title);
inline constexpr size_t kTitleRoom = 96;

}  // namespace troupe::core
