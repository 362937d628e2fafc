#include "troupe/actors/tensor_dict.h"

#include <sstream>

#include "troupe/runtime/core/errors.h"

namespace troupe::actors {

TensorDict::TensorDict(std::initializer_list<std::pair<const std::string, torch::Tensor>> entries) {
  for (const auto& [key, value] : entries) set(key, value);
}

TensorDict::TensorDict(Map entries) {
  for (auto& [key, value] : entries) set(key, std::move(value));
}

const torch::Tensor& TensorDict::at(const std::string& key) const {
  auto it = entries_.find(key);
  if (it == entries_.end()) {
    std::string have;
    for (const auto& [k, v] : entries_) have += (have.empty() ? "" : ", ") + k;
    throw ConfigError("no tensor '" + key + "' in the batch (it has: " + (have.empty() ? "nothing" : have) + ")");
  }
  return it->second;
}

torch::Tensor TensorDict::get(const std::string& key) const {
  auto it = entries_.find(key);
  return it == entries_.end() ? torch::Tensor() : it->second;
}

TensorDict& TensorDict::set(const std::string& key, torch::Tensor value) {
  if (value.defined()) {
    entries_[key] = std::move(value);
  } else {
    entries_.erase(key);
  }
  return *this;
}

std::vector<std::string> TensorDict::keys() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& [k, v] : entries_) out.push_back(k);
  return out;
}

TensorDict TensorDict::to(const torch::Device& device, bool non_blocking) const {
  TensorDict out;
  for (const auto& [k, v] : entries_) {
    // A non-blocking copy from pageable memory is not: CUDA synchronises
    // the stream first and stages the bytes itself. From pinned memory it
    // is queued behind the work already on the stream and the caller goes
    // on (LibTorch's pinned-memory cache keeps the staging block until the
    // copy is done), so the GPU runs the last step's optimizer, the copy
    // and the next forward back to back.
    if (non_blocking && device.is_cuda() && v.device().is_cpu() && !v.is_pinned())
      out.entries_[k] = v.pin_memory().to(device, true);
    else
      out.entries_[k] = v.to(device, non_blocking);
  }
  return out;
}

std::string describe_tensor(const torch::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::ostringstream os;
  os << c10::toString(t.scalar_type()) << " " << t.sizes();
  return os.str();
}

std::string TensorDict::describe() const {
  std::string out = "{";
  for (const auto& [k, v] : entries_) out += (out.size() > 1 ? ", " : "") + k + ": " + describe_tensor(v);
  return out + "}";
}

}  // namespace troupe::actors
