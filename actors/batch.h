// Batch: what a data loader hands a trainer — the collated tensors of
// consecutive samples (a TensorDict: by default each key stacked, or what
// the data set's own collate made of them), plus where they came from (data
// set indices, epoch, position in the run), so the receiver can check
// ordering and a checkpoint can say how far the epoch got. collate() turns
// samples into one. Batches cross the wire through Codec (tensor bytes as
// attachments, see tensor_codec.h).
#pragma once

#include <cstdint>
#include <vector>

#include "troupe/actors/dataset.h"
#include "troupe/actors/tensor_dict.h"

namespace troupe::actors {

struct Batch {
  // The collated tensors: {"input": [B, ...], "target": [B, ...]} for the
  // built-in data sets.
  TensorDict tensors{};
  // Data set indices of the samples, in order.
  std::vector<int64_t> indices{};
  int64_t epoch = 0;
  // 0, 1, 2, ... within one BatchPipeline::run.
  int64_t sequence = 0;
  // Samples collated into this batch (a graph batch's tensors have other
  // first dimensions).
  int64_t samples = 0;

  TROUPE_FIELDS(tensors, indices, epoch, sequence, samples);

  int64_t size() const { return samples; }
};

// Stacks each key of the samples along a new first dimension (as PyTorch's
// default_collate). Throws troupe::Error naming the first sample whose keys,
// shape or dtype differ from sample 0's.
TensorDict stack_collate(const std::vector<Sample>& samples);

// A batch of `samples` collated by stack_collate(). `indices` are copied
// into the batch (may be empty, else one per sample).
Batch collate(std::vector<Sample>&& samples, std::vector<int64_t> indices = {});
// The same with `dataset`'s own collate; an exception it throws comes out
// as troupe::Error naming the data set and the first index of the batch.
Batch collate(const Dataset& dataset, std::vector<Sample>&& samples, std::vector<int64_t> indices = {});

}  // namespace troupe::actors
