// FailureRecovery: what a TrainJob does about one failure, as separate
// steps (docs/runtime.md, "Recovery and elasticity"):
//   1. stop_round: abort the group in every survivor, interrupt every
//      trainer's batch stream, stop every loader's feeds, let the failed
//      round's calls settle;
//   2. probe: who is alive (trainers that answer progress(), loaders that
//      answer a stats message); the rest is killed for good;
//   3. respawn_loaders / replace_trainers: a dead loader of a live trainer
//      is respawned in its bundle, dead trainers are replaced (standbys
//      first) at the same ranks, or dropped when there is no room;
//   4. restore_from_disk or heal: the next generation is formed and takes
//      one state (a checkpoint, the initial weights, or a live peer's);
//      forming re-splits the cursor for the new world size.
// Steps 1 and 2 share one deadline (failure.abort_timeout). One object per
// failure; it fills the Recovery record. Internal to TrainJob.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "troupe/runtime/client/runtime.h"
#include "troupe/trainer/checkpoint.h"
#include "troupe/trainer/consumed_record.h"
#include "troupe/trainer/gang.h"
#include "troupe/trainer/job_reporter.h"
#include "troupe/trainer/slot_pool.h"
#include "troupe/trainer/train_job.h"

namespace troupe::trainer {

// The job cannot go on (fit() throws JobFailed with `why`). Not a
// std::exception, so no recovery handler catches it by mistake.
struct GiveUp {
  std::string why;
  bool names_step = false;  // `why` says the step it failed at: not said again as a range
};

class FailureRecovery {
 public:
  // What a recovery works on: the job's parts, owned by the driver.
  struct Parts {
    Runtime& rt;
    const TrainJobConfig& cfg;
    SlotPool& pool;
    Gang& gang;
    JobReporter& reporter;
    ConsumedRecord& consumed;
    CheckpointWriter* writer;  // null without checkpoints
    int64_t min_workers;
    // The checkpoint the job resumed from (null: none): restored from
    // disk while this job has no later checkpoint of its own.
    const CheckpointInfo* resumed = nullptr;
  };
  // `record` has failed_at, cause and world_before set; run() fills the rest.
  FailureRecovery(Parts parts, Recovery& record);

  // Every step, in order. Throws GiveUp when fewer than min_workers trainers
  // are left; anything else it throws is a new failure to recover from.
  void run();
  // Step 1 alone, for a job that gives up: the failed round's calls settle,
  // and a ConfigError one of them ended with (a rank's step or data set
  // raised) is thrown, so the job ends naming that, not what it caused (a
  // peer's broken stream or collective).
  void settle() { stop_round(); }
  // After run() restored a checkpoint: its epoch_sums (empty otherwise).
  const std::map<std::string, double>& restored_epoch_sums() const { return restored_epoch_sums_; }

 private:
  using Clock = std::chrono::steady_clock;

  std::chrono::milliseconds left() const;
  void event(JobEventKind kind, const std::string& detail) { p_.reporter.event(kind, detail); }

  // 1.
  void stop_round();
  // Abort, interrupt and stop messages (control messages bypass the
  // mailbox); returns how many trainers acknowledged the abort.
  int abort_group();
  std::vector<std::shared_ptr<core::FutureStateBase>> interrupt_and_stop_feeds();
  // 2.
  void probe();
  // A trainer that did not acknowledge the abort (stopped, hung) and then
  // reports more steps than every trainer that did took them outside the
  // group: killed, its slot emptied for a replacement.
  void distrust_steps_outside_the_group();
  // Whether the loader answered a stats control message in time.
  bool loader_answers(std::optional<Future<actors::LoaderStats>>& stats);
  // 3.
  void respawn_loaders();
  // Returns the "replaced" event's text ("" when none died), said once the
  // replacements are set up.
  std::string replace_trainers();
  // Replacements for the dead trainers, their slots emptied: standbys
  // first, then new actors in the dead slots' placement groups.
  std::vector<Slot> replacements();
  // Survivors and replacements in the new rank order; sets heal_src_.
  std::vector<Slot> next_ranks(std::vector<Slot> fresh);
  // 4.
  void restore_from_disk();
  void heal();
  void finish();

  Parts p_;
  Recovery& rec_;
  const Clock::time_point deadline_;
  // Per old rank: its progress if the trainer is alive.
  std::vector<std::optional<Progress>> progress_;
  std::vector<size_t> dead_;
  // The trainers that acknowledged the abort of the failed round's group.
  std::vector<uint64_t> acked_;
  bool acknowledged(size_t rank) const;
  bool any_state_ = false;
  int64_t heal_src_ = -1;
  std::map<std::string, double> restored_epoch_sums_;
};

}  // namespace troupe::trainer
