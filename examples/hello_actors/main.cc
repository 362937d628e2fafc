// hello_actors: the actor API in one page. Runs on an embedded local
// cluster (or on a running one with --address HOST:PORT / --address auto).
//
//   ./hello_actors [--address HOST:PORT|auto]
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>

#include "examples/common/cli_checks.h"
#include "troupe/runtime/client/runtime.h"

class Counter {
 public:
  explicit Counter(int start) : value_(start) {}
  int add(int x) { return value_ += x; }
  int pid() const { return getpid(); }
  uint64_t node() const { return std::stoull(std::getenv("TROUPE_NODE_ID")); }

 private:
  int value_;
};
TROUPE_ACTOR(Counter, &Counter::add, &Counter::pid, &Counter::node)

int main(int argc, char** argv) {
  troupe::run_role_if_requested(argc, argv);  // a worker process never returns from here
  std::setvbuf(stdout, nullptr, _IOLBF, 0);   // each line as it happens, into a pipe too
  std::string address;
  CLI::App app{"hello_actors: spawn an actor, call it, kill its process, watch it restart"};
  app.add_option("--address", address, "HOST:PORT of a running cluster, or auto (default: an embedded one)");
  TROUPE_EXAMPLE_PARSE(app, argc, argv);
  troupe::Runtime rt = [&] {
    try {
      return troupe::init(argc, argv);
    } catch (const troupe::Error& e) {  // a malformed or unreachable --address, a wrong token
      std::fprintf(stderr, "hello_actors: %s\n", e.what());
      std::exit(1);
    }
  }();
  auto c = rt.spawn<Counter>({.resources = {{"CPU", 1}}, .max_restarts = 1}, 10);
  std::printf("spawned Counter(10) as actor %llu on node %llu, worker pid %d\n", (unsigned long long)c.id(),
              (unsigned long long)c.call(&Counter::node).get(), c.call(&Counter::pid).get());

  std::vector<troupe::Future<int>> sums;
  for (int i = 1; i <= 5; ++i) sums.push_back(c.call(&Counter::add, i));  // pipelined, run in order
  for (auto& f : sums) std::printf("  add -> %d\n", f.get());

  int pid = c.call(&Counter::pid).get();
  std::printf("killing worker pid %d with SIGKILL...\n", pid);
  kill(pid, SIGKILL);
  try {
    // Races the restart: fails with ActorDied, or runs on the new worker.
    std::printf("  add(0) -> %d\n", c.call(&Counter::add, 0).get());
  } catch (const troupe::ActorDied& e) {
    std::printf("  call in flight failed: %s\n", e.what());
  }
  while (c.info().restarts < 1 || c.info().state != troupe::ActorState::kAlive) usleep(1000);
  std::printf("restarted (restart %d of %d) as pid %d; state was rebuilt by the constructor: add(1) -> %d\n",
              c.info().restarts, c.info().max_restarts, c.call(&Counter::pid).get(), c.call(&Counter::add, 1).get());
  return 0;
}
