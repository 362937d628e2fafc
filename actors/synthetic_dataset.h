// Synthetic data sets for tests, examples and benchmarks: Gaussian-cluster
// classification and noisy linear regression. Every sample is a pure
// function of (seed, index), so any subset, in any order, on any machine, is
// bitwise reproducible — which is what lets a recovered run match an
// uninterrupted one.
#pragma once

#include <cstdint>
#include <string>

#include "troupe/actors/dataset.h"

namespace troupe::actors {

struct SyntheticClassificationOptions {
  int64_t size = 1000;
  int64_t num_features = 16;
  int64_t num_classes = 4;
  int64_t seed = 0;
  // Standard deviation of the points around their class centre; centres are
  // drawn with standard deviation 3, so the default is learnable but not trivial.
  double noise = 1.0;
};

// input: float32 [num_features]; target: int64 scalar in [0, num_classes).
class SyntheticClassification final : public Dataset {
 public:
  explicit SyntheticClassification(SyntheticClassificationOptions options);
  int64_t size() const override { return options_.size; }
  std::string describe() const override;
  // The class centres, float32 [num_classes, num_features].
  const torch::Tensor& centres() const { return centres_; }

 protected:
  Sample load(int64_t index, int64_t epoch) const override;

 private:
  SyntheticClassificationOptions options_;
  torch::Tensor centres_;
};

struct SyntheticRegressionOptions {
  int64_t size = 1000;
  int64_t num_features = 8;
  int64_t num_outputs = 1;
  int64_t seed = 0;
  double noise = 0.1;
};

// input: float32 [num_features]; target: float32 [num_outputs] =
// weights · input + bias + noise · N(0, 1).
class SyntheticRegression final : public Dataset {
 public:
  explicit SyntheticRegression(SyntheticRegressionOptions options);
  int64_t size() const override { return options_.size; }
  std::string describe() const override;
  // The true parameters: float32 [num_outputs, num_features] and [num_outputs].
  const torch::Tensor& weights() const { return weights_; }
  const torch::Tensor& bias() const { return bias_; }

 protected:
  Sample load(int64_t index, int64_t epoch) const override;

 private:
  SyntheticRegressionOptions options_;
  torch::Tensor weights_;
  torch::Tensor bias_;
};

}  // namespace troupe::actors
