// graph_collate: ragged (graph) batching, as PyTorch Geometric's Batch does
// it, for data sets whose samples are graphs of different sizes. A data set
// overrides Dataset::collate with it (it then runs in the loader's TBB
// pipeline):
//
//   TensorDict collate(std::vector<Sample>&& s) const override { return graph_collate(s); }
//
// Node-level keys are concatenated along dimension 0, the edge index
// ([2, E] of node numbers within its graph) is concatenated along
// dimension 1 with each graph's numbers offset by the nodes before it,
// edge-level keys are concatenated along dimension 0, a `batch` vector
// says which graph each node belongs to, and every other key (graph-level
// targets) is stacked.
#pragma once

#include <string>
#include <vector>

#include "troupe/actors/dataset.h"
#include "troupe/actors/tensor_dict.h"

namespace troupe::actors {

struct GraphKeys {
  // The first names the node count of a graph (its size(0)).
  std::vector<std::string> node = {"x"};
  std::string edge_index = "edge_index";
  std::vector<std::string> edge = {"edge_attr"};
  // The key the node → graph vector is written under.
  std::string batch = "batch";
};

// Throws troupe::Error naming the sample and key that do not fit (no node
// key, an edge index that is not [2, E] of integers, or numbers out of its
// graph's range, a node or edge key without a row per node or edge, or
// missing from a sample with nodes or edges to give it rows for while
// other samples have it; a graph without edges may leave edge keys out).
TensorDict graph_collate(const std::vector<Sample>& samples, const GraphKeys& keys = {});

}  // namespace troupe::actors
