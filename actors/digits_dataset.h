// The scikit-learn "digits" data set: 1,797 8×8 grey-level images of
// handwritten digits (values 0-16) with labels 0-9. It is a small real data
// set that Debian ships in python3-sklearn as a gzip'd CSV (64 pixel columns
// then the label), so tests and examples can train on real data offline.
#pragma once

#include <string>

#include "troupe/actors/dataset.h"

namespace troupe::actors {

struct DigitsOptions {
  // The CSV, gzip'd or not; empty means find_digits_file().
  std::string path{};
  // Divide pixel values by 16, into [0, 1].
  bool normalize = false;
  // input shape [1, 8, 8] instead of [64].
  bool image = false;
};

// Where python3-sklearn installed digits.csv.gz, looked up in
// $TROUPE_DIGITS_PATH and then under /usr/lib/python3*/dist-packages and
// /usr/local/lib/python3*/{dist,site}-packages. Empty when not found.
std::string find_digits_file();

// input: float32 [64] (or [1, 8, 8]); target: int64 scalar in [0, 10).
// The whole set (460 KB) is parsed into memory at construction.
class DigitsDataset final : public Dataset {
 public:
  explicit DigitsDataset(DigitsOptions options = {});
  int64_t size() const override { return images_.size(0); }
  std::string describe() const override;
  // All of it: float32 [1797, 64] and int64 [1797].
  const torch::Tensor& images() const { return images_; }
  const torch::Tensor& labels() const { return labels_; }

 protected:
  Sample load(int64_t index, int64_t epoch) const override;

 private:
  DigitsOptions options_;
  std::string path_;
  torch::Tensor images_;
  torch::Tensor labels_;
};

}  // namespace troupe::actors
