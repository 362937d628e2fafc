// StatsPages: where a node agent's workers keep their call and stream-byte
// counters (client::ProcessStats), so that the agent can read a worker's
// last numbers after it was reaped. A worker publishes its counters to the
// KV store once a second; one SIGKILLed between two publications lost the
// calls it served since the last (what /metrics' troupe_actor_calls_total
// showed). Each spawn gets a page of shared memory (a memfd) that the
// worker maps as its ProcessStats (core::kEnvStatsFd names the
// descriptor); the agent keeps its own mapping, reads the final counts when
// it reports the exit (WorkerExited's calls and stream_bytes) and unmaps
// the page when the worker is reaped. One registry per process, keyed by
// pid: the pool and the agent both spawn workers, and either may reap one.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>

#include "troupe/runtime/core/process.h"

namespace troupe::node {

class StatsPages {
 public:
  // A page made for a spawn that has not happened yet.
  struct Page {
    int fd = -1;
    void* map = nullptr;
  };
  struct Counts {
    uint64_t calls = 0;
    uint64_t stream_bytes = 0;
  };

  static StatsPages& instance();

  // Makes a page and adds it to `o` (kept under its own number, named in
  // the child's environment). A page that cannot be made (no memfd) is an
  // empty Page: the worker then counts in its own memory, as before.
  Page prepare(core::SpawnOptions& o);
  // After the spawn: the page is worker `pid`'s (the descriptor is closed
  // here, the mapping kept). An empty page is ignored.
  void adopt(pid_t pid, Page page);
  // The spawn failed: the page goes.
  static void discard(Page page);
  // Worker `pid`'s counters now (after its exit: its last), or nullopt when
  // it has no page.
  std::optional<Counts> read(pid_t pid) const;
  // Worker `pid` was reaped: its page goes.
  void release(pid_t pid);

 private:
  mutable std::mutex mu_;
  std::map<pid_t, void*> pages_;
};

}  // namespace troupe::node
