#include "troupe/runtime/head/head.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <deque>
#include <map>
#include <set>
#include <unordered_map>

#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/head/scheduler.h"
#include "troupe/runtime/wire/connection.h"
#include "troupe/runtime/wire/rpc.h"

namespace troupe::head {

using namespace troupe::wire;
using Clock = std::chrono::steady_clock;

namespace {

struct Peer {
  std::shared_ptr<Connection> conn;
  Role role = Role::kDriver;
  bool hello = false;
  uint64_t node_id = 0;
  uint64_t actor_id = 0;
};

struct Node {
  uint64_t id = 0;
  std::shared_ptr<Connection> conn;
  std::string hostname;
  std::string bind_host;
  int32_t pid = 0;
  Resources total;
  Resources available;
  std::vector<int32_t> free_gpus;
  bool alive = true;
  Clock::time_point last_heartbeat;
};

struct Actor {
  ActorInfo info;
  ActorSpec spec;
  Peer* owner = nullptr;  // the driver connection that created it
  bool placed = false;    // holds resources on info.node_id
  bool kill_requested = false;
  std::vector<std::weak_ptr<Connection>> subscribers;
};

struct PlacementGroup {
  PlacementGroupInfo info;
  PlacementGroupSpec spec;
  Peer* owner = nullptr;
  std::vector<Resources> bundle_available;
  std::vector<std::vector<int32_t>> bundle_gpus;
  std::vector<std::pair<std::shared_ptr<Connection>, uint64_t>> waiters;
};

struct KvWaiter {
  std::shared_ptr<Connection> conn;
  uint64_t request_id;
  Clock::time_point deadline;
};

int gpu_count(const Resources& r) {
  auto it = r.find("GPU");
  return it == r.end() ? 0 : static_cast<int>(it->second + 0.5);
}

}  // namespace

class Head::Impl {
 public:
  explicit Impl(HeadOptions o)
      : opts_(std::move(o)),
        listener_(io_, opts_.host, opts_.port, opts_.token, opts_.listener,
                  [this](std::shared_ptr<Connection> c) { accept(std::move(c)); }),
        timer_(io_) {
    arm_timer();
  }

  std::string address() const { return opts_.host + ":" + std::to_string(listener_.port()); }
  asio::io_context& io() { return io_; }
  void stop() {
    asio::post(io_, [this] {
      for (auto& [id, n] : nodes_)
        if (n.alive && n.conn) n.conn->send(make_event(Op::kShutdown));
      listener_.close();
      // Give the shutdown events a moment to leave, then stop the loop.
      auto t = std::make_shared<asio::steady_timer>(io_, std::chrono::milliseconds(50));
      t->async_wait([this, t](asio::error_code) { io_.stop(); });
    });
  }
  void run() {
    auto guard = asio::make_work_guard(io_);
    io_.run();
  }

 private:
  // ---- connections --------------------------------------------------------
  void accept(std::shared_ptr<Connection> conn) {
    auto peer = std::make_unique<Peer>();
    peer->conn = conn;
    Peer* p = peer.get();
    peers_[conn.get()] = std::move(peer);
    conn->start([] {}, [this, p](Message&& m) { on_message(*p, std::move(m)); },
                [this, raw = conn.get()](const std::string& reason) { on_close(raw, reason); });
  }

  void on_close(Connection* raw, const std::string& reason) {
    auto it = peers_.find(raw);
    if (it == peers_.end()) return;
    Peer& p = *it->second;
    if (p.hello && p.role == Role::kNode) {
      node_died(p.node_id, "node agent connection lost: " + reason);
    }
    // Whoever created actors or groups (a driver, or an actor) owns them.
    driver_gone(p);
    // Drop KV waiters on this connection.
    for (auto& [k, ws] : kv_waiters_)
      ws.erase(std::remove_if(ws.begin(), ws.end(), [&](const KvWaiter& w) { return w.conn.get() == raw; }), ws.end());
    peers_.erase(it);
  }

  void on_message(Peer& p, Message&& m) {
    try {
      if (m.kind == Kind::REQUEST) {
        handle_request(p, m);
      } else if (m.kind == Kind::EVENT) {
        handle_event(p, m);
      } else {
        throw DecodeError("unexpected frame kind " + std::to_string(static_cast<int>(m.kind)) + " at the head");
      }
    } catch (const DecodeError& e) {
      TROUPE_LOG_WARN("closing connection {}: {}", p.conn->peer(), e.what());
      p.conn->close(std::string("bad message: ") + e.what());
    } catch (const std::exception& e) {
      if (m.kind == Kind::REQUEST) {
        p.conn->send(error_response(m.id, e));
      } else {
        TROUPE_LOG_WARN("event op {} from {} failed: {}", m.op, p.conn->peer(), e.what());
      }
    }
  }

  template <class T>
  static T body(const Message& m) {
    return decode_value<T>(m.body.data(), m.body.size(), &m.attachments);
  }

  void require_hello(const Peer& p, Op op) {
    if (!p.hello) throw Error("request op " + std::to_string(static_cast<uint32_t>(op)) + " before hello");
  }

  void handle_request(Peer& p, const Message& m) {
    auto op = static_cast<Op>(m.op);
    if (op != Op::kHello) require_hello(p, op);
    switch (op) {
      case Op::kHello:
        return hello(p, m);
      case Op::kCreateActor:
        return create_actor(p, m);
      case Op::kSubscribeActor: {
        auto id = body<uint64_t>(m);
        Actor& a = actor(id);
        a.subscribers.push_back(p.conn);
        return p.conn->send(ok_response_value(m.id, a.info));
      }
      case Op::kGetActor: {
        auto name = body<std::string>(m);
        auto it = named_.find(name);
        if (it == named_.end()) throw ConfigError("no actor named '" + name + "'");
        return p.conn->send(ok_response_value(m.id, actor(it->second).info));
      }
      case Op::kKillActor: {
        auto k = body<KillActor>(m);
        kill_actor(actor(k.actor_id), k.no_restart, "killed by request");
        return p.conn->send(ok_response(m.id));
      }
      case Op::kCreatePlacementGroup:
        return create_pg(p, m);
      case Op::kGetPlacementGroup:
        return p.conn->send(ok_response_value(m.id, pg(body<uint64_t>(m)).info));
      case Op::kWaitPlacementGroup: {
        auto w = body<WaitPlacementGroup>(m);
        auto& g = pg(w.id);
        if (g.info.state != PlacementGroupState::kPending || w.timeout_ms == 0)
          return p.conn->send(ok_response_value(m.id, g.info));
        g.waiters.emplace_back(p.conn, m.id);
        auto t = std::make_shared<asio::steady_timer>(io_, std::chrono::milliseconds(w.timeout_ms));
        t->async_wait([this, t, id = w.id, conn = p.conn, rid = m.id](asio::error_code) {
          auto it = pgs_.find(id);
          if (it == pgs_.end()) return;
          auto& ws = it->second.waiters;
          for (auto w = ws.begin(); w != ws.end(); ++w)
            if (w->first == conn && w->second == rid) {
              conn->send(ok_response_value(rid, it->second.info));
              ws.erase(w);
              return;
            }
        });
        return;
      }
      case Op::kRemovePlacementGroup: {
        remove_pg(pg(body<uint64_t>(m)));
        return p.conn->send(ok_response(m.id));
      }
      case Op::kKvPut: {
        auto e = body<KvEntry>(m);
        kv_set(e.key, e.value);
        return p.conn->send(ok_response(m.id));
      }
      case Op::kKvGet: {
        auto key = body<std::string>(m);
        std::optional<std::string> v;
        if (auto it = kv_.find(key); it != kv_.end()) v = it->second;
        return p.conn->send(ok_response_value(m.id, v));
      }
      case Op::kKvWait: {
        auto w = body<KvWait>(m);
        if (auto it = kv_.find(w.key); it != kv_.end()) return p.conn->send(ok_response_value(m.id, it->second));
        kv_waiters_[w.key].push_back({p.conn, m.id, Clock::now() + std::chrono::milliseconds(w.timeout_ms)});
        auto t = std::make_shared<asio::steady_timer>(io_, std::chrono::milliseconds(w.timeout_ms));
        t->async_wait([this, t, key = w.key, conn = p.conn, rid = m.id, ms = w.timeout_ms](asio::error_code) {
          auto it = kv_waiters_.find(key);
          if (it == kv_waiters_.end()) return;
          auto& ws = it->second;
          for (auto w = ws.begin(); w != ws.end(); ++w)
            if (w->conn == conn && w->request_id == rid) {
              conn->send(error_response(
                  rid, Timeout("kv wait for key '" + key + "' timed out after " + std::to_string(ms) + " ms")));
              ws.erase(w);
              return;
            }
        });
        return;
      }
      case Op::kKvErase: {
        kv_.erase(body<std::string>(m));
        return p.conn->send(ok_response(m.id));
      }
      case Op::kKvAdd: {
        auto a = body<KvAdd>(m);
        int64_t v = 0;
        if (auto it = kv_.find(a.key); it != kv_.end()) {
          try {
            v = std::stoll(it->second);
          } catch (const std::exception&) {
            throw ConfigError("kv add: key '" + a.key + "' holds a non-integer value");
          }
        }
        v += a.delta;
        kv_set(a.key, std::to_string(v));
        return p.conn->send(ok_response_value(m.id, v));
      }
      case Op::kStatus:
        return p.conn->send(ok_response_value(m.id, status_json().dump()));
      case Op::kShutdown: {
        p.conn->send(ok_response(m.id));
        TROUPE_LOG_INFO("shutdown requested by {}", p.conn->peer());
        for (auto& [id, a] : actors_)
          if (a.info.state != ActorState::kDead) kill_actor(a, true, "cluster shut down");
        auto t = std::make_shared<asio::steady_timer>(io_, std::chrono::milliseconds(100));
        t->async_wait([this, t](asio::error_code) {
          for (auto& [id, n] : nodes_)
            if (n.alive && n.conn) n.conn->send(make_event(Op::kShutdown));
          auto t2 = std::make_shared<asio::steady_timer>(io_, std::chrono::milliseconds(100));
          t2->async_wait([this, t2](asio::error_code) { io_.stop(); });
        });
        return;
      }
      default:
        throw DecodeError("unknown request op " + std::to_string(m.op));
    }
  }

  void handle_event(Peer& p, const Message& m) {
    auto op = static_cast<Op>(m.op);
    require_hello(p, op);
    switch (op) {
      case Op::kHeartbeat: {
        if (p.role != Role::kNode) throw DecodeError("heartbeat from a non-node");
        auto it = nodes_.find(p.node_id);
        if (it != nodes_.end()) it->second.last_heartbeat = Clock::now();
        return;
      }
      case Op::kActorReady:
        return actor_ready(body<ActorReady>(m));
      case Op::kActorInitFailed: {
        auto f = body<ActorInitFailed>(m);
        Actor& a = actor(f.actor_id);
        if (a.info.incarnation != f.incarnation) return;
        TROUPE_LOG_WARN("actor {} ({}) failed to start: {}", a.info.id, a.info.class_name, f.error);
        a.info.death_cause = "constructor failed: " + f.error;
        a.kill_requested = true;  // no restart: the constructor would fail again
        return;
      }
      case Op::kWorkerExited:
        return worker_exited(body<WorkerExited>(m));
      default:
        throw DecodeError("unknown event op " + std::to_string(m.op));
    }
  }

  // ---- hello --------------------------------------------------------------
  void hello(Peer& p, const Message& m) {
    if (p.hello) throw Error("hello sent twice");
    auto h = body<Hello>(m);
    p.role = h.role;
    p.hello = true;
    HelloReply reply;
    if (h.role == Role::kNode) {
      Node n;
      n.id = next_node_id_++;
      n.conn = p.conn;
      n.hostname = h.hostname;
      n.bind_host = h.bind_host;
      n.pid = h.pid;
      n.total = h.resources;
      n.available = h.resources;
      for (int i = 0; i < gpu_count(h.resources); ++i) n.free_gpus.push_back(i);
      n.last_heartbeat = Clock::now();
      p.node_id = n.id;
      reply.node_id = n.id;
      reply.heartbeat_ms = opts_.heartbeat_ms;
      TROUPE_LOG_INFO("node {} joined from {} (pid {}) with {{{}}}", n.id, h.hostname, h.pid,
                      format_resources(h.resources));
      nodes_[n.id] = std::move(n);
      p.conn->send(ok_response_value(m.id, reply));
      schedule();
      return;
    }
    if (h.role == Role::kWorker) {
      Actor& a = actor(h.actor_id);
      if (a.info.incarnation != h.incarnation || a.info.state == ActorState::kDead)
        throw Error("worker for actor " + std::to_string(h.actor_id) + " incarnation " + std::to_string(h.incarnation) +
                    " is stale");
      p.actor_id = h.actor_id;
      reply.spec = a.spec;
      reply.info = a.info;
    }
    p.conn->send(ok_response_value(m.id, reply));
  }

  // ---- actors -------------------------------------------------------------
  Actor& actor(uint64_t id) {
    auto it = actors_.find(id);
    if (it == actors_.end()) throw ConfigError("no actor with id " + std::to_string(id));
    return it->second;
  }

  void create_actor(Peer& p, const Message& m) {
    auto spec = body<ActorSpec>(m);
    if (spec.max_concurrency < 1)
      throw ConfigError("max_concurrency must be >= 1, got " + std::to_string(spec.max_concurrency));
    if (spec.max_restarts < -1)
      throw ConfigError("max_restarts must be >= -1, got " + std::to_string(spec.max_restarts));
    for (const auto& [k, v] : spec.resources)
      if (v < 0) throw ConfigError("resource " + k + " must be >= 0, got " + std::to_string(v));
    if (spec.placement_group) {
      auto& g = pg(spec.placement_group);
      if (spec.bundle_index >= static_cast<int>(g.spec.bundles.size()))
        throw ConfigError("bundle index " + std::to_string(spec.bundle_index) + " out of range for placement group " +
                          std::to_string(g.info.id) + " with " + std::to_string(g.spec.bundles.size()) + " bundles");
    }
    if (!spec.name.empty()) {
      auto it = named_.find(spec.name);
      if (it != named_.end() && actors_[it->second].info.state != ActorState::kDead)
        throw ConfigError("actor name '" + spec.name + "' is already taken by actor " + std::to_string(it->second));
    }
    Actor a;
    a.info.id = next_actor_id_++;
    a.info.class_name = spec.class_name;
    a.info.name = spec.name;
    a.info.max_restarts = spec.max_restarts;
    a.info.max_task_retries = spec.max_task_retries;
    a.spec = std::move(spec);
    a.owner = &p;
    if (!a.info.name.empty()) named_[a.info.name] = a.info.id;
    uint64_t id = a.info.id;
    actors_[id] = std::move(a);
    pending_actors_.push_back(id);
    schedule();
    p.conn->send(ok_response_value(m.id, actors_[id].info));
  }

  void publish(Actor& a) {
    ++a.info.version;
    auto ev = encode_frame(make_event_value(Op::kActorUpdate, a.info));
    auto& subs = a.subscribers;
    subs.erase(std::remove_if(subs.begin(), subs.end(),
                              [&](const std::weak_ptr<Connection>& w) {
                                auto c = w.lock();
                                if (!c || !c->is_open()) return true;
                                c->send(ev);
                                return false;
                              }),
               subs.end());
  }

  // Tries to give `a` a node; true when placed.
  bool try_place(Actor& a) {
    std::string reason;
    uint64_t node_id = 0;
    std::vector<int32_t> gpus;
    int ngpu = gpu_count(a.spec.resources);
    if (a.spec.placement_group) {
      auto git = pgs_.find(a.spec.placement_group);
      if (git == pgs_.end() || git->second.info.state == PlacementGroupState::kRemoved) {
        a.info.death_cause = "placement group " + std::to_string(a.spec.placement_group) + " was removed";
        set_dead(a);
        return false;
      }
      auto& g = git->second;
      if (g.info.state != PlacementGroupState::kCreated) {
        reason = "waiting for placement group " + std::to_string(g.info.id) + ": " + g.info.pending_reason;
      } else {
        for (size_t b = 0; b < g.spec.bundles.size(); ++b) {
          if (a.spec.bundle_index >= 0 && static_cast<size_t>(a.spec.bundle_index) != b) continue;
          if (!fits(g.bundle_available[b], a.spec.resources)) continue;
          subtract(g.bundle_available[b], a.spec.resources);
          node_id = g.info.bundle_nodes[b];
          auto& pool = g.bundle_gpus[b];
          gpus.assign(pool.begin(), pool.begin() + std::min<size_t>(ngpu, pool.size()));
          pool.erase(pool.begin(), pool.begin() + gpus.size());
          a.info.gpu_ids = gpus;
          break;
        }
        if (!node_id)
          reason = "bundle " + std::to_string(a.spec.bundle_index) + " of placement group " +
                   std::to_string(g.info.id) + " has no room for {" + format_resources(a.spec.resources) + "}";
      }
    } else {
      auto pick = pick_node(node_views(), a.spec.resources, &reason);
      if (pick) {
        node_id = *pick;
        Node& n = nodes_[node_id];
        subtract(n.available, a.spec.resources);
        gpus.assign(n.free_gpus.begin(), n.free_gpus.begin() + std::min<size_t>(ngpu, n.free_gpus.size()));
        n.free_gpus.erase(n.free_gpus.begin(), n.free_gpus.begin() + gpus.size());
        a.info.gpu_ids = gpus;
      }
    }
    if (!node_id) {
      if (a.info.pending_reason != reason) {
        a.info.pending_reason = reason;
        TROUPE_LOG_WARN("actor {} ({}) is {}: {}", a.info.id, a.info.class_name, to_string(a.info.state), reason);
        publish(a);
      }
      return false;
    }
    a.placed = true;
    a.info.node_id = node_id;
    a.info.pending_reason.clear();
    Node& n = nodes_[node_id];
    SpawnWorker s;
    s.actor_id = a.info.id;
    s.incarnation = a.info.incarnation;
    s.executable = a.spec.executable;
    s.gpu_ids = gpus;
    s.env = a.spec.env;
    s.class_name = a.info.class_name;
    n.conn->send(make_event_value(Op::kSpawnWorker, s));
    TROUPE_LOG_DEBUG("actor {} ({}) incarnation {} placed on node {}", a.info.id, a.info.class_name, a.info.incarnation,
                     node_id);
    return true;
  }

  void release(Actor& a) {
    if (!a.placed) return;
    a.placed = false;
    if (a.spec.placement_group) {
      auto git = pgs_.find(a.spec.placement_group);
      if (git != pgs_.end() && git->second.info.state == PlacementGroupState::kCreated) {
        auto& g = git->second;
        // Return to the bundle that sits on the actor's node and has room.
        for (size_t b = 0; b < g.spec.bundles.size(); ++b) {
          if (g.info.bundle_nodes[b] != a.info.node_id) continue;
          if (a.spec.bundle_index >= 0 && static_cast<size_t>(a.spec.bundle_index) != b) continue;
          add(g.bundle_available[b], a.spec.resources);
          g.bundle_gpus[b].insert(g.bundle_gpus[b].end(), a.info.gpu_ids.begin(), a.info.gpu_ids.end());
          break;
        }
      }
    } else {
      auto it = nodes_.find(a.info.node_id);
      if (it != nodes_.end() && it->second.alive) {
        add(it->second.available, a.spec.resources);
        it->second.free_gpus.insert(it->second.free_gpus.end(), a.info.gpu_ids.begin(), a.info.gpu_ids.end());
      }
    }
    a.info.gpu_ids.clear();
  }

  void actor_ready(const ActorReady& r) {
    Actor& a = actor(r.actor_id);
    if (a.info.incarnation != r.incarnation || !a.placed) return;
    a.info.state = ActorState::kAlive;
    a.info.address = r.address;
    a.info.control_address = r.control_address;
    a.info.pid = r.pid;
    TROUPE_LOG_INFO("actor {} ({}{}) alive on node {} pid {} at {}{}", a.info.id, a.info.class_name,
                    a.info.name.empty() ? "" : " '" + a.info.name + "'", a.info.node_id, r.pid, r.address,
                    a.info.restarts ? " (restart " + std::to_string(a.info.restarts) + ")" : "");
    publish(a);
  }

  void worker_exited(const WorkerExited& w) {
    auto it = actors_.find(w.actor_id);
    if (it == actors_.end()) return;
    Actor& a = it->second;
    if (a.info.incarnation != w.incarnation || !a.placed) return;
    actor_lost(a, "worker pid " + std::to_string(w.pid) + " " + w.how);
    schedule();
  }

  // The actor's current worker is gone; restart it or declare it dead.
  void actor_lost(Actor& a, const std::string& why) {
    release(a);
    a.info.address.clear();
    a.info.control_address.clear();
    a.info.pid = 0;
    if (a.info.state == ActorState::kDead) return;
    bool restarts_left = a.info.max_restarts == -1 || a.info.restarts < a.info.max_restarts;
    if (a.kill_requested || !restarts_left) {
      if (a.info.death_cause.empty() || !a.kill_requested)
        a.info.death_cause = why + (restarts_left ? ""
                                                  : " (no restarts left: " + std::to_string(a.info.restarts) + " of " +
                                                        std::to_string(a.info.max_restarts) + " used)");
      TROUPE_LOG_WARN("actor {} ({}) is DEAD: {}", a.info.id, a.info.class_name, a.info.death_cause);
      set_dead(a);
      return;
    }
    a.info.restarts++;
    a.info.incarnation++;
    a.info.state = ActorState::kRestarting;
    a.info.death_cause = why;
    TROUPE_LOG_WARN("actor {} ({}) died ({}); restarting ({} of {})", a.info.id, a.info.class_name, why,
                    a.info.restarts,
                    a.info.max_restarts == -1 ? std::string("unlimited") : std::to_string(a.info.max_restarts));
    publish(a);
    pending_actors_.push_back(a.info.id);
  }

  void set_dead(Actor& a) {
    a.info.state = ActorState::kDead;
    a.info.address.clear();
    if (!a.info.name.empty()) {
      auto it = named_.find(a.info.name);
      if (it != named_.end() && it->second == a.info.id) named_.erase(it);
    }
    publish(a);
  }

  void kill_actor(Actor& a, bool no_restart, const std::string& why) {
    if (a.info.state == ActorState::kDead) return;
    if (no_restart) {
      a.kill_requested = true;
      a.info.death_cause = why;
    }
    if (a.placed) {
      auto it = nodes_.find(a.info.node_id);
      if (it != nodes_.end() && it->second.alive)
        it->second.conn->send(make_event_value(Op::kKillWorker, KillWorker{a.info.id, a.info.incarnation}));
    } else if (no_restart) {
      set_dead(a);  // never placed: nothing to wait for
    }
  }

  void driver_gone(Peer& p) {
    for (auto& [id, a] : actors_)
      if (a.owner == &p) {
        a.owner = nullptr;
        kill_actor(a, true, "its driver exited");
      }
    for (auto& [id, g] : pgs_)
      if (g.owner == &p && g.info.state != PlacementGroupState::kRemoved) {
        g.owner = nullptr;
        remove_pg(g);
      }
  }

  // ---- nodes --------------------------------------------------------------
  std::vector<NodeView> node_views() const {
    std::vector<NodeView> v;
    for (const auto& [id, n] : nodes_)
      if (n.alive) v.push_back({n.id, n.total, n.available});
    return v;
  }

  void node_died(uint64_t node_id, const std::string& why) {
    auto it = nodes_.find(node_id);
    if (it == nodes_.end() || !it->second.alive) return;
    Node& n = it->second;
    n.alive = false;
    TROUPE_LOG_WARN("node {} ({}) is dead: {}", node_id, n.hostname, why);
    if (n.conn) n.conn->close("declared dead: " + why);
    for (auto& [id, a] : actors_)
      if (a.placed && a.info.node_id == node_id) actor_lost(a, "node " + std::to_string(node_id) + " died");
    // Bundles on the dead node must be placed again.
    for (auto& [id, g] : pgs_) {
      if (g.info.state != PlacementGroupState::kCreated) continue;
      bool hit = false;
      for (auto nid : g.info.bundle_nodes) hit |= nid == node_id;
      if (!hit) continue;
      unreserve_pg(g);
      g.info.state = PlacementGroupState::kPending;
      pending_pgs_.push_back(g.info.id);
    }
    schedule();
  }

  void arm_timer() {
    timer_.expires_after(std::chrono::milliseconds(opts_.heartbeat_ms));
    timer_.async_wait([this](asio::error_code ec) {
      if (ec) return;
      auto limit = std::chrono::milliseconds(opts_.heartbeat_ms * opts_.heartbeat_misses);
      auto now = Clock::now();
      std::vector<uint64_t> dead;
      for (auto& [id, n] : nodes_)
        if (n.alive && now - n.last_heartbeat > limit) dead.push_back(id);
      for (auto id : dead)
        node_died(id, "no heartbeat for " + std::to_string(opts_.heartbeat_ms * opts_.heartbeat_misses) + " ms");
      arm_timer();
    });
  }

  // ---- placement groups ---------------------------------------------------
  PlacementGroup& pg(uint64_t id) {
    auto it = pgs_.find(id);
    if (it == pgs_.end()) throw ConfigError("no placement group with id " + std::to_string(id));
    return it->second;
  }

  void create_pg(Peer& p, const Message& m) {
    auto spec = body<PlacementGroupSpec>(m);
    if (spec.bundles.empty()) throw ConfigError("a placement group needs at least one bundle");
    for (size_t i = 0; i < spec.bundles.size(); ++i)
      for (const auto& [k, v] : spec.bundles[i])
        if (v < 0) throw ConfigError("bundle " + std::to_string(i) + " resource " + k + " is negative");
    PlacementGroup g;
    g.info.id = next_pg_id_++;
    g.spec = std::move(spec);
    g.owner = &p;
    uint64_t id = g.info.id;
    pgs_[id] = std::move(g);
    pending_pgs_.push_back(id);
    schedule();
    p.conn->send(ok_response_value(m.id, pgs_[id].info));
  }

  bool try_place_pg(PlacementGroup& g) {
    std::string reason;
    auto placed = place_bundles(node_views(), g.spec.bundles, g.spec.strategy, &reason);
    if (!placed) {
      if (g.info.pending_reason != reason) {
        g.info.pending_reason = reason;
        TROUPE_LOG_WARN("placement group {} ({} bundles, {}) is PENDING: {}", g.info.id, g.spec.bundles.size(),
                        to_string(g.spec.strategy), reason);
      }
      return false;
    }
    g.info.bundle_nodes = *placed;
    g.bundle_available = g.spec.bundles;
    g.bundle_gpus.assign(g.spec.bundles.size(), {});
    for (size_t b = 0; b < g.spec.bundles.size(); ++b) {
      Node& n = nodes_[g.info.bundle_nodes[b]];
      subtract(n.available, g.spec.bundles[b]);
      int k = std::min<int>(gpu_count(g.spec.bundles[b]), n.free_gpus.size());
      g.bundle_gpus[b].assign(n.free_gpus.begin(), n.free_gpus.begin() + k);
      n.free_gpus.erase(n.free_gpus.begin(), n.free_gpus.begin() + k);
    }
    g.info.state = PlacementGroupState::kCreated;
    g.info.pending_reason.clear();
    TROUPE_LOG_INFO("placement group {} created ({}): bundles on nodes {}", g.info.id, to_string(g.spec.strategy),
                    nlohmann::json(g.info.bundle_nodes).dump());
    for (auto& [conn, rid] : g.waiters) conn->send(ok_response_value(rid, g.info));
    g.waiters.clear();
    return true;
  }

  void unreserve_pg(PlacementGroup& g) {
    for (size_t b = 0; b < g.info.bundle_nodes.size(); ++b) {
      auto it = nodes_.find(g.info.bundle_nodes[b]);
      if (it == nodes_.end() || !it->second.alive) continue;
      add(it->second.available, g.spec.bundles[b]);
    }
    // GPU ids go back with the bundle's whole reservation.
    for (size_t b = 0; b < g.info.bundle_nodes.size(); ++b) {
      auto it = nodes_.find(g.info.bundle_nodes[b]);
      if (it == nodes_.end() || !it->second.alive) continue;
      for (auto& [aid, a] : actors_)
        if (a.placed && a.spec.placement_group == g.info.id && a.info.node_id == it->first)
          g.bundle_gpus[b].insert(g.bundle_gpus[b].end(), a.info.gpu_ids.begin(), a.info.gpu_ids.end());
      it->second.free_gpus.insert(it->second.free_gpus.end(), g.bundle_gpus[b].begin(), g.bundle_gpus[b].end());
    }
    g.info.bundle_nodes.assign(g.spec.bundles.size(), 0);
  }

  void remove_pg(PlacementGroup& g) {
    if (g.info.state == PlacementGroupState::kRemoved) return;
    for (auto& [id, a] : actors_)
      if (a.spec.placement_group == g.info.id) kill_actor(a, true, "its placement group was removed");
    if (g.info.state == PlacementGroupState::kCreated) {
      for (auto& [id, a] : actors_)
        if (a.spec.placement_group == g.info.id) a.placed = false;  // resources go back with the bundles
      unreserve_pg(g);
    }
    g.info.state = PlacementGroupState::kRemoved;
    for (auto& [conn, rid] : g.waiters) conn->send(ok_response_value(rid, g.info));
    g.waiters.clear();
    schedule();
  }

  // ---- scheduling ---------------------------------------------------------
  void schedule() {
    std::deque<uint64_t> still;
    for (auto id : pending_pgs_) {
      auto& g = pgs_[id];
      if (g.info.state != PlacementGroupState::kPending) continue;
      if (!try_place_pg(g)) still.push_back(id);
    }
    pending_pgs_.swap(still);
    still.clear();
    for (auto id : pending_actors_) {
      auto& a = actors_[id];
      if (a.info.state == ActorState::kDead || a.placed) continue;
      if (a.kill_requested) {
        set_dead(a);
        continue;
      }
      if (!try_place(a)) {
        if (a.info.state != ActorState::kDead) still.push_back(id);
      }
    }
    pending_actors_.swap(still);
  }

  // ---- kv -----------------------------------------------------------------
  void kv_set(const std::string& key, const std::string& value) {
    kv_[key] = value;
    auto it = kv_waiters_.find(key);
    if (it == kv_waiters_.end()) return;
    for (auto& w : it->second) w.conn->send(ok_response_value(w.request_id, value));
    kv_waiters_.erase(it);
  }

  // ---- status -------------------------------------------------------------
  nlohmann::json status_json() const {
    using nlohmann::json;
    json j;
    j["address"] = address();
    j["nodes"] = json::array();
    for (const auto& [id, n] : nodes_) {
      json u;
      for (const auto& [k, v] : n.total) u[k] = v - (n.available.count(k) ? n.available.at(k) : 0.0);
      j["nodes"].push_back(
          {{"id", id}, {"hostname", n.hostname}, {"pid", n.pid}, {"alive", n.alive}, {"total", n.total}, {"used", u}});
    }
    j["actors"] = json::array();
    for (const auto& [id, a] : actors_) {
      j["actors"].push_back({{"id", id},
                             {"class", a.info.class_name},
                             {"name", a.info.name},
                             {"state", to_string(a.info.state)},
                             {"node", a.info.node_id},
                             {"pid", a.info.pid},
                             {"address", a.info.address},
                             {"restarts", a.info.restarts},
                             {"max_restarts", a.info.max_restarts},
                             {"pending_reason", a.info.pending_reason},
                             {"death_cause", a.info.death_cause}});
    }
    j["placement_groups"] = json::array();
    for (const auto& [id, g] : pgs_) {
      const char* st = g.info.state == PlacementGroupState::kPending   ? "PENDING"
                       : g.info.state == PlacementGroupState::kCreated ? "CREATED"
                                                                       : "REMOVED";
      j["placement_groups"].push_back({{"id", id},
                                       {"strategy", to_string(g.spec.strategy)},
                                       {"state", st},
                                       {"bundle_nodes", g.info.bundle_nodes},
                                       {"pending_reason", g.info.pending_reason}});
    }
    j["kv_keys"] = kv_.size();
    return j;
  }

  HeadOptions opts_;
  asio::io_context io_;
  Listener listener_;
  asio::steady_timer timer_;
  std::unordered_map<Connection*, std::unique_ptr<Peer>> peers_;
  std::map<uint64_t, Node> nodes_;
  std::map<uint64_t, Actor> actors_;
  std::map<uint64_t, PlacementGroup> pgs_;
  std::map<std::string, uint64_t> named_;
  std::deque<uint64_t> pending_actors_;
  std::deque<uint64_t> pending_pgs_;
  std::map<std::string, std::string> kv_;
  std::map<std::string, std::vector<KvWaiter>> kv_waiters_;
  uint64_t next_node_id_ = 1, next_actor_id_ = 1, next_pg_id_ = 1;
};

Head::Head(HeadOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}

Head::~Head() {
  stop();
  if (thread_.joinable()) thread_.join();
}

std::string Head::address() const { return impl_->address(); }

void Head::start() {
  thread_ = std::thread([this] { impl_->run(); });
}

void Head::run() { impl_->run(); }

void Head::stop() { impl_->stop(); }

}  // namespace troupe::head
