#include "troupe/runtime/collective/actor_group.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>

#include "troupe/config.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/collective/gloo_group.h"
#include "troupe/runtime/collective/nccl_group.h"
#include "troupe/runtime/core/check.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/core/thread_set.h"
#include "troupe/runtime/core/worker_env.h"

namespace troupe::collective {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// How often a rendezvous blocked on the KV re-checks whether a member died,
// so that forming a group fails soon after a death rather than at its
// timeout.
constexpr milliseconds kRendezvousPoll{200};

// With the runtime watching every member, a transport error is almost
// always a member's death that the head is about to report; the group waits
// this long for that report so that the error names the dead rank (see
// GlooGroupOptions::error_grace). Well inside the 2 s a survivor may take.
constexpr milliseconds kWatchedErrorGrace{1200};

class GroupTable;

// How the runtime's abort paths reach a joined group that its caller owns
// alone: a pointer to the backend group that is valid while the caller's
// JoinedGroup lives. An abort pins it for the duration of the call; the
// JoinedGroup's destructor clears it and waits for running aborts, so no
// abort ever touches a destroyed group. Shared between the JoinedGroup, the
// group table and the member watch (bookkeeping only: none of them owns
// the group).
class Membership {
 public:
  explicit Membership(Group* group) : group_(group) {}

  // Runs group->abort(reason) unless the group is gone; true when it ran.
  bool abort(const std::string& reason) {
    Group* group = pin();
    if (!group) return false;
    try {
      group->abort(reason);
    } catch (const std::exception& e) {
      TROUPE_LOG_WARN("aborting collective group '{}' failed: {}", group->name(), e.what());
    } catch (...) {
      TROUPE_LOG_WARN("aborting collective group '{}' failed", group->name());
    }
    unpin();
    return true;
  }
  // True when the group is alive and called `name`, of `generation` (or of
  // any generation when it is negative).
  bool matches(const std::string& name, int64_t generation) {
    std::lock_guard lock(mu_);
    return group_ && group_->name() == name && (generation < 0 || group_->generation() == generation);
  }
  bool retired() {
    std::lock_guard lock(mu_);
    return group_ == nullptr;
  }
  // The owner is about to destroy the group: no new aborts, and the running
  // ones finish first.
  void retire() {
    std::unique_lock lock(mu_);
    group_ = nullptr;
    idle_.wait(lock, [&] { return pins_ == 0; });
  }

 private:
  Group* pin() {
    std::lock_guard lock(mu_);
    if (group_) ++pins_;
    return group_;
  }
  void unpin() {
    std::lock_guard lock(mu_);
    if (--pins_ == 0) idle_.notify_all();
  }

  std::mutex mu_;
  std::condition_variable idle_;
  Group* group_;
  int pins_ = 0;
};

// What one join knows about its members' fate. Shared by the watch
// callbacks (I/O thread), the rendezvous (actor thread) and the joined
// group.
struct MemberWatch {
  std::mutex mu;
  std::shared_ptr<Membership> membership;  // set once the group is formed
  std::string death;                       // the first member death reported, "" = none
  std::weak_ptr<GroupTable> table;
  // The listeners on the other members: removed when the group goes.
  std::vector<ActorWatch> watches;
};

// The groups joined in this process, through their Membership: a service
// of the process's client core (Core::service), which owns it until
// shutdown. It serves the AbortGroup control message for every group of the
// process and owns the threads that abort them.
class GroupTable {
 public:
  explicit GroupTable(client::Core& core) {
    // The handler runs on the core's I/O thread, which the core joins
    // before it destroys this table.
    core.controls().set(AbortGroup::kControlTag,
                        client::typed_control_handler<AbortGroup>([this](const AbortGroup& m) { return abort(m); }));
  }

  std::weak_ptr<core::ThreadSet> threads() const { return threads_; }

  void add(std::shared_ptr<Membership> membership) {
    std::lock_guard lock(mu_);
    prune_locked();
    groups_.push_back(std::move(membership));
  }

  // Aborts every live group matching the request; returns how many.
  int32_t abort(const AbortGroup& request) {
    std::vector<std::shared_ptr<Membership>> hit;
    {
      std::lock_guard lock(mu_);
      prune_locked();
      for (auto& m : groups_)
        if (m->matches(request.name, request.generation)) hit.push_back(m);
    }
    for (auto& m : hit) abort_async(m, request.reason);
    return static_cast<int32_t>(hit.size());
  }

  // Aborts the group off the calling thread: abort() may wait for the
  // operation thread to leave the transport (GlooGroupOptions::abort_settle),
  // and the callers here are the I/O thread, which must keep serving the
  // head and other control messages meanwhile.
  void abort_async(std::shared_ptr<Membership> membership, std::string reason) {
    threads_->spawn([membership = std::move(membership), reason = std::move(reason)] { membership->abort(reason); });
  }

 private:
  void prune_locked() {
    groups_.erase(std::remove_if(groups_.begin(), groups_.end(), [](const auto& m) { return m->retired(); }),
                  groups_.end());
  }

  std::mutex mu_;
  std::vector<std::shared_ptr<Membership>> groups_;
  // Abort threads, and gloo operation threads left behind by aborted
  // groups; last, so they are joined before the rest goes.
  std::shared_ptr<core::ThreadSet> threads_ = std::make_shared<core::ThreadSet>();
};

// The group join_group() hands out: the caller's unique_ptr is its only
// owner. It owns the backend group and forwards to it; its destructor
// retires the Membership first (so the runtime's aborts are done with the
// backend), then destroys the backend, then lets the member watch go (the
// watch callbacks hold it weakly and go quiet).
class JoinedGroup final : public Group {
 public:
  JoinedGroup(std::unique_ptr<Group> backend, std::shared_ptr<MemberWatch> watch)
      : backend_(std::move(backend)),
        membership_(std::make_shared<Membership>(backend_.get())),
        watch_(std::move(watch)) {}
  ~JoinedGroup() override {
    membership_->retire();
    backend_.reset();
  }

  const std::shared_ptr<Membership>& membership() const { return membership_; }

  int rank() const override { return backend_->rank(); }
  int world_size() const override { return backend_->world_size(); }
  const std::string& name() const override { return backend_->name(); }
  int64_t generation() const override { return backend_->generation(); }
  WorkPtr allreduce(void* data, size_t count, DType dtype, const AllreduceOptions& opts) override {
    return backend_->allreduce(data, count, dtype, opts);
  }
  WorkPtr broadcast(void* data, size_t count, DType dtype, int root, const BroadcastOptions& opts) override {
    return backend_->broadcast(data, count, dtype, root, opts);
  }
  WorkPtr allgather(const void* in, void* out, size_t count, DType dtype, const AllgatherOptions& opts) override {
    return backend_->allgather(in, out, count, dtype, opts);
  }
  WorkPtr reduce_scatter(const void* in, void* out, size_t count_per_rank, DType dtype,
                         const ReduceScatterOptions& opts) override {
    return backend_->reduce_scatter(in, out, count_per_rank, dtype, opts);
  }
  WorkPtr barrier(const BarrierOptions& opts) override { return backend_->barrier(opts); }
  WorkPtr send(const void* data, size_t count, DType dtype, int dst, const SendOptions& opts) override {
    return backend_->send(data, count, dtype, dst, opts);
  }
  WorkPtr recv(void* data, size_t count, DType dtype, int src, const RecvOptions& opts) override {
    return backend_->recv(data, count, dtype, src, opts);
  }
  void abort(const std::string& reason) override { backend_->abort(reason); }
  bool is_aborted() const override { return backend_->is_aborted(); }
  Group& backend() override { return backend_->backend(); }

 private:
  std::unique_ptr<Group> backend_;
  std::shared_ptr<Membership> membership_;
  std::shared_ptr<MemberWatch> watch_;
};

// Records a member's death and aborts the group if it is formed. Runs on
// the I/O thread: only a lock, a string and a thread start.
void report_death(const std::shared_ptr<MemberWatch>& watch, std::string reason) {
  std::shared_ptr<Membership> membership;
  std::shared_ptr<GroupTable> table;
  {
    std::lock_guard lock(watch->mu);
    if (!watch->death.empty()) return;
    watch->death = reason;
    membership = watch->membership;
    table = watch->table.lock();
  }
  if (membership && table) table->abort_async(std::move(membership), std::move(reason));
}

// The runtime's KV, with waits that give up early when a member dies, so a
// rendezvous with a dead member fails in a fraction of a second instead of
// at its timeout.
class WatchedKv final : public KvStore {
 public:
  WatchedKv(KvStore& kv, std::shared_ptr<MemberWatch> watch) : kv_(kv), watch_(std::move(watch)) {}

  void put(const std::string& key, const std::string& value) override { kv_.put(key, value); }
  std::optional<std::string> get(const std::string& key) override { return kv_.get(key); }
  void erase(const std::string& key) override { kv_.erase(key); }
  int64_t add(const std::string& key, int64_t delta) override { return kv_.add(key, delta); }

  std::string wait(const std::string& key, milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      throw_if_dead();
      auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
      try {
        return kv_.wait(key, std::clamp(left, milliseconds(0), kRendezvousPoll));
      } catch (const Timeout&) {
        if (Clock::now() >= deadline) {
          throw Timeout("kv wait for key '" + key + "' timed out after " + std::to_string(timeout.count()) + " ms");
        }
      }
    }
  }

  void throw_if_dead() {
    std::lock_guard lock(watch_->mu);
    if (!watch_->death.empty()) throw Aborted(watch_->death);
  }

 private:
  KvStore& kv_;
  std::shared_ptr<MemberWatch> watch_;
};

std::string describe_member(int rank, uint64_t id) {
  return "rank " + std::to_string(rank) + " (actor " + std::to_string(id) + ")";
}

// Why `info` means the member is gone from this group, or "" when it is
// still the process that joined (same incarnation, not restarting/dead).
std::string departure(const ActorInfo& info, uint32_t joined_incarnation, int rank) {
  std::string who = "member " + describe_member(rank, info.id);
  if (info.state == ActorState::kDead || info.state == ActorState::kRestarting) {
    std::string why = who + " is " + wire::to_string(info.state);
    if (!info.death_cause.empty()) why += ": " + info.death_cause;
    return why;
  }
  if (info.incarnation != joined_incarnation) {
    return who + " restarted (incarnation " + std::to_string(joined_incarnation) + " -> " +
           std::to_string(info.incarnation) + ")";
  }
  return "";
}

// Gloo listens on the address it tells its peers, so it takes the node's
// advertise host (the bind host may be the wildcard 0.0.0.0).
std::string default_bind_host() {
  std::string advertise = core::env_value(core::kEnvAdvertiseHost);
  if (!advertise.empty()) return advertise;
  std::string bind = core::env_value(core::kEnvBindHost);
  return bind.empty() ? "127.0.0.1" : bind;
}

// Why forming the group should stop: the first member death the watch
// saw, "" while none.
std::function<std::string()> death_of(const std::shared_ptr<MemberWatch>& watch) {
  return [weak = std::weak_ptr<MemberWatch>(watch)] {
    auto w = weak.lock();
    if (!w) return std::string();
    std::lock_guard lock(w->mu);
    return w->death;
  };
}

std::unique_ptr<Group> create_backend(KvStore& kv, const GroupSpec& spec, const std::shared_ptr<MemberWatch>& watch,
                                      bool watched, std::weak_ptr<core::ThreadSet> stragglers) {
  switch (spec.backend) {
    case Backend::kGloo: {
      GlooGroupOptions opts;
      opts.bind_host = spec.bind_host.empty() ? default_bind_host() : spec.bind_host;
      opts.rendezvous_timeout = spec.rendezvous_timeout;
      opts.op_timeout = spec.op_timeout;
      opts.check_agreement = spec.check_agreement;
      opts.check_point_to_point = spec.check_point_to_point;
      if (watched) {
        opts.error_grace = kWatchedErrorGrace;
        opts.abandoned = death_of(watch);
      }
      opts.stragglers = std::move(stragglers);
      return GlooGroup::create(kv, spec.name, spec.generation, spec.rank, spec.world_size, opts);
    }
    case Backend::kNccl: {
#if TROUPE_WITH_NCCL
      NcclGroupOptions opts;
      opts.device = spec.device;
      opts.rendezvous_timeout = spec.rendezvous_timeout;
      opts.op_timeout = spec.op_timeout;
      return NcclGroup::create(kv, spec.name, spec.generation, spec.rank, spec.world_size, opts);
#else
      throw ConfigError("collective group '" + spec.name + "' asks for the NCCL backend, which this build lacks");
#endif
    }
  }
  throw ConfigError("unknown collective backend");
}

}  // namespace

const char* to_string(Backend backend) {
  switch (backend) {
    case Backend::kGloo:
      return "gloo";
    case Backend::kNccl:
      return "nccl";
  }
  return "unknown";
}

std::unique_ptr<Group> join_group(const GroupSpec& spec) { return join_group(this_actor::runtime(), spec); }

std::unique_ptr<Group> join_group(Runtime& runtime, const GroupSpec& spec) {
  TROUPE_CHECK(!spec.name.empty()) << "a collective group needs a name";
  TROUPE_CHECK(spec.world_size >= 1 && spec.rank >= 0 && spec.rank < spec.world_size)
      << "rank " << spec.rank << " of " << spec.world_size << " in group '" << spec.name << "'";
  TROUPE_CHECK(spec.members.empty() || spec.members.size() == static_cast<size_t>(spec.world_size))
      << "group '" << spec.name << "' has " << spec.members.size() << " member ids for world size " << spec.world_size;

  auto table = runtime.core()->service<GroupTable>();
  auto watch = std::make_shared<MemberWatch>();
  watch->table = table;

  // Watch first, then read each member's state: a change between the two is
  // then seen by the callback rather than lost.
  for (int r = 0; r < static_cast<int>(spec.members.size()); ++r) {
    if (r == spec.rank) continue;
    const uint64_t id = spec.members[r];
    // The incarnation that joins is the one alive now; set before the
    // callback can run (it compares against it).
    auto joined = std::make_shared<std::atomic<int64_t>>(-1);
    std::weak_ptr<MemberWatch> weak = watch;
    watch->watches.push_back(runtime.watch_actor(id, [weak, joined, r](const ActorInfo& info) {
      auto w = weak.lock();
      int64_t inc = joined->load();
      if (!w || inc < 0) return;
      std::string why = departure(info, static_cast<uint32_t>(inc), r);
      if (!why.empty()) report_death(w, std::move(why));
    }));
    ActorInfo now = runtime.actor_info(id);
    joined->store(now.incarnation);
    std::string why = departure(now, now.incarnation, r);
    if (!why.empty()) report_death(watch, std::move(why));
  }

  const bool watched = spec.members.size() > 1;
  WatchedKv kv(runtime.kv(), watch);
  std::unique_ptr<Group> formed;
  try {
    formed = create_backend(kv, spec, watch, watched, table->threads());
  } catch (const Aborted& e) {
    throw Aborted("forming collective group '" + spec.name + "' generation " + std::to_string(spec.generation) +
                  " failed: " + e.what());
  }

  // The group keeps the watch alive exactly as long as itself, so the
  // callbacks (which hold it weakly) go quiet once the group is destroyed.
  auto group = std::make_unique<JoinedGroup>(std::move(formed), watch);
  std::string died;
  {
    std::lock_guard lock(watch->mu);
    watch->membership = group->membership();
    died = watch->death;
  }
  table->add(group->membership());
  // A member died after its last rendezvous step but before the group was
  // registered: nothing else will abort it.
  if (!died.empty()) group->abort(died);
  return group;
}

int abort_group(Runtime& runtime, const std::vector<uint64_t>& member_ids, const std::string& name,
                const std::string& reason, int64_t generation, milliseconds timeout,
                std::vector<uint64_t>* acknowledged_ids) {
  const AbortGroup message{.name = name, .generation = generation, .reason = reason};
  std::vector<Future<int32_t>> answers;
  std::vector<uint64_t> asked;
  for (uint64_t id : member_ids) {
    try {
      // Fails at once for a member that is not ALIVE.
      answers.push_back(runtime.core()->actor(id)->control(message));
      asked.push_back(id);
    } catch (const std::exception& e) {
      TROUPE_LOG_DEBUG("abort of group '{}': actor {} not reached: {}", name, id, e.what());
    }
  }
  const auto deadline = Clock::now() + timeout;
  int acknowledged = 0;
  for (size_t i = 0; i < answers.size(); ++i) {
    auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    try {
      answers[i].get(std::max(left, milliseconds(0)));
      ++acknowledged;
      if (acknowledged_ids) acknowledged_ids->push_back(asked[i]);
    } catch (const std::exception& e) {
      TROUPE_LOG_DEBUG("abort of group '{}': a member did not acknowledge: {}", name, e.what());
    }
  }
  return acknowledged;
}

}  // namespace troupe::collective
