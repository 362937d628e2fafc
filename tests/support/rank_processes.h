// Runs one function per rank in real child processes (fork), the way gloo's
// per-rank test harness does, so collective tests cross process boundaries
// and can kill a rank with SIGKILL. Children report through their exit code
// (0 = pass; a failure message goes to stderr). Every wait is bounded;
// stragglers are killed.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <sys/types.h>

namespace troupe::test {

struct RankExit {
  int rank = 0;
  bool exited = false;  // exited normally (code valid)
  int code = -1;
  int signal = 0;          // terminating signal, when killed
  bool timed_out = false;  // still running at the deadline, killed by us
};

class RankProcesses {
 public:
  // Forks `world_size` children; child r runs body(r) and exits 0 when it
  // returns, 1 when it throws (printing what()).
  RankProcesses(int world_size, const std::function<void(int rank)>& body);
  ~RankProcesses();  // kills and reaps whatever is left
  RankProcesses(const RankProcesses&) = delete;
  RankProcesses& operator=(const RankProcesses&) = delete;

  pid_t pid(int rank) const { return pids_.at(rank); }
  void kill(int rank, int signal);
  // Waits for every child until `timeout`; kills the rest with SIGKILL.
  std::vector<RankExit> wait_all(std::chrono::milliseconds timeout);

 private:
  std::vector<pid_t> pids_;
  std::vector<RankExit> exits_;
  std::vector<bool> reaped_;
};

// steady_clock is CLOCK_MONOTONIC on Linux: comparable across processes.
int64_t monotonic_ms();

std::string describe(const RankExit& e);

}  // namespace troupe::test
