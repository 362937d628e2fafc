#include <gtest/gtest.h>

#include <set>

#include "troupe/runtime/head/resource_pool.h"
#include "troupe/runtime/head/scheduler.h"

namespace {

using namespace troupe::head;
using troupe::wire::PlacementStrategy;

std::vector<NodeView> three_nodes() {
  return {{1, {{"CPU", 4}, {"GPU", 2}}, {{"CPU", 4}, {"GPU", 2}}},
          {2, {{"CPU", 4}, {"GPU", 2}}, {{"CPU", 4}, {"GPU", 2}}},
          {3, {{"CPU", 2}}, {{"CPU", 2}}}};
}

TEST(Scheduler, ParseAndFormatResources) {
  auto r = parse_resources("CPU=2,GPU=0,disk=1.5");
  EXPECT_EQ(r.at("CPU"), 2);
  EXPECT_EQ(r.at("disk"), 1.5);
  EXPECT_EQ(format_resources({{"CPU", 2}, {"GPU", 1}}), "CPU=2, GPU=1");
  EXPECT_EQ(format_resources({{"CPU", 0.5}, {"GPU", 0.25}}), "CPU=0.5, GPU=0.25");
  EXPECT_THROW(parse_resources("CPU"), troupe::ConfigError);
  try {
    parse_resources("CPU=1,CPU=4");
    ADD_FAILURE() << "a resource given twice was taken";
  } catch (const troupe::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("resource 'CPU' is given twice in 'CPU=1,CPU=4'"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(parse_resources("CPU=x"), troupe::ConfigError);
  EXPECT_THROW(parse_resources("CPU=-1"), troupe::ConfigError);
  // stod read "0x10" as 16 and "inf" as a number; a blank beside an
  // amount was refused although one beside a comma is common.
  for (const char* bad : {"CPU=0x10", "CPU=inf", "CPU=nan", "CPU=1e", "CPU=", "CPU=1 2", " =1"})
    EXPECT_THROW(parse_resources(bad), troupe::ConfigError) << bad;
  auto spaced = parse_resources("CPU=1 , GPU = 0.5 ");
  EXPECT_EQ(spaced.at("CPU"), 1);
  EXPECT_EQ(spaced.at("GPU"), 0.5);
  EXPECT_EQ(parse_resources("disk=.25,x=1e3").at("x"), 1000);
  // An amount too small to tell from zero is refused by name.
  try {
    troupe::head::validate_resources(parse_resources("CPU=1e-300"), "--resources");
    ADD_FAILURE() << "1e-300 taken";
  } catch (const troupe::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("is smaller than the smallest amount, 0.0001"), std::string::npos) << e.what();
  }
  troupe::head::validate_resources(parse_resources("CPU=0.0001,GPU=0"), "ok");
  // Empty entries were skipped: ",,," was a node with nothing.
  EXPECT_EQ(parse_resources("CPU=1,").size(), 1u);
  EXPECT_THROW(parse_resources(",,,"), troupe::ConfigError);
  EXPECT_THROW(parse_resources("CPU=1,,GPU=1"), troupe::ConfigError);
  // Names with blanks, control characters or list punctuation broke the
  // lines of status and the lists of messages.
  for (const char* bad : {"a b", "a\nb", "custom{}", "x\"y"}) {
    try {
      troupe::head::validate_resources({{bad, 1}}, "--resources");
      ADD_FAILURE() << bad << " taken";
    } catch (const troupe::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("has a character names may not have"), std::string::npos) << e.what();
    }
  }
  troupe::head::validate_resources({{"node:10.0.0.1", 1}, {"accelerator_type/A100", 1}}, "ok");
}

// The load is over what the request names: a node whose one GPU is held
// scored full for every CPU request, and CPU actors all went to the other
// node while this one's eight CPUs stood idle (SPREAD stopped spreading).
TEST(Scheduler, TheLoadCountsOnlyWhatTheRequestNames) {
  NodeView gpu_held{1, {{"CPU", 8}, {"GPU", 1}}, {{"CPU", 8}, {"GPU", 0}}, {0.0}, 1};
  NodeView busier{2, {{"CPU", 8}}, {{"CPU", 6}}, {}, 2};
  EXPECT_EQ(pick_node({gpu_held, busier}, {{"CPU", 1}}, nullptr), 1u);
  // A request of nothing: the fewest actors.
  EXPECT_EQ(pick_node({gpu_held, busier}, {}, nullptr), 1u);
  EXPECT_FALSE(pick_node({gpu_held, busier}, {{"GPU", 1}}, nullptr).has_value());
  // PACK still takes the fullest node that fits, over all its resources:
  // the small bundle on the busy node leaves the empty one for the large.
  NodeView empty{1, {{"CPU", 8}}, {{"CPU", 8}}, {}, 0};
  NodeView busy{2, {{"CPU", 8}}, {{"CPU", 2}}, {}, 3};
  std::string why;
  auto packed = place_bundles({empty, busy}, {{{"CPU", 2}}, {{"CPU", 8}}}, PlacementStrategy::kPack, &why);
  ASSERT_TRUE(packed.has_value()) << why;
  EXPECT_EQ(*packed, (std::vector<uint64_t>{2, 1}));
}

TEST(Scheduler, PickNodePrefersEmptierNodeAndExplainsFailure) {
  auto nodes = three_nodes();
  nodes[0].available["CPU"] = 1;
  std::string why;
  EXPECT_EQ(pick_node(nodes, {{"CPU", 1}}, &why), 2u);
  EXPECT_FALSE(pick_node(nodes, {{"GPU", 3}}, &why).has_value());
  EXPECT_NE(why.find("at all"), std::string::npos) << why;
  EXPECT_FALSE(pick_node(nodes, {{"TPU", 1}}, &why).has_value());
  // With no node at all, that is the reason (it read "no node can hold {}
  // at all (no node has that much in total); no nodes alive").
  EXPECT_FALSE(pick_node({}, {}, &why).has_value());
  EXPECT_EQ(why, "no node is alive to run it");  // not "to hold {}"
  EXPECT_FALSE(pick_node({}, {{"CPU", 1}}, &why).has_value());
  EXPECT_EQ(why, "no node is alive to hold {CPU=1}");
}

TEST(Scheduler, StrictSpreadUsesDistinctNodes) {
  std::string why;
  auto p =
      place_bundles(three_nodes(), {{{"CPU", 1}}, {{"CPU", 1}}, {{"CPU", 1}}}, PlacementStrategy::kStrictSpread, &why);
  ASSERT_TRUE(p) << why;
  EXPECT_EQ(std::set<uint64_t>(p->begin(), p->end()).size(), 3u);
  auto q = place_bundles(three_nodes(), std::vector<troupe::wire::Resources>(4, {{"CPU", 1}}),
                         PlacementStrategy::kStrictSpread, &why);
  EXPECT_FALSE(q);
  EXPECT_NE(why.find("STRICT_SPREAD"), std::string::npos);
  // The summary names what the nodes have, not what the failed attempt
  // left of them (node 3 read {CPU=1}).
  EXPECT_NE(why.find("node 3 {CPU=2}"), std::string::npos) << why;
  // SPREAD reuses nodes when it must.
  auto s = place_bundles(three_nodes(), std::vector<troupe::wire::Resources>(4, {{"CPU", 1}}),
                         PlacementStrategy::kSpread, &why);
  ASSERT_TRUE(s) << why;
}

TEST(Scheduler, PackAndStrictPack) {
  std::string why;
  auto p = place_bundles(three_nodes(), {{{"GPU", 1}}, {{"GPU", 1}}}, PlacementStrategy::kStrictPack, &why);
  ASSERT_TRUE(p) << why;
  EXPECT_EQ((*p)[0], (*p)[1]);
  EXPECT_FALSE(place_bundles(three_nodes(), std::vector<troupe::wire::Resources>(3, {{"GPU", 1}}),
                             PlacementStrategy::kStrictPack, &why));
  auto q = place_bundles(three_nodes(), std::vector<troupe::wire::Resources>(3, {{"GPU", 1}}), PlacementStrategy::kPack,
                         &why);
  ASSERT_TRUE(q) << why;
}

// A group that lost some bundles with a node places only those, around
// the bundles it kept (`kept`: their node, 0 for the lost).
TEST(Scheduler, LostBundlesArePlacedAroundTheKeptOnes) {
  std::string why;
  // STRICT_SPREAD: not on a node that holds a kept bundle.
  auto spread = place_bundles(three_nodes(), {{{"CPU", 1}}, {{"CPU", 1}}, {{"CPU", 1}}},
                              PlacementStrategy::kStrictSpread, &why, {1, 0, 2});
  ASSERT_TRUE(spread) << why;
  EXPECT_EQ(*spread, (std::vector<uint64_t>{1, 3, 2}));
  auto two =
      place_bundles({three_nodes()[0]}, {{{"CPU", 1}}, {{"CPU", 1}}}, PlacementStrategy::kStrictSpread, &why, {1, 0});
  EXPECT_FALSE(two);
  EXPECT_NE(why.find("STRICT_SPREAD: bundle 1"), std::string::npos) << why;
  // PACK: on the kept bundles' node when it holds the rest, though another
  // node is emptier.
  auto nodes = three_nodes();
  nodes[1].available = {{"CPU", 1}, {"GPU", 2}};
  auto pack = place_bundles(nodes, {{{"CPU", 1}}, {{"CPU", 1}}}, PlacementStrategy::kPack, &why, {0, 2});
  ASSERT_TRUE(pack) << why;
  EXPECT_EQ(*pack, (std::vector<uint64_t>{2, 2}));
  // STRICT_PACK: there or nowhere, and the refusal names that node.
  auto strict = place_bundles(nodes, {{{"CPU", 2}}, {{"CPU", 1}}}, PlacementStrategy::kStrictPack, &why, {0, 2});
  EXPECT_FALSE(strict);
  EXPECT_NE(why.find("STRICT_PACK: node 2, which holds the group's other bundles"), std::string::npos) << why;
  // Nothing lost: the kept placement as it is.
  auto whole = place_bundles({}, {{{"CPU", 1}}}, PlacementStrategy::kPack, &why, {3});
  ASSERT_TRUE(whole) << why;
  EXPECT_EQ(*whole, (std::vector<uint64_t>{3}));
}

// GPUs as devices: fractions of a GPU pack onto the fullest GPU that still
// holds them, whole GPUs are never split, and a node whose free GPU amount
// would do but whose GPUs are each too full does not fit.
TEST(Scheduler, FractionsOfAGpuPackAndWholeGpusStayWhole) {
  EXPECT_EQ(pick_gpus({1, 1}, 0.5), (std::vector<size_t>{0}));
  EXPECT_EQ(pick_gpus({1, 0.5}, 0.5), (std::vector<size_t>{1}));  // the fuller one
  EXPECT_EQ(pick_gpus({0.4, 1}, 1), (std::vector<size_t>{1}));
  EXPECT_EQ(pick_gpus({1, 1, 1}, 2), (std::vector<size_t>{0, 1}));
  EXPECT_FALSE(pick_gpus({0.4, 0.4}, 0.5).has_value());
  EXPECT_FALSE(pick_gpus({0.5, 1}, 2).has_value());
  EXPECT_EQ(pick_gpus({}, 0), (std::vector<size_t>{}));
  std::vector<double> free{1, 1};
  take_gpus(free, {0}, 0.3);
  take_gpus(free, {0}, 0.3);
  take_gpus(free, {0}, 0.4);
  EXPECT_NEAR(free[0], 0.0, 1e-12);
  EXPECT_EQ(pick_gpus(free, 0.1), (std::vector<size_t>{1}));  // GPU 0 is full

  NodeView one_gpu{1, {{"CPU", 4}, {"GPU", 1}}, {{"CPU", 4}, {"GPU", 1}}, {1.0}};
  std::string why;
  // Two halves share the one GPU; two 0.6s do not fit on it.
  auto halves = place_bundles({one_gpu}, {{{"GPU", 0.5}}, {{"GPU", 0.5}}}, PlacementStrategy::kStrictPack, &why);
  ASSERT_TRUE(halves) << why;
  EXPECT_FALSE(place_bundles({one_gpu}, {{{"GPU", 0.6}}, {{"GPU", 0.6}}}, PlacementStrategy::kPack, &why));
  // 0.8 of GPU amount is free on two GPUs at 0.4 each: 0.5 fits neither.
  NodeView split{2, {{"GPU", 2}}, {{"GPU", 0.8}}, {0.4, 0.4}};
  EXPECT_FALSE(fits(split, {{"GPU", 0.5}}));
  EXPECT_TRUE(fits(split, {{"GPU", 0.4}}));
  EXPECT_FALSE(pick_node({split}, {{"GPU", 0.5}}, &why).has_value());
  // Enough free in all, split over two devices: said so, with each share.
  NodeView halves_free{1, {{"GPU", 2}}, {{"GPU", 1}}, {0.5, 0.5}};
  EXPECT_FALSE(pick_node({halves_free}, {{"GPU", 1}}, &why).has_value());
  EXPECT_NE(why.find("node 1 has GPU=1 free, but only as parts of its devices (0.5, 0.5)"), std::string::npos) << why;
  // Largest share first: 0.4, 0.4, 0.6, 0.6 fit two GPUs as 0.6 + 0.4 each
  // (in the order given, the two 0.4s would take one GPU and strand a 0.6).
  NodeView two_gpus{4, {{"GPU", 2}}, {{"GPU", 2}}, {1.0, 1.0}};
  std::vector<Resources> mixed = {{{"GPU", 0.4}}, {{"GPU", 0.4}}, {{"GPU", 0.6}}, {{"GPU", 0.6}}};
  EXPECT_EQ(placement_order(mixed), (std::vector<size_t>{2, 3, 0, 1}));
  EXPECT_TRUE(place_bundles({two_gpus}, mixed, PlacementStrategy::kStrictPack, &why)) << why;
  EXPECT_EQ(placement_order({{{"CPU", 1}}, {{"CPU", 2}}}), (std::vector<size_t>{1, 0}));
  // A view without GPU shares counts the amount only.
  NodeView amounts{3, {{"GPU", 2}}, {{"GPU", 0.8}}};
  EXPECT_TRUE(fits(amounts, {{"GPU", 0.5}}));
}

// The largest bundle is placed first, as Ray's: in the order given, the
// small bundle took the node the big one alone fits on, and a group the
// cluster can hold stayed PENDING for ever (for every strategy).
TEST(Scheduler, TheLargestBundleIsPlacedFirst) {
  std::string why;
  NodeView eight{1, {{"GPU", 8}}, {{"GPU", 8}}, std::vector<double>(8, 1.0)};
  NodeView one{2, {{"GPU", 1}}, {{"GPU", 1}}, {1.0}};
  for (auto s : {PlacementStrategy::kPack, PlacementStrategy::kSpread, PlacementStrategy::kStrictSpread}) {
    auto placed = place_bundles({eight, one}, {{{"GPU", 1}}, {{"GPU", 8}}}, s, &why);
    ASSERT_TRUE(placed) << why;
    EXPECT_EQ(*placed, (std::vector<uint64_t>{2, 1}));
  }
  NodeView four{1, {{"CPU", 4}}, {{"CPU", 4}}};
  NodeView two{2, {{"CPU", 2}}, {{"CPU", 2}}};
  auto placed = place_bundles({four, two}, {{{"CPU", 2}}, {{"CPU", 4}}}, PlacementStrategy::kPack, &why);
  ASSERT_TRUE(placed) << why;
  EXPECT_EQ(*placed, (std::vector<uint64_t>{2, 1}));
}

}  // namespace
