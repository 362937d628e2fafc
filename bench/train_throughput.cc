// Benchmark: data-parallel training throughput against PyTorch DDP.
//
// Workload (both sides): MLP 784→H→H→10 (ReLU), cross-entropy, SGD with
// momentum 0.9, per-worker batch B of random in-memory data (no loading),
// one torch thread per worker. Cases, one JSON object per line:
//   troupe_1      one TrainerActor (samples/s)
//   troupe_N      N TrainerActors, gradients reduced by GradientReducer
//                 (25 MiB buckets, launched as they fill during backward);
//                 ranks on one host reduce through shared memory (ShmGroup),
//                 --tcp forces Gloo over loopback TCP
//   torch_ddp_N   bench/peers/torch_ddp.py: N processes, DDP, gloo backend,
//                 run in the same invocation
//   ratio_vs_ddp  troupe_N / torch_ddp_N
//   scaling       troupe_N / troupe_1
// samples/s counts all workers' samples over the slowest worker's time.
//
// A peer that fails or misses --peer-timeout is an error row for its case.
//
//   troupe_bench_train_throughput [--hidden 1024] [--batch 64] [--workers 2]
//                                 [--steps 60] [--warmup 5] [--no-peer]
//                                 [--bucket-mb 25] [--compression none|bf16|fp16]
//                                 [--tcp]   (Gloo over TCP even on one host)
//                                 [--peer-timeout 600]
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/json_row.h"
#include "bench/peer_process.h"
#include "troupe/runtime/testing/local_cluster.h"
#include "troupe/trainer/trainer_actor.h"

#ifndef TROUPE_BENCH_PEERS_DIR
#define TROUPE_BENCH_PEERS_DIR "bench/peers"
#endif

using namespace std::chrono_literals;
using troupe::trainer::TrainerActor;

namespace {

struct Args {
  int64_t hidden = 1024;
  int64_t batch = 64;
  int64_t workers = 2;
  int64_t steps = 60;
  int64_t warmup = 5;
  int64_t bucket_mb = 25;
  std::string compression = "none";
  bool shared_memory = true;
  bool peer = true;
  double peer_timeout_s = 600;
};

double troupe_rate(troupe::Runtime& rt, const Args& a, int64_t n) {
  troupe::trainer::TrainerConfig c;
  c.model.name = "mlp";
  c.model.input_dim = 784;
  c.model.hidden = a.hidden;
  c.model.num_classes = 10;
  c.optimizer.name = "sgd";
  c.optimizer.lr = 0.01;
  c.optimizer.momentum = 0.9;
  c.batch_size = a.batch;
  c.bucket_mb = a.bucket_mb;
  c.compression = a.compression;
  c.shared_memory = a.shared_memory;
  c.threads = 1;
  c.seed = 0;
  // Only its sample shape is used.
  c.data = troupe::actors::DatasetSpec("synthetic_classification")
               .set("size", 64)
               .set("num_features", 784)
               .set("num_classes", 10);
  auto pg =
      rt.create_placement_group(std::vector<troupe::Resources>(n, {{"CPU", 1}}), troupe::PlacementStrategy::kPack);
  if (!pg.wait(30s)) throw troupe::Error("placement group pending: " + pg.info().pending_reason);
  std::vector<troupe::ActorHandle<TrainerActor>> ts;
  for (int64_t r = 0; r < n; ++r)
    ts.push_back(rt.spawn<TrainerActor>(
        {.resources = {{"CPU", 1}}, .placement_group = &pg, .bundle_index = static_cast<int>(r)}));
  std::vector<uint64_t> members;
  for (auto& t : ts) members.push_back(t.id());
  for (auto& t : ts) t.call(&TrainerActor::setup, c).get(120s);
  std::vector<troupe::Future<void>> joins;
  std::string name = "bench-" + std::to_string(n) + "-" + std::to_string(pg.id());
  for (int64_t r = 0; r < n; ++r)
    joins.push_back(ts[r].call(&TrainerActor::join, troupe::trainer::JoinSpec{name, 1, r, n, members}));
  for (auto& j : joins) j.get(120s);
  std::vector<troupe::Future<troupe::trainer::BenchReport>> fs;
  for (auto& t : ts) fs.push_back(t.call(&TrainerActor::benchmark, a.steps, a.batch, a.warmup));
  double seconds = 0;
  int64_t samples = 0;
  for (auto& f : fs) {
    auto r = f.get(600s);
    seconds = std::max(seconds, r.seconds);
    samples += r.samples;
  }
  for (auto& t : ts) rt.kill(t);
  rt.remove_placement_group(pg);
  return samples / seconds;
}

double ddp_rate(const Args& a) {
  // Same thread count as the trainers: torch.set_num_threads(1) in the
  // peer, and its pthreads OpenBLAS bounded as the trainers bound theirs.
  auto row = troupe::bench::run_peer_json(
      {"/usr/bin/python3", std::string(TROUPE_BENCH_PEERS_DIR) + "/torch_ddp.py", "--hidden", std::to_string(a.hidden),
       "--batch", std::to_string(a.batch), "--workers", std::to_string(a.workers), "--steps", std::to_string(a.steps),
       "--warmup", std::to_string(a.warmup)},
      {.env = {"OPENBLAS_NUM_THREADS=1"}, .name = "torch_ddp.py"},
      std::chrono::milliseconds(static_cast<int64_t>(a.peer_timeout_s * 1000)));
  return row.at("value").get<double>();
}

void row(const std::string& c, double value, const std::string& unit, const Args& a, bool ratio = false) {
  nlohmann::ordered_json j = {{"bench", "train_throughput"}, {"case", c}, {"value", value}, {"unit", unit}};
  if (ratio) j["ratio"] = value;
  j["hidden"] = a.hidden;
  j["batch"] = a.batch;
  j["workers"] = a.workers;
  j["steps"] = a.steps;
  troupe::bench::print_row(j);
}

}  // namespace

int main(int argc, char** argv) {
  troupe::run_role_if_requested(argc, argv);
  Args a;
  bool tcp = false;
  CLI::App app{"data-parallel training throughput: troupe's TrainerActors vs PyTorch DDP (gloo)"};
  app.add_option("--hidden", a.hidden, "MLP hidden width")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--batch", a.batch, "per-worker batch")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--workers", a.workers, "workers of the N case")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--steps", a.steps, "timed steps")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--warmup", a.warmup, "untimed steps first")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--bucket-mb", a.bucket_mb, "gradient bucket size")->capture_default_str();
  app.add_option("--compression", a.compression, "gradient compression")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "bf16", "fp16"}));
  app.add_flag("--tcp", tcp, "Gloo over loopback TCP even on one host");
  app.add_flag(
      "--no-peer", [&](int64_t) { a.peer = false; }, "skip the PyTorch DDP peer");
  app.add_option("--peer-timeout", a.peer_timeout_s, "seconds the DDP peer gets, start to result")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  a.shared_memory = !tcp;
  troupe::testing::LocalClusterOptions lo;
  lo.nodes = {{{"CPU", static_cast<double>(a.workers)}}};
  troupe::testing::LocalCluster cluster(lo);
  auto rt = cluster.connect();
  double one = troupe_rate(rt, a, 1);
  row("troupe_1", one, "samples/s", a);
  double many = troupe_rate(rt, a, a.workers);
  row("troupe_" + std::to_string(a.workers), many, "samples/s", a);
  if (a.peer) {
    try {
      double ddp = ddp_rate(a);
      row("torch_ddp_" + std::to_string(a.workers), ddp, "samples/s", a);
      row("ratio_vs_ddp", many / ddp, "x", a, true);
    } catch (const std::exception& e) {
      troupe::bench::print_error_row("train_throughput", "torch_ddp_" + std::to_string(a.workers), e.what());
    }
  }
  row("scaling", many / one, "x", a, true);
  rt.shutdown();
  return 0;
}
