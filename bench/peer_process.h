// PeerProcess: a child process a benchmark measures or compares against (a
// PyTorch peer script, a forked rank), bounded end to end. The child leads
// a process group of its own, so the ranks a peer starts are killed with it;
// every read of its output has a deadline, and on expiry, on failure and
// when the object goes away the whole group is SIGKILLed and reaped. A peer
// that hangs (torch 1.13's ProcessGroupGloo destructor at exit, a rank that
// never connects) becomes a PeerFailed error the benchmark reports as a
// JSON error line, never a hang.
//
//   troupe::bench::PeerProcess peer({"/usr/bin/python3", "peer.py", "--serve"}, {.stdin_pipe = true});
//   peer.write("1024 10 2\n");
//   std::optional<std::string> line = peer.read_line(std::chrono::seconds(60));
//
//   nlohmann::ordered_json row = troupe::bench::run_peer_json({"/usr/bin/python3", "peer.py"}, {},
//   std::chrono::minutes(5));
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace troupe::bench {

// A peer failed to start, exited with an error, sent nothing usable, or
// missed its deadline (then it was killed).
class PeerFailed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct PeerOptions {
  // Extra NAME=VALUE pairs on top of this process's environment.
  std::vector<std::string> env;
  // Give the peer a pipe on its stdin (write(), close_stdin()); otherwise
  // it reads /dev/null.
  bool stdin_pipe = false;
  // Names the peer in errors ("" = argv[0]).
  std::string name;
};

class PeerProcess {
 public:
  // Starts argv (argv[0] is a path, or a name looked up in PATH).
  PeerProcess(const std::vector<std::string>& argv, const PeerOptions& options);
  // Forks and runs `body` in the child, its return value the exit code.
  // For peers written in C++ (a rank of a collective); call it before the
  // parent starts threads.
  PeerProcess(const std::function<int()>& body, const PeerOptions& options);
  // Kills the process group and reaps the peer.
  ~PeerProcess();
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;

  // The next line of the peer's stdout (without '\n'), or nullopt at EOF.
  // Throws PeerFailed, after killing the group, when no full line came
  // within `timeout`.
  std::optional<std::string> read_line(std::chrono::milliseconds timeout);
  // Writes to the peer's stdin (stdin_pipe); false when the peer is gone.
  bool write(const std::string& text);
  // EOF on the peer's stdin: peers that serve commands end on it.
  void close_stdin();
  // Waits up to `timeout` for the peer to exit and returns its wait status;
  // then SIGKILLs what is left of its group (ranks stuck at exit). On
  // expiry the group is killed and PeerFailed thrown.
  int wait(std::chrono::milliseconds timeout);
  // SIGKILLs the whole process group and reaps the peer (idempotent).
  void kill_group();

  pid_t pid() const { return pid_; }
  const std::string& name() const { return name_; }

 private:
  void start(const std::function<void()>& run_child, const PeerOptions& options);

  std::string name_;
  pid_t pid_ = -1;
  bool reaped_ = false;
  int status_ = 0;
  int stdin_fd_ = -1;
  int stdout_fd_ = -1;
  std::string pending_;  // read but not yet returned as a line
};

// Runs a peer that prints its result as a JSON object line, within
// `timeout`. Returns the first JSON object it prints (other lines are
// skipped); the peer then gets a few seconds to exit before its group is
// killed. Throws PeerFailed when the peer exits or times out without one,
// or prints one with an "error" key.
nlohmann::ordered_json run_peer_json(const std::vector<std::string>& argv, const PeerOptions& options,
                                     std::chrono::milliseconds timeout);

// "exited with status 3", "killed by signal 9": a wait status in words.
std::string describe_exit(int wait_status);

}  // namespace troupe::bench
