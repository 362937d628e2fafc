// HeadStore: the SQLite file a durable head writes its tables through to
// (HeadState::take_rows after every message it handles) and a restarted
// head reloads them from. One table of (key, value) rows; each write is one
// transaction. WAL with synchronous=NORMAL: a committed write survives the
// head process being killed (not a power loss before the next checkpoint).
#pragma once

#include <map>
#include <string>
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
  // A file with rows must hold `format` (HeadState::kRowFormat); an empty
  // one is marked with it. ConfigError naming the file and both formats
  // otherwise: a head of another troupe version wrote it.
  void check_format(int format);
  std::map<std::string, std::string> load();
  void write(const std::vector<HeadState::Row>& rows);
  // Forgets every row (the cluster was stopped on purpose).
  void clear();

 private:
  void exec(const char* sql);
  [[noreturn]] void fail(const std::string& what);

  std::string path_;
  int lock_fd_ = -1;  // PATH.lock, flock'ed: one head per state file
  sqlite3* db_ = nullptr;
  sqlite3_stmt* put_ = nullptr;
  sqlite3_stmt* del_ = nullptr;
};

}  // namespace troupe::head
