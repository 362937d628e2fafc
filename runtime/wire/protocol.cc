#include "troupe/runtime/wire/protocol.h"

#include <iterator>

namespace troupe::wire {

std::string op_name(uint32_t op) {
  static const char* kNames[] = {"other",
                                 "hello",
                                 "heartbeat",
                                 "create_actor",
                                 "actor_ready",
                                 "actor_init_failed",
                                 "worker_exited",
                                 "spawn_worker",
                                 "kill_worker",
                                 "subscribe_actor",
                                 "actor_update",
                                 "get_actor",
                                 "kill_actor",
                                 "create_placement_group",
                                 "get_placement_group",
                                 "remove_placement_group",
                                 "kv_put",
                                 "kv_get",
                                 "kv_wait",
                                 "kv_erase",
                                 "kv_add",
                                 "status",
                                 "shutdown",
                                 "control",
                                 "wait_placement_group",
                                 "nodes",
                                 "node_fenced",
                                 "read_log",
                                 "lend_resources",
                                 "resources_wanted",
                                 "goodbye",
                                 "ping"};
  static_assert(std::size(kNames) == static_cast<size_t>(Op::kLastOp) + 1, "a name for every op");
  return op < std::size(kNames) ? kNames[op] : "op_" + std::to_string(op);
}

const char* to_string(ActorState s) {
  switch (s) {
    case ActorState::kPending:
      return "PENDING";
    case ActorState::kAlive:
      return "ALIVE";
    case ActorState::kRestarting:
      return "RESTARTING";
    case ActorState::kDead:
      return "DEAD";
  }
  return "?";
}

const char* to_string(PlacementStrategy s) {
  switch (s) {
    case PlacementStrategy::kPack:
      return "PACK";
    case PlacementStrategy::kSpread:
      return "SPREAD";
    case PlacementStrategy::kStrictPack:
      return "STRICT_PACK";
    case PlacementStrategy::kStrictSpread:
      return "STRICT_SPREAD";
  }
  return "?";
}

}  // namespace troupe::wire
