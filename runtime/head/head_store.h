// HeadStore: the SQLite file a durable head writes its tables through to
// (HeadState::take_rows after every message it handles) and a restarted
// head reloads them from. One table of (key, value) rows; each write is one
// transaction. WAL with synchronous=NORMAL: a committed write survives the
// head process being killed (not a power loss before the next checkpoint).
//
// A commit appends to the WAL and syncs nothing; a checkpoint (copying the
// WAL into the file) syncs both, which on a slow disk takes longer than a
// node's HeadLease. So the head's event loop does not checkpoint: a thread
// of the store's own, on a connection of its own, checkpoints (PASSIVE:
// never blocking a write) once the WAL holds kCheckpointPages pages. The
// WAL starts over only when a write finds it wholly checkpointed, which
// writes that never pause prevent: at kWriterCheckpointPages the writer
// checkpoints itself (mostly done already by the thread), so that the WAL
// stays bounded under any load.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "troupe/runtime/head/head_state.h"

struct sqlite3;
struct sqlite3_stmt;

namespace troupe::head {

class HeadStore {
 public:
  // Opens (creating) the file; ConfigError naming it when it cannot, when
  // it is not a regular SQLite file (a directory, a link, a file of other
  // content: left untouched), or when another head holds it (the lock on
  // PATH.lock, with that head's pid in it, held while this store lives).
  explicit HeadStore(const std::string& path);
  ~HeadStore();
  HeadStore(const HeadStore&) = delete;
  HeadStore& operator=(const HeadStore&) = delete;

  const std::string& path() const { return path_; }
  // A file with rows must hold `format` (HeadState::kRowFormat) or one as
  // old as `oldest` (one this head reads as well); an empty or older one is
  // marked `format` (a head of the older format then refuses it). A
  // ConfigError names the file and both formats otherwise: a head of
  // another troupe version wrote it.
  void check_format(int format, int oldest = 0);
  // `written_order`, when given, gets the keys in the order they were last
  // written, oldest first.
  std::map<std::string, std::string> load(std::vector<std::string>* written_order = nullptr);
  void write(const std::vector<HeadState::Row>& rows);
  // Forgets every row (the cluster was stopped on purpose).
  void clear();
  // Unlinks the file (its WAL and journal too; PATH.lock stays, held): a
  // store that failed a write holds tables older than the head's, which no
  // later head may reload. Unlinking frees room even on a full disk.
  void discard();
  // Checkpoints the checkpoint thread ran, and those the writer ran (for
  // tests).
  int64_t checkpoints() const { return checkpoints_.load(); }
  int64_t writer_checkpoints() const { return writer_checkpoints_.load(); }
  // Pages in the WAL after the last write, and those of them the last
  // checkpoint copied into the file (equal: the next write starts the WAL
  // over).
  int wal_pages() const { return wal_pages_seen_.load(); }
  int backfilled_pages() const { return backfilled_.load(); }

  // WAL pages after which the checkpoint thread runs (SQLite's own
  // automatic checkpoint, which this one replaces, also runs at 1000), and
  // after which the writer does.
  static constexpr int kCheckpointPages = 1000;
  static constexpr int kWriterCheckpointPages = 8 * kCheckpointPages;

 private:
  void exec(const char* sql);
  [[noreturn]] void fail(const std::string& what);
  void start_checkpoints();
  void stop_checkpoints();
  void checkpoint_loop();
  static int on_commit(void* self, sqlite3* db, const char* name, int pages);

  std::string path_;
  int lock_fd_ = -1;  // PATH.lock, flock'ed: one head per state file
  sqlite3* db_ = nullptr;
  sqlite3_stmt* put_ = nullptr;
  sqlite3_stmt* del_ = nullptr;

  // The checkpoint thread and its connection; wanted_ is set by the
  // writer's WAL hook and cleared by the thread.
  sqlite3* checkpoint_db_ = nullptr;
  std::thread checkpointer_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stopping_ = false;
  bool wanted_ = false;
  std::atomic<int64_t> checkpoints_{0};
  std::atomic<int64_t> writer_checkpoints_{0};
  std::atomic<int> wal_pages_seen_{0};
  std::atomic<int> backfilled_{0};
};

}  // namespace troupe::head
