#include "troupe/trainer/consumed_record.h"

#include <algorithm>

namespace troupe::trainer {

ConsumedRecord::ConsumedRecord(const TrainerConfig& config, bool enabled, const actors::DistributedSampler& sampler,
                               int64_t dataset_size)
    : config_(config), enabled_(enabled), sampler_(sampler), dataset_size_(dataset_size) {}

void ConsumedRecord::add(const TrainReport& r) {
  if (!enabled_ || r.step_samples.empty()) return;
  // Split the report's indices into its steps.
  size_t pos = 0;
  const int64_t first = r.global_step - static_cast<int64_t>(r.step_samples.size()) + 1;
  for (size_t k = 0; k < r.step_samples.size(); ++k) {
    auto& [epoch, idx] = steps_[first + static_cast<int64_t>(k)];
    const size_t n = std::min(static_cast<size_t>(r.step_samples[k]), r.consumed.size() - pos);
    epoch = r.cursor.epoch;
    idx.insert(idx.end(), r.consumed.begin() + pos, r.consumed.begin() + pos + n);
    pos += n;
  }
}

void ConsumedRecord::add_from_sampler(const actors::SamplerCursor& cursor, int64_t from, int64_t to) {
  if (!enabled_ || to <= from) return;
  const auto split = split_order(config_, dataset_size_);
  const int64_t per_step = config_.batch_size * config_.accumulation;
  for (int64_t r = 0; r < cursor.world_size; ++r) {
    const auto idx = sampler_.remaining(cursor, r);
    for (int64_t st = from; st < to; ++st) {
      auto& [epoch, out] = steps_[st + 1];
      epoch = cursor.epoch;
      const size_t b = static_cast<size_t>((st - from) * per_step);
      for (size_t k = b; k < std::min(idx.size(), b + static_cast<size_t>(per_step)); ++k)
        out.push_back(split.empty() ? idx[k] : split[static_cast<size_t>(idx[k])]);
    }
  }
}

void ConsumedRecord::forget_after(int64_t step) { steps_.erase(steps_.upper_bound(step), steps_.end()); }

std::map<int64_t, std::vector<int64_t>> ConsumedRecord::by_epoch() const {
  std::map<int64_t, std::vector<int64_t>> out;
  for (const auto& [st, entry] : steps_) {
    auto& v = out[entry.first];
    v.insert(v.end(), entry.second.begin(), entry.second.end());
  }
  return out;
}

}  // namespace troupe::trainer
