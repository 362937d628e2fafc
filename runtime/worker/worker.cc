#include "troupe/runtime/worker/worker.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <typeinfo>

#include "troupe/runtime/client/process_stats.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/client/task.h"
#include "troupe/runtime/client/task_cancel.h"
#include "troupe/runtime/client/task_controls.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/core/malloc_policy.h"
#include "troupe/runtime/worker/reply_watch.h"
#include "troupe/runtime/worker/stall_guard.h"
#include "troupe/runtime/worker/worker_context.h"

namespace troupe::worker {

using namespace troupe::wire;

namespace {

struct Job {
  std::shared_ptr<Connection> conn;
  Message msg;
};

class Mailbox {
 public:
  Mailbox() = default;
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;

  // False, with `j` left as it was, while the mailbox refuses work. Sets
  // `short_of_hands` when no drain thread waits for it (all are busy).
  bool push(Job& j, bool* short_of_hands = nullptr) {
    {
      std::lock_guard lock(mu_);
      if (refusing_) return false;
      q_.push_back(std::move(j));
      if (short_of_hands) *short_of_hands = waiting_ < static_cast<int>(q_.size());
    }
    cv_.notify_one();
    return true;
  }
  // From now until accept(), push refuses; returns what was queued.
  std::deque<Job> refuse() {
    std::lock_guard lock(mu_);
    refusing_ = true;
    return std::exchange(q_, {});
  }
  void accept() {
    std::lock_guard lock(mu_);
    refusing_ = false;
  }
  // What is queued now (its calls have not started).
  std::deque<Job> take_queued() {
    std::lock_guard lock(mu_);
    return std::exchange(q_, {});
  }
  bool empty() {
    std::lock_guard lock(mu_);
    return q_.empty();
  }
  Job pop() {
    std::unique_lock lock(mu_);
    ++waiting_;
    cv_.wait(lock, [&] { return !q_.empty(); });
    --waiting_;
    Job j = std::move(q_.front());
    q_.pop_front();
    return j;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> q_;
  bool refusing_ = false;
  int waiting_ = 0;  // drain threads waiting in pop()
};

// A task executor's answer to a task it will not start now: the task's own
// body and attachments go back with kBounced.
Message bounced(Message& call) {
  Message reply;
  reply.kind = Kind::REPLY;
  reply.id = call.id;
  reply.op = client::kBounced;
  reply.body = std::move(call.body);
  reply.attachments = std::move(call.attachments);
  return reply;
}

// Tells the head when the task a task executor runs starts and stops
// waiting in get(), so that its CPU serves other tasks meanwhile
// (LendResources). Installed on the thread of each call; sending is
// thread-safe and never blocks on the head. Meanwhile the executor starts
// nothing else: the tasks its submitter pipelined behind the waiting one,
// and those that arrive until it resumes, go back (kBounced) to run
// elsewhere, since one of them may be what it waits for.
//
// An async task's awaits each wait on a thread of their own and may
// overlap: the task waits from the first one's start to the last one's
// end. Waits left over when the task's call ends (abandoned awaits) no
// longer count (call_ended).
class CpuLender final : public core::WaitObserver {
 public:
  CpuLender(client::Core& core, uint64_t actor_id, uint32_t incarnation, Mailbox& mailbox)
      : core_(core), actor_id_(actor_id), incarnation_(incarnation), mailbox_(mailbox) {}
  void blocked() override {
    std::lock_guard lock(mu_);
    wait_epoch_ = epoch_;
    if (waiting_++ == 0) lend();
  }
  void unblocked() override {
    std::lock_guard lock(mu_);
    if (wait_epoch_ != epoch_ || waiting_ == 0) return;  // a wait of a call that has ended
    if (--waiting_ == 0) take_back();
  }
  void call_ended() {
    std::lock_guard lock(mu_);
    ++epoch_;
    if (std::exchange(waiting_, 0) > 0) take_back();
  }
  // Tells the head again whether the resources are lent now: a head that
  // died with the last telling unread came back with the state before it
  // (a repeat changes nothing).
  void tell_again() {
    std::lock_guard lock(mu_);
    tell(waiting_ > 0);
  }

 private:
  // Under mu_, so that the head hears lends and take-backs in their order.
  void lend() {
    tell(true);
    for (Job& j : mailbox_.refuse()) j.conn->send(bounced(j.msg), true);
  }
  void take_back() {
    mailbox_.accept();
    tell(false);
  }
  void tell(bool lend) {
    core_.head().send(make_event_value(Op::kLendResources, LendResources{actor_id_, incarnation_, lend}));
  }
  client::Core& core_;
  const uint64_t actor_id_;
  const uint32_t incarnation_;
  Mailbox& mailbox_;
  std::mutex mu_;
  int waiting_ = 0;     // waits open now, over all threads
  uint64_t epoch_ = 0;  // calls ended so far
  // The epoch in which this thread's wait began.
  static inline thread_local uint64_t wait_epoch_ = 0;
};

// Connects to the head as the worker of env's actor; a worker that cannot
// reach its head, or loses it for good (a durable head is waited for, and
// must take it back as its actor's current worker), has nothing to do and
// exits.
std::shared_ptr<client::Core> connect_to_head(const core::WorkerEnv& env) {
  client::ConnectOptions co;
  co.address = env.head_address;
  co.token = env.token;
  co.hello.role = Role::kWorker;
  co.hello.actor_id = env.actor_id;
  co.hello.incarnation = env.incarnation;
  co.hello.pid = getpid();
  std::shared_ptr<client::Core> core;
  try {
    core = client::Core::connect(co);
  } catch (const std::exception& e) {
    TROUPE_LOG_ERROR("cannot reach the head at {}: {}", co.address, e.what());
    std::_Exit(2);
  }
  core->set_on_head_lost([](const std::string& reason) {
    TROUPE_LOG_WARN("lost the head ({}); exiting", reason);
    // What the actor started goes too: the node agent that kills the rest
    // of an exited worker's group may be what is gone (a killed agent's
    // head connection drops first, and its parent-death signal can come
    // after this exit). The worker leads its group: it goes with it.
    if (::getpgrp() == ::getpid()) ::kill(0, SIGKILL);
    std::_Exit(0);
  });
  return core;
}

// Runs the actor's constructor from its spec; a missing constructor or one
// that throws is reported to the head (ActorInitFailed) and ends the process.
std::unique_ptr<client::HostedActor> construct_actor(client::Core& core, const core::WorkerEnv& env) {
  const ActorSpec& spec = core.hello_reply().spec;
  auto fail_init = [&](const std::string& error) {
    TROUPE_LOG_ERROR("actor {} ({}) failed to start: {}", env.actor_id, spec.class_name, error);
    // Not exited before the head has it (a request answered after it on the
    // same connection): one sent as a durable head died would be lost with
    // it, and the restarted head would take the exit for a crash (a restart
    // spent, the constructor run again). Told again after each failed ask
    // until the head is gone for good or six asks failed; a repeat changes
    // nothing. (A throw here ended the worker in std::terminate.)
    for (int ask = 0; ask < 6; ++ask) {
      core.head().send(make_event_value(Op::kActorInitFailed, ActorInitFailed{env.actor_id, env.incarnation, error}));
      try {
        core.head().call_empty<std::string>(Op::kStatus, std::chrono::seconds(5));
        break;
      } catch (const std::exception& e) {
        if (core.head().is_closed()) break;
        TROUPE_LOG_WARN("actor {}: telling the head it failed to start: {}; telling it again", env.actor_id, e.what());
      }
    }
    std::_Exit(1);
  };
  const client::ActorFactory* factory = client::find_factory(spec.type_key);
  if (!factory)
    fail_init("this executable has no constructor " + spec.class_name + " for the arguments given (key " +
              spec.type_key + "); is the worker executable the driver's binary?");
  try {
    Decoder d(spec.ctor_args.data(), spec.ctor_args.size(), &spec.ctor_attachments, &core);
    return factory->make(d);
  } catch (const std::exception& e) {
    // A plain troupe::Error says all itself (a Python constructor's
    // "ValueError: ..." and traceback); any other type is named.
    fail_init(typeid(e) == typeid(Error) ? std::string(e.what()) : type_name_of(e) + ": " + e.what());
  } catch (...) {
    fail_init("unknown exception");
  }
  return nullptr;  // not reached: fail_init exits
}

// StallGuard's confirmation: the head answers a worker it has not fenced.
// A durable head that is being restarted is waited for, as long as this
// worker's connection waits for it; a fenced worker's connection ends
// meanwhile, and the worker exits with it.
void ping_head(client::Core& core) {
  const auto until = std::chrono::steady_clock::now() + core::default_head_reconnect();
  for (;;) {
    try {
      core.head().call_empty<void>(Op::kPing, std::chrono::seconds(10));
      return;
    } catch (const Error& e) {
      const bool transient = dynamic_cast<const ConnectionError*>(&e) || dynamic_cast<const Timeout*>(&e);
      if (!transient || !core.hello_reply().durable || std::chrono::steady_clock::now() >= until) throw;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the connection is being made again
  }
}

// Serves one constructed actor: a call listener and a control listener, and
// either inline calls or a mailbox per concurrency group (the default one
// and ActorSpec::concurrency_groups), each drained by up to its group's
// max_concurrency threads.
//
// With one call at a time the actor runs calls on the thread that reads
// them (no hand-off: a synchronous call costs one wake-up here); control
// messages then come through their own listener on the core's I/O thread,
// which stays free while a call runs. With more concurrency, the I/O
// thread fills a mailbox that a pool of actor threads drains; so it does
// for a task executor, which must be able to hand back the calls queued
// behind a task that waits (CpuLender).
class ActorHost {
 public:
  ActorHost(std::shared_ptr<client::Core> core, std::unique_ptr<WorkerContext> context,
            std::unique_ptr<client::HostedActor> actor, const core::WorkerEnv& env)
      : core_(std::move(core)),
        context_(std::move(context)),
        actor_(std::move(actor)),
        // A task executor reads calls on the I/O thread even with one at a
        // time, so that it can hand back those queued behind a task that
        // waits (CpuLender).
        task_executor_(core_->hello_reply().spec.type_key == client::kTaskExecutorKey),
        inline_calls_(core_->hello_reply().spec.max_concurrency <= 1 && !task_executor_ &&
                      core_->hello_reply().spec.concurrency_groups.empty()),
        bind_host_(env.bind_host.empty() ? "127.0.0.1" : env.bind_host),
        // Callers reach the actor at the node's advertise host, never at a
        // wildcard bind address.
        advertise_host_(env.advertise_host.empty() ? default_advertise_host(bind_host_) : env.advertise_host),
        call_io_(inline_calls_ ? calls_io_ : core_->io()) {
    const ActorSpec& spec = core_->hello_reply().spec;
    lanes_.emplace_back(spec.max_concurrency, 1);  // serve()'s thread drains the default group
    method_lane_.assign(actor_->method_count(), 0);
    for (const auto& g : spec.concurrency_groups) {
      lanes_.emplace_back(g.max_concurrency, 0);
      for (const auto& name : g.methods) {
        bool found = false;
        for (size_t m = 0; m < method_lane_.size(); ++m)
          if (actor_->method_name(m) == name) {
            method_lane_[m] = static_cast<uint32_t>(lanes_.size() - 1);
            found = true;
          }
        // The creator's client checks the names; another may not have.
        if (!found)
          TROUPE_LOG_WARN("actor {}: concurrency group '{}' lists '{}', which it has no method of; ignored",
                          spec.class_name, g.name, name);
      }
    }
    if (task_executor_) lender_.emplace(*core_, env.actor_id, env.incarnation, lanes_.front().mailbox);
  }

  // Listens, tells the head the actor is ready, and serves; never returns.
  [[noreturn]] void serve(const core::WorkerEnv& env, int serving_fd) {
    auto call_listener = make_listener(call_io_, call_conns_);
    auto control_listener = make_listener(core_->io(), std::make_shared<ConnMap>());
    register_drop_connections();
    if (task_executor_) register_hand_back();
    ActorReady ready{env.actor_id, env.incarnation, format_address(advertise_host_, call_listener->port()), getpid(),
                     format_address(advertise_host_, control_listener->port())};
    // Sends made while the head is away wait and are replayed; one made
    // just before a durable head died is lost with it (unread, or read and
    // not yet written down): the restarted head would keep the actor
    // PENDING while it serves, or count a task executor's CPU as lent or
    // not when it is the other. Told again each time the head is back
    // (repeats change nothing); set before the first telling, so that a
    // reconnect between the two cannot miss it.
    core_->set_on_reconnected([this, ready] {
      core_->head().send(make_event_value(Op::kActorReady, ready));
      if (lender_) lender_->tell_again();
    });
    core_->head().send(make_event_value(Op::kActorReady, ready));
    if (serving_fd >= 0) {
      const char serving = 'S';
      (void)!::send(serving_fd, &serving, 1, MSG_NOSIGNAL);  // the agent may be gone
      ::close(serving_fd);
    }
    TROUPE_LOG_DEBUG("actor {} ({}) serving at {}", env.actor_id, core_->hello_reply().spec.class_name, ready.address);
    publish_stats(env.actor_id, env.incarnation);
    if (inline_calls_) {
      auto guard = asio::make_work_guard(calls_io_);
      calls_io_.run();
      std::_Exit(0);
    }
    drain(lanes_.front());
  }

 private:
  // Keeps every caller connection alive until it closes: added and erased
  // on the thread of the listener that accepted it, read by fault
  // injection's control handler on another.
  struct ConnMap {
    std::mutex mu;
    std::map<Connection*, std::shared_ptr<Connection>> all;
  };

  // One concurrency group's calls: its mailbox, and the threads that drain
  // it, started as calls find them all busy (up to the group's cap).
  struct Lane {
    Lane(int cap, int started) : max_hands(cap), hands(started) {}
    Mailbox mailbox;
    const int max_hands;
    int hands;  // started so far (on the I/O thread)
  };

  // The lane of a call: the group its op names, else its method's, else the
  // default one; nullopt for a group the actor does not have.
  std::optional<size_t> lane_of(uint32_t op) const {
    if (const uint32_t group = client::call_op_group(op); group != 0) {
      if (group >= lanes_.size()) return std::nullopt;
      return group;
    }
    const uint32_t method = client::call_op_method(op);
    return method < method_lane_.size() ? method_lane_[method] : 0;
  }

  Message run_call(Message& call) {
    stall_guard_.before_call();
    client::process_stats().calls.fetch_add(1, std::memory_order_relaxed);
    Message reply;
    reply.kind = Kind::REPLY;
    reply.id = call.id;
    try {
      Decoder d(call.body.data(), call.body.size(), &call.attachments, core_.get());
      Encoder e;
      bool keep = (call.op & client::kKeepResult) != 0;
      core::WaitObserverInstall observe(lender_ ? &*lender_ : nullptr);
      struct EndCall {
        CpuLender* lender;
        ~EndCall() {
          if (lender) lender->call_ended();
        }
      } end_call{lender_ ? &*lender_ : nullptr};
      // An actor's call is known by its call id to a cancel (task_cancel.h);
      // a task executor's task by the token in its body.
      const uint64_t token = task_executor_ ? 0 : call.id;
      const uint32_t method = client::call_op_method(call.op);
      if (!client::begin_task(token))
        throw TaskCancelled("call " + core_->hello_reply().spec.class_name + "." + actor_->method_name(method) +
                            " was cancelled before it started");
      struct EndTask {
        uint64_t token;
        ~EndTask() { client::end_task(token); }
      } end_task{token};
      actor_->invoke(method, d, e, keep ? &keep_result_ : nullptr);
      check_sendable(e.bytes(), e.attachments(), [&] {
        if (task_executor_) return "the result of task '" + client::last_task_run() + "'";
        return "the result of " + core_->hello_reply().spec.class_name + "." + actor_->method_name(method);
      });
      reply.body = std::move(e.bytes());
      reply.attachments = std::move(e.attachments());
    } catch (const std::exception& e) {
      set_error(reply, e);
    } catch (...) {
      set_unknown_error(reply);
    }
    // Also after a task that threw: it may have handed out refs to objects
    // it put before (a task executor that holds none is released when idle,
    // and its objects would go with it).
    if (lender_ && store_->stats().objects > 0) reply.op |= client::kHoldsObjects;
    return reply;
  }

  void handle_control(const std::shared_ptr<Connection>& c, Message& m) {
    try {
      auto request = decode_value<ControlRequest>(m.body);
      c->send(ok_response(m.id, core_->controls().find(request.tag)(request.body)), true);
    } catch (const std::exception& e) {
      c->send(error_response(m.id, e), true);
    } catch (...) {
      // A handler's `throw 42` escaped to the I/O thread and ended the
      // worker (std::terminate): the caller is told, as a method's is.
      Message r;
      r.kind = Kind::RESPONSE;
      r.id = m.id;
      set_unknown_error(r);
      c->send(std::move(r), true);
    }
  }

  void on_frame(const std::shared_ptr<Connection>& c, Message&& m) {
    if (m.kind == Kind::CALL) {
      const std::optional<size_t> lane = lane_of(m.op);
      if (!lane) {
        Message reply;
        reply.kind = Kind::REPLY;
        reply.id = m.id;
        set_error(reply,
                  ConfigError("the call names concurrency group #" + std::to_string(client::call_op_group(m.op)) +
                              "; actor " + core_->hello_reply().spec.class_name + " has " +
                              std::to_string(lanes_.size() - 1)));
        return c->send(std::move(reply));
      }
      if (inline_calls_) {
        // The reply leaves with the rest of this read batch, or while a
        // later call of it runs long (reply_watch_).
        reply_watch_->call_starts(c);
        Message reply = run_call(m);
        reply_watch_->call_ends();
        c->send(std::move(reply));
        return;
      }
      Lane& l = lanes_[*lane];
      Job j{c, std::move(m)};
      bool short_of_hands = false;
      if (!l.mailbox.push(j, &short_of_hands)) return c->send(bounced(j.msg));  // its executor's task waits
      if (short_of_hands) add_hand(l);
      return;
    }
    if (m.kind == Kind::REQUEST && static_cast<Op>(m.op) == Op::kControl) return handle_control(c, m);
    c->close("unexpected frame kind " + std::to_string(static_cast<int>(m.kind)) + " at a worker");
  }

  std::unique_ptr<Listener> make_listener(asio::io_context& io, std::shared_ptr<ConnMap> conns) {
    ListenerOptions options;
    options.connection = core_->connection_options();
    // A caller that reads is never dropped for the replies it asked for:
    // an in-order actor runs the calls of one read batch (up to 64) before
    // their replies go, and 40 pipelined calls of 8 MiB each passed the
    // write bound of 256 MiB; the caller was dropped as "not reading", its
    // calls failed as the actor's death, and retries ran them again. One
    // that truly stops reading is dropped by the send timeout, as the
    // object server's borrowers are.
    options.connection.max_queued_bytes = std::numeric_limits<uint64_t>::max();
    options.connection.send_timeout = std::chrono::seconds(120);
    return std::make_unique<Listener>(io, bind_host_, 0, core_->token(), options, [this, conns](auto c) {
      {
        std::lock_guard lock(conns->mu);
        conns->all[c.get()] = c;
      }
      std::weak_ptr<Connection> weak = c;
      c->start([] {},
               [weak, this](Message&& m) {
                 if (auto c = weak.lock()) on_frame(c, std::move(m));
               },
               [conns, raw = c.get()](const std::string& reason) {
                 TROUPE_LOG_DEBUG("caller connection closed: {}", reason);
                 std::lock_guard lock(conns->mu);
                 conns->all.erase(raw);
               });
    });
  }

  // Fault injection (FaultInjector::drop_connections): closes every caller
  // connection of the call listener, as a network fault would, while the
  // process lives on. Shut now, from the control thread: an inline actor's
  // listener thread runs its call, and a close posted there waited for the
  // call's end, whose reply went first (its caller saw no fault).
  void register_drop_connections() {
    core_->controls().set(DropConnections::kControlTag,
                          client::typed_control_handler<DropConnections>([conns = call_conns_](const DropConnections&) {
                            std::map<Connection*, std::shared_ptr<Connection>> all;
                            {
                              std::lock_guard lock(conns->mu);
                              all = conns->all;
                            }
                            for (auto& [raw, c] : all) c->sever("connection dropped (fault injection)");
                          }));
  }

  // A task executor's submitter takes back the tasks queued here for an
  // idle executor (HandBackQueued).
  void register_hand_back() {
    core_->controls().set(client::ObjectsHeld::kControlTag, client::typed_control_handler<client::ObjectsHeld>(
                                                                [store = store_](const client::ObjectsHeld&) {
                                                                  return static_cast<int64_t>(store->stats().objects);
                                                                }));
    core_->controls().set(client::HandBackQueued::kControlTag,
                          client::typed_control_handler<client::HandBackQueued>([this](const client::HandBackQueued&) {
                            auto jobs = lanes_.front().mailbox.take_queued();
                            for (Job& j : jobs) {
                              Message reply = bounced(j.msg);
                              reply.op |= client::kHandedBack;
                              j.conn->send(std::move(reply), true);
                            }
                            return static_cast<int32_t>(jobs.size());
                          }));
  }

  // Every second, the calls served and stream bytes received so far go to
  // the KV store when they changed (the head's /metrics sums them); the
  // first within 100 ms of the first call, so that a worker killed in its
  // first second (actors are SIGKILLed) is counted too. A thread of its
  // own: a KV put waits for the head, never on a call path.
  void publish_stats(uint64_t actor_id, uint32_t incarnation) {
    std::thread([core = core_, actor_id, incarnation] {
      const std::string key =
          std::string(client::kStatsKeyPrefix) + std::to_string(actor_id) + "." + std::to_string(incarnation);
      uint64_t last_calls = 0, last_bytes = 0;
      for (;;) {
        const bool reported = last_calls != 0 || last_bytes != 0;
        std::this_thread::sleep_for(reported ? std::chrono::milliseconds(1000) : std::chrono::milliseconds(100));
        auto& s = client::process_stats();
        const uint64_t calls = s.calls.load(std::memory_order_relaxed);
        const uint64_t bytes = s.stream_bytes.load(std::memory_order_relaxed);
        if (calls == last_calls && bytes == last_bytes) continue;
        try {
          core->head().call<void>(Op::kKvPut, KvEntry{key, client::format_stats(calls, bytes)});
          last_calls = calls;
          last_bytes = bytes;
        } catch (const std::exception&) {
          // The head is away or the process is ending: the next round tries again.
        }
      }
    }).detach();
  }

  // A call of lane `l` waits and every drain thread of it is busy: one
  // more, up to its group's max_concurrency (an async actor may run 100
  // calls at once, and used to start 100 threads whether or not it ever
  // did). On the I/O thread.
  void add_hand(Lane& l) {
    if (l.hands >= l.max_hands) return;
    try {
      std::thread([this, &l] { drain(l); }).detach();
    } catch (const std::system_error& e) {
      // At the process's thread limit. A hand is counted once its thread
      // runs (counted before, a group left with none took calls that never
      // ran). Threads it has will get to the call; with none, what waits
      // fails now and the next call tries again.
      if (l.hands > 0) return;
      for (Job& j : l.mailbox.take_queued()) {
        Message reply;
        reply.kind = Kind::REPLY;
        reply.id = j.msg.id;
        set_error(reply, Error("no thread could be started for the call to actor " +
                               core_->hello_reply().spec.class_name + ": " + e.what()));
        j.conn->send(std::move(reply));
      }
      return;
    }
    ++l.hands;
  }

  [[noreturn]] void drain(Lane& l) {
    for (;;) {
      Job j = l.mailbox.pop();
      Message reply = run_call(j.msg);
      // Written at once when nothing waits behind it; else the I/O thread
      // batches the replies of a pipelined burst into few writes.
      j.conn->send(reply, l.mailbox.empty());
    }
  }

  std::shared_ptr<client::Core> core_;
  // What this_actor answers (installed in run_worker); outlives the actor.
  std::unique_ptr<WorkerContext> context_;
  std::unique_ptr<client::HostedActor> actor_;
  const bool task_executor_;
  const bool inline_calls_;
  // Inline calls' only: sends replies that a long call would hold.
  const std::unique_ptr<ReplyWatch> reply_watch_ = inline_calls_ ? std::make_unique<ReplyWatch>() : nullptr;
  const std::string bind_host_;
  const std::string advertise_host_;
  asio::io_context calls_io_{1};  // one thread runs it: asio can skip some locking
  asio::io_context& call_io_;
  // [0]: the default group's; then ActorSpec::concurrency_groups' in order.
  // A deque: lanes stay where they are, for the threads draining them.
  std::deque<Lane> lanes_;
  std::vector<uint32_t> method_lane_;  // by method index: the lane of its group
  std::optional<CpuLender> lender_;    // a task executor's
  std::shared_ptr<ConnMap> call_conns_ = std::make_shared<ConnMap>();
  // The process's object store, looked up once (every call may ask it).
  const std::shared_ptr<client::ObjectStore> store_ = core_->service<client::ObjectStore>();
  // call_ref: the result stays in this process's object store; the reply
  // carries a ref, pinned until the caller has registered.
  const client::ObjectSink keep_result_ = [store = store_](client::ObjectValue v, Encoder& reply) {
    auto holder = store->put(std::move(v));
    store->encode_ref(reply, *holder);
  };
  // No call starts after a stall its node may have been fenced in before
  // the head says this worker still serves.
  StallGuard stall_guard_{std::chrono::milliseconds(std::max<uint32_t>(core_->hello_reply().fence_after_ms / 2, 1)),
                          [core = core_] { ping_head(*core); }};
};

// Before the actor allocates anything: see malloc_policy.h. The node agent
// refused a bad value at its start; one set for this actor alone is logged.
void apply_worker_malloc_policy() {
  try {
    if (std::string refused = core::apply_malloc_policy(core::malloc_policy_from_env()); !refused.empty())
      TROUPE_LOG_DEBUG("worker: {}", refused);
  } catch (const ConfigError& e) {
    TROUPE_LOG_ERROR("worker: {}; keeping the system allocator's defaults", e.what());
  }
}

}  // namespace

void run_worker(const core::WorkerEnv& env, int serving_fd) {
  core::init_logging("worker a" + std::to_string(env.actor_id));
  // A worker whose output is the log file its node agent gave it keeps it
  // under TROUPE_LOG_MAX_BYTES, as daemons do (a chatty trainer filled the
  // disk). What the actor starts is not told the file is its own.
  core::rotate_own_log_in_background();
  ::unsetenv(core::kEnvOwnLog);
  // What made this process the actor's worker is not passed on to what the
  // actor starts: a troupe program among its children (`troupe status`, a
  // helper of the same executable) said hello as a second worker of this
  // actor, and the head took its failure, or its ActorReady, as the
  // actor's. The identity (TROUPE_ACTOR_ID, TROUPE_GPU_IDS) stays: the
  // actor's code reads it.
  for (const char* name : {core::kEnvRole, core::kEnvServingFd, core::kEnvPoolFd, core::kEnvReadyFd}) ::unsetenv(name);
  if (serving_fd >= 0) ::fcntl(serving_fd, F_SETFD, ::fcntl(serving_fd, F_GETFD) | FD_CLOEXEC);
  apply_worker_malloc_policy();
  // Maps the agent's counter page now (and closes its descriptor), before
  // the actor can start a child that would inherit it.
  client::process_stats();
  std::shared_ptr<client::Core> core = connect_to_head(env);
  // The actor's constructor may already use this_actor.
  auto context =
      std::make_unique<WorkerContext>(env.actor_id, env.gpu_ids, std::make_unique<Runtime>(Runtime::attach(core)));
  WorkerContext::install(context.get());
  auto actor = construct_actor(*core, env);
  ActorHost host(core, std::move(context), std::move(actor), env);
  host.serve(env, serving_fd);  // never returns: the process exits from there
}

}  // namespace troupe::worker
