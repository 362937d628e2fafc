// troupe_bench_allreduce: allreduce bus bandwidth of GlooGroup against
// torch.distributed's gloo backend (bench/peers/torch_allreduce.py, run by
// Debian's /usr/bin/python3), 2 ranks in separate processes on loopback,
// float32, 1 KiB to 64 MiB. Prints one JSON object per line; troupe rows
// carry ratio = torch's time per op ÷ troupe's (> 1: troupe faster), with
// both sides' bus bandwidth beside it (value, peer_value) and the host's
// online CPUs (cpus: with 2, the ranks and gloo's loop threads share them,
// which weighs on small messages most).
//
// Usage: troupe_bench_allreduce [--peer PATH/torch_allreduce.py] [--python /usr/bin/python3]
//                               [--no-peer] [--rounds N] [--sizes B,B,...] [--check on|off|both]
//
// --check: troupe's groups with the agreement check (on, the default: each
// allreduce is preceded by a 24-byte allgather of what each rank asked
// for), without it (off), or both side by side (rows troupe_gloo and
// troupe_gloo_unchecked), which measures the check's cost.
//
// All sides stay up for the whole run, idle between trials, and take
// turns trial by trial (the order rotating every round), so that load from
// other processes on a shared machine falls on all alike. A trial is a few
// warm-up operations, a barrier, then `iters` back-to-back allreduces; its
// time per op is the max over the ranks. `value` is the best trial's bus
// bandwidth, 2(n-1)/n * bytes / time; `median_value` the median trial's.
// Each trial starts from a buffer of 2^-k (k = half its operations), so
// the in-place sums (×2 per op with 2 ranks) neither overflow nor go
// subnormal, and both sides check after it that every element is exactly
// the expected power of two (a trial that fails the check fails the run).
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/json_row.h"
#include "bench/peer_process.h"
#include "troupe/runtime/collective/file_kv_store.h"
#include "troupe/runtime/collective/gloo_group.h"

#ifndef TROUPE_BENCH_PEERS_DIR
#define TROUPE_BENCH_PEERS_DIR "bench/peers"
#endif

namespace {

using namespace std::chrono_literals;
using troupe::bench::PeerFailed;
using troupe::bench::PeerProcess;
using troupe::collective::DType;
using troupe::collective::FileKvStore;
using troupe::collective::GlooGroup;

constexpr int kWorld = 2;
constexpr auto kReplyTimeout = 120s;
// After EOF on their commands, ranks get this long to leave before their
// process group is killed.
constexpr auto kExitGrace = 10s;

// Back-to-back operations per trial: about 0.1-0.2 s each on a loaded
// 2-core machine, so a run of 15 rounds stays well inside two minutes.
int iterations_for(size_t bytes) {
  if (bytes <= (64u << 10)) return 200;
  if (bytes <= (1u << 20)) return 60;
  if (bytes <= (16u << 20)) return 8;
  return 3;
}
int warmups_for(size_t bytes) { return std::max(2, iterations_for(bytes) / 10); }

// A trial's starting value and, after `ops` in-place sums over kWorld = 2
// ranks, every element's exact value (powers of two: the sums are exact).
static_assert(kWorld == 2, "start_value/end_value assume each sum doubles");
float start_value(int ops) { return std::ldexp(1.0f, -((ops + 1) / 2)); }
float end_value(int ops) { return std::ldexp(1.0f, ops - (ops + 1) / 2); }

double bus_bandwidth_gbps(size_t bytes, double seconds) {
  return 2.0 * (kWorld - 1) / kWorld * static_cast<double>(bytes) / seconds / 1e9;
}

std::string trial_command(size_t bytes, int iters, int warmups) {
  return std::to_string(bytes) + " " + std::to_string(iters) + " " + std::to_string(warmups) + "\n";
}

// One troupe rank, a forked child: forms the group, then serves trial
// commands "<bytes> <iters> <warmups>" from stdin until EOF; rank 0 answers
// each with "<bytes> <seconds per op>" on stdout.
int serve_rank(int rank, const std::string& dir, bool check_agreement) {
  FileKvStore kv(dir);
  troupe::collective::GlooGroupOptions opts;
  opts.rendezvous_timeout = 60s;
  opts.check_agreement = check_agreement;
  auto group = GlooGroup::create(kv, "bench-allreduce", 1, rank, kWorld, opts);
  std::map<size_t, std::vector<float>> buffers;
  char line[128];
  while (std::fgets(line, sizeof line, stdin) != nullptr) {
    size_t bytes = 0;
    int iters = 0, warmups = 0;
    if (std::sscanf(line, "%zu %d %d", &bytes, &iters, &warmups) != 3) return 1;
    auto& data = buffers[bytes];
    data.assign(bytes / sizeof(float), start_value(warmups + iters));
    for (int i = 0; i < warmups; ++i) group->allreduce(data.data(), data.size(), DType::kFloat32)->wait();
    group->barrier()->wait();
    auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) group->allreduce(data.data(), data.size(), DType::kFloat32)->wait();
    std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    // Every element the expected sum, on every rank.
    const float want = end_value(warmups + iters);
    const bool good = std::all_of(data.begin(), data.end(), [want](float v) { return v == want; });
    // The slower rank bounds the collective; a wrong result on any rank fails the trial.
    double worst[2] = {elapsed.count() / iters, good ? 0.0 : 1.0};
    troupe::collective::AllreduceOptions max_opts;
    max_opts.op = troupe::collective::ReduceOp::kMax;
    group->allreduce(worst, 2, DType::kFloat64, max_opts)->wait();
    if (rank == 0) {
      std::printf("%zu %.9g %d\n", bytes, worst[0], worst[1] == 0.0 ? 1 : 0);
      std::fflush(stdout);
    }
  }
  return 0;
}

// A side of the comparison: processes that take trial commands and answer
// with seconds per op.
class Side {
 public:
  virtual ~Side() = default;
  // Seconds per op of one trial; PeerFailed when the side failed or did
  // not answer in time.
  virtual double trial(size_t bytes, int iters, int warmups) = 0;
};

// Each side ends its peers on destruction: EOF on their commands, a grace
// period, then their process groups are killed.
void finish(std::vector<std::unique_ptr<PeerProcess>>& peers) {
  for (auto& p : peers) p->close_stdin();
  for (auto& p : peers) {
    try {
      p->wait(kExitGrace);
    } catch (const PeerFailed& e) {
      std::fprintf(stderr, "%s\n", e.what());
    }
  }
}

class TroupeSide final : public Side {
 public:
  explicit TroupeSide(bool check_agreement) {
    char templ[] = "/tmp/troupe-bench-allreduce-XXXXXX";
    if (::mkdtemp(templ) == nullptr) throw std::runtime_error("mkdtemp failed");
    dir_ = templ;
    for (int r = 0; r < kWorld; ++r)
      ranks_.push_back(
          std::make_unique<PeerProcess>([r, this, check_agreement] { return serve_rank(r, dir_, check_agreement); },
                                        troupe::bench::PeerOptions{
                                            .stdin_pipe = true,
                                            .name = "troupe rank " + std::to_string(r),
                                        }));
  }

  ~TroupeSide() override {
    finish(ranks_);
    std::string rm = "rm -rf '" + dir_ + "'";
    if (std::system(rm.c_str()) != 0) std::fprintf(stderr, "could not remove %s\n", dir_.c_str());
  }

  double trial(size_t bytes, int iters, int warmups) override {
    const std::string cmd = trial_command(bytes, iters, warmups);
    for (auto& r : ranks_) {
      if (!r->write(cmd)) throw PeerFailed(r->name() + " is gone");
    }
    auto line = ranks_[0]->read_line(kReplyTimeout);
    size_t got = 0;
    double seconds = -1;
    int checked = 0;
    if (!line || std::sscanf(line->c_str(), "%zu %lf %d", &got, &seconds, &checked) != 3 || got != bytes)
      throw PeerFailed("troupe rank 0 answered '" + line.value_or("EOF") + "' to " + cmd);
    if (checked != 1) throw PeerFailed("troupe's allreduce of " + std::to_string(bytes) + " bytes: wrong result");
    return seconds;
  }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<PeerProcess>> ranks_;
};

// The torch peer in --serve mode: commands on its stdin, one JSON line per
// trial on its stdout.
class TorchSide final : public Side {
 public:
  TorchSide(const std::string& python, const std::string& peer) {
    peer_.push_back(std::make_unique<PeerProcess>(
        std::vector<std::string>{python, peer, "--serve", "--world", std::to_string(kWorld)},
        troupe::bench::PeerOptions{.stdin_pipe = true, .name = "torch peer"}));
  }

  ~TorchSide() override { finish(peer_); }

  double trial(size_t bytes, int iters, int warmups) override {
    const std::string cmd = trial_command(bytes, iters, warmups);
    if (!peer_[0]->write(cmd)) throw PeerFailed("torch peer is gone");
    // The first trial also waits for python to import torch and connect.
    auto line = peer_[0]->read_line(kReplyTimeout);
    if (!line) throw PeerFailed("torch peer ended before answering " + cmd);
    auto j = nlohmann::ordered_json::parse(*line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("bytes") || !j.contains("seconds_per_op") || j["bytes"].get<size_t>() != bytes)
      throw PeerFailed("torch peer answered '" + *line + "' to " + cmd);
    if (!j.value("checked", false))
      throw PeerFailed("torch's allreduce of " + std::to_string(bytes) + " bytes: wrong result (" + *line + ")");
    return j["seconds_per_op"].get<double>();
  }

 private:
  std::vector<std::unique_ptr<PeerProcess>> peer_;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

void print_result(const std::string& name, size_t bytes, const std::vector<double>& seconds,
                  const std::vector<double>* peer, int check_agreement) {
  const double best = *std::min_element(seconds.begin(), seconds.end());
  const double med = median(seconds);
  nlohmann::ordered_json row = {{"bench", "allreduce"},
                                {"case", name},
                                {"bytes", bytes},
                                {"value", bus_bandwidth_gbps(bytes, best)},
                                {"unit", "GB/s"}};
  if (peer != nullptr && !peer->empty()) {
    const double peer_best = *std::min_element(peer->begin(), peer->end());
    row["ratio"] = peer_best / best;
    row["median_ratio"] = median(*peer) / med;
    row["peer_value"] = bus_bandwidth_gbps(bytes, peer_best);
    row["peer_median_value"] = bus_bandwidth_gbps(bytes, median(*peer));
  }
  if (check_agreement >= 0) row["check_agreement"] = check_agreement == 1;
  row["median_value"] = bus_bandwidth_gbps(bytes, med);
  row["seconds_per_op"] = best;
  row["trials"] = seconds.size();
  row["checked"] = true;  // every trial's result, on both sides
  row["cpus"] = ::sysconf(_SC_NPROCESSORS_ONLN);
  troupe::bench::print_row(row);
}

}  // namespace

int main(int argc, char** argv) {
  std::string peer = std::string(TROUPE_BENCH_PEERS_DIR) + "/torch_allreduce.py";
  std::string python = "/usr/bin/python3";
  bool no_peer = false;
  int rounds = 15;
  std::vector<size_t> sizes = {1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20};
  CLI::App app{"allreduce bus bandwidth: troupe's Gloo group vs torch.distributed gloo, 2 ranks on loopback"};
  app.add_option("--peer", peer, "the torch peer script")->capture_default_str();
  app.add_option("--python", python, "interpreter for the peer")->capture_default_str();
  app.add_flag("--no-peer", no_peer, "measure troupe only");
  app.add_option("--rounds", rounds, "trials per size and side (the order rotating)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--sizes", sizes, "message sizes in bytes")->delimiter(',')->capture_default_str();
  std::string check = "on";
  app.add_option("--check", check, "troupe's agreement check: on, off, or both side by side")
      ->capture_default_str()
      ->check(CLI::IsMember({"on", "off", "both"}));
  CLI11_PARSE(app, argc, argv);

  // One entry per side: its case name, its processes, its trials' seconds.
  struct Entry {
    std::string name;
    std::unique_ptr<Side> side;
    int check_agreement = -1;  // troupe sides: 1 or 0
    std::vector<double> seconds;
  };
  std::string side = "troupe_gloo";
  size_t at_bytes = 0;
  try {
    std::vector<Entry> sides;
    if (check != "off") sides.push_back({"troupe_gloo", std::make_unique<TroupeSide>(true), 1, {}});
    if (check != "on")
      sides.push_back(
          {check == "off" ? "troupe_gloo" : "troupe_gloo_unchecked", std::make_unique<TroupeSide>(false), 0, {}});
    if (!no_peer) sides.push_back({"torch_gloo", std::make_unique<TorchSide>(python, peer), -1, {}});

    for (size_t bytes : sizes) {
      at_bytes = bytes;
      for (auto& e : sides) e.seconds.clear();
      const int iters = iterations_for(bytes);
      const int warmups = warmups_for(bytes);
      for (int round = 0; round < rounds; ++round) {
        // The order rotates: no side always runs right after another.
        for (size_t turn = 0; turn < sides.size(); ++turn) {
          auto& e = sides[(turn + round) % sides.size()];
          side = e.name;
          e.seconds.push_back(e.side->trial(bytes, iters, warmups));
        }
      }
      const std::vector<double>* torch = no_peer ? nullptr : &sides.back().seconds;
      if (torch) print_result("torch_gloo", bytes, *torch, nullptr, -1);
      for (auto& e : sides) {
        if (e.check_agreement >= 0) print_result(e.name, bytes, e.seconds, torch, e.check_agreement);
      }
    }
  } catch (const std::exception& e) {
    troupe::bench::print_row({{"bench", "allreduce"}, {"case", side}, {"bytes", at_bytes}, {"error", e.what()}});
    return 1;
  }
  return 0;
}
