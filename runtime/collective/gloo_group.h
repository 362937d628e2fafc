// GlooGroup: the host-memory collective backend, on libgloo's TCP
// transport. A member rendezvouses through a troupe::KvStore (the head's KV
// in a cluster) under "<name>/gen<generation>/", so groups re-form after a
// failure with a fresh generation and no stale peers.
//
// Threads: operations are queued to one operation thread per group, which
// runs them in issue order inside gloo; point-to-point operations are posted
// by that thread and completed by two more (one waits on sends, one on
// receives), so a rank may send and receive without deadlocking on its own
// queue. abort() fails every Work at
// once (they complete independently of the threads) and hard-closes the TCP
// pairs, which makes peers blocked on this member fail too. A failed
// operation leaves the group broken (gloo's pairs are closed); every later
// operation fails with the first error, and the group must be re-formed
// (except for a disagreement the agreement check caught: see
// GlooGroupOptions::check_agreement and check_point_to_point).
// gloo's own event-loop thread runs under SCHED_BATCH (see
// create_tcp_device in gloo_group.cc): it would otherwise preempt the
// operation thread while that holds a pair's lock and spin for a time slice.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "troupe/runtime/collective/group.h"
#include "troupe/runtime/core/kv_store.h"
#include "troupe/runtime/core/thread_set.h"

namespace troupe::collective {

struct GlooGroupOptions {
  // Address the TCP pairs listen on; loopback unless the cluster spans hosts.
  std::string bind_host = "127.0.0.1";
  // Bounds the whole rendezvous: waiting for every rank's key and
  // connecting the full mesh.
  std::chrono::milliseconds rendezvous_timeout{std::chrono::seconds(60)};
  // Default end-to-end timeout of one operation (options may override).
  std::chrono::milliseconds op_timeout{std::chrono::seconds(300)};
  // abort() fails the running operation once its thread has left gloo, or
  // after this long at the latest. By then the pairs are closed, so gloo no
  // longer moves bytes into or out of the caller's memory; a thread still
  // inside gloo is parked in a wait that gloo cannot interrupt (a receive
  // whose bytes were in flight when the peer died) and leaves at the
  // operation's timeout without touching the caller's memory.
  std::chrono::milliseconds abort_settle{std::chrono::milliseconds(200)};
  // How long the destructor of an aborted group waits for its operation
  // thread to leave gloo before leaving it behind (holding what it uses);
  // a healthy group's destructor always joins.
  std::chrono::milliseconds abort_join_grace{std::chrono::seconds(1)};
  // Who joins a thread left behind: groups formed through the runtime
  // (join_group) give the process's group table, which joins it when the
  // client core shuts down. Without one (a group made directly, outside
  // any runtime) the destructor waits for the thread itself, which leaves
  // gloo at the operation timeout at the latest; no thread is detached.
  std::weak_ptr<core::ThreadSet> stragglers;
  // When a peer's connection breaks, the runtime usually calls abort() with
  // the reason (which member died) moments later. A failed operation waits
  // this long for that abort so its error names the dead member; without
  // one it fails with the transport error.
  std::chrono::milliseconds error_grace{std::chrono::milliseconds(500)};
  // The agreement check. Before each collective the members exchange what
  // each was asked to do (operation, element count, dtype, root or
  // reduction: 24 bytes); when the calls differ every member fails the
  // operation with ConfigError naming each rank's call, and the group stays
  // usable. Without it gloo's transport thread aborts the process that
  // receives a message longer than it posted, and a shorter one leaves
  // data unchanged or a member waiting. It costs a small exchange per
  // collective: turn it off only where the calls agree by construction
  // (the trainer's gradient buckets). Every member must set it alike.
  bool check_agreement = true;
  // The same for send/recv (off by default): a send puts a header (count,
  // dtype) ahead of its data; a receive posts its data's receive only once
  // the header has come and agrees, else drops the bytes and fails with
  // ConfigError (the send completes). The price besides a round trip:
  // checked receives complete in the order they were posted, so a receive
  // whose sender waits for something a later receive must get first never
  // completes (it waits out the timeout). Every member must set it alike.
  bool check_point_to_point = false;
  // Asked every 100 ms while the mesh connects: why forming should stop
  // (a member died after publishing its addresses, so the pair waiting
  // for it never completes), or "" to go on. create() then fails with
  // troupe::Aborted and that reason at once instead of at
  // rendezvous_timeout. join_group asks its member watch. Called on a
  // thread of the group's own, so it must be thread-safe.
  std::function<std::string()> abandoned;
};

class GlooGroup final : public Group {
 public:
  // Forms the group: publishes this member, waits for all world_size
  // members of (name, generation), connects the full mesh. Throws
  // troupe::Timeout naming the group, generation and the missing ranks when
  // a member does not arrive within rendezvous_timeout; troupe::Error when
  // connecting fails.
  static std::unique_ptr<GlooGroup> create(KvStore& kv, const std::string& name, int64_t generation, int rank,
                                           int world_size, const GlooGroupOptions& options = {});
  ~GlooGroup() override;

  int rank() const override;
  int world_size() const override;
  const std::string& name() const override;
  int64_t generation() const override;

  WorkPtr allreduce(void* data, size_t count, DType dtype, const AllreduceOptions& opts = {}) override;
  WorkPtr broadcast(void* data, size_t count, DType dtype, int root, const BroadcastOptions& opts = {}) override;
  WorkPtr allgather(const void* in, void* out, size_t count, DType dtype, const AllgatherOptions& opts = {}) override;
  WorkPtr reduce_scatter(const void* in, void* out, size_t count_per_rank, DType dtype,
                         const ReduceScatterOptions& opts = {}) override;
  WorkPtr barrier(const BarrierOptions& opts = {}) override;
  WorkPtr send(const void* data, size_t count, DType dtype, int dst, const SendOptions& opts = {}) override;
  WorkPtr recv(void* data, size_t count, DType dtype, int src, const RecvOptions& opts = {}) override;

  void abort(const std::string& reason) override;
  bool is_aborted() const override;

  // State shared with the operation threads; defined in gloo_group.cc.
  struct Shared;

 private:
  explicit GlooGroup(std::shared_ptr<Shared> shared);

  std::shared_ptr<Shared> shared_;
};

}  // namespace troupe::collective
