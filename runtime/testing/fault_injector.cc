#include "troupe/runtime/testing/fault_injector.h"

#include <signal.h>

#include <algorithm>

#include <nlohmann/json.hpp>

#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/testing/local_cluster.h"
#include "troupe/runtime/worker/worker.h"

namespace troupe::testing {

FaultInjector::~FaultInjector() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : timers_) t.join();
  for (pid_t pid : stalled_) ::kill(pid, SIGCONT);  // their timers stopped early
}

std::vector<FaultInjector::LiveActor> FaultInjector::live_actors(const std::string& class_name, uint64_t after) {
  std::vector<LiveActor> out;
  const auto status = nlohmann::json::parse(rt_.status_json());
  for (const auto& a : status.at("actors")) {
    const auto id = a.at("id").get<uint64_t>();
    if (id > after && a.at("class") == class_name && a.at("state") == "ALIVE")
      out.push_back({id, a.at("node").get<uint64_t>(), static_cast<pid_t>(a.at("pid").get<int64_t>())});
  }
  std::sort(out.begin(), out.end(), [](const LiveActor& x, const LiveActor& y) { return x.id < y.id; });
  return out;
}

uint64_t FaultInjector::last_actor_id() {
  uint64_t last = 0;
  const auto status = nlohmann::json::parse(rt_.status_json());
  for (const auto& a : status.at("actors")) last = std::max(last, a.at("id").get<uint64_t>());
  return last;
}

pid_t FaultInjector::pid_of(uint64_t actor_id) {
  auto info = rt_.actor_info(actor_id);
  if (info.state != ActorState::kAlive || info.pid <= 0)
    throw Error("FaultInjector: actor " + std::to_string(actor_id) + " (" + info.class_name + ") is " +
                to_string(info.state) + ", no process to act on");
  return info.pid;
}

void FaultInjector::record(std::string what) {
  TROUPE_LOG_WARN("fault injected: {}", what);
  std::lock_guard lock(mu_);
  faults_.push_back({std::move(what), Clock::now()});
}

pid_t FaultInjector::kill_actor(uint64_t actor_id) {
  pid_t pid = pid_of(actor_id);
  if (::kill(pid, SIGKILL) != 0) throw Error("FaultInjector: kill(" + std::to_string(pid) + ") failed");
  record("SIGKILL actor " + std::to_string(actor_id) + " pid " + std::to_string(pid));
  return pid;
}

void FaultInjector::kill_node(LocalCluster& cluster, size_t index) {
  pid_t pid = cluster.node_pid(index);
  if (pid <= 0)
    throw Error("FaultInjector: node agent " + std::to_string(index) + " (node " +
                std::to_string(cluster.node_id(index)) + ") is not running: it was killed before");
  record("SIGKILL node agent " + std::to_string(cluster.node_id(index)) + " pid " + std::to_string(pid));
  cluster.kill_node(index, SIGKILL);
}

void FaultInjector::drop_connections(uint64_t actor_id) {
  pid_t pid = pid_of(actor_id);
  auto reply = rt_.core()->actor(rt_.actor_info(actor_id))->control(worker::DropConnections{});
  reply.get(std::chrono::seconds(5));
  record("dropped the connections of actor " + std::to_string(actor_id) + " pid " + std::to_string(pid));
}

void FaultInjector::stall_actor(uint64_t actor_id, std::chrono::milliseconds duration) {
  pid_t pid = pid_of(actor_id);
  {
    std::lock_guard lock(mu_);
    stalled_.push_back(pid);
  }
  ::kill(pid, SIGSTOP);
  record("SIGSTOP actor " + std::to_string(actor_id) + " pid " + std::to_string(pid) + " for " +
         std::to_string(duration.count()) + " ms");
  after(duration, [this, pid] {
    std::lock_guard lock(mu_);
    ::kill(pid, SIGCONT);
    if (auto it = std::find(stalled_.begin(), stalled_.end(), pid); it != stalled_.end()) stalled_.erase(it);
  });
}

void FaultInjector::after(std::chrono::milliseconds delay, std::function<void()> action) {
  std::lock_guard lock(mu_);
  timers_.emplace_back([this, delay, action = std::move(action)] {
    std::unique_lock lock(mu_);
    // Waiting on the injector's own condition: stops early when destroyed.
    if (cv_.wait_for(lock, delay, [&] { return stopping_; })) return;
    lock.unlock();
    try {
      action();
    } catch (const std::exception& e) {
      TROUPE_LOG_WARN("FaultInjector action failed: {}", e.what());
    }
  });
}

void FaultInjector::at_step(int64_t step, std::function<void()> action) {
  std::lock_guard lock(mu_);
  step_actions_.emplace_back(step, std::move(action));
}

void FaultInjector::on_step(int64_t step) {
  std::vector<std::function<void()>> due;
  {
    std::lock_guard lock(mu_);
    for (auto it = step_actions_.begin(); it != step_actions_.end();) {
      if (it->first <= step) {
        due.push_back(std::move(it->second));
        it = step_actions_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& a : due) a();
}

std::vector<FaultInjector::Fault> FaultInjector::faults() const {
  std::lock_guard lock(mu_);
  return faults_;
}

}  // namespace troupe::testing
