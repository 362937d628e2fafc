// Gang: the trainers of one TrainJob generation, in rank order, and where
// they stand (the step and sampler cursor the driver tracks for them). It
// fans calls out to every rank, sets up new trainers, forms the collective
// group under the next generation (healing every rank from one live peer
// when asked), loads one state everywhere, and runs a round of train()
// calls (fed by the loaders) that fails fast. Its slots come from, and go
// back to, a SlotPool. Internal to TrainJob.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "troupe/actors/distributed_sampler.h"
#include "troupe/runtime/core/future.h"
#include "troupe/trainer/slot_pool.h"
#include "troupe/trainer/stop_wait.h"

namespace troupe::trainer {

// A failure the job may recover from (a call failed, a peer died).
class StepFailed : public Error {
 public:
  using Error::Error;
};

// Waits for every future; rethrows the first failure after all settled, so
// no call is left running unobserved. With `stop` set, a stop during the
// wait throws StopRequested at once (stop_wait.h; the calls are left to
// the release of their actors).
template <class R>
std::vector<R> get_all(std::vector<Future<R>>& fs, std::chrono::milliseconds timeout,
                       const std::function<bool()>& stop = {}, const std::string& what = "") {
  std::vector<R> out;
  std::exception_ptr first;
  for (auto& f : fs) {
    try {
      out.push_back(get_or_stop(f, timeout, stop, what));
    } catch (const StopRequested&) {
      throw;
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
  return out;
}
void get_all(std::vector<Future<void>>& fs, std::chrono::milliseconds timeout, const std::function<bool()>& stop = {},
             const std::string& what = "");

class Gang {
 public:
  using StatePtr = std::shared_ptr<core::FutureStateBase>;

  Gang(const TrainJobConfig& cfg, SlotPool& pool, const actors::DistributedSampler& sampler, std::string group_name);
  // Gives every slot back to the pool.
  ~Gang();
  Gang(const Gang&) = delete;
  Gang& operator=(const Gang&) = delete;

  int64_t world() const { return static_cast<int64_t>(slots_.size()); }
  std::vector<Slot>& slots() { return slots_; }
  // The slots in their new rank order (released ones dropped by the caller).
  void set_slots(std::vector<Slot> slots) { slots_ = std::move(slots); }
  void add(std::vector<Slot> more);
  void release_all();
  // Releases the slots from index `keep` on (their actors killed, their
  // placement groups removed): a grow whose newcomers failed.
  void drop_from(size_t keep);

  const std::string& group_name() const { return group_name_; }
  int64_t generation() const { return generation_; }
  // The first trainer's setup() answer (model, parameters, device).
  const TrainerInfo& info() const { return info_; }

  int64_t step() const { return step_; }
  const actors::SamplerCursor& cursor() const { return cursor_; }
  void set_position(int64_t step, const actors::SamplerCursor& cursor);
  // The cursor at the start of `epoch` for the current world size.
  void begin_epoch(int64_t epoch);

  // method(args...) on every rank's trainer, in rank order.
  template <class M, class... A>
  auto call_all(M method, const A&... args) {
    std::vector<decltype(slots_[0].trainer.call(method, args...))> out;
    for (auto& s : slots_) out.push_back(s.trainer.call(method, args...));
    return out;
  }

  // setup() on every trainer not set up yet.
  void setup_new(std::chrono::milliseconds timeout);
  // Joins every trainer to the next generation of the group; with
  // heal_src >= 0, heals every rank from that rank and adopts its progress.
  // Re-splits the cursor for the world size. When the group fails to form
  // twice in a row with the very same trainers (alive: a recovery replaces
  // dead ones), throws GiveUp naming each rank, its host and its error: a
  // another try would fail the same way (hosts that cannot reach each other).
  void form(int64_t heal_src, std::chrono::milliseconds timeout);
  void load_everywhere(const TrainState& state, std::chrono::milliseconds timeout);
  // Rank 0's state, with the driver's cursor and world size.
  TrainState state(std::chrono::milliseconds timeout);

  // One round: train(request) on every rank, fed by the loaders for
  // `feed_steps` steps when request.from_stream. Returns as soon as one call
  // failed (StepFailed; its calls still running are take_inflight()).
  std::vector<TrainReport> train_round(const TrainRequest& request, int64_t feed_steps,
                                       std::chrono::milliseconds timeout);
  // The calls of the round that failed, still to settle.
  std::vector<StatePtr> take_inflight() { return std::move(inflight_); }

 private:
  // Opens a fresh batch stream in every trainer and starts every loader's
  // feed into it; the feeds' states join `round`.
  std::vector<Future<int64_t>> start_feeds(int64_t batches, std::chrono::milliseconds timeout,
                                           std::vector<StatePtr>& round);
  // Waits for form()'s join calls (see form()).
  void await_joins(std::vector<Future<void>>& joins, const std::vector<uint64_t>& members,
                   std::chrono::milliseconds timeout);

  const TrainJobConfig& cfg_;
  SlotPool& pool_;
  const actors::DistributedSampler& sampler_;
  const std::string group_name_;
  std::vector<Slot> slots_;
  int64_t generation_ = 0;
  TrainerInfo info_;
  int64_t step_ = 0;
  actors::SamplerCursor cursor_;
  std::vector<StatePtr> inflight_;
  // The trainers (actor ids in rank order) of the last form() when it
  // failed; empty after one that succeeded.
  std::vector<uint64_t> failed_members_;
};

}  // namespace troupe::trainer
