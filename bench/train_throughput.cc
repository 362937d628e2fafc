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
//   troupe_bench_train_throughput [--hidden 1024] [--batch 64] [--workers 2]
//                                 [--steps 60] [--warmup 5] [--no-peer]
//                                 [--bucket-mb 25] [--compression none|bf16|fp16]
//                                 [--tcp]   (Gloo over TCP even on one host)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

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
  std::ostringstream cmd;
  // Same thread count as the trainers: torch.set_num_threads(1) in the
  // peer, and its pthreads OpenBLAS bounded as the trainers bound theirs.
  cmd << "OPENBLAS_NUM_THREADS=1 /usr/bin/python3 " << TROUPE_BENCH_PEERS_DIR << "/torch_ddp.py --hidden " << a.hidden
      << " --batch " << a.batch << " --workers " << a.workers << " --steps " << a.steps << " --warmup " << a.warmup;
  FILE* p = ::popen(cmd.str().c_str(), "r");
  if (!p) throw troupe::Error("cannot run " + cmd.str());
  std::string out;
  char buf[4096];
  while (size_t k = std::fread(buf, 1, sizeof buf, p)) out.append(buf, k);
  int rc = ::pclose(p);
  if (rc != 0) throw troupe::Error("peer failed (" + std::to_string(rc) + "): " + cmd.str());
  auto j = nlohmann::json::parse(out.substr(out.rfind('{')));
  return j.at("value").get<double>();
}

void row(const std::string& c, double value, const std::string& unit, const Args& a, bool ratio = false) {
  std::printf("{\"bench\":\"train_throughput\",\"case\":\"%s\",\"value\":%.4f,\"unit\":\"%s\"", c.c_str(), value,
              unit.c_str());
  if (ratio) std::printf(",\"ratio\":%.4f", value);
  std::printf(",\"hidden\":%lld,\"batch\":%lld,\"workers\":%lld,\"steps\":%lld}\n", static_cast<long long>(a.hidden),
              static_cast<long long>(a.batch), static_cast<long long>(a.workers), static_cast<long long>(a.steps));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  troupe::run_role_if_requested(argc, argv);
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string f = argv[i];
    auto next = [&] { return i + 1 < argc ? std::atoll(argv[++i]) : 0LL; };
    if (f == "--hidden")
      a.hidden = next();
    else if (f == "--batch")
      a.batch = next();
    else if (f == "--workers")
      a.workers = next();
    else if (f == "--steps")
      a.steps = next();
    else if (f == "--warmup")
      a.warmup = next();
    else if (f == "--bucket-mb")
      a.bucket_mb = next();
    else if (f == "--compression" && i + 1 < argc)
      a.compression = argv[++i];
    else if (f == "--no-peer")
      a.peer = false;
    else if (f == "--tcp")
      a.shared_memory = false;
    else {
      std::fprintf(stderr,
                   "usage: %s [--hidden H] [--batch B] [--workers N] [--steps S] [--warmup W] [--bucket-mb M] "
                   "[--compression none|bf16|fp16] [--tcp] [--no-peer]\n",
                   argv[0]);
      return 2;
    }
  }
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
      std::printf("{\"bench\":\"train_throughput\",\"case\":\"torch_ddp_%lld\",\"error\":\"%s\"}\n",
                  static_cast<long long>(a.workers), e.what());
    }
  }
  row("scaling", many / one, "x", a, true);
  rt.shutdown();
  return 0;
}
