// FactoryRegistry: the user's own data sets, models and train steps,
// registered by name from the user's binary (TROUPE_DATASET, TROUPE_MODEL,
// TROUPE_STEP) the way TROUPE_ACTOR registers actor methods. Workers run the
// driver's own executable, so a name registered at static initialisation in
// the driver is found by every trainer and loader it spawns; specs carry
// only the name and a config string across the wire.
#pragma once

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace troupe::actors {

template <class Factory>
class FactoryRegistry {
 public:
  static FactoryRegistry& instance() {
    static FactoryRegistry registry;
    return registry;
  }
  // A later registration of the same name replaces the earlier one.
  bool add(const std::string& name, Factory factory) {
    std::lock_guard lock(mu_);
    factories_[name] = std::move(factory);
    return true;
  }
  std::optional<Factory> find(const std::string& name) const {
    std::lock_guard lock(mu_);
    auto it = factories_.find(name);
    if (it == factories_.end()) return std::nullopt;
    return it->second;
  }
  std::vector<std::string> names() const {
    std::lock_guard lock(mu_);
    std::vector<std::string> out;
    for (const auto& [name, f] : factories_) out.push_back(name);
    return out;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, Factory> factories_;
};

}  // namespace troupe::actors

#define TROUPE_REGISTRY_CONCAT_INNER(a, b) a##b
#define TROUPE_REGISTRY_CONCAT(a, b) TROUPE_REGISTRY_CONCAT_INNER(a, b)
