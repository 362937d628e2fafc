#include "troupe/trainer/failure_recovery.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "troupe/runtime/collective/actor_group.h"

namespace troupe::trainer {

FailureRecovery::FailureRecovery(Parts parts, Recovery& record)
    : p_(parts), rec_(record), deadline_(Clock::now() + parts.cfg.failure.abort_timeout) {}

std::chrono::milliseconds FailureRecovery::left() const {
  // Every wait of steps 1 and 2 shares one deadline, so a recovery's
  // probing is bounded by abort_timeout whatever the number of ranks.
  return std::max(std::chrono::milliseconds(1),
                  std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now()));
}

void FailureRecovery::run() {
  stop_round();
  probe();
  respawn_loaders();
  const std::string replaced = replace_trainers();
  // A new generation, and one state everywhere.
  p_.gang.setup_new(p_.cfg.setup_bound());
  // Said once the replacements are set up: asked for, they may still never
  // come (a cluster stopped meanwhile takes the head away with them).
  if (!replaced.empty()) event(JobEventKind::kReplaced, replaced);
  if (!any_state_ || p_.cfg.failure.mode == RecoveryMode::kCheckpoint)
    restore_from_disk();
  else
    heal();
  finish();
}

// 1. No survivor may stay inside a collective with a dead peer (abort, by
//    control message: it bypasses the mailbox), wait for batches from a
//    loader that died before it connected (interrupt its stream), and no
//    loader may keep writing into a stream nobody reads (stop feeds).
void FailureRecovery::stop_round() {
  const int acked = abort_group();
  for (auto& f : interrupt_and_stop_feeds()) f->wait_for(std::min(left(), std::chrono::milliseconds(1000)));
  // Which did not answer the abort: the stopped or hung one, where the
  // round's timeout could only name every rank.
  std::string silent;
  const auto& slots = p_.gang.slots();
  for (size_t i = 0; i < slots.size(); ++i)
    if (slots[i].trainer.valid() && !acknowledged(i))
      silent += std::string(silent.empty() ? "; no answer from " : ", ") + "rank " + std::to_string(i) + " (actor " +
                std::to_string(slots[i].trainer.id()) + ")";
  event(JobEventKind::kAborted, "generation " + std::to_string(p_.gang.generation()) + " aborted in " +
                                    std::to_string(acked) + " of " + std::to_string(p_.gang.world()) + " trainers" +
                                    silent);
  // Every call of the round has ended now. One that ended with a
  // ConfigError (a rank's step or data set raised) ends the job with it:
  // a heal would meet the same error again. The peers' aborts may have
  // reached the driver first; here, no timing decides which is seen.
  std::exception_ptr user_error;
  for (auto& st : p_.gang.take_inflight()) {
    st->wait_for(left());
    if (auto e = st->ready() ? st->error() : nullptr; e && !user_error) {
      try {
        std::rethrow_exception(e);
      } catch (const ConfigError&) {
        user_error = e;
      } catch (...) {
      }
    }
  }
  if (user_error) std::rethrow_exception(user_error);
}

bool FailureRecovery::acknowledged(size_t rank) const {
  return std::find(acked_.begin(), acked_.end(), p_.gang.slots()[rank].trainer.id()) != acked_.end();
}

int FailureRecovery::abort_group() {
  std::vector<uint64_t> ids;
  for (auto& s : p_.gang.slots())
    if (s.trainer.valid()) ids.push_back(s.trainer.id());
  acked_.clear();
  return collective::abort_group(p_.rt, ids, p_.gang.group_name(), rec_.cause, p_.gang.generation(),
                                 std::min(left(), std::chrono::milliseconds(2000)), &acked_);
}

std::vector<std::shared_ptr<core::FutureStateBase>> FailureRecovery::interrupt_and_stop_feeds() {
  std::vector<std::shared_ptr<core::FutureStateBase>> controls;
  for (auto& s : p_.gang.slots()) {
    try {
      controls.push_back(
          s.trainer.control(InterruptBatches{.generation = p_.gang.generation(), .reason = rec_.cause}).state());
      if (s.loader.valid()) controls.push_back(s.loader.control(actors::StopFeeds{.rank = -1}).state());
    } catch (...) {
    }
  }
  return controls;
}

bool FailureRecovery::loader_answers(std::optional<Future<actors::LoaderStats>>& stats) {
  try {
    stats->get(left());
    return true;
  } catch (...) {
    return false;
  }
}

// 2. Who is alive: a trainer that answers progress() (it left the aborted
//    step; calls queue behind a running one) and a loader that answers a
//    stats control message (served beside a running feed). Anything else is
//    gone: killed for good and its slot emptied.
void FailureRecovery::probe() {
  auto& slots = p_.gang.slots();
  progress_.assign(slots.size(), std::nullopt);
  auto ps = p_.gang.call_all(&TrainerActor::progress);
  std::vector<std::optional<Future<actors::LoaderStats>>> stats(slots.size());
  for (size_t i = 0; i < slots.size(); ++i)
    if (slots[i].loader.valid()) stats[i] = slots[i].loader.control(actors::GetLoaderStats{});
  for (size_t i = 0; i < slots.size(); ++i) {
    try {
      progress_[i] = ps[i].get(left());
    } catch (const std::exception&) {
      progress_[i].reset();
    }
    if (!stats[i] || loader_answers(stats[i]) || !progress_[i]) continue;
    try {
      p_.rt.kill_actor(slots[i].loader.id(), true);
    } catch (...) {
    }
    slots[i].loader = LoaderHandle();
  }
  distrust_steps_outside_the_group();
  // A trainer that never received the job's state (a replacement whose
  // heal failed) is no source: it holds the initial weights.
  int64_t reached = p_.gang.step();
  for (size_t i = 0; i < slots.size(); ++i) {
    if (!progress_[i]) {
      dead_.push_back(i);
      continue;
    }
    if (!slots[i].has_state) continue;
    any_state_ = true;
    reached = std::max(reached, progress_[i]->step);
  }
  rec_.reached_step = reached;
}

// Survivors of one round stand at most a step apart (a rank that saw the
// abort just before the round's last reduction ended), and a heal takes the
// furthest. A trainer stopped (SIGSTOP, a hang) when the abort came, and
// woken before the probe, may go on stepping on what its group left in
// shared memory: steps no peer took with it. So the furthest counts only
// among trainers that acknowledged the abort; one that did not and is
// further still is killed and its rank replaced, as a silent one would be.
void FailureRecovery::distrust_steps_outside_the_group() {
  auto& slots = p_.gang.slots();
  int64_t best_acked = -1;
  for (size_t i = 0; i < slots.size(); ++i)
    if (progress_[i] && slots[i].has_state && acknowledged(i)) best_acked = std::max(best_acked, progress_[i]->step);
  if (best_acked < 0) return;  // nobody acknowledged: the furthest, as before
  for (size_t i = 0; i < slots.size(); ++i) {
    if (!progress_[i] || !slots[i].has_state || acknowledged(i) || progress_[i]->step <= best_acked) continue;
    event(JobEventKind::kAborted,
          "rank " + std::to_string(i) + " (actor " + std::to_string(slots[i].trainer.id()) +
              ") did not acknowledge the abort and then reported step " + std::to_string(progress_[i]->step) +
              ", past the " + std::to_string(best_acked) +
              " of the ranks that did: steps taken outside the group; it is killed and replaced");
    try {
      p_.rt.kill_actor(slots[i].trainer.id(), true);
    } catch (...) {
    }
    progress_[i].reset();
  }
}

// 3a. Loaders of live trainers, in their trainers' bundles.
void FailureRecovery::respawn_loaders() {
  auto& slots = p_.gang.slots();
  for (size_t i = 0; i < slots.size(); ++i)
    if (progress_[i] && p_.pool.use_loaders() && !slots[i].loader.valid()) {
      p_.pool.spawn_loader(slots[i]);
      event(JobEventKind::kReplaced,
            "the loader of rank " + std::to_string(i) + " died; a new one resumes from the cursor");
    }
}

std::vector<Slot> FailureRecovery::replacements() {
  const size_t n = dead_.size();
  auto fresh = p_.pool.take_standby(n, deadline_ + std::chrono::seconds(2));
  rec_.from_standby = static_cast<int64_t>(fresh.size());
  // The dead slots no standby stands in for keep their placement groups:
  // released, their resources would go to whatever waits for room (queued
  // tasks, other actors) before a new slot could be placed.
  std::vector<Slot> kept;
  size_t lacking = 0;
  for (size_t k = 0; k < n; ++k) {
    Slot dead = std::exchange(p_.gang.slots()[dead_[k]], Slot{});
    if (k >= fresh.size() && dead.pg)
      kept.push_back(std::move(dead));
    else {
      lacking += k >= fresh.size() ? 1 : 0;  // a slot without a group gets a new one
      p_.pool.release(dead);
    }
  }
  // Standbys taken and slots placed are the gang's only once returned: an
  // error on the way gives them back rather than leaving them running.
  try {
    const auto deadline = Clock::now() + (n == p_.gang.slots().size() ? p_.cfg.scaling.placement_timeout
                                                                      : p_.cfg.failure.replacement_timeout);
    auto respawned = p_.pool.respawn(std::move(kept),
                                     std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
    rec_.placed = static_cast<int64_t>(respawned.size());
    for (auto& s : respawned) fresh.push_back(std::move(s));
    if (lacking > 0) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      auto placed = p_.pool.place(static_cast<int64_t>(lacking), std::max(left, std::chrono::milliseconds(1)));
      rec_.placed += static_cast<int64_t>(placed.size());
      for (auto& s : placed) fresh.push_back(std::move(s));
    }
  } catch (...) {
    for (auto& s : fresh) p_.pool.release(s);
    throw;
  }
  return fresh;
}

// The new slot order (survivors and replacements at their old ranks,
// dropped ranks closing the gaps) and the heal source: the survivor holding
// state with the most completed steps.
std::vector<Slot> FailureRecovery::next_ranks(std::vector<Slot> fresh) {
  auto& slots = p_.gang.slots();
  std::vector<Slot> next;
  int64_t best = -1;
  size_t k = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (progress_[i]) {
      if (slots[i].has_state && progress_[i]->step > best) {
        best = progress_[i]->step;
        heal_src_ = static_cast<int64_t>(next.size());
      }
      next.push_back(std::move(slots[i]));
    } else if (k < fresh.size()) {
      next.push_back(std::move(fresh[k++]));
    }
  }
  return next;
}

// 3b. Dead trainers replaced at the same ranks (the same data shard and
//     reduction order as before), standbys first, else in the dead slots'
//     own placement groups; what cannot be placed in time is dropped (the
//     job shrinks).
std::string FailureRecovery::replace_trainers() {
  // Every trainer dead: the wait was placement_timeout's (replacements()).
  const bool all_dead = dead_.size() == p_.gang.slots().size();
  auto fresh = replacements();
  const size_t replaced = fresh.size();
  p_.gang.set_slots(next_ranks(std::move(fresh)));
  // The head went while the replacements were asked for (the cluster was
  // stopped, which is often what killed the trainers): nothing was placed,
  // whatever the handles say.
  if (!dead_.empty() && p_.rt.valid() && p_.rt.core()->head_lost())
    throw GiveUp{"lost the cluster's head, so none of the " + std::to_string(dead_.size()) +
                 " dead trainer(s) could be replaced (the failure seen: " + rec_.cause + ")"};
  const auto& reason = p_.pool.pending_reason();
  const std::string said =
      dead_.empty() ? ""
                    : std::to_string(replaced) + " of " + std::to_string(dead_.size()) + " dead trainer(s) replaced" +
                          (rec_.from_standby ? " (" + std::to_string(rec_.from_standby) + " from standby)" : "") +
                          (replaced < dead_.size() ? " (no room: " + reason + ")" : "");
  const int64_t world = p_.gang.world();
  if (world < p_.min_workers) {
    if (!said.empty()) event(JobEventKind::kReplaced, said);
    const auto waited = all_dead ? p_.cfg.scaling.placement_timeout : p_.cfg.failure.replacement_timeout;
    char secs[32];
    std::snprintf(secs, sizeof secs, "%g s", static_cast<double>(waited.count()) / 1000.0);
    throw GiveUp{"only " + std::to_string(world) + " trainer(s) could be placed within " +
                 (all_dead ? "scaling.placement_timeout (" : "failure.replacement_timeout (") + secs +
                 "), and the job runs on at least " + std::to_string(p_.min_workers) +
                 " (scaling.min_workers, else num_workers)" + (reason.empty() ? "" : " (" + reason + ")")};
  }
  return said;
}

// 4, from disk: the last checkpoint, the one the job resumed from when it
// has none later of its own (it went back to the initial weights: a
// fine-tune lost what it started from at its first failure), or the
// initial weights without either.
void FailureRecovery::restore_from_disk() {
  auto& gang = p_.gang;
  std::optional<TrainState> disk;
  std::string from;
  if (p_.writer) p_.writer->wait();
  std::optional<CheckpointInfo> latest;
  if (!p_.cfg.checkpoint.dir.empty()) latest = latest_checkpoint(p_.cfg.checkpoint.dir);
  if (p_.resumed && (!latest || latest->step < p_.resumed->step)) {
    try {
      disk = load_checkpoint(p_.resumed->path);
    } catch (const std::exception& e) {
      throw GiveUp{"the job resumed from " + p_.resumed->path + " (step " + std::to_string(p_.resumed->step) +
                   "), has no later checkpoint, and cannot read that one again: " + e.what()};
    }
    restored_epoch_sums_ = p_.resumed->epoch_sums;
    from = "the checkpoint it resumed from, " + p_.resumed->path + ", ";
  } else if (latest) {
    disk = load_checkpoint(latest->path);
    restored_epoch_sums_ = latest->epoch_sums;
    from = "the checkpoint of ";
  }
  if (!disk) {
    // Back to the initial weights: survivors set up afresh too.
    for (auto& s : gang.slots()) s.ready = false;
    gang.setup_new(p_.cfg.setup_bound());
  }
  // Forming the group sends rank 0's weights to every rank: from here a
  // survivor holds the job's state no more (a stop, or a failure, before
  // the load has ended must not save or heal from it).
  for (auto& s : gang.slots()) s.has_state = false;
  gang.form(-1, p_.cfg.setup_bound());
  if (disk) {
    for (auto& s : gang.slots()) s.has_state = false;  // until the load succeeds
    gang.load_everywhere(*disk, p_.cfg.setup_bound());
    rec_.mode = RecoveryMode::kCheckpoint;
    event(JobEventKind::kRestored, "every trainer took " + from + "step " + std::to_string(disk->step));
  } else {
    // No checkpoint: every trainer holds the initial weights.
    gang.set_position(0, gang.cursor());
    gang.begin_epoch(0);
    rec_.mode = RecoveryMode::kRestart;
    event(JobEventKind::kRestored, "no checkpoint: training starts over from the initial weights");
  }
  // Steps after the restored one are done again: forget their records.
  p_.consumed.forget_after(gang.step());
}

// 4, from a live peer, by broadcast.
void FailureRecovery::heal() {
  auto& gang = p_.gang;
  const int64_t before = gang.step();
  const auto before_cursor = gang.cursor();
  gang.form(heal_src_, p_.cfg.setup_bound());
  // Steps the survivors completed inside the failed round count as
  // consumed: what each old rank read in them follows from the cursor the
  // round started at (the dead ranks' share included).
  p_.consumed.add_from_sampler(before_cursor, before, gang.step());
  rec_.mode = RecoveryMode::kHeal;
  event(JobEventKind::kHealed, "rank " + std::to_string(heal_src_) + " sent its state (step " +
                                   std::to_string(gang.step()) + ") to " + std::to_string(gang.world()) +
                                   " ranks by broadcast");
}

void FailureRecovery::finish() {
  const int64_t world = p_.gang.world();
  const int64_t step = p_.gang.step();
  if (world != rec_.world_before)
    event(JobEventKind::kResized, std::to_string(rec_.world_before) + " -> " + std::to_string(world) +
                                      " workers at step " + std::to_string(step));
  rec_.world_after = world;
  rec_.resumed_step = step;
  rec_.lost_steps = std::max<int64_t>(0, rec_.reached_step - step);
  rec_.resumed_at = p_.reporter.now();
  char took[32];
  std::snprintf(took, sizeof took, "%.3f", rec_.resumed_at - rec_.failed_at);
  event(JobEventKind::kResumed, "at step " + std::to_string(step) + " with " + std::to_string(world) + " workers, " +
                                    std::to_string(rec_.lost_steps) + " step(s) lost, " + to_string(rec_.mode) +
                                    " in " + took + " s");
}

}  // namespace troupe::trainer
