// The user-facing API of troupe: connect to (or embed) a cluster, spawn
// actors, call their methods (keeping results remote with call_ref), put
// objects (ObjectRef, object_ref.h), send actors typed control messages,
// look them up by name, kill them, reserve placement groups, and use the
// cluster's KV store. Errors thrown by an actor reach Future::get typed (ActorDied,
// Timeout, ConfigError, Aborted, classes registered with TROUPE_ERROR;
// others as RemoteError).
//
//   troupe::Runtime rt = troupe::init(argc, argv);
//   auto c = rt.spawn<Counter>({.resources = {{"CPU", 1}}, .max_restarts = 3}, 10);
//   int v = c.call(&Counter::add, 5).get();
//
// Tasks (stateless functions registered with TROUPE_TASK) run on pooled
// workers: `int v = rt.submit(&square, {.resources = {{"CPU", 1}}}, 7).get();`
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "troupe/runtime/client/actor.h"
#include "troupe/runtime/client/actor_watch.h"
#include "troupe/runtime/client/control.h"
#include "troupe/runtime/client/core.h"
#include "troupe/runtime/client/object_ref.h"
#include "troupe/runtime/client/task.h"
#include "troupe/runtime/client/task_cancel.h"
#include "troupe/runtime/client/task_submitter.h"
#include "troupe/runtime/core/error_registry.h"
#include "troupe/runtime/core/heartbeat.h"
#include "troupe/runtime/core/kv_store.h"
#include "troupe/runtime/wire/error_kind.h"

namespace troupe {

using wire::ActorInfo;
using wire::ActorState;
using wire::NodeInfo;
using wire::PlacementStrategy;
using Resources = std::map<std::string, double>;

class PlacementGroup {
 public:
  PlacementGroup() = default;
  uint64_t id() const { return info_.id; }
  size_t bundle_count() const { return bundles_; }
  // Waits until every bundle is reserved: true, or false at the timeout
  // (the group stays PENDING and is retried as nodes change).
  bool wait(std::chrono::milliseconds timeout);
  wire::PlacementGroupInfo info() const;

 private:
  friend class Runtime;
  std::shared_ptr<client::Core> core_;
  wire::PlacementGroupInfo info_;
  size_t bundles_ = 0;
};

struct ActorOptions {
  // What the actor reserves on its node ({} = nothing; a trainer asks for
  // {{"GPU", 1}} or {{"CPU", 1}}).
  Resources resources;
  // A name makes the actor findable with get_actor<T>(name).
  std::string name;
  // Restarts after the worker dies (-1 = unlimited). The constructor runs
  // again with the same arguments.
  int max_restarts = 0;
  // Times a call in flight when the worker died is sent again (-1 =
  // unlimited); 0 = fail it with ActorDied.
  int max_task_retries = 0;
  // Calls the actor runs at once in its default group.
  int max_concurrency = 1;
  // More groups (Ray's concurrency_groups), each with its own threads and
  // max_concurrency: {{"io", 2, {"read", "write"}}} runs read and write
  // calls, two at a time, beside the default group's. A method listed in
  // no group is in the default one.
  std::vector<wire::ConcurrencyGroup> concurrency_groups;
  const PlacementGroup* placement_group = nullptr;
  int bundle_index = -1;
  // Worker executable; "" = this program (it must call troupe::init).
  std::string executable;
  // Extra KEY=VALUE environment for the worker process.
  std::vector<std::string> env;
  // Outlives this process (Ray's lifetime="detached"): otherwise the actor
  // is killed when the process that created it exits. A detached actor
  // ends with kill_actor (a handle, or get_actor by name) or the cluster;
  // one in a placement group still goes with the group.
  bool detached = false;
  // Run on this node (a NodeInfo id; 0 = wherever the head places it), as
  // Ray's NodeAffinitySchedulingStrategy. Hard: only there (waiting for
  // room; DEAD once that node is gone, also at a restart); with
  // `affinity_soft`, there while that node is alive and big enough in all
  // (waiting for room), else anywhere. Not with a placement group.
  uint64_t node_affinity = 0;
  bool affinity_soft = false;
};

// How a task runs (Runtime::submit).
struct TaskOptions {
  // What the worker running it reserves ({} = nothing).
  Resources resources;
  const PlacementGroup* placement_group = nullptr;
  int bundle_index = -1;
  // Times the task runs again (on another worker) when the worker running
  // it dies (-1 = unlimited); then it fails with WorkerDied.
  int max_retries = 0;
  // Shown in logs and errors ("" = the task's registered name).
  std::string name;
  // Worker executable; "" = this program (it must call troupe::init).
  std::string executable;
  // Extra KEY=VALUE environment for the worker process.
  std::vector<std::string> env;
  // As ActorOptions::node_affinity / affinity_soft, for the task's worker.
  uint64_t node_affinity = 0;
  bool affinity_soft = false;
  // Tasks a worker runs with these options before it exits and another
  // takes its place (Ray's max_calls); 0 = no limit.
  int max_calls = 0;
};

class Runtime;

template <class T>
class ActorHandle {
 public:
  ActorHandle() = default;

  // Calls `method` with `args` (Futures among them are awaited first and
  // their values sent). Calls from one thread to an in-order actor
  // (max_concurrency 1, no concurrency groups: ActorInfo::in_order) run in
  // the order made; other actors keep no order (a call waiting for a
  // Future argument is sent after later ones, and sent calls may run at
  // once on separate threads).
  template <class M, class... A>
  auto call(M method, A&&... args) const -> Future<typename client::MethodTraits<M>::Result>;
  // The same, but the callee keeps the result in its process's object store
  // and replies with a reference to it: pass the ref on to other actors,
  // which fetch the value from the callee directly. Chosen per call.
  template <class M, class... A>
  auto call_ref(M method, A&&... args) const -> Future<ObjectRef<typename client::MethodTraits<M>::Result>>;

  // On an empty handle (made by default, or moved from) each of these, and
  // call, throws troupe::Error.
  uint64_t id() const { return live().id(); }
  // The latest state the head reported.
  ActorInfo info() const { return live().info(); }
  // Waits until ALIVE (true) or DEAD (false); Timeout names the reason it is
  // still pending.
  bool wait_ready(std::chrono::milliseconds timeout = std::chrono::seconds(60)) const {
    return live().wait_ready(timeout);
  }
  // Sends a typed control message (client/control.h) to the worker, which
  // serves it beside the running call (it bypasses the mailbox).
  template <ControlMessage M>
  Future<typename M::Reply> control(const M& message) const {
    return live().control(message);
  }
  bool valid() const { return client_ != nullptr; }

 private:
  friend class Runtime;
  template <class, class>
  friend struct wire::Codec;
  client::ActorClient& live() const {
    if (!client_) throw Error("an empty troupe::ActorHandle (made by default, or moved from) names no actor");
    return *client_;
  }
  explicit ActorHandle(std::shared_ptr<client::ActorClient> c) : client_(std::move(c)) {}
  // Sends method `M` as call op `op`; the reply decodes as R.
  template <class R, class M, class... A>
  Future<R> send_call(M method, uint32_t op, A&&... args) const;
  std::shared_ptr<client::ActorClient> client_;
};

// Where to connect; an empty address embeds a head and one node agent in
// this process (the default local cluster).
struct InitOptions {
  std::string address;       // HOST:PORT of the head, "" = embedded
  std::string token;         // "" = TROUPE_TOKEN or the session directory's
  Resources node_resources;  // embedded node (empty = detect)
  // Embedded head: how often its node heartbeats, and for how many silent
  // intervals it stays alive (0: core::kOneMachineHeartbeatMisses).
  uint32_t heartbeat_ms = core::kHeartbeatMs;
  uint32_t heartbeat_misses = 0;
  // This process's object store limit in bytes (0: TROUPE_OBJECT_STORE_BYTES,
  // else a quarter of the machine's memory). Workers take theirs from
  // TROUPE_OBJECT_STORE_BYTES (ActorOptions::env).
  uint64_t object_store_bytes = 0;
  // Embedded node's warm workers per executable (0 = none) and how long an
  // executable's idle workers outlive its last spawn (docs/runtime.md).
  uint32_t worker_pool_size = 2;
  std::chrono::milliseconds worker_idle_timeout{std::chrono::minutes(5)};
  // Embedded node: start warm workers of this program at once (off for a
  // driver that cannot be a worker, such as the Python interpreter).
  bool prefill_own_executable = true;
  // troupe::init only: the runtime's log level for this driver and its
  // embedded cluster (trace, debug, info, warn, error, critical, off; any
  // case), as TROUPE_LOG_LEVEL, which it overrides. "" = TROUPE_LOG_LEVEL,
  // else warn. Another name is a ConfigError naming it.
  std::string log_level;
};

namespace wire {
// An actor handle travels inside a value (an argument, a result, a field)
// as its actor's ActorInfo; the receiving process makes its own handle
// without waiting for the head, so tasks and actors can be handed actors,
// as in Ray. An empty handle travels as such; a handle decoded as another
// class's is a DecodeError naming both.
template <class T>
struct Codec<ActorHandle<T>> {
  static void encode(Encoder& e, const ActorHandle<T>& h) {
    if (!h.valid()) return e.write_pod<uint8_t>(0);
    e.write_pod<uint8_t>(1);
    wire::encode(e, h.info());
  }
  static ActorHandle<T> decode(Decoder& d) {
    const auto has = d.read_pod<uint8_t>();
    if (has > 1) throw DecodeError("bad actor handle tag " + std::to_string(has));
    if (!has) return {};
    auto info = wire::decode<ActorInfo>(d);
    if (info.class_name != ActorTraits<T>::kName)
      throw DecodeError("actor " + std::to_string(info.id) + " is a " + info.class_name +
                        ", decoded as a handle to a " + ActorTraits<T>::kName);
    if (!d.core())
      throw DecodeError("an ActorHandle can only be decoded with the process's client core (Decoder::core)");
    return ActorHandle<T>(d.core()->adopt_actor(info));
  }
};
}  // namespace wire

class Runtime {
 public:
  Runtime();  // not valid(): assign connect()'s or init()'s result to it
  Runtime(Runtime&&) noexcept;
  Runtime& operator=(Runtime&&) noexcept;
  ~Runtime();

  static Runtime connect(const InitOptions& options);
  // Wraps an existing client core (workers use this for this_actor).
  static Runtime attach(std::shared_ptr<client::Core> core);

  template <class T, class... A>
  ActorHandle<T> spawn(const ActorOptions& options, A&&... args);

  // The live actor registered under `name`; ConfigError when there is none.
  template <class T>
  ActorHandle<T> get_actor(const std::string& name) {
    auto core = live();
    auto info = core->head().call<ActorInfo>(wire::Op::kGetActor, name);
    if (info.class_name != ActorTraits<T>::kName)
      throw ConfigError("actor '" + name + "' is a " + info.class_name + ", not a " + ActorTraits<T>::kName);
    return ActorHandle<T>(core->actor(info));
  }

  // Kills the actor's worker (SIGKILL). With no_restart it ends DEAD;
  // otherwise it restarts if it has restarts left.
  template <class T>
  void kill(const ActorHandle<T>& h, bool no_restart = true) {
    kill_actor(h.id(), no_restart);
  }
  void kill_actor(uint64_t actor_id, bool no_restart = true);
  // The latest state of any actor by id.
  ActorInfo actor_info(uint64_t actor_id);
  // Runs `cb` on this process's I/O thread whenever the actor's state
  // changes (restarting, alive again, dead), for as long as the returned
  // watch lives. Keep `cb` short.
  ActorWatch watch_actor(uint64_t actor_id, std::function<void(const ActorInfo&)> cb);

  // `detached`: the group outlives this process (Ray's lifetime="detached").
  PlacementGroup create_placement_group(const std::vector<Resources>& bundles, PlacementStrategy strategy,
                                        const std::string& name = "", bool detached = false);
  void remove_placement_group(const PlacementGroup& pg);

  // The cluster's KV store (shared by every process of the cluster).
  KvStore& kv();
  // The head's status as JSON text (nodes, resources, actors, groups), for
  // the launcher; `request` filters the actors listed (by state, newest N).
  std::string status_json(const wire::StatusRequest& request = {});
  // Every node the head knows (dead ones with alive = false): resources in
  // total, used and available, and GPU ids.
  std::vector<NodeInfo> nodes();
  // Sums over the live nodes: everything, and what is not in use.
  Resources cluster_resources();
  Resources available_resources();
  // HOST:PORT of the head.
  std::string address() const;
  std::string token() const;
  // False once shut down (or when default-constructed or moved from).
  bool valid() const;
  // Stops the embedded cluster (if any) and disconnects. Any thread may
  // call it, more than once: a call made while another is under way returns
  // once that one has finished. Afterwards (and in a call that races it)
  // every method of this Runtime throws troupe::Error saying it is shut
  // down, rather than reaching a cluster that is gone.
  void shutdown();

  // Keeps `value` in this process's object store; the ref may be passed to
  // any actor, which fetches the value from here. ObjectStoreFull when it
  // would exceed the store's limit.
  template <class T>
  ObjectRef<std::decay_t<T>> put(T&& value) {
    auto store = live()->service<client::ObjectStore>();
    return ObjectRef<std::decay_t<T>>(store->put(client::make_object_value(std::decay_t<T>(std::forward<T>(value)))));
  }
  // What this process's object store holds, and its limit.
  client::ObjectStoreStats object_store_stats();

  // The process-internal client core (for layers built on the runtime);
  // troupe::Error once shut down.
  std::shared_ptr<client::Core> core() const { return live(); }

  // Runs task `fn` (registered with TROUPE_TASK) with `args` on a pooled
  // worker that has `options.resources`. Futures among the arguments are
  // awaited first and their values sent. An error the task throws reaches
  // get() typed, as an actor call's would; ConfigError at once when no node
  // could ever fit the resources.
  template <class R, class... P, class... A>
  Future<std::decay_t<R>> submit(R (*fn)(P...), const TaskOptions& options, A&&... args);
  // As submit, but the executor keeps the result and the future gives a
  // reference to it (chosen at submit time, as call_ref is): pass it to
  // other tasks and calls, which fetch it from the executor directly.
  template <class R, class... P, class... A>
  Future<ObjectRef<std::decay_t<R>>> submit_ref(R (*fn)(P...), const TaskOptions& options, A&&... args);
  // Cancels the task or actor call whose future `f` is (submit, submit_ref,
  // call, call_ref, from this Runtime), as ray.cancel: unless it had
  // finished, `f` fails with TaskCancelled now, and CancelOutcome says what
  // was found. One not yet started never runs (waiting for its arguments,
  // queued here or for a restarting actor, in a worker's mailbox or on the
  // wire). A running one runs to its end with its result dropped, and may
  // ask this_actor::is_cancelled() to end early; with `force`, a running
  // task's worker is killed (the other tasks sent to it run elsewhere,
  // without spending a retry). An actor call cannot be forced (its actor's
  // state would go with it: kill the actor instead): ConfigError, as for a
  // future that is neither. Waits up to 10 s for the worker to answer; not
  // to be called on the runtime's I/O thread (an on_ready callback).
  template <class T>
  CancelOutcome cancel(const Future<T>& f, bool force = false) const {
    return cancel_state(f.state(), force);
  }

 private:
  CancelOutcome cancel_state(const std::shared_ptr<core::FutureStateBase>& state, bool force) const;
  template <class Result, class R, class... P, class... A>
  Future<Result> submit_task(R (*fn)(P...), const TaskOptions& options, bool keep_result, A&&... args);
  static client::TaskPlacement task_placement(const TaskOptions& options);
  // `methods`: the actor's method names, which its concurrency groups may list.
  ActorInfo create_actor(wire::ActorSpec spec, const ActorOptions& options, const std::vector<std::string>& methods);
  // core_, or troupe::Error when shut down: what every method works on, a
  // reference of its own, so that a shutdown() racing the call cannot
  // destroy the core under it.
  std::shared_ptr<client::Core> live() const;
  struct Embedded;
  // Guards core_ (held briefly); lifecycle_mu_ is held for the whole of
  // shutdown(). Null only in a moved-from Runtime.
  std::unique_ptr<std::mutex> core_mu_ = std::make_unique<std::mutex>();
  std::unique_ptr<std::mutex> lifecycle_mu_ = std::make_unique<std::mutex>();
  std::shared_ptr<client::Core> core_;
  std::unique_ptr<Embedded> embedded_;
  std::unique_ptr<KvStore> kv_;
};

// Entry point of every troupe program. In a process started as a worker,
// node agent or head (TROUPE_ROLE set) it serves that role and never
// returns. Otherwise it connects to --address / TROUPE_ADDRESS ("auto" =
// the local session directory) or embeds a local cluster. A driver's
// console is the program's own: the runtime logs its warnings and errors
// there, not a line per actor placed or stopped, unless TROUPE_LOG_LEVEL
// or InitOptions::log_level says otherwise (init sets the variable to
// "warn" when both are unset, so an embedded cluster's processes log at
// the same level; Runtime::connect leaves it).
// Call it before the program starts threads of its own: setenv is not
// safe while another thread reads the environment.
Runtime init(int argc = 0, char** argv = nullptr);
Runtime init(const InitOptions& options);

// Serves a head / node / worker role when TROUPE_ROLE asks for one (then
// exits the process); returns otherwise.
void run_role_if_requested(int argc = 0, char** argv = nullptr);

namespace this_actor {
// Inside an actor: its id, the GPUs it was given (indices into
// CUDA_VISIBLE_DEVICES' view, i.e. 0..n-1 after remapping is the caller's
// choice; these are the node's device ids), and a Runtime connected to the
// cluster.
uint64_t id();
std::vector<int> gpu_ids();
// Inside an actor or a task: the resources its worker holds (as Ray's
// get_assigned_resources: {"CPU": 1, "GPU": 0.5, "memory": bytes, ...}, what
// its options asked; a task's are its own options'). Empty outside a worker.
Resources assigned_resources();
Runtime& runtime();
bool in_worker();
// Inside a task or an actor method call, on its thread: whether it was
// cancelled (Runtime::cancel, troupe.cancel) while it ran; a long one may
// check now and then and return early (as Ray's is_canceled()).
// ConfigError on a thread that runs no task or call (a driver, a thread
// the method started).
bool is_cancelled();
// Registers the handler of control message type M, a callable
// `const M& -> M::Reply` (runs on the worker's I/O thread, concurrently with
// the actor's current call; keep it short).
template <ControlMessage M, class F>
void on_control(F handler) {
  auto core = runtime().core();
  core->controls().set(M::kControlTag, client::typed_control_handler<M>(std::move(handler), core.get()));
}
}  // namespace this_actor

// ---- templates ------------------------------------------------------------

namespace client {

// Completes a call's future from its reply; `core` decodes refs in it.
template <class R>
void complete_call(core::FutureState<R>& st, wire::Message& m, Core* core) {
  if (m.status != wire::Status::OK) {
    st.set_error(wire::error_from_message(m));
    return;
  }
  try {
    if constexpr (std::is_void_v<R>) {
      st.set_value();
    } else {
      st.set_value(wire::decode_value<R>(m.body.data(), m.body.size(), &m.attachments, core));
    }
  } catch (...) {
    st.set_error(std::current_exception());
  }
}

// Compile-time check of one argument of a call or task: what it gives (a
// Future<X> gives its X once ready) must make the parameter's type. A
// mismatch fails here, naming the argument's position (I, from 0), the
// parameter and the argument in the instantiation note, rather than deep
// inside std::tuple.
template <class A>
struct ArgumentGives {
  using type = A&&;
};
template <class X>
struct ArgumentGives<Future<X>> {
  using type = X&&;
};
template <size_t I, class Parameter, class Argument>
constexpr bool argument_fits() {
  using Given = typename ArgumentGives<std::decay_t<Argument>>::type;
  constexpr bool fits = std::is_constructible_v<std::decay_t<Parameter>, Given>;
  static_assert(fits,
                "argument I (counting from 0) does not convert to the parameter's type: see Parameter and Argument "
                "in 'argument_fits<I, Parameter, Argument>' below (an ObjectRef<T> goes only to an ObjectRef<T> "
                "parameter; pass ref.get() for a T)");
  return fits;
}
template <class Parameters, class... A, size_t... I>
constexpr bool arguments_fit(std::index_sequence<I...>) {
  if constexpr (sizeof...(A) != std::tuple_size_v<Parameters>) {
    return false;  // the arity's own static_assert says so
  } else {
    return (argument_fits<I, std::tuple_element_t<I, Parameters>, A>() && ...);
  }
}

template <class T>
decltype(auto) resolve_arg(T&& v) {
  if constexpr (IsFuture<std::decay_t<T>>::value) {
    return v.get();
  } else {
    return std::forward<T>(v);
  }
}

// Calls `send(Args(...))` with `args`, once every Future among them is
// ready (at once when there is none), from the thread that completes the
// last one; an argument's error (or send's) goes to `st`. With `actor`
// (an actor's calls), after every call made before it to that actor when
// it runs calls in order (ActorClient::order); a call that ends before it
// could go (cancelled) stops holding up those behind it.
template <class Args, class State, class Send, class... A>
void send_when_ready(const std::shared_ptr<State>& st, const std::shared_ptr<ActorClient>& actor, Send send,
                     A&&... args) {
  constexpr bool any_future = (IsFuture<std::decay_t<A>>::value || ...);
  CallOrder* order = actor ? actor->order() : nullptr;
  auto give_up_when_ended = [&](uint64_t turn) { st->on_ready([actor, order, turn] { order->give_up(turn); }); };
  if constexpr (!any_future) {
    // Built before a turn is taken: a conversion that throws takes none.
    Args tuple(std::forward<A>(args)...);
    const uint64_t turn = order ? order->enter(true) : CallOrder::kNoTurn;
    if (turn == CallOrder::kNoTurn) return send(std::move(tuple));
    give_up_when_ended(turn);
    order->in_turn(turn, [st, send, tuple = std::move(tuple)]() mutable {
      try {
        send(std::move(tuple));
      } catch (...) {
        st->set_error(std::current_exception());
      }
    });
  } else {
    auto pack = std::make_shared<std::tuple<std::decay_t<A>...>>(std::forward<A>(args)...);
    auto remaining = std::make_shared<std::atomic<int>>(1);
    const uint64_t turn = order ? order->enter(false) : CallOrder::kNoTurn;
    if (turn != CallOrder::kNoTurn) give_up_when_ended(turn);
    auto fire = [pack, st, send, remaining, order, turn] {
      if (remaining->fetch_sub(1) != 1) return;
      auto go = [pack, st, send] {
        try {
          send(std::apply([](auto&... a) { return Args(resolve_arg(a)...); }, *pack));
        } catch (...) {
          st->set_error(std::current_exception());
        }
      };
      if (turn == CallOrder::kNoTurn) return go();
      order->in_turn(turn, std::move(go));
    };
    std::apply(
        [&](auto&... a) {
          (
              [&](auto& x) {
                if constexpr (IsFuture<std::decay_t<decltype(x)>>::value) {
                  remaining->fetch_add(1);
                  x.on_ready(fire);
                }
              }(a),
              ...);
        },
        *pack);
    fire();
  }
}
}  // namespace client

template <class T>
template <class M, class... A>
auto ActorHandle<T>::call(M method, A&&... args) const -> Future<typename client::MethodTraits<M>::Result> {
  using R = typename client::MethodTraits<M>::Result;
  return send_call<R>(method, client::method_index<T>(method), std::forward<A>(args)...);
}

template <class T>
template <class M, class... A>
auto ActorHandle<T>::call_ref(M method, A&&... args) const
    -> Future<ObjectRef<typename client::MethodTraits<M>::Result>> {
  using R = typename client::MethodTraits<M>::Result;
  static_assert(!std::is_void_v<R>, "call_ref needs a method that returns a value");
  return send_call<ObjectRef<R>>(method, client::method_index<T>(method) | client::kKeepResult,
                                 std::forward<A>(args)...);
}

template <class T>
template <class R, class M, class... A>
Future<R> ActorHandle<T>::send_call(M method, uint32_t op, A&&... args) const {
  using MT = client::MethodTraits<M>;
  using Args = typename MT::Args;
  static_assert(std::is_same_v<typename MT::Class, T> || std::is_base_of_v<typename MT::Class, T>,
                "method does not belong to this actor type");
  static_assert(sizeof...(A) == MT::kArity, "wrong number of arguments for this method");
  constexpr bool fits = client::arguments_fit<Args, A...>(std::index_sequence_for<A...>{});
  if constexpr (!fits) {
    return Future<R>();  // not compiled: the argument check above failed
  } else {
    (void)method;
    (void)live();
    // The future's state holds what cancel needs: no allocation beside it.
    auto st =
        std::make_shared<client::CallFutureState<R>>(&client::method_names<T>()[client::call_op_method(op)], client_);
    auto send = [client = client_, op, st](Args tuple) {
      st->submit_once([&] {
        wire::Encoder e;
        wire::encode(e, tuple);
        client::Core* core = &client->core();
        // The refs the call carries live until its answer: a retry sends
        // the same bytes after the caller may have dropped its own.
        auto refs = e.take_kept();
        return client->submit(
            op, std::move(e), [st, core, refs](wire::Message& m) { client::complete_call<R>(*st, m, core); },
            [st, refs](std::exception_ptr ex) { st->set_error(ex); });
      });
    };
    client::send_when_ready<Args>(st, client_, std::move(send), std::forward<A>(args)...);
    return Future<R>(st);
  }
}

template <class T, class... A>
ActorHandle<T> Runtime::spawn(const ActorOptions& options, A&&... args) {
  static_assert(kIsActor<T>,
                "this class is not an actor: declare it with TROUPE_ACTOR(Class, &Class::method, ...) at global "
                "namespace scope, after the class (T is named in 'spawn<T, ...>' below)");
  if constexpr (kIsActor<T>) {
    static_assert(std::is_constructible_v<T, std::decay_t<A>...>,
                  "the actor's class has no constructor taking these arguments (T and A are named in "
                  "'spawn<T, A...>' below)");
  }
  if constexpr (!kIsActor<T> || !std::is_constructible_v<T, std::decay_t<A>...>) {
    return ActorHandle<T>();  // not compiled: a static_assert above failed
  } else {
    using Registration = client::CtorRegistration<T, std::decay_t<A>...>;
    (void)Registration::registered;
    wire::ActorSpec spec;
    spec.type_key = client::factory_key<T, std::decay_t<A>...>();
    spec.class_name = ActorTraits<T>::kName;
    wire::Encoder e;
    wire::encode(e, std::tuple<std::decay_t<A>...>(std::forward<A>(args)...));
    spec.ctor_args = std::move(e.bytes());
    spec.ctor_attachments = std::move(e.attachments());
    auto refs = e.take_kept();
    // A creation refused (a name taken, a bad option: ConfigError) sent
    // nothing a worker will decode: the pins of the constructor's refs are
    // given back. After any other error the head may have made the actor.
    auto info =
        e.take_unsent().sent_by([&] { return create_actor(std::move(spec), options, client::method_names<T>()); });
    auto client = live()->actor(info);
    // A restart decodes the constructor's refs again: they live until
    // the actor is dead (one that never restarts decodes them once).
    if (refs && options.max_restarts != 0) client->keep_until_dead(std::move(refs));
    return ActorHandle<T>(std::move(client));
  }
}

template <class R, class... P, class... A>
Future<std::decay_t<R>> Runtime::submit(R (*fn)(P...), const TaskOptions& options, A&&... args) {
  return submit_task<std::decay_t<R>>(fn, options, false, std::forward<A>(args)...);
}

template <class R, class... P, class... A>
Future<ObjectRef<std::decay_t<R>>> Runtime::submit_ref(R (*fn)(P...), const TaskOptions& options, A&&... args) {
  static_assert(!std::is_void_v<R>, "submit_ref needs a task that returns a value");
  return submit_task<ObjectRef<std::decay_t<R>>>(fn, options, true, std::forward<A>(args)...);
}

template <class Result, class R, class... P, class... A>
Future<Result> Runtime::submit_task(R (*fn)(P...), const TaskOptions& options, bool keep_result, A&&... args) {
  using Args = std::tuple<std::decay_t<P>...>;
  static_assert(sizeof...(A) == sizeof...(P), "wrong number of arguments for this task");
  constexpr bool fits = client::arguments_fit<Args, A...>(std::index_sequence_for<A...>{});
  if constexpr (!fits) {
    return Future<Result>();  // not compiled: the argument check above failed
  } else {
    const client::TaskEntry& entry = client::task_for_function(client::task_function_key(fn));
    auto live_core = live();
    auto submitter = live_core->service<client::TaskSubmitter>();
    auto key = submitter->key_for(task_placement(options));
    const std::string& label = options.name.empty() ? entry.name : options.name;
    // The future's state holds what cancel needs: no allocation beside it.
    auto st = std::make_shared<client::TaskFutureState<Result>>(label, submitter->instance(), submitter);
    auto send = [submitter, key, st, &entry, label, retries = options.max_retries, keep_result,
                 core = live_core.get()](Args tuple) {
      st->submit_once([&] {
        wire::Encoder e;
        wire::encode(e, entry.name);
        wire::encode(e, st->token());
        wire::encode(e, tuple);
        auto refs = e.take_kept();  // until the answer, as a call's
        return submitter->submit(
            key, label, std::move(e), retries,
            [st, core, refs](wire::Message& m) { client::complete_call<Result>(*st, m, core); },
            [st, refs](std::exception_ptr ex) { st->set_error(ex); }, keep_result);
      });
    };
    client::send_when_ready<Args>(st, nullptr, std::move(send), std::forward<A>(args)...);
    return Future<Result>(st);
  }
}

}  // namespace troupe
