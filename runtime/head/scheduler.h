// Resource arithmetic and placement decisions of the head, as pure
// functions over a snapshot of the nodes, so they can be unit-tested.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "troupe/runtime/wire/protocol.h"

namespace troupe::head {

using wire::Resources;

struct NodeView {
  uint64_t id = 0;
  Resources total;
  Resources available;
};

// True when `avail` holds every amount in `req`.
bool fits(const Resources& avail, const Resources& req);
void subtract(Resources& avail, const Resources& req);
void add(Resources& avail, const Resources& req);
// "CPU=2, GPU=1"
std::string format_resources(const Resources& r);
// Parses "CPU=2,GPU=0,custom=1"; throws ConfigError naming the bad part.
Resources parse_resources(const std::string& text);

// The node that should host a request of `req`: the least loaded node that
// fits it, or nullopt with `reason` saying why none does.
std::optional<uint64_t> pick_node(const std::vector<NodeView>& nodes, const Resources& req, std::string* reason);

// Places every bundle (all or nothing) under `strategy`; returns the node of
// each bundle, or nullopt with `reason`.
std::optional<std::vector<uint64_t>> place_bundles(std::vector<NodeView> nodes, const std::vector<Resources>& bundles,
                                                   wire::PlacementStrategy strategy, std::string* reason);

}  // namespace troupe::head
