// Head store write latency: what a durable head's event loop waits for on
// each message it handles (HeadState::take_rows written through to the
// SQLite file, one transaction a message). HeadStore checkpoints the WAL on
// a thread of its own (head_store.h); the peer, measured in the same run on
// the same disk with the same rows, is the same SQLite file with SQLite's
// own automatic checkpoint (every 1000 WAL pages, on the committing
// connection), which is what a head without that thread would run.
//
// Each trial writes --writes transactions of --rows-per-write rows (values
// of --value-bytes over --keys keys, updated over and over as a head's
// actor and KV rows are; one row in 16 deleted and written again later).
// Printed, as JSON lines, per side: write latency p50, p99, p99.9 and max
// (µs), the writes that took over 1 ms, and writes/s; `ratio` = peer
// latency ÷ troupe latency (> 1: the head's loop waits less with troupe's
// store), and troupe ÷ peer of writes/s. Trials alternate sides.
//
//   bench/run head_store [--writes 20000] [--trials 3] [--dir DIR]
#include <sqlite3.h>
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/json_row.h"
#include "troupe/runtime/head/head_store.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using troupe::head::HeadState;

namespace {

struct Options {
  int writes = 20000;
  int rows_per_write = 2;
  int value_bytes = 512;
  int keys = 5000;
  int trials = 3;
  std::string dir;
};

// The peer: the table and statements HeadStore uses, with SQLite's
// automatic checkpoint left on.
class PlainStore {
 public:
  explicit PlainStore(const std::string& path) {
    if (sqlite3_open(path.c_str(), &db_) != SQLITE_OK) throw std::runtime_error("cannot open " + path);
    exec("PRAGMA journal_mode=WAL");
    exec("PRAGMA synchronous=NORMAL");
    exec("PRAGMA journal_size_limit=8388608");
    exec("CREATE TABLE IF NOT EXISTS head_rows (key TEXT PRIMARY KEY, value BLOB NOT NULL)");
    prepare("INSERT OR REPLACE INTO head_rows (key, value) VALUES (?1, ?2)", &put_);
    prepare("DELETE FROM head_rows WHERE key = ?1", &del_);
  }
  ~PlainStore() {
    sqlite3_finalize(put_);
    sqlite3_finalize(del_);
    sqlite3_close(db_);
  }
  PlainStore(const PlainStore&) = delete;
  PlainStore& operator=(const PlainStore&) = delete;

  void write(const std::vector<HeadState::Row>& rows) {
    exec("BEGIN");
    for (const auto& [key, value] : rows) {
      sqlite3_stmt* s = value ? put_ : del_;
      sqlite3_reset(s);
      sqlite3_bind_text(s, 1, key.data(), static_cast<int>(key.size()), SQLITE_STATIC);
      if (value) sqlite3_bind_blob(s, 2, value->data(), static_cast<int>(value->size()), SQLITE_STATIC);
      if (sqlite3_step(s) != SQLITE_DONE) throw std::runtime_error(std::string("write: ") + sqlite3_errmsg(db_));
    }
    exec("COMMIT");
  }

 private:
  void exec(const char* sql) {
    if (sqlite3_exec(db_, sql, nullptr, nullptr, nullptr) != SQLITE_OK)
      throw std::runtime_error(std::string(sql) + ": " + sqlite3_errmsg(db_));
  }
  void prepare(const char* sql, sqlite3_stmt** s) {
    if (sqlite3_prepare_v2(db_, sql, -1, s, nullptr) != SQLITE_OK)
      throw std::runtime_error(std::string(sql) + ": " + sqlite3_errmsg(db_));
  }
  sqlite3* db_ = nullptr;
  sqlite3_stmt* put_ = nullptr;
  sqlite3_stmt* del_ = nullptr;
};

// The same sequence of transactions for both sides (seeded).
std::vector<std::vector<HeadState::Row>> workload(const Options& o) {
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int> key(0, o.keys - 1);
  std::vector<std::vector<HeadState::Row>> out(static_cast<size_t>(o.writes));
  std::string value(static_cast<size_t>(o.value_bytes), 'v');
  for (auto& tx : out) {
    for (int r = 0; r < o.rows_per_write; ++r) {
      const int k = key(rng);
      value[static_cast<size_t>(k) % value.size()] = static_cast<char>('a' + k % 26);
      const std::string name = (r % 2 ? "kv/" : "actor/") + std::to_string(k);
      if (rng() % 16 == 0)
        tx.emplace_back(name, std::nullopt);
      else
        tx.emplace_back(name, value);
    }
  }
  return out;
}

struct Figures {
  std::vector<double> us;  // every write's latency
  double seconds = 0;
};

Figures time_writes(const std::vector<std::vector<HeadState::Row>>& txs,
                    const std::function<void(const std::vector<HeadState::Row>&)>& write) {
  Figures f;
  f.us.reserve(txs.size());
  const auto start = Clock::now();
  for (const auto& tx : txs) {
    const auto t0 = Clock::now();
    write(tx);
    f.us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  f.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return f;
}

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(std::ceil(q * static_cast<double>(v.size()))) - 1);
  return v[i];
}

void remove_db(const fs::path& p) {
  for (const char* suffix : {"", "-wal", "-shm", ".lock"}) fs::remove(p.string() + suffix);
}

double round3(double x) { return std::round(x * 1000) / 1000; }

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"head store write latency: troupe's HeadStore vs SQLite's automatic checkpoint"};
  app.add_option("--writes", o.writes, "transactions per trial")->check(CLI::Range(100, 10000000));
  app.add_option("--rows-per-write", o.rows_per_write, "rows a transaction writes")->check(CLI::Range(1, 1000));
  app.add_option("--value-bytes", o.value_bytes, "bytes of each row's value")->check(CLI::Range(1, 1 << 20));
  app.add_option("--keys", o.keys, "distinct keys written over")->check(CLI::Range(1, 10000000));
  app.add_option("--trials", o.trials, "trials per side, alternating")->check(CLI::Range(1, 100));
  app.add_option("--dir", o.dir, "where the files go (a disk, not tmpfs; default: a new folder under the cwd)");
  CLI11_PARSE(app, argc, argv);
  const fs::path dir =
      o.dir.empty() ? fs::current_path() / ("head-store-bench-" + std::to_string(::getpid())) : fs::path(o.dir);
  const bool remove_dir = o.dir.empty();
  fs::create_directories(dir);
  const auto txs = workload(o);
  std::vector<double> troupe_p50, troupe_p99, troupe_p999, troupe_max, troupe_rate, troupe_slow;
  std::vector<double> peer_p50, peer_p99, peer_p999, peer_max, peer_rate, peer_slow;
  auto note = [](std::vector<double>& p50, std::vector<double>& p99, std::vector<double>& p999,
                 std::vector<double>& max, std::vector<double>& rate, const Figures& f) {
    p50.push_back(quantile(f.us, 0.5));
    p99.push_back(quantile(f.us, 0.99));
    p999.push_back(quantile(f.us, 0.999));
    max.push_back(*std::max_element(f.us.begin(), f.us.end()));
    rate.push_back(static_cast<double>(f.us.size()) / f.seconds);
  };
  auto slow = [](const Figures& f) {
    return static_cast<double>(std::count_if(f.us.begin(), f.us.end(), [](double us) { return us > 1000; }));
  };
  try {
    for (int t = 0; t < o.trials; ++t) {
      const fs::path a = dir / "troupe.db", b = dir / "peer.db";
      remove_db(a);
      remove_db(b);
      {
        troupe::head::HeadStore store(a.string());
        const Figures f = time_writes(txs, [&](const auto& rows) { store.write(rows); });
        note(troupe_p50, troupe_p99, troupe_p999, troupe_max, troupe_rate, f);
        troupe_slow.push_back(slow(f));
        std::fprintf(stderr,
                     "trial %d troupe: %.0f writes/s, p99 %.0f us, max %.0f us (checkpoints: %lld by its thread, %lld "
                     "by the writer)\n",
                     t + 1, troupe_rate.back(), troupe_p99.back(), troupe_max.back(),
                     static_cast<long long>(store.checkpoints()), static_cast<long long>(store.writer_checkpoints()));
      }
      {
        PlainStore store(b.string());
        const Figures f = time_writes(txs, [&](const auto& rows) { store.write(rows); });
        note(peer_p50, peer_p99, peer_p999, peer_max, peer_rate, f);
        peer_slow.push_back(slow(f));
        std::fprintf(stderr, "trial %d peer:   %.0f writes/s, p99 %.0f us, max %.0f us\n", t + 1, peer_rate.back(),
                     peer_p99.back(), peer_max.back());
      }
      remove_db(a);
      remove_db(b);
    }
  } catch (const std::exception& e) {
    troupe::bench::print_error_row("head_store", "head_write", e.what());
    if (remove_dir) fs::remove_all(dir);
    return 1;
  }
  if (remove_dir) fs::remove_all(dir);
  using troupe::bench::median;
  auto latency_row = [&](const char* name, const std::vector<double>& mine, const std::vector<double>& peer) {
    const double m = median(mine), p = median(peer);
    troupe::bench::print_row({{"bench", "head_store"},
                              {"case", name},
                              {"value", round3(m)},
                              {"unit", "us"},
                              {"peer", round3(p)},
                              {"ratio", round3(p / m)},
                              {"ratio_is", "peer latency / troupe latency"},
                              {"trials", mine},
                              {"peer_trials", peer},
                              {"writes", o.writes},
                              {"rows_per_write", o.rows_per_write},
                              {"value_bytes", o.value_bytes}});
  };
  latency_row("head_write_p50_us", troupe_p50, peer_p50);
  latency_row("head_write_p99_us", troupe_p99, peer_p99);
  latency_row("head_write_p999_us", troupe_p999, peer_p999);
  latency_row("head_write_max_us", troupe_max, peer_max);
  troupe::bench::print_row({{"bench", "head_store"},
                            {"case", "head_writes_over_1ms"},
                            {"value", median(troupe_slow)},
                            {"unit", "writes"},
                            {"peer", median(peer_slow)},
                            {"trials", troupe_slow},
                            {"peer_trials", peer_slow}});
  const double r = median(troupe_rate), pr = median(peer_rate);
  troupe::bench::print_row({{"bench", "head_store"},
                            {"case", "head_writes_per_s"},
                            {"value", std::round(r)},
                            {"unit", "writes/s"},
                            {"peer", std::round(pr)},
                            {"ratio", round3(r / pr)},
                            {"trials", troupe_rate},
                            {"peer_trials", peer_rate}});
  return 0;
}
