// The client side of the runtime inside one process (a driver or a worker):
// the connection to the head, and one ActorClient per actor this process
// calls. ActorClient keeps a direct connection to the actor's worker, sends
// calls in order, matches replies, fails calls in flight with ActorDied when
// the worker goes away (or queues them again when max_task_retries allows),
// and follows the actor across restarts through the head's updates.
//
// The core is the one owner of the process's runtime state: its I/O thread,
// its control handlers, and the services that layers above attach to it
// (the stream listener, the collective group table). Shutting it down joins
// every thread it owns; nothing of it lives in a process-wide static.
#pragma once

#include <asio.hpp>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <typeindex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "troupe/runtime/client/control.h"
#include "troupe/runtime/core/future.h"
#include "troupe/runtime/wire/protocol.h"
#include "troupe/runtime/wire/rpc.h"

namespace troupe::client {

class Core;

// Keeps one process's calls to an actor in the order they were made when
// some wait for their arguments first (a Future or a call's ref not yet
// answered), as Ray does for an actor that runs one call at a time: a call
// made after one that waits is sent after it. A call whose arguments are
// there while none waits goes at once, without a lock (enter gives no
// turn).
class CallOrder {
 public:
  static constexpr uint64_t kNoTurn = std::numeric_limits<uint64_t>::max();
  // When a call is made; `ready`: its arguments are all there. kNoTurn:
  // send it now. Otherwise its turn, for in_turn (or give_up).
  uint64_t enter(bool ready) {
    if (ready && waiting_.load(std::memory_order_acquire) == 0) return kNoTurn;
    std::lock_guard lock(mu_);
    if (released_) return kNoTurn;
    waiting_.fetch_add(1, std::memory_order_acq_rel);
    return next_turn_++;
  }
  // Once the call of `turn` can go (its arguments are there, or one
  // failed): runs `go` (which sends or fails it) after every earlier turn's
  // has run, on this thread or on the one that ran the turn before it.
  // Nothing, for a turn given up.
  void in_turn(uint64_t turn, std::function<void()> go);
  // The call of `turn` ended before it could go (cancelled, failed): the
  // calls behind it no longer wait for it, and its in_turn runs nothing.
  void give_up(uint64_t turn);
  // The actor is gone (DEAD): no call waits behind another any more; turns
  // still open run their `go` at once when it comes (which fails them).
  void release_all();

 private:
  // Runs the ready turns in order (mu_ held by `lock`, running_ set).
  void run_ready(std::unique_lock<std::mutex>& lock);
  std::mutex mu_;
  std::atomic<uint64_t> waiting_{0};  // turns given that have not gone yet
  uint64_t next_turn_ = 0;
  uint64_t next_to_go_ = 0;
  // Turns that can go, behind one that cannot; an empty function: given up.
  std::map<uint64_t, std::function<void()>> ready_;
  std::set<uint64_t> given_up_;  // turns passed without their in_turn, which must run nothing
  bool running_ = false;         // a thread runs the ready turns
  bool released_ = false;
};

class ActorClient : public std::enable_shared_from_this<ActorClient> {
 public:
  using Complete = std::function<void(wire::Message&)>;
  using Fail = std::function<void(std::exception_ptr)>;

  ActorClient(Core& core, wire::ActorInfo info);

  // Sends method `method` with encoded args; `complete` gets the reply (OK
  // or error status), `fail` an ActorDied. Thread-safe; calls from one
  // thread go out in order. Returns the call's id (unique in the process:
  // the token its actor knows it by, task_cancel.h), for withdraw().
  // `max_retries` (-1: without limit) overrides the actor's
  // max_task_retries for this call: 0 for one that must not be sent twice
  // (a streaming call, whose stream takes one writer).
  uint64_t submit(uint32_t method, wire::Encoder&& args, Complete complete, Fail fail,
                  std::optional<int> max_retries = std::nullopt);
  // Takes call `call_id` back (CallCancel): it is never sent (again, after
  // a restart). One that was sent stays in flight, so that its reply, if
  // one comes, is still decoded (refs in it registered and let go); its
  // future has failed by then and keeps that. Says where it was.
  enum class Withdrawn {
    kNone,    // answered or failed already, or not a call of this client
    kQueued,  // never sent (the actor was connecting or restarting): dropped
    kSent,    // on its way to the actor, or there: tell it (CancelTask)
  };
  Withdrawn withdraw(uint64_t call_id);
  // Sends a typed control message, handled by the worker's I/O thread.
  template <ControlMessage M>
  Future<typename M::Reply> control(const M& message) {
    return typed_control_reply<M>(control(M::kControlTag, wire::encode_inline(message)), &core_);
  }
  // The same, already encoded: `body` is the Codec encoding of the message
  // registered under `tag`.
  Future<wire::Message> control(const std::string& tag, std::string body);

  void on_update(const wire::ActorInfo& info);
  // Holds `refs` (Encoder::take_kept: the constructor's ObjectRefs, which
  // each restart decodes again) until the actor is DEAD.
  void keep_until_dead(std::shared_ptr<const void> refs);
  // Calls in flight when the connection closes fail at once with the
  // connection's reason, not after waiting for the head's death cause
  // (the orphans waiting now fail so too).
  void stop_awaiting_causes();
  // The core is shutting down (its I/O loop has stopped): drops the
  // connection while the core's io_context is still there, fails every
  // call in flight or queued, and makes later calls, control messages and
  // waits fail at once with a ConnectionError. A handle may outlive its
  // Runtime; this is what it then reaches.
  void detach(const std::string& reason);
  // Runs `cb` (on the I/O thread) on every state change the head reports.
  // Runs `cb` on every update; returns the id remove_listener takes.
  uint64_t add_listener(std::function<void(const wire::ActorInfo&)> cb);
  void remove_listener(uint64_t listener_id);
  wire::ActorInfo info() const;
  // Waits until the actor is ALIVE (true) or DEAD (false).
  bool wait_ready(std::chrono::milliseconds timeout);
  uint64_t id() const { return id_; }
  Core& core() const { return core_; }
  // This process's calls to the actor in the order made (send_when_ready):
  // for an actor that runs one call at a time (ActorInfo::in_order); null
  // for others, whose calls Ray leaves unordered.
  CallOrder* order() { return in_order_.load(std::memory_order_acquire) ? &order_ : nullptr; }

 private:
  struct Pending {
    uint64_t id;
    wire::OutFrame frame;
    Complete complete;
    Fail fail;
    int retries_left;
    bool sent = false;       // its frame went out once (it may be queued again for a retry)
    bool cancelled = false;  // withdrawn while in flight: answered, never retried
    // Given back when it goes never sent (Encoder::take_unsent).
    wire::Unsent unsent;
  };
  void connect_locked();
  // Bytes of calls queued for the actor past which a caller waits to send
  // more (wait_for_backlog).
  static constexpr uint64_t kMaxCallBacklog = 256ull << 20;
  void wait_for_backlog(const wire::Message& m);
  // A connect failed while the head still says its process is alive:
  // connect_locked() again after connect_backoff_ (doubled each time, reset
  // by a connect that succeeds). One timer at a time (retry_pending_).
  void retry_connect_later_locked();
  static constexpr std::chrono::milliseconds kConnectBackoffMin{10};
  static constexpr std::chrono::milliseconds kConnectBackoffMax{1000};
  void on_connected(std::shared_ptr<wire::Connection> c, uint32_t incarnation, const std::string& error);
  void on_reply(wire::Message&& m);
  void on_closed(uint32_t incarnation, const std::string& reason);
  // Fails or re-queues everything in flight (lock held; returns failures to
  // run after unlocking). With `await_cause` (the connection closed and the
  // head has not said why yet) the calls that fail wait, as orphans_, for
  // the head's update to name the death cause, at most kCauseWait.
  std::vector<std::pair<Fail, std::exception_ptr>> drop_inflight_locked(const std::string& reason,
                                                                        bool await_cause = false);
  // Fails the orphans with `cause` (all of them, or those of incarnations
  // below `before`).
  std::vector<std::pair<Fail, std::exception_ptr>> fail_orphans_locked(
      const std::string& cause, uint32_t before = std::numeric_limits<uint32_t>::max());
  // Fails the orphans whose deadline is not after `now`.
  void fail_overdue_orphans(std::chrono::steady_clock::time_point now);
  // ActorDied for an orphan: naming `cause`, or ("") the connection's reason.
  struct Orphan;
  std::exception_ptr orphan_error_locked(const Orphan& o, const std::string& cause) const;
  static constexpr std::chrono::seconds kCauseWait{3};
  std::vector<std::pair<Fail, std::exception_ptr>> fail_all_locked(const std::string& reason);
  std::string detached_error_locked() const;

  Core& core_;
  const uint64_t id_;
  CallOrder order_;
  std::shared_ptr<const void> ctor_refs_;  // keep_until_dead; guarded by mu_
  std::atomic<bool> in_order_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  wire::ActorInfo info_;
  std::shared_ptr<wire::Connection> conn_;
  uint32_t conn_incarnation_ = 0;
  bool connecting_ = false;
  std::chrono::milliseconds connect_backoff_{0};
  bool retry_pending_ = false;
  std::unordered_map<uint64_t, Pending> inflight_;
  std::map<uint64_t, Pending> queued_;  // by call id, so retries keep their order
  // Calls that were in flight when the connection closed, not to be retried:
  // they fail once the head says why the process ended (or after
  // kCauseWait, with the connection's reason).
  struct Orphan {
    Fail fail;
    uint32_t incarnation;
    std::string reason;
    std::chrono::steady_clock::time_point deadline;
  };
  std::vector<Orphan> orphans_;
  // Off for a client whose updates nobody passes on any more (forgotten by
  // the core) or whose owner waits for the cause itself (a task executor's).
  bool await_causes_ = true;
  std::map<uint64_t, std::function<void(const wire::ActorInfo&)>> listeners_;  // by listener id
  uint64_t next_listener_id_ = 1;
  std::string detached_;  // why, once detach() ran
};

struct ConnectOptions {
  std::string address;
  std::string token;
  wire::Hello hello;  // role and, for workers, actor id + incarnation
  std::chrono::milliseconds timeout{10000};
  // How long to wait for a restarted head (one that writes its tables
  // through to a store) before the head counts as lost; 0 = never wait.
  // Default: TROUPE_HEAD_RECONNECT_MS, else 30 s.
  std::chrono::milliseconds head_reconnect = default_head_reconnect();
  static std::chrono::milliseconds default_head_reconnect();
};

class Core : public std::enable_shared_from_this<Core> {
 public:
  // Connects to the head and says hello; the reply is kept (workers read
  // their actor spec from it).
  static std::shared_ptr<Core> connect(const ConnectOptions& options);
  ~Core();

  asio::io_context& io() { return io_; }
  wire::RpcChannel& head() { return *head_; }
  // Asks the head for a new actor and returns its info. The request goes
  // out once more each time the head does not answer within the call's
  // timeout (a head that stalls; said in the log) or the connection drops
  // with it in flight (a durable head restarting): it carries an id, and the
  // head makes one actor per id, so the actor is made once (a request given
  // up on used to make one anyway, holding resources no one would use).
  // Throws what the head answers (ConfigError), ConnectionError once the
  // head is gone for good, and Error when `give_up` says so between asks.
  wire::ActorInfo create_actor(wire::ActorSpec spec, const std::function<bool()>& give_up = {});
  // The same for a placement group.
  wire::PlacementGroupInfo create_placement_group(wire::PlacementGroupSpec spec);
  const std::string& address() const { return address_; }
  const std::string& token() const { return token_; }
  const wire::HelloReply& hello_reply() const { return hello_reply_; }
  // The id this process said hello with (random, never 0; a worker's too):
  // the head's name for it across head restarts, and the scope of its
  // troupe.client/<id>/ keys (actor_keys.h).
  uint64_t client_id() const { return client_id_; }

  // The client for actor `info.id`, created and subscribed on first use.
  std::shared_ptr<ActorClient> actor(const wire::ActorInfo& info);
  // The same, knowing only the actor's id (asks the head).
  std::shared_ptr<ActorClient> actor(uint64_t id);
  // The same, from an ActorInfo that travelled inside a value (an
  // ActorHandle argument or result, decoded perhaps on the I/O thread):
  // never waits; subscribes in the background and applies the head's view
  // when it comes.
  std::shared_ptr<ActorClient> adopt_actor(const wire::ActorInfo& info);
  // This process's client for `info.id`, made and registered when it has
  // none (`second` says so).
  std::pair<std::shared_ptr<ActorClient>, bool> client_for(const wire::ActorInfo& info);
  // Drops this process's client for actor `id` (one it will never call
  // again, such as a released task executor), so clients do not pile up.
  void forget_actor(uint64_t id);
  // Called when the head connection drops for good: at once, or for a
  // durable head once it has not come back within head_reconnect.
  void set_on_head_lost(std::function<void(const std::string&)> cb) { on_head_lost_ = std::move(cb); }
  bool head_lost() const { return head_lost_.load(); }
  // Called on the I/O thread each time the channel to a durable head is
  // back after a drop, after this core's own resubscriptions: what an event
  // sent just before the drop told the head (it may have died unread or
  // unwritten), the caller tells it again.
  void set_on_reconnected(std::function<void()> cb);
  // The options of every connection this core makes or accepts: default
  // limits, and byte counters shared by all of them (traffic()).
  wire::ConnectionOptions connection_options() const { return {.counters = counters_}; }
  // Bytes read and written by this core's connections (head, actors,
  // streams, objects) since it started.
  const wire::ByteCounters& traffic() const { return *counters_; }
  // This process's control handlers (served by a worker's control listener).
  ControlTable& controls() { return controls_; }

  // The service of type S attached to this core, created on first use as
  // S(Core&). Services live until shutdown(), which destroys them in
  // reverse order of creation after the I/O thread has stopped (so their
  // I/O callbacks may use them without holding a reference). Throws Error
  // after shutdown. Not to be called from the I/O thread.
  template <class S>
  std::shared_ptr<S> service();
  // The service of type S if one was created, else null (never creates).
  template <class S>
  std::shared_ptr<S> find_service();

  // Stops the I/O thread and joins it, then destroys the services. Not to be
  // called from the I/O thread.
  void shutdown();

 private:
  struct Service {
    std::type_index type;
    std::shared_ptr<void> instance;
  };
  Core() = default;
  void on_event(wire::Message&& m);
  void resubscribe();
  // The head is gone for good: actors not alive now (pending, restarting)
  // can never be placed, and nothing would tell their clients so.
  void head_gone(const std::string& reason);

  asio::io_context io_;
  std::thread io_thread_;
  std::shared_ptr<wire::RpcChannel> head_;
  std::string address_, token_;
  wire::HelloReply hello_reply_;
  uint64_t client_id_ = 0;
  std::mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<ActorClient>> actors_;
  std::function<void(const std::string&)> on_head_lost_;
  std::function<void()> on_reconnected_;  // under mu_
  std::atomic<bool> head_lost_{false};
  bool shut_ = false;
  ControlTable controls_;
  std::shared_ptr<wire::ByteCounters> counters_ = std::make_shared<wire::ByteCounters>();
  std::mutex services_mu_;  // held while a service is created
  std::vector<Service> services_;
  bool services_closed_ = false;
};

template <class S>
std::shared_ptr<S> Core::service() {
  std::lock_guard lock(services_mu_);
  if (services_closed_) throw Error("the client core is shut down");
  for (auto& s : services_)
    if (s.type == std::type_index(typeid(S))) return std::static_pointer_cast<S>(s.instance);
  auto created = std::make_shared<S>(*this);
  services_.push_back(Service{std::type_index(typeid(S)), created});
  return created;
}

template <class S>
std::shared_ptr<S> Core::find_service() {
  std::lock_guard lock(services_mu_);
  for (auto& s : services_)
    if (s.type == std::type_index(typeid(S))) return std::static_pointer_cast<S>(s.instance);
  return nullptr;
}

}  // namespace troupe::client
