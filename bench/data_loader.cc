// Benchmark: the data-loading pipeline against PyTorch's DataLoader.
//
// Workload (both sides): 3x64x64 uint8 images in memory, random crop to 56,
// horizontal flip, normalize, batch 64, shuffled. This binary measures
// BatchPipeline feeding an in-process consumer (case pipeline_inprocess),
// then runs the PyTorch peer bench/peers/torch_dataloader.py (DataLoader, 2
// workers) in the same invocation and reports the ratio, one JSON object per
// line. The loader-to-another-process case (over runtime streams) is added
// next to this one once streams exist.
//
//   troupe_bench_data_loader [--seconds S] [--threads N] [--size N] [--no-peer]
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>

#include "actors/batch_pipeline.h"
#include "actors/distributed_sampler.h"
#include "actors/image_dataset.h"

#ifndef TROUPE_BENCH_PEERS_DIR
#define TROUPE_BENCH_PEERS_DIR "bench/peers"
#endif

namespace {

using Clock = std::chrono::steady_clock;
using troupe::actors::Batch;

struct Args {
  double seconds = 3.0;
  int threads = 2;
  int64_t size = 4096;
  int64_t batch = 64;
  bool peer = true;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::cerr << k << " needs a value\n";
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--seconds") {
      a.seconds = std::stod(value());
    } else if (k == "--threads") {
      a.threads = std::stoi(value());
    } else if (k == "--size") {
      a.size = std::stoll(value());
    } else if (k == "--batch") {
      a.batch = std::stoll(value());
    } else if (k == "--no-peer") {
      a.peer = false;
    } else {
      std::cerr << "usage: " << argv[0] << " [--seconds S] [--threads N] [--size N] [--batch B] [--no-peer]\n";
      std::exit(2);
    }
  }
  return a;
}

// The "value" field of a one-line JSON object (no JSON library needed for one number).
double json_number(const std::string& line, const std::string& key) {
  auto pos = line.find("\"" + key + "\"");
  if (pos == std::string::npos) return 0;
  pos = line.find(':', pos);
  return pos == std::string::npos ? 0 : std::strtod(line.c_str() + pos + 1, nullptr);
}

std::string run_peer(const Args& a) {
  std::ostringstream cmd;
  cmd << "/usr/bin/python3 " << TROUPE_BENCH_PEERS_DIR << "/torch_dataloader.py --seconds " << a.seconds
      << " --size " << a.size << " --batch " << a.batch << " --workers 2";
  std::FILE* p = popen(cmd.str().c_str(), "r");
  if (!p) return "";
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int status = pclose(p);
  if (status != 0) {
    std::cerr << "peer failed (status " << status << "): " << cmd.str() << "\n" << out;
    return "";
  }
  // The last non-empty line is the JSON row.
  while (!out.empty() && out.back() == '\n') out.pop_back();
  auto nl = out.rfind('\n');
  return nl == std::string::npos ? out : out.substr(nl + 1);
}

}  // namespace

int main(int argc, char** argv) {
  Args a = parse(argc, argv);
  // Loader threads do whole samples; intra-op threads inside them would only
  // contend for the same cores (PyTorch's DataLoader workers do the same).
  at::set_num_threads(1);

  auto ds = troupe::actors::ImageRecordDataset::synthetic(
      {.size = a.size, .channels = 3, .height = 64, .width = 64, .num_classes = 10, .seed = 0},
      {.crop = 56, .flip = true, .mean = {0.485, 0.456, 0.406}, .std = {0.229, 0.224, 0.225}, .seed = 0});
  troupe::actors::DistributedSampler sampler({.dataset_size = a.size, .world_size = 1, .shuffle = true, .seed = 0});
  troupe::actors::BatchPipeline pipe(*ds, {.batch_size = a.batch, .num_threads = a.threads, .prefetch_depth = 2});

  double checksum = 0;
  int64_t batches = 0, samples = 0;
  auto consume = [&](Batch&& b) {
    checksum += b.input.data_ptr<float>()[0];
    ++batches;
    samples += b.size();
  };
  pipe.run(sampler.indices(0, 0), 0, consume);  // warm-up epoch
  batches = samples = 0;
  int64_t max_live = 0;
  auto start = Clock::now();
  int64_t epoch = 1;
  while (std::chrono::duration<double>(Clock::now() - start).count() < a.seconds) {
    auto stats = pipe.run(sampler.indices(epoch, 0), epoch, consume);
    max_live = std::max(max_live, stats.max_live_batches);
    ++epoch;
  }
  double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  double rate = samples / elapsed;

  std::string peer_row;
  double peer_rate = 0;
  if (a.peer) {
    peer_row = run_peer(a);
    peer_rate = json_number(peer_row, "value");
    if (!peer_row.empty()) std::cout << peer_row << std::endl;
  }
  std::ostringstream row;
  row << "{\"bench\":\"data_loader\",\"case\":\"pipeline_inprocess\",\"value\":" << rate
      << ",\"unit\":\"samples/s\",\"batches_per_s\":" << batches / elapsed << ",\"batch\":" << a.batch
      << ",\"threads\":" << a.threads << ",\"max_live_batches\":" << max_live
      << ",\"token_bound\":" << pipe.max_live_tokens() << ",\"samples\":" << samples << ",\"seconds\":" << elapsed;
  if (peer_rate > 0) row << ",\"peer\":\"torch_dataloader\",\"ratio\":" << rate / peer_rate;
  row << "}";
  std::cout << row.str() << std::endl;
  if (checksum == 12345.678) std::cerr << "";  // keeps the consumer's reads alive
  return 0;
}
