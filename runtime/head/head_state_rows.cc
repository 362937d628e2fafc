// HeadState's write-through and restore: its tables as rows a store keeps
// (Head writes them to SQLite after every message it handles), and a
// restarted head's reload of them. See head_state.h.
#include <algorithm>
#include <cstdlib>
#include <unordered_map>

#include "troupe/runtime/client/actor_keys.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/head/head_state.h"

namespace troupe::head {

using namespace troupe::wire;

namespace {

// The records behind the rows: what a restarted head needs, no more (a
// node's heartbeat time and idle workers, and the pending queues, are
// rebuilt).
struct ActorRow {
  ActorInfo info;
  ActorSpec spec;  // its ctor_attachments travel in `attachments`
  std::vector<std::string> attachments;
  uint64_t owner_client = 0;
  bool allocated = false;
  uint64_t node_id = 0, group_id = 0, bundle = 0, epoch = 0;
  Resources grant;
  std::vector<int32_t> grant_gpus;
  bool worker_running = false, kill_requested = false;
  Resources lent;  // of grant, back in the pool while its task waits
  uint64_t last_node = 0;
  int32_t last_pid = 0;
  bool said_hello = false;
  TROUPE_FIELDS(info, spec, attachments, owner_client, allocated, node_id, group_id, bundle, epoch, grant, grant_gpus,
                worker_running, kill_requested, lent, last_node, last_pid, said_hello)
};

struct GroupRow {
  PlacementGroupInfo info;
  PlacementGroupSpec spec;
  uint64_t owner_client = 0;
  uint64_t epoch = 0;
  std::vector<Resources> reserved;
  std::vector<std::vector<int32_t>> reserved_gpus;
  TROUPE_FIELDS(info, spec, owner_client, epoch, reserved, reserved_gpus)
};

struct NodeRow {
  NodeInfo info;
  Resources total;
  TROUPE_FIELDS(info, total)
};

struct Counters {
  uint64_t next_node = 1, next_actor = 1, next_group = 1;
  uint64_t retired_calls = 0, retired_stream_bytes = 0;
  uint64_t retired_restarts = 0;
  TROUPE_FIELDS(next_node, next_actor, next_group, retired_calls, retired_stream_bytes, retired_restarts)
};

template <class T>
std::string encode_row(const T& v) {
  Encoder e = encode_value(v);
  if (!e.attachments().empty()) throw Error("head row with attachments");  // kept inline by the records above
  return std::move(e.bytes());
}

std::string actor_key(uint64_t id) { return "a/" + std::to_string(id); }
std::string group_key(uint64_t id) { return "g/" + std::to_string(id); }
std::string node_key(uint64_t id) { return "n/" + std::to_string(id); }
constexpr const char* kCountersKey = "m/counters";

}  // namespace

void HeadState::enable_write_through() {
  write_through_ = true;
  for (const auto& [id, a] : actors_) dirty_actors_.insert(id);
  for (const auto& [k, v] : kv_) dirty_kv_.insert(k);
}

std::vector<HeadState::Row> HeadState::take_rows() {
  std::vector<Row> rows;
  if (!write_through_) return rows;
  for (uint64_t id : std::exchange(dirty_actors_, {})) {
    auto it = actors_.find(id);
    if (it == actors_.end()) {
      rows.emplace_back(actor_key(id), std::nullopt);
      continue;
    }
    const Actor& a = it->second;
    ActorRow r;
    r.info = a.info;
    r.spec = a.spec;
    r.spec.ctor_attachments.clear();
    for (const auto& b : a.spec.ctor_attachments) r.attachments.push_back(b.to_string());
    r.owner_client = a.owner_client;
    if (a.allocation) {
      r.allocated = true;
      r.node_id = a.allocation->node_id;
      r.group_id = a.allocation->group_id;
      r.bundle = a.allocation->bundle;
      r.epoch = a.allocation->epoch;
      r.grant = a.allocation->grant.resources;
      r.grant_gpus = a.allocation->grant.gpu_ids;
      r.lent = a.lent;
    }
    r.worker_running = a.worker_running;
    r.kill_requested = a.kill_requested;
    r.last_node = a.last_node;
    r.last_pid = a.last_pid;
    r.said_hello = a.said_hello;
    rows.emplace_back(actor_key(id), encode_row(r));
  }
  // Job documents last and oldest first: the store's write order is what
  // a restarted head reads their age from (order_job_keys), and a head
  // writing back all its rows (after a restore) wrote them in name order.
  auto dirty = std::exchange(dirty_kv_, {});
  std::vector<std::string> jobs;
  for (const auto& key : job_keys_)
    if (dirty.erase(key)) jobs.push_back(key);
  auto add_kv = [&](const std::string& key) {
    auto it = kv_.find(key);
    rows.emplace_back("k/" + key, it == kv_.end() ? std::nullopt : std::optional<std::string>(it->second));
  };
  for (const auto& key : dirty) add_kv(key);
  for (const auto& key : jobs) add_kv(key);
  // Nodes, groups and the counters are few: each is compared with what the
  // store has and written when it changed.
  std::map<std::string, std::string> now;
  for (const auto& [id, n] : nodes_) {
    NodeRow r{n.info, n.pool.total()};
    r.info.idle_workers = 0;  // changes with every heartbeat; not worth a write
    now[node_key(id)] = encode_row(r);
  }
  for (const auto& [id, g] : groups_) {
    GroupRow r{g.info, g.spec, g.owner_client, g.epoch, {}, {}};
    for (const auto& grant : g.reserved) {
      r.reserved.push_back(grant.resources);
      r.reserved_gpus.push_back(grant.gpu_ids);
    }
    now[group_key(id)] = encode_row(r);
  }
  now[kCountersKey] = encode_row(Counters{next_node_id_, next_actor_id_, next_group_id_, retired_calls_,
                                          retired_stream_bytes_, retired_restarts_});
  for (const auto& [key, value] : written_)
    if (!now.count(key)) rows.emplace_back(key, std::nullopt);
  for (auto& [key, value] : now) {
    auto it = written_.find(key);
    if (it == written_.end() || it->second != value) rows.emplace_back(key, value);
  }
  written_ = std::move(now);
  return rows;
}

void HeadState::restore(const std::map<std::string, std::string>& rows, Time now, std::chrono::milliseconds grace,
                        const std::vector<std::string>& written_order) {
  const Time deadline = now + grace;
  restore_nodes_and_keys(rows, deadline);
  restore_groups(rows, deadline);
  restore_actors(rows, deadline);
  // The keys' references are counted again, and a client that holds keys
  // has the grace to come back that an owner has (client_gone otherwise).
  ref_counts_.clear();
  job_keys_.clear();
  const std::string clients = client::kClientKeyPrefix;
  for (const auto& [key, value] : kv_) {
    kv_added(key);
    if (key.compare(0, clients.size(), clients) == 0) {
      const uint64_t id = std::strtoull(key.c_str() + clients.size(), nullptr, 10);
      if (id != 0) awaited_owners_.emplace(id, Awaited{deadline, kNotBackAfterRestore});
    }
  }
  order_job_keys(written_order);
  written_.clear();
  for (const auto& [key, value] : rows)
    if (key[0] == 'n' || key[0] == 'g' || key[0] == 'm') written_[key] = value;
  TROUPE_LOG_INFO(
      "restored {} nodes, {} actors, {} placement groups and {} keys; nodes and owners have {} ms to "
      "come back",
      nodes_.size(), actors_.size(), groups_.size(), kv_.size(), grace.count());
  schedule();
}

void HeadState::order_job_keys(const std::vector<std::string>& written_order) {
  if (written_order.empty() || job_keys_.size() < 2) return;
  std::unordered_map<std::string, size_t> rank;
  for (size_t i = 0; i < written_order.size(); ++i)
    if (written_order[i].rfind("k/", 0) == 0) rank[written_order[i].substr(2)] = i + 1;
  auto rank_of = [&](const std::string& key) {
    auto it = rank.find(key);
    return it == rank.end() ? size_t{0} : it->second;
  };
  std::stable_sort(job_keys_.begin(), job_keys_.end(),
                   [&](const std::string& a, const std::string& b) { return rank_of(a) < rank_of(b); });
}

void HeadState::restart_grace(Time now, std::chrono::milliseconds grace) {
  const Time deadline = now + grace;
  const auto limit = fence_time();
  for (auto& [id, n] : nodes_)
    if (n.info.alive && n.awaiting) n.last_heartbeat = std::max(n.last_heartbeat, deadline - limit);
  for (auto& [client, awaited] : awaited_owners_)
    if (awaited.why == kNotBackAfterRestore) awaited.deadline = std::max(awaited.deadline, deadline);
}

void HeadState::restore_nodes_and_keys(const std::map<std::string, std::string>& rows, Time deadline) {
  const auto limit = fence_time();
  for (const auto& [key, value] : rows) {
    if (key == kCountersKey) {
      auto c = decode_value<Counters>(value);
      next_node_id_ = c.next_node;
      next_actor_id_ = c.next_actor;
      next_group_id_ = c.next_group;
      retired_calls_ = c.retired_calls;
      retired_restarts_ = c.retired_restarts;
      retired_stream_bytes_ = c.retired_stream_bytes;
    } else if (key.rfind("k/", 0) == 0) {
      kv_[key.substr(2)] = value;
    } else if (key.rfind("n/", 0) == 0) {
      auto r = decode_value<NodeRow>(value);
      Node n;
      n.info = r.info;
      n.pool = ResourcePool(r.total);
      n.last_heartbeat = deadline - limit;  // declared dead at the deadline unless it comes back
      n.awaiting = n.info.alive;
      n.awaiting_why = "did not come back to the restarted head";
      if (!n.info.alive) dead_nodes_order_.push_back(n.info.id);
      nodes_[n.info.id] = std::move(n);
    }
  }
  // Rows come in key order ("n/10" before "n/9"): oldest first by id, so
  // that the limit forgets the oldest dead node.
  std::sort(dead_nodes_order_.begin(), dead_nodes_order_.end());
}

void HeadState::restore_groups(const std::map<std::string, std::string>& rows, Time deadline) {
  for (const auto& [key, value] : rows) {
    if (key.rfind("g/", 0) != 0) continue;
    auto r = decode_value<GroupRow>(value);
    Group g;
    g.info = r.info;
    g.spec = r.spec;
    g.owner_client = r.owner_client;
    g.epoch = r.epoch;
    if (g.info.state != PlacementGroupState::kRemoved) {
      // A PENDING group holds the bundles it kept when others were lost
      // with a node (0: to place again).
      for (size_t b = 0; b < r.reserved.size() && b < g.info.bundle_nodes.size(); ++b) {
        Grant grant{r.reserved[b], r.reserved_gpus.at(b)};
        if (g.info.bundle_nodes[b] != 0) nodes_.at(g.info.bundle_nodes[b]).pool.retake(grant);
        g.bundles.emplace_back(grant.resources, grant.gpu_ids);
        g.reserved.push_back(std::move(grant));
      }
      if (g.info.state == PlacementGroupState::kPending) pending_groups_.push_back(g.info.id);
    } else {
      removed_groups_order_.push_back(g.info.id);
    }
    if (g.owner_client && g.info.state != PlacementGroupState::kRemoved)
      awaited_owners_[g.owner_client] = {deadline, kNotBackAfterRestore};
    groups_[g.info.id] = std::move(g);
  }
  // Oldest first by id, as they were queued (key order put group 10 before
  // 9: a restart reserved them the other way round, and forgot the newest
  // removed group rather than the oldest).
  std::sort(pending_groups_.begin(), pending_groups_.end());
  std::sort(removed_groups_order_.begin(), removed_groups_order_.end());
}

void HeadState::restore_actors(const std::map<std::string, std::string>& rows, Time deadline) {
  for (const auto& [key, value] : rows) {
    if (key.rfind("a/", 0) != 0) continue;
    auto r = decode_value<ActorRow>(value);
    Actor a;
    a.info = r.info;
    a.spec = r.spec;
    for (const auto& bytes : r.attachments) a.spec.ctor_attachments.push_back(Buffer::from_string(bytes));
    a.owner_client = r.owner_client;
    a.worker_running = r.worker_running;
    a.said_hello = r.said_hello;
    a.kill_requested = r.kill_requested;
    a.last_node = r.last_node;
    a.last_pid = r.last_pid;
    if (r.allocated) {
      Allocation al{r.node_id, r.group_id, r.bundle, r.epoch, Grant{r.grant, r.grant_gpus}};
      if (ResourcePool* pool = pool_of(al)) {
        pool->retake(al.grant);
        pool->give_back(Grant{r.lent, {}});
      }
      a.allocation = std::move(al);
      count_placed(*a.allocation, 1);
      a.lent = r.lent;
      // Who lent it is not kept: blocked says its worker did; lent and not
      // blocked, its owner (an idle executor). Both tell again once back.
      if (!a.lent.empty()) a.lenders = a.info.blocked ? kLentByWorker : kLentByOwner;
    }
    const uint64_t id = a.info.id;
    if (a.spec.request_id != 0) requests_[a.spec.request_id] = id;
    if (a.info.state == ActorState::kDead) {
      dead_order(a).push_back(id);
    } else {
      // Two live rows may carry one name: an actor killed for good (its
      // worker still stopping when the head went), whose kill freed the
      // name, and the newer one that took it. The killed one claims
      // nothing; among others (none, but ids grow) the newest holds it.
      if (!a.info.name.empty() && !a.kill_requested) {
        auto [it, fresh] = named_.emplace(a.info.name, id);
        if (!fresh && it->second < id) it->second = id;
      }
      if (!a.worker_running) pending_actors_.push_back(id);
      if (a.owner_client) awaited_owners_[a.owner_client] = {deadline, kNotBackAfterRestore};
    }
    actors_[id] = std::move(a);
  }
  // Rows come in key order ("a/1000" before "a/999"): the queues go oldest
  // first by id, as they were filled (ids grow with creation).
  std::sort(dead_order_.begin(), dead_order_.end());
  std::sort(dead_routine_.begin(), dead_routine_.end());
  std::sort(pending_actors_.begin(), pending_actors_.end());
}

void HeadState::bind_client(PeerId peer, uint64_t client_id, uint64_t worker_actor, uint32_t incarnation) {
  if (client_id == 0) return;
  clients_[peer] = client_id;
  if (worker_actor) worker_clients_[client_id] = {worker_actor, incarnation};
  if (!awaited_owners_.erase(client_id)) return;
  size_t actors = 0, groups = 0;
  for (auto& [id, a] : actors_)
    if (a.owner_client == client_id && a.owner == 0 && a.info.state != ActorState::kDead) {
      a.owner = peer;
      ++actors;
    }
  for (auto& [id, g] : groups_)
    if (g.owner_client == client_id && g.owner == 0 && g.info.state != PlacementGroupState::kRemoved) {
      g.owner = peer;
      ++groups;
    }
  // A client the head awaited for its keys alone owns no actor or group.
  TROUPE_LOG_INFO("client {} came back to the head: it owns {} actors, {} placement groups and {} keys", client_id,
                  actors, groups, kv_with_prefix(client::client_key_prefix(client_id)).size());
  if (actors > 0) tell_resources_wanted(peer);
}

void HeadState::check_restored_owners(Time now) {
  std::vector<std::pair<uint64_t, std::string>> gone;
  for (const auto& [client, awaited] : awaited_owners_)
    if (now > awaited.deadline) gone.emplace_back(client, awaited.why);
  for (auto& [client, why] : gone) {
    TROUPE_LOG_WARN("client {} did not come back to the head", client);
    drop_awaited(client, why);
  }
}

void HeadState::client_exited(uint64_t client_id) {
  if (!awaited_owners_.count(client_id)) return;
  TROUPE_LOG_INFO("client {} exited without saying goodbye", client_id);
  drop_awaited(client_id, kOwnerExited);
}

std::string HeadState::owner_gone_cause(uint64_t client_id) const {
  auto w = worker_clients_.find(client_id);
  if (w == worker_clients_.end()) return kOwnerExited;
  auto a = actors_.find(w->second.first);
  const std::string what =
      "actor " + std::to_string(w->second.first) + (a != actors_.end() ? " (" + a->second.info.class_name + ")" : "");
  return "its owner, " + what + ", ended";
}

void HeadState::drop_awaited(uint64_t client, const std::string& given) {
  if (!awaited_owners_.erase(client)) return;
  // A worker's: said as its actor's (the caller's is a driver's words).
  const std::string why = given == kOwnerExited ? owner_gone_cause(client) : given;
  worker_clients_.erase(client);
  auto actors = actor_ids_where([&](const Actor& a) { return a.owner == 0 && a.owner_client == client; });
  std::vector<uint64_t> groups;
  for (auto& [id, g] : groups_)
    if (g.owner == 0 && g.owner_client == client) groups.push_back(id);
  TROUPE_LOG_INFO("client {}'s {} actors, {} placement groups and {} keys go", client, actors.size(), groups.size(),
                  kv_with_prefix(client::client_key_prefix(client)).size());
  client_gone(client);
  for (auto id : actors)
    if (actors_.count(id)) kill_actor(id, true, why);
  for (auto id : groups)
    if (groups_.count(id)) remove_placement_group(id);
}

uint64_t HeadState::resume_node(PeerId peer, const Hello& hello, Time now) {
  auto it = nodes_.find(hello.resume_node_id);
  // Its agent's new connection may come before the head saw the old one
  // close: the same agent (pid and hostname) takes the node over, and the
  // old connection's close finds no node of its own.
  const bool same_agent =
      it != nodes_.end() && it->second.info.pid == hello.pid && it->second.info.hostname == hello.hostname;
  if (it == nodes_.end() || !it->second.info.alive || !(it->second.awaiting || same_agent)) {
    const char* why = it == nodes_.end()       ? "this head has no node of that id"
                      : !it->second.info.alive ? "it was declared dead meanwhile"
                                               : "a node of that id is still connected";
    TROUPE_LOG_WARN("node {} came back, but {}: it joins as a new node", hello.resume_node_id, why);
    return register_node(peer, hello, now);
  }
  Node& n = it->second;
  n.awaiting = false;
  n.awaiting_why.clear();
  n.peer = peer;
  n.last_heartbeat = now;
  n.info.pid = hello.pid;
  const uint64_t node_id = n.info.id;
  std::set<std::pair<uint64_t, uint32_t>> running;
  for (const auto& w : hello.workers) running.emplace(w.actor_id, w.incarnation);
  // Workers the head does not know of (their actor moved on or was
  // forgotten) go; actors whose worker is not there any more are lost.
  for (const auto& w : hello.workers) {
    auto a = actors_.find(w.actor_id);
    // A kill sent while the agent was away was lost with its connection.
    if (a == actors_.end() || a->second.info.incarnation != w.incarnation || !a->second.worker_running ||
        a->second.info.node_id != node_id || a->second.kill_requested || a->second.kill_sent == w.incarnation)
      out_.kills.emplace_back(node_id, KillWorker{w.actor_id, w.incarnation});
  }
  // One whose worker never said hello may never have been spawned: the
  // spawn was lost with the old connection. It is placed again without
  // using a restart (one that said hello took its arguments, and counts
  // as a crash).
  for (auto id : actor_ids_where([&](const Actor& a) {
         return a.worker_running && a.info.node_id == node_id && !running.count({a.info.id, a.info.incarnation});
       }))
    if (auto a = actors_.find(id); a != actors_.end()) {
      if (a->second.said_hello)
        actor_lost(a->second, "its worker ended while its node was away from the head");
      else
        actor_lost(a->second, "its worker had not started when its node came back (its spawn may have been lost)",
                   false);
    }
  drop_exited_workers();
  TROUPE_LOG_INFO("node {} is back with {} workers", node_id, hello.workers.size());
  schedule();
  return node_id;
}

void HeadState::node_leaving(uint64_t node_id) {
  auto it = nodes_.find(node_id);
  if (it == nodes_.end() || !it->second.info.alive) return;
  it->second.awaiting = true;
  it->second.awaiting_why = "its agent said goodbye but its connection did not close";
}

}  // namespace troupe::head
