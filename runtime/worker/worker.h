// The worker: a process that hosts exactly one actor. It reads its actor's
// spec from the head, runs the constructor, listens for callers, runs calls
// from a mailbox on the actor thread (one at a time unless max_concurrency
// says more), and answers control messages on its I/O thread.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "troupe/runtime/wire/codec.h"

namespace troupe::worker {

// Control message every worker serves: close all its callers' connections
// (a network fault, for fault injection); the process lives on.
struct DropConnections {
  static constexpr const char* kControlTag = "troupe.drop_connections";
  using Reply = void;
  TROUPE_FIELDS()
};

// Serves the actor named by TROUPE_ACTOR_ID etc.; never returns.
[[noreturn]] void run_worker();

}  // namespace troupe::worker
