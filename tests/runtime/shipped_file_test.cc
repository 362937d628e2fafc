// Files shipped from the driver to actors (shipped_file.h): the copy on the
// actor's host is whole and fetched once per host, a copy that does not
// match its digest is refused and left nowhere, and the driver's errors
// name the file.
#include "troupe/runtime/client/shipped_file.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <iterator>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "tests/support/temp_dir.h"
#include "tests/support/wait.h"
#include "troupe/runtime/testing/local_cluster.h"

using namespace std::chrono_literals;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// FNV-1a of the bytes and their count: a chunk out of place or missing shows.
uint64_t fingerprint(const std::string& s) {
  uint64_t h = 1469598103934665603ull ^ s.size();
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Bytes that differ from chunk to chunk, so a chunk out of place shows.
std::string pattern(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 7 + i / 4096) % 253);
  return s;
}

// Whether no process holds `use` (a copy's NAME.use): its users are gone.
bool unused(const std::string& use) {
  const int fd = ::open(use.c_str(), O_RDWR | O_CLOEXEC);
  const bool free = fd >= 0 && ::flock(fd, LOCK_EX | LOCK_NB) == 0;
  if (fd >= 0) ::close(fd);
  return free;
}

}  // namespace

class FileUser {
 public:
  // The local copy's path, and its bytes' fingerprint.
  std::string copy(troupe::ShippedFile f) { return troupe::local_copy(f); }
  uint64_t fingerprint_of(troupe::ShippedFile f) { return fingerprint(read_file(troupe::local_copy(f))); }
  // The copy of a shipped directory, and the text of `name` in it.
  std::string dir_copy(troupe::ShippedDir d) { return troupe::local_dir(d); }
  std::string read_in_copy(troupe::ShippedDir d, std::string name) {
    return read_file(troupe::local_dir(d) + "/" + name);
  }
  int pid() { return ::getpid(); }
  // Gets each of `pieces` over and over, all at once (one thread each),
  // until `rounds` are done or one fails; the first failure's text ("":
  // none).
  std::string get_over_and_over(std::vector<troupe::ObjectRef<troupe::Buffer>> pieces, int rounds) {
    std::mutex mu;
    std::string first;
    std::atomic<bool> failed{false};
    std::vector<std::thread> threads;
    for (const auto& piece : pieces)
      threads.emplace_back([&, piece] {
        for (int i = 0; i < rounds && !failed; ++i) {
          try {
            piece.get(std::chrono::minutes(5));
          } catch (const std::exception& e) {
            std::lock_guard lock(mu);
            if (!failed.exchange(true)) first = e.what();
          }
        }
      });
    for (auto& t : threads) t.join();
    return first;
  }
};
TROUPE_ACTOR(FileUser, &FileUser::copy, &FileUser::fingerprint_of, &FileUser::dir_copy, &FileUser::read_in_copy,
             &FileUser::pid, &FileUser::get_over_and_over)

namespace {

// Sets an environment variable for a scope, restoring what it was.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

bool in_memory(const std::string& dir) {
  struct statfs fs {};
  return ::statfs(dir.c_str(), &fs) == 0 && (fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC);
}

// Whether every thread of `pid` is stopped (kill returns before they all are).
bool all_stopped(int pid) {
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    const std::string stat = read_file(task.path().string() + "/stat");
    const size_t close = stat.rfind(')');
    if (close == std::string::npos || close + 2 >= stat.size()) return false;
    const char state = stat[close + 2];
    if (state != 'T' && state != 't') return false;
  }
  return !ec;
}

class ShippedFileTest : public ::testing::Test {
 protected:
  ShippedFileTest()
      : cluster_(troupe::testing::LocalClusterOptions{.nodes = {{{"CPU", 2}}}}),
        rt_(cluster_.connect()),
        dir_(troupe::test::make_temp_dir("shipped")),
        session_(troupe::test::make_temp_dir("shipped-session")) {}
  ~ShippedFileTest() override {
    troupe::test::remove_dir(dir_);
    troupe::test::remove_dir(session_);
  }
  std::string write(const std::string& name, const std::string& bytes) {
    std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  }
  troupe::ActorHandle<FileUser> user(const std::string& env = "") {
    std::vector<std::string> vars = {"TROUPE_SESSION_DIR=" + session_};
    if (!env.empty()) vars.push_back(env);
    return rt_.spawn<FileUser>({.env = vars});
  }
  troupe::testing::LocalCluster cluster_;
  troupe::Runtime rt_;
  std::string dir_;
  std::string session_;
};

// Two chunks and a part: every byte arrives in place, into the session's
// shipped/ folder; a second process of the host reads the same copy, and
// nothing of the file's size crosses the driver's connections again.
TEST_F(ShippedFileTest, AFileArrivesWholeOncePerHost) {
  const std::string bytes = pattern(2 * troupe::kShippedChunkBytes + 12345);
  troupe::ShippedFile f = troupe::ship_file(rt_, write("data.npz", bytes));
  EXPECT_EQ(f.chunks.size(), 3u);
  EXPECT_EQ(f.size, bytes.size());
  auto a = user();
  ASSERT_EQ(a.call(&FileUser::fingerprint_of, f).get(120s), fingerprint(bytes));
  const std::string copy = a.call(&FileUser::copy, f).get(60s);
  EXPECT_EQ(copy, session_ + "/shipped/" + f.sha256.substr(0, 16) + "-data.npz");
  const uint64_t written = rt_.core()->traffic().written;
  auto b = user();
  EXPECT_EQ(b.call(&FileUser::copy, f).get(60s), copy);
  EXPECT_LT(rt_.core()->traffic().written - written, 1u << 20);
  // A copy written over in place, even at its size, is not trained on:
  // fetched again (it was taken as is).
  {
    std::fstream damage(copy, std::ios::binary | std::ios::in | std::ios::out);
    damage.seekp(1000);
    damage << "damaged";
  }
  EXPECT_EQ(b.call(&FileUser::fingerprint_of, f).get(120s), fingerprint(bytes));
  // An empty file ships as no chunks and arrives empty.
  troupe::ShippedFile empty = troupe::ship_file(rt_, write("empty.txt", ""));
  EXPECT_TRUE(empty.chunks.empty());
  EXPECT_EQ(a.call(&FileUser::fingerprint_of, empty).get(60s), fingerprint(""));
}

// Bytes that do not match the digest the driver sent are refused, naming
// the file, and no copy (whole or partial) stays to be read later.
TEST_F(ShippedFileTest, ACopyThatDoesNotMatchItsDigestIsRefusedAndRemoved) {
  troupe::ShippedFile f = troupe::ship_file(rt_, write("model.pt", pattern(5000)));
  f.sha256[0] = f.sha256[0] == '0' ? '1' : '0';
  auto a = user();
  try {
    a.call(&FileUser::copy, f).get(60s);
    FAIL() << "a copy with the wrong digest was taken";
  } catch (const troupe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.pt"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("does not match"), std::string::npos) << e.what();
  }
  for (const auto& entry : std::filesystem::directory_iterator(session_ + "/shipped"))  // no copy, whole or partial
    EXPECT_TRUE(entry.path().extension() == ".lock" || entry.path().extension() == ".use") << entry.path();
  // A digest that is not one is refused before anything is fetched.
  f.sha256 = "../../etc/passwd";
  EXPECT_THROW(a.call(&FileUser::copy, f).get(60s), troupe::Error);
}

// Two processes of a host that need the file at once: one fetches, the
// other waits for its copy (the driver sends the bytes once); what a
// fetcher killed mid-fetch left is removed by the next.
TEST_F(ShippedFileTest, ProcessesOfAHostThatAskAtOnceFetchOnce) {
  const std::string bytes = pattern(troupe::kShippedChunkBytes + 4321);
  troupe::ShippedFile f = troupe::ship_file(rt_, write("train.npz", bytes));
  const std::string dest = session_ + "/shipped/" + f.sha256.substr(0, 16) + "-train.npz";
  std::filesystem::create_directories(session_ + "/shipped");
  std::filesystem::permissions(session_ + "/shipped", std::filesystem::perms::owner_all,
                               std::filesystem::perm_options::replace);
  const std::string stale = dest + ".99999.tmp";
  std::ofstream(stale) << "half a file";
  // Parts of other files: one whose process is gone from the host (past
  // pid_max: no such process) goes too; one whose process runs stays.
  long pid_max = 0;
  std::ifstream("/proc/sys/kernel/pid_max") >> pid_max;
  ASSERT_GT(pid_max, 0);
  const std::string dead = session_ + "/shipped/0123456789abcdef-other.npz." + std::to_string(pid_max + 1) + ".tmp";
  const std::string live = session_ + "/shipped/0123456789abcdef-other.npz." + std::to_string(::getpid()) + ".tmp";
  std::ofstream(dead) << "left by a fetcher that was killed";
  std::ofstream(live) << "being written";
  auto a = user();
  auto b = user();
  ASSERT_TRUE(a.wait_ready(60s));
  ASSERT_TRUE(b.wait_ready(60s));
  const uint64_t written = rt_.core()->traffic().written;
  auto from_a = a.call(&FileUser::fingerprint_of, f);
  auto from_b = b.call(&FileUser::fingerprint_of, f);
  EXPECT_EQ(from_a.get(120s), fingerprint(bytes));
  EXPECT_EQ(from_b.get(120s), fingerprint(bytes));
  EXPECT_LT(rt_.core()->traffic().written - written, bytes.size() + bytes.size() / 2);
  EXPECT_FALSE(std::filesystem::exists(stale));
  EXPECT_FALSE(std::filesystem::exists(dead));
  EXPECT_TRUE(std::filesystem::exists(live));
}

// A directory arrives as its files (what .gitignore leaves out stays
// behind), unpacked once per host: a second process of the host runs in the
// first one's copy, even after that one wrote into it. A later shipment of
// the same files gets a fresh copy (not what the last run left there). A
// copy no process uses is marked by the next copy made, and removed by one
// made past TROUPE_SHIPPED_COPY_GRACE_S after that unless used again
// meanwhile (a run placed anew after a failure comes back to it); a part a
// killed unpacker left goes then too.
TEST_F(ShippedFileTest, ADirectoryArrivesAsItsFilesOncePerHost) {
  const std::string project = dir_ + "/project";
  std::filesystem::create_directories(project + "/pkg");
  std::ofstream(project + "/train.py") << "import pkg.helper\n";
  std::ofstream(project + "/pkg/helper.py") << "ANSWER = 42\n";
  std::ofstream(project + "/.gitignore") << "outputs/\n";
  std::filesystem::create_directories(project + "/outputs");
  std::ofstream(project + "/outputs/ckpt.pt") << "left behind";
  const std::string big = pattern(troupe::kShippedChunkBytes + 100);  // two chunks
  std::ofstream(project + "/data.bin", std::ios::binary) << big;
  troupe::ShippedDir d = troupe::ship_dir(rt_, project + "/");
  EXPECT_EQ(d.path, project);
  EXPECT_EQ(d.files, 4u);  // .gitignore, data.bin, pkg/helper.py, train.py
  EXPECT_EQ(d.archive.chunks.size(), 2u);
  auto a = user();
  const std::string copy = a.call(&FileUser::dir_copy, d).get(120s);
  EXPECT_EQ(copy,
            session_ + "/shipped/" + d.archive.sha256.substr(0, 16) + "-project." + d.shipment.substr(0, 8) + ".d");
  EXPECT_EQ(read_file(copy + "/pkg/helper.py"), "ANSWER = 42\n");
  EXPECT_EQ(fingerprint(read_file(copy + "/data.bin")), fingerprint(big));
  EXPECT_FALSE(std::filesystem::exists(copy + "/outputs"));
  // The archive itself does not stay once unpacked.
  for (const auto& entry : std::filesystem::directory_iterator(session_ + "/shipped")) {
    const std::string name = entry.path().filename().string();
    EXPECT_TRUE(name.ends_with(".d") || name.ends_with(".lock") || name.ends_with(".use")) << name;
  }
  std::ofstream(copy + "/written_by_a_rank.txt") << "mine";
  const uint64_t written = rt_.core()->traffic().written;
  auto b = user();
  EXPECT_EQ(b.call(&FileUser::read_in_copy, d, std::string("written_by_a_rank.txt")).get(60s), "mine");
  EXPECT_LT(rt_.core()->traffic().written - written, 1u << 20);
  EXPECT_EQ(troupe::path_in_copy(d, copy, project + "/pkg/helper.py"), copy + "/pkg/helper.py");
  EXPECT_EQ(troupe::path_in_copy(d, copy, project + "/../elsewhere.py"), project + "/../elsewhere.py");
  EXPECT_EQ(troupe::path_in_copy(d, copy, project + "-other/x.py"), project + "-other/x.py");
  // Shipped again: a fresh copy. The first one stays while its users live,
  // and goes with the next copy made once they are gone.
  const troupe::ShippedDir again = troupe::ship_dir(rt_, project);
  EXPECT_EQ(again.archive.sha256, d.archive.sha256);
  const std::string fresh = b.call(&FileUser::dir_copy, again).get(120s);
  EXPECT_NE(fresh, copy);
  EXPECT_FALSE(std::filesystem::exists(fresh + "/written_by_a_rank.txt"));
  EXPECT_TRUE(std::filesystem::exists(copy + "/written_by_a_rank.txt"));
  rt_.kill(a);
  rt_.kill(b);
  // Their processes gone (the kernel let go of their locks on the copies).
  ASSERT_TRUE(troupe::test::eventually([&] { return unused(copy + ".use") && unused(fresh + ".use"); }));
  auto c = user("TROUPE_SHIPPED_COPY_GRACE_S=0");
  EXPECT_NE(c.call(&FileUser::dir_copy, troupe::ship_dir(rt_, project)).get(120s), fresh);
  EXPECT_TRUE(std::filesystem::exists(copy + ".unused") && std::filesystem::exists(fresh + ".unused"));
  EXPECT_TRUE(std::filesystem::exists(copy) && std::filesystem::exists(fresh));
  // A sweep within the grace (600 s by default) keeps what is marked.
  auto patient = user();
  patient.call(&FileUser::dir_copy, troupe::ship_dir(rt_, project)).get(120s);
  EXPECT_TRUE(std::filesystem::exists(fresh) && std::filesystem::exists(fresh + ".unused"));
  // The first copy used again: no longer unused, and kept by the next sweep.
  auto e = user();
  EXPECT_EQ(e.call(&FileUser::read_in_copy, d, std::string("written_by_a_rank.txt")).get(60s), "mine");
  EXPECT_FALSE(std::filesystem::exists(copy + ".unused"));
  const std::string part = fresh + ".99999.tmp";
  std::filesystem::create_directories(part + "/half");
  c.call(&FileUser::dir_copy, troupe::ship_dir(rt_, project)).get(120s);
  EXPECT_TRUE(std::filesystem::exists(copy));
  EXPECT_FALSE(std::filesystem::exists(fresh));
  EXPECT_FALSE(std::filesystem::exists(part));
  // What the driver cannot ship is named.
  try {
    troupe::ship_dir(rt_, dir_ + "/missing");
    FAIL() << "a missing directory was shipped";
  } catch (const troupe::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(dir_ + "/missing"), std::string::npos) << e.what();
  }
  EXPECT_EQ(troupe::ship_dir(rt_, project, {.excludes = {"*.bin"}}).files, 3u);
}

// Every version of a shipped data set stayed on each host until its node
// agent stopped (probe 26a: 1.4 GB): a file copy no process uses is marked
// by the next copy made and removed by one made past the grace; one in use
// stays.
TEST_F(ShippedFileTest, UnusedFileCopiesGoPastTheGrace) {
  auto a = user();
  const std::string v1 = a.call(&FileUser::copy, troupe::ship_file(rt_, write("v1.npz", pattern(4000)))).get(60s);
  auto keeper = user();
  const std::string kept =
      keeper.call(&FileUser::copy, troupe::ship_file(rt_, write("kept.npz", pattern(5000)))).get(60s);
  rt_.kill(a);
  ASSERT_TRUE(troupe::test::eventually([&] { return unused(v1 + ".use"); }));
  auto c = user("TROUPE_SHIPPED_COPY_GRACE_S=0");
  c.call(&FileUser::copy, troupe::ship_file(rt_, write("v2.npz", pattern(4100)))).get(60s);
  EXPECT_TRUE(std::filesystem::exists(v1) && std::filesystem::exists(v1 + ".unused"));
  c.call(&FileUser::copy, troupe::ship_file(rt_, write("v3.npz", pattern(4200)))).get(60s);
  EXPECT_FALSE(std::filesystem::exists(v1));
  EXPECT_FALSE(std::filesystem::exists(v1 + ".ok"));
  // Its lock files go with it (they piled up, a set per shipment, on a
  // long-lived node).
  EXPECT_FALSE(std::filesystem::exists(v1 + ".use"));
  EXPECT_FALSE(std::filesystem::exists(v1 + ".lock"));
  EXPECT_TRUE(std::filesystem::exists(kept));
  EXPECT_FALSE(std::filesystem::exists(kept + ".unused"));
}

// The records of a copy that is gone (left before they were removed with
// it) go when no process holds them; a copy whose own name ends in .use
// is not taken for one.
TEST_F(ShippedFileTest, RecordsOfGoneCopiesGoAndACopyNamedLikeOneStays) {
  auto a = user();
  const std::string empty_use = a.call(&FileUser::copy, troupe::ship_file(rt_, write("empty.use", ""))).get(60s);
  rt_.kill(a);
  ASSERT_TRUE(troupe::test::eventually([&] { return unused(empty_use + ".use"); }));
  const std::string gone = session_ + "/shipped/0123456789abcdef-gone.npz";
  for (const char* record : {".use", ".lock", ".ok", ".unused"}) std::ofstream(gone + record).flush();
  const std::string held = session_ + "/shipped/0123456789abcdef-held.npz";
  const int holder = ::open((held + ".use").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  ASSERT_GE(holder, 0);
  ASSERT_EQ(::flock(holder, LOCK_SH), 0);  // a process about to fetch it
  auto c = user("TROUPE_SHIPPED_COPY_GRACE_S=0");
  c.call(&FileUser::copy, troupe::ship_file(rt_, write("next.npz", pattern(3100)))).get(60s);
  for (const char* record : {".use", ".lock", ".ok", ".unused"})
    EXPECT_FALSE(std::filesystem::exists(gone + record)) << record;
  EXPECT_TRUE(std::filesystem::exists(held + ".use"));
  EXPECT_TRUE(std::filesystem::exists(empty_use));
  ::close(holder);
}

TEST_F(ShippedFileTest, TheDriverNamesAFileItCannotShip) {
  try {
    troupe::ship_file(rt_, dir_ + "/missing.npz");
    FAIL() << "a missing file was shipped";
  } catch (const troupe::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(dir_ + "/missing.npz"), std::string::npos) << e.what();
  }
  EXPECT_THROW(troupe::ship_file(rt_, dir_), troupe::ConfigError);  // a directory
}

// The driver holds none of a shipped file: its pieces are read from the
// file when fetched (they were held in its store, against its limit, for
// the whole job), so a file past the store's limit ships. A file changed
// or removed after it was shipped is refused on the host, naming it.
TEST_F(ShippedFileTest, TheDriverServesAFileFromDiskAndHoldsNoneOfIt) {
  rt_.core()->service<troupe::client::ObjectStore>()->set_limit(1 << 20);
  const std::string bytes = pattern(troupe::kShippedChunkBytes + (3 << 20));
  const uint64_t held_before = rt_.object_store_stats().bytes;
  troupe::ShippedFile f = troupe::ship_file(rt_, write("big.bin", bytes));
  EXPECT_EQ(rt_.object_store_stats().bytes, held_before);
  EXPECT_EQ(f.chunks.size(), 2u);
  auto a = user();
  EXPECT_EQ(a.call(&FileUser::fingerprint_of, f).get(120s), fingerprint(bytes));
  // A local get reads the piece too.
  EXPECT_EQ(f.chunks[1].get(60s).size(), bytes.size() - troupe::kShippedChunkBytes);
  const std::string changed = write("changed.bin", pattern(5000));
  troupe::ShippedFile g = troupe::ship_file(rt_, changed);
  std::ofstream(changed, std::ios::binary) << std::string(5000, 'x');
  try {
    a.call(&FileUser::copy, g).get(60s);
    ADD_FAILURE() << "a changed file was taken";
  } catch (const troupe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("changed.bin"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("did the file change after it was shipped"), std::string::npos) << e.what();
  }
  const std::string removed = write("removed.bin", pattern(5000));
  troupe::ShippedFile h = troupe::ship_file(rt_, removed);
  std::filesystem::remove(removed);
  try {
    a.call(&FileUser::copy, h).get(60s);
    ADD_FAILURE() << "a removed file was fetched";
  } catch (const troupe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot read " + removed), std::string::npos) << e.what();
  }
}

// How many archives of shipped directories this process holds open (they
// are unlinked at once: "/…/.shipping-XXXXXX (deleted)").
int open_archives() {
  int n = 0;
  std::error_code ec;
  for (const auto& fd : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    const std::string target = std::filesystem::read_symlink(fd.path(), ec).string();
    if (!ec && target.find("/.shipping-") != std::string::npos) ++n;
  }
  return n;
}

// A directory's archive was built in the driver's memory and held in its
// store for the whole job (a probe: 216 MB for a 200 MiB folder), so a
// folder past the store's limit could not ship. It is written to an
// unlinked file of shipping_folder() and served from there; its disk is
// freed when the ShippedDir goes. An archive the folder has no room for is
// refused before anything is read. The folder is not one held in memory
// (sessions live in $XDG_RUNTIME_DIR by default, a tmpfs: review r31).
TEST_F(ShippedFileTest, ADirectorysArchiveIsServedFromDiskNotMemory) {
  {
    const ScopedEnv tmpdir("TMPDIR", "/dev/shm");
    if (in_memory("/dev/shm") && !(in_memory("/var/tmp") && in_memory("/tmp"))) {
      EXPECT_NE(troupe::shipping_folder(), "/dev/shm");
    }
  }
  {
    // A folder that cannot take it is named, with how to name another
    // (not which files to leave out: that would not help).
    const ScopedEnv missing("TROUPE_SHIPPING_DIR", dir_ + "/missing");
    std::filesystem::create_directories(dir_ + "/small");
    std::ofstream(dir_ + "/small/a.txt") << "a";
    try {
      troupe::ship_dir(rt_, dir_ + "/small");
      ADD_FAILURE() << "an archive was made in a missing folder";
    } catch (const troupe::ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("cannot ship the directory " + dir_ + "/small: cannot make its archive in " + dir_ +
                          "/missing: No such file or directory (set TROUPE_SHIPPING_DIR to another folder)"),
                std::string::npos)
          << what;
      EXPECT_EQ(what.find("leave files out"), std::string::npos) << what;
    }
  }
  const std::string archives = dir_ + "/archives";
  std::filesystem::create_directories(archives);
  const ScopedEnv folder("TROUPE_SHIPPING_DIR", archives);
  ASSERT_EQ(troupe::shipping_folder(), archives);
  const std::string project = dir_ + "/big_project";
  std::filesystem::create_directories(project + "/data");
  const std::string bytes = pattern(troupe::kShippedChunkBytes + (3 << 20));
  std::ofstream(project + "/data/big.bin", std::ios::binary) << bytes;
  std::ofstream(project + "/train.py") << "print('hi')\n";
  rt_.core()->service<troupe::client::ObjectStore>()->set_limit(1 << 20);
  const uint64_t held_before = rt_.object_store_stats().bytes;
  const int archives_before = open_archives();
  {
    const troupe::ShippedDir d = troupe::ship_dir(rt_, project);
    EXPECT_EQ(rt_.object_store_stats().bytes, held_before);
    EXPECT_EQ(d.archive.chunks.size(), 2u);
    EXPECT_EQ(open_archives(), archives_before + 1);
    EXPECT_TRUE(std::filesystem::is_empty(archives));  // unlinked at once
    auto a = user();
    const std::string copy = a.call(&FileUser::dir_copy, d).get(120s);
    EXPECT_EQ(fingerprint(read_file(copy + "/data/big.bin")), fingerprint(bytes));
    EXPECT_EQ(read_file(copy + "/train.py"), "print('hi')\n");
    // The host's archive is gone once unpacked.
    EXPECT_FALSE(std::filesystem::exists(session_ + "/shipped/" + d.archive.sha256.substr(0, 16) + "-big_project"));
  }
  // The borrower's release reaches the driver in its own time.
  EXPECT_TRUE(troupe::test::eventually([&] { return open_archives() == archives_before; }));
  // A folder whose archive has no room (a sparse file of 15 TiB: ext4's
  // largest is 16) is refused, naming the folder, before it is read.
  struct statvfs room {};
  ASSERT_EQ(::statvfs(archives.c_str(), &room), 0);
  if (uint64_t(room.f_bavail) * room.f_frsize >= (uint64_t(15) << 40))
    GTEST_SKIP() << archives << " has 15 TiB free; the rest passed";
  const std::string huge = dir_ + "/huge_project";
  std::filesystem::create_directories(huge);
  const int fd = ::open((huge + "/sparse.bin").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  const bool sparse = ::ftruncate(fd, off_t(15) << 40) == 0;
  ::close(fd);
  if (!sparse) GTEST_SKIP() << "this file system holds no 15 TiB sparse file; the rest passed";
  try {
    troupe::ship_dir(rt_, huge);
    FAIL() << "an archive past the free space was written";
  } catch (const troupe::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("does not fit " + archives), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(huge), std::string::npos) << e.what();
  }
  EXPECT_TRUE(std::filesystem::is_empty(archives));
}

// A borrower that stopped reading (a stopped process, a partitioned host)
// while it waited for four pieces held every slot of the driver's piece
// reader, and no other host was served until TCP gave up on it (review
// r30). It holds one slot now; the others are served meanwhile.
TEST_F(ShippedFileTest, AHostThatStopsReadingDoesNotStallTheOthers) {
  // The kernel's default: a shut window is never given up on.
  const ScopedEnv timeout("TROUPE_OBJECT_SEND_TIMEOUT_S", "0");
  const troupe::ShippedFile f = troupe::ship_file(rt_, write("big.bin", pattern(2 * troupe::kShippedChunkBytes)));
  auto stopped = user();
  const int pid = stopped.call(&FileUser::pid).get(60s);
  auto endless = stopped.call(
      &FileUser::get_over_and_over,
      std::vector<troupe::ObjectRef<troupe::Buffer>>{f.chunks[0], f.chunks[1], f.chunks[0], f.chunks[1]}, 1000000);
  ASSERT_TRUE(troupe::test::eventually([&] { return rt_.object_store_stats().unsent_pieces >= 1; }));
  ASSERT_EQ(::kill(pid, SIGSTOP), 0);
  ASSERT_TRUE(troupe::test::eventually([&] { return all_stopped(pid); }));
  // Its four asks wait; one piece is held, unwritten.
  ASSERT_TRUE(troupe::test::eventually([&] { return rt_.object_store_stats().unsent_pieces == 1; }));
  const std::string other_bytes = pattern(5 << 20);
  auto other = user();
  EXPECT_EQ(other.call(&FileUser::fingerprint_of, troupe::ship_file(rt_, write("other.bin", other_bytes))).get(60s),
            fingerprint(other_bytes));
  EXPECT_EQ(rt_.object_store_stats().unsent_pieces, 1u);
  EXPECT_TRUE(all_stopped(pid));
  ::kill(pid, SIGCONT);
  rt_.kill(stopped);
}

// A borrower that takes nothing of what it asked for is dropped after the
// owner's send timeout (TROUPE_OBJECT_SEND_TIMEOUT_S, 120 s by default:
// TCP gave up on a shut window never, on a partitioned host after about 15
// minutes), and what was read for it goes.
TEST_F(ShippedFileTest, ABorrowerThatStopsReadingIsDroppedAfterTheSendTimeout) {
  // Read when the driver's object server starts (its first put).
  const ScopedEnv timeout("TROUPE_OBJECT_SEND_TIMEOUT_S", "2");
  const troupe::ShippedFile f = troupe::ship_file(rt_, write("big.bin", pattern(2 * troupe::kShippedChunkBytes)));
  auto stopped = user();
  const int pid = stopped.call(&FileUser::pid).get(60s);
  auto endless = stopped.call(&FileUser::get_over_and_over,
                              std::vector<troupe::ObjectRef<troupe::Buffer>>{f.chunks[0], f.chunks[1]}, 1000000);
  ASSERT_TRUE(troupe::test::eventually([&] { return rt_.object_store_stats().unsent_pieces >= 1; }));
  ASSERT_EQ(::kill(pid, SIGSTOP), 0);
  ASSERT_TRUE(troupe::test::eventually([&] { return all_stopped(pid); }));
  EXPECT_TRUE(troupe::test::eventually([&] { return rt_.object_store_stats().unsent_pieces == 0; }));
  EXPECT_TRUE(all_stopped(pid));
  ::kill(pid, SIGCONT);
  // Woken, it is told why its gets failed as well as the owner can be
  // sure of: the owner may have ended, or dropped it (said in its log).
  const std::string error = endless.get(120s);
  EXPECT_NE(error.find("the connection to its owner dropped ("), std::string::npos) << error;
  EXPECT_NE(error.find("or dropped this process for taking nothing for TROUPE_OBJECT_SEND_TIMEOUT_S seconds"),
            std::string::npos)
      << error;
  rt_.kill(stopped);
}

}  // namespace
