#include <cctype>
#include <map>
#include <mutex>

#include "troupe/runtime/client/actor.h"
#include "troupe/runtime/client/task.h"

namespace troupe::client {

namespace {
// Starts with the built-in task executor, so that every troupe binary
// serves tasks (a static registration elsewhere could be left out by the
// linker).
std::map<std::string, ActorFactory>& factories() {
  static std::map<std::string, ActorFactory> m{
      {kTaskExecutorKey, ActorFactory{kTaskExecutorClass, &make_task_executor}}};
  return m;
}
std::mutex& factories_mu() {
  static std::mutex mu;
  return mu;
}
}  // namespace

void register_factory(const std::string& key, ActorFactory f) {
  std::lock_guard lock(factories_mu());
  factories().emplace(key, std::move(f));
}

const ActorFactory* find_factory(const std::string& key) {
  std::lock_guard lock(factories_mu());
  auto it = factories().find(key);
  return it == factories().end() ? nullptr : &it->second;
}

std::vector<std::string> split_method_names(const char* list) {
  // TROUPE_ACTOR's list as written: "&Counter::add, &Counter::get", or an
  // overload picked with a cast, "static_cast<int (Ov::*)(int, int)>(&Ov::f)",
  // whose commas are inside brackets: only top-level commas split.
  std::vector<std::string> out;
  std::string cur;
  int depth = 0;
  auto flush = [&] {
    // The method's name: the identifier after the last "::" ("&Ov::f" in
    // a cast; "&Counter::add" -> "add").
    std::string n = cur;
    if (auto pos = n.rfind("::"); pos != std::string::npos) {
      size_t end = pos + 2;
      while (end < n.size() && (std::isalnum(static_cast<unsigned char>(n[end])) || n[end] == '_')) ++end;
      n = n.substr(pos + 2, end - pos - 2);
    }
    n.erase(0, n.find_first_not_of(" &\t\n"));
    n.erase(n.find_last_not_of(" \t\n") + 1);
    if (!n.empty()) out.push_back(n);
    cur.clear();
  };
  for (const char* p = list; *p; ++p) {
    if (*p == '(' || *p == '<' || *p == '[') ++depth;
    if ((*p == ')' || *p == '>' || *p == ']') && depth > 0) --depth;
    if (*p == ',' && depth == 0)
      flush();
    else
      cur += *p;
  }
  flush();
  return out;
}

}  // namespace troupe::client
