// How often node agents heartbeat to the head, and for how many intervals a
// node may stay silent before the head declares it dead: the defaults every
// options struct (head, runtime, local cluster, role environment) starts
// from, so that they cannot drift apart, and the bounds every one of them
// is checked against. 100 ms × 5 finds a hung or cut-off node in half a
// second; a killed one is found sooner, by its connection closing.
// `troupe start --head --heartbeat-ms/--heartbeat-misses` widens it for
// machines where an agent may be starved for longer.
#pragma once

#include <cstdint>
#include <string>

#include "troupe/runtime/core/errors.h"

namespace troupe::core {

inline constexpr uint32_t kHeartbeatMs = 100;
inline constexpr uint32_t kHeartbeatMisses = 5;
// A cluster whose nodes all run on the driver's machine (an embedded
// cluster, in the driver's own process; a testing::LocalCluster, in child
// processes) has no network to cut a node off: the only silence is
// starvation (a burst of workers starting, a loaded test machine) or a stop
// the program made itself. 100 ms × 30: 3 s before a node is fenced, not
// 0.5 s. A test of fencing sets heartbeat_misses itself.
inline constexpr uint32_t kOneMachineHeartbeatMisses = 30;
// A head started with `troupe start --head --host H` for a non-loopback H
// (agents reach it over a network) when --heartbeat-misses is not given:
// 100 ms × 20, 2 s. TCP resends a lost segment after 200 ms, then 400 ms
// more: a network outage of a quarter second silences a node for over
// half of one, which 5 misses took for a dead node.
inline constexpr uint32_t kNetworkHeartbeatMisses = 20;

// The bounds of both settings (`troupe start --head` checks the same).
inline constexpr uint32_t kMinHeartbeatMs = 10;
inline constexpr uint32_t kMaxHeartbeatMs = 60000;
inline constexpr uint32_t kMinHeartbeatMisses = 1;
inline constexpr uint32_t kMaxHeartbeatMisses = 100000;
// And of their product, the time before a silent node is fenced: a day.
// (Both at their bounds, 6e9 ms, would wrap the 32-bit fence time agents
// and workers are told, so that theirs and the head's would differ.)
inline constexpr uint64_t kMaxFenceMs = 24ull * 3600 * 1000;

// ConfigError naming `what` and the value out of bounds: a 0 ms heartbeat
// would spin the head's check, and 0 misses fence every node at once.
inline void validate_heartbeat(uint32_t ms, uint32_t misses, const std::string& what) {
  if (ms < kMinHeartbeatMs || ms > kMaxHeartbeatMs)
    throw ConfigError(what + ": heartbeat_ms " + std::to_string(ms) + " is not in [" + std::to_string(kMinHeartbeatMs) +
                      ", " + std::to_string(kMaxHeartbeatMs) + "]");
  if (misses < kMinHeartbeatMisses || misses > kMaxHeartbeatMisses)
    throw ConfigError(what + ": heartbeat_misses " + std::to_string(misses) + " is not in [" +
                      std::to_string(kMinHeartbeatMisses) + ", " + std::to_string(kMaxHeartbeatMisses) + "]");
  if (uint64_t(ms) * misses > kMaxFenceMs)
    throw ConfigError(what + ": heartbeat_ms " + std::to_string(ms) + " × heartbeat_misses " + std::to_string(misses) +
                      " = " + std::to_string(uint64_t(ms) * misses) + " ms before a silent node is fenced, over " +
                      std::to_string(kMaxFenceMs) + " (a day)");
}

}  // namespace troupe::core
