#include "troupe/actors/distributed_sampler.h"

#include <cstring>
#include <numeric>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/types.h>

#include "troupe/runtime/core/check.h"
#include "troupe/runtime/core/errors.h"

namespace troupe::actors {

std::string to_string(const SamplerCursor& c) {
  return "SamplerCursor(epoch=" + std::to_string(c.epoch) + ", world_size=" + std::to_string(c.world_size) +
         ", segment_start=" + std::to_string(c.segment_start) +
         ", segment_consumed=" + std::to_string(c.segment_consumed) + ")";
}

DistributedSampler::DistributedSampler(SamplerOptions options) : options_(options) {
  if (options_.dataset_size < 0) {
    throw ConfigError("DistributedSampler: dataset_size " + std::to_string(options_.dataset_size) + " < 0");
  }
  if (options_.world_size < 1) {
    throw ConfigError("DistributedSampler: world_size " + std::to_string(options_.world_size) + " < 1");
  }
}

int64_t DistributedSampler::num_samples_for(int64_t n, int64_t w, bool drop_last) {
  TROUPE_CHECK(n >= 0 && w >= 1) << "n=" << n << " world_size=" << w;
  if (drop_last && n % w != 0) {
    // math.ceil((n - w) / w); with n < w this is 0 (Python's ceil of a
    // negative fraction rounds toward zero).
    int64_t a = n - w;
    return a <= 0 ? 0 : (a + w - 1) / w;
  }
  return (n + w - 1) / w;
}

std::vector<int64_t> DistributedSampler::epoch_order(int64_t epoch) const {
  const int64_t n = options_.dataset_size;
  std::vector<int64_t> order(static_cast<size_t>(n));
  if (!options_.shuffle) {
    std::iota(order.begin(), order.end(), int64_t{0});
    return order;
  }
  // torch.Generator().manual_seed(seed + epoch); torch.randperm(n, generator=g).
  // manual_seed takes the integer modulo 2^64, which the unsigned cast does.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(options_.seed + epoch));
  auto perm = torch::randperm(n, gen, torch::TensorOptions().dtype(torch::kLong));
  std::memcpy(order.data(), perm.data_ptr<int64_t>(), sizeof(int64_t) * size_t(n));
  return order;
}

std::vector<int64_t> DistributedSampler::indices(int64_t epoch, int64_t rank) const {
  return remaining(begin_epoch(epoch), rank);
}

SamplerCursor DistributedSampler::begin_epoch(int64_t epoch, int64_t world_size) const {
  if (world_size < 1) throw ConfigError("DistributedSampler: world_size " + std::to_string(world_size) + " < 1");
  SamplerCursor c;
  c.epoch = epoch;
  c.world_size = world_size;
  return c;
}

void DistributedSampler::check_cursor(const SamplerCursor& c) const {
  TROUPE_CHECK(c.world_size >= 1 && c.segment_start >= 0 && c.segment_start <= options_.dataset_size &&
               c.segment_consumed >= 0 && c.segment_consumed % c.world_size == 0 &&
               c.segment_consumed <= segment_length(c))
      << "cursor " << to_string(c) << " does not fit a data set of " << options_.dataset_size << " samples";
}

int64_t DistributedSampler::segment_length(const SamplerCursor& c) const {
  return num_samples_for(options_.dataset_size - c.segment_start, c.world_size) * c.world_size;
}

std::vector<int64_t> DistributedSampler::remaining(const SamplerCursor& c, int64_t rank) const {
  check_cursor(c);
  TROUPE_CHECK(rank >= 0 && rank < c.world_size) << "rank " << rank << " of world size " << c.world_size;
  const int64_t unique = options_.dataset_size - c.segment_start;
  const int64_t length = segment_length(c);
  std::vector<int64_t> out;
  if (length == c.segment_consumed) return out;
  std::vector<int64_t> order = epoch_order(c.epoch);
  out.reserve(size_t((length - c.segment_consumed) / c.world_size));
  // Segment position p holds base[start + p % unique]: positions past the
  // unique ones wrap around to the segment's start, which is PyTorch's
  // padding rule (indices += indices[:padding_size], repeated as needed).
  for (int64_t p = c.segment_consumed + rank; p < length; p += c.world_size) {
    out.push_back(order[size_t(c.segment_start + p % unique)]);
  }
  return out;
}

int64_t DistributedSampler::remaining_per_rank(const SamplerCursor& c) const {
  check_cursor(c);
  return (segment_length(c) - c.segment_consumed) / c.world_size;
}

int64_t DistributedSampler::consumed(const SamplerCursor& c) const {
  check_cursor(c);
  if (c.segment_consumed == segment_length(c)) return options_.dataset_size;
  return c.segment_start + std::min(c.segment_consumed, options_.dataset_size - c.segment_start);
}

SamplerCursor DistributedSampler::advance(const SamplerCursor& c, int64_t per_rank) const {
  check_cursor(c);
  TROUPE_CHECK(per_rank >= 0 && per_rank <= remaining_per_rank(c))
      << "advance by " << per_rank << " per rank past the end of " << to_string(c) << " (" << remaining_per_rank(c)
      << " left per rank)";
  SamplerCursor next = c;
  next.segment_consumed += per_rank * c.world_size;
  return next;
}

SamplerCursor DistributedSampler::resize(const SamplerCursor& c, int64_t world_size) const {
  check_cursor(c);
  if (world_size < 1) throw ConfigError("DistributedSampler: world_size " + std::to_string(world_size) + " < 1");
  if (world_size == c.world_size) return c;
  SamplerCursor next;
  next.epoch = c.epoch;
  next.world_size = world_size;
  next.segment_start = consumed(c);
  next.segment_consumed = 0;
  return next;
}

}  // namespace troupe::actors
