#include "python_shim/src/py_client.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/core/process.h"
#include "troupe/runtime/core/session.h"
#include "troupe/runtime/core/worker_env.h"
#include "troupe/runtime/head/resource_pool.h"
#include "troupe/runtime/wire/address.h"

namespace troupe::py {

namespace {

// Fills a call's top-level arguments from the refs given, once every call
// answer among them is there; then `send` runs (on the thread that completed
// the last one). A failed argument fails the call, a Python exception
// answer becomes its answer (as Ray propagates a task's error downstream).
// With `actor` (an actor's calls), after every call made before it to an
// actor that runs calls in order (ActorClient::order), as Ray runs one
// caller's calls in the order made; a call that ends before it could go
// (cancelled) stops holding up those behind it.
template <class Send>
void send_when_ready(const std::shared_ptr<ReplyState>& st, PyCall call, const RefList& top,
                     const std::shared_ptr<client::ActorClient>& actor, Send send) {
  client::CallOrder* order = actor ? actor->order() : nullptr;
  struct Pending {
    PyCall call;
    std::vector<std::pair<size_t, std::shared_ptr<ReplyState>>> answers;
    std::atomic<int> remaining{1};
  };
  auto p = std::make_shared<Pending>();
  p->call = std::move(call);
  p->call.top.resize(top.size());
  for (size_t i = 0; i < top.size(); ++i) {
    if (auto stored = top[i]->stored_if_any()) {
      p->call.top[i].ref = std::move(*stored);
    } else {
      p->answers.emplace_back(i, top[i]->answer());
    }
  }
  // A call still waiting for its arguments when its actor dies for good
  // fails then, as one already sent would: its arguments may never come.
  // (Only while it waits: arguments all there cost no listener.)
  const bool waits =
      std::any_of(p->answers.begin(), p->answers.end(), [](const auto& a) { return !a.second->ready(); });
  if (actor && waits) {
    std::weak_ptr<ReplyState> weak = st;
    auto die = [weak](const wire::ActorInfo& now) {
      if (now.state != wire::ActorState::kDead) return;
      if (auto s = weak.lock())
        s->set_error(
            std::make_exception_ptr(ActorDied("actor " + std::to_string(now.id) + " (" + now.class_name +
                                              ") died while the call waited for its arguments: " + now.death_cause)));
    };
    const uint64_t listener = actor->add_listener(die);
    std::weak_ptr<client::ActorClient> weak_actor = actor;
    st->on_ready([weak_actor, listener] {
      if (auto a = weak_actor.lock()) a->remove_listener(listener);
    });
    die(actor->info());
  }
  const uint64_t turn = order ? order->enter(p->answers.empty()) : client::CallOrder::kNoTurn;
  if (turn != client::CallOrder::kNoTurn) st->on_ready([actor, order, turn] { order->give_up(turn); });
  auto go = [p, st, send = std::move(send)]() mutable {
    for (auto& [i, a] : p->answers) {
      if (auto e = a->error()) return st->set_error(e);
      if (a->value().error) return st->set_value(a->value());
      p->call.top[i].inline_value = 1;
      p->call.top[i].value = a->value().value;
    }
    try {
      send(std::move(p->call));
    } catch (...) {
      st->set_error(std::current_exception());
    }
  };
  auto fire = [p, go = std::move(go), order, turn]() mutable {
    if (p->remaining.fetch_sub(1) != 1) return;
    if (turn == client::CallOrder::kNoTurn) return go();
    order->in_turn(turn, std::move(go));
  };
  p->remaining.fetch_add(static_cast<int>(p->answers.size()));
  for (auto& [i, a] : p->answers) a->on_ready(fire);
  fire();
}

// The refs a call carries (nested in its arguments, and top-level ones
// sent as refs), held by the caller until the call has its answer: a
// retry (the worker died) sends the same message again, and its refs must
// still be there although the first attempt's worker used up their pins
// and the caller's program may have dropped its own handles (Ray keeps a
// task's arguments until it is done, retries included).
std::shared_ptr<const std::vector<ObjectRef<PyValue>>> refs_of(const PyCall& c) {
  if (c.args.refs.empty() && c.top.empty()) return nullptr;
  auto held = std::make_shared<std::vector<ObjectRef<PyValue>>>(c.args.refs);
  for (const auto& arg : c.top) {
    if (!arg.inline_value && arg.ref.valid()) held->push_back(arg.ref);
    // A top-level argument that was a call's answer goes inline: the refs
    // inside that value too (no one else held them, and a retry found
    // them freed once the first attempt's worker died).
    if (arg.inline_value) held->insert(held->end(), arg.value.refs.begin(), arg.value.refs.end());
  }
  return held;
}

// A ConfigError naming the size when the encoded spec of a Python actor
// is more than the head takes.
void check_spec_size(const std::string& class_name, wire::Encoder& e) {
  size_t size = e.bytes().size();
  for (const auto& b : e.attachments()) size += b.size();
  if (size > kMaxSpecBytes)
    throw ConfigError("actor " + class_name + ": its class and constructor arguments pickle to " +
                      std::to_string(size) + " bytes, more than the " + std::to_string(kMaxSpecBytes) +
                      " the head keeps for an actor (for its restarts); pass large values as troupe.put() refs");
}

}  // namespace

InitOptions resolve_init_options(std::string address, std::string token) {
  InitOptions o;
  o.address = std::move(address);
  // A malformed address (port 0 or past 65535 included) is named as that,
  // before the token it would need is looked for.
  if (!o.address.empty() && o.address != "auto") wire::parse_address(o.address);
  o.token = token.empty() ? core::clean_token(core::env_value(core::kEnvToken), core::kEnvToken) : std::move(token);
  if (o.address == "auto" || (!o.address.empty() && o.token.empty())) core::check_session_dir(core::session_dir());
  if (o.address == "auto") {
    std::string dir = core::session_dir();
    o.address = core::read_session_file(dir, "address");
    if (o.address.empty()) throw ConfigError("address 'auto': no running cluster in " + dir + " (troupe start --head)");
  }
  if (!o.address.empty() && o.token.empty()) o.token = core::read_session_file(core::session_dir(), "token");
  return o;
}

PyClient::PyClient(const InitOptions& options) : runtime_(Runtime::connect(options)), driver_(true), pid_(::getpid()) {}

PyClient::PyClient(std::shared_ptr<client::Core> core) : runtime_(Runtime::attach(std::move(core))) {}

PyClient::~PyClient() { shutdown(); }

void PyClient::shutdown() {
  if (!driver_) return;
  if (::getpid() != pid_) {
    // A fork's child (os.fork, multiprocessing's "fork"): the runtime's
    // threads live in the parent only, so a shutdown here would wait for
    // answers no thread reads, and joining them fails. The child leaves
    // the parent's runtime as it is, and never destroys it.
    static auto* left_by_fork = new std::vector<Runtime>;
    left_by_fork->push_back(std::move(runtime_));
    return;
  }
  runtime_.shutdown();
}

std::shared_ptr<client::ActorClient> PyClient::spawn(const std::string& class_name, PyActorSpec spec,
                                                     const PyOptions& o) {
  head::validate_max_concurrency(o.max_concurrency);
  head::validate_concurrency_groups(o.concurrency_groups, class_name);
  head::validate_resources(o.resources, "actor " + class_name + " options");
  wire::ActorSpec s;
  s.type_key = kPyActorKey;
  s.class_name = class_name;
  wire::Encoder e = wire::encode_value(spec);
  // Refused (too large, a name taken: ConfigError), the creation sent
  // nothing a worker will decode: its refs' pins are given back (in Python
  // an actor handle's lifetime ref, which kept that actor alive). After any
  // other error the head may have made the actor.
  wire::Unsent unsent = e.take_unsent();
  check_spec_size(class_name, e);
  s.ctor_args = std::move(e.bytes());
  s.ctor_attachments = std::move(e.attachments());
  s.resources = o.resources;
  s.name = o.name;
  s.max_restarts = o.max_restarts;
  s.max_task_retries = o.max_task_retries;
  s.max_concurrency = o.max_concurrency;
  s.concurrency_groups = o.concurrency_groups;
  s.executable = o.executable;
  s.env = o.env;
  s.placement_group = o.placement_group;
  s.bundle_index = o.bundle_index;
  s.detached = o.detached;
  s.node_affinity = o.node_affinity;
  s.affinity_soft = o.affinity_soft;
  auto info = unsent.sent_by([&] { return core()->create_actor(std::move(s)); });
  auto actor = core()->actor(info);
  // A restart runs the constructor again from the spec, with the same refs:
  // their objects are held here while the actor may still restart (until
  // it is DEAD), as Ray's owner keeps an actor's constructor arguments.
  if (auto held = refs_of(spec.ctor)) {
    auto holder = std::make_shared<std::mutex>();
    auto refs = std::make_shared<decltype(held)>(std::move(held));
    auto let_go = [holder, refs] {
      std::shared_ptr<const std::vector<ObjectRef<PyValue>>> gone;  // released after the lock
      std::lock_guard lock(*holder);
      gone = std::move(*refs);
    };
    actor->add_listener([let_go](const wire::ActorInfo& now) {
      if (now.state == wire::ActorState::kDead) let_go();
    });
    // Dead already (before the listener was there): nothing will restart.
    if (actor->info().state == wire::ActorState::kDead) let_go();
  }
  return actor;
}

std::shared_ptr<PyRef> PyClient::call(client::ActorClient& actor, PyCall call, const RefList& top,
                                      std::shared_ptr<PyRef> keep, uint32_t group, std::optional<int> max_retries) {
  if (group > wire::kMaxConcurrencyGroups)
    throw ConfigError("concurrency group #" + std::to_string(group) + " is out of range");
  if (max_retries && *max_retries < -1)
    throw ConfigError("max_task_retries must be >= -1, got " + std::to_string(*max_retries));
  auto st = std::make_shared<ReplyState>();
  auto client = actor.shared_from_this();
  auto cancel = std::make_shared<client::CallCancel>(call.target, client);
  // May run on the I/O thread (when an argument's answer arrives).
  auto send = [client, st, keep, cancel, max_retries, op = group << client::kCallGroupShift](PyCall c) {
    cancel->submit_once([&] {
      client::Core* core = &client->core();
      // A streaming call is never resent: its stream takes one writer. The
      // caller's ObjectRefGenerator makes it again, on a new stream, past
      // the values it already has.
      std::optional<int> retries = max_retries;
      if (c.stream_id != 0) retries = 0;
      auto held = refs_of(c);
      return client->submit(
          op, wire::encode_value(c),
          [st, core, keep, held](wire::Message& m) { client::complete_call<PyReply>(*st, m, core); },
          [st, keep, held](std::exception_ptr ex) { st->set_error(ex); }, retries);
    });
  };
  send_when_ready(st, std::move(call), top, client, std::move(send));
  return std::make_shared<PyRef>(core(), st, std::move(cancel));
}

PyTaskKey PyClient::task_key(const PyOptions& o) {
  if (o.max_retries < -1) throw ConfigError("max_retries must be >= -1, got " + std::to_string(o.max_retries));
  client::TaskPlacement p;
  p.resources = o.resources;
  p.executable = o.executable;
  p.env = o.env;
  p.placement_group = o.placement_group;
  p.bundle_index = o.bundle_index;
  p.node_affinity = o.node_affinity;
  p.affinity_soft = o.affinity_soft;
  p.max_calls = o.max_calls;
  auto submitter = core()->service<client::TaskSubmitter>();
  return PyTaskKey{submitter->key_for(p), o.name, o.max_retries};
}

std::shared_ptr<PyRef> PyClient::submit(const PyTaskKey& key, PyCall call, const RefList& top) {
  auto st = std::make_shared<ReplyState>();
  auto submitter = core()->service<client::TaskSubmitter>();
  auto task = std::make_shared<client::TaskCancel>(key.name, submitter->instance());
  call.task = task->token();
  // May run on the I/O thread (when an argument's answer arrives).
  auto send = [submitter, key, st, task, core = core().get()](PyCall c) {
    task->submit_once([&] {
      wire::Encoder e;
      wire::encode(e, std::string(kPyTaskName));
      wire::encode(e, task->token());
      wire::encode(e, c);
      auto held = refs_of(c);
      return submitter->submit(
          key.key, key.name, std::move(e), key.max_retries,
          [st, core, held](wire::Message& m) { client::complete_call<PyReply>(*st, m, core); },
          [st, held](std::exception_ptr ex) { st->set_error(ex); });
    });
  };
  send_when_ready(st, std::move(call), top, nullptr, std::move(send));
  return std::make_shared<PyRef>(core(), st, std::move(task));
}

namespace {

std::string outcome_name(CancelOutcome outcome) {
  switch (outcome) {
    case CancelOutcome::kFinished:
      return "done";
    case CancelOutcome::kNotStarted:
      return "dequeued";
    case CancelOutcome::kKilled:
      return "killed";
    case CancelOutcome::kStarted:
      break;
  }
  return "started";
}

}  // namespace

std::string PyClient::cancel(const PyRef& ref, bool force, bool recursive) {
  auto st = const_cast<PyRef&>(ref).answer();
  // What was sent on: the worker marks it (one not started never starts),
  // interrupts a running task and cancels an async method's coroutine, and
  // with `recursive` the tasks it submitted.
  auto interrupt = [recursive](client::ActorClient& worker, uint64_t token) {
    return worker.control(PyInterruptTask{token, recursive});
  };
  constexpr client::CancelApi api{"troupe.cancel", "troupe.init", "force=True", "troupe.kill"};
  if (const auto& call = ref.call()) return outcome_name(call->cancel(*core(), *st, force, api, interrupt));
  const auto& task = ref.task();
  if (!task)
    throw ConfigError("troupe.cancel takes the ref of a task or actor method call made by this process, not a put's");
  return outcome_name(task->cancel(*core()->service<client::TaskSubmitter>(), *st, force, api, interrupt));
}

std::shared_ptr<PyRef> PyClient::put(PyValue value) {
  auto store = core()->service<client::ObjectStore>();
  return std::make_shared<PyRef>(core(), ObjectRef<PyValue>(store->put(client::make_object_value(std::move(value)))));
}

std::shared_ptr<PyRef> PyClient::actor_lifetime(uint64_t actor_id) {
  auto store = core()->service<client::ObjectStore>();
  client::ObjectValue v = client::make_object_value(PyValue{});
  std::weak_ptr<client::Core> weak = core();
  // The value goes when the store lets the object go: no handle or call is
  // left in this process, and no borrower anywhere.
  v.value = std::shared_ptr<const void>(v.value.get(), [kept = v.value, weak, actor_id](const void*) {
    auto core = weak.lock();
    if (!core) return;
    try {
      core->head().request(wire::Op::kKillActor,
                           wire::encode_inline(wire::KillActor{actor_id, true, "all its handles went out of scope"}));
    } catch (const std::exception& e) {
      TROUPE_LOG_DEBUG("actor {} went out of scope, but the head was not told: {}", actor_id, e.what());
    }
  });
  return std::make_shared<PyRef>(core(), ObjectRef<PyValue>(store->put(std::move(v))));
}

std::shared_ptr<client::ActorClient> PyClient::get_actor(const std::string& name) {
  return core()->actor(core()->head().call<wire::ActorInfo>(wire::Op::kGetActor, name));
}

wire::ActorInfo PyClient::actor_info(uint64_t id) { return core()->actor(id)->info(); }

// ---- placement groups --------------------------------------------------------

namespace {

wire::PlacementStrategy strategy_from(const std::string& name) {
  if (name == "PACK") return wire::PlacementStrategy::kPack;
  if (name == "SPREAD") return wire::PlacementStrategy::kSpread;
  if (name == "STRICT_PACK") return wire::PlacementStrategy::kStrictPack;
  if (name == "STRICT_SPREAD") return wire::PlacementStrategy::kStrictSpread;
  throw ConfigError("unknown placement strategy '" + name + "' (known: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD)");
}

// One round of waiting for group `id` on the head, without blocking a
// thread: the head answers when the group is reserved or after a while,
// and an unreserved answer asks again. Runs its continuation on the I/O
// thread.
void wait_group_async(std::shared_ptr<client::Core> core, uint64_t id, std::shared_ptr<ReplyState> st,
                      std::shared_ptr<PyValue> value) {
  constexpr uint32_t kRoundMs = 10000;
  Future<wire::Message> f;
  try {
    f = core->head().request(wire::Op::kWaitPlacementGroup,
                             std::move(wire::encode_value(wire::WaitPlacementGroup{id, kRoundMs}).bytes()));
  } catch (...) {
    st->set_error(std::current_exception());
    return;
  }
  f.on_ready([core, id, st, value, f]() mutable {
    try {
      wire::Message m = f.get();
      auto info = wire::decode_value<wire::PlacementGroupInfo>(m.body.data(), m.body.size(), &m.attachments);
      if (info.state == wire::PlacementGroupState::kCreated) {
        PyReply reply;
        reply.value = std::move(*value);
        st->set_value(std::move(reply));
      } else if (info.state == wire::PlacementGroupState::kRemoved) {
        throw Error("placement group " + std::to_string(id) + " was removed before it was ready");
      } else {
        wait_group_async(std::move(core), id, std::move(st), std::move(value));
      }
    } catch (...) {
      st->set_error(std::current_exception());
    }
  });
}

}  // namespace

wire::PlacementGroupInfo PyClient::create_placement_group(const std::vector<Resources>& bundles,
                                                          const std::string& strategy, const std::string& name,
                                                          bool detached) {
  if (bundles.empty()) throw ConfigError("a placement group needs at least one bundle, got none");
  return runtime_.create_placement_group(bundles, strategy_from(strategy), name, detached).info();
}

wire::PlacementGroupInfo PyClient::wait_placement_group(uint64_t id, std::chrono::milliseconds timeout) {
  uint32_t ms = static_cast<uint32_t>(std::min<int64_t>(timeout.count(), UINT32_MAX));
  return core()->head().call<wire::PlacementGroupInfo>(wire::Op::kWaitPlacementGroup, wire::WaitPlacementGroup{id, ms},
                                                       timeout + std::chrono::seconds(5));
}

wire::PlacementGroupInfo PyClient::placement_group_info(uint64_t id) {
  return core()->head().call<wire::PlacementGroupInfo>(wire::Op::kGetPlacementGroup, id);
}

void PyClient::remove_placement_group(uint64_t id) { core()->head().call<void>(wire::Op::kRemovePlacementGroup, id); }

std::shared_ptr<PyRef> PyClient::placement_group_ready(uint64_t id, PyValue value) {
  auto st = std::make_shared<ReplyState>();
  wait_group_async(core(), id, st, std::make_shared<PyValue>(std::move(value)));
  return std::make_shared<PyRef>(core(), st);
}

}  // namespace troupe::py
