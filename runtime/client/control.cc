#include "troupe/runtime/client/control.h"

namespace troupe::client {

void ControlTable::set(const std::string& tag, Handler handler) {
  std::lock_guard lock(mu_);
  handlers_[tag] = std::move(handler);
}

namespace {

// Filled during static initialisation, read-only afterwards.
std::map<std::string, ControlTable::Handler>& process_controls() {
  static std::map<std::string, ControlTable::Handler> table;
  return table;
}

}  // namespace

bool register_process_control(const std::string& tag, ControlTable::Handler handler) {
  process_controls()[tag] = std::move(handler);
  return true;
}

ControlTable::Handler ControlTable::find(const std::string& tag) const {
  {
    std::lock_guard lock(mu_);
    auto it = handlers_.find(tag);
    if (it != handlers_.end()) return it->second;
  }
  const auto& process = process_controls();
  auto it = process.find(tag);
  if (it == process.end()) throw ConfigError("no control handler for '" + tag + "' in this worker");
  return it->second;
}

}  // namespace troupe::client
