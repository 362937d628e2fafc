#include "troupe/actors/synthetic_dataset.h"

#include <sstream>

#include "troupe/actors/random.h"
#include "troupe/runtime/core/check.h"

namespace troupe::actors {

namespace {

// Tags keep the streams for different purposes independent under one seed.
constexpr uint64_t kCentreTag = 0xC3A7'0001;
constexpr uint64_t kSampleTag = 0xC3A7'0002;
constexpr uint64_t kWeightTag = 0xC3A7'0003;

torch::Tensor normal_matrix(int64_t rows, int64_t cols, uint64_t seed, uint64_t tag, double scale) {
  auto t = torch::empty({rows, cols}, torch::kFloat);
  float* p = t.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    SampleRng rng(seed, tag, static_cast<uint64_t>(r));
    for (int64_t c = 0; c < cols; ++c) p[r * cols + c] = static_cast<float>(scale * rng.normal());
  }
  return t;
}

}  // namespace

SyntheticClassification::SyntheticClassification(SyntheticClassificationOptions options) : options_(options) {
  TROUPE_CHECK(options_.size >= 0 && options_.num_features > 0 && options_.num_classes > 0)
      << "bad synthetic classification options: " << describe();
  centres_ =
      normal_matrix(options_.num_classes, options_.num_features, static_cast<uint64_t>(options_.seed), kCentreTag, 3.0);
}

std::string SyntheticClassification::describe() const {
  std::ostringstream os;
  os << "synthetic_classification(size=" << options_.size << ", num_features=" << options_.num_features
     << ", num_classes=" << options_.num_classes << ", seed=" << options_.seed << ", noise=" << options_.noise << ")";
  return os.str();
}

Sample SyntheticClassification::load(int64_t index, int64_t /*epoch*/) const {
  SampleRng rng(static_cast<uint64_t>(options_.seed), kSampleTag, static_cast<uint64_t>(index));
  int64_t label = rng.uniform_int(options_.num_classes);
  auto input = torch::empty({options_.num_features}, torch::kFloat);
  float* x = input.data_ptr<float>();
  const float* centre = centres_.data_ptr<float>() + label * options_.num_features;
  for (int64_t f = 0; f < options_.num_features; ++f) {
    x[f] = centre[f] + static_cast<float>(options_.noise * rng.normal());
  }
  return {{"input", input}, {"target", torch::scalar_tensor(label, torch::kLong)}};
}

SyntheticRegression::SyntheticRegression(SyntheticRegressionOptions options) : options_(options) {
  TROUPE_CHECK(options_.size >= 0 && options_.num_features > 0 && options_.num_outputs > 0)
      << "bad synthetic regression options: " << describe();
  auto seed = static_cast<uint64_t>(options_.seed);
  weights_ = normal_matrix(options_.num_outputs, options_.num_features, seed, kWeightTag, 1.0);
  bias_ = normal_matrix(1, options_.num_outputs, seed, kWeightTag + 1, 1.0).reshape({options_.num_outputs});
}

std::string SyntheticRegression::describe() const {
  std::ostringstream os;
  os << "synthetic_regression(size=" << options_.size << ", num_features=" << options_.num_features
     << ", num_outputs=" << options_.num_outputs << ", seed=" << options_.seed << ", noise=" << options_.noise << ")";
  return os.str();
}

Sample SyntheticRegression::load(int64_t index, int64_t /*epoch*/) const {
  SampleRng rng(static_cast<uint64_t>(options_.seed), kSampleTag, static_cast<uint64_t>(index));
  const int64_t nf = options_.num_features;
  const int64_t no = options_.num_outputs;
  auto input = torch::empty({nf}, torch::kFloat);
  auto target = torch::empty({no}, torch::kFloat);
  float* x = input.data_ptr<float>();
  float* y = target.data_ptr<float>();
  for (int64_t f = 0; f < nf; ++f) x[f] = static_cast<float>(rng.normal());
  const float* w = weights_.data_ptr<float>();
  const float* b = bias_.data_ptr<float>();
  for (int64_t o = 0; o < no; ++o) {
    // Accumulate in double so the value does not depend on vectorisation.
    double acc = b[o];
    for (int64_t f = 0; f < nf; ++f) acc += double(w[o * nf + f]) * double(x[f]);
    y[o] = static_cast<float>(acc + options_.noise * rng.normal());
  }
  return {{"input", input}, {"target", target}};
}

}  // namespace troupe::actors
