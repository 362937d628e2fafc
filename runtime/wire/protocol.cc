#include "troupe/runtime/wire/protocol.h"

namespace troupe::wire {

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
