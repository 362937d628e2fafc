// A head that comes back by itself. `troupe start --head --supervise` runs
// the head under a small supervisor process (the one the session's head.pid
// names). When the head dies other than by a stop (a signal, a crash, a
// non-zero exit once it was serving), the supervisor starts it again at once
// on the address it had; the head being durable (its tables in SQLite), the
// new one reloads them and node agents, workers and drivers reconnect.
// A head that is alive but hung (its event loop has not written to the
// supervisor's liveness pipe for env.head_hang_timeout_ms, 30 s by default:
// a deadlock, a disk that does not answer) is SIGKILLed and started again
// the same way. SIGTERM or SIGINT to the supervisor stop the head, then the
// supervisor; a head that keeps dying (restarted 5 times within 10 s, its
// 6th death there) ends the supervision.
#pragma once

#include "troupe/runtime/core/worker_env.h"

namespace troupe::client {

// Called by the head role before it starts any thread. Returns, in a fresh
// head process, the environment to run that head with (its ready line goes
// to the supervisor, which passes the first one on to env.ready_fd); the
// supervisor itself never returns.
core::WorkerEnv supervise_head(core::WorkerEnv env);

}  // namespace troupe::client
