// bench/run objects — object references between two worker processes:
// actor A puts a buffer in its object store and returns the ref, actor B
// gets it from A directly (the driver only passes the ref along). Reported
// in GB/s, end to end (A's put call + B's get call, as the driver sees
// them), next to loopback TCP moving the same bytes between two plain
// processes in the same run (a request, then the bytes into a reused
// buffer: `ratio` = troupe ÷ TCP, > 1 when troupe is faster). troupe's
// receiver reuses its receive memory too (runtime/wire/incoming.cc keeps
// released mappings of large attachments, up to 256 MiB, for the next), so
// `ratio` is the like-for-like figure. `peer_fresh_value` is the same TCP
// fetch into newly allocated memory per fetch, what a receiver without
// such reuse pays for its page faults; it is printed for reference, with
// no ratio, since troupe does not pay that cost. Prints one JSON object per
// line; every wait is bounded.
//
//   troupe_bench_objects [--rounds 3]
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bench/json_row.h"
#include "bench/loopback_tcp.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/testing/local_cluster.h"

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;
constexpr auto kCallTimeout = 120s;

// Owns the objects: puts one buffer of n bytes per call (a Buffer goes into
// the store without a copy, as a tensor's storage would).
class Source {
 public:
  troupe::ObjectRef<troupe::Buffer> put(int64_t n) {
    if (!buffer_.has_value() || buffer_->size() != static_cast<size_t>(n)) {
      std::vector<std::byte> v(n);
      for (int64_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>(i % 251);
      buffer_ = troupe::Buffer::from_vector(std::move(v));
    }
    return troupe::this_actor::runtime().put(*buffer_);
  }

 private:
  std::optional<troupe::Buffer> buffer_;
};
TROUPE_ACTOR(Source, &Source::put)

// Consumes them: fetches the value from its owner.
class Sink {
 public:
  int64_t get(troupe::ObjectRef<troupe::Buffer> r) { return static_cast<int64_t>(r.get(kCallTimeout).size()); }
};
TROUPE_ACTOR(Sink, &Sink::get)

namespace {

using troupe::bench::read_full;
using troupe::bench::write_full;

// The peer: a child that answers each 8-byte request for n bytes with n
// bytes; GB/s over `reps` requests, read into one reused buffer (as troupe's
// receiver reuses its mappings) or (fresh) into new memory each time.
double tcp_fetch(int64_t bytes, int reps, bool fresh) {
  sockaddr_in a;
  int ls = troupe::bench::listen_loopback(a);
  pid_t pid = fork();
  if (pid == 0) {
    int s = accept(ls, nullptr, nullptr);
    std::vector<char> data(bytes, 'x');
    int64_t n = 0;
    for (;;) {
      if (::read(s, &n, 1) <= 0) _exit(0);
      read_full(s, reinterpret_cast<char*>(&n) + 1, 7);
      write_full(s, data.data(), n);
    }
  }
  int c = troupe::bench::connect_loopback(a);
  std::vector<char> buf(bytes);
  auto fetch = [&] {
    write_full(c, reinterpret_cast<const char*>(&bytes), 8);
    std::unique_ptr<char[]> block(fresh ? new char[bytes] : nullptr);
    read_full(c, fresh ? block.get() : buf.data(), bytes);
  };
  fetch();  // warm up
  auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) fetch();
  double s = std::chrono::duration<double>(Clock::now() - t0).count();
  close(c);
  close(ls);
  int st;
  waitpid(pid, &st, 0);
  return double(bytes) * reps / s / 1e9;
}

// GB/s of `reps` rounds of A.put + B.get.
double put_get(troupe::ActorHandle<Source>& a, troupe::ActorHandle<Sink>& b, int64_t bytes, int reps) {
  auto round = [&] {
    auto r = a.call(&Source::put, bytes).get(kCallTimeout);
    if (b.call(&Sink::get, r).get(kCallTimeout) != bytes) throw troupe::Error("the sink got a short object");
  };
  round();  // warm up: connections, the source's buffer
  auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) round();
  double s = std::chrono::duration<double>(Clock::now() - t0).count();
  return double(bytes) * reps / s / 1e9;
}

void emit(const std::string& c, double gbps, double tcp, double tcp_fresh) {
  troupe::bench::print_row({{"bench", "objects"},
                            {"case", c},
                            {"value", std::round(gbps * 1000) / 1000},
                            {"unit", "GB/s"},
                            {"ratio", std::round(gbps / tcp * 1000) / 1000},
                            {"peer", "tcp_fetch"},
                            {"peer_value", std::round(tcp * 1000) / 1000},
                            {"peer_fresh_value", std::round(tcp_fresh * 1000) / 1000}});
}

int run(int rounds) {
  troupe::testing::LocalClusterOptions lo;
  lo.nodes = {{{"CPU", 8}}};
  troupe::testing::LocalCluster cluster(lo);
  troupe::Runtime rt = cluster.connect();
  auto a = rt.spawn<Source>({});
  auto b = rt.spawn<Sink>({});
  if (!a.wait_ready(kCallTimeout) || !b.wait_ready(kCallTimeout)) {
    troupe::bench::print_error_row("objects", "run", "the actors did not start");
    return 1;
  }
  struct Case {
    const char* name;
    int64_t bytes;
    int reps;
  };
  for (Case c : {Case{"put_get_1MiB", int64_t{1} << 20, 200}, Case{"put_get_64MiB", int64_t{64} << 20, 8}}) {
    // Interleaved, best of `rounds` each, so that background load hits both alike.
    double tcp = 0, tcp_fresh = 0, troupe_gbps = 0;
    for (int r = 0; r < rounds; ++r) {
      tcp = std::max(tcp, tcp_fetch(c.bytes, c.reps, false));
      tcp_fresh = std::max(tcp_fresh, tcp_fetch(c.bytes, c.reps, true));
      troupe_gbps = std::max(troupe_gbps, put_get(a, b, c.bytes, c.reps));
    }
    emit(c.name, troupe_gbps, tcp, tcp_fresh);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  troupe::run_role_if_requested(argc, argv);
  troupe::core::init_logging("bench");
  spdlog::set_level(spdlog::level::warn);
  int rounds = 3;
  CLI::App app{"object refs between two worker processes, next to loopback TCP"};
  app.add_option("--rounds", rounds, "rounds per case (best is reported)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    return run(rounds);
  } catch (const std::exception& e) {
    troupe::bench::print_error_row("objects", "run", e.what());
    return 1;
  }
}
