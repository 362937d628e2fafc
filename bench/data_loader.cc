// Benchmark: the data-loading pipeline against PyTorch's DataLoader, and
// stream bandwidth against raw loopback TCP.
//
// Loader workload (both sides): 3x64x64 uint8 images in memory (--image),
// random crop to 56 (--crop), horizontal flip, normalize, batch 64,
// shuffled. With --defer-normalize the loader ships the uint8 crops and the
// consumer normalises each batch (Dataset::finish, what a trainer does with
// image_records' defer_normalize), so the stream carries a quarter of the
// bytes; --image 256 --crop 224 --batch 128 is the GPU benchmark's
// loader-bound shape. Cases:
//   pipeline_inprocess  BatchPipeline feeding a consumer in this process (no
//                       process boundary: no ratio against the peer, whose
//                       batches cross one; `inprocess_over_torch_dataloader`
//                       gives the quotient for reference only)
//   loader              a DataLoaderActor in a worker process feeding this
//                       process over a stream (what a trainer sees)
//   torch_dataloader    the peer: bench/peers/torch_dataloader.py (DataLoader,
//                       2 workers, batches from worker processes), run in the
//                       same invocation; `ratio` of the loader row is
//                       troupe / PyTorch (> 1: troupe faster)
//   loopback_tcp        raw TCP over 127.0.0.1 between two threads, 4 MiB writes
//   stream              StreamWriter -> StreamReader of 4 MiB Buffers between
//                       two processes; `ratio` = stream / loopback_tcp
// One JSON object per line. The binary serves as head, node agent and worker
// for the LocalCluster it starts (run_role_if_requested first in main).
//
// A peer that fails or misses its deadline (--seconds + 120 s) is an error
// row; the troupe rows then carry no ratio.
//
//   troupe_bench_data_loader [--seconds S] [--threads N] [--size N] [--batch B]
//                            [--image 64] [--crop 56] [--defer-normalize]
//                            [--case all|pipeline|loader|stream] [--blocks N]
//                            [--rounds N] [--no-peer]
#include <ATen/Parallel.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>

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

#include "bench/json_row.h"
#include "bench/peer_process.h"
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
  int64_t image = 64;  // square uint8 images of this side
  int64_t crop = 56;
  bool defer_normalize = false;
  std::string only = "all";
  bool peer = true;
  // Blocks per stream / loopback round.
  int64_t blocks = 256;
  // Alternating rounds of peer and loader cases (best of each is reported).
  int rounds = 2;
};

// Parses the flags into `a`; returns CLI11's exit code when main should
// stop (--help, a bad value), -1 to go on.
int parse(int argc, char** argv, Args& a) {
  CLI::App app{"data loading: DataLoaderActor vs PyTorch's DataLoader; stream bandwidth vs loopback TCP"};
  app.add_option("--seconds", a.seconds, "seconds per timed loader run")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--threads", a.threads, "loader threads")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--size", a.size, "images in the data set")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--batch", a.batch, "batch size")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--image", a.image, "side of the square images")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--crop", a.crop, "side of the random crop")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_flag("--defer-normalize", a.defer_normalize, "ship uint8 crops; the consumer normalises");
  app.add_option("--case", a.only, "cases to run")
      ->capture_default_str()
      ->check(CLI::IsMember({"all", "pipeline", "loader", "stream"}));
  app.add_option("--blocks", a.blocks, "4 MiB blocks per stream / loopback round")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--rounds", a.rounds, "alternating rounds of peer and loader cases")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_flag(
      "--no-peer", [&](int64_t) { a.peer = false; }, "skip PyTorch's DataLoader");
  try {
    app.parse(argc, argv);
    if (a.crop > a.image)
      throw CLI::ValidationError("--crop",
                                 std::to_string(a.crop) + " is larger than --image " + std::to_string(a.image));
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return -1;
}

bool wanted(const Args& a, const char* name) { return a.only == "all" || a.only == name; }

// The peer's result row; PeerFailed when it failed or missed its deadline.
nlohmann::ordered_json run_peer(const Args& a) {
  std::ostringstream seconds;
  seconds << a.seconds;
  // The same work as troupe's side: as many workers as loader threads,
  // and the normalisation deferred to the consumer when troupe's is.
  std::vector<std::string> args = {"/usr/bin/python3", std::string(TROUPE_BENCH_PEERS_DIR) + "/torch_dataloader.py",
                                   "--seconds",        seconds.str(),
                                   "--size",           std::to_string(a.size),
                                   "--batch",          std::to_string(a.batch),
                                   "--workers",        std::to_string(a.threads),
                                   "--image",          std::to_string(a.image),
                                   "--crop",           std::to_string(a.crop)};
  if (a.defer_normalize) args.push_back("--defer-normalize");
  return troupe::bench::run_peer_json(args, {.name = "torch_dataloader.py"},
                                      std::chrono::milliseconds(static_cast<int64_t>((a.seconds + 120) * 1000)));
}

troupe::actors::ImageTransformOptions transform(const Args& a) {
  return {.crop = a.crop,
          .flip = true,
          .mean = {0.485, 0.456, 0.406},
          .std = {0.229, 0.224, 0.225},
          .seed = 0,
          .defer_normalize = a.defer_normalize};
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
      {.size = a.size, .channels = 3, .height = a.image, .width = a.image, .num_classes = 10, .seed = 0}, transform(a));
  troupe::actors::DistributedSampler sampler({.dataset_size = a.size, .world_size = 1, .shuffle = true, .seed = 0});
  troupe::actors::BatchPipeline pipe(*ds, {.batch_size = a.batch, .num_threads = a.threads, .prefetch_depth = 2});
  *token_bound = pipe.max_live_tokens();
  double checksum = 0;
  int64_t batches = 0, samples = 0;
  auto consume = [&](Batch&& b) {
    checksum += ds->finish(std::move(b.tensors)).at("input").data_ptr<float>()[0];
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
                       .set("height", a.image)
                       .set("width", a.image)
                       .set("num_classes", 10)
                       .set("seed", 0)
                       .set("crop", a.crop)
                       .set("flip", 1)
                       .set("mean", {0.485, 0.456, 0.406})
                       .set("std", {0.229, 0.224, 0.225})
                       .set("defer_normalize", a.defer_normalize ? 1 : 0);
  // The consumer's half of a deferred normalisation (a trainer's finish()).
  const auto finisher = troupe::actors::make_dataset(config.dataset);
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
      checksum += finisher->finish(std::move(b->tensors)).at("input").data_ptr<float>()[0];
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

void emit_rate(const char* name, const Rate& r, const Args& a, double peer_rate, const nlohmann::ordered_json& extra) {
  nlohmann::ordered_json row = {{"bench", "data_loader"},
                                {"case", name},
                                {"value", r.samples_per_s},
                                {"unit", "samples/s"},
                                {"batches_per_s", r.batches_per_s},
                                {"batch", a.batch},
                                {"image", a.image},
                                {"crop", a.crop},
                                {"defer_normalize", a.defer_normalize},
                                {"threads", a.threads},
                                {"max_live_batches", r.max_live},
                                {"samples", r.samples},
                                {"seconds", r.seconds}};
  row.update(extra);
  if (peer_rate > 0) {
    row["peer"] = "torch_dataloader";
    row["ratio"] = r.samples_per_s / peer_rate;
  }
  troupe::bench::print_row(row);
}

}  // namespace

int main(int argc, char** argv) {
  troupe::run_role_if_requested(argc, argv);
  troupe::core::init_logging("bench");
  spdlog::set_level(spdlog::level::warn);
  Args a;
  if (int code = parse(argc, argv, a); code >= 0) return code;
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
  nlohmann::ordered_json peer_row;
  std::string peer_error;
  double peer_rate = 0;
  Rate inprocess, remote;
  int64_t bound = 0;
  troupe::actors::LoaderStats stats;
  troupe::ActorHandle<troupe::actors::DataLoaderActor> loader;
  auto keep_best = [](Rate& best, const Rate& r) {
    if (r.samples_per_s > best.samples_per_s) best = r;
  };
  for (int round = 0; loaders && round < a.rounds; ++round) {
    if (a.peer && peer_error.empty()) {
      try {
        auto row = run_peer(a);
        if (row.value("value", 0.0) > peer_rate) {
          peer_rate = row.value("value", 0.0);
          peer_row = row;
        }
      } catch (const troupe::bench::PeerFailed& e) {
        peer_error = e.what();  // not tried again: the next round would fail alike
      }
    }
    if (wanted(a, "pipeline")) keep_best(inprocess, pipeline_inprocess(a, &bound));
    if (wanted(a, "loader")) keep_best(remote, loader_remote(*rt, a, &loader, &stats));
  }
  if (!peer_row.is_null()) troupe::bench::print_row(peer_row);
  if (!peer_error.empty()) troupe::bench::print_error_row("data_loader", "torch_dataloader", peer_error);
  if (wanted(a, "pipeline")) {
    // In this process, against a peer whose batches come from worker
    // processes: not a like-for-like ratio, so none; the quotient under a
    // name that says what it is.
    nlohmann::ordered_json extra = {{"token_bound", bound}};
    if (peer_rate > 0) extra["inprocess_over_torch_dataloader"] = inprocess.samples_per_s / peer_rate;
    emit_rate("pipeline_inprocess", inprocess, a, 0, extra);
  }
  if (wanted(a, "loader")) {
    emit_rate("loader", remote, a, peer_rate,
              {{"token_bound", stats.token_bound},
               {"max_in_flight", stats.max_in_flight},
               {"loader_peak_rss_mb", stats.peak_rss_bytes >> 20}});
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
    troupe::bench::print_row({{"bench", "data_loader"},
                              {"case", "loopback_tcp"},
                              {"value", tcp / 1e9},
                              {"unit", "GB/s"},
                              {"message_bytes", kBlock},
                              {"messages", a.blocks}});
    troupe::bench::print_row({{"bench", "data_loader"},
                              {"case", "stream"},
                              {"value", stream / 1e9},
                              {"unit", "GB/s"},
                              {"message_bytes", kBlock},
                              {"messages", a.blocks},
                              {"credits", 8},
                              {"peer", "loopback_tcp"},
                              {"ratio", stream / tcp}});
  }
  return 0;
}
