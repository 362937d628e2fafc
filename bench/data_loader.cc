// Benchmark: the data-loading pipeline against PyTorch's DataLoader, and
// stream bandwidth against raw loopback TCP.
//
// Loader workload (both sides): 3x64x64 uint8 images in memory, random crop
// to 56, horizontal flip, normalize, batch 64, shuffled. Cases:
//   pipeline_inprocess  BatchPipeline feeding a consumer in this process
//   loader              a DataLoaderActor in a worker process feeding this
//                       process over a stream (what a trainer sees)
//   torch_dataloader    the peer: bench/peers/torch_dataloader.py (DataLoader,
//                       2 workers), run in the same invocation; `ratio` of
//                       the two rows above is troupe / PyTorch
//   loopback_tcp        raw TCP over 127.0.0.1 between two threads, 4 MiB writes
//   stream              StreamWriter -> StreamReader of 4 MiB Buffers between
//                       two processes; `ratio` = stream / loopback_tcp
// One JSON object per line. The binary serves as head, node agent and worker
// for the LocalCluster it starts (run_role_if_requested first in main).
//
//   troupe_bench_data_loader [--seconds S] [--threads N] [--size N] [--batch B]
//                            [--case all|pipeline|loader|stream] [--blocks N]
//                            [--rounds N] [--no-peer]
#include <ATen/Parallel.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "troupe/actors/batch_pipeline.h"
#include "troupe/actors/data_loader_actor.h"
#include "troupe/actors/distributed_sampler.h"
#include "troupe/actors/image_dataset.h"
#include "troupe/runtime/client/stream.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/testing/local_cluster.h"

#ifndef TROUPE_BENCH_PEERS_DIR
#define TROUPE_BENCH_PEERS_DIR "bench/peers"
#endif

// The writing half of the stream case: sends `count` copies of one block
// (no copy per message: every Buffer views the same bytes).
class StreamSource {
 public:
  int64_t produce(troupe::StreamRef ref, int64_t count, int64_t bytes) {
    auto block = std::make_shared<std::vector<std::byte>>(static_cast<size_t>(bytes), std::byte{7});
    troupe::Buffer buffer(block, block->data(), block->size());
    troupe::StreamWriter<troupe::Buffer> w(troupe::this_actor::runtime(), ref);
    for (int64_t i = 0; i < count; ++i) w.write(buffer);
    w.close();
    return count;
  }
};
TROUPE_ACTOR(StreamSource, &StreamSource::produce)

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;
using troupe::actors::Batch;

constexpr int64_t kBlock = 4 << 20;  // the stream case's message size

struct Args {
  double seconds = 3.0;
  int threads = 2;
  int64_t size = 4096;
  int64_t batch = 64;
  std::string only = "all";
  bool peer = true;
  // Blocks per stream / loopback round.
  int64_t blocks = 256;
  // Alternating rounds of peer and loader cases (best of each is reported).
  int rounds = 2;
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
    } else if (k == "--case") {
      a.only = value();
    } else if (k == "--blocks") {
      a.blocks = std::stoll(value());
    } else if (k == "--rounds") {
      a.rounds = std::stoi(value());
    } else if (k == "--no-peer") {
      a.peer = false;
    } else {
      std::cerr << "usage: " << argv[0]
                << " [--seconds S] [--threads N] [--size N] [--batch B] [--case all|pipeline|loader|stream]"
                   " [--blocks N] [--rounds N] [--no-peer]\n";
      std::exit(2);
    }
  }
  return a;
}

bool wanted(const Args& a, const char* name) { return a.only == "all" || a.only == name; }

// The "value" field of a one-line JSON object (no JSON library needed for one number).
double json_number(const std::string& line, const std::string& key) {
  auto pos = line.find("\"" + key + "\"");
  if (pos == std::string::npos) return 0;
  pos = line.find(':', pos);
  return pos == std::string::npos ? 0 : std::strtod(line.c_str() + pos + 1, nullptr);
}

std::string run_peer(const Args& a) {
  std::ostringstream cmd;
  cmd << "/usr/bin/python3 " << TROUPE_BENCH_PEERS_DIR << "/torch_dataloader.py --seconds " << a.seconds << " --size "
      << a.size << " --batch " << a.batch << " --workers 2";
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

troupe::actors::ImageTransformOptions transform() {
  return {.crop = 56, .flip = true, .mean = {0.485, 0.456, 0.406}, .std = {0.229, 0.224, 0.225}, .seed = 0};
}

struct Rate {
  double samples_per_s = 0;
  double batches_per_s = 0;
  int64_t samples = 0;
  double seconds = 0;
  int64_t max_live = 0;
};

// BatchPipeline with an in-process consumer.
Rate pipeline_inprocess(const Args& a, int64_t* token_bound) {
  auto ds = troupe::actors::ImageRecordDataset::synthetic(
      {.size = a.size, .channels = 3, .height = 64, .width = 64, .num_classes = 10, .seed = 0}, transform());
  troupe::actors::DistributedSampler sampler({.dataset_size = a.size, .world_size = 1, .shuffle = true, .seed = 0});
  troupe::actors::BatchPipeline pipe(*ds, {.batch_size = a.batch, .num_threads = a.threads, .prefetch_depth = 2});
  *token_bound = pipe.max_live_tokens();
  double checksum = 0;
  int64_t batches = 0, samples = 0;
  auto consume = [&](Batch&& b) {
    checksum += b.input.data_ptr<float>()[0];
    ++batches;
    samples += b.size();
  };
  pipe.run(sampler.indices(0, 0), 0, consume);  // warm-up epoch
  batches = samples = 0;
  Rate r;
  auto start = Clock::now();
  for (int64_t epoch = 1; std::chrono::duration<double>(Clock::now() - start).count() < a.seconds; ++epoch) {
    auto stats = pipe.run(sampler.indices(epoch, 0), epoch, consume);
    r.max_live = std::max(r.max_live, stats.max_live_batches);
  }
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  r.samples = samples;
  r.samples_per_s = samples / r.seconds;
  r.batches_per_s = batches / r.seconds;
  if (checksum == 12345.678) std::cerr << "";  // keeps the consumer's reads alive
  return r;
}

// A DataLoaderActor in a worker process, read by this process: one feed()
// per epoch, as a trainer would run it.
Rate loader_remote(troupe::Runtime& rt, const Args& a, troupe::ActorHandle<troupe::actors::DataLoaderActor>* actor,
                   troupe::actors::LoaderStats* stats) {
  troupe::actors::LoaderConfig config;
  config.dataset = troupe::actors::DatasetSpec("image_records")
                       .set("size", a.size)
                       .set("channels", 3)
                       .set("height", 64)
                       .set("width", 64)
                       .set("num_classes", 10)
                       .set("seed", 0)
                       .set("crop", 56)
                       .set("flip", 1)
                       .set("mean", {0.485, 0.456, 0.406})
                       .set("std", {0.229, 0.224, 0.225});
  config.batch_size = a.batch;
  config.threads = a.threads;
  config.prefetch_depth = 2;
  config.credits = 4;
  if (!actor->valid()) {
    *actor = rt.spawn<troupe::actors::DataLoaderActor>({}, config);
    if (!actor->wait_ready(60s)) throw troupe::Error("the loader actor did not start");
  }
  const auto& loader = *actor;
  double checksum = 0;
  int64_t batches = 0, samples = 0;
  auto epoch_run = [&](int64_t epoch) {
    troupe::StreamReader<Batch> r(rt, config.credits);
    auto sent = loader.call(&troupe::actors::DataLoaderActor::feed, r.ref(),
                            troupe::actors::SamplerCursor{.epoch = epoch}, 0, 0);
    while (auto b = r.read(60s)) {
      checksum += b->input.data_ptr<float>()[0];
      ++batches;
      samples += b->size();
    }
    sent.get(60s);
  };
  epoch_run(0);  // warm-up: opens the data set
  batches = samples = 0;
  Rate rate;
  auto start = Clock::now();
  for (int64_t epoch = 1; std::chrono::duration<double>(Clock::now() - start).count() < a.seconds; ++epoch)
    epoch_run(epoch);
  rate.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  rate.samples = samples;
  rate.samples_per_s = samples / rate.seconds;
  rate.batches_per_s = batches / rate.seconds;
  *stats = troupe::actors::loader_stats(loader);
  rate.max_live = stats->max_live_batches;
  if (checksum == 12345.678) std::cerr << "";
  return rate;
}

// Raw TCP over loopback: one thread writes `blocks` × 4 MiB, this one reads
// them into one reused buffer. Bytes per second.
double loopback_tcp(int64_t blocks) {
  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  if (listener < 0 || ::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(listener, 1) != 0 || ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
    throw troupe::Error(std::string("loopback listener: ") + std::strerror(errno));
  std::thread writer([addr, blocks] {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) return;
    std::vector<char> block(kBlock, 7);
    for (int64_t i = 0; i < blocks; ++i) {
      size_t off = 0;
      while (off < block.size()) {
        ssize_t n = ::send(fd, block.data() + off, block.size() - off, MSG_NOSIGNAL);
        if (n <= 0) break;
        off += static_cast<size_t>(n);
      }
    }
    ::close(fd);
  });
  int fd = ::accept(listener, nullptr, nullptr);
  ::close(listener);
  std::vector<char> buf(kBlock);
  int64_t total = 0;
  auto start = Clock::now();
  for (;;) {
    ssize_t n = ::recv(fd, buf.data(), buf.size(), 0);
    if (n <= 0) break;
    total += n;
  }
  double s = std::chrono::duration<double>(Clock::now() - start).count();
  ::close(fd);
  writer.join();
  if (total != blocks * kBlock) throw troupe::Error("loopback: short transfer");
  return total / s;
}

// 4 MiB Buffers from a worker process to this one through a stream. Bytes
// per second.
double stream_bandwidth(troupe::Runtime& rt, const troupe::ActorHandle<StreamSource>& source, int64_t blocks) {
  const int credits = 8;
  troupe::StreamReader<troupe::Buffer> r(rt, credits);
  auto start = Clock::now();
  auto done = source.call(&StreamSource::produce, r.ref(), blocks, kBlock);
  int64_t total = 0;
  int64_t touch = 0;
  while (auto b = r.read(60s)) {
    total += static_cast<int64_t>(b->size());
    touch += static_cast<int64_t>(b->data()[b->size() - 1]);
  }
  double s = std::chrono::duration<double>(Clock::now() - start).count();
  done.get(60s);
  if (total != blocks * kBlock || touch != 7 * blocks) throw troupe::Error("stream: short or wrong transfer");
  return total / s;
}

void emit_rate(const char* name, const Rate& r, const Args& a, double peer_rate, const std::string& extra) {
  std::ostringstream row;
  row << "{\"bench\":\"data_loader\",\"case\":\"" << name << "\",\"value\":" << r.samples_per_s
      << ",\"unit\":\"samples/s\",\"batches_per_s\":" << r.batches_per_s << ",\"batch\":" << a.batch
      << ",\"threads\":" << a.threads << ",\"max_live_batches\":" << r.max_live << ",\"samples\":" << r.samples
      << ",\"seconds\":" << r.seconds << extra;
  if (peer_rate > 0) row << ",\"peer\":\"torch_dataloader\",\"ratio\":" << r.samples_per_s / peer_rate;
  row << "}";
  std::cout << row.str() << std::endl;
}

}  // namespace

int main(int argc, char** argv) {
  troupe::run_role_if_requested(argc, argv);
  troupe::core::init_logging("bench");
  spdlog::set_level(spdlog::level::warn);
  Args a = parse(argc, argv);
  // Loader threads do whole samples; intra-op threads inside them would only
  // contend for the same cores (PyTorch's DataLoader workers do the same).
  at::set_num_threads(1);

  // The loader cases and the peer run in alternating rounds, best of each,
  // so that load from other processes on the machine hits both alike.
  const bool loaders = wanted(a, "pipeline") || wanted(a, "loader");
  const bool cluster_needed = wanted(a, "loader") || wanted(a, "stream");
  std::unique_ptr<troupe::testing::LocalCluster> cluster;
  std::optional<troupe::Runtime> rt;  // (Runtime's default constructor is not usable here)
  if (cluster_needed) {
    troupe::testing::LocalClusterOptions lo;
    lo.nodes = {{{"CPU", 8}}};
    cluster = std::make_unique<troupe::testing::LocalCluster>(lo);
    rt.emplace(cluster->connect());
  }
  std::string peer_row;
  double peer_rate = 0;
  Rate inprocess, remote;
  int64_t bound = 0;
  troupe::actors::LoaderStats stats;
  troupe::ActorHandle<troupe::actors::DataLoaderActor> loader;
  auto keep_best = [](Rate& best, const Rate& r) {
    if (r.samples_per_s > best.samples_per_s) best = r;
  };
  for (int round = 0; loaders && round < a.rounds; ++round) {
    if (a.peer) {
      std::string row = run_peer(a);
      if (json_number(row, "value") > peer_rate) {
        peer_rate = json_number(row, "value");
        peer_row = row;
      }
    }
    if (wanted(a, "pipeline")) keep_best(inprocess, pipeline_inprocess(a, &bound));
    if (wanted(a, "loader")) keep_best(remote, loader_remote(*rt, a, &loader, &stats));
  }
  if (!peer_row.empty()) std::cout << peer_row << std::endl;
  if (wanted(a, "pipeline"))
    emit_rate("pipeline_inprocess", inprocess, a, peer_rate, ",\"token_bound\":" + std::to_string(bound));
  if (wanted(a, "loader")) {
    emit_rate("loader", remote, a, peer_rate,
              ",\"token_bound\":" + std::to_string(stats.token_bound) +
                  ",\"max_in_flight\":" + std::to_string(stats.max_in_flight) +
                  ",\"loader_peak_rss_mb\":" + std::to_string(stats.peak_rss_bytes >> 20));
  }
  if (wanted(a, "stream")) {
    auto source = rt->spawn<StreamSource>({});
    if (!source.wait_ready(60s)) throw troupe::Error("the stream source did not start");
    stream_bandwidth(*rt, source, std::max<int64_t>(8, a.blocks / 8));  // warm-up
    // Interleaved, best of three each, so that background load hits both alike.
    double tcp = 0, stream = 0;
    for (int round = 0; round < 3; ++round) {
      tcp = std::max(tcp, loopback_tcp(a.blocks));
      stream = std::max(stream, stream_bandwidth(*rt, source, a.blocks));
    }
    std::ostringstream row;
    row << "{\"bench\":\"data_loader\",\"case\":\"loopback_tcp\",\"value\":" << tcp / 1e9
        << ",\"unit\":\"GB/s\",\"message_bytes\":" << kBlock << ",\"messages\":" << a.blocks << "}";
    std::cout << row.str() << std::endl;
    row.str("");
    row << "{\"bench\":\"data_loader\",\"case\":\"stream\",\"value\":" << stream / 1e9
        << ",\"unit\":\"GB/s\",\"message_bytes\":" << kBlock << ",\"messages\":" << a.blocks
        << ",\"credits\":8,\"peer\":\"loopback_tcp\",\"ratio\":" << stream / tcp << "}";
    std::cout << row.str() << std::endl;
  }
  return 0;
}
