// troupe_bench_allreduce: allreduce bus bandwidth of GlooGroup against
// torch.distributed's gloo backend (bench/peers/torch_allreduce.py, run by
// Debian's /usr/bin/python3), 2 ranks in separate processes on loopback,
// float32, 1 KiB to 64 MiB. Prints one JSON object per line; troupe rows
// carry ratio = troupe / torch.
//
// Usage: troupe_bench_allreduce [--peer PATH/torch_allreduce.py] [--python /usr/bin/python3]
//                               [--no-peer] [--rounds N] [--sizes B,B,...]
//
// Both sides stay up for the whole run, idle between trials, and take
// turns trial by trial (ABBA order per size), so that load from other
// processes on a shared machine falls on both alike. A trial is a few
// warm-up operations, a barrier, then `iters` back-to-back allreduces; its
// time per op is the max over the ranks. `value` is the best trial's bus
// bandwidth, 2(n-1)/n * bytes / time; `median_value` the median trial's.
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "troupe/runtime/collective/file_kv_store.h"
#include "troupe/runtime/collective/gloo_group.h"

#ifndef TROUPE_BENCH_PEERS_DIR
#define TROUPE_BENCH_PEERS_DIR "bench/peers"
#endif

namespace {

using namespace std::chrono_literals;
using troupe::collective::DType;
using troupe::collective::FileKvStore;
using troupe::collective::GlooGroup;

constexpr int kWorld = 2;
constexpr int kReplyTimeoutMs = 120'000;

// Back-to-back operations per trial: about 0.1-0.2 s each on a loaded
// 2-core machine, so a run of 15 rounds stays well inside two minutes.
int iterations_for(size_t bytes) {
  if (bytes <= (64u << 10)) return 200;
  if (bytes <= (1u << 20)) return 60;
  if (bytes <= (16u << 20)) return 8;
  return 3;
}
int warmups_for(size_t bytes) { return std::max(2, iterations_for(bytes) / 10); }

double bus_bandwidth_gbps(size_t bytes, double seconds) {
  return 2.0 * (kWorld - 1) / kWorld * static_cast<double>(bytes) / seconds / 1e9;
}

// Reads one '\n'-terminated line from fd within timeout_ms; false on EOF,
// error or timeout.
bool read_line(int fd, std::string* line, int timeout_ms) {
  line->clear();
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    int left = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count());
    if (left <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, left) <= 0) return false;
    char c;
    if (::read(fd, &c, 1) != 1) return false;
    if (c == '\n') return true;
    line->push_back(c);
  }
}

bool write_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = ::write(fd, s.data() + off, s.size() - off);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
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

// One troupe rank: forms the group, then serves trial commands
// "<bytes> <iters> <warmups>" from `cmd_fd` until EOF; rank 0 answers each
// with "<bytes> <seconds per op>" on `out_fd`.
int serve_rank(int rank, const std::string& dir, int cmd_fd, int out_fd) {
  FileKvStore kv(dir);
  troupe::collective::GlooGroupOptions opts;
  opts.rendezvous_timeout = 60s;
  auto group = GlooGroup::create(kv, "bench-allreduce", 1, rank, kWorld, opts);
  std::map<size_t, std::vector<float>> buffers;
  std::string line;
  while (read_line(cmd_fd, &line, 24 * 3600 * 1000)) {
    size_t bytes = 0;
    int iters = 0, warmups = 0;
    if (std::sscanf(line.c_str(), "%zu %d %d", &bytes, &iters, &warmups) != 3) return 1;
    auto& data = buffers[bytes];
    if (data.empty()) data.assign(bytes / sizeof(float), 1.0f);
    for (int i = 0; i < warmups; ++i) group->allreduce(data.data(), data.size(), DType::kFloat32)->wait();
    group->barrier()->wait();
    auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) group->allreduce(data.data(), data.size(), DType::kFloat32)->wait();
    std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    // The slower rank bounds the collective.
    double worst = elapsed.count() / iters;
    troupe::collective::AllreduceOptions max_opts;
    max_opts.op = troupe::collective::ReduceOp::kMax;
    group->allreduce(&worst, 1, DType::kFloat64, max_opts)->wait();
    char reply[64];
    std::snprintf(reply, sizeof reply, "%zu %.9g\n", bytes, worst);
    if (rank == 0 && !write_all(out_fd, reply)) return 1;
  }
  return 0;
}

// A side of the comparison: processes that take trial commands and answer
// with seconds per op.
class Side {
 public:
  virtual ~Side() = default;
  // Seconds per op of one trial, or a negative value on failure.
  virtual double trial(size_t bytes, int iters, int warmups) = 0;
};

class TroupeSide final : public Side {
 public:
  TroupeSide() {
    char templ[] = "/tmp/troupe-bench-allreduce-XXXXXX";
    if (::mkdtemp(templ) == nullptr) throw std::runtime_error("mkdtemp failed");
    dir_ = templ;
    int out[2];
    if (::pipe(out) != 0) throw std::runtime_error("pipe failed");
    std::fflush(stdout);
    for (int r = 0; r < kWorld; ++r) {
      int cmd[2];
      if (::pipe(cmd) != 0) throw std::runtime_error("pipe failed");
      pid_t pid = ::fork();
      if (pid == 0) {
        ::close(cmd[1]);
        ::close(out[0]);
        for (int fd : cmd_fds_) ::close(fd);
        int code = 1;
        try {
          code = serve_rank(r, dir_, cmd[0], out[1]);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "troupe rank %d: %s\n", r, e.what());
        }
        ::_exit(code);
      }
      ::close(cmd[0]);
      cmd_fds_.push_back(cmd[1]);
      pids_.push_back(pid);
    }
    ::close(out[1]);
    out_fd_ = out[0];
  }

  ~TroupeSide() override {
    for (int fd : cmd_fds_) ::close(fd);  // EOF ends the ranks
    ::close(out_fd_);
    for (pid_t pid : pids_) ::waitpid(pid, nullptr, 0);
    std::string rm = "rm -rf '" + dir_ + "'";
    if (std::system(rm.c_str()) != 0) std::fprintf(stderr, "could not remove %s\n", dir_.c_str());
  }

  double trial(size_t bytes, int iters, int warmups) override {
    std::string cmd = std::to_string(bytes) + " " + std::to_string(iters) + " " + std::to_string(warmups) + "\n";
    for (int fd : cmd_fds_) {
      if (!write_all(fd, cmd)) return -1;
    }
    std::string line;
    if (!read_line(out_fd_, &line, kReplyTimeoutMs)) return -1;
    size_t got = 0;
    double seconds = -1;
    if (std::sscanf(line.c_str(), "%zu %lf", &got, &seconds) != 2 || got != bytes) return -1;
    return seconds;
  }

 private:
  std::string dir_;
  std::vector<int> cmd_fds_;
  std::vector<pid_t> pids_;
  int out_fd_ = -1;
};

// The torch peer in --serve mode: commands on its stdin, one JSON line per
// trial on its stdout.
class TorchSide final : public Side {
 public:
  TorchSide(const std::string& python, const std::string& peer) {
    int in[2], out[2];
    if (::pipe(in) != 0 || ::pipe(out) != 0) throw std::runtime_error("pipe failed");
    std::fflush(stdout);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(in[0], 0);
      ::dup2(out[1], 1);
      ::close(in[0]);
      ::close(in[1]);
      ::close(out[0]);
      ::close(out[1]);
      ::execl(python.c_str(), python.c_str(), peer.c_str(), "--serve", "--world", std::to_string(kWorld).c_str(),
              static_cast<char*>(nullptr));
      std::perror("exec torch peer");
      ::_exit(127);
    }
    ::close(in[0]);
    ::close(out[1]);
    cmd_fd_ = in[1];
    out_fd_ = out[0];
  }

  ~TorchSide() override {
    ::close(cmd_fd_);
    ::close(out_fd_);
    ::waitpid(pid_, nullptr, 0);
  }

  double trial(size_t bytes, int iters, int warmups) override {
    std::string cmd = std::to_string(bytes) + " " + std::to_string(iters) + " " + std::to_string(warmups) + "\n";
    if (!write_all(cmd_fd_, cmd)) return -1;
    std::string line;
    // The first trial also waits for python to import torch and connect.
    if (!read_line(out_fd_, &line, kReplyTimeoutMs)) return -1;
    double got = 0, seconds = -1;
    if (!json_number(line, "bytes", &got) || !json_number(line, "seconds_per_op", &seconds) ||
        static_cast<size_t>(got) != bytes) {
      return -1;
    }
    return seconds;
  }

 private:
  pid_t pid_ = -1;
  int cmd_fd_ = -1;
  int out_fd_ = -1;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

void print_row(const char* name, size_t bytes, const std::vector<double>& seconds, const std::vector<double>* peer) {
  const double best = *std::min_element(seconds.begin(), seconds.end());
  const double med = median(seconds);
  std::printf("{\"bench\":\"allreduce\",\"case\":\"%s\",\"bytes\":%zu,\"value\":%.4f,\"unit\":\"GB/s\"", name, bytes,
              bus_bandwidth_gbps(bytes, best));
  if (peer != nullptr && !peer->empty()) {
    const double peer_best = *std::min_element(peer->begin(), peer->end());
    std::printf(",\"ratio\":%.3f,\"median_ratio\":%.3f", peer_best / best, median(*peer) / med);
  }
  std::printf(",\"median_value\":%.4f,\"seconds_per_op\":%.9g,\"trials\":%zu}\n", bus_bandwidth_gbps(bytes, med), best,
              seconds.size());
  std::fflush(stdout);
}

std::vector<size_t> parse_sizes(const std::string& s) {
  std::vector<size_t> out;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t comma = s.find(',', pos);
    out.push_back(std::strtoull(s.substr(pos, comma - pos).c_str(), nullptr, 10));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string peer = std::string(TROUPE_BENCH_PEERS_DIR) + "/torch_allreduce.py";
  std::string python = "/usr/bin/python3";
  bool run_peer = true;
  int rounds = 15;
  std::vector<size_t> sizes = {1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--peer" && i + 1 < argc) {
      peer = argv[++i];
    } else if (a == "--python" && i + 1 < argc) {
      python = argv[++i];
    } else if (a == "--no-peer") {
      run_peer = false;
    } else if (a == "--rounds" && i + 1 < argc) {
      rounds = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--sizes" && i + 1 < argc) {
      sizes = parse_sizes(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--peer PATH] [--python PATH] [--no-peer] [--rounds N] [--sizes B,B,...]\n",
                   argv[0]);
      return 2;
    }
  }

  try {
    TroupeSide troupe;
    std::unique_ptr<TorchSide> torch;
    if (run_peer) torch = std::make_unique<TorchSide>(python, peer);

    for (size_t bytes : sizes) {
      std::vector<double> mine, theirs;
      const int iters = iterations_for(bytes);
      const int warmups = warmups_for(bytes);
      for (int round = 0; round < rounds; ++round) {
        // ABBA: neither side always runs right after the other.
        const bool troupe_first = round % 2 == 0;
        for (int turn = 0; turn < (torch ? 2 : 1); ++turn) {
          const bool troupe_turn = (turn == 0) == troupe_first || !torch;
          double s = troupe_turn ? troupe.trial(bytes, iters, warmups) : torch->trial(bytes, iters, warmups);
          if (s <= 0) {
            std::fprintf(stderr, "%s side failed at %zu bytes\n", troupe_turn ? "troupe" : "torch", bytes);
            return 1;
          }
          (troupe_turn ? mine : theirs).push_back(s);
        }
      }
      if (torch) print_row("torch_gloo", bytes, theirs, nullptr);
      print_row("troupe_gloo", bytes, mine, torch ? &theirs : nullptr);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "allreduce bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
