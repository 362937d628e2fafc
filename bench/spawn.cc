// Spawn benchmark: actor spawn to first reply, with the node agent's warm
// worker pool (spawn_pool_p50_ms) and without it (spawn_cold_p50_ms), each
// on a one-node LocalCluster of its own, in the same run. Runtime only (no
// LibTorch): the worker is this small binary.
//
//   troupe_bench_spawn [--spawns N]
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "bench/json_row.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/testing/local_cluster.h"

class Echo {
 public:
  Echo() = default;
  int ping() const { return 1; }
};
TROUPE_ACTOR(Echo, &Echo::ping)

namespace {

using Clock = std::chrono::steady_clock;

// Waits (bounded) until the node reports `n` idle workers; false when it
// did not within 30 s (the next spawn is then no pooled start).
bool wait_idle(troupe::Runtime& rt, uint32_t n) {
  auto deadline = Clock::now() + std::chrono::seconds(30);
  while (Clock::now() < deadline) {
    auto nodes = rt.nodes();
    if (!nodes.empty() && nodes[0].idle_workers >= n) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

struct Samples {
  std::vector<double> ms;
  int without_full_pool = 0;  // spawns made before the pool had refilled
};

// Milliseconds from spawn to the first reply, for `spawns` actors one after
// another; each actor is killed before the next spawn (and, with a pool,
// the pool has refilled).
Samples measure(uint32_t pool_size, int spawns) {
  troupe::testing::LocalClusterOptions o;
  o.nodes = {{{"CPU", 2}}};
  o.worker_pool_size = pool_size;
  troupe::testing::LocalCluster cluster(o);
  troupe::Runtime rt = cluster.connect();
  Samples out;
  for (int i = 0; i < spawns; ++i) {
    if (pool_size > 0 && !wait_idle(rt, pool_size)) ++out.without_full_pool;
    auto t0 = Clock::now();
    auto a = rt.spawn<Echo>({});
    a.call(&Echo::ping).get(std::chrono::seconds(120));  // bounded, as every benchmark is
    out.ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    rt.kill(a);
  }
  return out;
}

double p50(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  troupe::run_role_if_requested(argc, argv);
  int spawns = 20;
  CLI::App app{"actor spawn to first reply, with the warm worker pool and without it, in the same run"};
  app.add_option("--spawns", spawns, "spawns per case (the median of them is reported)")->check(CLI::Range(1, 100000));
  CLI11_PARSE(app, argc, argv);
  try {
    const Samples pooled = measure(2, spawns);
    double pool = p50(pooled.ms);
    double cold = p50(measure(0, spawns).ms);
    // Spawns made before the pool refilled (30 s) are cold starts among
    // the pooled ones: counted, not hidden.
    troupe::bench::print_row({{"bench", "spawn"},
                              {"case", "spawn_pool_p50_ms"},
                              {"value", pool},
                              {"unit", "ms"},
                              {"spawns", spawns},
                              {"spawns_before_pool_refilled", pooled.without_full_pool},
                              {"ratio", cold > 0 ? pool / cold : 0}});
    troupe::bench::print_row(
        {{"bench", "spawn"}, {"case", "spawn_cold_p50_ms"}, {"value", cold}, {"unit", "ms"}, {"spawns", spawns}});
  } catch (const std::exception& e) {
    troupe::bench::print_error_row("spawn", "spawn_pool_p50_ms", e.what());
    return 1;
  }
  return 0;
}
