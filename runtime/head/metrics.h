// The head's Prometheus metrics: the text exposition format (version 0.0.4)
// rendered from a status snapshot (HeadState::status plus the jobs and the
// head's own counters, as the HTTP endpoint builds it). A pure function of
// the snapshot, so it is tested without a head.
//
// What the head can count is what passes through it: nodes, resources,
// actors and their restarts, placement groups, the KV store, the messages
// it handles, the TrainJobs that publish their progress to the KV store
// (troupe.jobs/<name>), and the calls and stream bytes the workers report
// (client/process_stats.h: they go straight between processes, so each
// worker counts its own and publishes them once a second).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace troupe::head {

// The KV prefix under which a TrainJob publishes its progress document.
inline constexpr const char* kJobKeyPrefix = "troupe.jobs/";

std::string prometheus_text(const nlohmann::json& snapshot);

}  // namespace troupe::head
