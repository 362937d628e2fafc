// DistributedSampler: which sample indices each data-parallel rank reads in
// an epoch, with PyTorch's semantics to the index — `torch.randperm(n)` from
// a generator seeded with `seed + epoch`, padding by wrap-around (or
// truncation with drop_last) to a multiple of the world size, then rank r
// takes every world-th index starting at r — so a troupe job sees the same
// samples in the same order as the equivalent torch.distributed job.
//
// On top of that, a SamplerCursor: a small value (saved in checkpoints)
// recording how far the epoch has got. Ranks consume in step-major order —
// step s reads batch_size samples on each of the world ranks — so what has
// been consumed is always a prefix of the epoch's global order. When the
// world size changes mid-epoch, the unconsumed rest is re-split among the
// new ranks (re-padded or re-truncated for the new world), so no sample of
// the epoch is skipped or seen twice. Resuming with the same world size
// continues the very same index lists, so a recovered run reads exactly what
// an uninterrupted run reads.
//
// This header does not include LibTorch; only the .cc does (for randperm).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "troupe/runtime/wire/codec.h"

namespace troupe::actors {

struct SamplerOptions {
  // Number of samples in the data set.
  int64_t dataset_size = 0;
  // PyTorch's num_replicas, for cursors started with begin_epoch().
  int64_t world_size = 1;
  bool shuffle = true;
  // As torch's `seed` argument; the epoch's generator is seeded with
  // seed + epoch (negative values wrap as torch.Generator.manual_seed does).
  int64_t seed = 0;
  bool drop_last = false;

  TROUPE_FIELDS(dataset_size, world_size, shuffle, seed, drop_last);
};

// Where an epoch stands. The epoch's base order is the shuffled (or
// identity) permutation of the data set. A segment is a stretch of the epoch
// run at one world size: it starts at base position `segment_start`, its
// order is base[segment_start:] padded or truncated to a multiple of
// `world_size`, and `segment_consumed` of its positions have been read
// (always a multiple of world_size: whole steps). A resize starts a new
// segment at the first unconsumed base position.
struct SamplerCursor {
  int64_t epoch = 0;
  int64_t world_size = 1;
  int64_t segment_start = 0;
  int64_t segment_consumed = 0;

  TROUPE_FIELDS(epoch, world_size, segment_start, segment_consumed);

  friend bool operator==(const SamplerCursor&, const SamplerCursor&) = default;
};

std::string to_string(const SamplerCursor& c);

// A value: cheap to copy, no state beyond its options. Every method is a pure
// function of its arguments (permutations are recomputed, O(n)).
class DistributedSampler {
 public:
  explicit DistributedSampler(SamplerOptions options);

  const SamplerOptions& options() const { return options_; }

  // PyTorch's num_samples (per rank) and total_size for options().world_size.
  int64_t num_samples() const { return num_samples_for(options_.dataset_size, options_.world_size); }
  int64_t total_size() const { return num_samples() * options_.world_size; }

  // The epoch's base order: torch.randperm(n, generator=g) with
  // g.manual_seed(seed + epoch), or 0..n-1 without shuffling.
  std::vector<int64_t> epoch_order(int64_t epoch) const;

  // Exactly PyTorch's `list(iter(sampler))` after set_epoch(epoch), for
  // `rank` of options().world_size.
  std::vector<int64_t> indices(int64_t epoch, int64_t rank) const;

  // --- cursor ---

  // A cursor at the start of `epoch` for options().world_size (or `world_size`).
  SamplerCursor begin_epoch(int64_t epoch) const { return begin_epoch(epoch, options_.world_size); }
  SamplerCursor begin_epoch(int64_t epoch, int64_t world_size) const;

  // The indices `rank` has yet to read in the cursor's segment, in order.
  // For a fresh cursor this equals indices(epoch, rank).
  std::vector<int64_t> remaining(const SamplerCursor& cursor, int64_t rank) const;
  // How many indices each rank has yet to read in the cursor's segment.
  int64_t remaining_per_rank(const SamplerCursor& cursor) const;
  // Base positions of the epoch consumed so far (padding duplicates are not
  // counted twice). With drop_last, the positions dropped for divisibility
  // count as consumed once the segment is exhausted.
  int64_t consumed(const SamplerCursor& cursor) const;
  bool epoch_done(const SamplerCursor& cursor) const { return remaining_per_rank(cursor) == 0; }

  // Records that every rank read `per_rank` more indices (e.g. steps ×
  // batch size). Throws troupe::Error past the end of the segment.
  SamplerCursor advance(const SamplerCursor& cursor, int64_t per_rank) const;

  // Starts a new segment for `world_size` ranks at the first unconsumed
  // position. Same world size: returns the cursor unchanged, so the index
  // lists (including padding) stay those of the uninterrupted run.
  SamplerCursor resize(const SamplerCursor& cursor, int64_t world_size) const;

  // PyTorch's rule: ceil((n - w) / w) with drop_last and n % w != 0, else
  // ceil(n / w).
  static int64_t num_samples_for(int64_t n, int64_t world_size, bool drop_last);
  int64_t num_samples_for(int64_t n, int64_t world_size) const {
    return num_samples_for(n, world_size, options_.drop_last);
  }

 private:
  // Positions in the cursor's segment (padded or truncated length).
  int64_t segment_length(const SamplerCursor& cursor) const;
  // Throws troupe::Error for a cursor that cannot come from this sampler.
  void check_cursor(const SamplerCursor& cursor) const;

  SamplerOptions options_;
};

}  // namespace troupe::actors
