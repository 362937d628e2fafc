// Process-wide facts of a worker (its actor id, GPUs, and the runtime whose
// client core owns the process's state), set once at start and read by
// troupe::this_actor. Empty in a driver.
#pragma once

#include <memory>
#include <vector>

namespace troupe {
class Runtime;
}

namespace troupe::worker {

struct WorkerContext {
  uint64_t actor_id = 0;
  std::vector<int> gpu_ids;
  std::unique_ptr<Runtime> runtime;

  static WorkerContext& get();
};

}  // namespace troupe::worker
