#include <map>
#include <mutex>
#include <unordered_map>

#include "troupe/runtime/client/task.h"
#include "troupe/runtime/client/task_cancel.h"

namespace troupe::client {

namespace {

// Name -> entry, and function -> entry. Written only during static
// initialisation (under the mutex, since translation units may initialise
// from several threads in principle), read afterwards.
struct TaskTable {
  std::mutex mu;
  std::map<std::string, TaskEntry> by_name;
  std::map<std::string, TaskFunctionKey> function_of;
  std::map<std::string, bool> ambiguous;
  std::unordered_map<TaskFunctionKey, const TaskEntry*> by_function;
};

TaskTable& table() {
  static TaskTable t;
  return t;
}

void throw_if_ambiguous(TaskTable& t, const std::string& name) {
  if (t.ambiguous.count(name))
    throw ConfigError("task name '" + name + "' is registered by two different functions (TROUPE_TASK)");
}

thread_local std::string t_last_task;

// Runs tasks by name, one call at a time (the worker serves it as an actor
// with max_concurrency 1).
class TaskExecutor final : public HostedActor {
 public:
  void invoke(uint32_t index, wire::Decoder& args, wire::Encoder& result, const ObjectSink* keep) override {
    if (index != 0) throw Error("task executor has one method, not #" + std::to_string(index));
    std::string name = wire::decode<std::string>(args);
    // The submitter's token for the task (task_cancel.h); 0: not cancellable.
    const auto token = wire::decode<uint64_t>(args);
    const TaskEntry& entry = task_named(name);
    t_last_task = name;
    if (!begin_task(token)) throw TaskCancelled("task '" + name + "' was cancelled before it started");
    struct End {
      uint64_t token;
      ~End() { end_task(token); }
    } end{token};
    entry.invoke(args, result, keep);
  }
  size_t method_count() const override { return 1; }
  std::string method_name(uint32_t) const override { return "run"; }
};

}  // namespace

const std::string& last_task_run() { return t_last_task; }

bool register_task(const std::string& name, TaskFunctionKey fn, TaskInvoker invoke) {
  TaskTable& t = table();
  std::lock_guard lock(t.mu);
  auto known = t.function_of.find(name);
  if (known != t.function_of.end()) {
    if (known->second != fn) t.ambiguous[name] = true;
    return true;
  }
  t.function_of[name] = fn;
  auto [it, inserted] = t.by_name.emplace(name, TaskEntry{name, invoke});
  t.by_function[fn] = &it->second;
  return true;
}

const TaskEntry& task_for_function(TaskFunctionKey fn) {
  TaskTable& t = table();
  std::lock_guard lock(t.mu);
  auto it = t.by_function.find(fn);
  if (it == t.by_function.end())
    throw ConfigError("this function is not a task: register it with TROUPE_TASK(name) at namespace scope");
  throw_if_ambiguous(t, it->second->name);
  return *it->second;
}

const TaskEntry& task_named(const std::string& name) {
  TaskTable& t = table();
  std::lock_guard lock(t.mu);
  auto it = t.by_name.find(name);
  if (it == t.by_name.end())
    throw ConfigError("this executable has no task '" + name +
                      "' (TROUPE_TASK); is the worker executable the driver's binary?");
  throw_if_ambiguous(t, name);
  return it->second;
}

std::unique_ptr<HostedActor> make_task_executor(wire::Decoder& args) {
  if (!args.done()) throw DecodeError("the task executor takes no constructor arguments");
  return std::make_unique<TaskExecutor>();
}

}  // namespace troupe::client
