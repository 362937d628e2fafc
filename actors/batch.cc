#include "troupe/actors/batch.h"

#include <sstream>

#include "troupe/runtime/core/errors.h"

namespace troupe::actors {

namespace {

std::string describe_tensor(const torch::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::ostringstream os;
  os << c10::toString(t.scalar_type()) << " " << t.sizes();
  return os.str();
}

// Stacks field `which` of every sample, after checking they agree, so a
// mismatch names the sample rather than surfacing as a c10::Error from stack.
torch::Tensor stack_field(const std::vector<Sample>& samples, torch::Tensor Sample::*which, const char* name) {
  const torch::Tensor& first = samples.front().*which;
  std::vector<torch::Tensor> parts;
  parts.reserve(samples.size());
  for (size_t i = 0; i < samples.size(); ++i) {
    const torch::Tensor& t = samples[i].*which;
    if (t.defined() != first.defined() ||
        (t.defined() && (t.scalar_type() != first.scalar_type() || t.sizes() != first.sizes()))) {
      throw Error(std::string("collate: sample ") + std::to_string(i) + " has " + name + " " + describe_tensor(t) +
                  " but sample 0 has " + describe_tensor(first));
    }
    if (t.defined()) parts.push_back(t);
  }
  if (!first.defined()) return {};
  return torch::stack(parts);
}

}  // namespace

Batch collate(std::vector<Sample>&& samples, std::vector<int64_t> indices) {
  if (samples.empty()) throw Error("collate: no samples");
  if (!indices.empty() && indices.size() != samples.size()) {
    throw Error("collate: " + std::to_string(samples.size()) + " samples but " + std::to_string(indices.size()) +
                " indices");
  }
  Batch b;
  b.input = stack_field(samples, &Sample::input, "input");
  if (!b.input.defined()) throw Error("collate: samples have no input");
  b.target = stack_field(samples, &Sample::target, "target");
  b.indices = std::move(indices);
  samples.clear();
  return b;
}

}  // namespace troupe::actors
