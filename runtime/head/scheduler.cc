#include "troupe/runtime/head/scheduler.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <optional>
#include <sstream>

#include <fmt/format.h>

#include "troupe/runtime/core/errors.h"

namespace troupe::head {

namespace {
constexpr double kEps = 1e-9;

double get(const Resources& r, const std::string& k) {
  auto it = r.find(k);
  return it == r.end() ? 0.0 : it->second;
}

// Fraction of the node in use after placing req (the largest over the
// resources the request names); lower is emptier. Only those: a node
// whose one GPU (or most of whose memory) was held scored full for every
// CPU request, and SPREAD put all of them on the other nodes. A request
// of nothing scores 0 everywhere (the fewest actors decide).
double load_after(const NodeView& n, const Resources& req) {
  double worst = 0;
  for (const auto& [k, amount] : req) {
    const double v = get(n.total, k);
    if (v <= 0 || amount <= 0) continue;
    double used = v - get(n.available, k) + amount;
    worst = std::max(worst, used / v);
  }
  return worst;
}

// The largest used fraction over every resource of the node: how full it
// is, for PACK's "the fullest node that fits" (load_after counts only what
// a request names, and a request of nothing named none).
double fullness(const NodeView& n) {
  double worst = 0;
  for (const auto& [k, v] : n.total) {
    if (v <= 0) continue;
    worst = std::max(worst, (v - get(n.available, k)) / v);
  }
  return worst;
}

// Takes req out of a node view being planned on: its amounts and its GPUs.
// Defined below the public helpers it uses.
void reserve(NodeView& n, const Resources& req);

std::string nodes_summary(const std::vector<NodeView>& nodes) {
  std::ostringstream s;
  if (nodes.empty()) return "no nodes alive";
  s << "available:";
  for (const auto& n : nodes) s << " node " << n.id << " {" << format_resources(n.available) << "}";
  return s.str();
}

}  // namespace

double gpu_amount(const Resources& r) { return get(r, "GPU"); }

namespace {
void reserve(NodeView& n, const Resources& req) {
  subtract(n.available, req);
  if (n.gpu_free.empty()) return;
  const double amount = gpu_amount(req);
  if (auto picked = pick_gpus(n.gpu_free, amount)) take_gpus(n.gpu_free, *picked, amount);
}
}  // namespace

std::optional<std::vector<size_t>> pick_gpus(const std::vector<double>& free, double amount) {
  std::vector<size_t> out;
  if (!(amount > kEps)) return out;
  if (amount < 1 - kEps) {
    // Best fit: the GPU with the least free share that still holds it.
    std::optional<size_t> best;
    for (size_t i = 0; i < free.size(); ++i)
      if (free[i] + kEps >= amount && (!best || free[i] < free[*best])) best = i;
    if (!best) return std::nullopt;
    out.push_back(*best);
    return out;
  }
  const auto whole = static_cast<size_t>(std::llround(amount));
  for (size_t i = 0; i < free.size() && out.size() < whole; ++i)
    if (free[i] >= 1 - kEps) out.push_back(i);
  if (out.size() < whole) return std::nullopt;
  return out;
}

std::vector<size_t> placement_order(const std::vector<Resources>& bundles) {
  // Largest first, by GPUs, then CPUs, memory, then the other resources'
  // sum: in the order given, {GPU:1} took the 8-GPU node and {GPU:8}, next,
  // fitted nowhere, though the group fits in the other order.
  auto key = [&](size_t i) {
    const Resources& r = bundles[i];
    double others = 0;
    for (const auto& [name, amount] : r)
      if (name != "GPU" && name != "CPU" && name != "memory") others += amount;
    return std::array<double, 4>{gpu_amount(r), get(r, "CPU"), get(r, "memory"), others};
  };
  std::vector<size_t> order(bundles.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const auto ka = key(a), kb = key(b);
    for (size_t k = 0; k < ka.size(); ++k) {
      if (ka[k] > kb[k] + kEps) return true;
      if (kb[k] > ka[k] + kEps) return false;
    }
    return false;
  });
  return order;
}

double gpu_share(double amount) { return amount < 1 - kEps ? amount : 1.0; }

void take_gpus(std::vector<double>& free, const std::vector<size_t>& picked, double amount) {
  const double each = gpu_share(amount);
  for (size_t i : picked) free.at(i) = std::max(0.0, free.at(i) - each);
}

bool fits(const NodeView& n, const Resources& req) {
  if (!fits(n.available, req)) return false;
  return n.gpu_free.empty() || pick_gpus(n.gpu_free, gpu_amount(req)).has_value();
}

bool fits(const Resources& avail, const Resources& req) {
  for (const auto& [k, v] : req) {
    if (!std::isfinite(v) || v < 0) return false;  // never fits, never stored
    // Written so that a NaN amount available fits nothing.
    if (v > kEps && !(get(avail, k) + kEps >= v)) return false;
  }
  return true;
}

namespace {
// Adds sign * req to avail; a non-finite amount is refused before any is stored.
void add_scaled(Resources& avail, const Resources& req, double sign) {
  for (const auto& [k, v] : req)
    if (!std::isfinite(v) || !std::isfinite(get(avail, k)))
      throw ConfigError("resource '" + k + "' is not a finite number");
  for (const auto& [k, v] : req) {
    if (v == 0) continue;
    double& x = avail[k];
    x += sign * v;
    // Fractions given back leave rounding dust (2.2e-16 of an idle node's
    // CPUs, in `troupe status`): amounts are decimal, none that small.
    if (std::abs(x) < kEps) x = 0;
  }
}
}  // namespace

void subtract(Resources& avail, const Resources& req) { add_scaled(avail, req, -1); }

void add(Resources& avail, const Resources& req) { add_scaled(avail, req, 1); }

std::string format_resources(const Resources& r) {
  std::ostringstream s;
  bool first = true;
  for (const auto& [k, v] : r) {
    if (!first) s << ", ";
    first = false;
    s << k << "=";
    if (std::abs(v - std::round(v)) < kEps)
      s << static_cast<long long>(std::round(v));
    else
      s << fmt::format("{}", v);  // the shortest that reads back as v: 0.5, not 0.500000
  }
  return s.str();
}

namespace {
std::string trimmed(const std::string& s) {
  size_t b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

// A decimal amount as people write them: 2, 0.5, .25, 1e3. Hexadecimal
// ("0x10", which stod read as 16), "inf" and "nan" are not amounts.
std::optional<double> decimal_amount(const std::string& s) {
  if (s.empty() || !(std::isdigit(static_cast<unsigned char>(s[0])) || s[0] == '.' || s[0] == '-')) return {};
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c)) && std::string_view(".eE+-").find(c) == std::string_view::npos)
      return {};
  try {
    size_t used = 0;
    double v = std::stod(s, &used);
    if (used == s.size()) return v;
  } catch (const std::exception&) {
  }
  return {};
}
}  // namespace

Resources parse_resources(const std::string& text) {
  Resources r;
  std::stringstream ss(text);
  std::string part;
  bool any = false;
  while (std::getline(ss, part, ',')) {
    if (part.empty()) {
      if (!ss.eof()) throw ConfigError("'" + text + "' has an empty entry (give NAME=AMOUNT,NAME=AMOUNT)");
      continue;  // a trailing comma
    }
    any = true;
    auto eq = part.find('=');
    std::string name = trimmed(part.substr(0, eq));
    if (eq == std::string::npos || name.empty()) throw ConfigError("resource '" + part + "' is not NAME=AMOUNT");
    auto amount = decimal_amount(trimmed(part.substr(eq + 1)));
    if (!amount) throw ConfigError("resource '" + part + "' has a bad amount (give a decimal number: 2, 0.5, 1e9)");
    double v = *amount;
    if (v < 0 || !std::isfinite(v)) throw ConfigError("resource '" + part + "' must be a non-negative number");
    if (!r.emplace(name, v).second)
      throw ConfigError("resource '" + name + "' is given twice in '" + text + "' (give each once)");
  }
  if (!any && !text.empty()) throw ConfigError("'" + text + "' names no resource (give NAME=AMOUNT,NAME=AMOUNT)");
  return r;
}

std::optional<uint64_t> pick_node(const std::vector<NodeView>& nodes, const Resources& req, std::string* reason) {
  const NodeView* best = nullptr;
  double best_load = 0;
  for (const auto& n : nodes) {
    if (!fits(n, req)) continue;
    double l = load_after(n, req);
    if (!best || l < best_load - kEps || (l <= best_load + kEps && n.actors < best->actors)) {
      best = &n;
      best_load = l;
    }
  }
  if (best) return best->id;
  if (reason && nodes.empty()) {
    *reason = req.empty() ? std::string("no node is alive to run it")
                          : "no node is alive to hold {" + format_resources(req) + "}";
  } else if (reason) {
    bool any_total = std::any_of(nodes.begin(), nodes.end(), [&](const NodeView& n) { return fits(n.total, req); });
    *reason = "no node can hold {" + format_resources(req) + "} " +
              (any_total ? "right now" : "at all (no node has that much in total)") + "; " + nodes_summary(nodes);
    // The amount is free somewhere, but as parts of GPUs: a whole GPU (or
    // a part) must come from one device. Said with each device's free
    // share; the summary alone showed enough free.
    for (const auto& n : nodes) {
      if (n.gpu_free.empty() || !fits(n.available, req) || fits(n, req)) continue;
      std::string shares;
      for (double f : n.gpu_free) shares += (shares.empty() ? "" : ", ") + fmt::format("{:g}", f);
      *reason += fmt::format(
          "; node {} has GPU={:g} free, but only as parts of its devices ({}), and a request "
          "takes its GPUs whole from one device each (a part from one device)",
          n.id, get(n.available, "GPU"), shares);
    }
  }
  return std::nullopt;
}

std::vector<NodeView> affine_views(const wire::ActorSpec& spec, const std::vector<NodeView>& views) {
  if (!spec.node_affinity) return views;
  std::vector<NodeView> out;
  for (const auto& v : views)
    if (v.id == spec.node_affinity) out.push_back(v);
  return out;
}

namespace {
// The least loaded node that holds every bundle (whose sum is `sum`), taken
// one by one: two halves of a GPU may share one GPU; a whole GPU may not be
// split. nullptr when no node does.
const NodeView* node_for_all(const std::vector<NodeView>& nodes, const std::vector<Resources>& bundles,
                             const Resources& sum) {
  const NodeView* best = nullptr;
  double best_load = 0;
  for (const auto& n : nodes) {
    NodeView trial = n;
    bool ok = true;
    for (size_t i : placement_order(bundles)) {
      if (!fits(trial, bundles[i])) {
        ok = false;
        break;
      }
      reserve(trial, bundles[i]);
    }
    if (!ok) continue;
    double l = load_after(n, sum);
    if (!best || l < best_load - kEps) {
      best = &n;
      best_load = l;
    }
  }
  return best;
}

std::string bundle_text(const std::vector<Resources>& bundles, size_t i) {
  return "bundle " + std::to_string(i) + " {" + format_resources(bundles[i]) + "}";
}

// PACK and STRICT_PACK of the bundles in `order` (the others are kept on
// `kept_nodes`): all on one node — the kept bundles' node when there is
// one, the only one STRICT_PACK may use —, else (PACK) each on the fullest
// node that fits it. Fills `out`; returns why not.
std::optional<std::string> pack(std::vector<NodeView>& nodes, const std::vector<Resources>& bundles, bool strict,
                                const std::vector<size_t>& order, const std::vector<uint64_t>& kept_nodes,
                                std::vector<uint64_t>& out) {
  std::vector<Resources> rest;
  Resources sum;
  for (size_t i : order) {
    rest.push_back(bundles[i]);
    add(sum, bundles[i]);
  }
  std::vector<NodeView> candidates;
  if (kept_nodes.size() == 1) {
    for (const auto& n : nodes)
      if (n.id == kept_nodes[0]) candidates.push_back(n);
  } else if (kept_nodes.empty()) {
    candidates = nodes;
  }
  if (const NodeView* all_on = node_for_all(candidates, rest, sum)) {
    for (size_t i : order) out[i] = all_on->id;
    return std::nullopt;
  }
  if (strict) {
    if (!kept_nodes.empty())
      return "STRICT_PACK: node " + std::to_string(kept_nodes[0]) +
             ", which holds the group's other bundles, cannot also hold {" + format_resources(sum) + "}";
    return "STRICT_PACK: no single node can hold all bundles {" + format_resources(sum) + "}";
  }
  for (size_t i : order) {
    NodeView* target = nullptr;
    for (auto& n : nodes) {
      if (!fits(n, bundles[i])) continue;
      if (!target || fullness(n) > fullness(*target)) target = &n;
    }
    if (!target) return "PACK: " + bundle_text(bundles, i) + " fits on no node";
    reserve(*target, bundles[i]);
    out[i] = target->id;
  }
  return std::nullopt;
}

// SPREAD and STRICT_SPREAD: each bundle of `order` on the least loaded node
// not yet used by this group, the kept bundles' nodes included (STRICT
// insists; SPREAD reuses when it must). Fills `out`; returns why not.
std::optional<std::string> spread(std::vector<NodeView>& nodes, const std::vector<Resources>& bundles, bool strict,
                                  const std::vector<size_t>& order, std::vector<uint64_t> used,
                                  std::vector<uint64_t>& out) {
  for (size_t i : order) {
    NodeView* target = nullptr;
    double best = 0;
    for (int pass = 0; pass < 2 && !target; ++pass) {
      if (pass == 1 && strict) break;
      for (auto& n : nodes) {
        bool taken = std::find(used.begin(), used.end(), n.id) != used.end();
        if (pass == 0 && taken) continue;
        if (!fits(n, bundles[i])) continue;
        double l = load_after(n, bundles[i]);
        if (!target || l < best) {
          target = &n;
          best = l;
        }
      }
    }
    if (!target)
      return std::string(strict ? "STRICT_SPREAD" : "SPREAD") + ": " + bundle_text(bundles, i) + " has no " +
             (strict ? "distinct " : "") + "node that fits";
    reserve(*target, bundles[i]);
    used.push_back(target->id);
    out[i] = target->id;
  }
  return std::nullopt;
}
}  // namespace

std::optional<std::vector<uint64_t>> place_bundles(std::vector<NodeView> nodes, const std::vector<Resources>& bundles,
                                                   wire::PlacementStrategy strategy, std::string* reason,
                                                   const std::vector<uint64_t>& kept) {
  using S = wire::PlacementStrategy;
  std::vector<uint64_t> out(bundles.size(), 0);
  if (kept.size() == bundles.size()) out = kept;
  // The bundles to place, in placement order, and the nodes of the kept ones.
  std::vector<size_t> order;
  std::vector<uint64_t> kept_nodes;
  for (size_t i : placement_order(bundles)) {
    if (out[i] == 0)
      order.push_back(i);
    else if (std::find(kept_nodes.begin(), kept_nodes.end(), out[i]) == kept_nodes.end())
      kept_nodes.push_back(out[i]);
  }
  if (order.empty()) return out;
  // The summary names what the nodes have, not what is left of them after
  // the bundles a failed placement took on trial (it said 1 CPU free on
  // each of three nodes with 2 free).
  const std::vector<NodeView> as_given = reason ? nodes : std::vector<NodeView>{};
  const auto why = strategy == S::kStrictPack || strategy == S::kPack
                       ? pack(nodes, bundles, strategy == S::kStrictPack, order, kept_nodes, out)
                       : spread(nodes, bundles, strategy == S::kStrictSpread, order, kept_nodes, out);
  if (!why) return out;
  if (reason) *reason = *why + "; " + nodes_summary(as_given);
  return std::nullopt;
}

}  // namespace troupe::head
