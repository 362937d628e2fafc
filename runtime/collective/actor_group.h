// Collective groups formed by actors through the runtime. Inside an actor,
// join_group() forms a GlooGroup or NcclGroup through the head's KV store
// and ties it to the runtime so that no member ever hangs on a dead peer:
//
//  - the group watches every other member (Runtime::watch_actor) and aborts
//    itself, naming the dead rank and actor, as soon as the head reports a
//    member RESTARTING or DEAD or running a new incarnation;
//  - an AbortGroup control message (which bypasses the mailbox, so it
//    reaches an actor blocked inside a collective) aborts it too: the driver
//    sends one to every survivor with abort_group().
//
// The groups of a process are found through a table owned by its client
// core (Runtime::core()), which also owns and joins the threads that abort
// them.
//
//   // in the actor
//   auto group = troupe::collective::join_group({.name = "dp", .generation = 2, .rank = r,
//                                                .world_size = n, .members = ids});
//   group->allreduce(grad, count, DType::kFloat32)->wait();
//   // in the driver, after a trainer died
//   troupe::collective::abort_group(rt, survivor_ids, "dp", "rank 3 died");
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "troupe/runtime/collective/group.h"
#include "troupe/runtime/wire/codec.h"

namespace troupe {
class Runtime;
}

namespace troupe::collective {

enum class Backend { kGloo, kNccl };
const char* to_string(Backend backend);

// The control message that aborts the groups named `name` in a worker, of
// generation `generation` (-1 = every generation). The reply is how many
// groups were aborted.
struct AbortGroup {
  static constexpr const char* kControlTag = "collective.abort";
  using Reply = int32_t;
  std::string name;
  int64_t generation = -1;
  std::string reason;
  TROUPE_FIELDS(name, generation, reason)
};

// Which group this member joins and how. A value: every member passes the
// same spec except `rank`.
struct GroupSpec {
  std::string name;
  // Members of different generations never see each other; re-form after
  // a failure or resize with a higher generation.
  int64_t generation = 1;
  int rank = 0;
  int world_size = 1;
  // The actor id of each rank (size world_size). Every member but this one
  // is watched; empty watches nobody (then only abort_group() or the
  // transport detect a dead peer).
  std::vector<uint64_t> members;
  Backend backend = Backend::kGloo;
  // Bounds forming the group: a member that never arrives fails the
  // rendezvous with troupe::Timeout naming the missing ranks.
  std::chrono::milliseconds rendezvous_timeout{std::chrono::seconds(60)};
  // Default timeout of one operation (a hang that no death explains).
  std::chrono::milliseconds op_timeout{std::chrono::seconds(300)};
  // Gloo: the address the TCP pairs listen on ("" = TROUPE_BIND_HOST or
  // loopback).
  std::string bind_host;
  // NCCL: the CUDA device (-1 = the calling thread's current one).
  int device = -1;
  // Gloo: GlooGroupOptions::check_agreement and check_point_to_point (NCCL
  // has no such checks). Every member must set them alike.
  bool check_agreement = true;
  bool check_point_to_point = false;
};

// Inside an actor: forms the group through this_actor::runtime().kv(),
// starts watching the other members and registers the group for
// AbortGroup control messages. Blocks until every member has joined.
// Throws troupe::Timeout when a member does not arrive in time, ConfigError
// for a bad spec or a backend that is not built, Aborted when a member died
// while the group was forming.
//
// The caller's unique_ptr is the group's only owner. The runtime's abort
// paths reach it through bookkeeping of their own that never keeps it
// alive; destroying it unregisters the group (after any abort already
// running on it has returned). The transport's resources inside it are
// owned by exactly one object, the backend group.
std::unique_ptr<Group> join_group(const GroupSpec& spec);

// The same, through an explicit runtime (tests and drivers that host a
// group outside an actor; AbortGroup only reaches groups in workers).
std::unique_ptr<Group> join_group(Runtime& runtime, const GroupSpec& spec);

// Driver side: sends AbortGroup to each member (dead ones are skipped) and
// waits, at most `timeout` in all, for their answers. Returns how many
// members acknowledged (and, with `acknowledged`, which: their ids);
// members that are gone or do not answer in time are not an error (their
// group fails through its own watches or timeouts).
int abort_group(Runtime& runtime, const std::vector<uint64_t>& member_ids, const std::string& name,
                const std::string& reason, int64_t generation = -1,
                std::chrono::milliseconds timeout = std::chrono::seconds(5),
                std::vector<uint64_t>* acknowledged = nullptr);

}  // namespace troupe::collective
