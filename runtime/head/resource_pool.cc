#include "troupe/runtime/head/resource_pool.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>
#include <string_view>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/utf8.h"
#include "troupe/runtime/head/scheduler.h"

namespace troupe::head {

namespace {
// Shares are sums of fractions such as 0.1: compare with room for rounding.
constexpr double kShareEps = 1e-9;

std::string show(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}
}  // namespace

void validate_max_concurrency(int64_t n) {
  if (n < 1 || n > kMaxActorConcurrency)
    throw ConfigError("max_concurrency must be in [1, " + std::to_string(kMaxActorConcurrency) + "], got " +
                      std::to_string(n));
}

void validate_concurrency_groups(const std::vector<wire::ConcurrencyGroup>& groups, const std::string& class_name,
                                 const std::vector<std::string>* methods) {
  const std::string where = "actor " + class_name + ": concurrency_groups";
  if (groups.size() > wire::kMaxConcurrencyGroups)
    throw ConfigError(where + " has " + std::to_string(groups.size()) + " groups, more than " +
                      std::to_string(wire::kMaxConcurrencyGroups));
  std::map<std::string, std::string> group_of;  // method -> its group
  for (size_t i = 0; i < groups.size(); ++i) {
    const auto& g = groups[i];
    if (g.name.empty()) throw ConfigError(where + ": group #" + std::to_string(i) + " has an empty name");
    for (size_t j = 0; j < i; ++j)
      if (groups[j].name == g.name) throw ConfigError(where + ": group '" + g.name + "' is given twice");
    if (g.max_concurrency < 1 || g.max_concurrency > kMaxActorConcurrency)
      throw ConfigError(where + ": group '" + g.name + "' has max_concurrency " + std::to_string(g.max_concurrency) +
                        ", not in [1, " + std::to_string(kMaxActorConcurrency) + "]");
    for (const auto& m : g.methods) {
      if (methods && std::find(methods->begin(), methods->end(), m) == methods->end())
        throw ConfigError(where + ": group '" + g.name + "' lists method '" + m + "', which " + class_name +
                          " does not have");
      auto [it, fresh] = group_of.emplace(m, g.name);
      if (!fresh)
        throw ConfigError(where + ": method '" + m + "' is in two groups, '" + it->second + "' and '" + g.name + "'");
    }
  }
}

void validate_shown_name(const std::string& name, const std::string& what) {
  if (name.size() > kMaxShownName)
    throw ConfigError(what + " '" + core::to_valid_utf8(name.substr(0, 64)) + "...' is " + std::to_string(name.size()) +
                      " bytes long, over the limit of " + std::to_string(kMaxShownName));
  if (!core::valid_utf8(name)) throw ConfigError(what + " '" + core::to_valid_utf8(name) + "' is not UTF-8 text");
  // C0 controls and DEL; C1 controls (U+0080-U+009F: C2 80-9F, an 8-bit
  // CSI among them) and the bidirectional overrides and isolates
  // (U+202A-U+202E: E2 80 AA-AE; U+2066-U+2069: E2 81 A6-A9), which
  // reorder what a terminal shows.
  auto control_at = [&](size_t i) {
    const auto b = [&](size_t k) { return k < name.size() ? static_cast<unsigned char>(name[k]) : 0; };
    if (b(i) < ' ' || b(i) == 0x7f) return true;
    if (b(i) == 0xC2 && b(i + 1) >= 0x80 && b(i + 1) <= 0x9F) return true;
    if (b(i) == 0xE2 && b(i + 1) == 0x80 && b(i + 2) >= 0xAA && b(i + 2) <= 0xAE) return true;
    return b(i) == 0xE2 && b(i + 1) == 0x81 && b(i + 2) >= 0xA6 && b(i + 2) <= 0xA9;
  };
  for (size_t i = 0; i < name.size(); ++i)
    if (control_at(i)) {
      std::string shown;
      for (size_t k = 0; k < name.size();) {
        const auto c = static_cast<unsigned char>(name[k]);
        if (!control_at(k)) {
          shown += name[k++];
          continue;
        }
        shown += '?';
        k += c < 0x80 ? 1 : c == 0xC2 ? 2 : 3;
      }
      throw ConfigError(what + " '" + shown + "' has a control character (shown as ?): names may not have them");
    }
}

void validate_resources(const Resources& r, const std::string& where) {
  for (const auto& [k, v] : r) {
    if (k.empty()) throw ConfigError(where + ": a resource has an empty name (amount " + show(v) + ")");
    if (!core::valid_utf8(k))
      throw ConfigError(where + ": resource name '" + core::to_valid_utf8(k) + "' is not UTF-8 text");
    // Names are shown in lists ("{CPU=1, disk=2}") and lines of status:
    // no blanks, control characters or the list's own punctuation.
    for (unsigned char c : k)
      if (c <= ' ' || c == 0x7f || std::string_view("{}=,\"").find(static_cast<char>(c)) != std::string_view::npos)
        throw ConfigError(where + ": resource name '" + k + "' has a character names may not have (blanks, " +
                          "control characters and {}=,\" are refused)");
    std::string what = where + ": resource '" + k + "' = " + show(v);
    if (!std::isfinite(v)) throw ConfigError(what + " is not a finite number");
    if (v < 0) throw ConfigError(what + " is negative");
    if (v > 0 && v < kSmallestAmount)
      throw ConfigError(what + " is smaller than the smallest amount, " + show(kSmallestAmount) + " (give 0 for none)");
    if (k == "memory") {
      if (v > kMaxMemoryBytes) throw ConfigError(what + " exceeds the limit of " + show(kMaxMemoryBytes) + " bytes");
      if (v != std::floor(v)) throw ConfigError(what + " is not a whole number of bytes");
      continue;
    }
    if (v > kMaxResourceAmount) throw ConfigError(what + " exceeds the limit " + show(kMaxResourceAmount));
    if (k == "GPU" && v > kMaxGpus) throw ConfigError(what + " exceeds the limit of " + show(kMaxGpus) + " GPUs");
    if (k == "GPU" && v > 1 && std::abs(v - std::round(v)) > kShareEps)
      throw ConfigError(what + " is more than one GPU but not a whole number: ask for whole GPUs, or a part of one");
  }
}

int gpu_count(const Resources& r) {
  auto it = r.find("GPU");
  if (it == r.end() || !(it->second > 0)) return 0;
  if (it->second < 1) return 1;  // a part of one GPU is a share of GPU 0
  return static_cast<int>(std::min(it->second, kMaxGpus) + 0.5);
}

ResourcePool::ResourcePool(Resources total) : total_(total), available_(std::move(total)) {
  for (int i = 0; i < gpu_count(total_); ++i) gpu_ids_.push_back(i);
  // A node that offers part of one GPU offers that part of GPU 0.
  gpu_capacity_.assign(gpu_ids_.size(), gpu_ids_.size() == 1 ? gpu_share(gpu_amount(total_)) : 1.0);
  gpu_free_ = gpu_capacity_;
}

ResourcePool::ResourcePool(Resources total, std::vector<int32_t> gpu_ids)
    : total_(total), available_(std::move(total)), gpu_ids_(std::move(gpu_ids)) {
  gpu_capacity_.assign(gpu_ids_.size(), gpu_ids_.size() == 1 ? gpu_share(gpu_amount(total_)) : 1.0);
  gpu_free_ = gpu_capacity_;
}

std::vector<int32_t> ResourcePool::free_gpus() const {
  std::vector<int32_t> out;
  for (size_t i = 0; i < gpu_ids_.size(); ++i)
    if (gpu_free_[i] >= 1 - kShareEps) out.push_back(gpu_ids_[i]);
  return out;
}

Resources ResourcePool::used() const {
  Resources u;
  for (const auto& [k, v] : total_) {
    auto it = available_.find(k);
    u[k] = v - (it == available_.end() ? 0.0 : it->second);
  }
  return u;
}

bool ResourcePool::fits(const Resources& req) const {
  return head::fits(available_, req) && pick_gpus(gpu_free_, gpu_amount(req)).has_value();
}

Grant ResourcePool::take(const Resources& req) {
  if (!fits(req))
    throw ConfigError("{" + format_resources(req) + "} does not fit in {" + format_resources(available_) + "}");
  Grant g;
  g.resources = req;
  subtract(available_, req);
  const double amount = gpu_amount(req);
  auto picked = *pick_gpus(gpu_free_, amount);
  take_gpus(gpu_free_, picked, amount);
  for (size_t i : picked) g.gpu_ids.push_back(gpu_ids_[i]);
  return g;
}

void ResourcePool::retake(const Grant& grant) {
  // Only GPUs must fit: other amounts may have run over the total before
  // the restart (reclaim).
  const double amount = gpu_amount(grant.resources);
  if (!head::fits(available_, {{"GPU", amount}}))
    throw ConfigError("{" + format_resources(grant.resources) + "} does not fit in {" + format_resources(available_) +
                      "}");
  const double each = gpu_share(amount);
  std::vector<size_t> picked;
  for (int32_t id : grant.gpu_ids) {
    auto it = std::find(gpu_ids_.begin(), gpu_ids_.end(), id);
    auto i = static_cast<size_t>(it - gpu_ids_.begin());
    if (it == gpu_ids_.end() || gpu_free_[i] + kShareEps < each)
      throw ConfigError("GPU " + std::to_string(id) + " is not free");
    picked.push_back(i);
  }
  subtract(available_, grant.resources);
  take_gpus(gpu_free_, picked, amount);
}

void ResourcePool::reclaim(const Resources& amounts) { subtract(available_, amounts); }

void ResourcePool::give_back(const Grant& grant) {
  add(available_, grant.resources);
  // Fractions taken and given back in another order leave rounding dust: an
  // idle node showed 2.2e-16 of its CPUs used. What is within a billionth of
  // the total is all of it.
  for (auto& [k, v] : available_)
    if (auto t = total_.find(k); t != total_.end() && std::abs(v - t->second) < 1e-9) v = t->second;
  const double each = gpu_share(gpu_amount(grant.resources));
  for (int32_t id : grant.gpu_ids) {
    auto it = std::find(gpu_ids_.begin(), gpu_ids_.end(), id);
    if (it == gpu_ids_.end()) continue;
    const auto i = static_cast<size_t>(it - gpu_ids_.begin());
    gpu_free_[i] = std::min(gpu_capacity_[i], gpu_free_[i] + each);
  }
}

}  // namespace troupe::head
