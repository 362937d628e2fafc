// Declaring tasks: stateless functions that rt.submit runs on pooled
// workers. TROUPE_TASK(fn) registers `fn` under its name with an invoker
// that decodes the arguments, calls it and encodes the result; the driver
// finds the name from the function pointer, the worker the invoker from the
// name. Like the TROUPE_ACTOR tables, the registry is filled during static
// initialisation and only read afterwards, so every binary built from the
// same sources (the driver's own, by default) runs the same tasks.
//
// The worker side is a built-in hidden actor, the task executor, whose one
// method runs a task by name; every troupe binary serves it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>

#include "troupe/runtime/client/actor.h"
#include "troupe/runtime/wire/codec.h"

namespace troupe::client {

// Runs a task: decodes its arguments from `args`, encodes its result (or,
// with `keep`, a submit_ref, hands the result to `keep`, which stores it and
// writes a reference to it).
using TaskInvoker = void (*)(wire::Decoder& args, wire::Encoder& result, const ObjectSink* keep);
// The function pointer a task was registered with, as a lookup key.
using TaskFunctionKey = uintptr_t;

struct TaskEntry {
  std::string name;
  TaskInvoker invoke = nullptr;
};

// Adds `name` -> (fn, invoke). Registering one function twice is harmless;
// two functions under one name make that name unusable (ConfigError when
// submitted or run), since a worker could not tell which one is meant.
bool register_task(const std::string& name, TaskFunctionKey fn, TaskInvoker invoke);
// The task registered for `fn`; ConfigError when TROUPE_TASK did not name it.
const TaskEntry& task_for_function(TaskFunctionKey fn);
// The task registered as `name`; ConfigError naming it when there is none.
const TaskEntry& task_named(const std::string& name);

// With kBounced in a task executor's reply (Message::op): the task was
// handed back because its submitter asked (HandBackQueued), not because the
// task before it waits.
inline constexpr uint32_t kHandedBack = 1u << 28;

// Control message from a submitter to one of its task executors: answer the
// tasks in the mailbox that have not started with kBounced | kHandedBack
// (each with its own body), so that an idle executor runs them rather than
// they wait behind a long task. Replies how many went back.
struct HandBackQueued {
  static constexpr const char* kControlTag = "troupe.task.hand_back";
  using Reply = int32_t;
  TROUPE_FIELDS()
};

// The task this thread last ran in a task executor: what the worker names
// a result too large to send.
const std::string& last_task_run();

// Registry key and class name of the built-in task-executor actor.
inline constexpr const char* kTaskExecutorKey = "troupe.TaskExecutor";
inline constexpr const char* kTaskExecutorClass = "TaskExecutor";
// Its constructor (no arguments): reads a task name, then runs that task
// with the rest of the call's arguments.
std::unique_ptr<HostedActor> make_task_executor(wire::Decoder& args);

template <class F>
struct TaskTraits;
template <class R, class... A>
struct TaskTraits<R (*)(A...)> {
  using Result = std::decay_t<R>;
  using Args = std::tuple<std::decay_t<A>...>;
  static constexpr size_t kArity = sizeof...(A);
};
template <class R, class... A>
struct TaskTraits<R (*)(A...) noexcept> : TaskTraits<R (*)(A...)> {};

template <auto F>
void invoke_task(wire::Decoder& d, wire::Encoder& e, const ObjectSink* keep) {
  using TT = TaskTraits<decltype(F)>;
  auto args = wire::decode<typename TT::Args>(d);
  if (!d.done()) throw DecodeError("trailing bytes after the arguments of a task");
  if constexpr (std::is_void_v<typename TT::Result>) {
    if (keep) throw ConfigError("submit_ref of a task that returns nothing");
    std::apply([](auto&&... a) { F(std::move(a)...); }, std::move(args));
  } else {
    auto r = std::apply([](auto&&... a) { return F(std::move(a)...); }, std::move(args));
    if (keep) {
      (*keep)(make_object_value(std::move(r)), e);
    } else {
      wire::encode(e, r);
    }
  }
}

template <class F>
TaskFunctionKey task_function_key(F fn) {
  return reinterpret_cast<TaskFunctionKey>(fn);
}

template <auto F>
bool register_task_function(const char* name) {
  return register_task(name, task_function_key(F), &invoke_task<F>);
}

}  // namespace troupe::client

// Registers the free function `fn` as a task under the name written (use
// the same spelling everywhere, e.g. `TROUPE_TASK(prep::resize)`). Use at
// namespace scope in code linked into both the driver and the workers.
#define TROUPE_TASK(fn)                                                   \
  static const bool TROUPE_CONCAT(troupe_task_registered_, __COUNTER__) = \
      ::troupe::client::register_task_function<&fn>(#fn);
