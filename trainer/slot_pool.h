// SlotPool: where a TrainJob's trainers live. A slot is one trainer and its
// DataLoaderActor in a one-bundle placement group of their own, so one slot
// can be replaced, added or dropped without touching the others. The pool
// places and releases slots, keeps the standby trainers (placed and set up
// ahead, idle until a trainer dies) and answers how much room the live nodes
// have (for growth and for the up-front "can this job ever be placed"
// check). Internal to TrainJob.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "troupe/actors/data_loader_actor.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/trainer/stop_wait.h"
#include "troupe/trainer/train_job.h"
#include "troupe/trainer/trainer_actor.h"

namespace troupe::trainer {

using TrainerHandle = ActorHandle<TrainerActor>;
using LoaderHandle = ActorHandle<actors::DataLoaderActor>;

// One trainer with its loader, in a one-bundle placement group of its own.
struct Slot {
  std::optional<PlacementGroup> pg;
  TrainerHandle trainer;
  LoaderHandle loader;
  bool ready = false;  // setup() done
  // Holds the job's training state (joined a formed group that synced or
  // healed it, or loaded a checkpoint): may be a heal source.
  bool has_state = false;
  // A standby's setup() call, until it has answered (or, for a standby
  // that stood in while still setting up, until Gang::setup_new waits on
  // it).
  std::optional<Future<TrainerInfo>> setting_up;
};

// "{CPU: 1, GPU: 1}", for events and errors.
std::string format_resources(const Resources& r);

class SlotPool {
 public:
  // `name` prefixes the placement groups' names; with `use_loaders` every
  // slot gets a DataLoaderActor beside its trainer.
  SlotPool(Runtime& rt, const TrainJobConfig& cfg, bool use_loaders, std::string name);
  // Releases the standby trainers (the gang releases its own slots).
  ~SlotPool();
  SlotPool(const SlotPool&) = delete;
  SlotPool& operator=(const SlotPool&) = delete;

  // Places up to n new slots within `timeout`; those that fit are returned
  // with their actors spawned (not set up). Why the others did not fit is
  // pending_reason().
  std::vector<Slot> place(int64_t n, std::chrono::milliseconds timeout);
  // Kills the slot's actors and removes its placement group (best effort).
  void release(Slot& s);
  // New actors in the placement groups of slots whose trainer died: the
  // old actors are killed and the groups kept, so nothing else (queued
  // tasks, actors waiting for room) takes their reservations meanwhile. A
  // group whose node died is placed again by the cluster: it is waited for
  // within `timeout`, and released if it is not placed by then (why is
  // pending_reason()). Returns the slots respawned (not set up).
  std::vector<Slot> respawn(std::vector<Slot> dead, std::chrono::milliseconds timeout);
  void spawn_loader(Slot& s);
  const std::string& pending_reason() const { return pending_reason_; }
  bool use_loaders() const { return use_loaders_; }

  // Tops the standby trainers up to failure.standby_workers where there is
  // room, no more often than scaling.grow_interval (their setup runs while
  // training goes on). Returns how many were placed.
  int64_t refill_standby();
  size_t standby_count() const { return standby_.size(); }
  // Up to n live standby trainers, taken out of the pool (dead ones are
  // released), waiting for each at most until `deadline`. One still
  // setting up then is taken too, not ready, with its setup() call in
  // `setting_up`: Gang::setup_new waits for that.
  std::vector<Slot> take_standby(size_t n, std::chrono::steady_clock::time_point deadline);

  // How many more slots (at most `limit`) the live nodes' free resources fit.
  int64_t room_to_grow(int64_t limit);
  // ConfigError naming the resource when the live nodes could not hold n
  // slots even if empty (the placement groups would stay PENDING).
  void check_can_place(int64_t n);

 private:
  // The live nodes (total and available resources): the one place that
  // asks the cluster for its nodes.
  std::vector<wire::NodeInfo> live_nodes();
  // Options for an actor in the slot's bundle (resources: none).
  ActorOptions slot_options(const Slot& s) const;
  // Spawns the trainer (and loader) in the slot's ready placement group.
  void spawn_actors(Slot& s);
  // Kills the slot's actors (best effort) and empties its handles.
  void kill_actors(Slot& s);

  Runtime& rt_;
  const TrainJobConfig& cfg_;
  const bool use_loaders_;
  const std::string name_;
  int64_t pg_count_ = 0;
  std::string pending_reason_;
  std::vector<Slot> standby_;
  std::chrono::steady_clock::time_point last_standby_check_;
};

}  // namespace troupe::trainer
