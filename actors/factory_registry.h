// FactoryRegistry: the user's own data sets, models and train steps,
// registered by name from the user's binary (TROUPE_DATASET, TROUPE_MODEL,
// TROUPE_STEP) the way TROUPE_ACTOR registers actor methods. Workers run the
// driver's own executable, so a name registered at static initialisation in
// the driver is found by every trainer and loader it spawns; specs carry
// only the name and a config string across the wire.
#pragma once

#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/wire/error_kind.h"

namespace troupe::actors {

template <class Factory>
class FactoryRegistry {
 public:
  static FactoryRegistry& instance() {
    static FactoryRegistry registry;
    return registry;
  }
  // A name registered twice (two registrations in one binary, or in the
  // libraries it links) is kept, and refused when it is asked for (check):
  // which one ran would depend on the order of static initialisation.
  bool add(const std::string& name, Factory factory) {
    std::lock_guard lock(mu_);
    if (!factories_.emplace(name, std::move(factory)).second) duplicated_.insert(name);
    return true;
  }
  // ConfigError when `name` was registered twice, or registered although
  // it is a built-in name (`builtin`: the registration is never used).
  // `what` is "model", `macro` "TROUPE_MODEL".
  void check(const std::string& name, bool builtin, const char* what, const char* macro) const {
    std::lock_guard lock(mu_);
    if (duplicated_.count(name))
      throw ConfigError(std::string(what) + " '" + name + "' is registered twice (" + macro +
                        " with that name twice, in this binary or the libraries it links); rename one");
    if (builtin && factories_.count(name))
      throw ConfigError(std::string(what) + " '" + name + "' is a built-in name: the " + macro +
                        " of that name is never used; register yours under another name");
  }
  std::optional<Factory> find(const std::string& name) const {
    std::lock_guard lock(mu_);
    auto it = factories_.find(name);
    if (it == factories_.end()) return std::nullopt;
    return it->second;
  }
  // The registered names, after `builtins` (each once).
  std::vector<std::string> names(std::vector<std::string> builtins = {}) const {
    std::lock_guard lock(mu_);
    const std::set<std::string> known(builtins.begin(), builtins.end());
    for (const auto& [name, f] : factories_)
      if (!known.count(name)) builtins.push_back(name);
    return builtins;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, Factory> factories_;
  std::set<std::string> duplicated_;
};

// Runs a user's factory: what it throws that is not troupe's own is a
// ConfigError naming the thing it was to make ("model 'resmlp': ..."); it
// arrived as a bare std:: exception (a driver's catch of troupe::Error
// missed it) or as "std::invalid_argument: stod", naming nothing.
template <class Make>
auto run_factory(const std::string& what, Make&& make) -> decltype(make()) {
  try {
    return make();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw ConfigError(what + " could not be made: " + wire::type_name_of(e) + ": " + e.what());
  }
}

}  // namespace troupe::actors

#define TROUPE_REGISTRY_CONCAT_INNER(a, b) a##b
#define TROUPE_REGISTRY_CONCAT(a, b) TROUPE_REGISTRY_CONCAT_INNER(a, b)
