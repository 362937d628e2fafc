#include "troupe/runtime/client/runtime.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <type_traits>

#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/core/process.h"
#include "troupe/runtime/core/session.h"
#include "troupe/runtime/core/worker_env.h"
#include "troupe/runtime/head/head.h"
#include "troupe/runtime/head/resource_pool.h"
#include "troupe/runtime/node/node_agent.h"
#include "troupe/runtime/wire/address.h"
#include "troupe/runtime/worker/worker_context.h"

namespace troupe {

using namespace troupe::wire;

namespace {

// Why nothing answers a TCP connect to `address` within 3 s, or "" when
// something accepts it: a driver without a token asks for one only where
// a head may be listening.
std::string tcp_unreachable(const std::string& address) {
  const int err = tcp_connect_error(address, std::chrono::seconds(3));
  return err == 0 ? std::string() : std::strerror(err);
}

constexpr const char* kShutDownMessage =
    "this troupe::Runtime was shut down (or moved from): make a new one with troupe::init()";

// KvStore over the head's KV requests.
class HeadKvStore final : public KvStore {
 public:
  explicit HeadKvStore(const std::shared_ptr<client::Core>& core) : core_(core) {}
  void put(const std::string& key, const std::string& value) override {
    again_if_cut([&] { ask<void>(Op::kKvPut, KvEntry{key, value}); });
  }
  std::optional<std::string> get(const std::string& key) override {
    return again_if_cut([&] { return ask<std::optional<std::string>>(Op::kKvGet, key); });
  }
  std::string wait(const std::string& key, std::chrono::milliseconds timeout) override {
    uint32_t ms = static_cast<uint32_t>(std::min<int64_t>(timeout.count(), UINT32_MAX));
    return live()->head().call<std::string>(Op::kKvWait, KvWait{key, ms}, timeout + std::chrono::seconds(5));
  }
  void erase(const std::string& key) override {
    again_if_cut([&] { ask<void>(Op::kKvErase, key); });
  }
  int64_t add(const std::string& key, int64_t delta) override {
    return live()->head().call<int64_t>(Op::kKvAdd, KvAdd{key, delta});
  }

 private:
  // put, get and erase are the same sent twice: one the head's connection
  // cut in flight (the head died, and the link is dialling it again) is
  // sent again, and waits for the link like any call made while it is
  // down, rather than failing the caller (a function's export on its
  // first .remote()). add is not, and wait has the caller's timeout.
  template <class F>
  auto again_if_cut(F&& f) -> decltype(f()) {
    for (int attempt = 1;; ++attempt) {
      try {
        return f();
      } catch (const ConnectionError&) {
        if (attempt >= 3 || live()->head_lost()) throw;
      }
    }
  }

  // Sends one request and waits for its answer for as long as its
  // connection lives, saying so in the log every 30 s: a stalled head
  // answers once it wakes. (Asked again instead, a put could land after a
  // newer put of another process, which it then undid.)
  template <class R, class Q>
  R ask(Op op, const Q& q) {
    static constexpr auto kPatience = std::chrono::seconds(30);
    auto core = live();
    auto f = core->head().request(op, encode_inline(q));
    core::WaitObserverInstall quick(nullptr);  // answered within a round trip (RpcChannel::call)
    for (int waited = 1; !f.wait_for(kPatience); ++waited)
      TROUPE_LOG_WARN("the head has not answered a key-value request ({}) in {} s; waiting on", op_name(op),
                      waited * kPatience.count());
    Message m = f.get();
    if constexpr (std::is_void_v<R>)
      return;
    else
      return decode_value<R>(m.body.data(), m.body.size(), &m.attachments);
  }

  // The Runtime owns the core: once it is shut down the store refuses.
  std::shared_ptr<client::Core> live() const {
    auto core = core_.lock();
    if (!core) throw Error(kShutDownMessage);
    return core;
  }
  std::weak_ptr<client::Core> core_;
};

}  // namespace

struct Runtime::Embedded {
  std::unique_ptr<head::Head> head;
  std::unique_ptr<node::NodeAgent> node;
};

Runtime::Runtime() = default;
Runtime::Runtime(Runtime&&) noexcept = default;
Runtime& Runtime::operator=(Runtime&& other) noexcept {
  if (this != &other) {
    shutdown();  // what this one held goes first, as if it were destroyed
    core_mu_ = std::move(other.core_mu_);
    lifecycle_mu_ = std::move(other.lifecycle_mu_);
    core_ = std::move(other.core_);
    embedded_ = std::move(other.embedded_);
    kv_ = std::move(other.kv_);
  }
  return *this;
}
Runtime::~Runtime() { shutdown(); }

std::shared_ptr<client::Core> Runtime::live() const {
  std::shared_ptr<client::Core> core;
  if (core_mu_) {
    std::lock_guard lock(*core_mu_);
    core = core_;
  }
  if (!core) throw Error(kShutDownMessage);
  return core;
}

bool Runtime::valid() const {
  if (!core_mu_) return false;
  std::lock_guard lock(*core_mu_);
  return core_ != nullptr;
}

Runtime Runtime::attach(std::shared_ptr<client::Core> core) {
  Runtime rt;
  rt.core_ = std::move(core);
  rt.kv_ = std::make_unique<HeadKvStore>(rt.core_);
  return rt;
}

CancelOutcome Runtime::cancel_state(const std::shared_ptr<core::FutureStateBase>& state, bool force) const {
  if (!state) throw ConfigError("Runtime::cancel: the future is empty");
  if (auto* task = dynamic_cast<client::TaskCancel*>(state.get()))
    return task->cancel(*live()->service<client::TaskSubmitter>(), *state, force, client::kCppCancelApi);
  if (auto* call = dynamic_cast<client::CallCancel*>(state.get()))
    return call->cancel(*live(), *state, force, client::kCppCancelApi);
  throw ConfigError(
      "Runtime::cancel takes the future of a task or actor call made through this Runtime (submit, submit_ref, "
      "call, call_ref), not a put's or anything else");
}

client::ObjectStoreStats Runtime::object_store_stats() { return live()->service<client::ObjectStore>()->stats(); }

Runtime Runtime::connect(const InitOptions& o) {
  core::init_logging_once("driver");
  Runtime rt;
  std::string address = o.address;
  std::string token = o.token;
  if (address.empty()) {
    if (const std::string role = core::env_value(core::kEnvRole); !role.empty())
      // A program whose main() does not serve the role first: every worker
      // the embedded cluster started would embed one more, without end.
      throw ConfigError("Runtime::connect would start an embedded cluster in a process troupe started as a " + role +
                        " (" + core::kEnvRole + "=" + role +
                        "): main() must call troupe::run_role_if_requested(argc, argv), or troupe::init(argc, "
                        "argv), before anything else");
    core::validate_heartbeat(o.heartbeat_ms, o.heartbeat_misses ? o.heartbeat_misses : core::kOneMachineHeartbeatMisses,
                             "InitOptions");
    rt.embedded_ = std::make_unique<Embedded>();
    if (token.empty()) token = random_token();
    head::HeadOptions ho;
    ho.token = token;
    ho.heartbeat_ms = o.heartbeat_ms;
    ho.heartbeat_misses = o.heartbeat_misses ? o.heartbeat_misses : core::kOneMachineHeartbeatMisses;
    rt.embedded_->head = std::make_unique<head::Head>(ho);
    rt.embedded_->head->start();
    address = rt.embedded_->head->address();
    node::NodeOptions no;
    no.head_address = address;
    no.token = token;
    no.resources = node::detect_resources(o.node_resources);
    no.worker_pool = {o.worker_pool_size, o.worker_idle_timeout};
    no.prefill_own_executable = o.prefill_own_executable;
    rt.embedded_->node = std::make_unique<node::NodeAgent>(no);
  } else {
    // A malformed address is named before a missing token is asked for.
    wire::parse_address(address);
    core::check_token(token, "the cluster token");
    if (token.empty()) {
      // A mistyped address is said as such, not as a token to find.
      if (const std::string why = tcp_unreachable(address); !why.empty())
        throw ConnectionError("cannot connect to " + address + ": " + why);
      throw ConfigError("connecting to " + address +
                        " needs the cluster token (TROUPE_TOKEN or the session directory)");
    }
  }
  client::ConnectOptions co;
  co.address = address;
  co.token = token;
  co.hello.role = Role::kDriver;
  co.hello.pid = getpid();
  rt.core_ = client::Core::connect(co);
  rt.kv_ = std::make_unique<HeadKvStore>(rt.core_);
  // Made now: it reads TROUPE_OBJECT_STORE_BYTES, whose bad value is said
  // here rather than at the first put.
  auto store = rt.core_->service<client::ObjectStore>();
  if (o.object_store_bytes != 0) store->set_limit(o.object_store_bytes);
  return rt;
}

void Runtime::shutdown() {
  if (!lifecycle_mu_) return;  // moved from
  std::lock_guard whole(*lifecycle_mu_);
  std::shared_ptr<client::Core> core;
  {
    std::lock_guard lock(*core_mu_);
    core = std::move(core_);
  }
  if (core) {
    // Worker runtimes share the process's core; only drivers close theirs
    // (and release their task executors first, while the head is there).
    if (embedded_ || !this_actor::in_worker()) {
      if (auto tasks = core->find_service<client::TaskSubmitter>()) tasks->release_all();
      core->shutdown();
    }
    core.reset();
  }
  if (embedded_) {
    // The head first: it then knows its node agent goes with it, and does
    // not warn that the node is dead. (Either may be missing: connect()
    // failed while making them.)
    if (embedded_->head) embedded_->head->stop();
    embedded_->node.reset();  // kills the workers
    embedded_->head.reset();
    embedded_.reset();
  }
  // kv_ stays: a reference kv() gave out may still be in use on another
  // thread; without the core it refuses every call.
}

ActorInfo Runtime::create_actor(ActorSpec spec, const ActorOptions& options, const std::vector<std::string>& methods) {
  spec.resources = options.resources;
  spec.name = options.name;
  spec.max_restarts = options.max_restarts;
  spec.max_task_retries = options.max_task_retries;
  spec.max_concurrency = options.max_concurrency;
  if (options.placement_group) spec.placement_group = options.placement_group->id();
  spec.bundle_index = options.bundle_index;
  spec.executable = options.executable.empty() ? core::self_executable_path() : options.executable;
  spec.env = options.env;
  spec.detached = options.detached;
  spec.node_affinity = options.node_affinity;
  spec.affinity_soft = options.affinity_soft;
  spec.concurrency_groups = options.concurrency_groups;
  head::validate_max_concurrency(options.max_concurrency);
  head::validate_concurrency_groups(spec.concurrency_groups, spec.class_name, &methods);
  head::validate_resources(spec.resources, "actor " + spec.class_name + " options");
  auto core = live();
  auto info = core->create_actor(std::move(spec));
  // Waiting for resources: this process's idle task executors may hold them.
  if (info.state == ActorState::kPending && !info.pending_reason.empty())
    if (auto tasks = core->find_service<client::TaskSubmitter>()) tasks->release_idle();
  return info;
}

client::TaskPlacement Runtime::task_placement(const TaskOptions& options) {
  client::TaskPlacement p;
  p.resources = options.resources;
  if (options.placement_group) {
    p.placement_group = options.placement_group->id();
    if (options.bundle_index < -1 || options.bundle_index >= static_cast<int>(options.placement_group->bundle_count()))
      throw ConfigError("task bundle_index " + std::to_string(options.bundle_index) +
                        " is out of range for a group of " + std::to_string(options.placement_group->bundle_count()) +
                        " bundles");
  }
  p.bundle_index = options.bundle_index;
  p.executable = options.executable;
  p.env = options.env;
  p.node_affinity = options.node_affinity;
  p.affinity_soft = options.affinity_soft;
  p.max_calls = options.max_calls;
  if (options.max_retries < -1)
    throw ConfigError("max_retries must be >= -1, got " + std::to_string(options.max_retries));
  return p;
}

namespace {

// Waits (bounded) until the head reports the actor in a state `reached`
// accepts.
void wait_until(client::ActorClient& actor, const std::function<bool(const ActorInfo&)>& reached,
                std::chrono::milliseconds timeout) {
  auto done = std::make_shared<core::FutureState<void>>();
  uint64_t listener = actor.add_listener([done, reached](const ActorInfo& info) {
    if (reached(info) && !done->ready()) done->set_value();
  });
  if (!reached(actor.info())) done->wait_for(timeout);
  actor.remove_listener(listener);
}

}  // namespace

void Runtime::kill_actor(uint64_t actor_id, bool no_restart) {
  auto core = live();
  auto actor = core->actor(actor_id);
  const ActorInfo before = actor->info();
  core->head().call<void>(Op::kKillActor, KillActor{actor_id, no_restart});
  // The head answers once the kill is sent; the worker may still serve a
  // call sent meanwhile. A kill returns once the head reports the killed
  // incarnation gone (DEAD for good; else RESTARTING or a later
  // incarnation), so no call made after it reaches that incarnation
  // (bounded: a node that does not report is declared dead by its
  // heartbeats well within this).
  // By value: a copy of the listener may still run on the I/O thread after
  // this function has returned.
  const auto gone = [no_restart, incarnation = before.incarnation](const ActorInfo& info) {
    if (no_restart) return info.state == ActorState::kDead;
    return info.state != ActorState::kAlive || info.incarnation != incarnation;
  };
  wait_until(*actor, gone, std::chrono::seconds(10));
}

ActorInfo Runtime::actor_info(uint64_t actor_id) { return live()->actor(actor_id)->info(); }

ActorWatch Runtime::watch_actor(uint64_t actor_id, std::function<void(const ActorInfo&)> cb) {
  auto client = live()->actor(actor_id);
  uint64_t id = client->add_listener(std::move(cb));
  return ActorWatch(client, id);
}

PlacementGroup Runtime::create_placement_group(const std::vector<Resources>& bundles, PlacementStrategy strategy,
                                               const std::string& name, bool detached) {
  for (size_t i = 0; i < bundles.size(); ++i)
    head::validate_resources(bundles[i], "placement group bundle " + std::to_string(i));
  PlacementGroupSpec spec{bundles, strategy, name, detached};
  PlacementGroup pg;
  pg.core_ = live();
  pg.info_ = pg.core_->create_placement_group(spec);
  pg.bundles_ = bundles.size();
  // As in create_actor: idle task executors may hold what it waits for.
  if (pg.info_.state == wire::PlacementGroupState::kPending && !pg.info_.pending_reason.empty())
    if (auto tasks = pg.core_->find_service<client::TaskSubmitter>()) tasks->release_idle();
  return pg;
}

void Runtime::remove_placement_group(const PlacementGroup& pg) {
  live()->head().call<void>(Op::kRemovePlacementGroup, pg.id());
}

bool PlacementGroup::wait(std::chrono::milliseconds timeout) {
  uint32_t ms = static_cast<uint32_t>(std::min<int64_t>(timeout.count(), UINT32_MAX));
  info_ = core_->head().call<PlacementGroupInfo>(Op::kWaitPlacementGroup, WaitPlacementGroup{info_.id, ms},
                                                 timeout + std::chrono::seconds(5));
  return info_.state == wire::PlacementGroupState::kCreated;
}

wire::PlacementGroupInfo PlacementGroup::info() const {
  return core_->head().call<PlacementGroupInfo>(Op::kGetPlacementGroup, info_.id);
}

KvStore& Runtime::kv() {
  live();  // refused once shut down
  return *kv_;
}

std::string Runtime::status_json(const wire::StatusRequest& request) {
  return live()->head().call<std::string>(Op::kStatus, request);
}

std::vector<NodeInfo> Runtime::nodes() { return live()->head().call_empty<std::vector<NodeInfo>>(Op::kNodes); }

namespace {
Resources sum_over_live(const std::vector<NodeInfo>& nodes, Resources NodeInfo::*field) {
  Resources sum;
  for (const auto& n : nodes)
    if (n.alive)
      for (const auto& [k, v] : n.*field) sum[k] += v;
  return sum;
}
}  // namespace

Resources Runtime::cluster_resources() { return sum_over_live(nodes(), &NodeInfo::total); }

Resources Runtime::available_resources() {
  // A node whose pool ran over (a task that lent its CPU took it back while
  // another ran on it: ResourcePool::reclaim) has nothing free, not less
  // than nothing: it adds 0, not a negative amount, as in Ray.
  auto nodes = this->nodes();
  for (auto& n : nodes)
    for (auto& [k, v] : n.available) v = std::max(v, 0.0);
  return sum_over_live(nodes, &NodeInfo::available);
}

std::string Runtime::address() const { return live()->address(); }
std::string Runtime::token() const {
  // A copy: another thread's shutdown() may let the core go at any time.
  return live()->token();
}

Runtime init(const InitOptions& options) {
  run_role_if_requested();
  if (!options.log_level.empty() && !core::parse_log_level(options.log_level))
    throw ConfigError("InitOptions::log_level '" + options.log_level +
                      "' is not one of trace, debug, info, warn, error, critical, off");
  // The option wins over the variable; the variable over the default.
  const bool given = !options.log_level.empty();
  ::setenv(core::kEnvLogLevel, given ? options.log_level.c_str() : "warn", /*overwrite=*/given);
  core::init_logging_once("driver");
  return Runtime::connect(options);
}

Runtime init(int argc, char** argv) {
  run_role_if_requested(argc, argv);
  InitOptions o;
  o.address = core::env_value(core::kEnvAddress);
  o.token = core::clean_token(core::env_value(core::kEnvToken), core::kEnvToken);
  for (int i = 1; argv && i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--address" || arg == "--address=") {
      // Without a value it embedded a cluster, as if not given.
      if (arg == "--address=" || i + 1 >= argc)
        throw ConfigError("--address needs a value: HOST:PORT of a running cluster, or auto");
      o.address = argv[++i];
    } else if (arg.rfind("--address=", 0) == 0) {
      o.address = arg.substr(10);
    }
  }
  if (o.address == "auto" || (!o.address.empty() && o.token.empty())) core::check_session_dir(core::session_dir());
  if (o.address == "auto") {
    std::string dir = core::session_dir();
    o.address = core::read_session_file(dir, "address");
    if (o.address.empty())
      throw ConnectionError("--address auto: no running cluster in " + dir + " (troupe start --head)");
  }
  if (!o.address.empty() && o.token.empty()) o.token = core::read_session_file(core::session_dir(), "token");
  return init(o);
}

namespace this_actor {
namespace {
const worker::WorkerContext& context(const char* what) {
  const worker::WorkerContext* ctx = worker::WorkerContext::current();
  if (!ctx) throw Error(std::string("this_actor::") + what + "() called outside an actor");
  return *ctx;
}
}  // namespace

uint64_t id() {
  const worker::WorkerContext* ctx = worker::WorkerContext::current();
  return ctx ? ctx->actor_id() : 0;
}
std::vector<int> gpu_ids() {
  const worker::WorkerContext* ctx = worker::WorkerContext::current();
  return ctx ? ctx->gpu_ids() : std::vector<int>{};
}
Resources assigned_resources() {
  const worker::WorkerContext* ctx = worker::WorkerContext::current();
  return ctx ? ctx->runtime().core()->hello_reply().spec.resources : Resources{};
}
bool in_worker() { return worker::WorkerContext::current() != nullptr; }
Runtime& runtime() { return context("runtime").runtime(); }
bool is_cancelled() {
  if (auto cancelled = client::current_task_cancelled()) return *cancelled;
  throw ConfigError("this_actor::is_cancelled() called on a thread that runs no task or actor call");
}
}  // namespace this_actor

namespace worker {
namespace {
// The one piece of process-wide state behind this_actor: a pointer to the
// context the worker's ActorHost owns. Written once at worker start, before
// any actor code runs (and before any thread that could read it exists
// beyond the client core's), never changed afterwards; atomic so that the
// reads on the actor's threads need no further ordering argument.
std::atomic<const WorkerContext*> g_context{nullptr};
}  // namespace

WorkerContext::WorkerContext(uint64_t actor_id, std::vector<int> gpu_ids, std::unique_ptr<Runtime> runtime)
    : actor_id_(actor_id), gpu_ids_(std::move(gpu_ids)), runtime_(std::move(runtime)) {}
WorkerContext::~WorkerContext() = default;

void WorkerContext::install(const WorkerContext* context) {
  const WorkerContext* expected = nullptr;
  if (!g_context.compare_exchange_strong(expected, context, std::memory_order_acq_rel))
    throw Error("a worker context is already installed in this process");
}
const WorkerContext* WorkerContext::current() { return g_context.load(std::memory_order_acquire); }
}  // namespace worker

}  // namespace troupe
