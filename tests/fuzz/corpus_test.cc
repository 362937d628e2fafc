// Runs every fuzz target over its seeds, every truncation and single-byte
// change of them, and the inputs kept under tests/fuzz/corpus/<target>/
// (crashes the fuzzer found, now fixed): the fuzz targets' regression test in
// every build, no clang or libFuzzer needed.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "tests/fuzz/targets.h"

namespace fs = std::filesystem;
using troupe::fuzz::kTargets;

namespace {

void run(const troupe::fuzz::Target& t, const std::string& input) {
  t.run(reinterpret_cast<const uint8_t*>(input.data()), input.size());
}

// Inputs near the valid ones, where decoders are most likely to go wrong.
std::vector<std::string> near(const std::string& seed) {
  std::vector<std::string> v;
  for (size_t n = 0; n < seed.size(); ++n) v.push_back(seed.substr(0, n));
  for (size_t i = 0; i < seed.size(); ++i)
    for (uint8_t x : {0x01, 0x80, 0xff}) {
      std::string s = seed;
      s[i] = char(uint8_t(s[i]) ^ x);
      v.push_back(std::move(s));
    }
  return v;
}

class FuzzCorpus : public ::testing::TestWithParam<troupe::fuzz::Target> {};

}  // namespace

TEST_P(FuzzCorpus, SeedsAndTheirNeighboursAndKeptInputsPass) {
  const auto& t = GetParam();
  auto seeds = troupe::fuzz::seeds(t.name);
  ASSERT_FALSE(seeds.empty());
  // The connection target costs a loopback connection per input: its
  // neighbours are sampled.
  const size_t stride = std::string(t.name) == "connection" ? 7 : 1;
  for (const auto& seed : seeds) {
    run(t, seed);
    auto others = near(seed);
    for (size_t i = 0; i < others.size(); i += stride) run(t, others[i]);
  }
  fs::path kept = fs::path(TROUPE_FUZZ_CORPUS_DIR) / t.name;
  if (!fs::is_directory(kept)) return;
  for (const auto& entry : fs::directory_iterator(kept)) {
    std::ifstream in(entry.path(), std::ios::binary);
    std::stringstream bytes;
    bytes << in.rdbuf();
    SCOPED_TRACE(entry.path().string());
    run(t, bytes.str());
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, FuzzCorpus, ::testing::ValuesIn(kTargets),
                         [](const auto& info) { return std::string(info.param.name); });
