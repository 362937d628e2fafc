#include "troupe/actors/array_datasets.h"

#include <cstring>

#include "troupe/runtime/core/errors.h"

namespace troupe::actors {

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

NpyArray open_tokens(const TokenStreamOptions& o) {
  if (o.path.empty()) throw ConfigError("token_stream: 'path' is required");
  if (ends_with(o.path, ".npy")) return NpyArray::open(o.path, /*allow_unsigned=*/true);
  if (o.dtype == "uint16") return NpyArray::open_raw(o.path, torch::kShort, true);
  if (o.dtype == "uint32") return NpyArray::open_raw(o.path, torch::kInt, true);
  if (o.dtype == "int32") return NpyArray::open_raw(o.path, torch::kInt, false);
  if (o.dtype == "int64") return NpyArray::open_raw(o.path, torch::kLong, false);
  throw ConfigError("token_stream '" + o.path + "': dtype '" + o.dtype +
                    "' is not one of uint16, uint32, int32, int64");
}

// Token ids as int64, reading unsigned storage as unsigned.
torch::Tensor widen(const torch::Tensor& t, bool unsigned_ints) {
  auto wide = t.to(torch::kLong);
  if (!unsigned_ints || t.scalar_type() == torch::kLong) return wide;
  const int64_t mask = t.scalar_type() == torch::kShort ? 0xFFFF : 0xFFFFFFFFLL;
  return wide.bitwise_and(mask);
}

}  // namespace

// --- ArrayDataset ---

ArrayDataset::ArrayDataset(std::map<std::string, NpyArray> arrays, std::string description)
    : arrays_(std::move(arrays)), description_(std::move(description)) {
  if (arrays_.empty()) throw ConfigError(description_ + ": no arrays");
  const auto& [first_key, first] = *arrays_.begin();
  for (const auto& [key, a] : arrays_) {
    if (a.shape().empty()) throw ConfigError(description_ + ": array '" + key + "' is 0-dimensional");
    if (a.rows() != first.rows()) {
      throw ConfigError(description_ + ": array '" + key + "' has " + std::to_string(a.rows()) + " rows but '" +
                        first_key + "' has " + std::to_string(first.rows()));
    }
  }
  rows_ = first.rows();
  std::vector<const NpyArray*> all;
  for (const auto& [key, a] : arrays_) all.push_back(&a);
  require_data_in_rows(all, description_);
}

std::unique_ptr<ArrayDataset> ArrayDataset::from_npz(const std::string& path) {
  return std::make_unique<ArrayDataset>(NpyArray::open_npz(path), "npz('" + path + "')");
}

std::unique_ptr<ArrayDataset> ArrayDataset::from_npy_files(const std::map<std::string, std::string>& paths) {
  std::map<std::string, NpyArray> arrays;
  std::string description;
  for (const auto& [key, path] : paths) {
    arrays.emplace(key, NpyArray::open(path));
    description += (description.empty() ? "" : ", ") + key + "='" + path + "'";
  }
  return std::make_unique<ArrayDataset>(std::move(arrays), "arrays(" + description + ")");
}

Sample ArrayDataset::load(int64_t index, int64_t /*epoch*/) const {
  Sample s;
  for (const auto& [key, a] : arrays_) s.set(key, a.row(index));
  return s;
}

// --- TokenStreamDataset ---

TokenStreamDataset::TokenStreamDataset(TokenStreamOptions options)
    : options_(std::move(options)), tokens_(open_tokens(options_)) {
  const std::string name = "token_stream '" + options_.path + "'";
  if (options_.block_size < 1) throw ConfigError(name + ": block_size must be >= 1");
  if (options_.stride < 0) throw ConfigError(name + ": stride must be >= 0");
  if (options_.stride == 0) options_.stride = options_.block_size;
  if (tokens_.shape().size() != 1) throw ConfigError(name + ": the token array must be 1-dimensional");
  auto t = tokens_.dtype();
  if (t != torch::kShort && t != torch::kInt && t != torch::kLong && t != torch::kByte)
    throw ConfigError(name + ": token ids must be integers, not " + std::string(c10::toString(t)));
  const int64_t n = tokens();
  if (n < options_.block_size + 1) {
    throw ConfigError(name + ": " + std::to_string(n) +
                      " tokens, fewer than block_size + 1 = " + std::to_string(options_.block_size + 1));
  }
  windows_ = (n - options_.block_size - 1) / options_.stride + 1;
}

std::string TokenStreamDataset::describe() const {
  return "token_stream('" + options_.path + "', " + std::to_string(tokens()) + " tokens, block_size " +
         std::to_string(options_.block_size) + ")";
}

Sample TokenStreamDataset::load(int64_t index, int64_t /*epoch*/) const {
  const int64_t start = index * options_.stride;
  const int64_t len = options_.block_size + 1;
  const size_t item = torch::elementSize(tokens_.dtype());
  auto window = torch::empty({len}, torch::TensorOptions().dtype(tokens_.dtype()));
  tokens_.check_unchanged();
  read_mapped(&tokens_, 1, [&] {
    std::memcpy(window.data_ptr(), tokens_.data() + static_cast<size_t>(start) * item, static_cast<size_t>(len) * item);
  });
  auto ids = widen(window, tokens_.unsigned_ints());
  return {{"input", ids.slice(0, 0, len - 1).clone()}, {"target", ids.slice(0, 1, len).clone()}};
}

}  // namespace troupe::actors
