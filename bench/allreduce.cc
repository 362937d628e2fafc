// troupe_bench_allreduce: allreduce bus bandwidth of GlooGroup, 2 ranks in
// separate processes on loopback, float32, 1 KiB to 64 MiB; then the same
// with torch.distributed's gloo backend (bench/peers/torch_allreduce.py run
// by Debian's /usr/bin/python3) in the same invocation. Prints one JSON
// object per line; troupe rows carry ratio = troupe / torch.
//
// Usage: troupe_bench_allreduce [--peer PATH/torch_allreduce.py] [--python /usr/bin/python3]
//                               [--no-peer] [--trials N] [--rounds N]
// Both sides run the same schedule: warm-ups, then `trials` timed runs of
// `iters` back-to-back allreduces; the best trial's mean time per op, taken
// as the max over ranks, gives bus bandwidth = 2(n-1)/n * bytes / time.
// `rounds` alternates troupe and torch runs and keeps each side's best.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "runtime/collective/file_kv_store.h"
#include "runtime/collective/gloo_group.h"

#ifndef TROUPE_BENCH_PEERS_DIR
#define TROUPE_BENCH_PEERS_DIR "bench/peers"
#endif

namespace {

using namespace std::chrono_literals;
using troupe::collective::DType;
using troupe::collective::FileKvStore;
using troupe::collective::GlooGroup;

constexpr int kWorld = 2;
const std::vector<size_t> kSizes = {1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20};

// About 1 GiB moved per size, within [10, 2000] iterations.
int iterations_for(size_t bytes) {
  return static_cast<int>(std::clamp<size_t>((size_t{1} << 30) / bytes, 10, 2000));
}
int warmups_for(size_t bytes) { return std::max(3, iterations_for(bytes) / 10); }

double bus_bandwidth_gbps(size_t bytes, double seconds) {
  return 2.0 * (kWorld - 1) / kWorld * static_cast<double>(bytes) / seconds / 1e9;
}

// One rank: forms the group and measures every size. Rank 0 writes
// "<bytes> <seconds per op>" lines to `out_fd`.
int run_rank(int rank, const std::string& dir, int trials, int out_fd) {
  FileKvStore kv(dir);
  troupe::collective::GlooGroupOptions opts;
  opts.rendezvous_timeout = 60s;
  auto group = GlooGroup::create(kv, "bench-allreduce", 1, rank, kWorld, opts);
  for (size_t bytes : kSizes) {
    std::vector<float> data(bytes / sizeof(float), 1.0f);
    for (int i = 0; i < warmups_for(bytes); ++i) group->allreduce(data.data(), data.size(), DType::kFloat32)->wait();
    double best = 1e30;
    for (int t = 0; t < trials; ++t) {
      group->barrier()->wait();
      auto start = std::chrono::steady_clock::now();
      const int iters = iterations_for(bytes);
      for (int i = 0; i < iters; ++i) group->allreduce(data.data(), data.size(), DType::kFloat32)->wait();
      std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
      best = std::min(best, elapsed.count() / iters);
    }
    // The slower rank bounds the collective.
    double worst = best;
    troupe::collective::AllreduceOptions max_opts;
    max_opts.op = troupe::collective::ReduceOp::kMax;
    group->allreduce(&worst, 1, DType::kFloat64, max_opts)->wait();
    if (rank == 0) dprintf(out_fd, "%zu %.9g\n", bytes, worst);
  }
  return 0;
}

std::string join(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

// Pulls "key": number out of one JSON line written by the peer.
bool json_number(const std::string& line, const std::string& key, double* out) {
  auto pos = line.find("\"" + key + "\"");
  if (pos == std::string::npos) return false;
  pos = line.find(':', pos);
  if (pos == std::string::npos) return false;
  *out = std::strtod(line.c_str() + pos + 1, nullptr);
  return true;
}

// Runs both ranks once over every size; fills seconds per op by size.
bool run_troupe(int trials, std::map<size_t, double>* troupe_seconds) {
  char templ[] = "/tmp/troupe-bench-allreduce-XXXXXX";
  if (::mkdtemp(templ) == nullptr) {
    std::perror("mkdtemp");
    return false;
  }
  const std::string dir = templ;
  int fds[2];
  if (::pipe(fds) != 0) {
    std::perror("pipe");
    return false;
  }
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int r = 0; r < kWorld; ++r) {
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      int code = 1;
      try {
        code = run_rank(r, dir, trials, fds[1]);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
      }
      ::_exit(code);
    }
    pids.push_back(pid);
  }
  ::close(fds[1]);
  if (FILE* in = ::fdopen(fds[0], "r")) {
    size_t bytes;
    double seconds;
    while (std::fscanf(in, "%zu %lf", &bytes, &seconds) == 2) (*troupe_seconds)[bytes] = seconds;
    std::fclose(in);
  }
  bool ok = true;
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  std::string rm = "rm -rf '" + dir + "'";
  if (std::system(rm.c_str()) != 0) std::fprintf(stderr, "could not remove %s\n", dir.c_str());
  if (!ok || troupe_seconds->size() != kSizes.size()) {
    std::fprintf(stderr, "troupe ranks failed\n");
    return false;
  }
  return true;
}

// Runs the torch peer once; fills GB/s by size.
void run_torch(const std::string& python, const std::string& peer, int trials, std::map<size_t, double>* gbps) {
  std::vector<int> iters, warmups, sizes;
  for (size_t b : kSizes) {
    sizes.push_back(static_cast<int>(b));
    iters.push_back(iterations_for(b));
    warmups.push_back(warmups_for(b));
  }
  std::string cmd = "'" + python + "' '" + peer + "' --sizes " + join(sizes) + " --iters " + join(iters) +
                    " --warmups " + join(warmups) + " --trials " + std::to_string(trials);
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) {
    std::fprintf(stderr, "could not run %s\n", cmd.c_str());
    return;
  }
  char line[4096];
  while (std::fgets(line, sizeof line, p)) {
    std::string s = line;
    double bytes = 0, value = 0;
    if (json_number(s, "bytes", &bytes) && json_number(s, "value", &value)) (*gbps)[static_cast<size_t>(bytes)] = value;
  }
  if (::pclose(p) != 0) std::fprintf(stderr, "torch peer failed: %s\n", cmd.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  std::string peer = std::string(TROUPE_BENCH_PEERS_DIR) + "/torch_allreduce.py";
  std::string python = "/usr/bin/python3";
  bool run_peer = true;
  int trials = 3;
  int rounds = 2;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--peer" && i + 1 < argc) {
      peer = argv[++i];
    } else if (a == "--python" && i + 1 < argc) {
      python = argv[++i];
    } else if (a == "--no-peer") {
      run_peer = false;
    } else if (a == "--trials" && i + 1 < argc) {
      trials = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--rounds" && i + 1 < argc) {
      rounds = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: %s [--peer PATH] [--python PATH] [--no-peer] [--trials N] [--rounds N]\n", argv[0]);
      return 2;
    }
  }

  std::map<size_t, double> troupe_seconds;
  std::map<size_t, double> torch_gbps;
  // Alternate troupe and torch rounds and keep each side's best, so that
  // background load on a shared machine biases neither side.
  for (int round = 0; round < rounds; ++round) {
    std::map<size_t, double> t;
    if (!run_troupe(trials, &t)) return 1;
    for (auto& [b, sec] : t) {
      if (!troupe_seconds.count(b) || sec < troupe_seconds[b]) troupe_seconds[b] = sec;
    }
    if (run_peer) {
      std::map<size_t, double> g;
      run_torch(python, peer, trials, &g);
      for (auto& [b, v] : g) torch_gbps[b] = std::max(torch_gbps[b], v);
    }
  }
  if (run_peer) {
    for (size_t bytes : kSizes) {
      if (!torch_gbps.count(bytes)) continue;
      std::printf("{\"bench\":\"allreduce\",\"case\":\"torch_gloo\",\"bytes\":%zu,\"value\":%.4f,\"unit\":\"GB/s\"}\n",
                  bytes, torch_gbps[bytes]);
    }
  }

  for (size_t bytes : kSizes) {
    double gbps = bus_bandwidth_gbps(bytes, troupe_seconds[bytes]);
    std::printf("{\"bench\":\"allreduce\",\"case\":\"troupe_gloo\",\"bytes\":%zu,\"value\":%.4f,\"unit\":\"GB/s\"", bytes,
                gbps);
    auto it = torch_gbps.find(bytes);
    if (it != torch_gbps.end() && it->second > 0) std::printf(",\"ratio\":%.3f", gbps / it->second);
    std::printf(",\"seconds_per_op\":%.9g}\n", troupe_seconds[bytes]);
  }
  return 0;
}
