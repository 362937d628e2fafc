#include "troupe/actors/batch.h"

#include <utility>

#include "troupe/runtime/core/errors.h"

namespace troupe::actors {

namespace {

thread_local CollateBuffers* current_buffers = nullptr;

std::string key_list(const Sample& s) {
  std::string out;
  for (const auto& k : s.keys()) out += (out.empty() ? "" : ", ") + k;
  return "{" + out + "}";
}

// Stacks key `key` of every sample, after checking they agree, so a
// mismatch names the sample rather than surfacing as a c10::Error from stack.
torch::Tensor stack_key(const std::vector<Sample>& samples, const std::string& key) {
  const torch::Tensor& first = samples.front().at(key);
  std::vector<torch::Tensor> parts;
  parts.reserve(samples.size());
  for (size_t i = 0; i < samples.size(); ++i) {
    torch::Tensor t = samples[i].get(key);
    if (!t.defined() || t.scalar_type() != first.scalar_type() || t.sizes() != first.sizes()) {
      throw Error("collate: sample " + std::to_string(i) + " has " + key + " " + describe_tensor(t) +
                  " but sample 0 has " + describe_tensor(first));
    }
    parts.push_back(t);
  }
  // Kept buffers are plain CPU tensors: anything else stacks as before.
  if (current_buffers == nullptr || !first.device().is_cpu() || first.layout() != torch::kStrided ||
      first.requires_grad())
    return torch::stack(parts);
  std::vector<int64_t> sizes{static_cast<int64_t>(parts.size())};
  sizes.insert(sizes.end(), first.sizes().begin(), first.sizes().end());
  torch::Tensor out = current_buffers->take(key, first.scalar_type(), sizes);
  torch::stack_out(out, parts);
  return out;
}

void check_sizes(size_t samples, const std::vector<int64_t>& indices) {
  if (samples == 0) throw Error("collate: no samples");
  if (!indices.empty() && indices.size() != samples) {
    throw Error("collate: " + std::to_string(samples) + " samples but " + std::to_string(indices.size()) + " indices");
  }
}

}  // namespace

bool sole_handle(const torch::Tensor& t) { return t.use_count() == 1 && t.storage().use_count() == 1; }

torch::Tensor CollateBuffers::take(const std::string& key, c10::ScalarType dtype, c10::IntArrayRef sizes) {
  std::lock_guard lock(mu_);
  auto& kept = kept_[key];
  for (const torch::Tensor& t : kept) {
    if (sole_handle(t) && t.scalar_type() == dtype && t.sizes() == sizes) return t;
  }
  torch::Tensor fresh = torch::empty(sizes, torch::TensorOptions().dtype(dtype));
  if (kept.size() < max_per_key_) {
    kept.push_back(fresh);
  } else {
    // A shape change (the last, short batch) replaces a tensor nobody holds.
    for (torch::Tensor& t : kept)
      if (sole_handle(t)) {
        t = fresh;
        break;
      }
  }
  return fresh;
}

size_t CollateBuffers::kept() const {
  std::lock_guard lock(mu_);
  size_t n = 0;
  for (const auto& [key, v] : kept_) n += v.size();
  return n;
}

CollateBuffers::Scope::Scope(CollateBuffers* buffers) : previous_(std::exchange(current_buffers, buffers)) {}
CollateBuffers::Scope::~Scope() { current_buffers = previous_; }

torch::Tensor batch_buffer(const std::string& key, c10::ScalarType dtype, c10::IntArrayRef sizes) {
  return current_buffers ? current_buffers->take(key, dtype, sizes)
                         : torch::empty(sizes, torch::TensorOptions().dtype(dtype));
}

TensorDict stack_collate(const std::vector<Sample>& samples) {
  if (samples.empty()) throw Error("collate: no samples");
  const Sample& first = samples.front();
  if (first.empty()) throw Error("collate: samples have no tensors");
  for (size_t i = 1; i < samples.size(); ++i) {
    if (samples[i].size() != first.size()) {
      throw Error("collate: sample " + std::to_string(i) + " has keys " + key_list(samples[i]) + " but sample 0 has " +
                  key_list(first));
    }
  }
  TensorDict out;
  for (const auto& [key, t] : first) out.set(key, stack_key(samples, key));
  return out;
}

Batch collate(std::vector<Sample>&& samples, std::vector<int64_t> indices) {
  check_sizes(samples.size(), indices);
  Batch b;
  b.tensors = stack_collate(samples);
  b.samples = static_cast<int64_t>(samples.size());
  b.indices = std::move(indices);
  samples.clear();
  return b;
}

Batch collate(const Dataset& dataset, std::vector<Sample>&& samples, std::vector<int64_t> indices) {
  check_sizes(samples.size(), indices);
  Batch b;
  b.samples = static_cast<int64_t>(samples.size());
  try {
    b.tensors = dataset.collate(std::move(samples));
  } catch (const std::exception& e) {
    // Its samples by position are these data set indices (a collate's error
    // names a sample by its position in the batch).
    std::string where;
    if (!indices.empty()) {
      where = " (its samples 0, 1, ... are data set indices ";
      for (size_t i = 0; i < indices.size() && i < 16; ++i) where += (i ? ", " : "") + std::to_string(indices[i]);
      where += indices.size() > 16 ? ", ...)" : ")";
    }
    throw ConfigError("collate of " + dataset.describe() + " failed" + where + ": " + e.what());
  }
  if (b.tensors.empty()) throw Error("collate of " + dataset.describe() + " returned no tensors");
  b.indices = std::move(indices);
  return b;
}

Batch loaded_batch(TensorDict tensors, std::vector<int64_t> indices) {
  Batch b;
  b.tensors = std::move(tensors);
  b.samples = static_cast<int64_t>(indices.size());
  b.indices = std::move(indices);
  return b;
}

Batch load_and_collate(const Dataset& dataset, std::vector<int64_t> indices, int64_t epoch) {
  if (auto whole = dataset.load_batch(indices, epoch)) return loaded_batch(std::move(*whole), std::move(indices));
  std::vector<Sample> samples;
  samples.reserve(indices.size());
  for (int64_t i : indices) samples.push_back(dataset.get(i, epoch));
  return collate(dataset, std::move(samples), std::move(indices));
}

}  // namespace troupe::actors
