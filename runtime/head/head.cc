#include "troupe/runtime/head/head.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/core/process.h"
#include "troupe/runtime/core/random_id.h"
#include "troupe/runtime/core/rate_limited_log.h"
#include "troupe/runtime/core/utf8.h"
#include "troupe/runtime/head/head_state.h"
#include "troupe/runtime/head/head_store.h"
#include "troupe/runtime/head/http_endpoint.h"
#include "troupe/runtime/head/metrics.h"
#include "troupe/runtime/wire/connection.h"
#include "troupe/runtime/wire/rpc.h"

namespace troupe::head {

using namespace troupe::wire;
using Clock = std::chrono::steady_clock;

namespace {

// The state file's row holding the cluster's id (HelloReply::cluster_id):
// the head's own, beside HeadState's rows, which leave "c/" alone.
constexpr const char* kClusterRow = "c/cluster";

// Why a process of cluster `was` cannot go on with a head of cluster `now`.
std::string other_cluster_text(uint64_t now, uint64_t was) {
  return "the head came back without this cluster's tables (its state file was lost or removed; cluster " +
         std::to_string(now) + ", not " + std::to_string(was) +
         "): this process's actors, objects and keys are gone with them";
}

struct Peer {
  PeerId id = 0;
  std::shared_ptr<Connection> conn;
  std::chrono::steady_clock::time_point accepted = std::chrono::steady_clock::now();
  Role role = Role::kDriver;
  bool hello = false;
  // A node agent's own node, or the node a worker runs on.
  uint64_t node_id = 0;
  // A worker: the actor incarnation it runs (its hello), the only one it
  // may report ready or failed.
  uint64_t actor_id = 0;
  uint32_t incarnation = 0;
  // Its node was declared dead: whatever it still sends is ignored.
  bool fenced = false;
  // It said goodbye, or the head closed it: what its client owns goes with
  // the connection, without the grace a dropped connection gets.
  bool final_close = false;
  bool said_goodbye = false;  // its close is the one it announced (kGoodbye)
  // A driver or worker: its process id towards the head, and (when it runs
  // where the head runs) its pid and start time, watched while the head
  // waits for it to come back.
  uint64_t client_id = 0;
  int32_t pid = 0;
  uint64_t started = 0;
  // Actors whose updates it gets (dropped from subscribers_ when it goes).
  std::set<uint64_t> subscriptions;
};

// How long a fenced node agent's connection stays half-open for the agent
// to read its NodeFenced (it may be stopped) before the head closes it.
constexpr std::chrono::seconds kFencedLinger{60};

struct Waiter {
  std::shared_ptr<Connection> conn;
  uint64_t request_id = 0;
  // Its timeout, owned here alone: a waiter answered or dropped takes it
  // along (cancelled). Kept by its handler, it held the waiter's
  // connection until the timeout, up to ~49 days after the answer.
  std::shared_ptr<asio::steady_timer> timer;
};

}  // namespace

// The server around HeadState: accepts connections, decodes each message
// into one HeadState call, and sends what the state says to send. Timers
// (heartbeat checks, waits with a timeout) live here too.
class Head::Impl {
 public:
  explicit Impl(HeadOptions o) : opts_(std::move(o)), state_(head_config(opts_)), timer_(io_) {
    if (opts_.advertise_host.empty())
      opts_.advertise_host = wire::default_advertise_host(opts_.host);
    else
      wire::check_host("advertise address", opts_.advertise_host);
    if (!opts_.state_db.empty()) open_store();
    // Listens only once the tables are loaded: until then a node agent's
    // connect is refused, which tells it no head runs to fence it, so it
    // keeps its lease and its workers however long a large store takes to
    // load. (Bound earlier, the kernel would accept and no handshake would
    // come: the agent's lease would run out and its workers go.)
    listener_.emplace(io_, opts_.host, opts_.port, opts_.token, opts_.listener,
                      [this](std::shared_ptr<Connection> c) { accept(std::move(c)); });
    arm_timer();
    if (opts_.liveness_fd >= 0) beat();
    if (opts_.dashboard_port >= 0) {
      HttpOptions h{opts_.host, opts_.dashboard_port, opts_.token,
                    opts_.dashboard_require_token || !is_loopback_host(opts_.host)};
      try {
        http_ = std::make_unique<HttpEndpoint>(h, [this] { return snapshot(); });
      } catch (const ConfigError& e) {
        if (!opts_.dashboard_port_fallback || h.port == 0) throw;
        TROUPE_LOG_WARN("dashboard port {} is taken; using a free one", h.port);
        h.port = 0;
        http_ = std::make_unique<HttpEndpoint>(h, [this] { return snapshot(); });
      }
    }
  }

  // A durable head's clients reconnect when their connection drops: they
  // get restore_grace to come back to what they own.
  static HeadConfig head_config(const HeadOptions& o) {
    HeadConfig c{o.heartbeat_ms, o.heartbeat_misses, o.max_dead_actors};
    if (!o.state_db.empty()) c.client_grace = o.restore_grace;
    return c;
  }

  std::string address() const { return wire::format_address(opts_.advertise_host, listener_->port()); }
  std::string dashboard_url() const { return http_ ? http_->url(opts_.advertise_host) : ""; }
  void stop() {
    ending_ = true;  // before the post: a node may go before it runs
    asio::post(io_, [this] {
      state_.stopping();
      end_for_good();
      shutdown_nodes();
      listener_->close();
      // Give the shutdown events a moment to leave, then stop the loop.
      after(std::chrono::milliseconds(50), [this] { io_.stop(); });
    });
  }
  void run() {
    auto guard = asio::make_work_guard(io_);
    io_.run();
  }

 private:
  template <class F>
  void after(std::chrono::milliseconds d, F f) {
    auto t = std::make_shared<asio::steady_timer>(io_, d);
    t->async_wait([t, f = std::move(f)](asio::error_code) { f(); });
  }

  // A sign of life for the supervisor, from the event loop itself: a loop
  // stuck in one handler (a deadlock, a disk that does not answer) stops
  // beating and is restarted. Never blocks (the pipe is non-blocking).
  void beat() {
    const char b = 'b';
    (void)!::write(opts_.liveness_fd, &b, 1);
    liveness_timer_.expires_after(std::chrono::seconds(1));
    liveness_timer_.async_wait([this](asio::error_code ec) {
      if (!ec) beat();
    });
  }

  // A durable head reloads an earlier one's tables; from then on every
  // change is written through (flush).
  void open_store() {
    store_ = std::make_unique<HeadStore>(opts_.state_db);
    store_->check_format(HeadState::kRowFormat, HeadState::kOldestReadableRowFormat);
    std::vector<std::string> written_order;
    auto rows = store_->load(&written_order);
    // The tables' identity is theirs: a head that reloads them keeps it, one
    // that starts without them (the file new, cleared by `troupe stop`, or
    // removed) draws one.
    uint64_t kept = 0;
    if (auto it = rows.find(kClusterRow); it != rows.end()) {
      kept = std::strtoull(it->second.c_str(), nullptr, 10);
      rows.erase(it);
    }
    if (kept != 0)
      cluster_id_ = kept;
    else
      cluster_row_due_ = true;  // written with the tables, below
    const auto grace =
        std::max(opts_.restore_grace, std::chrono::milliseconds(uint64_t(opts_.heartbeat_ms) * opts_.heartbeat_misses));
    if (!rows.empty()) {
      TROUPE_LOG_INFO("reloading the tables of the head before this one from {}", opts_.state_db);
      try {
        state_.restore(rows, Clock::now(), grace, written_order);
      } catch (const DecodeError& e) {
        throw ConfigError("head state file " + opts_.state_db + " has a row this head cannot read (" + e.what() +
                          "): it is damaged. Move it away (or start the head with --no-state-db)");
      }
    }
    state_.enable_write_through();
    persist();
    // The nodes' and owners' grace counts from now, when the head is about
    // to serve: writing a large store back may have taken longer than it.
    if (!rows.empty()) state_.restart_grace(Clock::now(), grace);
  }

  void persist() {
    if (!store_) return;
    try {
      auto rows = state_.take_rows();
      if (cluster_row_due_) rows.emplace_back(kClusterRow, std::to_string(cluster_id_));
      store_->write(rows);
      cluster_row_due_ = false;
    } catch (const std::exception& e) {
      // A head that cannot write goes on as a non-durable one, loudly (the
      // log, `troupe status`, /metrics). Its file, behind the head's
      // tables from now on, is removed: a head started after this one
      // starts empty instead of reloading a past the drivers have left.
      // The store is kept (unused): it holds the state file's lock, which
      // no other head may take while this one lives.
      store_error_ = e.what();
      TROUPE_LOG_ERROR(
          "{}; the head's tables are no longer written through, and {} is removed (a head restarted "
          "now starts empty)",
          store_error_, opts_.state_db);
      failed_store_ = std::move(store_);
      failed_store_->discard();
    }
  }

  // The cluster ends on purpose: whoever is connected is told not to wait
  // for a restart, and the store forgets the tables.
  void end_for_good() {
    for (auto& [raw, p] : peers_)
      if (p->hello && p->role != Role::kNode) p->conn->send(make_event(Op::kShutdown));
    if (store_) {
      try {
        store_->clear();
      } catch (const std::exception& e) {
        TROUPE_LOG_WARN("{}", e.what());
      }
      store_.reset();
    }
  }

  void shutdown_nodes() {
    for (auto id : state_.live_nodes())
      if (auto it = node_conns_.find(id); it != node_conns_.end()) it->second->send(make_event(Op::kShutdown));
  }

  // ---- connections --------------------------------------------------------
  void accept(std::shared_ptr<Connection> conn) {
    auto peer = std::make_unique<Peer>();
    peer->id = next_peer_id_++;
    peer->conn = conn;
    Peer* p = peer.get();
    peers_[conn.get()] = std::move(peer);
    conn->start([] {}, [this, p](Message&& m) { on_message(*p, std::move(m)); },
                [this, raw = conn.get()](const std::string& reason) { on_close(raw, reason); });
  }

  void on_close(Connection* raw, const std::string& reason) {
    auto it = peers_.find(raw);
    if (it == peers_.end()) return;
    if (ending_) state_.stopping();
    Peer& p = *it->second;
    const bool may_return = store_ && !ending_ && !p.final_close && !p.fenced;
    if (p.said_goodbye && p.role == Role::kNode && p.hello)
      state_.node_lost(p.node_id, "its agent stopped and said goodbye", true);
    state_.peer_gone(p.id, p.said_goodbye ? "it said goodbye" : reason, may_return, Clock::now());
    if (may_return && p.pid > 0 && state_.awaits_client(p.client_id)) watched_[p.client_id] = {p.pid, p.started};
    if (may_return && p.pid > 0 && p.role == Role::kNode && state_.node_awaited(p.node_id))
      watched_nodes_[p.node_id] = {p.pid, p.started};
    // A node's current connection: nothing more can be sent to it, and the
    // logs read through it will not come (a newer connection of the same
    // agent, which took the node over, stays).
    if (p.role == Role::kNode && p.hello) {
      if (auto n = node_conns_.find(p.node_id); n != node_conns_.end() && n->second.get() == raw) node_conns_.erase(n);
      // Those asked on this connection, whichever connection the node has now.
      fail_log_reads([raw](const LogRead& r) { return r.via == raw; },
                     "node " + std::to_string(p.node_id) + " lost its agent's connection (" + reason + ")");
    }
    drop_waiters(kv_waiters_, raw);
    drop_waiters(group_waiters_, raw);
    for (uint64_t id : it->second->subscriptions) unsubscribe(id, raw);
    peers_.erase(it);
    flush();
  }

  // Nothing is kept for a connection that went: its waiters, and (in
  // on_close) its subscriptions; keys left without waiters go too.
  template <class K>
  static void drop_waiters(std::map<K, std::vector<Waiter>>& table, Connection* raw) {
    for (auto it = table.begin(); it != table.end();) {
      auto& ws = it->second;
      ws.erase(std::remove_if(ws.begin(), ws.end(), [&](const Waiter& w) { return w.conn.get() == raw; }), ws.end());
      it = ws.empty() ? table.erase(it) : std::next(it);
    }
  }

  void subscribe(Peer& p, uint64_t actor_id) {
    if (!p.subscriptions.insert(actor_id).second) return;  // one update per change, however often asked
    subscribers_[actor_id].push_back(p.conn);
  }

  void unsubscribe(uint64_t actor_id, Connection* raw) {
    auto it = subscribers_.find(actor_id);
    if (it == subscribers_.end()) return;
    auto& subs = it->second;
    subs.erase(std::remove_if(subs.begin(), subs.end(),
                              [&](const std::weak_ptr<Connection>& w) {
                                auto c = w.lock();
                                return !c || c.get() == raw;
                              }),
               subs.end());
    if (subs.empty()) subscribers_.erase(it);
  }

  void on_message(Peer& p, Message&& m) {
    if (p.fenced) return;
    // Known ops by name, anything else as "other": the table stays small
    // whatever a peer sends.
    uint32_t counted = m.op <= static_cast<uint32_t>(Op::kLastOp) ? m.op : 0;
    // An agent's responses answer the head's one request of agents, a log
    // read relayed for a client: they count as read_log.
    if (m.kind == Kind::RESPONSE && p.role == Role::kNode) counted = static_cast<uint32_t>(Op::kReadLog);
    ++message_counts_[counted];
    try {
      if (m.kind == Kind::REQUEST) {
        handle_request(p, m);
      } else if (m.kind == Kind::RESPONSE && p.role == Role::kNode && p.hello) {
        relay_log(m);
      } else if (m.kind == Kind::EVENT) {
        handle_event(p, m);
      } else {
        throw DecodeError("unexpected frame kind " + std::to_string(static_cast<int>(m.kind)) + " at the head");
      }
    } catch (const DecodeError& e) {
      bad_message_log_.warn("closing connection {}: {}", p.conn->peer(), e.what());
      p.final_close = true;
      p.conn->close(std::string("bad message: ") + e.what());
    } catch (const std::exception& e) {
      if (m.kind == Kind::REQUEST) {
        p.conn->send(error_response(m.id, e));
      } else {
        failed_event_log_.warn("event op {} from {} failed: {}", m.op, p.conn->peer(), e.what());
      }
    }
    flush();
  }

  template <class T>
  static T body(const Message& m) {
    return decode_value<T>(m.body.data(), m.body.size(), &m.attachments);
  }

  static void require_hello(const Peer& p, Op op) {
    if (!p.hello) throw Error("request op " + std::to_string(static_cast<uint32_t>(op)) + " before hello");
  }

  void handle_request(Peer& p, const Message& m) {
    auto op = static_cast<Op>(m.op);
    if (op != Op::kHello) require_hello(p, op);
    switch (op) {
      case Op::kHello:
        return hello(p, m);
      case Op::kCreateActor:
        return p.conn->send(ok_response_value(m.id, state_.create_actor(p.id, body<ActorSpec>(m))));
      case Op::kSubscribeActor: {
        auto id = body<uint64_t>(m);
        const ActorInfo& info = state_.actor_info(id);
        subscribe(p, id);
        return p.conn->send(ok_response_value(m.id, info));
      }
      case Op::kGetActor:
        return p.conn->send(ok_response_value(m.id, state_.named_actor(body<std::string>(m))));
      case Op::kKillActor: {
        auto k = body<KillActor>(m);
        state_.kill_actor(k.actor_id, k.no_restart, k.why.empty() ? std::string(kKilledByRequest) : k.why);
        return p.conn->send(ok_response(m.id));
      }
      case Op::kNodes:
        return p.conn->send(ok_response_value(m.id, state_.nodes()));
      case Op::kStatus:
        return p.conn->send(
            ok_response_value(m.id, status_json(m).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)));
      case Op::kShutdown:
        return shutdown(p, m);
      case Op::kReadLog:
        return read_log(p, m);
      case Op::kPing:
        // A fenced peer's messages are never read (on_message): it gets
        // its close instead of this.
        return p.conn->send(ok_response(m.id));
      case Op::kGoodbye:
        // Every connection of that process: one the head has not yet seen
        // close (a reconnect raced it) must not keep what it owns either.
        for (auto& [raw, q] : peers_)
          if (q.get() == &p || (p.client_id && q->client_id == p.client_id) ||
              (p.role == Role::kNode && q->role == Role::kNode && q->node_id == p.node_id))
            q->final_close = true;
        p.said_goodbye = true;
        if (p.role == Role::kNode) state_.node_leaving(p.node_id);
        return p.conn->send(ok_response(m.id));
      default:
        if (handle_group_request(p, m, op) || handle_kv_request(p, m, op)) return;
        throw DecodeError("unknown request op " + std::to_string(m.op));
    }
  }

  bool handle_group_request(Peer& p, const Message& m, Op op) {
    switch (op) {
      case Op::kCreatePlacementGroup:
        p.conn->send(ok_response_value(m.id, state_.create_placement_group(p.id, body<PlacementGroupSpec>(m))));
        return true;
      case Op::kGetPlacementGroup:
        p.conn->send(ok_response_value(m.id, state_.placement_group(body<uint64_t>(m))));
        return true;
      case Op::kWaitPlacementGroup:
        wait_group(p, m);
        return true;
      case Op::kRemovePlacementGroup:
        state_.remove_placement_group(body<uint64_t>(m));
        p.conn->send(ok_response(m.id));
        return true;
      default:
        return false;
    }
  }

  bool handle_kv_request(Peer& p, const Message& m, Op op) {
    switch (op) {
      case Op::kKvPut: {
        auto e = body<KvEntry>(m);
        state_.kv_put(e.key, e.value);
        p.conn->send(ok_response(m.id));
        return true;
      }
      case Op::kKvGet:
        p.conn->send(ok_response_value(m.id, state_.kv_get(body<std::string>(m))));
        return true;
      case Op::kKvWait:
        wait_kv(p, m);
        return true;
      case Op::kKvErase:
        state_.kv_erase(body<std::string>(m));
        p.conn->send(ok_response(m.id));
        return true;
      case Op::kKvAdd: {
        auto a = body<KvAdd>(m);
        p.conn->send(ok_response_value(m.id, state_.kv_add(a.key, a.delta)));
        return true;
      }
      default:
        return false;
    }
  }

  void wait_group(Peer& p, const Message& m) {
    auto w = body<WaitPlacementGroup>(m);
    const PlacementGroupInfo& info = state_.placement_group(w.id);
    if (info.state != PlacementGroupState::kPending || w.timeout_ms == 0)
      return p.conn->send(ok_response_value(m.id, info));
    auto timer =
        waiter_timer(w.timeout_ms, p.conn, [this, id = w.id, rid = m.id](const std::shared_ptr<Connection>& conn) {
          if (take_waiter(group_waiters_, id, conn, rid))
            conn->send(ok_response_value(rid, state_.placement_group(id)));
        });
    group_waiters_[w.id].push_back({p.conn, m.id, std::move(timer)});
  }

  void wait_kv(Peer& p, const Message& m) {
    auto w = body<KvWait>(m);
    if (auto v = state_.kv_get(w.key)) return p.conn->send(ok_response_value(m.id, *v));
    auto timer = waiter_timer(
        w.timeout_ms, p.conn,
        [this, key = w.key, rid = m.id, ms = w.timeout_ms](const std::shared_ptr<Connection>& conn) {
          if (take_waiter(kv_waiters_, key, conn, rid))
            conn->send(error_response(
                rid, Timeout("kv wait for key '" + key + "' timed out after " + std::to_string(ms) + " ms")));
        });
    kv_waiters_[w.key].push_back({p.conn, m.id, std::move(timer)});
  }

  // A waiter's timeout: `on_timeout(conn)` runs after `ms` unless the timer
  // went first (with its waiter) or `conn` did.
  template <class F>
  std::shared_ptr<asio::steady_timer> waiter_timer(uint32_t ms, const std::shared_ptr<Connection>& conn, F on_timeout) {
    auto t = std::make_shared<asio::steady_timer>(io_, std::chrono::milliseconds(ms));
    ++waiter_timers_;
    t->async_wait(
        [this, weak = std::weak_ptr<Connection>(conn), on_timeout = std::move(on_timeout)](asio::error_code ec) {
          --waiter_timers_;
          if (auto c = weak.lock(); c && !ec) on_timeout(c);
        });
    return t;
  }

  // Removes the waiter (conn, rid) under `key`; false when it was answered already.
  template <class K>
  static bool take_waiter(std::map<K, std::vector<Waiter>>& table, const K& key,
                          const std::shared_ptr<Connection>& conn, uint64_t rid) {
    auto it = table.find(key);
    if (it == table.end()) return false;
    auto& ws = it->second;
    for (auto w = ws.begin(); w != ws.end(); ++w)
      if (w->conn == conn && w->request_id == rid) {
        ws.erase(w);
        if (ws.empty()) table.erase(it);
        return true;
      }
    return false;
  }

  void shutdown(Peer& p, const Message& m) {
    p.conn->send(ok_response(m.id));
    TROUPE_LOG_INFO("shutdown requested by {}", p.conn->peer());
    ending_ = true;
    state_.stopping();
    state_.kill_all("cluster shut down");
    after(std::chrono::milliseconds(100), [this] {
      end_for_good();
      shutdown_nodes();
      after(std::chrono::milliseconds(100), [this] { io_.stop(); });
    });
  }

  nlohmann::json status_json(const Message& m) {
    // An empty body (older callers) asks for everything.
    return status_document(m.body.empty() ? StatusRequest{} : body<StatusRequest>(m));
  }

  // What `troupe status --json` and the dashboard's /api/status (and, from
  // it, /metrics) answer: one document, so that a script written against
  // one reads the other.
  nlohmann::json status_document(const StatusRequest& request) {
    auto j = state_.status(request);
    j["address"] = address();
    j["tables"].update(server_table_sizes());
    j["jobs"] = jobs_json();
    if (http_) j["dashboard"] = dashboard_url();
    j["state_db"] = state_db_json();
    j["workers"] = worker_rates();
    nlohmann::json messages = nlohmann::json::object();
    for (const auto& [op, n] : message_counts_) messages[op_name(op)] = n;
    j["head"] = {{"uptime_s", std::chrono::duration<double>(Clock::now() - started_).count()},
                 {"messages", std::move(messages)},
                 {"state_db", state_db_json()}};
    return j;
  }

  static constexpr size_t kMaxJobDocument = HeadState::kMaxJobDocument;

  // The progress documents TrainJobs publish in the KV store. A running
  // job's document names its driver's key (under the driver's client
  // prefix, erased when the driver is gone for good): without that key the
  // driver died mid-run and the job is shown "lost", not "running" forever.
  nlohmann::json jobs_json() const {
    auto jobs = nlohmann::json::array();
    for (const auto& [key, value] : state_.kv_with_prefix(kJobKeyPrefix)) {
      if (value.size() > kMaxJobDocument) {
        // Parsed on the event loop for every status and dashboard poll: a
        // buggy writer's 15 MB document stalled the head past the nodes'
        // lease, and every worker of the cluster was killed.
        jobs.push_back({{"name", key.substr(std::strlen(kJobKeyPrefix))},
                        {"state", "unknown"},
                        {"error", "its progress document is " + std::to_string(value.size()) + " bytes, over the " +
                                      std::to_string(kMaxJobDocument) + " a status reads"}});
        continue;
      }
      auto doc = nlohmann::json::parse(value, nullptr, /*allow_exceptions=*/false);
      if (!doc.is_object()) continue;  // not a job's document
      const auto driver = doc.find("driver_key");
      if (doc.value("state", nlohmann::json()) == "running" && driver != doc.end() && driver->is_string() &&
          !state_.kv_get(driver->get<std::string>())) {
        doc["state"] = "lost";
        doc["lost_why"] = "its driver exited or lost the head before the job ended";
      }
      jobs.push_back(std::move(doc));
    }
    return jobs;
  }

  // What the server keeps per connection and per waiter (state's tables are
  // in HeadState::status): none of it may outlive what it is for.
  nlohmann::json server_table_sizes() const {
    size_t subscriptions = 0;
    for (const auto& [id, subs] : subscribers_) subscriptions += subs.size();
    size_t kv_waiting = 0, group_waiting = 0;
    for (const auto& [k, ws] : kv_waiters_) kv_waiting += ws.size();
    for (const auto& [g, ws] : group_waiters_) group_waiting += ws.size();
    return {{"connections", peers_.size()},
            {"node_connections", node_conns_.size()},
            {"subscribed_actors", subscribers_.size()},
            {"subscriptions", subscriptions},
            {"kv_waiters", kv_waiting},
            {"group_waiters", group_waiting},
            {"waiter_timers", waiter_timers_}};
  }

  void handle_event(Peer& p, const Message& m) {
    auto op = static_cast<Op>(m.op);
    require_hello(p, op);
    switch (op) {
      case Op::kHeartbeat:
        if (p.role != Role::kNode) throw DecodeError("heartbeat from a non-node");
        state_.heartbeat(p.node_id, Clock::now(), m.body.empty() ? NodeHeartbeat{} : body<NodeHeartbeat>(m));
        // The answer by which the agent knows the head still hears it (its
        // HeadLease); a fenced peer's heartbeats are never read, so it gets none.
        return p.conn->send(make_event(Op::kHeartbeat));
      case Op::kActorReady: {
        auto r = body<ActorReady>(m);
        require_own_actor(p, "ActorReady", r.actor_id, r.incarnation);
        return state_.actor_ready(r);
      }
      case Op::kActorInitFailed: {
        auto f = body<ActorInitFailed>(m);
        require_own_actor(p, "ActorInitFailed", f.actor_id, f.incarnation);
        return state_.actor_init_failed(f);
      }
      case Op::kLendResources: {
        // From the executor's own worker (a task waits), or from its owner
        // (an executor kept idle for its objects), which may be a worker
        // too (a task or actor that submits tasks): only the executor's own
        // worker speaks as it.
        auto l = body<LendResources>(m);
        const bool own = p.role == Role::kWorker && p.actor_id == l.actor_id && p.incarnation == l.incarnation;
        return state_.lend_resources(l, own ? 0 : p.id);
      }
      case Op::kWorkerExited:
        if (p.role != Role::kNode) throw DecodeError("worker exit report from a non-node");
        return state_.worker_exited(body<WorkerExited>(m), p.node_id);
      default:
        throw DecodeError("unknown event op " + std::to_string(m.op));
    }
  }

  // An actor's worker says it is ready or failed to start, on the
  // connection it said hello on as that actor's worker: from any other
  // peer (a buggy driver's) it would repoint the actor's callers.
  static void require_own_actor(const Peer& p, const char* what, uint64_t actor_id, uint32_t incarnation) {
    if (p.role != Role::kWorker || p.actor_id != actor_id || p.incarnation != incarnation)
      throw DecodeError(std::string(what) + " for actor " + std::to_string(actor_id) + " incarnation " +
                        std::to_string(incarnation) + " from a connection that is not that worker's");
  }

  // A node's hostname and address go into log lines and the status: a
  // buggy agent's 10 MB name, or one with a newline and an escape code,
  // wrote 10 MB per mention and forged log lines.
  static void require_printable(const std::string& value, const char* what) {
    constexpr size_t kMax = 255;
    bool ok = value.size() <= kMax && core::valid_utf8(value);
    for (unsigned char c : value) ok = ok && c >= 0x20 && c != 0x7f;
    // UTF-8's controls too: C1 (U+0080-U+009F: C2 80-9F, CSI among them)
    // and the line and paragraph separators (E2 80 A8/A9).
    for (size_t i = 0; ok && i + 1 < value.size(); ++i) {
      const auto c = static_cast<unsigned char>(value[i]), d = static_cast<unsigned char>(value[i + 1]);
      ok = !(c == 0xc2 && d >= 0x80 && d <= 0x9f) &&
           !(c == 0xe2 && d == 0x80 && i + 2 < value.size() && (value[i + 2] == '\xa8' || value[i + 2] == '\xa9'));
    }
    if (ok) return;
    std::string shown;
    for (unsigned char c : value.substr(0, 64))
      shown += c >= 0x20 && c < 0x7f ? std::string(1, static_cast<char>(c)) : fmt::format("\\x{:02x}", c);
    throw ConfigError(fmt::format("a node's {} must be printable text of at most {} bytes; got {} bytes: \"{}{}\"",
                                  what, kMax, value.size(), shown, value.size() > 64 ? "..." : ""));
  }

  void hello(Peer& p, const Message& m) {
    if (p.hello) throw Error("hello sent twice");
    auto h = body<Hello>(m);
    if (h.role != Role::kDriver && h.role != Role::kNode && h.role != Role::kWorker)
      throw DecodeError("hello with an unknown role " + std::to_string(static_cast<int>(h.role)));
    if (h.cluster_id != 0 && h.cluster_id != cluster_id_) throw Error(other_cluster_text(cluster_id_, h.cluster_id));
    HelloReply reply;
    if (h.role == Role::kNode) {
      require_printable(h.hostname, "hostname");
      require_printable(h.address, "address");
      reply.node_id =
          h.resume_node_id ? state_.resume_node(p.id, h, Clock::now()) : state_.register_node(p.id, h, Clock::now());
      reply.heartbeat_ms = opts_.heartbeat_ms;
      reply.fence_after_ms = opts_.heartbeat_ms * opts_.heartbeat_misses;
      p.node_id = reply.node_id;
      node_conns_[reply.node_id] = p.conn;
    } else if (h.role == Role::kWorker) {
      reply = state_.worker_hello(h.actor_id, h.incarnation);
      reply.fence_after_ms = opts_.heartbeat_ms * opts_.heartbeat_misses;
      p.node_id = reply.info.node_id;
      p.actor_id = h.actor_id;
      p.incarnation = h.incarnation;
    }
    if (h.role != Role::kNode) {
      state_.bind_client(p.id, h.client_id, h.role == Role::kWorker ? h.actor_id : 0, h.incarnation);
      p.client_id = h.client_id;
      watched_.erase(h.client_id);
    } else {
      watched_nodes_.erase(p.node_id);
    }
    // Its pid means what it says only where the head runs.
    static const std::string own_host = core::host_key();
    if (!own_host.empty() && h.host_key == own_host && h.pid > 0)
      if (auto started = core::process_start_time(h.pid)) {
        p.pid = h.pid;
        p.started = *started;
      }
    reply.durable = store_ != nullptr;
    reply.cluster_id = cluster_id_;
    p.role = h.role;
    p.hello = true;
    p.conn->send(ok_response_value(m.id, reply));
  }

  // ---- carrying out the state's outputs -----------------------------------
  void flush() {
    // Written before anything it caused is sent.
    persist();
    HeadOutputs out = state_.take_outputs();
    // Stale workers go before their replacements start.
    for (auto& [node, why] : out.dead_nodes) fence_node(node, why);
    for (auto& [node, s] : out.spawns) send_to_node(node, make_event_value(Op::kSpawnWorker, s));
    for (auto& [node, k] : out.kills) send_to_node(node, make_event_value(Op::kKillWorker, k));
    for (auto& info : out.updates) publish(info);
    for (auto id : out.evicted) forget_subscribers(id);
    for (auto& g : out.groups_settled) answer(group_waiters_, g.id, g);
    for (auto& e : out.kv_set) answer(kv_waiters_, e.key, e.value);
    if (!out.resources_wanted.empty()) tell_owners(out.resources_wanted);
  }

  // Owners hear when the cluster starts or stops waiting for room.
  void tell_owners(const std::vector<std::pair<PeerId, bool>>& told) {
    std::unordered_map<PeerId, Peer*> by_id;
    for (auto& [raw, p] : peers_) by_id[p->id] = p.get();
    for (auto& [peer, wanted] : told)
      if (auto it = by_id.find(peer); it != by_id.end())
        it->second->conn->send(make_event_value(Op::kResourcesWanted, ResourcesWanted{wanted}));
  }

  // A node declared dead may still be running (stopped, partitioned, slow):
  // its workers are told to end and their connections closed (a worker
  // that loses the head for good exits), so none of them acts beside its replacement; the agent is told
  // its incarnation is over, and its connection is half-closed so that an
  // agent that wakes up reads the NodeFenced first.
  void fence_node(uint64_t node, const std::string& why) {
    fail_log_reads([node](const LogRead& r) { return r.node == node; },
                   "node " + std::to_string(node) + " was declared dead (" + why + ")");
    std::vector<std::shared_ptr<Connection>> stale;
    for (auto& [raw, p] : peers_)
      if (p->node_id == node && p->hello && !p->fenced) {
        p->fenced = true;
        if (p->role == Role::kWorker) stale.push_back(p->conn);
      }
    for (auto& c : stale) {
      // Told not to wait for this head to come back, then closed once the
      // worker has read that (or at once when it is not durable).
      if (store_) {
        c->send(make_event(Op::kShutdown), true);
        c->finish();
        after(std::chrono::seconds(5), [c] { c->close("fenced worker did not close its connection"); });
      } else {
        c->close("node " + std::to_string(node) + " was declared dead (" + why + ")");
      }
    }
    auto it = node_conns_.find(node);
    if (it == node_conns_.end()) return;
    auto conn = std::move(it->second);
    node_conns_.erase(it);
    conn->send(make_event_value(Op::kNodeFenced, NodeFenced{node, why}));
    conn->finish();
    after(kFencedLinger, [conn] { conn->close("fenced node agent did not close its connection"); });
  }

  // Clients and node agents the head waits for whose processes it can see:
  // one that has exited will not come back, and what it owns (or runs) goes
  // now.
  void check_watched() {
    sweep(
        watched_nodes_, [this](uint64_t node) { return state_.node_awaited(node); },
        [this](uint64_t node) { state_.node_lost(node, "its node agent exited"); });
    sweep(
        watched_, [this](uint64_t client) { return state_.awaits_client(client); },
        [this](uint64_t client) { state_.client_exited(client); });
  }

  // Drops the entries no longer awaited, and calls `gone` for those whose
  // process has exited.
  template <class Awaited, class Gone>
  static void sweep(std::map<uint64_t, std::pair<int32_t, uint64_t>>& watched, Awaited awaited, Gone gone) {
    for (auto it = watched.begin(); it != watched.end();) {
      const auto [id, w] = *it;
      if (awaited(id) && core::process_running(w.first, w.second)) {
        ++it;
        continue;
      }
      it = watched.erase(it);
      if (awaited(id)) gone(id);
    }
  }

  void forget_subscribers(uint64_t actor_id) {
    auto it = subscribers_.find(actor_id);
    if (it == subscribers_.end()) return;
    for (auto& w : it->second)
      if (auto c = w.lock())
        if (auto p = peers_.find(c.get()); p != peers_.end()) p->second->subscriptions.erase(actor_id);
    subscribers_.erase(it);
  }

  void send_to_node(uint64_t node, const Message& m) {
    if (auto it = node_conns_.find(node); it != node_conns_.end()) it->second->send(m);
  }

  template <class K, class V>
  static void answer(std::map<K, std::vector<Waiter>>& table, const K& key, const V& value) {
    auto it = table.find(key);
    if (it == table.end()) return;
    for (auto& w : it->second) w.conn->send(ok_response_value(w.request_id, value));
    table.erase(it);
  }

  void publish(const ActorInfo& info) {
    auto it = subscribers_.find(info.id);
    if (it == subscribers_.end()) return;
    auto ev = encode_frame(make_event_value(Op::kActorUpdate, info));
    auto& subs = it->second;
    subs.erase(std::remove_if(subs.begin(), subs.end(),
                              [&](const std::weak_ptr<Connection>& w) {
                                auto c = w.lock();
                                if (!c || !c->is_open()) return true;
                                c->send(ev);
                                return false;
                              }),
               subs.end());
    if (subs.empty()) subscribers_.erase(it);
  }

  // ---- troupe logs ----------------------------------------------------------
  // The head's own log is read here; a node's or an actor's worker's is
  // asked of its node agent (a request on the agent's connection), whose
  // answer goes back to the asker under the asker's request id.
  void read_log(Peer& p, const Message& m) {
    auto req = body<ReadLog>(m);
    if (req.max_bytes == 0 || req.max_bytes > (4u << 20))
      throw ConfigError("read log: max_bytes " + std::to_string(req.max_bytes) + " is not in 1..4 MiB");
    if (req.target == "head") {
      LogChunk c;
      c.path = core::own_log_file();
      if (c.path.empty()) throw ConfigError("the head's output is not a file (it was not started as a daemon)");
      if (req.rotated) c.path += ".1";
      c.text = core::read_log_piece(c.path, req.offset, req.max_bytes, &c.next_offset, &c.size, &c.file_id);
      return p.conn->send(ok_response_value(m.id, c));
    }
    uint64_t node = req.id;
    if (req.target == "actor" || req.target == "actor_previous") {
      // Its worker's log, or its last worker's when it has none now (a
      // dead actor's log is the one most worth reading); "actor_previous":
      // the worker that ran before that one.
      const auto [on_node, pid] = state_.actor_log_source(req.id, req.target == "actor_previous");
      if (pid <= 0 && req.target == "actor_previous" && state_.actor_log_source(req.id, false).second > 0)
        throw ConfigError("actor " + std::to_string(req.id) + " has no previous worker: it has not restarted (" +
                          to_string(state_.actor_info(req.id).state) + "; without --previous: its worker's log)");
      if (pid <= 0)
        throw ConfigError("actor " + std::to_string(req.id) + " has had no worker process yet (" +
                          to_string(state_.actor_info(req.id).state) + ")");
      node = on_node;
      req.target = "worker";
      req.id = static_cast<uint64_t>(pid);
    } else if (req.target != "node") {
      throw ConfigError("read log: unknown target '" + req.target + "' (head, node, actor or actor_previous)");
    }
    auto it = node_conns_.find(node);
    // A fenced agent joins again as a new node: the same process, with the
    // same log files, which keeps its earlier workers' logs.
    if (it == node_conns_.end())
      if (const uint64_t same = same_agent_as(node)) it = node_conns_.find(same);
    // A dead actor's last worker ran on a node whose agent is gone (killed,
    // then started again): the log file stays on its host, where another
    // agent started in the same session directory reads it ("no log file"
    // from one started elsewhere).
    if (it == node_conns_.end() && req.target == "worker")
      if (const uint64_t other = agent_on_host_of(node)) it = node_conns_.find(other);
    if (it == node_conns_.end())
      throw ConfigError("node " + std::to_string(node) + " is not alive, or its agent is not connected to the head");
    const uint64_t id = next_log_request_++;
    log_waiters_[id] = {node, it->second.get(), Waiter{p.conn, m.id}};
    Message ask;
    ask.kind = Kind::REQUEST;
    ask.op = static_cast<uint32_t>(Op::kReadLog);
    ask.id = id;
    ask.body = encode_inline(req);
    it->second->send(ask);
  }

  // The live node whose agent is the process that was node `dead` (same
  // host, same pid); 0 when none is.
  uint64_t same_agent_as(uint64_t dead) const {
    const auto nodes = state_.nodes();
    auto was = std::find_if(nodes.begin(), nodes.end(), [&](const auto& n) { return n.id == dead; });
    if (was == nodes.end() || was->pid <= 0) return 0;
    for (const auto& n : nodes)
      if (n.alive && n.id != dead && n.pid == was->pid && n.hostname == was->hostname) return n.id;
    return 0;
  }

  // A live node on the host node `dead` ran on: the same hostname, and the
  // same advertised address where one has it (hosts that are containers or
  // network namespaces of one machine share a hostname); 0 when none.
  uint64_t agent_on_host_of(uint64_t dead) const {
    const auto nodes = state_.nodes();
    auto was = std::find_if(nodes.begin(), nodes.end(), [&](const auto& n) { return n.id == dead; });
    if (was == nodes.end() || was->hostname.empty()) return 0;
    uint64_t same_name = 0;
    for (const auto& n : nodes) {
      if (!n.alive || n.id == dead || n.hostname != was->hostname || !node_conns_.count(n.id)) continue;
      if (n.address == was->address) return n.id;
      if (!same_name) same_name = n.id;
    }
    return same_name;
  }

  void relay_log(Message& m) {
    auto it = log_waiters_.find(m.id);
    if (it == log_waiters_.end()) return;  // its asker left
    m.id = it->second.asker.request_id;
    it->second.asker.conn->send(m);
    log_waiters_.erase(it);
  }

  // A node, or a connection of its agent, that goes fails the log reads
  // it had not answered.
  template <class Match>
  void fail_log_reads(Match match, const std::string& why) {
    for (auto it = log_waiters_.begin(); it != log_waiters_.end();) {
      if (!match(it->second)) {
        ++it;
        continue;
      }
      it->second.asker.conn->send(error_response(it->second.asker.request_id, Error(why)));
      it = log_waiters_.erase(it);
    }
  }

  // ---- the HTTP endpoint's view ------------------------------------------
  // The status document plus jobs and the head's counters, built on the
  // event loop for an HTTP thread; null if the loop does not get to it in
  // time (stopped, or very busy). Requests that come while a build waits
  // for the loop share it: each used to queue a build of its own, run
  // after its requester had given up (a head stalled for T seconds then
  // built T/2 snapshots, each the size of the cluster, that nobody read).
  nlohmann::json snapshot() {
    std::shared_future<nlohmann::json> result;
    {
      std::lock_guard lock(snapshot_mu_);
      const bool queued =
          queued_snapshot_.valid() && queued_snapshot_.wait_for(std::chrono::seconds(0)) != std::future_status::ready;
      if (!queued) {
        auto done = std::make_shared<std::promise<nlohmann::json>>();
        queued_snapshot_ = done->get_future().share();
        asio::post(io_, [this, done] {
          try {
            done->set_value(build_snapshot());
          } catch (...) {
            done->set_value(nullptr);
          }
        });
      }
      result = queued_snapshot_;
    }
    if (result.wait_for(std::chrono::seconds(2)) != std::future_status::ready) return nullptr;
    return result.get();
  }

  nlohmann::json build_snapshot() { return status_document(StatusRequest{}); }

  // Totals of the workers' calls and stream bytes, and their rates over
  // the last few seconds (samples taken once a second by the timer).
  void sample_worker_stats() {
    const auto now = Clock::now();
    if (!stats_samples_.empty() && now - stats_samples_.back().at < std::chrono::seconds(1)) return;
    auto [calls, bytes] = state_.worker_stats();
    stats_samples_.push_back({now, calls, bytes});
    if (stats_samples_.size() > 6) stats_samples_.pop_front();
  }

  nlohmann::json worker_rates() const {
    auto [calls, bytes] = state_.worker_stats();
    double calls_rate = 0, bytes_rate = 0;
    if (stats_samples_.size() >= 2) {
      const auto& a = stats_samples_.front();
      const auto& b = stats_samples_.back();
      const double dt = std::chrono::duration<double>(b.at - a.at).count();
      if (dt > 0) {
        calls_rate = static_cast<double>(b.calls - std::min(a.calls, b.calls)) / dt;
        bytes_rate = static_cast<double>(b.bytes - std::min(a.bytes, b.bytes)) / dt;
      }
    }
    return {{"calls_total", calls},
            {"stream_bytes_total", bytes},
            {"calls_per_second", calls_rate},
            {"stream_bytes_per_second", bytes_rate}};
  }

  // Closes connections that authenticated and sent no hello within
  // hello_timeout (every client says hello first), once a second at most.
  void close_silent_peers() {
    const auto now = Clock::now();
    if (now - last_silent_sweep_ < std::min<Clock::duration>(std::chrono::seconds(1), opts_.hello_timeout)) return;
    last_silent_sweep_ = now;
    std::vector<std::shared_ptr<Connection>> silent;
    for (auto& [raw, p] : peers_)
      if (!p->hello && now - p->accepted > opts_.hello_timeout) {
        p->final_close = true;
        silent.push_back(p->conn);
      }
    if (silent.empty()) return;
    // One line for a flood of them, naming the first.
    TROUPE_LOG_WARN("closing {} connection(s) that sent no hello within {} ms of the handshake (the first from {})",
                    silent.size(), opts_.hello_timeout.count(), silent.front()->peer());
    for (auto& conn : silent) conn->close("no hello within " + std::to_string(opts_.hello_timeout.count()) + " ms");
  }

  void arm_timer() {
    timer_.expires_after(std::chrono::milliseconds(opts_.heartbeat_ms));
    timer_.async_wait([this](asio::error_code ec) {
      if (ec) return;
      state_.check_heartbeats(Clock::now());
      check_watched();
      close_silent_peers();
      flush();
      sample_worker_stats();
      arm_timer();
    });
  }

  HeadOptions opts_;
  HeadState state_;
  uint64_t cluster_id_ = core::random_id();  // see HelloReply::cluster_id
  bool cluster_row_due_ = false;             // not in the state file yet
  std::unique_ptr<HeadStore> store_;
  std::unique_ptr<HeadStore> failed_store_;  // a store that failed a write: kept for its lock
  std::string store_error_;                  // that write's error

  // Whether the tables are written through, for status and /metrics.
  nlohmann::json state_db_json() const {
    nlohmann::json j = {{"path", opts_.state_db}, {"written", store_ != nullptr}};
    if (!store_error_.empty()) j["error"] = store_error_;
    return j;
  }
  asio::io_context io_;
  std::optional<Listener> listener_;
  asio::steady_timer timer_;
  asio::steady_timer liveness_timer_{io_};
  std::unordered_map<Connection*, std::unique_ptr<Peer>> peers_;
  std::map<uint64_t, std::shared_ptr<Connection>> node_conns_;
  std::map<uint64_t, std::vector<std::weak_ptr<Connection>>> subscribers_;
  std::map<uint64_t, std::vector<Waiter>> group_waiters_;
  std::map<std::string, std::vector<Waiter>> kv_waiters_;
  size_t waiter_timers_ = 0;  // the waiters' timers not yet done (fired or cancelled)
  PeerId next_peer_id_ = 1;
  std::map<uint64_t, std::pair<int32_t, uint64_t>> watched_;        // client id -> pid, start time (see check_watched)
  std::map<uint64_t, std::pair<int32_t, uint64_t>> watched_nodes_;  // node id -> its agent's pid, start time
  std::map<uint32_t, uint64_t> message_counts_;                     // by op, for /metrics
  // A peer can send these again and again: logged at a bounded rate.
  core::RateLimitedLog bad_message_log_{"connections closed for a bad message"};
  core::RateLimitedLog failed_event_log_{"failed events"};
  // troupe logs requests a node agent has not answered yet, by the id the
  // head gave them.
  struct LogRead {
    uint64_t node = 0;
    const Connection* via = nullptr;  // the agent's connection it was sent on
    Waiter asker;                     // and its request id
  };
  std::map<uint64_t, LogRead> log_waiters_;
  struct StatsSample {
    Clock::time_point at;
    uint64_t calls = 0, bytes = 0;
  };
  std::deque<StatsSample> stats_samples_;  // the last few seconds, for rates
  // snapshot()'s last build asked of the loop (HTTP threads share it).
  std::mutex snapshot_mu_;
  std::shared_future<nlohmann::json> queued_snapshot_;
  uint64_t next_log_request_ = 1;
  const Clock::time_point started_ = Clock::now();
  Clock::time_point last_silent_sweep_{};  // close_silent_peers
  // Set by stop() and a Shutdown request (stop() from another thread): the
  // head is going on purpose, and so are the nodes it loses from then on.
  std::atomic<bool> ending_{false};
  // Last: destroyed first, so no HTTP thread asks for a snapshot of a head
  // being torn down.
  std::unique_ptr<HttpEndpoint> http_;
};

Head::Head(HeadOptions options) {
  core::validate_heartbeat(options.heartbeat_ms, options.heartbeat_misses, "HeadOptions");
  impl_ = std::make_unique<Impl>(std::move(options));
}

Head::~Head() {
  stop();
  if (thread_.joinable()) thread_.join();
}

std::string Head::address() const { return impl_->address(); }

std::string Head::dashboard_url() const { return impl_->dashboard_url(); }

void Head::start() {
  thread_ = std::thread([this] { impl_->run(); });
}

void Head::run() { impl_->run(); }

void Head::stop() { impl_->stop(); }

}  // namespace troupe::head
