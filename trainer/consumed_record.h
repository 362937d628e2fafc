// ConsumedRecord: with TrainJobConfig::record_indices, the data set indices
// every completed step trained on (Result::consumed), for tests of
// exactly-once delivery across failures. Steps of a successful round come
// from the trainers' reports; steps completed inside a failed round are
// derived from the cursor the round began at; steps done again after a
// restore are forgotten first. Does nothing when recording is off.
// Internal to TrainJob.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "troupe/actors/distributed_sampler.h"
#include "troupe/trainer/trainer_actor.h"

namespace troupe::trainer {

class ConsumedRecord {
 public:
  ConsumedRecord(const TrainerConfig& config, bool enabled, const actors::DistributedSampler& sampler,
                 int64_t dataset_size);

  // One rank's report of a successful round.
  void add(const TrainReport& r);
  // The indices every rank of `cursor`'s world read in steps (from, to]
  // that began at `cursor` (steps of a failed round).
  void add_from_sampler(const actors::SamplerCursor& cursor, int64_t from, int64_t to);
  // Steps after `step` will be done again.
  void forget_after(int64_t step);
  // Epoch -> indices, in step order.
  std::map<int64_t, std::vector<int64_t>> by_epoch() const;

 private:
  const TrainerConfig& config_;
  const bool enabled_;
  const actors::DistributedSampler& sampler_;
  const int64_t dataset_size_;
  // Global step -> (epoch, indices of every rank).
  std::map<int64_t, std::pair<int64_t, std::vector<int64_t>>> steps_;
};

}  // namespace troupe::trainer
