#include "troupe/runtime/head/head_store.h"

#include <fcntl.h>
#include <sqlite3.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/logging.h"

namespace troupe::head {

namespace {

// The first table or index of SQLite file `path` that a head does not
// make, or "" (none, or the file cannot be read here: opening it to
// write says why).
std::string other_programs_table(const std::string& path) {
  sqlite3* db = nullptr;
  std::string found;
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READONLY, nullptr) == SQLITE_OK) {
    // A program writing its database holds it a moment: waited for, as the
    // head's own connection waits, rather than taken as "cannot tell".
    sqlite3_busy_timeout(db, 2000);
    sqlite3_stmt* q = nullptr;
    if (sqlite3_prepare_v2(db,
                           "SELECT name FROM sqlite_master WHERE name <> 'head_rows' AND name NOT LIKE 'sqlite\\_%' "
                           "ESCAPE '\\' LIMIT 1",
                           -1, &q, nullptr) == SQLITE_OK &&
        sqlite3_step(q) == SQLITE_ROW) {
      const auto* name = reinterpret_cast<const char*>(sqlite3_column_text(q, 0));
      found = name ? name : "?";
    }
    sqlite3_finalize(q);
  }
  sqlite3_close(db);
  return found;
}

// The state file a path names: none yet, an empty file, or a SQLite file.
// Anything else is refused by name before anything is created, locked or
// chmod'ed, so that a mistyped --state-db never changes the user's files.
void check_state_path(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return;
    throw ConfigError("head state file " + path + ": " + std::strerror(errno));
  }
  const std::string refused = "head state file " + path + " ";
  if (S_ISLNK(st.st_mode)) throw ConfigError(refused + "is a symbolic link; give the path of the file itself");
  if (S_ISDIR(st.st_mode))
    throw ConfigError(refused + "is a directory; give a file's path (e.g. " + path + "/head.sqlite)");
  if (!S_ISREG(st.st_mode)) throw ConfigError(refused + "is not a regular file");
  if (st.st_size == 0) return;
  static constexpr char kMagic[] = "SQLite format 3";  // and its NUL: SQLite's 16-byte header
  char header[sizeof kMagic] = {};
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) throw ConfigError("head state file " + path + ": " + std::strerror(errno));
  const ssize_t n = ::read(fd, header, sizeof header);
  ::close(fd);
  if (n != static_cast<ssize_t>(sizeof header) || std::memcmp(header, kMagic, sizeof kMagic) != 0)
    throw ConfigError(refused + "is not a SQLite file (a head's state file is one); left as it is");
  // Another program's database (an app's db.sqlite3, a tracker's) is a
  // SQLite file too: one with a table other than the head's is refused,
  // before WAL mode, the head's table and format mark go into it (and a
  // failed write or `troupe stop --force` would remove it).
  const std::string other = other_programs_table(path);
  if (!other.empty())
    throw ConfigError(refused + "is a SQLite database with a table '" + other +
                      "' that no troupe head writes: another program's, left as it is. Give the head a file of its "
                      "own (or start it with --no-state-db)");
}

// One head per state file: two would each take the other's nodes and
// actors for dead and overwrite each other's rows. An exclusive flock on
// PATH.lock, held for the store's life (the kernel lets go when the head
// dies, however it dies); the holder's pid is written in it for the error.
int lock_state_file(const std::string& path) {
  const std::string lock_path = path + ".lock";
  const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, S_IRUSR | S_IWUSR);
  if (fd < 0)
    throw ConfigError("head state file " + path + ": cannot open its lock " + lock_path + ": " + std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char pid[32] = {};
    const ssize_t n = ::pread(fd, pid, sizeof pid - 1, 0);
    ::close(fd);
    if (err != EWOULDBLOCK)
      throw ConfigError("head state file " + path + ": cannot lock " + lock_path + ": " + std::strerror(err));
    std::string holder = n > 0 ? std::string(pid, static_cast<size_t>(n)) : std::string();
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    throw ConfigError("head state file " + path + " is in use by another head" +
                      (holder.empty() ? std::string() : " (pid " + holder + ")") +
                      "; stop that head first, or give this one another state file");
  }
  const std::string mine = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, mine.data(), mine.size(), 0) < 0)
    TROUPE_LOG_DEBUG("head state file {}: cannot note this pid in {}: {}", path, lock_path, std::strerror(errno));
  return fd;
}

// The cluster's KV store is in the state file: readable by its owner alone,
// as the token is. Created 0600 before SQLite opens it (SQLite gives the
// -wal and -shm files the database's mode); a file of an older head, and
// journal files it left, are made 0600 too (regular files only: the path
// passed check_state_path). A file this user cannot chmod (another's, or a
// file system without modes) is used as it is, with a warning.
void keep_private(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, S_IRUSR | S_IWUSR);
  if (fd >= 0) ::close(fd);
  for (const char* suffix : {"", "-wal", "-shm"}) {
    const std::string f = path + suffix;
    struct stat st {};
    if (::lstat(f.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (::chmod(f.c_str(), S_IRUSR | S_IWUSR) != 0)
      TROUPE_LOG_WARN("head state file {}: cannot make it private (chmod 600: {}); it holds the cluster's KV store", f,
                      std::strerror(errno));
  }
}

}  // namespace

HeadStore::HeadStore(const std::string& path) : path_(path) {
  check_state_path(path);
  lock_fd_ = lock_state_file(path);
  keep_private(path);
  if (sqlite3_open_v2(path.c_str(), &db_, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                      nullptr) != SQLITE_OK) {
    std::string why = db_ ? sqlite3_errmsg(db_) : "out of memory";
    sqlite3_close(db_);
    db_ = nullptr;
    ::close(lock_fd_);
    throw ConfigError("cannot open the head's state file " + path + ": " + why);
  }
  try {
    sqlite3_busy_timeout(db_, 2000);
    exec("PRAGMA journal_mode=WAL");
    exec("PRAGMA synchronous=NORMAL");
    // A WAL that grew under a stream of writes is cut back when it starts over.
    exec("PRAGMA journal_size_limit=8388608");
    exec("CREATE TABLE IF NOT EXISTS head_rows (key TEXT PRIMARY KEY, value BLOB NOT NULL)");
    if (sqlite3_prepare_v2(db_, "INSERT OR REPLACE INTO head_rows (key, value) VALUES (?1, ?2)", -1, &put_, nullptr) !=
            SQLITE_OK ||
        sqlite3_prepare_v2(db_, "DELETE FROM head_rows WHERE key = ?1", -1, &del_, nullptr) != SQLITE_OK)
      fail("prepare");
    start_checkpoints();
  } catch (...) {
    stop_checkpoints();
    sqlite3_finalize(put_);
    sqlite3_finalize(del_);
    sqlite3_close(db_);
    ::close(lock_fd_);
    throw;
  }
}

HeadStore::~HeadStore() {
  stop_checkpoints();
  sqlite3_finalize(put_);
  sqlite3_finalize(del_);
  sqlite3_close(db_);
  ::close(lock_fd_);  // the next head may take the file
}

void HeadStore::start_checkpoints() {
  if (sqlite3_open_v2(path_.c_str(), &checkpoint_db_, SQLITE_OPEN_READWRITE | SQLITE_OPEN_FULLMUTEX, nullptr) !=
      SQLITE_OK) {
    const std::string why = checkpoint_db_ ? sqlite3_errmsg(checkpoint_db_) : "out of memory";
    sqlite3_close(checkpoint_db_);
    checkpoint_db_ = nullptr;
    throw ConfigError("head state file " + path_ + ": cannot open it for checkpoints: " + why);
  }
  sqlite3_busy_timeout(checkpoint_db_, 2000);
  // A connection opens the WAL at its first read; until then a checkpoint
  // does nothing (and says so only by its counts, -1).
  if (sqlite3_exec(checkpoint_db_, "SELECT count(*) FROM sqlite_master", nullptr, nullptr, nullptr) != SQLITE_OK) {
    const std::string why = sqlite3_errmsg(checkpoint_db_);
    sqlite3_close(checkpoint_db_);
    checkpoint_db_ = nullptr;
    throw ConfigError("head state file " + path_ + ": cannot read it for checkpoints: " + why);
  }
  sqlite3_wal_hook(db_, &HeadStore::on_commit, this);  // replaces SQLite's automatic checkpoint
  checkpointer_ = std::thread([this] { checkpoint_loop(); });
}

// After each commit of the writer (the head's event loop): wakes the
// checkpoint thread when the WAL is long, instead of checkpointing here.
int HeadStore::on_commit(void* self, sqlite3* db, const char*, int pages) {
  auto* store = static_cast<HeadStore*>(self);
  store->wal_pages_seen_.store(pages);
  if (pages >= kWriterCheckpointPages) {
    // Writes never paused for the thread's checkpoint to finish first.
    if (sqlite3_wal_checkpoint_v2(db, nullptr, SQLITE_CHECKPOINT_PASSIVE, nullptr, nullptr) == SQLITE_OK)
      store->writer_checkpoints_.fetch_add(1);
    return SQLITE_OK;
  }
  if (pages >= kCheckpointPages) {
    std::lock_guard lock(store->mu_);
    store->wanted_ = true;
    store->wake_.notify_one();
  }
  return SQLITE_OK;
}

void HeadStore::stop_checkpoints() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  wake_.notify_one();
  if (checkpointer_.joinable()) checkpointer_.join();
  sqlite3_close(checkpoint_db_);
  checkpoint_db_ = nullptr;
}

void HeadStore::checkpoint_loop() {
  std::unique_lock lock(mu_);
  while (true) {
    wake_.wait(lock, [&] { return stopping_ || wanted_; });
    if (stopping_) return;
    wanted_ = false;
    lock.unlock();
    int wal = 0, copied = 0;
    const int rc = sqlite3_wal_checkpoint_v2(checkpoint_db_, nullptr, SQLITE_CHECKPOINT_PASSIVE, &wal, &copied);
    if (rc == SQLITE_OK) {
      checkpoints_.fetch_add(1);
      backfilled_.store(copied);
    } else if (rc != SQLITE_BUSY)  // busy: a clear() checkpoints; the next commit asks again
      TROUPE_LOG_WARN("head state file {}: checkpoint failed: {}", path_, sqlite3_errmsg(checkpoint_db_));
    lock.lock();
  }
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

namespace {

// The first column of the first row of `sql`, as a number.
int64_t query_int(sqlite3* db, const char* sql, bool& ok) {
  sqlite3_stmt* q = nullptr;
  int64_t v = 0;
  ok = sqlite3_prepare_v2(db, sql, -1, &q, nullptr) == SQLITE_OK && sqlite3_step(q) == SQLITE_ROW;
  if (ok) v = sqlite3_column_int64(q, 0);
  sqlite3_finalize(q);
  return v;
}

}  // namespace

void HeadStore::check_format(int format, int oldest) {
  bool ok = false;
  const int64_t has_rows = query_int(db_, "SELECT EXISTS (SELECT 1 FROM head_rows)", ok);
  if (!ok) fail("read");
  // SQLite's user_version: 0 in a file no head marked (those written
  // before formats were kept, or new ones).
  const int64_t written = query_int(db_, "PRAGMA user_version", ok);
  if (!ok) fail("read its format");
  if (has_rows && written != format && !(oldest > 0 && written >= oldest && written < format))
    throw ConfigError("head state file " + path_ + " holds a cluster's tables in format " +
                      (written == 0 ? std::string("0 (unmarked)") : std::to_string(written)) +
                      ", and this head reads format " + std::to_string(format) +
                      ": another troupe version wrote it. Stop that cluster with the troupe that started it, or "
                      "move the file away (or start the head with --no-state-db)");
  if (written != format) exec(("PRAGMA user_version = " + std::to_string(format)).c_str());
}

std::map<std::string, std::string> HeadStore::load(std::vector<std::string>* written_order) {
  std::map<std::string, std::string> rows;
  sqlite3_stmt* q = nullptr;
  // In rowid order: a row's rowid is new at every write (INSERT OR
  // REPLACE), so this is the order they were last written in.
  if (sqlite3_prepare_v2(db_, "SELECT key, value FROM head_rows ORDER BY rowid", -1, &q, nullptr) != SQLITE_OK)
    fail("read");
  int rc = 0;
  while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
    // The key with its length: a KV key may hold NUL bytes, which a C
    // string would cut it at (two keys then read back as one).
    auto* k = reinterpret_cast<const char*>(sqlite3_column_text(q, 0));
    std::string key(k ? k : "", k ? static_cast<size_t>(sqlite3_column_bytes(q, 0)) : 0);
    auto* v = static_cast<const char*>(sqlite3_column_blob(q, 1));
    if (written_order) written_order->push_back(key);
    rows[std::move(key)] = std::string(v ? v : "", static_cast<size_t>(sqlite3_column_bytes(q, 1)));
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

void HeadStore::discard() {
  for (const char* suffix : {"", "-wal", "-shm", "-journal"}) ::unlink((path_ + suffix).c_str());
}

void HeadStore::clear() {
  exec("DELETE FROM head_rows");
  // The file gives its pages back: emptied, it is as small as a new one
  // (a long session's KV store can have grown it to tens of MB).
  exec("VACUUM");
  exec("PRAGMA wal_checkpoint(TRUNCATE)");
}

}  // namespace troupe::head
