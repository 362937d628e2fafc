// The pieces of examples/train_graphs, registered by name so that every
// trainer and loader the job spawns (they run this binary) finds them:
//
//   data set "molecules": generated molecule-like graphs. NOT a real data
//     set: each sample is a random valence-respecting molecule of 5 to 18
//     heavy atoms (C, N, O, F; hydrogens implicit), a spanning tree of
//     bonds plus up to two ring closures, as QM9-style graphs look. Node
//     features are the atom type and its implicit hydrogen count (one-hot,
//     9 columns); edges go both ways. The target `y` is an additive energy
//     per heavy atom (a group-additivity model: a term per atom type, per
//     implicit hydrogen, per bond by the pair of types, per ring, plus
//     noise of 0.005), so a message-passing network can learn it while a
//     model that sees atoms one by one cannot. Sample i is a function of
//     (seed, i) only: every worker generates the same graph for an index.
//     Ragged batches come from actors::graph_collate, inside the loader's
//     TBB pipeline.
//   model "molecule_gnn": `layers` rounds of message passing (sum over
//     neighbours, residual update), mean pooling per graph, an MLP readout;
//     it takes the whole batch and returns MSE `loss` and an `mae` metric.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/torch.h>

#include "troupe/actors/dataset.h"
#include "troupe/actors/graph_collate.h"
#include "troupe/trainer/module_model.h"

namespace molecules {

constexpr int kTypes = 4;  // C, N, O, F
constexpr int kFeatures = kTypes + 5;
constexpr std::array<int, kTypes> kValence = {4, 3, 2, 1};
constexpr std::array<double, kTypes> kAtomEnergy = {-1.10, -1.45, -1.85, -2.30};
constexpr double kHydrogenEnergy = -0.42;
constexpr double kRingEnergy = 0.35;
// Bond energy by the pair of atom types (symmetric).
constexpr std::array<std::array<double, kTypes>, kTypes> kBondEnergy = {{
    {-0.60, -0.52, -0.66, -0.81},
    {-0.52, -0.31, -0.38, -0.45},
    {-0.66, -0.38, -0.27, -0.33},
    {-0.81, -0.45, -0.33, -0.22},
}};

struct Molecule {
  std::vector<int> type;                    // per heavy atom
  std::vector<int> hydrogens;               // implicit, per heavy atom
  std::vector<std::pair<int, int>> bonds;   // each once
  int rings = 0;
  double energy_per_atom = 0;
};

inline Molecule generate(int64_t seed, int64_t index) {
  std::mt19937_64 rng(static_cast<uint64_t>(seed) * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(index));
  std::uniform_int_distribution<int> atoms(5, 18);
  std::discrete_distribution<int> kind({0.55, 0.2, 0.18, 0.07});
  std::uniform_real_distribution<double> unit(0, 1);
  Molecule m;
  const int n = atoms(rng);
  std::vector<int> free;
  m.type.push_back(0);  // a carbon to grow from
  free.push_back(kValence[0]);
  for (int i = 1; i < n; ++i) {
    std::vector<int> open;
    for (int j = 0; j < i; ++j)
      if (free[j] > 0) open.push_back(j);
    if (open.empty()) break;  // saturated: a smaller molecule
    const int t = kind(rng);
    const int at = open[std::uniform_int_distribution<size_t>(0, open.size() - 1)(rng)];
    m.type.push_back(t);
    free.push_back(kValence[t] - 1);
    --free[at];
    m.bonds.emplace_back(at, i);
  }
  const int heavy = static_cast<int>(m.type.size());
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (unit(rng) > 0.4) continue;
    std::uniform_int_distribution<int> pick(0, heavy - 1);
    const int a = pick(rng), b = pick(rng);
    bool bonded = a == b || free[a] == 0 || free[b] == 0;
    for (const auto& [u, v] : m.bonds) bonded = bonded || (u == a && v == b) || (u == b && v == a);
    if (bonded) continue;
    m.bonds.emplace_back(a, b);
    --free[a];
    --free[b];
    ++m.rings;
  }
  double e = kRingEnergy * m.rings;
  for (int i = 0; i < heavy; ++i) {
    m.hydrogens.push_back(free[i]);
    e += kAtomEnergy[m.type[i]] + kHydrogenEnergy * free[i];
  }
  for (const auto& [u, v] : m.bonds) e += kBondEnergy[m.type[u]][m.type[v]];
  m.energy_per_atom = e / heavy + std::normal_distribution<double>(0, 0.005)(rng);
  return m;
}

class MoleculeGraphs final : public troupe::actors::Dataset {
 public:
  MoleculeGraphs(int64_t size, int64_t seed) : size_(size), seed_(seed) {}
  int64_t size() const override { return size_; }
  std::string describe() const override {
    return "molecules (" + std::to_string(size_) + " generated graphs, seed " + std::to_string(seed_) + ")";
  }
  troupe::actors::TensorDict collate(std::vector<troupe::actors::Sample>&& samples) const override {
    return troupe::actors::graph_collate(samples);  // x and edge_index concatenated, a `batch` vector
  }

 protected:
  troupe::actors::Sample load(int64_t index, int64_t /*epoch*/) const override {
    const Molecule m = generate(seed_, index);
    const int64_t n = static_cast<int64_t>(m.type.size());
    auto x = torch::zeros({n, kFeatures});
    auto xa = x.accessor<float, 2>();
    for (int64_t i = 0; i < n; ++i) {
      xa[i][m.type[i]] = 1;
      xa[i][kTypes + std::min(m.hydrogens[i], 4)] = 1;
    }
    const int64_t edges = static_cast<int64_t>(m.bonds.size());
    auto edge_index = torch::empty({2, 2 * edges}, torch::kLong);
    auto ea = edge_index.accessor<int64_t, 2>();
    for (int64_t k = 0; k < edges; ++k) {
      const auto [u, v] = m.bonds[k];
      ea[0][2 * k] = u, ea[1][2 * k] = v;
      ea[0][2 * k + 1] = v, ea[1][2 * k + 1] = u;
    }
    return {{"x", x}, {"edge_index", edge_index}, {"y", torch::scalar_tensor(m.energy_per_atom, torch::kFloat)}};
  }

 private:
  int64_t size_;
  int64_t seed_;
};

// Message passing: h ← h + relu(W_self h + W_msg Σ_{u→v} h_u), `layers`
// times; then the mean of each graph's node states through an MLP.
struct MoleculeGnnImpl : torch::nn::Module {
  MoleculeGnnImpl(int64_t hidden, int64_t layers)
      : embed(register_module("embed", torch::nn::Linear(kFeatures, hidden))),
        self_weights(register_module("self", torch::nn::ModuleList())),
        message_weights(register_module("message", torch::nn::ModuleList())),
        head1(register_module("head1", torch::nn::Linear(hidden, hidden))),
        head2(register_module("head2", torch::nn::Linear(hidden, 1))) {
    for (int64_t l = 0; l < layers; ++l) {
      self_weights->push_back(torch::nn::Linear(hidden, hidden));
      message_weights->push_back(torch::nn::Linear(hidden, hidden));
    }
  }

  troupe::actors::TensorDict forward(const troupe::actors::TensorDict& batch) {
    const auto& edges = batch.at("edge_index");
    const auto& graph_of = batch.at("batch");
    const auto& y = batch.at("y");
    auto h = torch::relu(embed->forward(batch.at("x")));
    for (size_t l = 0; l < self_weights->size(); ++l) {
      auto sum = torch::zeros_like(h).index_add(0, edges[1], h.index_select(0, edges[0]));
      h = h + torch::relu(self_weights[l]->as<torch::nn::Linear>()->forward(h) +
                          message_weights[l]->as<torch::nn::Linear>()->forward(sum));
    }
    const int64_t graphs = y.size(0);
    auto pooled = torch::zeros({graphs, h.size(1)}).index_add(0, graph_of, h);
    auto atoms = torch::zeros({graphs}).index_add(0, graph_of, torch::ones({h.size(0)}));
    auto pred = head2->forward(torch::relu(head1->forward(pooled / atoms.unsqueeze(1)))).squeeze(1);
    auto err = pred - y;
    return {{"loss", (err * err).mean()}, {"mae", err.abs().mean().detach()}};
  }

  torch::nn::Linear embed;
  torch::nn::ModuleList self_weights, message_weights;
  torch::nn::Linear head1, head2;
};
TORCH_MODULE(MoleculeGnn);

// ModelSpec::hidden is the width; ModelSpec::config the number of layers
// ("" = 3).
inline std::unique_ptr<troupe::trainer::Model> make_gnn(const troupe::trainer::ModelSpec& s) {
  int64_t layers = 3;
  if (!s.config.empty()) {
    size_t used = 0;
    try {
      layers = std::stoll(s.config, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != s.config.size() || layers < 1)
      throw troupe::ConfigError("molecule_gnn: config must be a layer count of at least 1, got '" + s.config + "'");
  }
  return troupe::trainer::wrap_batch_module(MoleculeGnn(s.hidden, layers), "molecule_gnn");
}

}  // namespace molecules

TROUPE_DATASET("molecules", [](const troupe::actors::DatasetSpec& s) {
  return std::make_unique<molecules::MoleculeGraphs>(s.get_int("size", 4000), s.get_int("seed", 0));
});
TROUPE_MODEL("molecule_gnn", molecules::make_gnn);
