// What troupe::this_actor answers inside a worker: the actor's id, its GPUs
// and a Runtime on the worker's client core. The worker's ActorHost owns the
// one WorkerContext of the process; it is built before the actor is
// constructed and never changes afterwards. this_actor finds it through
// current(), a pointer installed once at worker start (null in a driver).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace troupe {
class Runtime;
}

namespace troupe::worker {

class WorkerContext {
 public:
  WorkerContext(uint64_t actor_id, std::vector<int> gpu_ids, std::unique_ptr<Runtime> runtime);
  ~WorkerContext();
  WorkerContext(const WorkerContext&) = delete;
  WorkerContext& operator=(const WorkerContext&) = delete;

  uint64_t actor_id() const { return actor_id_; }
  const std::vector<int>& gpu_ids() const { return gpu_ids_; }
  // The Runtime handle itself is shared by the actor's threads; what it
  // calls is thread-safe (the client core's locking).
  Runtime& runtime() const { return *runtime_; }

  // Makes `context` what this_actor answers from. Called once, by the
  // worker, before any actor code runs; `context` must outlive every call
  // of current() (the ActorHost owns it, and the worker process exits from
  // ActorHost::serve without destroying it).
  static void install(const WorkerContext* context);
  // The installed context; nullptr outside a worker.
  static const WorkerContext* current();

 private:
  const uint64_t actor_id_;
  const std::vector<int> gpu_ids_;
  const std::unique_ptr<Runtime> runtime_;
};

}  // namespace troupe::worker
