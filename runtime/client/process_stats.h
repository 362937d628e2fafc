// What this process did, for the head's /metrics: the actor calls its
// worker served and the stream bytes it received. Counted with relaxed
// atomics where the work happens; a worker publishes them to the cluster's
// KV store (kStatsKeyPrefix + actor id) at most once a second, and the head
// sums them (runtime/head/metrics.h), folding in an actor's last numbers
// when it dies. A worker its node agent started keeps them in a page of
// shared memory the agent made (core::kEnvStatsFd; node/stats_pages.h), so the
// agent reads its last numbers after it was killed.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace troupe::client {

inline constexpr const char* kStatsKeyPrefix = "troupe.stats/";
// The memfd's name: a descriptor named anything else is not mapped.
inline constexpr const char* kStatsPageName = "troupe-stats";
inline constexpr size_t kStatsPageBytes = 4096;

struct ProcessStats {
  std::atomic<uint64_t> calls{0};
  std::atomic<uint64_t> stream_bytes{0};
};
// The agent reads a worker's page as two uint64_t.
static_assert(std::is_standard_layout_v<ProcessStats> && sizeof(ProcessStats) == 2 * sizeof(uint64_t) &&
              std::atomic<uint64_t>::is_always_lock_free);

// This process's counters: in the agent's page when there is one
// (core::kEnvStatsFd, read and unset on first use, so that no child of the
// worker sees it), else in this process's memory.
ProcessStats& process_stats();

// "calls stream_bytes": the KV value a worker publishes.
std::string format_stats(uint64_t calls, uint64_t stream_bytes);
// Parses format_stats' text; false for anything else.
bool parse_stats(const std::string& text, uint64_t* calls, uint64_t* stream_bytes);

}  // namespace troupe::client
