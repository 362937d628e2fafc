// bench/run soak — the long form of the test suite's bounded soak: many
// task cycles and actor spawn → call → kill cycles against one LocalCluster,
// then how much the driver grew. Rows: `soak_cycles_per_s` (task and actor
// cycles together), `soak_fd_growth` (open descriptors of the driver, end
// minus start after a warm-up) and `soak_rss_growth_mib` (its resident
// memory). Nothing here is asserted; the figures are for a reader to judge.
//
//   troupe_bench_soak [--tasks 20000] [--actors 500]
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>

#include "bench/json_row.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/testing/local_cluster.h"

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;
constexpr auto kTimeout = 120s;

int twice(int x) { return 2 * x; }
TROUPE_TASK(twice)

class Echo {
 public:
  int echo(int x) { return x; }
};
TROUPE_ACTOR(Echo, &Echo::echo)

namespace {

size_t open_fds() {
  size_t n = 0;
  for ([[maybe_unused]] auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

double rss_mib() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<double>(::sysconf(_SC_PAGESIZE)) / (1024.0 * 1024.0);
}

// One actor cycle: spawn, one call, kill (no restart).
void actor_cycle(troupe::Runtime& rt, int i) {
  auto a = rt.spawn<Echo>({.resources = {{"CPU", 1}}});
  if (a.call(&Echo::echo, i).get(kTimeout) != i) throw std::runtime_error("actor echoed a wrong value");
  rt.kill(a);
}

int run(int tasks, int actors) {
  troupe::testing::LocalClusterOptions o;
  o.nodes = {{{"CPU", 2}}};
  troupe::testing::LocalCluster cluster(o);
  troupe::Runtime rt = cluster.connect();
  // Warm-up: executors leased, connections and pools in place.
  for (int i = 0; i < 200; ++i) rt.submit(&twice, {}, i).get(kTimeout);
  actor_cycle(rt, 0);
  const size_t fds0 = open_fds();
  const double rss0 = rss_mib();
  auto t0 = Clock::now();
  const int every = actors > 0 ? std::max(1, tasks / actors) : 0;
  int spawned = 0;
  for (int i = 0; i < tasks; ++i) {
    if (rt.submit(&twice, {}, i).get(kTimeout) != 2 * i) throw std::runtime_error("task returned a wrong value");
    if (every && i % every == 0 && spawned < actors) {
      actor_cycle(rt, i);
      ++spawned;
    }
    if ((i + 1) % 5000 == 0)
      std::fprintf(stderr, "soak: %d/%d tasks, %d actors, %zu fds, %.1f MiB\n", i + 1, tasks, spawned, open_fds(),
                   rss_mib());
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  nlohmann::ordered_json base = {{"bench", "soak"}, {"tasks", tasks}, {"actors", spawned}};
  auto row = [&](const char* c, double v, const char* unit) {
    auto r = base;
    r["case"] = c;
    r["value"] = v;
    r["unit"] = unit;
    troupe::bench::print_row(r);
  };
  row("soak_cycles_per_s", (tasks + spawned) / secs, "cycles/s");
  row("soak_fd_growth", static_cast<double>(open_fds()) - static_cast<double>(fds0), "fds");
  row("soak_rss_growth_mib", rss_mib() - rss0, "MiB");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  troupe::run_role_if_requested(argc, argv);
  troupe::core::init_logging("bench");
  spdlog::set_level(spdlog::level::warn);
  int tasks = 20000, actors = 500;
  CLI::App app{"long soak: task and actor cycles, then the driver's fd and memory growth"};
  app.add_option("--tasks", tasks, "task cycles (submit + get)")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--actors", actors, "actor cycles (spawn, call, kill) spread among them")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    return run(tasks, actors);
  } catch (const std::exception& e) {
    troupe::bench::print_error_row("soak", "run", e.what());
    return 1;
  }
}
