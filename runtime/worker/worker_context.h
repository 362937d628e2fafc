// Process-wide facts of a worker (its actor id, GPUs, runtime, control
// handlers), read by troupe::this_actor. Empty in a driver.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace troupe {
class Runtime;
}

namespace troupe::worker {

struct WorkerContext {
  using ControlHandler = std::function<std::string(const std::string&)>;

  uint64_t actor_id = 0;
  std::vector<int> gpu_ids;
  std::unique_ptr<Runtime> runtime;

  void set_control_handler(const std::string& topic, ControlHandler h) {
    std::lock_guard lock(mu);
    handlers[topic] = std::move(h);
  }
  ControlHandler control_handler(const std::string& topic) {
    std::lock_guard lock(mu);
    auto it = handlers.find(topic);
    return it == handlers.end() ? nullptr : it->second;
  }

  static WorkerContext& get();

 private:
  std::mutex mu;
  std::map<std::string, ControlHandler> handlers;
};

}  // namespace troupe::worker
