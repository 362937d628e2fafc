// What this process did, for the head's /metrics: the actor calls its
// worker served and the stream bytes it received. Counted with relaxed
// atomics where the work happens; a worker publishes them to the cluster's
// KV store (kStatsKeyPrefix + actor id) at most once a second, and the head
// sums them (runtime/head/metrics.h), folding in an actor's last numbers
// when it dies.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace troupe::client {

inline constexpr const char* kStatsKeyPrefix = "troupe.stats/";

struct ProcessStats {
  std::atomic<uint64_t> calls{0};
  std::atomic<uint64_t> stream_bytes{0};
};

// This process's counters.
ProcessStats& process_stats();

// "calls stream_bytes": the KV value a worker publishes.
std::string format_stats(uint64_t calls, uint64_t stream_bytes);
// Parses format_stats' text; false for anything else.
bool parse_stats(const std::string& text, uint64_t* calls, uint64_t* stream_bytes);

}  // namespace troupe::client
