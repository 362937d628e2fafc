// Batch: what a data loader hands a trainer — the collated tensors of
// consecutive samples (a TensorDict: by default each key stacked, or what
// the data set's own collate made of them), plus where they came from (data
// set indices, epoch, position in the run), so the receiver can check
// ordering and a checkpoint can say how far the epoch got. collate() turns
// samples into one. Batches cross the wire through Codec (tensor bytes as
// attachments, see tensor_codec.h).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
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
// shape or dtype differ from sample 0's. Inside a CollateBuffers::Scope it
// stacks into that set's buffers.
TensorDict stack_collate(const std::vector<Sample>& samples);

// A CPU tensor for key `key` of a batch: from this thread's CollateBuffers
// (see Scope) when it has some, else fresh. For Dataset::load_batch.
torch::Tensor batch_buffer(const std::string& key, c10::ScalarType dtype, c10::IntArrayRef sizes);

// True when `t` is the only handle on its memory: no other tensor, view or
// detached handle (an encoded frame's owner) shares its storage, so its
// bytes may be written over.
bool sole_handle(const torch::Tensor& t);

// Batch tensors for stack_collate to write into again once nothing else
// holds them (the batch went out on its stream, or the consumer dropped
// it). A large batch (128 × 3 × 224² floats: 77 MB) is otherwise fresh
// memory from the kernel each time, and faulting in its zeroed pages cost
// the loader more than the stacking. A set keeps at most `max_per_key`
// tensors for each key (it grows to the most batches held at once) and
// frees them when destroyed; several pipelines may share one.
class CollateBuffers {
 public:
  explicit CollateBuffers(size_t max_per_key = 16) : max_per_key_(max_per_key) {}
  // A tensor of `sizes` and `dtype` for `key`: a kept one that nothing
  // else holds, else a new one (kept while under max_per_key).
  torch::Tensor take(const std::string& key, c10::ScalarType dtype, c10::IntArrayRef sizes);
  size_t kept() const;

  // Makes `buffers` the set stack_collate uses on this thread until the
  // scope ends (nullptr: none).
  class Scope {
   public:
    explicit Scope(CollateBuffers* buffers);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    CollateBuffers* previous_;
  };

 private:
  size_t max_per_key_;
  mutable std::mutex mu_;
  std::map<std::string, std::vector<torch::Tensor>> kept_;
};

// A batch of `samples` collated by stack_collate(). `indices` are copied
// into the batch (may be empty, else one per sample).
Batch collate(std::vector<Sample>&& samples, std::vector<int64_t> indices = {});
// The same with `dataset`'s own collate; an exception it throws comes out
// as troupe::Error naming the data set and the first index of the batch.
Batch collate(const Dataset& dataset, std::vector<Sample>&& samples, std::vector<int64_t> indices = {});
// The batch of `indices` in `epoch`: Dataset::load_batch when the data set
// has it, else get() of each index and collate().
Batch load_and_collate(const Dataset& dataset, std::vector<int64_t> indices, int64_t epoch);
// A batch from tensors load_batch() made for `indices`.
Batch loaded_batch(TensorDict tensors, std::vector<int64_t> indices);

}  // namespace troupe::actors
