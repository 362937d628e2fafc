#include "troupe/runtime/client/core.h"

#include <algorithm>
#include <atomic>
#include <limits>

#include "troupe/runtime/client/task_cancel.h"
#include "troupe/runtime/client/task_submitter.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/core/process.h"
#include "troupe/runtime/core/random_id.h"
#include "troupe/runtime/core/worker_env.h"

namespace troupe::client {

std::chrono::milliseconds ConnectOptions::default_head_reconnect() { return core::default_head_reconnect(); }

namespace {
// How long a leaving client waits for the head to take its goodbye.
constexpr std::chrono::seconds kGoodbyeTimeout{2};

}  // namespace

using namespace troupe::wire;

ActorClient::ActorClient(Core& core, ActorInfo info)
    : core_(core), id_(info.id), in_order_(info.in_order && info.state != ActorState::kDead), info_(std::move(info)) {}

ActorInfo ActorClient::info() const {
  std::lock_guard lock(mu_);
  return info_;
}

bool ActorClient::wait_ready(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] {
        return info_.state == ActorState::kAlive || info_.state == ActorState::kDead || !detached_.empty();
      }))
    throw Timeout("actor " + std::to_string(id_) + " (" + info_.class_name + ") still " + to_string(info_.state) +
                  " after " + std::to_string(timeout.count()) + " ms" +
                  (info_.pending_reason.empty() ? "" : ": " + info_.pending_reason));
  if (!detached_.empty()) throw ConnectionError(detached_error_locked());
  return info_.state == ActorState::kAlive;
}

std::string ActorClient::detached_error_locked() const {
  return "actor " + std::to_string(id_) + " (" + info_.class_name + ") cannot be reached: " + detached_;
}

void ActorClient::detach(const std::string& reason) {
  std::vector<std::pair<Fail, std::exception_ptr>> failures;
  std::shared_ptr<Connection> conn;
  {
    std::lock_guard lock(mu_);
    if (!detached_.empty()) return;
    detached_ = reason;
    conn = std::move(conn_);
    connecting_ = false;
    auto error = std::make_exception_ptr(ConnectionError(detached_error_locked()));
    for (auto& [id, p] : inflight_) failures.emplace_back(std::move(p.fail), error);
    for (auto& [id, p] : queued_) failures.emplace_back(std::move(p.fail), error);
    for (auto& o : orphans_) failures.emplace_back(std::move(o.fail), error);
    inflight_.clear();
    queued_.clear();
    orphans_.clear();
    listeners_.clear();
  }
  cv_.notify_all();
  if (conn) conn->close(reason);
  conn.reset();
  for (auto& [f, e] : failures) f(e);
}

void CallOrder::in_turn(uint64_t turn, std::function<void()> go) {
  std::unique_lock lock(mu_);
  if (turn < next_to_go_) {
    // Passed without it: given up (nothing to do), or released (the actor
    // is gone: it goes now, and fails).
    if (given_up_.erase(turn) != 0) return;
    lock.unlock();
    go();
    return;
  }
  if (auto it = ready_.find(turn); it != ready_.end() && !it->second) return;  // given up, not passed yet
  ready_[turn] = std::move(go);
  run_ready(lock);
}

void CallOrder::give_up(uint64_t turn) {
  std::unique_lock lock(mu_);
  if (turn < next_to_go_ || ready_.count(turn) != 0) return;  // gone, or about to go: too late
  ready_.emplace(turn, nullptr);
  run_ready(lock);
}

void CallOrder::release_all() {
  std::unique_lock lock(mu_);
  released_ = true;
  // Every open turn may go: those whose arguments are not there yet go at
  // once when they come (in_turn above).
  for (uint64_t t = next_to_go_; t < next_turn_; ++t) ready_.try_emplace(t, std::function<void()>([] {}));
  run_ready(lock);
}

void CallOrder::run_ready(std::unique_lock<std::mutex>& lock) {
  if (running_) return;  // the running thread takes them in their turn
  running_ = true;
  while (!ready_.empty() && ready_.begin()->first == next_to_go_) {
    auto next = std::move(ready_.begin()->second);
    ready_.erase(ready_.begin());
    const bool given_up = !next;
    if (given_up) given_up_.insert(next_to_go_);
    ++next_to_go_;
    lock.unlock();
    if (next) {
      try {
        next();
      } catch (...) {
        // `go` reports its own failures to its call; nothing may stop the turns.
      }
    }
    waiting_.fetch_sub(1, std::memory_order_acq_rel);
    lock.lock();
  }
  running_ = false;
}

uint64_t ActorClient::submit(uint32_t method, Encoder&& args, Complete complete, Fail fail,
                             std::optional<int> max_retries) {
  // Given back (the pins of the refs it carries) unless the call goes out:
  // as it fails here, or is withdrawn or failed while queued.
  wire::Unsent unsent = args.take_unsent();
  wire::check_sendable(args.bytes(), args.attachments(), [&] {
    return "the arguments of a call to actor " + std::to_string(id_) + " (" + info().class_name + ")";
  });
  Message m;
  m.kind = Kind::CALL;
  m.op = method;
  m.body = std::move(args.bytes());
  m.attachments = std::move(args.attachments());
  wait_for_backlog(m);
  std::unique_lock lock(mu_);
  // Taken under the lock: calls of one client go out in the order of their
  // ids, which retries keep (queued_).
  m.id = unique_call_id();
  Pending p{m.id, encode_frame(m), std::move(complete), std::move(fail), max_retries.value_or(info_.max_task_retries)};
  p.unsent = std::move(unsent);
  if (!detached_.empty()) {
    auto f = std::move(p.fail);
    auto error = std::make_exception_ptr(ConnectionError(detached_error_locked()));
    lock.unlock();
    f(error);
    return m.id;
  }
  if (info_.state == ActorState::kDead) {
    auto f = std::move(p.fail);
    std::string cause = info_.death_cause;
    lock.unlock();
    f(std::make_exception_ptr(
        ActorDied("actor " + std::to_string(id_) + " (" + info_.class_name + ") is dead: " + cause)));
    return m.id;
  }
  if (conn_ && conn_->is_open() && queued_.empty()) {
    // A lone call goes out on this thread at once; calls behind others
    // in flight are batched by the I/O thread. The frame is kept only when
    // a retry may need it again.
    bool lone = inflight_.empty();
    p.sent = true;
    p.unsent.sent();
    if (p.retries_left != 0) {
      conn_->send(p.frame, lone);
    } else {
      conn_->send(std::move(p.frame), lone);
      p.frame = {};
    }
    inflight_.emplace(p.id, std::move(p));
    return m.id;
  }
  queued_.emplace(p.id, std::move(p));
  connect_locked();
  return m.id;
}

ActorClient::Withdrawn ActorClient::withdraw(uint64_t call_id) {
  Pending gone;  // its callbacks are let go after the lock
  std::lock_guard lock(mu_);
  if (auto it = queued_.find(call_id); it != queued_.end()) {
    // Queued again after its connection broke, it may be at the worker all
    // the same: tell it.
    const bool sent = it->second.sent;
    gone = std::move(it->second);
    queued_.erase(it);
    return sent ? Withdrawn::kSent : Withdrawn::kQueued;
  }
  if (auto it = inflight_.find(call_id); it != inflight_.end()) {
    it->second.cancelled = true;
    return Withdrawn::kSent;
  }
  return Withdrawn::kNone;
}

Future<Message> ActorClient::control(const std::string& tag, std::string body) {
  auto st = std::make_shared<core::FutureState<Message>>();
  std::string address;
  {
    std::lock_guard lock(mu_);
    if (!detached_.empty()) {
      st->set_error(std::make_exception_ptr(ConnectionError(detached_error_locked())));
      return Future<Message>(st);
    }
    if (info_.state != ActorState::kAlive || info_.control_address.empty()) {
      st->set_error(std::make_exception_ptr(
          ActorDied("actor " + std::to_string(id_) + " (" + info_.class_name + ") is " + to_string(info_.state))));
      return Future<Message>(st);
    }
    address = info_.control_address;
  }
  Message m;
  m.kind = Kind::REQUEST;
  m.op = static_cast<uint32_t>(Op::kControl);
  m.id = 1;
  m.body = encode_inline(ControlRequest{tag, std::move(body)});
  // Control messages use a short-lived connection to the worker's control
  // listener, which its I/O thread serves even while a call runs.
  // The core, not `this`: the caller may drop the last handle to this
  // client before the post runs (a control sent and not awaited).
  asio::post(core_.io(), [core = &core_, st, m = std::move(m), address] {
    std::pair<std::string, uint16_t> hp;
    try {
      hp = parse_address(address);
    } catch (...) {
      return st->set_error(std::current_exception());
    }
    // Weak: the connection's own pending read keeps it alive until the
    // answer; a strong pointer here would be a cycle through its handlers.
    auto holder = std::make_shared<std::weak_ptr<Connection>>();
    Connection::connect(
        core->io(), hp.first, hp.second, core->token(), core->connection_options(),
        [st, holder](Message&& r) {
          if (r.status != Status::OK)
            st->set_error(error_from_message(r));
          else
            st->set_value(std::move(r));
          if (auto c = holder->lock()) c->close("control answered");
          holder->reset();
        },
        [st, holder](const std::string& reason) {
          st->set_error(std::make_exception_ptr(ConnectionError("control connection closed: " + reason)));
          holder->reset();
        },
        [st, holder, m](std::shared_ptr<Connection> c, std::string error) {
          if (!c) return st->set_error(std::make_exception_ptr(ConnectionError("control connect failed: " + error)));
          *holder = c;
          c->send(m, true);
        });
  });
  return Future<Message>(st);
}

namespace {

// A connect that neither succeeds nor fails for kConnectHangs (packets to
// the address dropped: a node whose advertised address is not reachable
// from here) would otherwise end only with the kernel's SYN retries, some
// two minutes, while calls wait silently: say so, naming the address.
void warn_if_connect_hangs(asio::io_context& io, std::shared_ptr<std::atomic<bool>> pending, std::string who,
                           std::string address) {
  static constexpr std::chrono::seconds kConnectHangs{10};
  auto timer = std::make_shared<asio::steady_timer>(io, kConnectHangs);
  timer->async_wait([timer, pending, who = std::move(who), address = std::move(address)](const asio::error_code& ec) {
    if (ec || !pending->load()) return;
    TROUPE_LOG_WARN(
        "{}: no answer from its process at {} for {} s; calls to it wait. An actor that runs one call at a time "
        "answers a new caller between calls: it may be in a long one. Else, is that address reachable from here? (a "
        "node agent advertises what --advertise-address gives, else the address that routes to the head)",
        who, address, kConnectHangs.count());
  });
}

}  // namespace

// An actor that runs one call at a time reads the next when it gets to it:
// a caller whose arguments outpace it waits here while kMaxCallBacklog bytes
// are queued for it, where the connection's write bound used to drop it
// (failing calls to a live actor, some of which had run).
void ActorClient::wait_for_backlog(const Message& m) {
  std::shared_ptr<Connection> c;
  {
    std::lock_guard lock(mu_);
    c = conn_;
  }
  if (!c) return;
  c->wait_for_room(wire::payload_bytes(m.body, m.attachments), std::chrono::steady_clock::time_point::max(),
                   kMaxCallBacklog);
}

void ActorClient::connect_locked() {
  if (!detached_.empty() || connecting_ || info_.state != ActorState::kAlive || info_.address.empty()) return;
  if (conn_ && conn_->is_open() && conn_incarnation_ == info_.incarnation) {
    // Connected already: flush what queued up.
    for (auto& [id, p] : queued_) {
      conn_->send(p.frame);
      p.sent = true;
      p.unsent.sent();
      inflight_.emplace(id, std::move(p));
    }
    queued_.clear();
    return;
  }
  connecting_ = true;
  uint32_t inc = info_.incarnation;
  std::string address = info_.address;
  auto self = shared_from_this();
  auto pending = std::make_shared<std::atomic<bool>>(true);
  asio::post(core_.io(), [self, inc, address, pending] {
    std::pair<std::string, uint16_t> hp;
    try {
      hp = parse_address(address);
    } catch (const std::exception& e) {
      pending->store(false);
      return self->on_connected(nullptr, inc, e.what());
    }
    std::weak_ptr<ActorClient> weak = self;
    // No write bound: what queues here is the caller's own calls, held
    // back by wait_for_backlog, and resent whole after a reconnection.
    ConnectionOptions options = self->core_.connection_options();
    options.max_queued_bytes = std::numeric_limits<uint64_t>::max();
    Connection::connect(
        self->core_.io(), hp.first, hp.second, self->core_.token(), options,
        [weak](Message&& m) {
          if (auto s = weak.lock()) s->on_reply(std::move(m));
        },
        [weak, inc](const std::string& reason) {
          if (auto s = weak.lock()) s->on_closed(inc, reason);
        },
        [self, inc, pending](std::shared_ptr<Connection> c, std::string error) {
          pending->store(false);
          self->on_connected(std::move(c), inc, error);
        });
  });
  warn_if_connect_hangs(core_.io(), pending, "actor " + std::to_string(id_) + " (" + info_.class_name + ")", address);
}

void ActorClient::on_connected(std::shared_ptr<Connection> c, uint32_t incarnation, const std::string& error) {
  std::optional<ActorInfo> gone;  // the actor's end, told to this client's listeners outside the lock
  {
    std::lock_guard lock(mu_);
    connecting_ = false;
    if (!c) {
      TROUPE_LOG_DEBUG("actor {}: connect to incarnation {} failed: {}", id_, incarnation, error);
      if (queued_.empty()) return;
      if (incarnation != info_.incarnation) {
        // The head told of the process that replaced it while this connect
        // was under way (its update left the connect to finish): that one.
        connect_locked();
        return;
      }
      if (!core_.head_lost() || info_.state != ActorState::kAlive) {
        // The head still says this process is alive: it is gone and the
        // head does not know yet (its update comes, and connects), or the
        // connect failed on the way (a handshake timed out under load).
        // Again, later.
        retry_connect_later_locked();
        return;
      }
      // No head will say what became of it (a stopped cluster took the
      // process with it), and a live worker ends once its head is gone:
      // its end, now, rather than calls that wait for ever.
      gone = info_;
      gone->state = ActorState::kDead;
      gone->death_cause =
          "its process at " + info_.address + " cannot be reached (" + error + ") and the cluster's head is gone";
      ++gone->version;
    } else {
      connect_backoff_ = std::chrono::milliseconds(0);
      if (!detached_.empty()) {
        c->close("client detached");  // detach() ran while this connect was under way
        return;
      }
      if (incarnation != info_.incarnation || info_.state != ActorState::kAlive) {
        c->close("stale incarnation");
        connect_locked();
        return;
      }
      conn_ = std::move(c);
      conn_incarnation_ = incarnation;
      for (auto& [id, p] : queued_) {
        conn_->send(p.frame);
        p.sent = true;
        p.unsent.sent();
        inflight_.emplace(id, std::move(p));
      }
      queued_.clear();
    }
  }
  if (gone) on_update(*gone);
}

void ActorClient::retry_connect_later_locked() {
  // Calls submitted meanwhile connect at once; their failures share this
  // one timer rather than each arming another.
  if (retry_pending_) return;
  retry_pending_ = true;
  const auto before = connect_backoff_;
  connect_backoff_ = std::clamp(2 * connect_backoff_, kConnectBackoffMin, kConnectBackoffMax);
  if (connect_backoff_ == kConnectBackoffMax && before < kConnectBackoffMax)
    TROUPE_LOG_WARN(
        "actor {} ({}): cannot connect to its process at {}, which the head says is alive; calls wait "
        "and connects are retried every {} ms",
        id_, info_.class_name, info_.address, kConnectBackoffMax.count());
  auto timer = std::make_shared<asio::steady_timer>(core_.io(), connect_backoff_);
  std::weak_ptr<ActorClient> weak = shared_from_this();
  timer->async_wait([timer, weak](const asio::error_code& ec) {
    auto self = weak.lock();
    if (!self) return;
    std::lock_guard lock(self->mu_);
    self->retry_pending_ = false;
    if (!ec && !self->queued_.empty()) self->connect_locked();
  });
}

void ActorClient::on_reply(Message&& m) {
  Pending p;
  {
    std::lock_guard lock(mu_);
    auto it = inflight_.find(m.id);
    if (it == inflight_.end()) return;
    p = std::move(it->second);
    inflight_.erase(it);
  }
  p.complete(m);
}

std::vector<std::pair<ActorClient::Fail, std::exception_ptr>> ActorClient::drop_inflight_locked(
    const std::string& reason, bool await_cause) {
  std::vector<std::pair<Fail, std::exception_ptr>> failures;
  const size_t orphans_before = orphans_.size();
  for (auto& [id, p] : inflight_) {
    if (p.retries_left != 0 && !p.cancelled) {
      if (p.retries_left > 0) --p.retries_left;
      queued_.emplace(id, std::move(p));
    } else if (await_cause) {
      orphans_.push_back({std::move(p.fail), conn_incarnation_, reason, std::chrono::steady_clock::now() + kCauseWait});
    } else {
      failures.emplace_back(std::move(p.fail),
                            std::make_exception_ptr(ActorDied("actor " + std::to_string(id_) + " (" + info_.class_name +
                                                              ") died while the call was in flight: " + reason)));
    }
  }
  inflight_.clear();
  if (orphans_.size() > orphans_before) {
    // The head's update names the cause within moments of a death; a
    // connection that broke while the process lives gets no update, and
    // its calls fail with the connection's reason at their deadline.
    auto timer = std::make_shared<asio::steady_timer>(core_.io(), kCauseWait);
    std::weak_ptr<ActorClient> weak = shared_from_this();
    timer->async_wait([timer, weak](const asio::error_code&) {
      if (auto self = weak.lock()) self->fail_overdue_orphans(std::chrono::steady_clock::now());
    });
  }
  return failures;
}

void ActorClient::fail_overdue_orphans(std::chrono::steady_clock::time_point now) {
  std::vector<std::pair<Fail, std::exception_ptr>> late;
  {
    std::lock_guard lock(mu_);
    for (auto it = orphans_.begin(); it != orphans_.end();) {
      if (it->deadline > now) {
        ++it;
        continue;
      }
      late.emplace_back(std::move(it->fail), orphan_error_locked(*it, ""));
      it = orphans_.erase(it);
    }
  }
  for (auto& [f, e] : late) f(e);
}

std::exception_ptr ActorClient::orphan_error_locked(const Orphan& o, const std::string& cause) const {
  const std::string who = "actor " + std::to_string(id_) + " (" + info_.class_name + ")";
  if (!cause.empty()) return std::make_exception_ptr(ActorDied(who + " died while the call was in flight: " + cause));
  return std::make_exception_ptr(ActorDied(who + ": its connection closed while the call was in flight (" + o.reason +
                                           "), and the head named no death"));
}

void ActorClient::stop_awaiting_causes() {
  {
    std::lock_guard lock(mu_);
    await_causes_ = false;
  }
  fail_overdue_orphans(std::chrono::steady_clock::time_point::max());
}

std::vector<std::pair<ActorClient::Fail, std::exception_ptr>> ActorClient::fail_orphans_locked(const std::string& cause,
                                                                                               uint32_t before) {
  std::vector<std::pair<Fail, std::exception_ptr>> failures;
  for (auto it = orphans_.begin(); it != orphans_.end();) {
    if (it->incarnation >= before) {
      ++it;
      continue;
    }
    failures.emplace_back(std::move(it->fail), orphan_error_locked(*it, cause));
    it = orphans_.erase(it);
  }
  return failures;
}

std::vector<std::pair<ActorClient::Fail, std::exception_ptr>> ActorClient::fail_all_locked(const std::string& reason) {
  auto failures = drop_inflight_locked(reason);
  auto orphans = fail_orphans_locked(reason);
  failures.insert(failures.end(), std::make_move_iterator(orphans.begin()), std::make_move_iterator(orphans.end()));
  for (auto& [id, p] : queued_)
    failures.emplace_back(std::move(p.fail),
                          std::make_exception_ptr(ActorDied("actor " + std::to_string(id_) + " (" + info_.class_name +
                                                            ") is dead: " + reason)));
  queued_.clear();
  return failures;
}

void ActorClient::on_closed(uint32_t incarnation, const std::string& reason) {
  std::vector<std::pair<Fail, std::exception_ptr>> failures;
  {
    std::lock_guard lock(mu_);
    if (incarnation != conn_incarnation_ || !conn_) return;
    conn_.reset();
    // The head's update will say why, unless nobody passes it on.
    failures = drop_inflight_locked(reason, await_causes_ && !core_.head_lost());
    if (info_.state == ActorState::kDead) {
      auto more = fail_all_locked(info_.death_cause);
      failures.insert(failures.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
    }
    // If the head still says ALIVE at this incarnation, its update will
    // follow; try once more in case only the connection broke.
    if (!queued_.empty()) connect_locked();
  }
  for (auto& [f, e] : failures) f(e);
}

uint64_t ActorClient::add_listener(std::function<void(const ActorInfo&)> cb) {
  std::lock_guard lock(mu_);
  uint64_t id = next_listener_id_++;
  listeners_.emplace(id, std::move(cb));
  return id;
}

void ActorClient::remove_listener(uint64_t listener_id) {
  std::lock_guard lock(mu_);
  listeners_.erase(listener_id);
}

void ActorClient::keep_until_dead(std::shared_ptr<const void> refs) {
  std::lock_guard lock(mu_);
  if (info_.state != ActorState::kDead) ctor_refs_ = std::move(refs);
}

void ActorClient::on_update(const ActorInfo& info) {
  std::vector<std::pair<Fail, std::exception_ptr>> failures;
  std::vector<std::function<void(const ActorInfo&)>> listeners;
  std::shared_ptr<const void> dropped_refs;  // released after the lock: a release may send
  {
    std::lock_guard lock(mu_);
    // A stale view (an older incarnation, or a subscribe reply that lost
    // the race with a newer event) changes nothing.
    if (info.incarnation < info_.incarnation || info.version < info_.version) return;
    info_ = info;
    if (!detached_.empty()) return;
    // Calls orphaned by an earlier process's connection: now the cause is
    // known (a restart or a death).
    failures = fail_orphans_locked(info.death_cause.empty() ? "its process ended" : info.death_cause,
                                   info.state == ActorState::kDead ? UINT32_MAX : info.incarnation);
    if (conn_ && conn_incarnation_ != info.incarnation) {
      // A newer process replaced the one we talk to.
      conn_->close("actor restarted");
      conn_.reset();
      auto more = drop_inflight_locked("worker replaced (" + info.death_cause + ")");
      failures.insert(failures.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
    }
    if (info.state == ActorState::kDead) {
      if (conn_) conn_->close("actor dead");
      conn_.reset();
      dropped_refs = std::move(ctor_refs_);  // let go outside the lock
      in_order_.store(false, std::memory_order_release);
      auto more = fail_all_locked(info.death_cause);
      failures.insert(failures.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
    } else if (info.state == ActorState::kAlive && !queued_.empty()) {
      connect_locked();
    }
    for (const auto& [id, l] : listeners_) listeners.push_back(l);
  }
  cv_.notify_all();
  // Calls waiting behind one whose argument may never come go now (and
  // fail with the actor's death), and no later call waits. Unlocked: they
  // submit, which takes mu_.
  if (info.state == ActorState::kDead) order_.release_all();
  for (auto& [f, e] : failures) f(e);
  for (auto& l : listeners) l(info);
}

std::shared_ptr<Core> Core::connect(const ConnectOptions& o) {
  std::shared_ptr<Core> core(new Core());
  core->address_ = o.address;
  core->token_ = o.token;
  core->io_thread_ = std::thread([c = core.get()] {
    auto guard = asio::make_work_guard(c->io_);
    c->io_.run();
  });
  try {
    // The callbacks run on the I/O thread, which shutdown() joins before
    // the core goes: a plain pointer is safe, and the core is never
    // destroyed from its own I/O thread.
    Core* c = core.get();
    core->head_ = RpcChannel::connect(
        core->io_, o.address, o.token, o.timeout, [c](Message&& m) { c->on_event(std::move(m)); },
        [c](const std::string& reason) {
          c->head_lost_ = true;
          if (c->on_head_lost_) c->on_head_lost_(reason);
          c->head_gone(reason);
        },
        core->connection_options());
    Hello hello = o.hello;
    if (hello.client_id == 0) hello.client_id = core::random_id();
    if (hello.host_key.empty()) hello.host_key = core::host_key();
    core->client_id_ = hello.client_id;
    core->hello_reply_ = core->head_->call<HelloReply>(Op::kHello, hello, o.timeout);
    hello.cluster_id = core->hello_reply_.cluster_id;  // said when it comes back
    if (core->hello_reply_.durable && o.head_reconnect.count() > 0)
      core->head_->enable_reconnect(
          {.window = o.head_reconnect, .hello = encode_inline(hello), .on_reconnected = [c](Message&&) {
             c->resubscribe();
             std::function<void()> hook;
             {
               std::lock_guard lock(c->mu_);
               hook = c->on_reconnected_;
             }
             if (hook) hook();
           }});
  } catch (...) {
    core->shutdown();
    throw;
  }
  return core;
}

Core::~Core() { shutdown(); }

void Core::set_on_reconnected(std::function<void()> cb) {
  std::lock_guard lock(mu_);
  on_reconnected_ = std::move(cb);
}

namespace {

// A request id unique in this process, and across processes as their random
// client ids are (ActorSpec::request_id).
uint64_t new_request_id(uint64_t client_id) {
  static std::atomic<uint64_t> asked{0};
  return (client_id ^ (++asked * 0x9E3779B97F4A7C15ull)) | 1;
}

// Sends `spec` (which carries its request id) until the head answers,
// through stalls (Timeout) and drops of a head that comes back.
template <class Info, class Spec>
Info ask_until_answered(wire::RpcChannel& head, wire::Op op, const Spec& spec, const std::string& what,
                        const std::function<bool()>& give_up) {
  for (;;) {
    try {
      return head.call<Info>(op, spec);
    } catch (const Timeout& e) {
      if (head.is_closed()) throw;
      TROUPE_LOG_WARN(
          "the head has not answered the request for {} ({}); asking again (the same request: it is "
          "carried out once)",
          what, e.what());
    } catch (const ConnectionError&) {
      if (head.is_closed()) throw;  // else it dropped while a durable head restarts: the ask waits for its return
    }
    if (give_up && give_up()) throw Error("gave up asking the head for " + what);
  }
}

}  // namespace

wire::ActorInfo Core::create_actor(wire::ActorSpec spec, const std::function<bool()>& give_up) {
  if (spec.request_id == 0) spec.request_id = new_request_id(client_id_);
  return ask_until_answered<wire::ActorInfo>(head(), wire::Op::kCreateActor, spec, "a " + spec.class_name + " actor",
                                             give_up);
}

wire::PlacementGroupInfo Core::create_placement_group(wire::PlacementGroupSpec spec) {
  if (spec.request_id == 0) spec.request_id = new_request_id(client_id_);
  return ask_until_answered<wire::PlacementGroupInfo>(head(), wire::Op::kCreatePlacementGroup, spec,
                                                      "a placement group", {});
}

void Core::shutdown() {
  {
    std::lock_guard lock(mu_);
    if (shut_) return;
    shut_ = true;
  }
  if (io_thread_.joinable() && io_thread_.get_id() == std::this_thread::get_id()) {
    // Its own thread cannot be joined, and the io_context it runs would be
    // destroyed under it: a bug in whatever kept the core alive there.
    TROUPE_LOG_ERROR("client core shut down from its own I/O thread");
    std::terminate();
  }
  if (head_) {
    // A durable head gives a client whose connection drops time to come
    // back (a network blip); one that leaves says so, and what it owns goes
    // at once. A bounded wait: a head that does not answer waits out its
    // grace instead.
    if (hello_reply_.durable && head_->is_open()) try {
        head_->call_empty<void>(Op::kGoodbye, kGoodbyeTimeout);
      } catch (const std::exception& e) {
        TROUPE_LOG_DEBUG("goodbye to the head: {}", e.what());
      }
    head_->close("client shutting down");
  }
  // The close runs on the I/O thread: stop the loop after it, so the head
  // sees this process leave now (and kills what it owns), not only once
  // whatever still holds the core lets it go.
  if (io_thread_.joinable()) {
    asio::post(io_, [this] { io_.stop(); });
    io_thread_.join();
  } else {
    io_.stop();
  }
  // Handles may outlive the core: their clients let go of their
  // connections now, while the io_context those belong to still exists.
  std::unordered_map<uint64_t, std::shared_ptr<ActorClient>> actors;
  {
    std::lock_guard lock(mu_);
    actors.swap(actors_);
  }
  for (auto& [id, c] : actors) c->detach("its runtime was shut down");
  actors.clear();
  std::vector<Service> services;
  {
    std::lock_guard lock(services_mu_);
    services_closed_ = true;
    services.swap(services_);
  }
  while (!services.empty()) services.pop_back();
}

std::pair<std::shared_ptr<ActorClient>, bool> Core::client_for(const ActorInfo& info) {
  std::lock_guard lock(mu_);
  if (shut_) throw ConnectionError("actor " + std::to_string(info.id) + ": the client core was shut down");
  auto it = actors_.find(info.id);
  if (it != actors_.end()) return {it->second, false};
  auto c = std::make_shared<ActorClient>(*this, info);
  actors_[info.id] = c;
  return {c, true};
}

std::shared_ptr<ActorClient> Core::actor(const ActorInfo& info) {
  auto [c, made] = client_for(info);
  if (!made) return c;
  // Subscribe, then apply the head's current view (it may be newer).
  auto latest = head_->call<ActorInfo>(Op::kSubscribeActor, info.id);
  c->on_update(latest);
  return c;
}

std::shared_ptr<ActorClient> Core::adopt_actor(const ActorInfo& info) {
  auto [client, made] = client_for(info);
  if (!made) return client;
  auto f = head_->request(Op::kSubscribeActor, encode_inline(info.id));
  f.on_ready([f, c = client] {
    try {
      Message m = f.get();
      c->on_update(decode_value<ActorInfo>(m.body));
    } catch (const std::exception& e) {
      TROUPE_LOG_DEBUG("actor {}: no subscription for a handle that travelled here ({})", c->id(), e.what());
    }
  });
  return client;
}

std::shared_ptr<ActorClient> Core::actor(uint64_t id) {
  {
    std::lock_guard lock(mu_);
    auto it = actors_.find(id);
    if (it != actors_.end()) return it->second;
  }
  return actor(head_->call<ActorInfo>(Op::kSubscribeActor, id));
}

// The restarted head knows no subscribers: ask again for every actor this
// process follows and apply what it says now (on the I/O thread; the replies
// come there too).
void Core::resubscribe() {
  // It tells again whether room is wanted, if it is.
  if (auto tasks = find_service<TaskSubmitter>()) {
    tasks->set_resources_wanted(false);
    tasks->tell_lends_again();
  }
  std::vector<std::shared_ptr<ActorClient>> clients;
  {
    std::lock_guard lock(mu_);
    for (auto& [id, c] : actors_) clients.push_back(c);
  }
  for (auto& c : clients) {
    auto f = head_->request(Op::kSubscribeActor, encode_inline(c->id()));
    f.on_ready([f, c] {
      try {
        Message m = f.get();
        c->on_update(decode_value<ActorInfo>(m.body));
      } catch (const std::exception& e) {
        TROUPE_LOG_WARN("actor {}: the restarted head does not know it ({})", c->id(), e.what());
      }
    });
  }
}

// What waits for an actor to be placed (its calls, a task queued for a
// task executor not yet started) fails now with the head's end, instead of
// waiting for news that cannot come. An alive actor's calls go on to its
// worker, which learns the same and ends. On the I/O thread, as updates.
void Core::head_gone(const std::string& reason) {
  std::vector<std::shared_ptr<ActorClient>> clients;
  bool shut = false;
  {
    std::lock_guard lock(mu_);
    for (auto& [id, c] : actors_) clients.push_back(c);
    shut = shut_;
  }
  // Closed by this process's own shutdown (a Runtime destroyed while a
  // call still waited), not by the head.
  const std::string cause = shut ? "this process's Runtime was shut down before the actor was placed"
                                 : "the cluster's head is gone (" + reason + ") before the actor was placed";
  for (auto& c : clients) {
    ActorInfo info = c->info();
    if (info.state == ActorState::kAlive || info.state == ActorState::kDead) continue;
    info.state = ActorState::kDead;
    info.death_cause = cause;
    ++info.version;
    c->on_update(info);
  }
}

void Core::forget_actor(uint64_t id) {
  std::shared_ptr<ActorClient> client;
  {
    std::lock_guard lock(mu_);
    auto it = actors_.find(id);
    if (it == actors_.end()) return;
    client = std::move(it->second);
    actors_.erase(it);
  }
  // Its updates are dropped from now on: nothing to wait for.
  client->stop_awaiting_causes();
}

void Core::on_event(Message&& m) {
  if (static_cast<Op>(m.op) == Op::kResourcesWanted) {
    try {
      const bool wanted = decode_value<ResourcesWanted>(m.body).wanted;
      if (auto tasks = find_service<TaskSubmitter>()) tasks->set_resources_wanted(wanted);
    } catch (const std::exception& e) {
      TROUPE_LOG_WARN("bad resources-wanted event from head: {}", e.what());
    }
    return;
  }
  if (static_cast<Op>(m.op) != Op::kActorUpdate) return;
  ActorInfo info;
  try {
    info = decode_value<ActorInfo>(m.body);
  } catch (const std::exception& e) {
    TROUPE_LOG_WARN("bad actor update from head: {}", e.what());
    return;
  }
  std::shared_ptr<ActorClient> c;
  {
    std::lock_guard lock(mu_);
    auto it = actors_.find(info.id);
    if (it == actors_.end()) return;
    c = it->second;
    // A dead actor never changes again: its handles keep their client (and
    // fail with ActorDied), the table lets it go, so that a driver that
    // spawns and kills actors for days does not grow with them.
    if (info.state == ActorState::kDead) actors_.erase(it);
  }
  c->on_update(info);
}

}  // namespace troupe::client
