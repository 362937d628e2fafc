// WorkerAssignment: what a node agent tells a pooled worker when it hands
// it an actor. A pooled worker was started ahead of time (exec, dynamic
// loading, static initialisation all done) and waits on a socket for this
// one message; the agent sends it length-prefixed and Codec-encoded, the
// worker applies the environment (before anything touches CUDA) and goes on
// as a worker started for that actor would.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "troupe/runtime/wire/codec.h"

namespace troupe::node {

struct WorkerAssignment {
  uint64_t actor_id = 0;
  uint32_t incarnation = 0;
  uint64_t node_id = 0;
  std::vector<int32_t> gpu_ids;
  // KEY=VALUE set in the worker before it runs: CUDA_VISIBLE_DEVICES and the
  // actor's extra environment.
  std::vector<std::string> env;
  std::string class_name;  // for logs
  TROUPE_FIELDS(actor_id, incarnation, node_id, gpu_ids, env, class_name)
};

// The largest assignment either side accepts (the environment is small).
inline constexpr uint32_t kMaxAssignmentBytes = 1 << 20;

// What always fits in a pool socket's buffer at once; a larger assignment
// (an environment of hundreds of KiB) needs the worker reading it.
inline constexpr size_t kSmallAssignmentBytes = 64 << 10;
bool large_assignment(const WorkerAssignment& a);

// Writes `a` to `fd` (blocking). Throws troupe::Error when the worker's end is
// gone.
void send_assignment(int fd, const WorkerAssignment& a);

// Blocks until an assignment arrives on `fd`; nullopt when the agent closed
// its end first (the pooled worker is not needed any more). Throws
// DecodeError for a malformed or oversized message.
std::optional<WorkerAssignment> receive_assignment(int fd);

// The first variable of `env` (KEY=VALUE) that must be in the environment
// when the process is exec'd, so that a pooled worker, already running,
// cannot take it: read by the dynamic loader or libc at start (LD_*,
// GLIBC_TUNABLES, MALLOC_*), by OpenMP/MKL runtimes when they are loaded
// (OMP_*, KMP_*, MKL_*), by the Python interpreter as it starts (PYTHON*),
// or troupe's own (TROUPE_*). "" when there is none.
std::string exec_time_variable(const std::vector<std::string>& env);

}  // namespace troupe::node
