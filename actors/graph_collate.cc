#include "troupe/actors/graph_collate.h"

#include <algorithm>
#include <map>

#include "troupe/actors/batch.h"
#include "troupe/runtime/core/errors.h"

namespace troupe::actors {

namespace {

bool listed(const std::vector<std::string>& keys, const std::string& key) {
  return std::find(keys.begin(), keys.end(), key) != keys.end();
}

[[noreturn]] void bad(size_t sample, const std::string& problem) {
  throw Error("graph_collate: sample " + std::to_string(sample) + " " + problem);
}

// Sample `g`'s edge index, checked against its `nodes`, offset by `offset`.
torch::Tensor offset_edges(const torch::Tensor& e, size_t g, int64_t nodes, int64_t offset) {
  if (e.dim() != 2 || e.size(0) != 2 || e.is_floating_point())
    bad(g, "has an edge index of " + describe_tensor(e) + "; it must be [2, E] integers");
  if (e.numel() > 0 && (e.min().item<int64_t>() < 0 || e.max().item<int64_t>() >= nodes))
    bad(g, "has an edge index outside its " + std::to_string(nodes) + " nodes");
  return e.to(torch::kLong) + offset;
}

// Sample `g`'s node and edge keys have a row per node and per edge: one
// that did not was concatenated out of line with the others' rows.
void check_rows(const Sample& s, size_t g, int64_t nodes, const GraphKeys& keys) {
  auto rows = [&](const std::string& key, int64_t want, const char* per) {
    if (!s.contains(key)) return;
    const torch::Tensor& t = s.at(key);
    if (t.dim() == 0 || t.size(0) != want)
      bad(g, "has " + describe_tensor(t) + " under '" + key + "'; it must have " + std::to_string(want) +
                 " rows, one per " + per);
  };
  for (const auto& key : keys.node) rows(key, nodes, "node");
  for (const auto& key : keys.edge) {
    if (!s.contains(key)) continue;
    if (!s.contains(keys.edge_index)) bad(g, "has '" + key + "' but no edge index '" + keys.edge_index + "'");
    const torch::Tensor& e = s.at(keys.edge_index);
    if (e.dim() == 2) rows(key, e.size(1), "edge");
  }
}

// A node or edge key that some samples have is in every sample with nodes
// (edges) to have rows for: without it there, the concatenated rows no
// longer line up with the batch's nodes. A graph without edges may leave
// its edge keys out.
void check_present(const std::vector<Sample>& samples, const std::string& key, const GraphKeys& keys) {
  const bool node_key = listed(keys.node, key);
  for (size_t g = 0; g < samples.size(); ++g) {
    const Sample& s = samples[g];
    if (s.contains(key)) continue;
    int64_t rows = 0;
    if (node_key) {
      rows = s.at(keys.node.front()).size(0);
    } else if (s.contains(keys.edge_index) && s.at(keys.edge_index).dim() == 2) {
      rows = s.at(keys.edge_index).size(1);
    }
    if (rows > 0)
      bad(g, "has no '" + key + "', which other samples have, though it has " + (node_key ? "nodes" : "edges") + " (" +
                 std::to_string(rows) + ")");
  }
}

}  // namespace

TensorDict graph_collate(const std::vector<Sample>& samples, const GraphKeys& keys) {
  if (samples.empty()) throw Error("graph_collate: no samples");
  if (keys.node.empty()) throw Error("graph_collate: no node key");
  std::map<std::string, std::vector<torch::Tensor>> cat0, stack;
  std::vector<torch::Tensor> edges, batch;
  int64_t offset = 0;
  for (size_t g = 0; g < samples.size(); ++g) {
    const Sample& s = samples[g];
    if (!s.contains(keys.node.front())) bad(g, "has no node key '" + keys.node.front() + "'");
    const int64_t nodes = s.at(keys.node.front()).size(0);
    check_rows(s, g, nodes, keys);
    for (const auto& [key, t] : s) {
      if (key == keys.edge_index) {
        edges.push_back(offset_edges(t, g, nodes, offset));
      } else if (listed(keys.node, key) || listed(keys.edge, key)) {
        cat0[key].push_back(t);
      } else {
        stack[key].push_back(t);
      }
    }
    batch.push_back(torch::full({nodes}, static_cast<int64_t>(g), torch::kLong));
    offset += nodes;
  }
  TensorDict out;
  for (auto& [key, parts] : cat0) {
    check_present(samples, key, keys);
    out.set(key, torch::cat(parts));
  }
  if (!edges.empty()) out.set(keys.edge_index, torch::cat(edges, 1));
  for (const auto& [key, parts] : stack) {
    if (parts.size() != samples.size()) throw Error("graph_collate: key '" + key + "' is missing in some samples");
    std::vector<Sample> single;
    for (const auto& p : parts) single.push_back(TensorDict{{key, p}});
    out.set(key, stack_collate(single).at(key));
  }
  out.set(keys.batch, torch::cat(batch));
  return out;
}

}  // namespace troupe::actors
