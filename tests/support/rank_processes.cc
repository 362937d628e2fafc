#include "tests/support/rank_processes.h"

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <thread>

#include <sys/wait.h>
#include <unistd.h>

namespace troupe::test {

RankProcesses::RankProcesses(int world_size, const std::function<void(int)>& body) {
  std::fflush(stdout);
  std::fflush(stderr);
  for (int r = 0; r < world_size; ++r) {
    pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("fork");
      std::abort();
    }
    if (pid == 0) {
      int code = 0;
      try {
        body(r);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[rank %d pid %d] FAILED: %s\n", r, ::getpid(), e.what());
        code = 1;
      } catch (...) {
        std::fprintf(stderr, "[rank %d pid %d] FAILED: unknown exception\n", r, ::getpid());
        code = 1;
      }
      std::fflush(stderr);
      std::fflush(stdout);
      // _exit: the child must not run the parent's atexit handlers or gtest.
      ::_exit(code);
    }
    pids_.push_back(pid);
    exits_.push_back(RankExit{r});
    reaped_.push_back(false);
  }
}

RankProcesses::~RankProcesses() {
  for (size_t r = 0; r < pids_.size(); ++r) {
    if (!reaped_[r]) {
      ::kill(pids_[r], SIGKILL);
      ::waitpid(pids_[r], nullptr, 0);
    }
  }
}

void RankProcesses::kill(int rank, int signal) { ::kill(pids_.at(rank), signal); }

std::vector<RankExit> RankProcesses::wait_all(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::milliseconds(1);
  for (;;) {
    bool all = true;
    for (size_t r = 0; r < pids_.size(); ++r) {
      if (reaped_[r]) continue;
      int status = 0;
      pid_t got = ::waitpid(pids_[r], &status, WNOHANG);
      if (got == pids_[r]) {
        reaped_[r] = true;
        exits_[r].exited = WIFEXITED(status);
        exits_[r].code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        exits_[r].signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
      } else {
        all = false;
      }
    }
    if (all) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      for (size_t r = 0; r < pids_.size(); ++r) {
        if (reaped_[r]) continue;
        ::kill(pids_[r], SIGKILL);
        int status = 0;
        ::waitpid(pids_[r], &status, 0);
        reaped_[r] = true;
        exits_[r].timed_out = true;
        exits_[r].signal = SIGKILL;
      }
      break;
    }
    // Bounded poll of waitpid: children have no other channel to wake us.
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(20));
  }
  return exits_;
}

int64_t monotonic_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string describe(const RankExit& e) {
  std::string s = "rank " + std::to_string(e.rank) + ": ";
  if (e.timed_out) return s + "timed out (killed by the harness)";
  if (e.exited) return s + "exit code " + std::to_string(e.code);
  return s + "killed by signal " + std::to_string(e.signal);
}

}  // namespace troupe::test
