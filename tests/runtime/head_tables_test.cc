// The head keeps nothing for what is gone: over many drivers that connect,
// spawn, call, watch, wait and leave (their actors killed or dying with
// them), every table of live things and every per-connection table returns
// to where it started (the dead are kept up to their limits only).
#include <gtest/gtest.h>
#include <unistd.h>

#include <future>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/support/wait.h"
#include "troupe/runtime/client/actor_keys.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/testing/local_cluster.h"

using namespace std::chrono_literals;
using troupe::test::eventually;
using troupe::test::kWaitBound;

namespace {

class Echo {
 public:
  explicit Echo(int start) : value_(start) {}
  int add(int x) { return value_ += x; }

 private:
  int value_;
};

// The head's table sizes less the dead it keeps on purpose.
nlohmann::json live_tables(troupe::Runtime& rt) {
  auto t = nlohmann::json::parse(rt.status_json({"", 1}))["tables"];
  t["actors"] = t["actors"].get<int64_t>() - t["dead_actors"].get<int64_t>();
  t["placement_groups"] = t["placement_groups"].get<int64_t>() - t["removed_groups"].get<int64_t>();
  t.erase("dead_actors");
  t.erase("removed_groups");
  return t;
}

}  // namespace

TROUPE_ACTOR(Echo, &Echo::add)

TEST(HeadTables, DriversThatComeAndGoLeaveNothingBehind) {
  troupe::testing::LocalCluster cluster({.nodes = {{{"CPU", 4}}}});
  troupe::Runtime rt = cluster.connect();
  const auto base = live_tables(rt);
  constexpr int kCycles = 24;
  for (int i = 0; i < kCycles; ++i) {
    troupe::Runtime driver = cluster.connect();
    auto e = driver.spawn<Echo>({.resources = {{"CPU", 1}}, .name = "echo-" + std::to_string(i)}, i);
    EXPECT_EQ(e.call(&Echo::add, 1).get(kWaitBound), i + 1);
    auto watch = driver.watch_actor(e.id(), [](const troupe::ActorInfo&) {});
    auto pg = driver.create_placement_group({{{"CPU", 1}}}, troupe::PlacementStrategy::kPack);
    EXPECT_THROW(driver.kv().wait("never-" + std::to_string(i), 1ms), troupe::Timeout);
    // A wait answered long before its timeout, and one its driver leaves
    // in: neither's timer outlives it (each kept its connection for the
    // hour). Not ASSERTs: returning early, the futures' destructors would
    // wait out the hour.
    const std::string answered = "answered-" + std::to_string(i);
    auto waits = std::async(std::launch::async, [&] { return driver.kv().wait(answered, 1h); });
    EXPECT_TRUE(eventually([&] { return live_tables(rt)["kv_waiters"] == base["kv_waiters"].get<int>() + 1; }));
    rt.kv().put(answered, "v");
    EXPECT_EQ(waits.get(), "v");
    rt.kv().erase(answered);
    auto left = std::async(std::launch::async, [&] {
      try {
        driver.kv().wait("left-" + std::to_string(i), 1h);
      } catch (const std::exception&) {  // the driver shuts down under it
      }
    });
    EXPECT_TRUE(eventually([&] { return live_tables(rt)["kv_waiters"] == base["kv_waiters"].get<int>() + 1; }));
    // Keys the driver holds by a reference of its client's go with it.
    const std::string held = "held-" + std::to_string(i) + "/";
    driver.kv().put(held + "data", "x");
    driver.kv().put(troupe::client::client_key_prefix(driver.core()->client_id()) + "ref/" + held, "");
    if (i % 2 == 0) {
      // Half are cleaned up by their driver, the others die with it.
      watch.reset();
      driver.kill(e);
      driver.remove_placement_group(pg);
    }
    driver.shutdown();
    left.get();
    // Its connection is gone before the next driver comes (its actor and
    // group are then released: the node has room for the next cycle).
    EXPECT_TRUE(eventually([&] { return live_tables(rt)["connections"] == base["connections"]; }))
        << "cycle " << i << ": " << live_tables(rt).dump();
  }
  nlohmann::json now;
  EXPECT_TRUE(eventually([&] {
    now = live_tables(rt);
    return now == base;
  })) << "before: "
      << base.dump() << "\nafter:  " << now.dump();
}

// A handle kept after the Runtime it came from was shut down (its client
// core and I/O loop gone): calls and waits fail at once with a
// ConnectionError naming the actor and the reason, the actor itself lives
// on for the runtimes that own it, and letting the handle go later is safe
// (the ASan lane checks that its connection did not outlive its loop).
TEST(HeadTables, HandlesThatOutliveTheirRuntimeFailClearly) {
  troupe::testing::LocalCluster cluster({.nodes = {{{"CPU", 2}}}});
  troupe::Runtime rt = cluster.connect();
  auto owned = rt.spawn<Echo>({.name = "kept"}, 10);
  ASSERT_TRUE(owned.wait_ready(kWaitBound));
  troupe::ActorHandle<Echo> kept;
  {
    troupe::Runtime driver = cluster.connect();
    kept = driver.get_actor<Echo>("kept");
    EXPECT_EQ(kept.call(&Echo::add, 1).get(kWaitBound), 11);
    driver.shutdown();
  }
  try {
    kept.call(&Echo::add, 1).get(kWaitBound);
    ADD_FAILURE() << "a call through a handle of a shut-down runtime went through";
  } catch (const troupe::ConnectionError& e) {
    EXPECT_NE(std::string(e.what()).find("shut down"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("Echo"), std::string::npos) << e.what();
  }
  EXPECT_THROW(kept.wait_ready(kWaitBound), troupe::ConnectionError);
  EXPECT_EQ(owned.call(&Echo::add, 1).get(kWaitBound), 12);
  kept = {};
}
