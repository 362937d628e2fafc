#include "troupe/runtime/head/head_store.h"

#include <sqlite3.h>

#include "troupe/runtime/core/errors.h"

namespace troupe::head {

HeadStore::HeadStore(const std::string& path) : path_(path) {
  if (sqlite3_open_v2(path.c_str(), &db_, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                      nullptr) != SQLITE_OK) {
    std::string why = db_ ? sqlite3_errmsg(db_) : "out of memory";
    sqlite3_close(db_);
    db_ = nullptr;
    throw ConfigError("cannot open the head's state file " + path + ": " + why);
  }
  try {
    sqlite3_busy_timeout(db_, 2000);
    exec("PRAGMA journal_mode=WAL");
    exec("PRAGMA synchronous=NORMAL");
    exec("CREATE TABLE IF NOT EXISTS head_rows (key TEXT PRIMARY KEY, value BLOB NOT NULL)");
    if (sqlite3_prepare_v2(db_, "INSERT OR REPLACE INTO head_rows (key, value) VALUES (?1, ?2)", -1, &put_,
                           nullptr) != SQLITE_OK ||
        sqlite3_prepare_v2(db_, "DELETE FROM head_rows WHERE key = ?1", -1, &del_, nullptr) != SQLITE_OK)
      fail("prepare");
  } catch (...) {
    sqlite3_finalize(put_);
    sqlite3_finalize(del_);
    sqlite3_close(db_);
    throw;
  }
}

HeadStore::~HeadStore() {
  sqlite3_finalize(put_);
  sqlite3_finalize(del_);
  sqlite3_close(db_);
}

void HeadStore::fail(const std::string& what) {
  throw ConfigError("head state file " + path_ + ": " + what + ": " + sqlite3_errmsg(db_));
}

void HeadStore::exec(const char* sql) {
  char* err = nullptr;
  if (sqlite3_exec(db_, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    std::string why = err ? err : "unknown error";
    sqlite3_free(err);
    throw ConfigError("head state file " + path_ + ": " + sql + ": " + why);
  }
}

std::map<std::string, std::string> HeadStore::load() {
  std::map<std::string, std::string> rows;
  sqlite3_stmt* q = nullptr;
  if (sqlite3_prepare_v2(db_, "SELECT key, value FROM head_rows", -1, &q, nullptr) != SQLITE_OK) fail("read");
  int rc = 0;
  while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
    auto* k = reinterpret_cast<const char*>(sqlite3_column_text(q, 0));
    auto* v = static_cast<const char*>(sqlite3_column_blob(q, 1));
    rows[k ? k : ""] = std::string(v ? v : "", static_cast<size_t>(sqlite3_column_bytes(q, 1)));
  }
  sqlite3_finalize(q);
  if (rc != SQLITE_DONE) fail("read");
  return rows;
}

void HeadStore::write(const std::vector<HeadState::Row>& rows) {
  if (rows.empty()) return;
  exec("BEGIN");
  try {
    for (const auto& [key, value] : rows) {
      sqlite3_stmt* s = value ? put_ : del_;
      sqlite3_reset(s);
      sqlite3_bind_text(s, 1, key.data(), static_cast<int>(key.size()), SQLITE_STATIC);
      if (value) sqlite3_bind_blob(s, 2, value->data(), static_cast<int>(value->size()), SQLITE_STATIC);
      if (sqlite3_step(s) != SQLITE_DONE) fail("write " + key);
    }
    exec("COMMIT");
  } catch (...) {
    sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
    throw;
  }
}

void HeadStore::clear() { exec("DELETE FROM head_rows"); }

}  // namespace troupe::head
