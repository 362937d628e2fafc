// DistributedSampler: PyTorch's order and padding, coverage, determinism, and
// the cursor's re-split after a world-size change.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "troupe/actors/distributed_sampler.h"
#include "troupe/runtime/core/errors.h"
#include "tests/actors/python_helper.h"

namespace troupe::actors {
namespace {

using Indices = std::vector<int64_t>;

struct FixtureCase {
  int64_t n, world, seed, epoch;
  bool shuffle, drop_last;
  int64_t rank;
  Indices expected;
};

// Parses lines "n world seed epoch shuffle drop_last rank : i0 i1 ..." as
// written by tests/actors/data/gen_sampler_fixtures.py.
std::vector<FixtureCase> parse_cases(std::istream& in) {
  std::vector<FixtureCase> out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream s(line);
    FixtureCase c{};
    int shuffle = 0, drop_last = 0;
    std::string colon;
    s >> c.n >> c.world >> c.seed >> c.epoch >> shuffle >> drop_last >> c.rank >> colon;
    EXPECT_EQ(colon, ":") << line;
    c.shuffle = shuffle;
    c.drop_last = drop_last;
    int64_t i;
    while (s >> i) c.expected.push_back(i);
    out.push_back(std::move(c));
  }
  return out;
}

void expect_matches(const std::vector<FixtureCase>& cases) {
  for (const auto& c : cases) {
    DistributedSampler s(
        {.dataset_size = c.n, .world_size = c.world, .shuffle = c.shuffle, .seed = c.seed, .drop_last = c.drop_last});
    EXPECT_EQ(s.indices(c.epoch, c.rank), c.expected)
        << "n=" << c.n << " world=" << c.world << " seed=" << c.seed << " epoch=" << c.epoch << " shuffle=" << c.shuffle
        << " drop_last=" << c.drop_last << " rank=" << c.rank;
    EXPECT_EQ(s.num_samples(), static_cast<int64_t>(c.expected.size()));
  }
}

TEST(DistributedSampler, MatchesPyTorchFixtures) {
  std::ifstream in(std::string(TROUPE_ACTORS_TEST_DATA) + "/sampler_orders.txt");
  ASSERT_TRUE(in) << "missing fixture " << TROUPE_ACTORS_TEST_DATA << "/sampler_orders.txt";
  auto cases = parse_cases(in);
  ASSERT_GT(cases.size(), 400u);
  expect_matches(cases);
}

// Same comparison against the PyTorch installed here, with cases the
// fixture does not hold.
TEST(DistributedSampler, MatchesLivePyTorch) {
  if (!python_has_torch()) GTEST_SKIP() << "no /usr/bin/python3 with torch";
  std::string script = R"PY(
import torch
from torch.utils.data import DistributedSampler
for n, world, seed, epoch, drop_last in [(50, 3, 2024, 0, 0), (50, 3, 2024, 1, 0), (50, 3, 2024, 2, 1),
                                         (257, 6, 9, 4, 0), (257, 6, 9, 4, 1), (3, 7, 1, 0, 0), (999, 2, 31337, 17, 0)]:
    for rank in range(world):
        s = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=bool(drop_last))
        s.set_epoch(epoch)
        print(n, world, seed, epoch, 1, drop_last, rank, ":", " ".join(map(str, s)))
)PY";
  std::istringstream out(run_python(script));
  auto cases = parse_cases(out);
  ASSERT_EQ(cases.size(), 3u * 3 + 6 * 2 + 7 + 2);
  expect_matches(cases);
}

TEST(DistributedSampler, PaddingWrapsAroundLikePyTorch) {
  // n=10, world=4: total 12, padded with indices[:2].
  DistributedSampler s({.dataset_size = 10, .world_size = 4, .shuffle = false});
  EXPECT_EQ(s.indices(0, 0), (Indices{0, 4, 8}));
  EXPECT_EQ(s.indices(0, 1), (Indices{1, 5, 9}));
  EXPECT_EQ(s.indices(0, 2), (Indices{2, 6, 0}));
  EXPECT_EQ(s.indices(0, 3), (Indices{3, 7, 1}));
  // Padding longer than the data: indices repeated as often as needed.
  DistributedSampler tiny({.dataset_size = 2, .world_size = 5, .shuffle = false});
  for (int64_t r = 0; r < 5; ++r) EXPECT_EQ(tiny.indices(0, r), (Indices{r % 2}));
  // drop_last: the tail is cut instead.
  DistributedSampler cut({.dataset_size = 10, .world_size = 4, .shuffle = false, .drop_last = true});
  EXPECT_EQ(cut.num_samples(), 2);
  EXPECT_EQ(cut.indices(0, 0), (Indices{0, 4}));
  EXPECT_EQ(cut.indices(0, 3), (Indices{3, 7}));
  DistributedSampler none({.dataset_size = 3, .world_size = 4, .shuffle = false, .drop_last = true});
  EXPECT_EQ(none.num_samples(), 0);
  EXPECT_TRUE(none.indices(0, 0).empty());
}

TEST(DistributedSampler, CoversEveryIndexOncePerEpoch) {
  for (int64_t n : {1, 2, 9, 64, 101, 1000}) {
    for (int64_t world : {1, 2, 3, 4, 7, 16}) {
      for (bool drop_last : {false, true}) {
        DistributedSampler s({.dataset_size = n, .world_size = world, .seed = 5, .drop_last = drop_last});
        std::map<int64_t, int> seen;
        for (int64_t r = 0; r < world; ++r) {
          auto idx = s.indices(3, r);
          ASSERT_EQ(static_cast<int64_t>(idx.size()), s.num_samples());
          for (int64_t i : idx) ++seen[i];
        }
        int64_t total = s.total_size();
        if (drop_last) {
          EXPECT_EQ(total, n / world * world);
          EXPECT_EQ(static_cast<int64_t>(seen.size()), total);
          for (auto& [i, count] : seen) EXPECT_EQ(count, 1);
        } else {
          EXPECT_EQ(static_cast<int64_t>(seen.size()), n) << "n=" << n << " world=" << world;
          int64_t extra = 0;
          for (auto& [i, count] : seen) extra += count - 1;
          EXPECT_EQ(extra, total - n);
        }
        for (auto& [i, count] : seen) ASSERT_TRUE(i >= 0 && i < n);
      }
    }
  }
}

TEST(DistributedSampler, DeterministicPerSeedAndEpoch) {
  DistributedSampler a({.dataset_size = 500, .world_size = 4, .seed = 11});
  DistributedSampler b({.dataset_size = 500, .world_size = 4, .seed = 11});
  DistributedSampler c({.dataset_size = 500, .world_size = 4, .seed = 12});
  EXPECT_EQ(a.indices(2, 1), b.indices(2, 1));
  EXPECT_NE(a.indices(2, 1), a.indices(3, 1));
  EXPECT_NE(a.indices(2, 1), c.indices(2, 1));
  // seed + epoch is what seeds the generator, as in PyTorch.
  EXPECT_EQ(a.indices(1, 0), c.indices(0, 0));
  EXPECT_EQ(a.epoch_order(4), a.epoch_order(4));
}

// Drives a cursor in whole steps of `batch` per rank, as trainers do.
Indices consume_steps(const DistributedSampler& s, SamplerCursor& cur, int64_t steps, int64_t batch) {
  Indices got;
  for (int64_t step = 0; step < steps && !s.epoch_done(cur); ++step) {
    int64_t take = std::min(batch, s.remaining_per_rank(cur));
    for (int64_t r = 0; r < cur.world_size; ++r) {
      auto rem = s.remaining(cur, r);
      got.insert(got.end(), rem.begin(), rem.begin() + take);
    }
    cur = s.advance(cur, take);
  }
  return got;
}

TEST(DistributedSampler, CursorContinuesTheSameLists) {
  DistributedSampler s({.dataset_size = 103, .world_size = 4, .seed = 3});
  auto cur = s.begin_epoch(2);
  for (int64_t r = 0; r < 4; ++r) EXPECT_EQ(s.remaining(cur, r), s.indices(2, r));
  auto later = s.advance(cur, 10);
  for (int64_t r = 0; r < 4; ++r) {
    auto full = s.indices(2, r);
    EXPECT_EQ(s.remaining(later, r), Indices(full.begin() + 10, full.end()));
  }
  EXPECT_EQ(s.resize(later, 4), later);  // same world: padding kept, nothing re-split
  EXPECT_EQ(s.consumed(later), 40);
  EXPECT_THROW(s.advance(later, 100), Error);
  EXPECT_THROW(s.remaining(later, 4), Error);
  // Round trip through the wire codec, as a checkpoint or a call would.
  auto bytes = wire::encode_value(later).bytes();
  EXPECT_EQ(wire::decode_value<SamplerCursor>(bytes), later);
}

TEST(DistributedSampler, ResplitAfterResizeCoversRestExactlyOnce) {
  struct Plan {
    int64_t n;
    bool drop_last;
    std::vector<std::pair<int64_t, int64_t>> segments;  // (world size, steps)
  };
  const int64_t batch = 5;
  std::vector<Plan> plans = {
      {103, false, {{4, 2}, {3, 1000}}},
      {103, true, {{4, 2}, {3, 1000}}},
      {1000, false, {{8, 3}, {3, 7}, {6, 1}, {1, 2}, {5, 1000}}},
      {1000, true, {{8, 3}, {3, 7}, {6, 1}, {1, 2}, {5, 1000}}},
      {64, false, {{2, 1}, {7, 1000}}},     // padding needed only after the resize
      {50, false, {{3, 1000}, {2, 1000}}},  // resize after the end: nothing left
  };
  for (const auto& plan : plans) {
    DistributedSampler s(
        {.dataset_size = plan.n, .world_size = plan.segments[0].first, .seed = 77, .drop_last = plan.drop_last});
    auto cur = s.begin_epoch(1);
    std::map<int64_t, int> seen;
    int64_t padding = 0;
    for (const auto& [world, steps] : plan.segments) {
      cur = s.resize(cur, world);
      // Within the segment, the extra positions are padding duplicates.
      int64_t unique_left = plan.n - cur.segment_start;
      int64_t before = 0;
      for (auto& [i, c] : seen) before += c;
      auto got = consume_steps(s, cur, steps, batch);
      for (int64_t i : got) ++seen[i];
      int64_t used = static_cast<int64_t>(got.size());
      if (used > unique_left) padding += used - unique_left;
      // What was consumed is a prefix of the epoch order.
      auto order = s.epoch_order(1);
      std::set<int64_t> prefix(order.begin(), order.begin() + s.consumed(cur));
      for (auto& [i, c] : seen) {
        if (!plan.drop_last || s.consumed(cur) < plan.n) {
          EXPECT_TRUE(prefix.count(i)) << "index " << i << " outside the consumed prefix";
        }
      }
    }
    ASSERT_TRUE(s.epoch_done(cur));
    int64_t dupes = 0;
    for (auto& [i, c] : seen) dupes += c - 1;
    EXPECT_EQ(dupes, padding) << "n=" << plan.n << ": a sample was seen twice beyond padding";
    if (!plan.drop_last) {
      EXPECT_EQ(static_cast<int64_t>(seen.size()), plan.n) << "n=" << plan.n << ": a sample was skipped";
    } else {
      EXPECT_EQ(padding, 0);
      EXPECT_LE(static_cast<int64_t>(seen.size()), plan.n);
      // Only the tail dropped for divisibility is missing: fewer than the world size.
      EXPECT_LT(plan.n - static_cast<int64_t>(seen.size()), plan.segments.back().first);
    }
  }
}

TEST(DistributedSampler, RejectsBadArguments) {
  EXPECT_THROW(DistributedSampler({.dataset_size = -1}), ConfigError);
  EXPECT_THROW(DistributedSampler({.dataset_size = 5, .world_size = 0}), ConfigError);
  DistributedSampler s({.dataset_size = 5, .world_size = 2});
  EXPECT_THROW(s.resize(s.begin_epoch(0), 0), ConfigError);
  SamplerCursor bogus{.epoch = 0, .world_size = 2, .segment_start = 9, .segment_consumed = 0};
  EXPECT_THROW(s.remaining(bogus, 0), Error);
}

}  // namespace
}  // namespace troupe::actors
