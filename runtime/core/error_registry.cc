#include "troupe/runtime/core/error_registry.h"

#include <map>
#include <mutex>

namespace troupe::core {

namespace {

// The one registry of the process, a function-local static. Process-wide
// on purpose, like the TROUPE_ACTOR method table: TROUPE_ERROR fills it
// during static initialisation (of the program and of libraries loaded
// later, which is why registration still takes the lock), and after that
// it is only read. Nothing that runs after main starts writes to it.
struct Registry {
  std::mutex mu;
  std::map<std::type_index, std::string> names;
  std::map<std::string, ErrorMaker> makers;
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

bool register_error_type(std::type_index type, const std::string& name, ErrorMaker make) {
  auto& r = registry();
  std::lock_guard lock(r.mu);
  r.names.emplace(type, name);
  r.makers.emplace(name, std::move(make));
  return true;
}

std::string registered_error_name(const std::exception& e) {
  auto& r = registry();
  std::lock_guard lock(r.mu);
  auto it = r.names.find(std::type_index(typeid(e)));
  return it == r.names.end() ? std::string() : it->second;
}

std::exception_ptr make_registered_error(const std::string& name, const std::string& message) {
  ErrorMaker make;
  {
    auto& r = registry();
    std::lock_guard lock(r.mu);
    auto it = r.makers.find(name);
    if (it == r.makers.end()) return nullptr;
    make = it->second;
  }
  return make(message);
}

}  // namespace troupe::core
