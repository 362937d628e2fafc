// StopSignals: SIGINT, SIGTERM, SIGHUP and SIGQUIT (torchrun's four) for a
// launcher command that must stop what it runs in order (troupe train,
// troupe torchrun) rather than die at once: a closed ssh session's SIGHUP
// killed the launcher outright, and no rank got its SIGTERM to save. A
// SIGHUP or SIGQUIT ignored when it starts (nohup) is left ignored.
// Construct it first in main: it blocks the signals in this
// thread, so every later thread inherits the mask (processes the runtime
// spawns get a clear one: runtime/core/process.cc), and takes them on a
// thread of its own. Threads that exist already (a BLAS library's pool,
// started when it is loaded) do not block them, and the kernel may hand
// them a signal sent to the process: a handler forwards it to the waiting
// thread, where the default action would have killed the process. The
// first sets requested() and prints `first_note`; a second ends the
// process at once (128 + signal). Either signal again within kSameRequest
// of the first is that request arriving twice, not a second one: `timeout`
// and job schedulers send SIGTERM to the process and then to its process
// group, a terminal's Ctrl-C reaches every process of it, and a parent
// that took the same Ctrl-C passes it on (Python's TrainJob sends SIGTERM
// on KeyboardInterrupt: probe 28b). From the first request on SIGPIPE is
// ignored: a pipe's reader (`| tee log`) killed by the same Ctrl-C must
// not end the command before it has stopped in order (what it writes
// there is lost). Not before: a reader that goes away (`| head`, a Python
// driver that died) still ends a command nobody asked to stop.
#pragma once

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

namespace troupe::launcher {

class StopSignals {
 public:
  // Lines go to stderr as "<command>: SIGTERM: <first_note>".
  StopSignals(std::string command, std::string first_note)
      : command_(std::move(command)), first_note_(std::move(first_note)) {
    sigemptyset(&set_);
    for (size_t i = 0; i < kSignals.size(); ++i) {
      // A hang-up or quit the command was started to ignore (nohup) stays
      // ignored: a nohup'd job did not stop when its ssh session closed.
      struct sigaction now {};
      sigaction(kSignals[i], nullptr, &now);
      taken_[i] = !((kSignals[i] == SIGHUP || kSignals[i] == SIGQUIT) && now.sa_handler == SIG_IGN);
      if (taken_[i]) sigaddset(&set_, kSignals[i]);
    }
    pthread_sigmask(SIG_BLOCK, &set_, nullptr);
    waiter_ = std::thread([this] { wait(); });
    waiter_thread() = waiter_.native_handle();
    struct sigaction forward {};
    forward.sa_handler = [](int sig) { pthread_kill(waiter_thread(), sig); };  // async-signal-safe
    sigemptyset(&forward.sa_mask);
    forward.sa_flags = SA_RESTART;
    for (size_t i = 0; i < kSignals.size(); ++i)
      if (taken_[i]) sigaction(kSignals[i], &forward, &old_[i]);
  }
  ~StopSignals() {
    for (size_t i = 0; i < kSignals.size(); ++i)
      if (taken_[i]) sigaction(kSignals[i], &old_[i], nullptr);
    done_ = true;
    pthread_kill(waiter_.native_handle(), SIGTERM);  // wakes sigwait
    waiter_.join();
    if (pipe_ignored_) sigaction(SIGPIPE, &old_pipe_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  bool requested() const { return signal_.load() != 0; }
  // The first signal taken (0 = none).
  int signal() const { return signal_.load(); }
  // Signals taken as the first request arriving again (kSameRequest).
  int repeats() const { return repeats_.load(); }
  static const char* name(int sig) {
    switch (sig) {
      case SIGINT:
        return "SIGINT";
      case SIGHUP:
        return "SIGHUP";
      case SIGQUIT:
        return "SIGQUIT";
      default:
        return "SIGTERM";
    }
  }

 private:
  void wait() {
    for (;;) {
      int sig = 0;
      if (sigwait(&set_, &sig) != 0 || done_) return;
      const auto now = std::chrono::steady_clock::now();
      if (signal_.load() != 0 && now - first_at_ < kSameRequest) {
        repeats_.fetch_add(1);
        continue;
      }
      if (signal_.load() == 0) {
        first_at_ = now;
        struct sigaction ignore {};
        ignore.sa_handler = SIG_IGN;
        sigemptyset(&ignore.sa_mask);
        pipe_ignored_ = sigaction(SIGPIPE, &ignore, &old_pipe_) == 0;
      }
      if (signal_.exchange(sig) != 0) {
        std::fprintf(stderr, "%s: %s again: stopping now\n", command_.c_str(), name(sig));
        std::fflush(stderr);
        ::_exit(128 + sig);
      }
      std::fprintf(stderr, "%s: %s: %s (again to stop at once)\n", command_.c_str(), name(sig), first_note_.c_str());
      std::fflush(stderr);
    }
  }

  // The thread that takes the signals, for the forwarding handler.
  static pthread_t& waiter_thread() {
    static pthread_t t{};
    return t;
  }

  static constexpr std::chrono::milliseconds kSameRequest{500};
  std::chrono::steady_clock::time_point first_at_{};  // the waiter's alone
  const std::string command_;
  const std::string first_note_;
  static constexpr std::array<int, 4> kSignals{SIGINT, SIGTERM, SIGHUP, SIGQUIT};
  std::array<struct sigaction, 4> old_{};
  std::array<bool, 4> taken_{};   // not a SIGHUP or SIGQUIT that was ignored
  struct sigaction old_pipe_ {};  // the waiter's, until it has ended
  bool pipe_ignored_ = false;     // the same
  sigset_t set_;
  std::atomic<int> signal_{0};
  std::atomic<int> repeats_{0};
  std::atomic<bool> done_{false};
  std::thread waiter_;
};

}  // namespace troupe::launcher
