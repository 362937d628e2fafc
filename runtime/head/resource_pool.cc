#include "troupe/runtime/head/resource_pool.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/head/scheduler.h"

namespace troupe::head {

namespace {
std::string show(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}
}  // namespace

void validate_resources(const Resources& r, const std::string& where) {
  for (const auto& [k, v] : r) {
    if (k.empty()) throw ConfigError(where + ": a resource has an empty name (amount " + show(v) + ")");
    std::string what = where + ": resource '" + k + "' = " + show(v);
    if (!std::isfinite(v)) throw ConfigError(what + " is not a finite number");
    if (v < 0) throw ConfigError(what + " is negative");
    if (v > kMaxResourceAmount) throw ConfigError(what + " exceeds the limit " + show(kMaxResourceAmount));
    if (k == "GPU" && v > kMaxGpus) throw ConfigError(what + " exceeds the limit of " + show(kMaxGpus) + " GPUs");
  }
}

int gpu_count(const Resources& r) {
  auto it = r.find("GPU");
  if (it == r.end() || !(it->second > 0)) return 0;
  return static_cast<int>(std::min(it->second, kMaxGpus) + 0.5);
}

ResourcePool::ResourcePool(Resources total) : total_(total), available_(std::move(total)) {
  for (int i = 0; i < gpu_count(total_); ++i) gpu_ids_.push_back(i);
  free_gpus_ = gpu_ids_;
}

ResourcePool::ResourcePool(Resources total, std::vector<int32_t> gpu_ids)
    : total_(total), available_(std::move(total)), gpu_ids_(std::move(gpu_ids)), free_gpus_(gpu_ids_) {}

Resources ResourcePool::used() const {
  Resources u;
  for (const auto& [k, v] : total_) {
    auto it = available_.find(k);
    u[k] = v - (it == available_.end() ? 0.0 : it->second);
  }
  return u;
}

bool ResourcePool::fits(const Resources& req) const { return head::fits(available_, req); }

Grant ResourcePool::take(const Resources& req) {
  if (!fits(req))
    throw ConfigError("{" + format_resources(req) + "} does not fit in {" + format_resources(available_) + "}");
  Grant g;
  g.resources = req;
  subtract(available_, req);
  size_t k = std::min<size_t>(gpu_count(req), free_gpus_.size());
  g.gpu_ids.assign(free_gpus_.begin(), free_gpus_.begin() + k);
  free_gpus_.erase(free_gpus_.begin(), free_gpus_.begin() + k);
  return g;
}

void ResourcePool::retake(const Grant& grant) {
  if (!fits(grant.resources))
    throw ConfigError("{" + format_resources(grant.resources) + "} does not fit in {" + format_resources(available_) +
                      "}");
  for (int32_t id : grant.gpu_ids)
    if (std::find(free_gpus_.begin(), free_gpus_.end(), id) == free_gpus_.end())
      throw ConfigError("GPU " + std::to_string(id) + " is not free");
  subtract(available_, grant.resources);
  for (int32_t id : grant.gpu_ids) free_gpus_.erase(std::find(free_gpus_.begin(), free_gpus_.end(), id));
}

void ResourcePool::give_back(const Grant& grant) {
  add(available_, grant.resources);
  free_gpus_.insert(free_gpus_.end(), grant.gpu_ids.begin(), grant.gpu_ids.end());
}

}  // namespace troupe::head
