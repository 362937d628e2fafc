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
//   ratio_vs_ddp  troupe_N / torch_ddp_N (> 1: troupe faster)
//   scaling       troupe_N / troupe_1
//   troupe_N_independent  N TrainerActors at once, each training alone
//                 (no group, nothing reduced)
//   scaling_ceiling  troupe_N_independent / troupe_1: what the machine
//                 gives N processes of this workload; scaling over it is
//                 what the gradient reduction leaves
// The MLP rows are the medians of --repeats runs of each, alternating
// (each row lists its runs; ratios are of the medians).
// and for a transformer language model (examples/train_lm/model.py's
// TinyGPT: byte tokens, context --lm-block, --lm-layers blocks of width
// --lm-width; its own cross-entropy loss; AdamW; a per-worker batch of
// --lm-batch sequences), scripted for troupe's trainers (TorchScript step
// module) and run eagerly by the peer, value in tokens/s, the median of
// --lm-repeats runs of each side, alternating (each row lists its runs):
//   troupe_lm_1, troupe_lm_N        1 and N TrainerActors
//   torch_ddp_lm_1, torch_ddp_lm_N  bench/peers/torch_ddp.py --model lm
//   lm_ratio_vs_ddp                 troupe_lm_N / torch_ddp_lm_N
//   lm_ratio_vs_ddp_1               troupe_lm_1 / torch_ddp_lm_1
// and the same with bf16 autocast on both sides (TrainerConfig's
// mixed_precision on the CPU; torch.autocast("cpu", bfloat16) in the peer),
// fp32 weights and optimizer: troupe_lm_bf16_1, troupe_lm_bf16_N,
// torch_ddp_lm_bf16_1, torch_ddp_lm_bf16_N, lm_ratio_vs_ddp_bf16 and
// lm_ratio_vs_ddp_bf16_1 (--no-lm-bf16 skips them). troupe's fp32 linear
// layers (MLP and LM) go through oneDNN by default (TrainerConfig::cpu_gemm;
// --cpu-gemm aten keeps them on torch's BLAS, OpenBLAS here, as the peer's
// always are): every row says which (cpu_gemm: troupe's rows and ratios;
// the peer's rows "aten"; peer_cpu_gemm on ratios), and the
// OPENBLAS_CORETYPE both sides ran under. The benchmark unsets
// OPENBLAS_CORETYPE before it starts anything (--keep-openblas-coretype
// keeps it): set, it forces OpenBLAS kernels that can be slower than the
// CPU's own, which slows the peer (OpenBLAS) and not troupe's oneDNN.
// samples/s counts all workers' samples over the slowest worker's time.
//
// A peer that fails or misses --peer-timeout is an error row for its case.
//
//   troupe_bench_train_throughput [--hidden 1024] [--batch 64] [--workers 2]
//                                 [--steps 300] [--warmup 5] [--no-peer]
//                                 [--bucket-mb 25] [--compression none|bf16|fp16]
//                                 [--tcp]   (Gloo over TCP even on one host)
//                                 [--worker-pool-size 2]   (0: trainers start cold, and no
//                                 warm worker is started again while they train)
//                                 [--peer-timeout 600]
//                                 [--lm-block 128] [--lm-width 128] [--lm-layers 4]
//                                 [--lm-heads 4] [--lm-batch 16] [--lm-steps 20] [--lm-repeats 3]
//                                 [--no-lm | --lm-only] [--no-lm-bf16]
//                                 [--cpu-gemm auto|onednn|aten] [--repeats 3]
//                                 [--keep-openblas-coretype]
#include <CLI/CLI.hpp>

#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/json_row.h"
#include "bench/peer_process.h"
#include "troupe/runtime/core/files.h"
#include "troupe/runtime/testing/local_cluster.h"
#include "troupe/trainer/cpu_gemm.h"
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
  int64_t steps = 300;
  int64_t warmup = 5;
  int64_t repeats = 3;  // MLP: alternating runs of each row (medians)
  int64_t bucket_mb = 25;
  std::string compression = "none";
  bool shared_memory = true;
  std::string cpu_gemm = "auto";
  bool peer = true;
  double peer_timeout_s = 600;
  // The language-model cases.
  bool mlp = true;
  bool lm = true;
  int64_t lm_block = 128;
  int64_t lm_width = 128;
  int64_t lm_layers = 4;
  int64_t lm_heads = 4;
  int64_t lm_batch = 16;
  int64_t lm_steps = 20;
  int64_t lm_repeats = 3;
  bool lm_bf16 = true;
};

troupe::trainer::TrainerConfig mlp_config(const Args& a) {
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
  c.cpu_gemm = a.cpu_gemm;
  c.threads = 1;
  c.seed = 0;
  // The benchmark trains on one batch of its samples, again and again.
  c.data = troupe::actors::DatasetSpec("synthetic_classification")
               .set("size", 64)
               .set("num_features", 784)
               .set("num_classes", 10);
  return c;
}

// The TorchScript TinyGPT and a random token stream of its context
// (bench/peers/lm_files.py writes them into dir).
troupe::trainer::TrainerConfig lm_config(const Args& a, const std::string& dir, double peer_timeout_s) {
  auto files = troupe::bench::run_peer_json(
      {"/usr/bin/python3", std::string(TROUPE_BENCH_PEERS_DIR) + "/lm_files.py", dir, "--block",
       std::to_string(a.lm_block), "--width", std::to_string(a.lm_width), "--layers", std::to_string(a.lm_layers),
       "--heads", std::to_string(a.lm_heads), "--windows", std::to_string(std::max<int64_t>(64, 4 * a.lm_batch))},
      {.env = {"OPENBLAS_NUM_THREADS=1"}, .name = "lm_files.py"},
      std::chrono::milliseconds(static_cast<int64_t>(peer_timeout_s * 1000)));
  troupe::trainer::TrainerConfig c;
  c.model.name = "torchscript";
  c.model.path = files.at("step").get<std::string>();
  c.optimizer.name = "adamw";
  c.optimizer.lr = 1e-3;
  c.batch_size = a.lm_batch;
  c.bucket_mb = a.bucket_mb;
  c.compression = a.compression;
  c.shared_memory = a.shared_memory;
  c.cpu_gemm = a.cpu_gemm;
  c.threads = 1;
  c.seed = 0;
  c.data = troupe::actors::DatasetSpec("token_stream")
               .set("path", files.at("tokens").get<std::string>())
               .set("block_size", a.lm_block);
  return c;
}

// Samples/s of n TrainerActors running config c's benchmark(): one
// data-parallel group, or with `independent` n trainers of their own that
// train side by side and reduce nothing.
double troupe_rate(troupe::Runtime& rt, const troupe::trainer::TrainerConfig& c, int64_t n, int64_t batch,
                   int64_t steps, int64_t warmup, bool independent = false) {
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
  for (int64_t r = 0; r < n && !independent; ++r)
    joins.push_back(ts[r].call(&TrainerActor::join, troupe::trainer::JoinSpec{name, 1, r, n, members}));
  for (auto& j : joins) j.get(120s);
  std::vector<troupe::Future<troupe::trainer::BenchReport>> fs;
  for (auto& t : ts) fs.push_back(t.call(&TrainerActor::benchmark, steps, batch, warmup));
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
       "--warmup", std::to_string(a.warmup), "--bucket-mb", std::to_string(a.bucket_mb), "--compression",
       a.compression},
      {.env = {"OPENBLAS_NUM_THREADS=1"}, .name = "torch_ddp.py"},
      std::chrono::milliseconds(static_cast<int64_t>(a.peer_timeout_s * 1000)));
  return row.at("value").get<double>();
}

// Tokens/s of the language model under DDP with `workers` processes
// (forward under bf16 autocast with `bf16`).
double ddp_lm_rate(const Args& a, int64_t workers, bool bf16) {
  std::vector<std::string> args = {"/usr/bin/python3", std::string(TROUPE_BENCH_PEERS_DIR) + "/torch_ddp.py",
                                   "--model",          "lm",
                                   "--block",          std::to_string(a.lm_block),
                                   "--width",          std::to_string(a.lm_width),
                                   "--layers",         std::to_string(a.lm_layers),
                                   "--heads",          std::to_string(a.lm_heads),
                                   "--batch",          std::to_string(a.lm_batch),
                                   "--workers",        std::to_string(workers),
                                   "--steps",          std::to_string(a.lm_steps),
                                   "--warmup",         std::to_string(a.warmup),
                                   "--bucket-mb",      std::to_string(a.bucket_mb),
                                   "--compression",    a.compression};
  args.insert(args.end(), {"--amp", bf16 ? "bf16" : "none"});
  auto row = troupe::bench::run_peer_json(args, {.env = {"OPENBLAS_NUM_THREADS=1"}, .name = "torch_ddp.py --model lm"},
                                          std::chrono::milliseconds(static_cast<int64_t>(a.peer_timeout_s * 1000)));
  return row.at("tokens_per_s").get<double>();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// Who computes a side's fp32 linear layers: troupe's per --cpu-gemm (the
// workers run this binary's LibTorch); the peer's are always torch's own
// (ATen → its BLAS, OpenBLAS here).
std::string troupe_gemm(const Args& a) {
  return a.cpu_gemm != "aten" && troupe::trainer::onednn_available() ? "onednn" : "aten";
}

enum class Side { kTroupe, kPeer, kRatio };

void gemm_fields(nlohmann::ordered_json& j, const Args& a, Side side) {
  j["cpu_gemm"] = side == Side::kPeer ? "aten" : troupe_gemm(a);
  if (side == Side::kRatio) j["peer_cpu_gemm"] = "aten";
  // The OpenBLAS kernels both sides' torch was told to use (the
  // environment both inherit; empty: OpenBLAS's own choice).
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  j["openblas_coretype"] = coretype ? coretype : "";
}

void lm_row(const std::string& c, double value, const std::string& unit, const Args& a, int64_t workers, bool bf16,
            Side side, bool ratio = false, const std::vector<double>& runs = {}) {
  nlohmann::ordered_json j = {{"bench", "train_throughput"}, {"case", c}, {"value", value}, {"unit", unit}};
  if (ratio) j["ratio"] = value;
  if (!runs.empty()) j["runs"] = runs;
  j["model"] = "tiny_gpt";
  j["block"] = a.lm_block;
  j["width"] = a.lm_width;
  j["layers"] = a.lm_layers;
  j["batch"] = a.lm_batch;
  j["workers"] = workers;
  j["steps"] = a.lm_steps;
  j["amp"] = bf16 ? "bf16" : "none";
  // Both sides run with these (the peer's DDP bucket_cap_mb and its
  // compression hook): they changed troupe's side alone before.
  j["bucket_mb"] = a.bucket_mb;
  j["compression"] = a.compression;
  gemm_fields(j, a, side);
  troupe::bench::print_row(j);
}

void lm_cases(troupe::Runtime& rt, const Args& a) {
  const std::string dir = std::filesystem::temp_directory_path() / ("troupe-bench-lm-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  try {
    const auto fp32 = lm_config(a, dir, a.peer_timeout_s);
    const double tokens = static_cast<double>(a.lm_block);
    for (bool bf16 : {false, true}) {
      if (bf16 && !a.lm_bf16) break;
      auto c = fp32;
      c.mixed_precision = bf16;
      c.amp_dtype = "bf16";
      const std::string amp = bf16 ? "bf16_" : "";
      // Each world size: troupe and the peer alternately, --lm-repeats
      // times, medians reported (this machine's speed drifts between runs).
      for (int64_t w : {int64_t{1}, a.workers}) {
        std::vector<double> ours, theirs;
        std::string peer_error;
        for (int64_t r = 0; r < a.lm_repeats; ++r) {
          ours.push_back(tokens * troupe_rate(rt, c, w, a.lm_batch, a.lm_steps, a.warmup));
          if (!a.peer || !peer_error.empty()) continue;
          try {
            theirs.push_back(ddp_lm_rate(a, w, bf16));
          } catch (const std::exception& e) {
            peer_error = e.what();
          }
        }
        const std::string n = std::to_string(w);
        lm_row("troupe_lm_" + amp + n, median(ours), "tokens/s", a, w, bf16, Side::kTroupe, false, ours);
        if (!peer_error.empty()) {
          troupe::bench::print_error_row("train_throughput", "torch_ddp_lm_" + amp + n, peer_error);
        } else if (a.peer) {
          lm_row("torch_ddp_lm_" + amp + n, median(theirs), "tokens/s", a, w, bf16, Side::kPeer, false, theirs);
          const std::string ratio = "lm_ratio_vs_ddp" + (bf16 ? std::string("_bf16") : std::string());
          lm_row(w == 1 ? ratio + "_1" : ratio, median(ours) / median(theirs), "x", a, w, bf16, Side::kRatio, true);
        }
        if (a.workers == 1) break;
      }
    }
  } catch (const std::exception& e) {
    troupe::bench::print_error_row("train_throughput", "troupe_lm", e.what());
  }
  troupe::core::remove_tree(dir);
}

void row(const std::string& c, double value, const std::string& unit, const Args& a, Side side, bool ratio = false,
         const std::vector<double>& runs = {}) {
  nlohmann::ordered_json j = {{"bench", "train_throughput"}, {"case", c}, {"value", value}, {"unit", unit}};
  if (ratio) j["ratio"] = value;
  if (!runs.empty()) j["runs"] = runs;
  j["hidden"] = a.hidden;
  j["batch"] = a.batch;
  j["workers"] = a.workers;
  j["steps"] = a.steps;
  j["bucket_mb"] = a.bucket_mb;
  j["compression"] = a.compression;
  gemm_fields(j, a, side);
  troupe::bench::print_row(j);
}

}  // namespace

int main(int argc, char** argv) {
  troupe::run_role_if_requested(argc, argv);
  Args a;
  bool tcp = false;
  uint32_t pool_size = 2;
  CLI::App app{"data-parallel training throughput: troupe's TrainerActors vs PyTorch DDP (gloo)"};
  app.add_option("--hidden", a.hidden, "MLP hidden width")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--batch", a.batch, "per-worker batch")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--workers", a.workers, "workers of the N case")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--steps", a.steps, "timed steps")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--warmup", a.warmup, "untimed steps first")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--repeats", a.repeats, "MLP: alternating runs of each row (median)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  bool keep_coretype = false;
  app.add_flag("--keep-openblas-coretype", keep_coretype,
               "keep OPENBLAS_CORETYPE from the environment (it slows the peer's OpenBLAS, not troupe's oneDNN)");
  app.add_option("--bucket-mb", a.bucket_mb, "gradient bucket size")->capture_default_str();
  app.add_option("--cpu-gemm", a.cpu_gemm,
                 "troupe's fp32 linear layers (MLP and LM) by auto (oneDNN where found), onednn or aten (torch's "
                 "BLAS, as the peer)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "onednn", "aten"}));
  app.add_option("--compression", a.compression, "gradient compression")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "bf16", "fp16"}));
  app.add_flag("--tcp", tcp, "Gloo over loopback TCP even on one host");
  app.add_option("--worker-pool-size", pool_size, "warm workers the node agent keeps (0 = none)")
      ->capture_default_str()
      ->check(CLI::Range(0, 64));
  app.add_flag(
      "--no-peer", [&](int64_t) { a.peer = false; }, "skip the PyTorch DDP peer");
  app.add_option("--peer-timeout", a.peer_timeout_s, "seconds the DDP peer gets, start to result")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--lm-block", a.lm_block, "language model: context (tokens per sequence)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--lm-width", a.lm_width, "language model: width")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--lm-layers", a.lm_layers, "language model: transformer blocks")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--lm-heads", a.lm_heads, "language model: attention heads")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--lm-batch", a.lm_batch, "language model: sequences per worker per step")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--lm-steps", a.lm_steps, "language model: timed steps")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--lm-repeats", a.lm_repeats, "language model: alternating troupe/peer runs per world size (median)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  auto* no_lm = app.add_flag(
      "--no-lm", [&](int64_t) { a.lm = false; }, "skip the language-model cases");
  app.add_flag(
         "--lm-only", [&](int64_t) { a.mlp = false; }, "only the language-model cases")
      ->excludes(no_lm);
  app.add_flag(
      "--no-lm-bf16", [&](int64_t) { a.lm_bf16 = false; }, "skip the language-model cases under bf16 autocast");
  CLI11_PARSE(app, argc, argv);
  // Both sides under the same BLAS environment: the trainers and the peers
  // are started from here and inherit it.
  if (const char* coretype = std::getenv("OPENBLAS_CORETYPE"); coretype && !keep_coretype) {
    std::fprintf(stderr,
                 "train_throughput: unsetting OPENBLAS_CORETYPE=%s for both sides (OpenBLAS picks its own kernels; "
                 "--keep-openblas-coretype keeps it)\n",
                 coretype);
    ::unsetenv("OPENBLAS_CORETYPE");
  }
  a.shared_memory = !tcp;
  troupe::testing::LocalClusterOptions lo;
  lo.nodes = {{{"CPU", static_cast<double>(a.workers)}}};
  lo.worker_pool_size = pool_size;
  troupe::testing::LocalCluster cluster(lo);
  auto rt = cluster.connect();
  if (a.mlp) {
    const auto c = mlp_config(a);
    // Each row --repeats times, the rows alternating (this machine's speed
    // drifts between runs), medians reported with their runs.
    std::vector<double> ones, manys, ddps, alones;
    std::string peer_error;
    for (int64_t r = 0; r < a.repeats; ++r) {
      ones.push_back(troupe_rate(rt, c, 1, a.batch, a.steps, a.warmup));
      manys.push_back(troupe_rate(rt, c, a.workers, a.batch, a.steps, a.warmup));
      if (a.peer && peer_error.empty()) {
        try {
          ddps.push_back(ddp_rate(a));
        } catch (const std::exception& e) {
          peer_error = e.what();
        }
      }
      // The same N trainers side by side, each alone (nothing reduced):
      // what this machine gives N processes of this workload, the bound
      // `scaling` is read against.
      alones.push_back(troupe_rate(rt, c, a.workers, a.batch, a.steps, a.warmup, true));
    }
    const double one = median(ones), many = median(manys), alone = median(alones);
    row("troupe_1", one, "samples/s", a, Side::kTroupe, false, ones);
    row("troupe_" + std::to_string(a.workers), many, "samples/s", a, Side::kTroupe, false, manys);
    if (!peer_error.empty()) {
      troupe::bench::print_error_row("train_throughput", "torch_ddp_" + std::to_string(a.workers), peer_error);
    } else if (a.peer) {
      const double ddp = median(ddps);
      row("torch_ddp_" + std::to_string(a.workers), ddp, "samples/s", a, Side::kPeer, false, ddps);
      row("ratio_vs_ddp", many / ddp, "x", a, Side::kRatio, true);
    }
    row("scaling", many / one, "x", a, Side::kTroupe, true);
    row("troupe_" + std::to_string(a.workers) + "_independent", alone, "samples/s", a, Side::kTroupe, false, alones);
    row("scaling_ceiling", alone / one, "x", a, Side::kTroupe, true);
  }
  if (a.lm) lm_cases(rt, a);
  rt.shutdown();
  return 0;
}
