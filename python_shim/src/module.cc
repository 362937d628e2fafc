// troupe._core: the pybind11 extension under the Python API. It exposes the
// C++ client core (PyClient: connect or embed, spawn, call, submit, put,
// get, wait, kill, status) and the worker entry point; every operation that
// blocks or moves bytes runs with the GIL released. The Ray-shaped API is
// plain Python on top (troupe/__init__.py).
#include <fmt/format.h>
#include <pybind11/eval.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_set>

#include "python_shim/src/py_client.h"
#include "python_shim/src/py_collective.h"
#include "python_shim/src/py_convert.h"
#include "python_shim/src/py_stream.h"
#include "python_shim/src/py_worker.h"
#include "troupe/runtime/client/task_cancel.h"
#include "troupe/runtime/core/session.h"
#include "troupe/runtime/core/utf8.h"
#include "troupe/runtime/core/worker_env.h"
#include "troupe/runtime/head/resource_pool.h"
#include "troupe/runtime/wire/local_host.h"
#include "troupe/runtime/worker/reply_watch.h"

namespace pyb = pybind11;
using namespace troupe;
using namespace troupe::py;

namespace {

// troupe.exceptions' classes by C++ error name; set once by the package.
pyb::dict* g_errors = nullptr;

void raise_as(const char* name, const std::exception& e) {
  if (g_errors && g_errors->contains(name)) {
    PyErr_SetString((*g_errors)[name].ptr(), e.what());
  } else {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
}

void translate(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const WorkerDied& e) {
    raise_as("WorkerDied", e);
  } catch (const ActorDied& e) {
    raise_as("ActorDied", e);
  } catch (const Timeout& e) {
    raise_as("Timeout", e);
  } catch (const ObjectLost& e) {
    raise_as("ObjectLost", e);
  } catch (const ConfigError& e) {
    raise_as("ConfigError", e);
  } catch (const ConnectionError& e) {
    raise_as("ConnectionError", e);
  } catch (const TaskCancelled& e) {
    raise_as("TaskCancelled", e);
  } catch (const StreamError& e) {
    raise_as("StreamError", e);
  } catch (const RemoteError& e) {
    raise_as("RemoteError", e);
  } catch (const ObjectStoreFull& e) {
    raise_as("ObjectStoreFull", e);
  } catch (const Aborted& e) {
    raise_as("Aborted", e);
  } catch (const Error& e) {
    raise_as("Error", e);
  }
}

PyOptions options_from(const pyb::dict& d) {
  PyOptions o;
  if (d.contains("resources")) o.resources = d["resources"].cast<Resources>();
  if (d.contains("name") && !d["name"].is_none()) o.name = d["name"].cast<std::string>();
  if (d.contains("max_restarts")) o.max_restarts = d["max_restarts"].cast<int>();
  if (d.contains("max_task_retries")) o.max_task_retries = d["max_task_retries"].cast<int>();
  if (d.contains("max_retries")) o.max_retries = d["max_retries"].cast<int>();
  if (d.contains("max_concurrency")) o.max_concurrency = d["max_concurrency"].cast<int>();
  if (d.contains("concurrency_groups"))
    for (const auto& [name, cap] : d["concurrency_groups"].cast<std::vector<std::pair<std::string, int>>>())
      o.concurrency_groups.push_back(wire::ConcurrencyGroup{name, cap, {}});
  if (d.contains("executable")) o.executable = d["executable"].cast<std::string>();
  if (d.contains("env")) o.env = d["env"].cast<std::vector<std::string>>();
  if (d.contains("placement_group")) o.placement_group = d["placement_group"].cast<uint64_t>();
  if (d.contains("bundle_index")) o.bundle_index = d["bundle_index"].cast<int>();
  if (d.contains("detached")) o.detached = d["detached"].cast<bool>();
  if (d.contains("node_affinity")) o.node_affinity = d["node_affinity"].cast<uint64_t>();
  if (d.contains("affinity_soft")) o.affinity_soft = d["affinity_soft"].cast<bool>();
  if (d.contains("max_calls")) o.max_calls = d["max_calls"].cast<int>();
  return o;
}

PyCall call_from(std::string target, const pyb::handle& args) {
  PyCall c;
  c.target = std::move(target);
  c.args = value_from_python(args);
  return c;
}

// The interpreter's main thread (PyThread_get_thread_ident), set on import.
unsigned long g_main_thread = 0;

// Called without the GIL between slices of a wait: runs Python's signal
// handlers, so that Ctrl-C in a driver blocked in get or wait raises
// KeyboardInterrupt there instead of waiting on. Only the main thread runs
// them, so only it takes the GIL here: another thread (a daemon one still
// waiting while the interpreter exits) must not, or finalization ends it
// inside C++ frames.
void check_signals() {
  if (PyThread_get_thread_ident() != g_main_thread) return;
  pyb::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) throw pyb::error_already_set();
}

// Called without the GIL between slices of a wait, on a task's thread: the
// KeyboardInterrupt troupe.cancel raises in a running task (at its next
// Python instruction, troupe._worker_hooks.interrupt_task) is raised now,
// as Ray's get does, not once what the task waits for is there (a parent
// waiting on its child waited out the child). One instruction runs when
// the runtime says this thread's task or call was cancelled; an actor
// method's, which runs on as in Ray, has no interrupt pending.
bool interpreter_finalizing();

void check_cancelled() {
  const auto cancelled = client::current_task_cancelled();
  if (!cancelled || !*cancelled || interpreter_finalizing()) return;
  pyb::gil_scoped_acquire gil;
  pyb::eval("None");  // throws error_already_set with the pending KeyboardInterrupt
}

// Runs `wait_slice(ms)` (true once done) in slices until it is done or
// `timeout` seconds pass (None = no limit), checking signals between
// slices. Called without the GIL; false at the timeout. A wait that blocks
// inside a task lends the task's CPU back meanwhile (core::BlockedScope).
// A cancelled task's interrupt is raised before what it waited for is
// handed back: a recursive cancel fails the task's children as it
// interrupts it, and the parent sees the KeyboardInterrupt, not its
// child's TaskCancelledError followed by the interrupt inside its handler.
template <class WaitSlice>
bool wait_interruptibly(WaitSlice wait_slice, const std::optional<double>& timeout) {
  using namespace std::chrono;
  constexpr milliseconds kSlice{100};
  if (wait_slice(milliseconds{0})) {
    check_cancelled();
    return true;
  }
  if (timeout && *timeout <= 0) return false;
  core::BlockedScope blocked;
  const auto deadline = steady_clock::now() + duration_cast<milliseconds>(duration<double>(timeout.value_or(0)));
  for (;;) {
    milliseconds slice = kSlice;
    if (timeout)
      slice = std::clamp(duration_cast<milliseconds>(deadline - steady_clock::now()), milliseconds{0}, kSlice);
    if (wait_slice(slice)) {
      check_cancelled();
      return true;
    }
    if (timeout && steady_clock::now() >= deadline) return false;
    check_signals();
    check_cancelled();
  }
}

// Whether a state is there and holds an error (a runtime one, or a Python
// exception answer).
bool failed_now(ReplyState& st) {
  return st.wait_for(std::chrono::milliseconds(0)) && (st.error() || st.value().error);
}

// The tokens of refs whose answers are there, for troupe._Awaiter. Never
// destroyed: an answer may come while the process exits.
struct ReadyTokens {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<uint64_t> tokens;
  bool stopping = false;  // the interpreter exits: no wait blocks
};

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// The GIL let go for a wait, as pybind11's gil_scoped_release, except at
// the end: a (daemon) thread that would take it back while the interpreter
// finalizes is ended by Python inside these C++ frames, which aborts the
// process (std::terminate); such a thread waits for the process's end.
class GilReleased {
 public:
  GilReleased() : saved_(PyEval_SaveThread()) {}
  ~GilReleased() {
    // (The main thread finalizes, and takes it back as usual.)
    while (interpreter_finalizing() && PyThread_get_thread_ident() != g_main_thread)
      std::this_thread::sleep_for(std::chrono::seconds(3600));
    PyEval_RestoreThread(saved_);
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* saved_;
};
ReadyTokens& ready_tokens() {
  static auto* q = new ReadyTokens;
  return *q;
}

// A get that has waited a while for an actor no node can ever hold says
// so on the driver's stderr, once per actor, as Ray warns of an
// infeasible request: the head's warning went to its log only, and a
// mistyped resource left a driver blocked without a word. After
// TROUPE_UNPLACEABLE_WARN_MS (default 10 s) of one get, then every 5 s,
// for the first value not there. Through sys.stderr on the main thread;
// elsewhere to fd 2, without the GIL (a daemon thread taking it while the
// interpreter finalizes is ended in C++ frames).
void warn_if_unplaceable(PyRef& ref) {
  std::string text;
  try {
    text = ref.pending_text();
  } catch (const std::exception&) {
    return;  // a diagnostic only
  }
  const size_t pending = text.find(": the actor is PENDING (");
  if (pending == std::string::npos || text.find("at all (no node has that much in total)") == std::string::npos) return;
  static std::mutex mu;
  static std::set<std::string> said;  // "Class.method on actor N"
  // Of one cluster connection: another init's actor N is another actor (a
  // weak_ptr keeps its control block, so a new core never compares equal).
  static std::weak_ptr<client::Core> said_for;
  {
    std::lock_guard lock(mu);
    const auto& core = ref.core();
    if (said_for.owner_before(core) || core.owner_before(said_for)) {
      said.clear();
      said_for = core;
    }
    const std::string what = text.substr(0, pending);
    const size_t on = what.rfind(" on actor ");
    if (!said.insert(what.substr(on == std::string::npos ? 0 : on)).second) return;
  }
  const std::string line =
      "troupe: (warning) a get waits for " + text + "; it waits until a node that can hold the actor joins\n";
  // On the main thread, through sys.stderr (a notebook shows it there);
  // elsewhere to fd 2, without the GIL.
  if (PyThread_get_thread_ident() == g_main_thread && !interpreter_finalizing()) {
    pyb::gil_scoped_acquire gil;
    // A Ctrl-C pending now is raised, not swallowed by the write (which
    // clears what sys.stderr.write raises).
    if (PyErr_CheckSignals() != 0) throw pyb::error_already_set();
    PySys_FormatStderr("%s", line.c_str());
    return;
  }
  for (size_t n = 0; n < line.size();) {
    const ssize_t w = ::write(2, line.data() + n, line.size() - n);
    if (w <= 0 && errno != EINTR) break;
    if (w > 0) n += size_t(w);
  }
}

// Read with the GIL held (a Python thread may be changing os.environ).
std::chrono::milliseconds unplaceable_warn_after() {
  const std::string v = core::env_value("TROUPE_UNPLACEABLE_WARN_MS");
  char* end = nullptr;
  const long long ms = v.empty() ? -1 : std::strtoll(v.c_str(), &end, 10);
  return std::chrono::milliseconds(ms >= 0 && end && *end == '\0' ? ms : 10000);
}

// The states of `refs`, waited for with the GIL released: all of them,
// until one of them holds an error (as Ray's get raises as soon as one
// value is an error), or Timeout after `timeout` seconds (None = no limit).
std::vector<std::shared_ptr<ReplyState>> wait_all(const RefList& refs, const std::optional<double>& timeout,
                                                  std::chrono::milliseconds warn_after) {
  std::vector<std::shared_ptr<ReplyState>> states;
  states.reserve(refs.size());
  for (const auto& r : refs) states.push_back(r->answer());
  size_t next = 0;  // the first state not known to be ready
  auto warn_at = std::chrono::steady_clock::now() + warn_after;
  auto done = [&](std::chrono::milliseconds slice) {
    for (; next < states.size(); ++next) {
      if (!states[next]->wait_for(slice)) {
        if (slice.count() > 0 && std::chrono::steady_clock::now() >= warn_at) {
          warn_at = std::chrono::steady_clock::now() + std::chrono::seconds(5);
          warn_if_unplaceable(*refs[next]);
        }
        // Still waiting for this one: an error among those after it ends
        // the wait (looked for once a slice, so a long list costs one pass
        // per 100 ms, not one per ref).
        for (size_t i = next + 1; i < states.size(); ++i)
          if (failed_now(*states[i])) return true;
        return false;
      }
      if (failed_now(*states[next])) return true;
    }
    return true;
  };
  if (!wait_interruptibly(done, timeout)) {
    size_t missing = 0;
    std::string first;  // what the first missing one waits for
    for (size_t i = 0; i < states.size(); ++i) {
      if (states[i]->wait_for(std::chrono::milliseconds(0))) continue;
      if (missing++ != 0) continue;
      try {
        first = refs[i]->pending_text();
      } catch (const std::exception&) {
        // A diagnostic never changes which error the get raises (the
        // runtime may be shutting down under it).
      }
    }
    if (!first.empty()) first = (states.size() == 1 ? ": " : "; the first: ") + first;
    throw Timeout(states.size() == 1 ? fmt::format("get: no result within {:g} s{}", *timeout, first)
                                     : fmt::format("get: {} of {} results not there within {:g} s{}", missing,
                                                   states.size(), *timeout, first));
  }
  return states;
}

// `lend_for`: a task executor's CpuLender (wait_observer() on the task's
// thread), for an async task's await, which waits on a thread of its own
// and lends the task's CPU as a get on the task's thread would; 0 = this
// thread's own observer, if any. A value not there (an error ended the
// wait first) is None; a runtime error is raised here, in list order.
pyb::list get_many(PyClient& client, const RefList& refs, const std::optional<double>& timeout, uintptr_t lend_for) {
  std::vector<std::shared_ptr<ReplyState>> states;
  const auto warn_after = unplaceable_warn_after();
  {
    GilReleased nogil;
    core::WaitObserverInstall install(lend_for ? reinterpret_cast<core::WaitObserver*>(lend_for)
                                               : core::tls_wait_observer.observer);
    states = wait_all(refs, timeout, warn_after);
  }
  pyb::list out;
  for (const auto& st : states) {
    if (!st->wait_for(std::chrono::milliseconds(0))) {
      out.append(pyb::none());
      continue;
    }
    if (auto e = st->error()) std::rethrow_exception(e);
    out.append(reply_to_python(st->value(), client.core()));
  }
  return out;
}

// The first `num_returns` of `refs` then `streams` (indices into the two
// lists as one) that are ready, in that order, or those ready at the
// timeout. A stream is ready when its next() would not wait.
std::vector<size_t> wait_some(const RefList& refs, const std::vector<std::shared_ptr<PyStream>>& streams,
                              size_t num_returns, const std::optional<double>& timeout) {
  std::vector<std::shared_ptr<ReplyState>> states;
  for (const auto& r : refs) states.push_back(r->answer());
  auto is_ready = [&](size_t i) {
    if (i < states.size()) return states[i]->ready();
    const auto& s = streams[i - states.size()];
    return !s || s->ready();  // none (None from Python): nothing to wait for
  };
  const size_t total = states.size() + streams.size();
  auto count_ready = [&] {
    size_t n = 0;
    for (size_t i = 0; i < total; ++i) n += is_ready(i);
    return n;
  };
  // A poll (timeout 0) registers nothing.
  if (count_ready() < num_returns && !(timeout && *timeout <= 0)) {
    for (const auto& r : refs) r->signal_when_ready();
    for (const auto& s : streams)
      if (s) s->signal_when_ready();
    auto& signal = ready_signal();
    auto enough = [&](std::chrono::milliseconds slice) {
      uint64_t seen = 0;
      {
        std::lock_guard lock(signal.mu);
        seen = signal.epoch;
      }
      if (count_ready() >= num_returns) return true;
      std::unique_lock lock(signal.mu);
      signal.cv.wait_for(lock, slice, [&] { return signal.epoch != seen; });
      return false;  // counted again by the next slice
    };
    wait_interruptibly(enough, timeout);
  }
  std::vector<size_t> ready;
  for (size_t i = 0; i < total && ready.size() < num_returns; ++i)
    if (is_ready(i)) ready.push_back(i);
  return ready;
}

// troupe.wait for a list of plain refs (ObjectRef and ItemRef, whose holder
// is its call's ref), with a pass of C++ each way instead of Python's: a
// loop over wait() on thousands of refs, as Ray programs write to take
// results as they come, cost hundreds of microseconds a call in Python's
// checks and conversions. (ready, not_ready) in the order given; None when
// the list holds anything else (an ObjectRefGenerator, or what troupe.wait
// refuses), which the Python path handles.
std::optional<std::pair<pyb::list, pyb::list>> wait_refs(const pyb::list& refs, size_t num_returns,
                                                         const std::optional<double>& timeout) {
  RefList plain;
  plain.reserve(refs.size());
  std::unordered_set<PyObject*> seen;
  seen.reserve(refs.size());
  static auto* const ref_type = reinterpret_cast<PyTypeObject*>(pyb::type::of<PyRef>().ptr());
  for (const auto& item : refs) {
    if (!PyObject_TypeCheck(item.ptr(), ref_type)) return std::nullopt;
    if (!seen.insert(item.ptr()).second) throw pyb::value_error("troupe.wait: the list holds the same ref twice");
    plain.push_back(item.cast<std::shared_ptr<PyRef>>());
  }
  std::vector<size_t> ready;
  {
    GilReleased nogil;
    ready = wait_some(plain, {}, num_returns, timeout);
  }
  pyb::list yes, no;
  size_t k = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    if (k < ready.size() && ready[k] == i) {
      yes.append(refs[i]);
      ++k;
    } else {
      no.append(refs[i]);
    }
  }
  return std::make_pair(std::move(yes), std::move(no));
}

pyb::dict node_to_python(const wire::NodeInfo& n) {
  pyb::dict d;
  d["NodeID"] = std::to_string(n.id);
  d["Alive"] = n.alive;
  d["NodeManagerHostname"] = n.hostname;
  d["NodeManagerAddress"] = n.address;
  d["Resources"] = n.total;
  d["AvailableResources"] = n.available;
  d["GPUIds"] = n.gpu_ids;
  d["IdleWorkers"] = n.idle_workers;  // troupe's: warm pooled workers, as of the node's last report
  return d;
}

pyb::dict actor_to_python(const wire::ActorInfo& i) {
  pyb::dict d;
  d["id"] = i.id;
  // Text a C++ program chose may not be UTF-8: shown with U+FFFD, not a
  // UnicodeDecodeError.
  d["class_name"] = core::to_valid_utf8(i.class_name);
  d["name"] = core::to_valid_utf8(i.name);
  d["state"] = wire::to_string(i.state);
  d["node_id"] = i.node_id;
  d["pid"] = i.pid;
  d["restarts"] = i.restarts;
  d["death_cause"] = core::to_valid_utf8(i.death_cause);
  d["max_restarts"] = i.max_restarts;
  d["max_task_retries"] = i.max_task_retries;
  return d;
}

void bind_values(pyb::module_& m) {
  pyb::class_<Buffer>(m, "Bytes", pyb::buffer_protocol()).def_buffer([](Buffer& b) {
    return pyb::buffer_info(const_cast<std::byte*>(b.data()), 1, "B", 1, {static_cast<pyb::ssize_t>(b.size())}, {1},
                            /*readonly=*/true);
  });
  pyb::class_<PyRef, std::shared_ptr<PyRef>>(m, "ObjectRef")
      // Another Python object for the same ref: what troupe's ItemRef (one
      // of a num_returns=N call's refs) is made from, sharing its state.
      .def(pyb::init([](std::shared_ptr<PyRef> same) { return same; }))
      .def("_key", &PyRef::key)
      .def("_ready", [](PyRef& r) { return r.answer()->ready(); });
  pyb::class_<client::ActorClient, std::shared_ptr<client::ActorClient>>(m, "Actor")
      .def_property_readonly("id", &client::ActorClient::id)
      .def("info", [](client::ActorClient& a) { return actor_to_python(a.info()); });
  pyb::class_<PyTaskKey>(m, "TaskKey");
}

// Makes `call` a streaming call writing to `stream` (none: a plain call),
// past the first `skip` values.
void streaming(PyCall& call, const PyStream* stream, uint64_t skip) {
  if (!stream) return;
  StreamRef ref = stream->ref();
  call.stream_address = ref.address;
  call.stream_id = ref.id;
  call.stream_skip = skip;
}

// Streaming generators: the caller's PyStream and the worker's writer.
void bind_streams(pyb::module_& m) {
  using NoGil = pyb::call_guard<pyb::gil_scoped_release>;
  pyb::class_<PyStream, std::shared_ptr<PyStream>>(m, "Stream")
      .def("watch", &PyStream::watch, NoGil())
      .def("ready", &PyStream::ready, NoGil())
      // (kind, ref): PyStream::Kind and the item's ref (None at the end);
      // None when nothing came within `timeout` seconds (None: no limit).
      .def("next", [](PyStream& s, const std::optional<double>& timeout) -> pyb::object {
        std::optional<PyStream::Next> got;
        {
          GilReleased nogil;  // a daemon thread reading a stream at exit waits, not aborts
          wait_interruptibly(
              [&](std::chrono::milliseconds slice) {
                got = s.next(slice);
                return got.has_value();
              },
              timeout);
        }
        if (!got) return pyb::none();
        return pyb::make_tuple(static_cast<int>(got->first), got->second);
      });
  pyb::class_<PyStreamWriter>(m, "StreamWriter")
      .def(pyb::init([](const std::string& address, uint64_t id) {
        pyb::gil_scoped_release nogil;
        return std::make_unique<PyStreamWriter>(this_actor::runtime().core(), address, id);
      }))
      // (error, data, buffers, refs), as a call's answer.
      .def("write",
           [](PyStreamWriter& w, const pyb::handle& parts) {
             PyReply item = reply_from_python(parts);
             pyb::gil_scoped_release nogil;
             w.write(item);
           })
      .def("close", &PyStreamWriter::close, NoGil());
}

pyb::class_<PyClient> bind_client(pyb::module_& m) {
  using NoGil = pyb::call_guard<pyb::gil_scoped_release>;
  pyb::class_<PyClient> cls(m, "Client");
  cls.def(pyb::init([](std::string address, std::string token, Resources resources) {
            InitOptions o = resolve_init_options(std::move(address), std::move(token));
            o.node_resources = std::move(resources);
            o.prefill_own_executable = false;  // the interpreter is no worker
            // An embedded cluster's fence is the runtime's embedded default
            // (core::kOneMachineHeartbeatMisses): 3 s, not 0.5 s.
            return std::make_unique<PyClient>(o);
          }),
          NoGil())
      .def_static("attach_worker", [] { return std::make_unique<PyClient>(this_actor::runtime().core()); })
      .def("spawn",
           [](PyClient& c, const std::string& class_name, const pyb::handle& blob, const pyb::handle& args,
              const RefList& top, const pyb::dict& options) {
             PyActorSpec spec{buffer_from_python(blob), call_from("__init__", args)};
             PyOptions o = options_from(options);
             pyb::gil_scoped_release nogil;
             // Top-level refs of a constructor are resolved here: the spec
             // is kept by the head and replayed on restarts.
             spec.ctor.top.resize(top.size());
             for (size_t i = 0; i < top.size(); ++i) spec.ctor.top[i].ref = top[i]->stored_ref();
             return c.spawn(class_name, std::move(spec), o);
           })
      .def(
          "call",
          [](PyClient& c, client::ActorClient& actor, std::string method, const pyb::handle& args, const RefList& top,
             std::shared_ptr<PyRef> keep, std::shared_ptr<PyStream> stream, uint64_t skip, uint32_t group,
             std::optional<int> retries) {
            PyCall call = call_from(std::move(method), args);
            pyb::gil_scoped_release nogil;
            streaming(call, stream.get(), skip);
            return c.call(actor, std::move(call), top, std::move(keep), group, retries);
          },
          pyb::arg("actor"), pyb::arg("method"), pyb::arg("args"), pyb::arg("top"), pyb::arg("keep") = nullptr,
          pyb::arg("stream") = nullptr, pyb::arg("skip") = 0, pyb::arg("group") = 0,
          pyb::arg("retries") = std::optional<int>())
      .def("actor_lifetime", &PyClient::actor_lifetime, pyb::call_guard<pyb::gil_scoped_release>())
      .def("task_key",
           [](PyClient& c, const pyb::dict& options) {
             PyOptions o = options_from(options);
             pyb::gil_scoped_release nogil;
             return c.task_key(o);
           })
      .def(
          "submit",
          [](PyClient& c, const PyTaskKey& key, std::string fn, const pyb::handle& args, const RefList& top,
             std::shared_ptr<PyStream> stream, uint64_t skip) {
            PyCall call = call_from(std::move(fn), args);
            pyb::gil_scoped_release nogil;
            streaming(call, stream.get(), skip);
            return c.submit(key, std::move(call), top);
          },
          pyb::arg("key"), pyb::arg("fn"), pyb::arg("args"), pyb::arg("top"), pyb::arg("stream") = nullptr,
          pyb::arg("skip") = 0)
      // The caller's half of a streaming call's stream (py_stream.h).
      .def(
          "stream", [](PyClient& c, size_t credits) { return std::make_shared<PyStream>(c.core(), credits); }, NoGil())
      .def(
          "cancel",
          [](PyClient& c, const PyRef& ref, bool force, bool recursive) { return c.cancel(ref, force, recursive); },
          NoGil())
      .def("shutdown", &PyClient::shutdown, NoGil());
  return cls;
}

// Objects, waiting, actors by name or id, the cluster's state and KV.
void bind_client_queries(pyb::class_<PyClient>& cls) {
  using NoGil = pyb::call_guard<pyb::gil_scoped_release>;
  cls.def("put",
          [](PyClient& c, const pyb::handle& value) {
            PyValue v = value_from_python(value);
            pyb::gil_scoped_release nogil;
            return c.put(std::move(v));
          })
      .def("get", &get_many, pyb::arg("refs"), pyb::arg("timeout") = pyb::none(), pyb::arg("lend_for") = 0)
      .def("wait_refs", [](PyClient&, const pyb::list& refs, size_t n,
                           const std::optional<double>& timeout) { return wait_refs(refs, n, timeout); })
      .def("wait",
           [](PyClient&, const RefList& refs, const std::vector<std::shared_ptr<PyStream>>& streams, size_t n,
              const std::optional<double>& timeout) {
             GilReleased nogil;  // as get's: a daemon thread waiting at exit must not abort the process
             return wait_some(refs, streams, n, timeout);
           })
      .def(
          "kill", [](PyClient& c, uint64_t id, bool no_restart) { c.runtime().kill_actor(id, no_restart); }, NoGil())
      // A piece of actor `id`'s worker log from `offset` (troupe logs),
      // within `timeout_s`: (text as bytes, next offset, the file's size,
      // its path). `previous`: the log of the worker before its current one.
      .def("read_actor_log",
           [](PyClient& c, uint64_t id, uint64_t offset, uint32_t max_bytes, double timeout_s, bool previous) {
             wire::LogChunk chunk;
             {
               pyb::gil_scoped_release nogil;
               chunk = c.core()->head().call<wire::LogChunk>(
                   wire::Op::kReadLog, wire::ReadLog{previous ? "actor_previous" : "actor", id, offset, max_bytes},
                   std::chrono::milliseconds(static_cast<int64_t>(std::max(0.0, timeout_s) * 1000)));
             }
             return pyb::make_tuple(pyb::bytes(chunk.text), chunk.next_offset, chunk.size, chunk.path);
           })
      // An actor ends itself for good (troupe.actor.exit_actor): the head
      // sends the kill and records `why`; no wait, the kill ends the caller.
      .def(
          "exit_actor",
          [](PyClient& c, uint64_t id, const std::string& why) {
            // The replies of the calls read with this one go before the kill.
            if (auto* watch = troupe::worker::ReplyWatch::of_this_process()) watch->send_held_now();
            c.core()->head().call<void>(wire::Op::kKillActor, wire::KillActor{id, true, why});
          },
          NoGil())
      .def("get_actor", &PyClient::get_actor, NoGil())
      .def(
          "actor_by_id", [](PyClient& c, uint64_t id) { return c.core()->actor(id); }, NoGil())
      .def("actor_info",
           [](PyClient& c, uint64_t id) {
             wire::ActorInfo info;
             {
               pyb::gil_scoped_release nogil;
               info = c.actor_info(id);
             }
             return actor_to_python(info);
           })
      .def("nodes",
           [](PyClient& c) {
             std::vector<wire::NodeInfo> nodes;
             {
               pyb::gil_scoped_release nogil;
               nodes = c.runtime().nodes();
             }
             pyb::list out;
             for (const auto& n : nodes) out.append(node_to_python(n));
             return out;
           })
      .def(
          "cluster_resources", [](PyClient& c) { return c.runtime().cluster_resources(); }, NoGil())
      .def(
          "available_resources", [](PyClient& c) { return c.runtime().available_resources(); }, NoGil())
      .def("kv_put",
           [](PyClient& c, const std::string& k, const pyb::bytes& v) {
             std::string value = v;
             pyb::gil_scoped_release nogil;
             c.runtime().kv().put(k, value);
           })
      .def("kv_get",
           [](PyClient& c, const std::string& k) -> pyb::object {
             std::optional<std::string> v;
             {
               pyb::gil_scoped_release nogil;
               v = c.runtime().kv().get(k);
             }
             if (!v) return pyb::none();
             return pyb::bytes(*v);
           })
      .def(
          "kv_add", [](PyClient& c, const std::string& k, int64_t delta) { return c.runtime().kv().add(k, delta); },
          NoGil())
      .def("kv_wait",
           [](PyClient& c, const std::string& k, int64_t ms) {
             std::string v;
             {
               pyb::gil_scoped_release nogil;
               v = c.runtime().kv().wait(k, std::chrono::milliseconds(ms));
             }
             return pyb::bytes(v);
           })
      .def(
          "kv_erase", [](PyClient& c, const std::string& k) { c.runtime().kv().erase(k); }, NoGil())
      .def_property_readonly("address", [](PyClient& c) { return c.runtime().address(); })
      .def_property_readonly("token", [](PyClient& c) { return c.runtime().token(); })
      // The id this process said hello with: the scope of its
      // troupe.client/<id>/ keys (client/actor_keys.h).
      .def_property_readonly("client_id", [](PyClient& c) { return c.core()->client_id(); });
}

pyb::dict group_to_python(const wire::PlacementGroupInfo& g) {
  pyb::dict d;
  d["id"] = g.id;
  using S = wire::PlacementGroupState;
  d["state"] = g.state == S::kPending ? "PENDING" : g.state == S::kCreated ? "CREATED" : "REMOVED";
  d["bundle_nodes"] = g.bundle_nodes;
  d["pending_reason"] = g.pending_reason;
  return d;
}

// Placement groups: create, wait (blocking or as a ref), look up, remove.
void bind_placement_groups(pyb::class_<PyClient>& cls) {
  using NoGil = pyb::call_guard<pyb::gil_scoped_release>;
  // Runs `f` with the GIL released, converts its group info with it held.
  auto info_call = [](auto f) {
    wire::PlacementGroupInfo g;
    {
      pyb::gil_scoped_release nogil;
      g = f();
    }
    return group_to_python(g);
  };
  cls.def("create_placement_group",
          [info_call](PyClient& c, const std::vector<Resources>& bundles, const std::string& strategy,
                      const std::string& name, bool detached) {
            return info_call([&] { return c.create_placement_group(bundles, strategy, name, detached); });
          })
      .def("wait_placement_group",
           [info_call](PyClient& c, uint64_t id, double timeout_s) {
             auto ms = std::chrono::milliseconds(static_cast<int64_t>(std::max(0.0, timeout_s) * 1000));
             return info_call([&] { return c.wait_placement_group(id, ms); });
           })
      .def("placement_group_info",
           [info_call](PyClient& c, uint64_t id) { return info_call([&] { return c.placement_group_info(id); }); })
      .def("remove_placement_group", &PyClient::remove_placement_group, NoGil())
      .def(
          "status_json",
          [](PyClient& c, const std::string& state, uint32_t limit, uint64_t driver) {
            return c.runtime().status_json(wire::StatusRequest{state, limit, driver});
          },
          NoGil(), pyb::arg("state") = "", pyb::arg("limit") = 0, pyb::arg("driver") = 0)
      .def("placement_group_ready", [](PyClient& c, uint64_t id, const pyb::handle& value) {
        PyValue v = value_from_python(value);
        pyb::gil_scoped_release nogil;
        return c.placement_group_ready(id, std::move(v));
      });
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "troupe's C++ client core (used by the troupe package)";
  pyb::register_exception_translator(&translate);
  g_main_thread = pyb::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
  bind_values(m);
  bind_streams(m);
  auto client = bind_client(m);
  bind_client_queries(client);
  bind_placement_groups(client);
  bind_collective(m);
  // The most a value kept by the head (an actor's spec, a task's function
  // in the KV store) may take.
  m.attr("HEAD_VALUE_LIMIT") = kMaxSpecBytes;
  // The most calls an actor may run at once (head::validate_max_concurrency).
  m.attr("MAX_ACTOR_CONCURRENCY") = head::kMaxActorConcurrency;
  // The most concurrency groups an actor may have beside its default one.
  m.attr("MAX_CONCURRENCY_GROUPS") = wire::kMaxConcurrencyGroups;
  m.def("set_error_classes", [](pyb::dict d) { g_errors = new pyb::dict(std::move(d)); });
  m.def("serve_worker", &serve_worker);
  m.def("in_worker", [] { return this_actor::in_worker(); });
  // init() with no address joins this session's cluster when its head (or
  // the head's supervisor) runs, as Ray's init finds the latest `ray start`
  // cluster: "session dir", "address", or ("", "") when none runs.
  m.def("running_cluster", [] {
    const std::string dir = core::session_dir();
    try {
      core::check_session_dir(dir);
    } catch (const std::exception&) {
      return std::pair<std::string, std::string>();  // init says what is wrong with it if asked for "auto"
    }
    // The head runs here, or a node agent that joined it from this host
    // (`troupe start --address`: its session's address is the head's).
    if (!core::check_pid_file(dir, "head.pid").alive && !core::has_live_pid_file(dir, "node-"))
      return std::pair<std::string, std::string>();
    return std::pair(dir, core::read_session_file(dir, "address"));
  });
  m.def("actor_id", [] { return this_actor::id(); });
  // The concurrency groups of this worker's actor, in their order (the
  // numbers its calls name them by); empty outside an actor.
  m.def("concurrency_groups", [] {
    std::vector<std::string> names;
    if (this_actor::in_worker())
      for (const auto& g : this_actor::runtime().core()->hello_reply().spec.concurrency_groups) names.push_back(g.name);
    return names;
  });
  // The wait observer of this thread (a task executor's CpuLender while it
  // runs a task), as an opaque number for get(lend_for=...); 0 if none.
  m.def("wait_observer", [] { return reinterpret_cast<uintptr_t>(core::tls_wait_observer.observer); });
  // Awaits without a thread each (troupe._Awaiter): a ref's answer queues
  // its token, and the one awaiter thread takes the queued tokens.
  m.def("notify_when_ready", [](const std::shared_ptr<PyRef>& ref, uint64_t token) {
    std::shared_ptr<ReplyState> answer;
    {
      pyb::gil_scoped_release nogil;  // a stored ref's answer starts its fetch
      answer = ref->answer();
    }
    answer->on_ready([token] {
      auto& q = ready_tokens();
      {
        std::lock_guard lock(q.mu);
        q.tokens.push_back(token);
      }
      q.cv.notify_one();
    });
  });
  // None once stop_ready_tokens was called and no token is left.
  m.def("ready_tokens", [](double timeout_s) -> std::optional<std::vector<uint64_t>> {
    auto& q = ready_tokens();
    std::vector<uint64_t> out;
    bool stopping = false;
    {
      GilReleased nogil;
      std::unique_lock lock(q.mu);
      q.cv.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return !q.tokens.empty() || q.stopping; });
      out.swap(q.tokens);
      stopping = q.stopping;
    }
    if (out.empty() && stopping) return std::nullopt;
    return out;
  });
  // At exit (atexit, before finalization): the awaiter thread's wait ends.
  m.def("stop_ready_tokens", [] {
    auto& q = ready_tokens();
    {
      std::lock_guard lock(q.mu);
      q.stopping = true;
    }
    q.cv.notify_all();
  });
  m.def("gpu_ids", [] { return this_actor::gpu_ids(); });
  m.def("assigned_resources", [] { return this_actor::assigned_resources(); });
  // The placement group this actor or task runs in (0 = none, or a driver).
  m.def("placement_group_id", [] {
    return this_actor::in_worker() ? this_actor::runtime().core()->hello_reply().spec.placement_group : uint64_t{0};
  });
  // Whether the task or actor call this thread runs was cancelled while it
  // ran (None on a thread that runs none).
  m.def("current_task_cancelled", [] { return client::current_task_cancelled(); });
  m.def("getenv", [](const std::string& name) { return core::env_value(name.c_str()); });
  // None when unset, where getenv says "" for unset and empty alike: an
  // empty CUDA_VISIBLE_DEVICES hides every GPU, an unset one none.
  m.def("getenv_or_none", [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  });
  // TorchTrainer's MASTER_PORT and GLOO_SOCKET_IFNAME, as `troupe torchrun`
  // picks them (wire/local_host.h).
  m.def("free_port", [] { return wire::free_listen_port(); });
  m.def("interface_of", [](const std::string& address) { return wire::interface_of(address); });
}
