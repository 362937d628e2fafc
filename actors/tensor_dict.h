// TensorDict: a sample or a batch as named tensors ("input", "target",
// "edge_index", ...). It is what data sets return, what the loader's
// pipeline collates and streams, and what a train step receives, so a model
// with several inputs or a ragged (graph) batch needs no special type. A
// value: copyable, ordered by key (so iteration, encoding and error
// messages are deterministic), crosses the wire through Codec (each tensor
// as an attachment, see tensor_codec.h).
#pragma once

#include <cstddef>
#include <initializer_list>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "troupe/actors/tensor_codec.h"
#include "troupe/runtime/wire/codec.h"

namespace troupe::actors {

class TensorDict {
 public:
  using Map = std::map<std::string, torch::Tensor>;

  TensorDict() = default;
  // {{"input", x}, {"target", y}}; undefined tensors are left out.
  TensorDict(std::initializer_list<std::pair<const std::string, torch::Tensor>> entries);
  explicit TensorDict(Map entries);

  bool contains(const std::string& key) const { return entries_.count(key) != 0; }
  // Throws troupe::ConfigError naming `key` and the keys there are.
  const torch::Tensor& at(const std::string& key) const;
  // The tensor under `key`, or an undefined tensor.
  torch::Tensor get(const std::string& key) const;
  // Sets `key` (an undefined tensor erases it). Returns *this for chaining.
  TensorDict& set(const std::string& key, torch::Tensor value);
  void erase(const std::string& key) { entries_.erase(key); }

  std::vector<std::string> keys() const;
  size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }
  Map::const_iterator begin() const { return entries_.begin(); }
  Map::const_iterator end() const { return entries_.end(); }
  const Map& entries() const { return entries_; }

  // Every tensor moved to `device`. non_blocking to a GPU copies CPU
  // tensors through pinned memory (pinning those that are not), so the
  // copies queue without synchronising the stream.
  TensorDict to(const torch::Device& device, bool non_blocking = false) const;
  // "{input: Float [4, 3], target: Long [4]}", for messages.
  std::string describe() const;

  TROUPE_FIELDS(entries_);

 private:
  Map entries_;
};

// "Float [4, 3]" or "undefined".
std::string describe_tensor(const torch::Tensor& t);

}  // namespace troupe::actors
