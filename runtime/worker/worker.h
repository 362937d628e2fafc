// The worker: a process that hosts exactly one actor. It reads its actor's
// spec from the head, runs the constructor, listens for callers, runs calls
// from a mailbox on the actor thread (one at a time unless max_concurrency
// says more), and answers control messages on its I/O thread.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "troupe/runtime/core/worker_env.h"
#include "troupe/runtime/wire/codec.h"

namespace troupe::worker {

// Control message every worker serves: close all its callers' connections
// (a network fault, for fault injection); the process lives on.
struct DropConnections {
  static constexpr const char* kControlTag = "troupe.drop_connections";
  using Reply = void;
  TROUPE_FIELDS()
};

// Serves the actor named by env (actor id, incarnation, head, token, bind
// and advertise hosts, GPUs); never returns. A pooled worker passes its
// agent's socket as `serving_fd`: one byte goes there, and it is closed,
// once the actor serves (the agent refills its pool then).
[[noreturn]] void run_worker(const core::WorkerEnv& env, int serving_fd = -1);

// A pooled worker (env.pool_fd set): waits for its node agent's assignment on
// that descriptor, takes on the actor's environment (GPUs, extra env) and
// runs as run_worker; exits quietly when the agent closes the descriptor
// first. Never returns.
[[noreturn]] void run_pooled_worker(core::WorkerEnv env);

}  // namespace troupe::worker
