// A helper thread that no process-directed signal is delivered to. A
// process that handles SIGTERM/SIGINT by blocking them in every thread and
// waiting for them in one (a head, a node agent, `troupe torchrun`) must
// not start a thread that leaves them unblocked: the kernel may hand the
// signal to that thread, whose default action ends the process before it
// cleans up (a head that does not empty its state db on `troupe stop`).
#pragma once

#include <pthread.h>
#include <signal.h>

#include <thread>
#include <utility>

namespace troupe::core {

template <class F>
std::thread signal_free_thread(F&& f) {
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, &old);  // the new thread inherits this mask
  try {
    std::thread t(std::forward<F>(f));
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    return t;
  } catch (...) {
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    throw;
  }
}

}  // namespace troupe::core
