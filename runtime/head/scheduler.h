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

// The death cause of an actor placed in a placement group that was removed
// (or never was): a task submitter tells it apart from an executor that
// died, since no retry can start one.
inline std::string placement_group_removed_cause(uint64_t group) {
  return "placement group " + std::to_string(group) + " was removed";
}

struct NodeView {
  uint64_t id = 0;
  Resources total;
  Resources available;
  // The free part of each of the node's GPUs (1 = all of it), in GPU id
  // order. Empty: GPUs are counted as an amount only.
  std::vector<double> gpu_free;
  // Actors placed there: between nodes equally loaded after a request (an
  // actor that asks for nothing loads none), the one with fewer wins.
  size_t actors = 0;
};

// GPUs as devices, not only an amount. A request for a whole number of GPUs
// takes that many GPUs that are wholly free; a request for a fraction (0 <
// GPU < 1, as Ray allows) takes that share of one GPU that still has it,
// the fullest such GPU, so that fractions pack onto as few GPUs as they
// can. Returns the indices into `free` the request takes, or nullopt when
// they are not there. A request without GPUs takes none.
std::optional<std::vector<size_t>> pick_gpus(const std::vector<double>& free, double amount);
// Takes `amount` (as pick_gpus chose `picked`) out of `free`.
void take_gpus(std::vector<double>& free, const std::vector<size_t>& picked, double amount);
// The "GPU" amount of `r` (0 without one).
double gpu_amount(const Resources& r);
// What a request of `amount` GPUs takes of each GPU it is given: the
// amount itself for a part of one GPU, else all of each.
double gpu_share(double amount);
// True when node `n` can hold `req`: its amounts and, where it tracks them,
// its GPUs.
bool fits(const NodeView& n, const Resources& req);

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

// The nodes of `views` that `spec` may run on when its node affinity is
// kept: all of them without one, else its node alone (none if that is not
// among them).
std::vector<NodeView> affine_views(const wire::ActorSpec& spec, const std::vector<NodeView>& views);

// The order in which a group's bundles are placed and taken: the largest
// first (GPUs, then CPUs, memory, the other resources; stable otherwise),
// as Ray's, so that a big bundle is not left without a node the small ones
// took, and parts of GPUs pack as well as they can (0.6 before 0.4).
// place_bundles plans in this order, and the head takes the bundles'
// resources in it too, so plan and take agree.
std::vector<size_t> placement_order(const std::vector<Resources>& bundles);

// Places every bundle (all or nothing) under `strategy`; returns the node of
// each bundle, or nullopt with `reason`. With `kept` (a node id or 0 per
// bundle: a group that lost some of its bundles with a node), the bundles
// with a node stay on it (`nodes` count what they hold as taken) and only
// the others are placed, around them: STRICT_PACK on their node, PACK there
// first, SPREAD and STRICT_SPREAD away from them.
std::optional<std::vector<uint64_t>> place_bundles(std::vector<NodeView> nodes, const std::vector<Resources>& bundles,
                                                   wire::PlacementStrategy strategy, std::string* reason,
                                                   const std::vector<uint64_t>& kept = {});

}  // namespace troupe::head
