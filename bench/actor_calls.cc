// bench/run actor_calls — actor call throughput and spawn latency across
// processes on loopback, next to two raw TCP ping-pongs between two plain
// processes measured in the same run (the physical limit of a synchronous
// round trip here): `tcp_pingpong` blocks in read(), `tcp_pingpong_spin`
// polls ~100 us before it blocks, as troupe's Future waits. The 1:1 sync
// call's `ratio` is against the spinning peer, which waits the same way
// (`ratio_blocking` against the blocking one): against a blocking peer the
// ratio measures the scheduler's wake-up more than the runtime. Prints one
// JSON object per line. Every wait for an actor is bounded (kCallTimeout);
// the ping-pong child is killed at the end.
//
//   troupe_bench_actor_calls [--seconds 3] [--only-sync]
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "bench/json_row.h"
#include "bench/loopback_tcp.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/testing/local_cluster.h"

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;
// No single call or batch of this benchmark comes near it on a loaded
// machine; a hung actor ends the run with an error instead of a hang.
constexpr auto kCallTimeout = 120s;
// How long a troupe Future spins before it blocks
// (core::FutureStateBase::kSpinMicros); the spinning ping-pong waits alike.
constexpr int kFutureSpinMicros = 100;

class Echo {
 public:
  std::string echo(std::string s) { return s; }
  int ping() { return 1; }
};
TROUPE_ACTOR(Echo, &Echo::echo, &Echo::ping)

// A caller actor for the n:n case: makes `n` pipelined calls spread over
// the named Echo actors and returns the seconds it took.
class Caller {
 public:
  explicit Caller(std::vector<std::string> targets) : targets_(std::move(targets)) {}
  double run(int n, int window) {
    auto& rt = troupe::this_actor::runtime();
    std::vector<troupe::ActorHandle<Echo>> hs;
    for (auto& t : targets_) hs.push_back(rt.get_actor<Echo>(t));
    for (auto& h : hs) h.call(&Echo::ping).get(kCallTimeout);
    std::string payload(64, 'x');
    auto t0 = Clock::now();
    std::vector<troupe::Future<std::string>> fs;
    fs.reserve(window);
    for (int done = 0; done < n;) {
      int k = std::min(window, n - done);
      for (int i = 0; i < k; ++i) fs.push_back(hs[(done + i) % hs.size()].call(&Echo::echo, payload));
      for (auto& f : fs) f.get(kCallTimeout);
      fs.clear();
      done += k;
    }
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }

 private:
  std::vector<std::string> targets_;
};
TROUPE_ACTOR(Caller, &Caller::run)

namespace {

void emit(const std::string& c, double value, const std::string& unit, const nlohmann::ordered_json& extra = {}) {
  nlohmann::ordered_json row = {
      {"bench", "actor_calls"}, {"case", c}, {"value", std::round(value * 10) / 10}, {"unit", unit}};
  if (extra.is_object()) row.update(extra);
  troupe::bench::print_row(row);
}

using troupe::bench::read_full;
using troupe::bench::write_full;

// Reads n bytes the way a troupe Future waits for a reply
// (core::FutureStateBase::spin): non-blocking reads with a yield in
// between for kFutureSpinMicros, checking the clock every 16 tries, then a
// blocking read for the rest.
void spin_read_full(int fd, char* p, size_t n) {
  auto until = Clock::now() + std::chrono::microseconds(kFutureSpinMicros);
  for (unsigned i = 1; n; ++i) {
    ssize_t r = ::recv(fd, p, n, MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
      continue;
    }
    if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) _exit(1);
    sched_yield();
    if (i % 16 == 0 && Clock::now() > until) return read_full(fd, p, n);
  }
}

// Round trips/s of 64-byte messages between two plain processes. The echo
// side blocks in read() (as a worker's I/O thread blocks in epoll); the
// asking side blocks too, or spins first when `spin` is set.
double tcp_pingpong(double seconds, bool spin) {
  sockaddr_in a;
  int ls = troupe::bench::listen_loopback(a);
  pid_t pid = fork();
  if (pid == 0) {
    int s = accept(ls, nullptr, nullptr);
    int one = 1;
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    char buf[64];
    for (;;) {
      ssize_t r = ::read(s, buf, 1);
      if (r <= 0) _exit(0);
      read_full(s, buf + 1, 63);
      write_full(s, buf, 64);
    }
  }
  int c = troupe::bench::connect_loopback(a);
  char buf[64] = {0};
  long n = 0;
  auto t0 = Clock::now();
  double elapsed = 0;
  while (elapsed < seconds) {
    for (int i = 0; i < 500; ++i) {
      write_full(c, buf, 64);
      if (spin)
        spin_read_full(c, buf, 64);
      else
        read_full(c, buf, 64);
    }
    n += 500;
    elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  close(c);
  close(ls);
  int st;
  waitpid(pid, &st, 0);
  return n / elapsed;
}

double sync_calls(troupe::ActorHandle<Echo>& h, double seconds) {
  std::string payload(64, 'x');
  for (int i = 0; i < 200; ++i) h.call(&Echo::echo, payload).get(kCallTimeout);
  long n = 0;
  auto t0 = Clock::now();
  double elapsed = 0;
  while (elapsed < seconds) {
    for (int i = 0; i < 200; ++i) h.call(&Echo::echo, payload).get(kCallTimeout);
    n += 200;
    elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  return n / elapsed;
}

double async_calls(troupe::ActorHandle<Echo>& h, int total, int window) {
  std::string payload(64, 'x');
  std::vector<troupe::Future<std::string>> fs;
  fs.reserve(window);
  auto t0 = Clock::now();
  for (int done = 0; done < total;) {
    int k = std::min(window, total - done);
    for (int i = 0; i < k; ++i) fs.push_back(h.call(&Echo::echo, payload));
    for (auto& f : fs) f.get(kCallTimeout);
    fs.clear();
    done += k;
  }
  return total / std::chrono::duration<double>(Clock::now() - t0).count();
}

int run(double seconds, bool only_sync);

}  // namespace

int main(int argc, char** argv) {
  troupe::run_role_if_requested(argc, argv);
  troupe::core::init_logging("bench");
  spdlog::set_level(spdlog::level::warn);
  double seconds = 3;
  bool only_sync = false;
  CLI::App app{"actor call throughput and spawn latency, next to a raw TCP ping-pong"};
  app.add_option("--seconds", seconds, "seconds per ping-pong / sync case")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_flag("--only-sync", only_sync, "only the ping-pong and 1:1 sync cases");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(seconds, only_sync);
  } catch (const std::exception& e) {
    troupe::bench::print_error_row("actor_calls", "run", e.what());
    return 1;
  }
}

namespace {

int run(double seconds, bool only_sync) {
  troupe::testing::LocalClusterOptions lo;
  lo.nodes = {{{"CPU", 8}}};
  troupe::testing::LocalCluster cluster(lo);
  troupe::Runtime rt = cluster.connect();
  auto echo = rt.spawn<Echo>({.name = "echo0"});
  echo.call(&Echo::ping).get(kCallTimeout);

  // Interleaved, best of three each, so that background load hits both alike.
  double tcp = 0, tcp_spin = 0, sync = 0;
  for (int r = 0; r < 3; ++r) {
    tcp = std::max(tcp, tcp_pingpong(seconds / 3, false));
    tcp_spin = std::max(tcp_spin, tcp_pingpong(seconds / 3, true));
    sync = std::max(sync, sync_calls(echo, seconds / 3));
  }
  auto ratio = [](double a, double b) { return std::round(a / b * 1000) / 1000; };
  emit("tcp_pingpong", tcp, "round_trips/s");
  emit("tcp_pingpong_spin", tcp_spin, "round_trips/s", {{"spin_us", kFutureSpinMicros}});
  emit("1_1_sync", sync, "calls/s",
       {{"ratio", ratio(sync, tcp_spin)},
        {"peer", "tcp_pingpong_spin"},
        {"ratio_blocking", ratio(sync, tcp)},
        {"peer_blocking", "tcp_pingpong"}});
  if (only_sync) return 0;

  async_calls(echo, 20000, 5000);  // warm up
  double best = 0;
  for (int r = 0; r < 3; ++r) best = std::max(best, async_calls(echo, 400000, 20000));
  emit("1_1_async", best, "calls/s");

  auto echo1 = rt.spawn<Echo>({.name = "echo1"});
  echo1.call(&Echo::ping).get(kCallTimeout);
  std::vector<std::string> names{"echo0", "echo1"};
  auto c0 = rt.spawn<Caller>({}, names);
  auto c1 = rt.spawn<Caller>({}, names);
  if (!c0.wait_ready(kCallTimeout) || !c1.wait_ready(kCallTimeout)) {
    troupe::bench::print_error_row("actor_calls", "n_n_async", "the caller actors did not start");
    return 1;
  }
  const int per_caller = 200000;
  auto f0 = c0.call(&Caller::run, per_caller, 10000);
  auto f1 = c1.call(&Caller::run, per_caller, 10000);
  double t = std::max(f0.get(kCallTimeout), f1.get(kCallTimeout));
  emit("n_n_async", 2.0 * per_caller / t, "calls/s", {{"callers", 2}, {"actors", 2}});

  // Spawn to first reply from the warm pool: each spawn waits (bounded)
  // until the node agent has refilled its pool, so every sample is a pooled
  // start, not a mix of pooled and cold ones. The worker is this binary
  // (runtime only, no LibTorch); bench/run spawn measures pooled and cold
  // starts side by side.
  // False when it had not refilled within 30 s: that spawn is counted.
  const auto wait_pool = [&] {
    const auto deadline = Clock::now() + 30s;
    while (lo.worker_pool_size > 0 && Clock::now() < deadline) {
      auto nodes = rt.nodes();
      if (!nodes.empty() && nodes[0].idle_workers >= lo.worker_pool_size) return true;
      std::this_thread::sleep_for(5ms);
    }
    return lo.worker_pool_size == 0;
  };
  std::vector<double> ms;
  int before_refill = 0;
  for (int i = 0; i < 15; ++i) {
    if (!wait_pool()) ++before_refill;
    auto t0 = Clock::now();
    auto a = rt.spawn<Echo>({});
    a.call(&Echo::ping).get(kCallTimeout);
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    rt.kill(a);
  }
  std::sort(ms.begin(), ms.end());
  emit("spawn_p50_ms", ms[ms.size() / 2], "ms",
       {{"from", "warm pool, refilled before each spawn"},
        {"pool", lo.worker_pool_size},
        {"spawns_before_pool_refilled", before_refill},
        {"worker", "runtime only"}});
  return 0;
}

}  // namespace
