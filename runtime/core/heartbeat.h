// How often node agents heartbeat to the head, and for how many intervals a
// node may stay silent before the head declares it dead: the defaults every
// options struct (head, runtime, local cluster, role environment) starts
// from, so that they cannot drift apart. 100 ms × 5 finds a hung or cut-off
// node in half a second; a killed one is found sooner, by its connection
// closing. `troupe start --head --heartbeat-ms/--heartbeat-misses` widens it
// for machines where an agent may be starved for longer.
#pragma once

#include <cstdint>

namespace troupe::core {

inline constexpr uint32_t kHeartbeatMs = 100;
inline constexpr uint32_t kHeartbeatMisses = 5;
// An embedded cluster (Runtime::connect with no address) has its head and
// node agent in the driver's own process: that node cannot be cut off or die
// alone, so the only silence is starvation (a burst of workers starting on a
// small, loaded machine). 100 ms x 30: 3 s before it is fenced, not 0.5 s.
inline constexpr uint32_t kEmbeddedHeartbeatMisses = 30;

}  // namespace troupe::core
