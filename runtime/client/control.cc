#include "troupe/runtime/client/control.h"

namespace troupe::client {

void ControlTable::set(const std::string& tag, Handler handler) {
  std::lock_guard lock(mu_);
  handlers_[tag] = std::move(handler);
}

ControlTable::Handler ControlTable::find(const std::string& tag) const {
  std::lock_guard lock(mu_);
  auto it = handlers_.find(tag);
  if (it == handlers_.end()) throw ConfigError("no control handler for '" + tag + "' in this worker");
  return it->second;
}

}  // namespace troupe::client
