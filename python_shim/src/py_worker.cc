#include "python_shim/src/py_worker.h"

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <set>
#include <thread>

#include "python_shim/src/py_client.h"
#include "python_shim/src/py_convert.h"
#include "troupe/runtime/client/task.h"
#include "troupe/runtime/client/task_cancel.h"
#include "troupe/runtime/core/logging.h"

namespace troupe::py {

namespace {

// The hooks module; set once before the worker loop starts, never freed
// (the process ends with _Exit).
pyb::object* g_hooks = nullptr;

std::shared_ptr<client::Core> worker_core() { return this_actor::runtime().core(); }

pyb::object hook(const char* name) {
  if (!g_hooks) throw ConfigError("Python calls reached a process that is not a troupe Python worker");
  return g_hooks->attr(name);
}

// Fetches the top-level refs from their owners (GIL not held), so that the
// function sees values.
void resolve_top(PyCall& call) {
  for (auto& arg : call.top) {
    if (arg.inline_value) continue;
    if (!arg.ref.valid()) throw DecodeError("a top-level argument ref is empty");
    auto st = fetch_stored(*worker_core(), arg.ref);
    st->wait();
    if (auto e = st->error()) std::rethrow_exception(e);
    arg.value = st->value().value;
    arg.inline_value = 1;
  }
}

pyb::tuple call_args(const PyCall& call) {
  auto core = worker_core();
  pyb::list top;
  for (const auto& arg : call.top) top.append(value_to_python(arg.value, core));
  return pyb::make_tuple(value_to_python(call.args, core), top);
}

// A streaming call's (address, stream id, values to skip), else None.
pyb::object stream_of(const PyCall& call) {
  if (call.stream_address.empty()) return pyb::none();
  return pyb::make_tuple(call.stream_address, call.stream_id, call.stream_skip);
}

// Writes a hook's reply: as the answer, or (a call_ref) kept here.
void write_reply(PyReply reply, wire::Encoder& result, const client::ObjectSink* keep) {
  if (!keep) return wire::encode(result, reply);
  if (reply.error) return wire::encode(result, reply);
  (*keep)(client::make_object_value(std::move(reply.value)), result);
}

PyCall decode_call(wire::Decoder& args, const char* what) {
  PyCall call = wire::decode<PyCall>(args);
  if (!args.done()) throw DecodeError(std::string("trailing bytes after the arguments of a Python ") + what);
  resolve_top(call);
  return call;
}

// Interrupts handed to a thread of their own (interrupt_task) and not done
// yet, each by its ticket. troupe.cancel returns once a running call is
// marked, before its async method's coroutine is cancelled on that thread:
// a call that came after it could run first (a queue's cancelled get took
// the item that the next put added). A method call waits for the
// interrupts begun before it (up to kInterruptWait: the interrupt needs
// the GIL, which a long plain method may hold). An interrupt is done once
// its coroutine is cancelled or its exception raised, before a recursive
// cancel's children are cancelled (which calls back into the cluster), and
// each is tracked by itself: one begun later, or ending sooner, lets no
// call through early.
class InterruptFence {
 public:
  uint64_t begin() {
    std::lock_guard lock(mu_);
    open_.insert(++next_);
    return next_;
  }
  void end(uint64_t ticket) {
    {
      std::lock_guard lock(mu_);
      if (open_.erase(ticket) == 0) return;  // ended already
    }
    cv_.notify_all();
  }
  void wait_for_earlier() {
    std::unique_lock lock(mu_);
    const uint64_t upto = next_;
    cv_.wait_for(lock, kWait, [&] { return open_.empty() || *open_.begin() > upto; });
  }

 private:
  static constexpr std::chrono::seconds kWait{1};
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_ = 0;
  std::set<uint64_t> open_;
};

InterruptFence& interrupt_fence() {
  static auto* fence = new InterruptFence;  // never destroyed: detached threads use it
  return *fence;
}

void wait_for_earlier_interrupts() { interrupt_fence().wait_for_earlier(); }

class PyHostedActor final : public client::HostedActor {
 public:
  explicit PyHostedActor(pyb::object instance) : instance_(std::move(instance)) {}
  ~PyHostedActor() override {
    pyb::gil_scoped_acquire gil;
    instance_ = pyb::object();
  }

  void invoke(uint32_t index, wire::Decoder& args, wire::Encoder& result, const client::ObjectSink* keep) override {
    if (index != 0) throw Error("a Python actor has one entry point, not #" + std::to_string(index));
    PyCall call = decode_call(args, "method call");
    t_method = {client::current_task_token(), call.target};
    wait_for_earlier_interrupts();
    PyReply reply;
    {
      pyb::gil_scoped_acquire gil;
      pyb::tuple a = call_args(call);
      // The call's token (its call id), by which troupe.cancel finds an
      // async method's coroutine.
      reply = reply_from_python(
          hook("call_method")(instance_, call.target, a[0], a[1], client::current_task_token(), stream_of(call)));
    }
    write_reply(std::move(reply), result, keep);
  }
  size_t method_count() const override { return 1; }
  // The method this thread runs now, by its call's token (an error about
  // its result names it); "call" outside it (a call cancelled before it
  // started was named after the one before).
  std::string method_name(uint32_t) const override {
    const uint64_t now = client::current_task_token();
    return now != 0 && t_method.first == now ? t_method.second : "call";
  }

 private:
  static inline thread_local std::pair<uint64_t, std::string> t_method;
  pyb::object instance_;
};

std::unique_ptr<client::HostedActor> make_py_actor(wire::Decoder& d) {
  PyActorSpec spec = wire::decode<PyActorSpec>(d);
  if (!d.done()) throw DecodeError("trailing bytes after a Python actor's constructor arguments");
  resolve_top(spec.ctor);
  pyb::gil_scoped_acquire gil;
  pyb::tuple a = call_args(spec.ctor);
  pyb::object blob = buffer_to_python(spec.class_blob);
  try {
    return std::make_unique<PyHostedActor>(hook("make_actor")(blob, a[0], a[1]));
  } catch (pyb::error_already_set& e) {
    // The constructor's own error first ("ValueError: ..."), then its
    // Python traceback: the actor's death cause, without pybind11's
    // wrapper text around them.
    std::string text;
    try {
      text = pyb::str(e.type().attr("__name__")).cast<std::string>() + ": " + pyb::str(e.value()).cast<std::string>();
      pyb::list lines = pyb::module_::import("traceback").attr("format_exception")(e.type(), e.value(), e.trace());
      text += "\n";
      for (const auto& line : lines) text += pyb::str(line).cast<std::string>();
    } catch (const std::exception&) {
      text = e.what();
    }
    while (!text.empty() && text.back() == '\n') text.pop_back();
    throw Error(text);
  }
}

void invoke_py_task(wire::Decoder& args, wire::Encoder& result, const client::ObjectSink* keep) {
  // (A task cancelled before it started never gets here: the task
  // executor skips it, task_cancel.h.)
  PyCall call = decode_call(args, "task");
  PyReply reply;
  {
    pyb::gil_scoped_acquire gil;
    pyb::tuple a = call_args(call);
    reply = reply_from_python(hook("run_task")(call.target, a[0], a[1], call.task, stream_of(call)));
  }
  write_reply(std::move(reply), result, keep);
}

// troupe.cancel's interrupt: served from the worker's start (a task may be
// cancelled before this executor ran any). A task or call not started yet
// is marked here, on the I/O thread before the reply, so that it never
// starts however long the interrupt thread below would wait for the GIL;
// a running task gets KeyboardInterrupt from the hook, a running async
// method's coroutine is cancelled (a plain method runs on), on a thread of
// its own, not on the I/O thread, which a task holding the GIL (inside a C
// extension) would otherwise stall. Replies what was known of it
// (client::TaskState).
int32_t interrupt_task(const PyInterruptTask& m) {
  const client::TaskState state = client::mark_task_cancelled(m.task);
  if (state != client::kTaskRunning) return state;
  auto& fence = interrupt_fence();
  const uint64_t ticket = fence.begin();
  std::thread([task = m.task, recursive = m.recursive, &fence, ticket] {
    {
      pyb::gil_scoped_acquire gil;
      try {
        // Called by the hook once the interrupt is made, before the
        // children of a recursive cancel are cancelled.
        pyb::cpp_function interrupted([&fence, ticket] { fence.end(ticket); });
        hook("interrupt_task")(task, recursive, interrupted);
      } catch (const std::exception& e) {
        TROUPE_LOG_WARN("interrupting task {}: {}", task, e.what());
      }
    }
    fence.end(ticket);
  }).detach();
  return state;
}

const bool registered = [] {
  client::register_factory(kPyActorKey, client::ActorFactory{"PythonActor", &make_py_actor});
  client::register_task(kPyTaskName, client::task_function_key(&invoke_py_task), &invoke_py_task);
  client::register_process_control(PyInterruptTask::kControlTag,
                                   client::typed_control_handler<PyInterruptTask>(&interrupt_task));
  return true;
}();

}  // namespace

void serve_worker(pyb::object hooks) {
  (void)registered;
  g_hooks = new pyb::object(std::move(hooks));
  pyb::gil_scoped_release nogil;
  run_role_if_requested();
}

}  // namespace troupe::py
