// Runs one function per rank on threads of this process, for collective
// and trainer tests whose members need not be separate processes (see
// rank_processes.h for those that must). Every thread is joined; the first
// rank's failure is rethrown on the caller.
#pragma once

#include <exception>
#include <functional>
#include <thread>
#include <vector>

namespace troupe::test {

// Runs body(0) .. body(world - 1) concurrently and waits for all of them;
// rethrows the exception of the lowest failing rank.
inline void run_rank_threads(int world, const std::function<void(int rank)>& body) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace troupe::test
