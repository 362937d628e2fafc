// bench/run tasks — task throughput on loopback: `tasks_sync` (submit +
// get, one at a time) and `tasks_async` (1,000 in flight), in tasks/s,
// each next to its peer measured in the same run: calls of the same
// function as an actor method on one actor (`actor_sync`, `actor_async`).
// Prints one JSON object per line; every wait is bounded (kTimeout).
//
//   troupe_bench_tasks [--seconds 3] [--executors 0] [--profile tasks_async]
//
// --profile CASE runs only that case (tasks_sync, actor_sync, tasks_async,
// actor_async) for --seconds, for a profiler, and prints its rate alone.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "bench/json_row.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/testing/local_cluster.h"

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;
constexpr auto kTimeout = 120s;
constexpr int kInFlight = 1000;

int square(int x) { return x * x; }
TROUPE_TASK(square)

class Squarer {
 public:
  int square(int x) { return x * x; }
};
TROUPE_ACTOR(Squarer, &Squarer::square)

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Runs `one_batch` (which does `n` operations) until `seconds` pass;
// operations per second.
template <class F>
double rate(double seconds, int n, F one_batch) {
  long done = 0;
  auto t0 = Clock::now();
  while (seconds_since(t0) < seconds) {
    one_batch();
    done += n;
  }
  return done / seconds_since(t0);
}

template <class Submit>
void in_flight_batch(Submit submit) {
  std::vector<troupe::Future<int>> fs;
  fs.reserve(kInFlight);
  for (int i = 0; i < kInFlight; ++i) fs.push_back(submit(i));
  for (auto& f : fs) f.get(kTimeout);
}

void emit(const std::string& c, double value, const std::string& peer = "", double peer_value = 0) {
  nlohmann::ordered_json row = {{"bench", "tasks"}, {"case", c}, {"value", std::round(value)}, {"unit", "tasks/s"}};
  if (!peer.empty()) {
    row["ratio"] = std::round(value / peer_value * 1000) / 1000;
    row["peer"] = peer;
  }
  troupe::bench::print_row(row);
}

int run(double seconds, int executors, const std::string& profile) {
  troupe::testing::LocalClusterOptions lo;
  lo.nodes = {{{"CPU", 2}}};
  troupe::testing::LocalCluster cluster(lo);
  troupe::Runtime rt = cluster.connect();
  auto tasks = rt.core()->service<troupe::client::TaskSubmitter>();
  tasks->set_options({.idle_release = 10s, .max_executors = executors});
  auto actor = rt.spawn<Squarer>({});
  actor.call(&Squarer::square, 1).get(kTimeout);

  auto task_sync = [&] {
    for (int i = 0; i < 100; ++i) rt.submit(&square, {}, i).get(kTimeout);
  };
  auto actor_sync = [&] {
    for (int i = 0; i < 100; ++i) actor.call(&Squarer::square, i).get(kTimeout);
  };
  auto task_async = [&] { in_flight_batch([&](int i) { return rt.submit(&square, {}, i); }); };
  auto actor_async = [&] { in_flight_batch([&](int i) { return actor.call(&Squarer::square, i); }); };
  // Warm-up: executors leased, connections made.
  for (int i = 0; i < 5; ++i) task_async();
  actor_async();

  if (!profile.empty()) {
    const std::map<std::string, std::function<void()>> cases = {{"tasks_sync", task_sync},
                                                                {"actor_sync", actor_sync},
                                                                {"tasks_async", task_async},
                                                                {"actor_async", actor_async}};
    const bool sync = profile.ends_with("_sync");
    emit(profile, rate(seconds, sync ? 100 : kInFlight, cases.at(profile)));
    return 0;
  }
  // Interleaved, best of three each, so that background load hits both alike.
  double ts = 0, as = 0, ta = 0, aa = 0;
  for (int r = 0; r < 3; ++r) {
    ts = std::max(ts, rate(seconds / 3, 100, task_sync));
    as = std::max(as, rate(seconds / 3, 100, actor_sync));
    ta = std::max(ta, rate(seconds / 3, kInFlight, task_async));
    aa = std::max(aa, rate(seconds / 3, kInFlight, actor_async));
  }
  emit("actor_sync", as);
  emit("tasks_sync", ts, "actor_sync", as);
  emit("actor_async", aa);
  emit("tasks_async", ta, "actor_async", aa);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  troupe::run_role_if_requested(argc, argv);
  troupe::core::init_logging("bench");
  spdlog::set_level(spdlog::level::warn);
  double seconds = 3;
  int executors = 0;
  CLI::App app{"task throughput next to actor calls of the same function"};
  app.add_option("--seconds", seconds, "seconds per case")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--executors", executors, "task executors to lease (0 = as many as the cluster fits)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  std::string profile;
  app.add_option("--profile", profile, "run only this case, for a profiler")
      ->check(CLI::IsMember({"tasks_sync", "actor_sync", "tasks_async", "actor_async"}));
  CLI11_PARSE(app, argc, argv);
  try {
    return run(seconds, executors, profile);
  } catch (const std::exception& e) {
    troupe::bench::print_error_row("tasks", "run", e.what());
    return 1;
  }
}
