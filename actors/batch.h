// Batch: what a data loader hands a trainer — the stacked inputs and targets
// of consecutive samples, plus where they came from (data set indices, epoch,
// position in the run), so the receiver can check ordering and a checkpoint
// can say how far the epoch got. collate() turns samples into one. Batches
// cross the wire through Codec (tensor bytes as attachments, see
// tensor_codec.h).
#pragma once

#include <cstdint>
#include <vector>

#include "troupe/actors/dataset.h"

namespace troupe::actors {

struct Batch {
  // [B, ...] stacks of the samples' tensors; target undefined when the
  // samples have none.
  torch::Tensor input{};
  torch::Tensor target{};
  // Data set indices of the rows, in row order.
  std::vector<int64_t> indices{};
  int64_t epoch = 0;
  // 0, 1, 2, ... within one BatchPipeline::run.
  int64_t sequence = 0;

  TROUPE_FIELDS(input, target, indices, epoch, sequence);

  int64_t size() const { return input.defined() ? input.size(0) : 0; }
};

// Stacks samples along a new first dimension (as PyTorch's default_collate).
// Throws troupe::Error naming the first sample whose shape or dtype differs
// from sample 0's, or when some samples have targets and others not.
// `indices` are copied into the batch (may be empty).
Batch collate(std::vector<Sample>&& samples, std::vector<int64_t> indices = {});

}  // namespace troupe::actors
