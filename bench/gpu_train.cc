// Benchmark: training on one GPU, troupe against PyTorch 2.x eager on the
// same GPU in the same run (issue 17). Both sides train the same scripted
// modules (bench/peers/torch_gpu.py writes them; the peer runs their eager
// originals) with bf16 autocast and read every step's loss. Cases, one JSON
// object per line, each with the GPU's name:
//   cnn_compute_bound  ResNet-18 on one in-memory batch of 3×224×224
//                      (TrainerActor::benchmark in a worker holding {GPU: 1});
//                      images/s, ratio = troupe ÷ PyTorch; gpu_busy and
//                      torch_gpu_busy, each side's NVML utilization (the
//                      ceiling of cnn_resnet18_fed's)
//   cnn_loader_bound   a model the peer's DataLoader cannot keep busy, fed
//                      by a DataLoaderActor: the widest ResNet18Step of
//                      --loader-widths (channel widths; 64 is ResNet-18)
//                      that the peer's GPU trains at least --loader-margin
//                      times as fast as the peer's DataLoader feeds it,
//                      both measured first in this run (torch_gpu.py
//                      calibrate; --loader-width W skips the choice); the
//                      row names the width, torch_feed, torch_compute and
//                      loader_bound (whether any width was light enough).
//                      The data: uint8
//                      3×256×256 records, random crop 224 and flip in its
//                      TBB pipeline (--loader-threads), normalised on the
//                      trainer's GPU (defer_normalize; --normalize-in-loader
//                      normalises in the pipeline instead), against
//                      DataLoader(num_workers=--loader-threads,
//                      pin_memory=True) shipping the same format (uint8
//                      normalised on the GPU, or float32 from the workers
//                      with --normalize-in-loader) and reading the loss
//                      back as often as troupe (once per train() call,
//                      --steps/6 steps); images/s over the steps after
//                      --warmup, ratio = troupe ÷ PyTorch; data_wait = the
//                      share of the trainer's timed train() calls spent
//                      waiting for batches (StepInfo::data_wait);
//                      without_look_ahead and its data_wait: the same run
//                      with --look-ahead 0
//   gpu_busy           NVML utilization.gpu of the GPU, read every 100 ms
//                      over troupe's timed loader-bound steps (0-1), the
//                      peer's own reading beside it (the same reads, by
//                      pynvml; null without NVML, as in a CPU dry run);
//                      by_rate and torch_by_rate, each side's loader-bound
//                      rate over its compute-bound rate of the same model,
//                      timed as cnn_compute_bound is (the share of the
//                      GPU's full rate that the feeding kept)
//   cnn_resnet18_fed   ResNet-18 fed by the same loaders (what
//                      cnn_loader_bound measured until late on 2026-12-04, when
//                      its rows had no width: on an H200 both sides'
//                      loaders out-feed ResNet-18, so it is compute-bound);
//                      with both sides' gpu_busy
//   loader_feed        cnn_loader_bound's loader and data, training a probe
//                      (bench/peers/torch_gpu.py's PoolStep: channel means
//                      through one linear layer) on both sides: how fast
//                      batches reach the GPU when the model costs nothing,
//                      so a loader-bound miss says whether feeding or
//                      overlap is short; data_wait as above
//   lm_tokens          examples/train_lm's TinyGPT (--block, --width,
//                      --layers, --heads), AdamW, one in-memory batch;
//                      tokens/s, ratio = troupe ÷ PyTorch
// A side that fails is an error row for its case.
//
//   troupe_bench_gpu_train [--python /opt/torch/.venv/bin/python]
//                          [--batch 128] [--steps 150] [--lm-steps 100] [--warmup 5]
//                          [--loader-threads 8] [--records 2048] [--look-ahead 2]
//                          [--loader-width W | --loader-widths 64,56,...]
//                          [--loader-margin 1.5] [--width-steps 20]
//                          [--lm-batch 16] [--block 256] [--width 512]
//                          [--layers 8] [--heads 8] [--case NAME]...
#include <CLI/CLI.hpp>

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/json_row.h"
#include "bench/peer_process.h"
#include "troupe/runtime/core/files.h"
#include "troupe/runtime/testing/local_cluster.h"
#include "troupe/trainer/train_job.h"
#include "troupe/trainer/trainer_actor.h"

#ifndef TROUPE_BENCH_PEERS_DIR
#define TROUPE_BENCH_PEERS_DIR "bench/peers"
#endif

using namespace std::chrono_literals;
using troupe::trainer::TrainerActor;
using troupe::trainer::TrainerConfig;

namespace {

struct Args {
  std::string python = "/opt/torch/.venv/bin/python";
  int64_t batch = 128;
  int64_t steps = 150;
  int64_t lm_steps = 100;
  int64_t warmup = 5;
  int64_t loader_threads = 8;
  int64_t look_ahead = 2;
  int64_t records = 2048;
  int64_t lm_batch = 16;
  int64_t block = 256;
  int64_t width = 512;
  int64_t layers = 8;
  int64_t heads = 8;
  // cnn_loader_bound's model: a fixed width, or the choice among widths.
  int64_t loader_width = 0;
  std::string loader_widths = "64,56,48,40,32,24,16,8";
  double loader_margin = 1.5;
  int64_t width_steps = 20;
  double peer_timeout_s = 300;
  // "cpu": both sides on the CPU in fp32 (a dry run of the whole benchmark
  // on a machine without a GPU; its figures say nothing about GPUs).
  std::string device = "cuda";
  bool normalize_in_loader = false;
  std::vector<std::string> cases;
  bool gpu() const { return device == "cuda"; }
  troupe::Resources trainer_resources() const {
    return gpu() ? troupe::Resources{{"GPU", 1}, {"CPU", 1}} : troupe::Resources{{"CPU", 1}};
  }
  bool want(const std::string& c) const {
    return cases.empty() || std::find(cases.begin(), cases.end(), c) != cases.end();
  }
};

std::string gpu_name() {
  try {
    troupe::bench::PeerProcess p({"nvidia-smi", "--query-gpu=name", "--format=csv,noheader"}, {.name = "nvidia-smi"});
    auto line = p.read_line(20s);
    return line ? *line : "unknown";
  } catch (const std::exception&) {
    return "unknown";
  }
}

// NVML's utilization.gpu of GPU 0, read every 100 ms on a thread from
// start() until fraction(): the same reads as the peer's pynvml sampler, so
// both sides' gpu_busy come from one method. NVML is dlopen()ed, so the
// benchmark builds and dry-runs where there is none.
class GpuBusy {
 public:
  void start() {
    lib_ = ::dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!lib_) throw troupe::Error(std::string("dlopen libnvidia-ml.so.1: ") + ::dlerror());
    auto init = reinterpret_cast<int (*)()>(::dlsym(lib_, "nvmlInit_v2"));
    auto handle = reinterpret_cast<int (*)(unsigned, void**)>(::dlsym(lib_, "nvmlDeviceGetHandleByIndex_v2"));
    read_ = reinterpret_cast<int (*)(void*, Utilization*)>(::dlsym(lib_, "nvmlDeviceGetUtilizationRates"));
    if (!init || !handle || !read_) throw troupe::Error("libnvidia-ml.so.1 lacks the NVML functions");
    if (int rc = init(); rc != 0) throw troupe::Error("nvmlInit_v2 returned " + std::to_string(rc));
    if (int rc = handle(0, &device_); rc != 0)
      throw troupe::Error("nvmlDeviceGetHandleByIndex_v2(0) returned " + std::to_string(rc));
    reader_ = std::thread([this] {
      std::unique_lock<std::mutex> l(mu_);
      while (!cv_.wait_for(l, 100ms, [this] { return stop_; })) {
        Utilization u{};
        if (read_(device_, &u) == 0) samples_.push_back(u.gpu);
      }
    });
  }
  // Mean of the samples as a fraction (-1 without any).
  double fraction() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (reader_.joinable()) reader_.join();
    std::lock_guard<std::mutex> l(mu_);
    if (samples_.empty()) return -1;
    double s = 0;
    for (double v : samples_) s += v;
    return s / static_cast<double>(samples_.size()) / 100.0;
  }
  ~GpuBusy() { fraction(); }

 private:
  struct Utilization {  // nvmlUtilization_t
    unsigned gpu;
    unsigned memory;
  };
  void* lib_ = nullptr;  // left loaded: NVML is process-wide
  void* device_ = nullptr;
  int (*read_)(void*, Utilization*) = nullptr;
  std::thread reader_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::vector<double> samples_;
};

nlohmann::ordered_json peer(const Args& a, std::vector<std::string> args) {
  std::vector<std::string> argv = {a.python, std::string(TROUPE_BENCH_PEERS_DIR) + "/torch_gpu.py"};
  argv.insert(argv.end(), args.begin(), args.end());
  if (args[0] == "run" || args[0] == "calibrate") argv.insert(argv.end(), {"--device", a.device});
  return troupe::bench::run_peer_json(argv, {.name = "torch_gpu.py " + args[0]},
                                      std::chrono::milliseconds(static_cast<int64_t>(a.peer_timeout_s * 1000)));
}

std::vector<std::string> model_args(const Args& a) {
  return {"--block",  std::to_string(a.block),  "--width", std::to_string(a.width),
          "--layers", std::to_string(a.layers), "--heads", std::to_string(a.heads)};
}

// bf16 autocast on the GPU; fp32 on the CPU dry run.
void set_precision(TrainerConfig& c, const Args& a) {
  c.device = a.gpu() ? "auto" : "cpu";
  c.mixed_precision = a.gpu();
  c.amp_dtype = "bf16";
}

TrainerConfig cnn_config(const Args& a, const std::string& step, int64_t size, int64_t batch) {
  TrainerConfig c;
  set_precision(c, a);
  c.model.name = "torchscript";
  c.model.path = step;
  c.optimizer.name = "sgd";
  c.optimizer.lr = 0.1;
  c.optimizer.momentum = 0.9;
  c.batch_size = batch;
  c.threads = 4;
  c.data = troupe::actors::DatasetSpec("image_records")
               .set("size", size)
               .set("channels", 3)
               .set("height", 256)
               .set("width", 256)
               .set("num_classes", 1000)
               .set("crop", 224)
               .set("flip", 1)
               .set("mean", {0.485, 0.456, 0.406})
               .set("std", {0.229, 0.224, 0.225});
  return c;
}

struct Rate {
  double per_s;  // samples/s
  double busy;   // NVML utilization over the timed benchmark() call (-1 without samples)
};

// Samples/s of one TrainerActor holding the GPU, running c's benchmark().
Rate troupe_rate(troupe::Runtime& rt, const TrainerConfig& c, const Args& a, int64_t batch) {
  auto t = rt.spawn<TrainerActor>({.resources = a.trainer_resources()});
  // Killed however this ends: a failed case must not keep the GPU from the
  // next one.
  struct Kill {
    troupe::Runtime& rt;
    troupe::ActorHandle<TrainerActor>& t;
    ~Kill() {
      try {
        rt.kill(t);
      } catch (const std::exception&) {
      }
    }
  } kill{rt, t};
  auto info = t.call(&TrainerActor::setup, c).get(300s);
  if (a.gpu() && info.device.rfind("cuda", 0) != 0)
    throw troupe::Error("the trainer runs on " + info.device + ", not a GPU");
  t.call(&TrainerActor::join, troupe::trainer::JoinSpec{"gpu-bench-" + std::to_string(t.id()), 1, 0, 1, {t.id()}})
      .get(300s);
  // The warm-up in a call of its own, so that the GPU's use is sampled over
  // the timed steps only.
  if (a.warmup > 0) t.call(&TrainerActor::benchmark, a.warmup, batch, int64_t{0}).get(600s);
  GpuBusy busy;
  if (a.gpu()) {
    try {
      busy.start();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "gpu_train: cannot sample GPU use: %s\n", e.what());
    }
  }
  auto r = t.call(&TrainerActor::benchmark, a.steps, batch, int64_t{0}).get(600s);
  return {static_cast<double>(r.samples) / r.seconds, busy.fraction()};
}

struct LoaderFed {
  double rate;       // images/s over the steps after the warm-up
  double data_wait;  // the share of the trainer's timed calls spent waiting for batches
  double busy;       // NVML utilization over the timed steps (-1 without samples)
};

// The steps per train() call of the loader-bound cases: troupe's trainer
// reads the steps' losses back from the GPU once per call, and the peer
// (--loss-every) once per as many steps. A call also ends at each epoch's
// end, so the round is the largest divisor of an epoch's steps up to a
// sixth of the steps: every round of either side is that long (it was a
// sixth, 25 at the defaults, against troupe's 16-step epochs).
int64_t loss_every(const Args& a) {
  const int64_t epoch = std::max<int64_t>(1, a.records / std::max<int64_t>(1, a.batch));
  int64_t round = std::clamp<int64_t>(a.steps / 6, 1, epoch);
  while (epoch % round != 0) --round;
  return round;
}

// The peer's arguments for a loader-fed case: the same data format
// (uint8 to the GPU unless --normalize-in-loader) and loss read-back
// cadence as troupe's side.
std::vector<std::string> loader_peer_args(const Args& a, bool probe) {
  const auto n = [](int64_t v) { return std::to_string(v); };
  std::vector<std::string> r = {"run",        "--case",       "cnn_loader",        "--batch",
                                n(a.batch),   "--steps",      n(a.steps),          "--warmup",
                                n(a.warmup),  "--workers",    n(a.loader_threads), "--records",
                                n(a.records), "--loss-every", n(loss_every(a))};
  if (probe) r.push_back("--probe");
  if (a.normalize_in_loader) r.push_back("--normalize-in-loader");
  return r;
}

// cnn_loader_bound's model (see the top of this file).
struct LoaderBoundModel {
  int64_t width = 64;
  std::string file;
  double torch_feed = 0;      // the peer's DataLoader feeding a model that costs nothing, images/s
  double torch_compute = 0;   // the peer's GPU training this model on one in-memory batch, images/s
  bool loader_bound = false;  // torch_compute >= --loader-margin × torch_feed
};

LoaderBoundModel loader_bound_model(const Args& a, const std::filesystem::path& dir, const std::string& resnet18) {
  const auto n = [](int64_t v) { return std::to_string(v); };
  std::vector<std::string> args = {
      "calibrate",         "--cnn-widths",   a.loader_width > 0 ? n(a.loader_width) : a.loader_widths,
      "--width-steps",     n(a.width_steps), "--batch",
      n(a.batch),          "--steps",        n(a.steps),
      "--warmup",          n(a.warmup),      "--workers",
      n(a.loader_threads), "--records",      n(a.records),
      "--loss-every",      n(loss_every(a))};
  if (a.normalize_in_loader) args.push_back("--normalize-in-loader");
  const auto cal = peer(a, args);
  LoaderBoundModel m;
  m.torch_feed = cal.at("feed").get<double>();
  // The widest width light enough; failing that, the fastest of them.
  bool found = false;
  for (const auto& [w, rate] : cal.at("compute").items()) {
    const int64_t width = std::stoll(w);
    const double r = rate.get<double>();
    const bool light = r >= a.loader_margin * m.torch_feed;
    const bool better = light ? (!found || width > m.width) : (!found && r > m.torch_compute);
    if (!better) continue;
    found = found || light;
    m.width = width;
    m.torch_compute = r;
    m.loader_bound = light;
  }
  if (m.torch_compute <= 0) throw troupe::Error("the peer's calibration timed no width");
  m.file = m.width == 64 ? resnet18
                         : peer(a, {"write_cnn", dir.string(), "--cnn-width", n(m.width)}).at("cnn").get<std::string>();
  return m;
}

// One trainer holding the GPU, fed by a DataLoaderActor (a TrainJob with
// loaders), training the scripted module at `step` on uint8 records.
LoaderFed loader_fed(troupe::Runtime& rt, const Args& a, const std::string& step) {
  troupe::trainer::TrainJobConfig job;
  job.name = "gpu-loader-bench";
  job.trainer = cnn_config(a, step, a.records, a.batch);
  // The loader crops and flips; the trainer normalises on its GPU (the
  // same floats, docs/runtime.md), so the stream and the host-to-device
  // copy move uint8 pixels. --normalize-in-loader keeps it all there.
  job.trainer.data.set("defer_normalize", a.normalize_in_loader ? 0 : 1);
  job.scaling.num_workers = 1;
  job.scaling.resources_per_worker = a.trainer_resources();
  job.scaling.placement_timeout = 60s;
  job.use_loaders = true;
  job.loader_threads = a.loader_threads;
  job.loader_look_ahead = a.look_ahead;
  job.evaluate = false;
  job.verbose = false;
  job.epochs = 100;
  job.max_steps = a.warmup + a.steps;
  // Progress marks time the steps; about six of them after the warm-up.
  // The trainer reads the steps' losses back once per mark (one train()
  // call); the peer is given the same cadence (loader_peer_args).
  job.progress_every_steps = loss_every(a);
  GpuBusy busy;
  struct Mark {
    double time;
    int64_t step;
    int64_t samples;
    double seconds;    // of the train() calls behind this mark
    double data_wait;  // the share of them spent waiting for batches
  };
  std::vector<Mark> marks;
  int64_t samples = 0;
  bool sampling = false;
  job.on_step = [&](const troupe::trainer::StepInfo& s) {
    samples += s.samples;
    marks.push_back({s.time, s.step, samples, s.seconds, s.data_wait});
    if (a.gpu() && !sampling && s.step >= a.warmup) {
      sampling = true;
      try {
        busy.start();
      } catch (const std::exception& e) {  // no nvidia-smi: no gpu_busy, the rate still counts
        std::fprintf(stderr, "gpu_train: cannot sample GPU use: %s\n", e.what());
      }
    }
  };
  troupe::trainer::TrainJob(rt, job).fit();
  double busy_fraction = busy.fraction();
  // From the first progress mark at or after the warm-up to the last.
  auto first = std::find_if(marks.begin(), marks.end(), [&](const Mark& m) { return m.step >= a.warmup; });
  if (first == marks.end() || first == marks.end() - 1) throw troupe::Error("too few steps to time");
  double mine = static_cast<double>(marks.back().samples - first->samples) / (marks.back().time - first->time);
  // The trainer's time waiting for batches over the timed calls: near 1,
  // the loader (or the stream) bounds the rate; near 0, the trainer.
  double waited = 0, called = 0;
  for (auto m = first + 1; m != marks.end(); ++m) {
    waited += m->data_wait * m->seconds;
    called += m->seconds;
  }
  return {mine, called > 0 ? waited / called : 0.0, busy_fraction};
}

void ratio_row(const std::string& c, double troupe, const nlohmann::ordered_json& torch, const std::string& unit,
               const std::string& gpu, const std::string& key = "value",
               const nlohmann::ordered_json& extra = nlohmann::ordered_json::object()) {
  double theirs = torch.at(key).get<double>();
  nlohmann::ordered_json row = {{"bench", "gpu_train"},
                                {"case", c},
                                {"value", troupe},
                                {"unit", unit},
                                {"ratio", troupe / theirs},
                                {"torch", theirs},
                                {"torch_version", torch.value("torch", "")},
                                {"gpu", gpu}};
  for (const auto& [k, v] : extra.items()) row[k] = v;
  troupe::bench::print_row(row);
}

}  // namespace

int main(int argc, char** argv) {
  troupe::run_role_if_requested(argc, argv);
  Args a;
  CLI::App app{"training on one GPU: troupe's trainer against PyTorch eager on the same GPU"};
  app.add_option("--python", a.python, "the interpreter with CUDA PyTorch for the peer and the module files");
  app.add_option("--batch", a.batch, "images per step (cnn cases)");
  app.add_option("--steps", a.steps, "timed steps per side (cnn cases)");
  app.add_option("--lm-steps", a.lm_steps, "timed steps per side (lm_tokens; its steps are short)");
  app.add_option("--warmup", a.warmup, "untimed steps first");
  app.add_option("--loader-threads", a.loader_threads, "DataLoaderActor threads and DataLoader workers");
  app.add_option("--records", a.records, "uint8 records in the loader-bound data set");
  app.add_option("--look-ahead", a.look_ahead, "batches a loader makes of the next round early (0 = none)");
  app.add_option("--lm-batch", a.lm_batch, "sequences per step (lm_tokens)");
  app.add_option("--block", a.block, "lm context");
  app.add_option("--width", a.width, "lm width");
  app.add_option("--layers", a.layers, "lm blocks");
  app.add_option("--heads", a.heads, "lm attention heads");
  app.add_option("--loader-width", a.loader_width,
                 "cnn_loader_bound: this ResNet18Step width (64 = ResNet-18) rather than the choice below")
      ->check(CLI::Range(int64_t{1}, int64_t{4096}));
  app.add_option("--loader-widths", a.loader_widths,
                 "cnn_loader_bound: the widths to choose from, comma-separated: the widest the peer's GPU trains "
                 "--loader-margin times as fast as its DataLoader feeds");
  app.add_option("--loader-margin", a.loader_margin, "see --loader-widths")->check(CLI::Range(0.01, 100.0));
  app.add_option("--width-steps", a.width_steps, "timed steps per width when choosing")
      ->check(CLI::Range(int64_t{1}, int64_t{100000}));
  app.add_option("--peer-timeout", a.peer_timeout_s, "seconds a peer may take");
  app.add_flag("--normalize-in-loader", a.normalize_in_loader,
               "cnn_loader_bound: normalise in the loader (float32 batches) rather than on the trainer's GPU");
  app.add_option("--device", a.device, "cuda, or cpu for a dry run on a machine without a GPU")
      ->check(CLI::IsMember({"cuda", "cpu"}));
  app.add_option(
      "--case", a.cases,
      "run only these cases (cnn_compute_bound, cnn_loader_bound, cnn_resnet18_fed, loader_feed, lm_tokens)");
  CLI11_PARSE(app, argc, argv);

  const std::string gpu = a.gpu() ? gpu_name() : "none (cpu dry run)";
  auto dir = std::filesystem::temp_directory_path() / ("troupe-gpu-bench-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  // Removed however main ends (the module files are a few MB).
  struct RemoveDir {
    std::filesystem::path dir;
    ~RemoveDir() {
      std::error_code ec;
      troupe::core::remove_tree(dir, ec);
    }
  } remove_dir{dir};
  nlohmann::ordered_json files;
  try {
    auto args = model_args(a);
    args.insert(args.begin(), {"write", dir.string()});
    files = peer(a, args);
  } catch (const std::exception& e) {
    for (auto c : {"cnn_compute_bound", "cnn_loader_bound", "cnn_resnet18_fed", "loader_feed", "lm_tokens"})
      troupe::bench::print_error_row("gpu_train", c, std::string("writing the modules: ") + e.what());
    return 1;
  }

  const int64_t cpus = std::max<long>(2, ::sysconf(_SC_NPROCESSORS_ONLN));
  troupe::testing::LocalClusterOptions lo;
  lo.nodes = {{{"CPU", static_cast<double>(cpus)}, {"GPU", a.gpu() ? 1.0 : 0.0}}};
  lo.worker_pool_size = 0;
  troupe::testing::LocalCluster cluster(lo);
  troupe::Runtime rt = cluster.connect();
  const auto n = [](int64_t v) { return std::to_string(v); };
  // Each side's compute-bound rate of ResNet-18: the GPU's rate with
  // nothing but the model to run, so cnn_resnet18_fed's rate over it is a
  // second, NVML-free reading of how busy the loader-fed GPU was.
  double compute_mine = 0, compute_theirs = 0;

  if (a.want("cnn_compute_bound")) {
    try {
      auto mine = troupe_rate(rt, cnn_config(a, files.at("cnn").get<std::string>(), a.batch, a.batch), a, a.batch);
      auto theirs = peer(
          a, {"run", "--case", "cnn_compute", "--batch", n(a.batch), "--steps", n(a.steps), "--warmup", n(a.warmup)});
      // How busy the GPU is when nothing but the model runs: the ceiling
      // of cnn_resnet18_fed's gpu_busy.
      nlohmann::ordered_json extra = nlohmann::ordered_json::object();
      if (a.gpu()) extra = {{"gpu_busy", mine.busy}, {"torch_gpu_busy", theirs.value("gpu_busy", nlohmann::json())}};
      ratio_row("cnn_compute_bound", mine.per_s, theirs, "images/s", gpu, "value", extra);
      compute_mine = mine.per_s;
      compute_theirs = theirs.at("value").get<double>();
    } catch (const std::exception& e) {
      troupe::bench::print_error_row("gpu_train", "cnn_compute_bound", e.what());
    }
  }

  if (a.want("cnn_loader_bound")) {
    // What the gpu_busy row needs of the case, once its row is out.
    struct Fed {
      LoaderBoundModel model;
      LoaderFed mine;
      nlohmann::ordered_json theirs;
    };
    std::optional<Fed> fed;
    try {
      const auto model = loader_bound_model(a, dir, files.at("cnn").get<std::string>());
      const auto mine = loader_fed(rt, a, model.file);
      auto peer_args = loader_peer_args(a, false);
      peer_args.insert(peer_args.end(), {"--cnn-width", n(model.width)});
      auto theirs = peer(a, peer_args);
      nlohmann::ordered_json extra = {{"width", model.width},
                                      {"torch_feed", model.torch_feed},
                                      {"torch_compute", model.torch_compute},
                                      {"loader_bound", model.loader_bound},
                                      {"data_wait", mine.data_wait}};
      if (a.look_ahead > 0) {
        // The same without the loaders' look-ahead, so the row says what it is worth.
        Args none = a;
        none.look_ahead = 0;
        const auto plain = loader_fed(rt, none, model.file);
        extra["without_look_ahead"] = plain.rate;
        extra["data_wait_without_look_ahead"] = plain.data_wait;
      }
      ratio_row("cnn_loader_bound", mine.rate, theirs, "images/s", gpu, "value", extra);
      fed = Fed{model, mine, theirs};
    } catch (const std::exception& e) {
      troupe::bench::print_error_row("gpu_train", "cnn_loader_bound", e.what());
    }
    if (fed) {
      try {
        // Each side's loader-fed rate over its own compute-bound rate of
        // the same model, both timed as cnn_compute_bound times them (one
        // in-memory batch, the loss read back every step).
        const auto& [model, mine, theirs] = *fed;
        const double full = troupe_rate(rt, cnn_config(a, model.file, a.batch, a.batch), a, a.batch).per_s;
        const double peer_full = peer(a, {"run", "--case", "cnn_compute", "--cnn-width", n(model.width), "--batch",
                                          n(a.batch), "--steps", n(a.steps), "--warmup", n(a.warmup)})
                                     .at("value")
                                     .get<double>();
        nlohmann::ordered_json row = {{"bench", "gpu_train"}, {"case", "gpu_busy"}, {"unit", "fraction"}};
        // No NVML reading (a CPU dry run, no libnvidia-ml): null.
        row["value"] = mine.busy >= 0 ? nlohmann::json(mine.busy) : nlohmann::json();
        row["torch"] = theirs.value("gpu_busy", nlohmann::json());
        row["by_rate"] = mine.rate / full;
        row["torch_by_rate"] = theirs.at("value").get<double>() / peer_full;
        row["width"] = model.width;
        row["gpu"] = gpu;
        troupe::bench::print_row(row);
      } catch (const std::exception& e) {
        troupe::bench::print_error_row("gpu_train", "gpu_busy", e.what());
      }
    }
  }

  if (a.want("cnn_resnet18_fed")) {
    try {
      const auto mine = loader_fed(rt, a, files.at("cnn").get<std::string>());
      auto theirs = peer(a, loader_peer_args(a, false));
      nlohmann::ordered_json extra = {{"width", 64}, {"data_wait", mine.data_wait}};
      if (a.gpu()) {
        extra["gpu_busy"] = mine.busy;
        extra["torch_gpu_busy"] = theirs.value("gpu_busy", nlohmann::json());
        if (compute_mine > 0 && compute_theirs > 0) {
          extra["by_rate"] = mine.rate / compute_mine;
          extra["torch_by_rate"] = theirs.at("value").get<double>() / compute_theirs;
        }
      }
      ratio_row("cnn_resnet18_fed", mine.rate, theirs, "images/s", gpu, "value", extra);
    } catch (const std::exception& e) {
      troupe::bench::print_error_row("gpu_train", "cnn_resnet18_fed", e.what());
    }
  }

  if (a.want("loader_feed")) {
    try {
      const auto mine = loader_fed(rt, a, files.at("probe").get<std::string>());
      auto theirs = peer(a, loader_peer_args(a, true));
      ratio_row("loader_feed", mine.rate, theirs, "images/s", gpu, "value", {{"data_wait", mine.data_wait}});
    } catch (const std::exception& e) {
      troupe::bench::print_error_row("gpu_train", "loader_feed", e.what());
    }
  }

  if (a.want("lm_tokens")) {
    try {
      TrainerConfig c;
      c.model.name = "torchscript";
      c.model.path = files.at("lm").get<std::string>();
      c.optimizer.name = "adamw";
      c.optimizer.lr = 1e-3;
      c.batch_size = a.lm_batch;
      set_precision(c, a);
      c.threads = 4;
      c.data = troupe::actors::DatasetSpec("token_stream")
                   .set("path", files.at("tokens").get<std::string>())
                   .set("block_size", a.block);
      Args lm = a;
      lm.steps = a.lm_steps;
      double mine = troupe_rate(rt, c, lm, a.lm_batch).per_s * static_cast<double>(a.block);
      auto args = model_args(a);
      std::vector<std::string> run = {"run",     "--case",      "lm",       "--batch",  n(a.lm_batch),
                                      "--steps", n(a.lm_steps), "--warmup", n(a.warmup)};
      run.insert(run.end(), args.begin(), args.end());
      ratio_row("lm_tokens", mine, peer(a, run), "tokens/s", gpu, "tokens_per_s");
    } catch (const std::exception& e) {
      troupe::bench::print_error_row("gpu_train", "lm_tokens", e.what());
    }
  }
  return 0;
}
