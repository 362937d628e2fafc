// The `troupe` CLI end to end: start a head and a second node in the
// background, look at them, run a driver against them, stop them.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <asio.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <thread>

#include <sqlite3.h>

#include "tests/support/process.h"
#include "tests/support/wait.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/core/files.h"
#include "troupe/runtime/core/session.h"
#include "troupe/runtime/head/head_store.h"

using namespace std::chrono_literals;
using troupe::test::kWaitBound;

class Adder {
 public:
  int add(int a, int b) { return a + b; }
};
TROUPE_ACTOR(Adder, &Adder::add)

namespace {

struct CommandResult {
  int status;
  std::string output;
};

CommandResult run(const std::string& cmd) {
  CommandResult r{0, ""};
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  r.status = pclose(p);
  return r;
}

// The oldest child of `p` (0 when none), from /proc.
pid_t child_of(pid_t p) {
  std::ifstream f("/proc/" + std::to_string(p) + "/task/" + std::to_string(p) + "/children");
  pid_t c = 0;
  f >> c;
  return c;
}

// Whether nothing holds the lock of the session's head state file (a
// SIGKILLed head's threads may still be leaving while they hold it).
bool state_lock_free(const std::filesystem::path& dir) {
  const int fd = ::open((dir / "head.sqlite.lock").c_str(), O_RDONLY | O_CLOEXEC);
  const bool free = fd >= 0 && ::flock(fd, LOCK_EX | LOCK_NB) == 0;
  if (fd >= 0) ::close(fd);
  return free;
}

class LauncherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("troupe-cli-test-" + std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
    // A session directory must be the user's own with mode 0700.
    std::filesystem::permissions(dir_, std::filesystem::perms::owner_all);
    setenv("TROUPE_SESSION_DIR", dir_.c_str(), 1);
    unsetenv("TROUPE_TOKEN");
  }
  void stop_a_blocking_start_with(int signal);
  void TearDown() override {
    std::string stop = TROUPE_CLI;  // built in steps: GCC 12 misreads the one-expression form (-Warray-bounds)
    stop += " stop";
    run(stop);
    troupe::core::remove_tree(dir_);
    unsetenv("TROUPE_SESSION_DIR");
  }
  std::filesystem::path dir_;
  std::string cli() const { return TROUPE_CLI; }
  // How many nodes the session's head lists alive.
  int alive_nodes() const {
    const auto j = nlohmann::json::parse(run(cli() + " status --json").output);  // kept: the loop reads into it
    int alive = 0;
    for (const auto& n : j["nodes"]) alive += n["alive"].get<bool>();
    return alive;
  }
  // Starts a supervised head with `flags` added: the supervisor's pid (in
  // head.pid) and the head's (its child).
  void start_supervised(const std::string& flags, pid_t* supervisor, pid_t* head) {
    auto r = run(cli() + " start --head --supervise --port 0 " + flags);
    ASSERT_EQ(r.status, 0) << r.output;
    *supervisor = std::stoi(troupe::core::read_session_file(dir_.string(), "head.pid"));
    *head = child_of(*supervisor);
    ASSERT_GT(*head, 0) << "no head under the supervisor " << *supervisor;
  }
  // What a driver connects to the session's cluster with.
  troupe::InitOptions session_cluster() const {
    troupe::InitOptions o;
    o.address = troupe::core::read_session_file(dir_.string(), "address");
    o.token = troupe::core::read_session_file(dir_.string(), "token");
    return o;
  }
};

// A listening socket on loopback that accepts nothing: the kernel completes
// connections to it, and nobody ever speaks on them.
struct SilentService {
  asio::io_context io;
  asio::ip::tcp::acceptor acceptor{io, {asio::ip::make_address("127.0.0.1"), 0}};
  std::string address() const { return "127.0.0.1:" + std::to_string(acceptor.local_endpoint().port()); }
  uint16_t port() const { return acceptor.local_endpoint().port(); }
};

TEST_F(LauncherTest, StartStatusSubmitStop) {
  // A permissive umask, so that the file modes checked below are troupe's.
  const mode_t umask_before = ::umask(022);
  auto head = run(std::string(TROUPE_CLI) + " start --head --port 0 --resources CPU=2,GPU=0");
  ::umask(umask_before);
  ASSERT_EQ(head.status, 0) << head.output;
  std::string dir = dir_.string();
  std::string address = troupe::core::read_session_file(dir, "address");
  ASSERT_FALSE(address.empty());
  struct stat st {};
  ASSERT_EQ(::stat((dir + "/token").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600);
  // The state db holds the cluster's KV store: its owner's alone too.
  for (const char* f : {"/head.sqlite", "/head.sqlite-wal"}) {
    ASSERT_EQ(::stat((dir + f).c_str(), &st), 0) << f;
    EXPECT_EQ(st.st_mode & 0777, 0600) << f;
  }

  // `auto`, as drivers spell it, is the session's head for the CLI too.
  // Bound to every interface, it tells peers the address it advertises,
  // never 0.0.0.0 (as deploy/kubernetes/nodes.yaml starts nodes).
  auto node = run(std::string(TROUPE_CLI) +
                  " start --address auto --host 0.0.0.0 --advertise-address 127.0.0.1 --resources CPU=3,GPU=0,disk=1");
  ASSERT_EQ(node.status, 0) << node.output;

  auto status = run(std::string(TROUPE_CLI) + " status --json --address auto");
  ASSERT_EQ(status.status, 0) << status.output;
  auto j = nlohmann::json::parse(status.output);
  ASSERT_EQ(j["nodes"].size(), 2u);
  EXPECT_EQ(j["nodes"][1]["total"]["disk"], 1.0);
  EXPECT_EQ(j["nodes"][1]["address"], "127.0.0.1") << j["nodes"][1].dump();

  // A driver finds the cluster through the session directory.
  const troupe::InitOptions o = session_cluster();
  troupe::Runtime rt = troupe::Runtime::connect(o);
  auto a = rt.spawn<Adder>({.resources = {{"disk", 1}}});
  EXPECT_EQ(a.call(&Adder::add, 2, 3).get(kWaitBound), 5);
  auto human = run(std::string(TROUPE_CLI) + " status");
  EXPECT_NE(human.output.find("Adder"), std::string::npos) << human.output;
  EXPECT_NE(human.output.find("ALIVE"), std::string::npos) << human.output;
  // Filtered and paged status (typed fields of the status request).
  auto b = rt.spawn<Adder>({});
  rt.kill(b);
  ASSERT_TRUE(troupe::test::eventually([&] { return b.info().state == troupe::ActorState::kDead; }));
  auto dead = run(std::string(TROUPE_CLI) + " status --json --state dead");  // any case, as the state API
  ASSERT_EQ(dead.status, 0) << dead.output;
  auto dj = nlohmann::json::parse(dead.output);
  ASSERT_EQ(dj["actors"].size(), 1u);
  EXPECT_EQ(dj["actors"][0]["id"], b.id());
  auto one = run(std::string(TROUPE_CLI) + " status --json --limit 1");
  ASSERT_EQ(one.status, 0) << one.output;
  EXPECT_EQ(nlohmann::json::parse(one.output)["actors"].size(), 1u);
  EXPECT_EQ(nlohmann::json::parse(one.output)["actors_matching"], 2u);
  // The list says it was cut.
  auto cut = run(std::string(TROUPE_CLI) + " status --limit 1");
  EXPECT_NE(cut.output.find("(1 more not shown: --limit 1 shows the newest)"), std::string::npos) << cut.output;
  auto bogus = run(std::string(TROUPE_CLI) + " status --state SLEEPY");
  EXPECT_NE(bogus.status, 0);
  EXPECT_NE(bogus.output.find("SLEEPY"), std::string::npos) << bogus.output;

  auto bad = run(std::string(TROUPE_CLI) + " start --address " + address + " --resources CPU=x");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("CPU=x"), std::string::npos) << bad.output;

  std::string head_pid = troupe::core::read_session_file(dir, "head.pid");
  // `ps` names the role (it showed the bare binary's path).
  std::ifstream cmdline("/proc/" + std::to_string(std::stoi(head_pid)) + "/cmdline");
  std::string argv0;
  std::getline(cmdline, argv0, '\0');
  EXPECT_EQ(argv0, "troupe-head");
  auto stop = run(std::string(TROUPE_CLI) + " stop");
  EXPECT_EQ(stop.status, 0) << stop.output;
  EXPECT_TRUE(troupe::test::eventually([&] { return ::kill(std::stoi(head_pid), 0) != 0; }));
  // A second stop has nothing to stop, and says so (not "the cluster goes on").
  auto again = run(std::string(TROUPE_CLI) + " stop");
  EXPECT_EQ(again.status, 0) << again.output;
  EXPECT_NE(again.output.find("nothing to stop"), std::string::npos) << again.output;
}

// A dead node's resources are not shown in use: what ran there died with
// it, though the head leaves the dead node's pool as it was.
TEST_F(LauncherTest, StatusShowsNothingInUseOnADeadNode) {
  auto head = run(cli() + " start --head --port 0 --dashboard-port -1 --resources CPU=1,GPU=0");
  ASSERT_EQ(head.status, 0) << head.output;
  const troupe::InitOptions o = session_cluster();
  auto node = run(cli() + " start --address " + o.address + " --resources CPU=1,GPU=0,disk=1");
  ASSERT_EQ(node.status, 0) << node.output;
  troupe::Runtime rt = troupe::Runtime::connect(o);
  auto a = rt.spawn<Adder>({.resources = {{"disk", 1}}});
  ASSERT_EQ(a.call(&Adder::add, 2, 3).get(kWaitBound), 5);
  auto before = run(cli() + " status");
  EXPECT_NE(before.output.find("disk 1/1"), std::string::npos) << before.output;
  // Built outside the lambda: GCC 12 warns falsely (-Warray-bounds) on the
  // concatenation inlined into it.
  const std::string status_json = cli() + " status --json";
  const auto nodes = nlohmann::json::parse(run(status_json).output)["nodes"];
  ASSERT_EQ(nodes.size(), 2u);
  ASSERT_EQ(::kill(nodes[1]["pid"].get<pid_t>(), SIGKILL), 0);
  ASSERT_TRUE(troupe::test::eventually(
      [&] { return nlohmann::json::parse(run(status_json).output)["nodes"][1]["alive"] == false; }));
  // The JSON (and so the dashboard and the metrics) shows nothing in use
  // on the dead node either.
  const auto dead = nlohmann::json::parse(run(status_json).output)["nodes"][1];
  EXPECT_TRUE(dead["used"].empty()) << dead.dump();
  EXPECT_EQ(dead["idle_workers"], 0) << dead.dump();  // not its last heartbeat's count
  auto after = run(cli() + " status");
  const size_t row = after.output.find("node 2 ");
  ASSERT_NE(row, std::string::npos) << after.output;
  const std::string line = after.output.substr(row, after.output.find('\n', row) - row);
  EXPECT_NE(line.find("DEAD"), std::string::npos) << line;
  EXPECT_NE(line.find("disk -/1"), std::string::npos) << line;
  EXPECT_EQ(line.find("1/1"), std::string::npos) << line;
}

// --supervise: the head SIGKILLed is started again on its address by the
// supervisor that head.pid names; the node rejoins as itself, an actor
// spawned before keeps its process and its name, and troupe stop ends
// head and supervisor alike.
TEST_F(LauncherTest, SupervisedHeadComesBackAfterSigkill) {
  auto head = run(cli() + " start --head --supervise --port 0 --resources CPU=2,GPU=0");
  ASSERT_EQ(head.status, 0) << head.output;
  const std::string dir = dir_.string();
  const pid_t supervisor = std::stoi(troupe::core::read_session_file(dir, "head.pid"));
  EXPECT_NE(head.output.find("head started (supervised: the supervisor is pid " + std::to_string(supervisor) + ")"),
            std::string::npos)
      << head.output;
  const pid_t first = child_of(supervisor);
  ASSERT_GT(first, 0) << "no head under the supervisor " << supervisor;
  const troupe::InitOptions o = session_cluster();
  {
    troupe::Runtime rt = troupe::Runtime::connect(o);
    auto a = rt.spawn<Adder>({.name = "adder"});
    ASSERT_EQ(a.call(&Adder::add, 2, 3).get(kWaitBound), 5);
    ASSERT_EQ(::kill(first, SIGKILL), 0);
    ASSERT_TRUE(troupe::test::eventually([&] {
      const pid_t c = child_of(supervisor);
      return c > 0 && c != first;
    }));
    EXPECT_EQ(a.call(&Adder::add, 1, 1).get(kWaitBound), 2);  // caller to worker: no head on the way
    EXPECT_TRUE(troupe::test::eventually([&] {
      auto status = run(cli() + " status --json");
      if (status.status != 0) return false;
      auto j = nlohmann::json::parse(status.output);
      return j["nodes"].size() == 1 && j["nodes"][0]["id"] == 1 && j["nodes"][0]["alive"] == true;
    }));
    EXPECT_TRUE(troupe::test::eventually([&] {
      try {
        return rt.get_actor<Adder>("adder").id() == a.id();
      } catch (const std::exception&) {
        return false;  // the driver's own reconnection is still under way
      }
    }));
  }
  auto log = troupe::core::read_session_file(dir, "head.log");
  // Timed and named as every other line of head.log.
  EXPECT_TRUE(std::regex_search(
      log, std::regex(R"(\n\[\d\d:\d\d:\d\d\.\d{3}\] \[head-supervisor pid \d+\] \[warning\] the head \(pid \d+\) )"
                      R"(killed by signal 9 \(Killed\); starting it again on port \d+\n)")))
      << log;
  auto stop = run(cli() + " stop");
  EXPECT_EQ(stop.status, 0) << stop.output;
  EXPECT_TRUE(troupe::test::eventually([&] { return troupe::test::process_gone(supervisor); }));
  auto refused = run(cli() + " start --head --supervise --no-state-db");
  EXPECT_NE(refused.status, 0);
  EXPECT_NE(refused.output.find("--no-state-db"), std::string::npos) << refused.output;
}

// --supervise with --hang-timeout: a head that is alive but hung (SIGSTOP
// holds its event loop as a deadlock would) is killed by the supervisor
// and started again; the node rejoins and the driver spawns and calls a new
// actor. (The node agent, hearing nothing from the head, killed its workers
// long before: HeadLease.)
TEST_F(LauncherTest, SupervisedHeadThatHangsIsKilledAndStartedAgain) {
  const std::string dir = dir_.string();
  pid_t supervisor = 0, first = 0;
  ASSERT_NO_FATAL_FAILURE(start_supervised("--hang-timeout 2 --resources CPU=2,GPU=0", &supervisor, &first));
  const troupe::InitOptions o = session_cluster();
  {
    troupe::Runtime rt = troupe::Runtime::connect(o);
    ASSERT_EQ(rt.spawn<Adder>({}).call(&Adder::add, 2, 3).get(kWaitBound), 5);
    ASSERT_EQ(::kill(first, SIGSTOP), 0);
    ASSERT_TRUE(troupe::test::eventually(
        [&] {
          const pid_t c = child_of(supervisor);
          return c > 0 && c != first;
        },
        std::chrono::seconds(30)))
        << "the supervisor did not replace the stopped head " << first;
    EXPECT_TRUE(troupe::test::eventually([&] { return troupe::test::process_gone(first); }));
    EXPECT_TRUE(troupe::test::eventually([&] {
      try {
        return rt.spawn<Adder>({}).call(&Adder::add, 1, 1).get(kWaitBound) == 2;
      } catch (const troupe::Error&) {
        return false;  // the driver's own reconnection is still under way
      }
    }));
    std::string status_json = cli();  // in steps: GCC 12's -Warray-bounds misreads the one-expression form
    status_json += " status --json";
    EXPECT_TRUE(troupe::test::eventually([&] {
      auto status = run(status_json);
      if (status.status != 0) return false;
      auto j = nlohmann::json::parse(status.output);
      return j["nodes"].size() == 1 && j["nodes"][0]["alive"] == true;
    }));
  }
  auto log = troupe::core::read_session_file(dir, "head.log");
  EXPECT_NE(log.find("gave no sign of life"), std::string::npos) << log;
  auto stop = run(cli() + " stop");
  EXPECT_EQ(stop.status, 0) << stop.output;
  EXPECT_TRUE(troupe::test::eventually([&] { return troupe::test::process_gone(supervisor); }));
}

// A restarted head that cannot start (here its state file's lock is held,
// as by a killed head's threads that have not all left yet) is tried again
// after a pause that grows (none, then 250 ms, 500 ms, ...). Started again
// at once, it died five times within milliseconds and the supervisor gave
// up. Once the lock is free, the next try serves with the cluster's tables.
TEST_F(LauncherTest, SupervisedHeadThatCannotStartIsTriedAgainAfterAPause) {
  const std::string dir = dir_.string();
  pid_t supervisor = 0, first = 0;
  ASSERT_NO_FATAL_FAILURE(start_supervised("--resources CPU=1,GPU=0", &supervisor, &first));
  troupe::Runtime rt = troupe::Runtime::connect(session_cluster());
  rt.kv().put("before", "1");
  // The supervisor held still until the lock is taken, so that no restart
  // comes between the head's end and the test's flock.
  ASSERT_EQ(::kill(supervisor, SIGSTOP), 0);
  ASSERT_EQ(::kill(first, SIGKILL), 0);
  const int lock = ::open((dir_ / "head.sqlite.lock").c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(lock, 0);
  ASSERT_TRUE(troupe::test::eventually([&] { return ::flock(lock, LOCK_EX | LOCK_NB) == 0; }));
  ASSERT_EQ(::kill(supervisor, SIGCONT), 0);
  const bool paused = troupe::test::eventually([&] {
    return troupe::core::read_session_file(dir, "head.log").find(" in 500 ms (restart ") != std::string::npos;
  });
  ::close(lock);
  ASSERT_TRUE(paused) << troupe::core::read_session_file(dir, "head.log");
  EXPECT_TRUE(troupe::test::eventually([&] {
    try {
      return rt.kv().get("before") == std::optional<std::string>("1");
    } catch (const troupe::Error&) {
      return false;  // the driver's own reconnection is still under way
    }
  }));
  const auto log = troupe::core::read_session_file(dir, "head.log");
  EXPECT_NE(log.find(" in 250 ms (restart "), std::string::npos) << log;
  EXPECT_EQ(log.find("giving up"), std::string::npos) << log;
  EXPECT_TRUE(troupe::test::process_gone(first));
}

// A stop signal reaches a supervised head that has not served yet (a
// restarted one writing back its tables, held up by its file's write lock,
// then SIGSTOPped): the supervisor passes it on with a SIGCONT and both
// end, so troupe stop kills nothing after its grace period. The supervisor
// used to read the head's ready line with its stop signals blocked, and to
// send a stopped head a SIGTERM it never took.
TEST_F(LauncherTest, SupervisedHeadStoppedBeforeItServesEndsWithoutAKill) {
  pid_t supervisor = 0, first = 0;
  ASSERT_NO_FATAL_FAILURE(start_supervised("--resources CPU=1,GPU=0", &supervisor, &first));
  ASSERT_EQ(::kill(supervisor, SIGSTOP), 0);
  ASSERT_EQ(::kill(first, SIGKILL), 0);
  ASSERT_TRUE(troupe::test::eventually([&] { return state_lock_free(dir_); }));
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open((dir_ / "head.sqlite").c_str(), &db), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(db, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr), SQLITE_OK);
  ASSERT_EQ(::kill(supervisor, SIGCONT), 0);
  pid_t second = 0;
  const bool restarted = troupe::test::eventually([&] {
    second = child_of(supervisor);
    return second > 0 && second != first;
  });
  if (restarted) ::kill(second, SIGSTOP);
  sqlite3_exec(db, "ROLLBACK", nullptr, nullptr, nullptr);
  sqlite3_close(db);
  ASSERT_TRUE(restarted) << "the supervisor " << supervisor << " did not start the head again";
  auto stop = run(cli() + " stop --grace-period 20");
  EXPECT_EQ(stop.status, 0) << stop.output;
  EXPECT_EQ(stop.output.find("killed after the grace period"), std::string::npos) << stop.output;
  EXPECT_TRUE(troupe::test::eventually([&] { return troupe::test::process_gone(supervisor); }));
  EXPECT_TRUE(troupe::test::eventually([&] { return troupe::test::process_gone(second); }));
}

// `troupe session` names the directory the other commands use, for
// scripts that read its token or pid files.
TEST_F(LauncherTest, SessionPrintsTheSessionDirectory) {
  auto r = run(std::string(TROUPE_CLI) + " session");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output, dir_.string() + "\n");
}

TEST_F(LauncherTest, ClearErrorsWithoutACluster) {
  // No cluster is a failure (1) for every command that needs one, not a
  // usage error (2): submit used to say 2.
  for (const char* command : {" status", " logs", " submit -- true"}) {
    auto r = run(std::string(TROUPE_CLI) + command);
    EXPECT_EQ(WEXITSTATUS(r.status), 1) << command << ": " << r.output;
    EXPECT_NE(r.output.find("no running cluster"), std::string::npos) << command << ": " << r.output;
  }
  auto join = run(std::string(TROUPE_CLI) + " start --address 127.0.0.1:1");
  EXPECT_NE(join.status, 0);
  EXPECT_NE(join.output.find("token"), std::string::npos) << join.output;
  // A driver without a token at an address where nothing listens: said as
  // that, not as a token to find (there is no head to need one).
  auto nobody = run(cli() + " status --address 127.0.0.1:1");
  EXPECT_NE(nobody.status, 0);
  EXPECT_NE(nobody.output.find("cannot connect to 127.0.0.1:1: Connection refused"), std::string::npos)
      << nobody.output;
  EXPECT_EQ(nobody.output.find("token"), std::string::npos) << nobody.output;
  // stop --address of another cluster: a malformed one is a usage error, an
  // unreachable one fails; neither is taken for this session's own stop.
  auto garbage = run(cli() + " stop --address garbage");
  EXPECT_EQ(WEXITSTATUS(garbage.status), 2) << garbage.output;
  EXPECT_NE(garbage.output.find("--address garbage: "), std::string::npos) << garbage.output;
  // So is it for every command that takes one (start, status, logs said 1).
  for (const char* command : {" status", " logs", " start"}) {
    auto r = run(cli() + command + " --address http://127.0.0.1:6380");
    EXPECT_EQ(WEXITSTATUS(r.status), 2) << command << ": " << r.output;
    EXPECT_NE(r.output.find("--address http://127.0.0.1:6380: "), std::string::npos) << command << ": " << r.output;
    EXPECT_NE(r.output.find("leave out the 'http://'"), std::string::npos) << command << ": " << r.output;
  }
  auto gone = run(cli() + " stop --address 127.0.0.1:1");
  EXPECT_EQ(WEXITSTATUS(gone.status), 1) << gone.output;
  EXPECT_NE(gone.output.find("the head at 127.0.0.1:1 was not stopped"), std::string::npos) << gone.output;
  EXPECT_EQ(gone.output.find("local"), std::string::npos) << gone.output;
}

// A head stopped from another host (`troupe stop --address`) leaves its
// own session's files behind: `troupe status` there said "Connection
// refused"; it says the head has exited, and `troupe stop` clears them.
TEST_F(LauncherTest, StatusOfASessionWhoseHeadWasStoppedElsewhereSaysSo) {
  auto head = run(cli() + " start --head --port 0 --resources CPU=1,GPU=0");
  ASSERT_EQ(head.status, 0) << head.output;
  const std::string dir = dir_.string();
  const std::string address = troupe::core::read_session_file(dir, "address");
  const std::string token = troupe::core::read_session_file(dir, "token");
  const auto elsewhere = dir_ / "elsewhere";
  std::filesystem::create_directories(elsewhere);
  std::filesystem::permissions(elsewhere, std::filesystem::perms::owner_all);
  std::string stop_elsewhere = "TROUPE_SESSION_DIR=";  // in steps: GCC 12's -Warray-bounds misreads one expression
  stop_elsewhere += elsewhere.string();
  stop_elsewhere += " TROUPE_TOKEN=" + token;
  stop_elsewhere += " " + cli() + " stop --address " + address;
  auto stop = run(stop_elsewhere);
  ASSERT_EQ(stop.status, 0) << stop.output;
  const auto head_pid = troupe::core::check_pid_file(dir, "head.pid").pid;
  ASSERT_GT(head_pid, 0);
  std::string said = "no cluster runs in session ";
  said += dir;
  said += ": its head (pid " + std::to_string(head_pid) + ") has exited";
  // Once the head and its node agent have both exited.
  CommandResult status{0, ""};
  std::string status_command = cli();
  status_command += " status";
  EXPECT_TRUE(troupe::test::eventually([&] {
    status = run(status_command);
    return status.output.find(said) != std::string::npos;
  })) << status.output;
  EXPECT_EQ(WEXITSTATUS(status.status), 1) << status.output;
  auto clear = run(cli() + " stop");
  EXPECT_EQ(clear.status, 0) << clear.output;
  EXPECT_FALSE(std::filesystem::exists(dir_ / "head.pid"));
}

TEST_F(LauncherTest, PortOutOfRangeIsRefused) {
  for (std::string port : {"70000", "-5"}) {
    auto r = run(cli() + " start --head --port " + port);
    ASSERT_TRUE(WIFEXITED(r.status)) << r.output;
    EXPECT_EQ(WEXITSTATUS(r.status), 2) << r.output;
    EXPECT_NE(r.output.find("--port"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(port), std::string::npos) << r.output;
    EXPECT_TRUE(troupe::core::read_session_file(dir_.string(), "head.pid").empty());
  }
}

// Every bad value of a `troupe start` option, whether CLI11 or troupe finds
// it, is a usage error (exit code 2) said in one line naming the option and
// the value; --help still exits 0.
TEST_F(LauncherTest, BadStartValuesAreUsageErrorsNamingOptionAndValue) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--worker-pool-size", "100"},    {"--worker-pool-size", "-1"},  {"--worker-idle-timeout", "0"},
      {"--worker-idle-timeout", "abc"}, {"--heartbeat-ms", "5"},       {"--resources", "CPU=x"},
      {"--max-dead-actors", "-1"},      {"--dashboard-port", "70000"}, {"--port", "abc"},
      {"--heartbeat-ms", "1e3"},        {"--heartbeat-misses", "2.5"}, {"--worker-assign-timeout", "0"},
  };
  for (const auto& [option, value] : cases) {
    auto r = run(cli() + " start --head " + option + " " + value);
    const std::string what = option + " " + value + ": " + r.output;
    ASSERT_TRUE(WIFEXITED(r.status)) << what;
    EXPECT_EQ(WEXITSTATUS(r.status), 2) << what;
    EXPECT_NE(r.output.find(option), std::string::npos) << what;
    EXPECT_NE(r.output.find(value), std::string::npos) << what;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << what;
    EXPECT_TRUE(troupe::core::read_session_file(dir_.string(), "head.pid").empty()) << what;
  }
  // Said as what is wrong with it: 1000 is in range, 1e3 is no whole number.
  auto exp = run(cli() + " start --head --heartbeat-ms 1e3");
  EXPECT_NE(exp.output.find("1e3 is not a whole number"), std::string::npos) << exp.output;
  auto word = run(cli() + " start --head --port abc");
  EXPECT_NE(word.output.find("abc is not a number"), std::string::npos) << word.output;
  auto negative = run(cli() + " start --head --worker-pool-size -1");
  EXPECT_NE(negative.output.find("-1 is not in [0, 64]"), std::string::npos) << negative.output;
  auto far = run(cli() + " start --head --heartbeat-ms 5");
  EXPECT_NE(far.output.find("5 is not in [10, 60000]"), std::string::npos) << far.output;
  // Each in range, their product over a day: it wrapped the agents' 32-bit
  // fence time.
  auto day = run(cli() + " start --head --heartbeat-ms 60000 --heartbeat-misses 100000");
  EXPECT_EQ(WEXITSTATUS(day.status), 2) << day.output;
  EXPECT_NE(day.output.find("--heartbeat-ms 60000 × --heartbeat-misses 100000 = 6000000000 ms before a silent node "
                            "is fenced, over 86400000 (a day)"),
            std::string::npos)
      << day.output;
  auto help = run(cli() + " start --help");
  ASSERT_TRUE(WIFEXITED(help.status));
  EXPECT_EQ(WEXITSTATUS(help.status), 0) << help.output;
}

TEST_F(LauncherTest, HeadThatFailsAtOnceIsReportedWithItsExitStatus) {
  SilentService taken;  // holds the port the head is asked for
  auto r = run(cli() + " start --head --port " + std::to_string(taken.port()));
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("exited with code"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("Address already in use"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("bind 127.0.0.1:" + std::to_string(taken.port())), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("did not become ready"), std::string::npos) << r.output;
}

TEST_F(LauncherTest, AddressOfAForeignServiceFailsFastAndPersistsNothing) {
  SilentService other;
  auto r = run("TROUPE_TOKEN=abc " + cli() + " start --address " + other.address());
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find(other.address() + " did not answer the troupe handshake"), std::string::npos) << r.output;
  EXPECT_TRUE(troupe::core::read_session_file(dir_.string(), "token").empty());
  EXPECT_TRUE(troupe::core::read_session_file(dir_.string(), "address").empty());
}

TEST_F(LauncherTest, UnsafeSessionDirectoryIsRefused) {
  std::filesystem::permissions(dir_, std::filesystem::perms::all);  // 0777
  auto open = run(cli() + " start --head --port 0 --no-node");
  EXPECT_NE(open.status, 0) << open.output;
  EXPECT_NE(open.output.find(dir_.string()), std::string::npos) << open.output;
  EXPECT_NE(open.output.find("0777"), std::string::npos) << open.output;
  EXPECT_FALSE(std::filesystem::exists(dir_ / "token"));
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to chown the directory to another user (CI runs as root)";
  std::filesystem::permissions(dir_, std::filesystem::perms::owner_all);
  ASSERT_EQ(::chown(dir_.c_str(), 65534, 65534), 0);  // nobody
  auto theirs = run(cli() + " start --head --port 0 --no-node");
  EXPECT_NE(theirs.status, 0) << theirs.output;
  EXPECT_NE(theirs.output.find("uid 65534"), std::string::npos) << theirs.output;
  EXPECT_FALSE(std::filesystem::exists(dir_ / "token"));
  ASSERT_EQ(::chown(dir_.c_str(), ::geteuid(), ::getegid()), 0);
}

TEST_F(LauncherTest, PlantedPidFileDoesNotGetItsProcessKilled) {
  pid_t victim = ::fork();
  if (victim == 0) {
    ::execl("/bin/sleep", "sleep", "60", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ASSERT_GT(victim, 0);
  std::string dir = dir_.string();
  troupe::core::write_session_file(dir, "head.pid", std::to_string(victim) + "\n");          // old format
  troupe::core::write_session_file(dir, "node-9.pid", std::to_string(victim) + " 12345\n");  // wrong start time
  auto stop = run(cli() + " stop");
  EXPECT_EQ(stop.status, 0) << stop.output;
  EXPECT_NE(stop.output.find("ignoring"), std::string::npos) << stop.output;
  int st = 0;
  EXPECT_EQ(::waitpid(victim, &st, WNOHANG), 0) << "troupe stop killed an unrelated process";
  ::kill(victim, SIGKILL);
  ::waitpid(victim, &st, 0);
}

TEST_F(LauncherTest, WildcardHeadAdvertisesAReachableAddressAndAWrongTokenIsNotPersisted) {
  auto head = run(cli() + " start --head --host 0.0.0.0 --advertise-address 127.0.0.1 --port 0 --no-node");
  ASSERT_EQ(head.status, 0) << head.output;
  EXPECT_EQ(head.output.find("warning"), std::string::npos) << head.output;  // 127.0.0.1 leads to 0.0.0.0
  std::string address = troupe::core::read_session_file(dir_.string(), "address");
  EXPECT_EQ(address.rfind("127.0.0.1:", 0), 0u) << address;
  auto status = run(cli() + " status --json");
  ASSERT_EQ(status.status, 0) << status.output;
  EXPECT_EQ(nlohmann::json::parse(status.output)["address"], address);
  // A node joining with a wrong token fails at once and writes nothing.
  auto other = dir_ / "other";
  std::filesystem::create_directory(other);
  std::filesystem::permissions(other, std::filesystem::perms::owner_all);
  auto join = run("TROUPE_SESSION_DIR=" + other.string() + " TROUPE_TOKEN=wrong " + cli() + " start --address " +
                  address + " --resources CPU=1,GPU=0");
  EXPECT_NE(join.status, 0) << join.output;
  EXPECT_NE(join.output.find("a wrong cluster token"), std::string::npos) << join.output;
  EXPECT_FALSE(std::filesystem::exists(other / "token"));
}

// An --advertise-address that does not lead back to where the head or the
// node's workers listen (here 127.0.0.2, while they listen on 127.0.0.1
// alone) is warned of as the command starts them; before, they started
// without a word and drivers' calls failed later.
TEST_F(LauncherTest, AnAdvertisedAddressThatDoesNotLeadHereIsWarnedOf) {
  auto head = run(cli() + " start --head --host 127.0.0.1 --advertise-address 127.0.0.2 --port 0 --no-node " +
                  "--dashboard-port -1");
  ASSERT_EQ(head.status, 0) << head.output;
  EXPECT_NE(head.output.find("warning: --advertise-address 127.0.0.2 does not reach this head"), std::string::npos)
      << head.output;
  run(cli() + " stop");
  head = run(cli() + " start --head --port 0 --no-node --dashboard-port -1");
  ASSERT_EQ(head.status, 0) << head.output;
  EXPECT_EQ(head.output.find("warning"), std::string::npos) << head.output;
  const std::string address = troupe::core::read_session_file(dir_.string(), "address");
  const std::filesystem::path joined = dir_ / "joined";
  std::filesystem::create_directories(joined);
  std::filesystem::permissions(joined, std::filesystem::perms::owner_all);
  const std::string in_joined = "TROUPE_SESSION_DIR=" + joined.string() +
                                " TROUPE_TOKEN=" + troupe::core::read_session_file(dir_.string(), "token") + " ";
  auto node = run(in_joined + cli() + " start --address " + address +
                  " --host 127.0.0.1 --advertise-address 127.0.0.2 --resources CPU=1,GPU=0");
  EXPECT_EQ(node.status, 0) << node.output;
  EXPECT_NE(node.output.find("warning: --advertise-address 127.0.0.2 does not reach this node's workers"),
            std::string::npos)
      << node.output;
  EXPECT_NE(node.output.find("127.0.0.2:"), std::string::npos) << node.output;  // the address it tried
  run(in_joined + cli() + " stop");
}

// A head behind a NAT without hairpinning advertises an address that does
// not lead back from its own machine (here 127.0.0.2, while it listens on
// 127.0.0.1 alone): its own node agent joins it where it listens. Before,
// the agent joined through the advertised address and the start failed.
TEST_F(LauncherTest, AHeadsOwnNodeJoinsWhereTheHeadListensNotWhereItIsAdvertised) {
  auto head = run(cli() + " start --head --host 127.0.0.1 --advertise-address 127.0.0.2 --port 0 " +
                  "--dashboard-port -1 --resources CPU=1,GPU=0");
  ASSERT_EQ(head.status, 0) << head.output;
  EXPECT_NE(head.output.find("warning: --advertise-address 127.0.0.2 does not reach this head"), std::string::npos)
      << head.output;
  const std::string address = troupe::core::read_session_file(dir_.string(), "address");
  ASSERT_EQ(address.rfind("127.0.0.2:", 0), 0u) << address;
  const std::string listening = "127.0.0.1:" + address.substr(address.find(':') + 1);
  auto status = run(cli() + " status --json --address " + listening);
  ASSERT_EQ(status.status, 0) << status.output;
  const auto j = nlohmann::json::parse(status.output);
  ASSERT_EQ(j["nodes"].size(), 1u) << status.output;
  EXPECT_TRUE(j["nodes"][0]["alive"].get<bool>()) << status.output;
  // Its workers listen, and are reached, where the head listens.
  EXPECT_EQ(j["nodes"][0]["address"], "127.0.0.1") << status.output;
}

// Options that do not fit together are usage errors (exit code 2) naming
// the option, before anything starts.
TEST_F(LauncherTest, StartOptionsThatDoNotFitAreRefusedNamingThem) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {" start --head --address 127.0.0.1:1 --no-node", "--address 127.0.0.1:1"},
      {" start --address 127.0.0.1:1 --heartbeat-ms 50", "--heartbeat-ms"},
      {" start --address 127.0.0.1:1 --supervise", "--supervise"},
      {" start --head --hang-timeout 5", "--supervise"},
      {" start --head --supervise --hang-timeout -1", "--hang-timeout"},
      {" start --head --no-node --resources CPU=1", "--resources"},
      {" start --head --no-node --advertise-address 'bad host'", "'bad host'"},
      // Neither --head nor --address: the head's option is named all the same.
      {" start --port 6390", "--port is an option of the head"},
      // The file given was ignored without a word.
      {" start --head --state-db x.sqlite --no-state-db", "--state-db"},
      // An empty name read as none: the head's log was printed.
      {" logs --name ''", "an actor's name is not empty"},
  };
  for (const auto& [args, named] : cases) {
    auto r = run(cli() + args);
    ASSERT_TRUE(WIFEXITED(r.status)) << args;
    EXPECT_EQ(WEXITSTATUS(r.status), 2) << args << ": " << r.output;
    EXPECT_NE(r.output.find(named), std::string::npos) << args << ": " << r.output;
    EXPECT_FALSE(std::filesystem::exists(dir_ / "head.pid")) << args;
  }
}

// The head's pid from "head started (pid N) ...", or 0.
pid_t started_head_pid(const std::string& output) {
  const std::string mark = "head started (pid ";
  const size_t at = output.find(mark);
  return at == std::string::npos ? 0 : std::stoi(output.substr(at + mark.size()));
}

// The head starts, its node agent cannot reach it at the address it
// advertises (127.0.0.2: the head listens on 127.0.0.1 only): the command
// fails and stops the head it started, leaving no head behind.
TEST_F(LauncherTest, HeadWhoseNodeAgentFailsIsStoppedAgain) {
  // A setting only the node agent reads, and refuses, as it starts.
  auto r = run("TROUPE_WORKER_MALLOC=bogus " + cli() + " start --head --port 0 --dashboard-port -1");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("TROUPE_WORKER_MALLOC='bogus'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("stopped again"), std::string::npos) << r.output;
  const pid_t head = started_head_pid(r.output);
  ASSERT_GT(head, 0) << r.output;
  EXPECT_TRUE(troupe::test::eventually([&] { return troupe::test::process_gone(head); }));
  EXPECT_FALSE(std::filesystem::exists(dir_ / "head.pid"));
  EXPECT_FALSE(std::filesystem::exists(dir_ / "address"));
}

// A head restarted after a crash whose node agent then fails to start is
// undone without ending the cluster: the state it reloaded is there for the
// next start. Stopped with SIGTERM, it emptied the state db (a stop ends a
// cluster for good) and told those that had come back that it had ended.
TEST_F(LauncherTest, AFailedRestartOfACrashedHeadKeepsItsState) {
  auto first = run(cli() + " start --head --port 0 --dashboard-port -1 --resources CPU=1,GPU=0");
  ASSERT_EQ(first.status, 0) << first.output;
  {
    troupe::Runtime rt = troupe::Runtime::connect(session_cluster());
    rt.kv().put("kept", "1");
    rt.shutdown();
  }
  // The machine's crash: head and agent SIGKILLed.
  ASSERT_EQ(::kill(started_head_pid(first.output), SIGKILL), 0);
  for (const auto& e : std::filesystem::directory_iterator(dir_)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("node-", 0) == 0 && name.size() > 4 && name.substr(name.size() - 4) == ".pid") {
      const auto cut = name.rfind('-');
      ::kill(std::stoi(name.substr(cut + 1, name.size() - 4 - cut - 1)), SIGKILL);
    }
  }
  ASSERT_TRUE(troupe::test::eventually([&] { return state_lock_free(dir_); }));
  auto failed = run("TROUPE_WORKER_MALLOC=bogus " + cli() + " start --head --port 0 --dashboard-port -1");
  EXPECT_NE(failed.status, 0) << failed.output;
  EXPECT_NE(failed.output.find("stopped again"), std::string::npos) << failed.output;
  const pid_t undone = started_head_pid(failed.output);
  ASSERT_GT(undone, 0) << failed.output;
  ASSERT_TRUE(troupe::test::eventually([&] { return troupe::test::process_gone(undone); }));
  ASSERT_TRUE(troupe::test::eventually([&] { return state_lock_free(dir_); }));
  auto again = run(cli() + " start --head --port 0 --dashboard-port -1 --resources CPU=1,GPU=0");
  ASSERT_EQ(again.status, 0) << again.output;
  troupe::Runtime rt = troupe::Runtime::connect(session_cluster());
  EXPECT_EQ(rt.kv().get("kept"), std::optional<std::string>("1"));
}

// `troupe start --block` in the foreground, stopped by Ctrl-C, or by its
// terminal closing (SIGHUP, whose default action ended it alone): what it
// started ends with it, and so do their pid files and the head's address,
// so the session reads as having no cluster (not as a head that refuses).
TEST_F(LauncherTest, ABlockingStartStoppedByCtrlCLeavesNoClusterBehind) {
  for (const int signal : {SIGINT, SIGHUP}) {
    SCOPED_TRACE(signal == SIGINT ? "SIGINT" : "SIGHUP");
    stop_a_blocking_start_with(signal);
  }
}

void LauncherTest::stop_a_blocking_start_with(int signal) {
  const std::string out = (dir_ / "block.out").string();
  std::filesystem::remove(out);  // an earlier start's words are not this one's
  const pid_t start = ::fork();
  ASSERT_GE(start, 0);
  if (start == 0) {
    const int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::execl(TROUPE_CLI, TROUPE_CLI, "start", "--head", "--port", "0", "--dashboard-port", "-1", "--block",
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  const auto printed = [&] { return troupe::core::read_session_file(dir_.string(), "block.out"); };
  auto node_pid_file = [&] {
    for (const auto& e : std::filesystem::directory_iterator(dir_))
      if (e.path().filename().string().rfind("node-", 0) == 0 && e.path().extension() == ".pid") return true;
    return false;
  };
  const bool up =
      troupe::test::eventually([&] { return printed().find("running in the foreground") != std::string::npos; });
  EXPECT_TRUE(node_pid_file());
  const pid_t head = started_head_pid(printed());
  ::kill(start, signal);
  int st = 0;
  EXPECT_TRUE(troupe::test::eventually([&] { return ::waitpid(start, &st, WNOHANG) == start; }));
  ASSERT_TRUE(up) << printed();
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << st;
  ASSERT_GT(head, 0);
  EXPECT_TRUE(troupe::test::process_gone(head));
  EXPECT_FALSE(std::filesystem::exists(dir_ / "head.pid"));
  EXPECT_FALSE(node_pid_file());
  EXPECT_FALSE(std::filesystem::exists(dir_ / "address"));
  auto status = run(cli() + " status");
  EXPECT_NE(status.status, 0);
  EXPECT_NE(status.output.find("no running cluster"), std::string::npos) << status.output;
}

// As a container's PID 1 (a pod of deploy/kubernetes/nodes.yaml), `troupe
// start --block` waiting for its head stops on SIGTERM: PID 1 gets no
// signal whose action is the default, and the pod waited out its grace
// period (the wait here is 600 s).
TEST_F(LauncherTest, ABlockingStartAsPid1StopsOnSigtermWhileWaitingForItsHead) {
  const std::string out = (dir_ / "pid1.out").string();
  const pid_t unshare = ::fork();
  ASSERT_GE(unshare, 0);
  if (unshare == 0) {
    const int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::setenv("TROUPE_TOKEN", "pid-one", 1);
    ::execlp("unshare", "unshare", "--pid", "--fork", TROUPE_CLI, "start", "--address", "127.0.0.1:1",
             "--wait-for-head", "600", "--block", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  const auto printed = [&] { return troupe::core::read_session_file(dir_.string(), "pid1.out"); };
  const bool waiting =
      troupe::test::eventually([&] { return printed().find("waiting for the head") != std::string::npos; });
  const pid_t init = child_of(unshare);
  int st = 0;
  if (!waiting || init <= 0 || ::kill(init, SIGTERM) != 0) {
    ::kill(unshare, SIGKILL);
    ::waitpid(unshare, &st, 0);
    if (printed().find("unshare failed") != std::string::npos) GTEST_SKIP() << "no PID namespace here: " << printed();
    FAIL() << "not waiting for its head as PID 1: " << printed();
  }
  const bool ended = troupe::test::eventually([&] { return ::waitpid(unshare, &st, WNOHANG) == unshare; });
  if (!ended) {
    ::kill(init, SIGKILL);
    ::waitpid(unshare, &st, 0);
  }
  EXPECT_TRUE(ended) << "SIGTERM to PID 1 was dropped: " << printed();
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << st << ": " << printed();
  EXPECT_NE(printed().find("while waiting for the head: stopped"), std::string::npos) << printed();
}

// Two `troupe start --head` at once in one session: one head starts, the
// other command finds it and fails; troupe stop leaves no head running.
TEST_F(LauncherTest, TwoHeadStartsAtOnceStartOneHead) {
  const std::string start = cli() + " start --head --no-node --port 0 --dashboard-port -1";
  auto r = run("(" + start + " > " + (dir_ / "a.out").string() + " 2>&1; echo $? >> " + (dir_ / "a.out").string() +
               ") & " + start + " 2>&1; wait");
  const std::string both = r.output + troupe::core::read_session_file(dir_.string(), "a.out");
  std::vector<pid_t> heads;
  for (size_t at = 0; (at = both.find("head started (pid ", at)) != std::string::npos; ++at)
    heads.push_back(started_head_pid(both.substr(at)));
  EXPECT_EQ(heads.size(), 1u) << both;
  EXPECT_NE(both.find("a head is already running"), std::string::npos) << both;
  auto stop = run(cli() + " stop");
  EXPECT_EQ(stop.status, 0) << stop.output;
  for (pid_t h : heads) EXPECT_TRUE(troupe::test::eventually([&] { return troupe::test::process_gone(h); })) << h;
}

// troupe stop with the head gone (SIGKILLed) empties its state db all the
// same, as the head does when told: the next head starts a new cluster
// rather than reloading the stopped one.
TEST_F(LauncherTest, StopWithTheHeadGoneEmptiesItsStateDb) {
  auto r = run(cli() + " start --head --no-node --port 0 --dashboard-port -1");
  ASSERT_EQ(r.status, 0) << r.output;
  const pid_t head = started_head_pid(r.output);
  ASSERT_GT(head, 0) << r.output;
  ASSERT_TRUE(std::filesystem::exists(dir_ / "head.sqlite"));
  ASSERT_EQ(::kill(head, SIGKILL), 0);
  ASSERT_TRUE(troupe::test::eventually([&] { return troupe::test::process_gone(head); }));
  auto stop = run(cli() + " stop");
  EXPECT_EQ(stop.status, 0) << stop.output;
  EXPECT_NE(stop.output.find("head not reachable"), std::string::npos) << stop.output;
  EXPECT_FALSE(std::filesystem::exists(dir_ / "head.sqlite")) << stop.output;
  auto again = run(cli() + " start --head --no-node --port 0 --dashboard-port -1");
  ASSERT_EQ(again.status, 0) << again.output;
  EXPECT_EQ(troupe::core::read_session_file(dir_.string(), "head.log").find("reloading"), std::string::npos);
}

// A relative --state-db is the file where `troupe start` ran: the session
// recorded it as typed, and `troupe stop` run from elsewhere removed (and
// said it removed) a file of that name there, leaving the head's, which
// the next head reloaded.
TEST_F(LauncherTest, ARelativeStateDbIsTheFileWhereStartRan) {
  const auto where = dir_ / "started-here";
  std::filesystem::create_directories(where);
  auto r = run("cd '" + where.string() + "' && " + cli() +
               " start --head --no-node --port 0 --dashboard-port -1 --state-db relative.sqlite");
  ASSERT_EQ(r.status, 0) << r.output;
  const pid_t head = started_head_pid(r.output);
  ASSERT_GT(head, 0) << r.output;
  ASSERT_TRUE(std::filesystem::exists(where / "relative.sqlite")) << r.output;
  EXPECT_EQ(troupe::core::read_session_file(dir_.string(), "state_db"), (where / "relative.sqlite").string());
  ASSERT_EQ(::kill(head, SIGKILL), 0);
  ASSERT_TRUE(troupe::test::eventually([&] { return troupe::test::process_gone(head); }));
  auto stop = run("cd / && " + cli() + " stop");
  EXPECT_EQ(stop.status, 0) << stop.output;
  EXPECT_FALSE(std::filesystem::exists(where / "relative.sqlite")) << stop.output;
}

// A state db that another troupe version wrote (rows of another format),
// or a damaged one, stops the head at its start with a message naming the
// file and what to do, not a decoder's words; nothing is overwritten.
TEST_F(LauncherTest, AStateDbOfAnotherFormatOrDamagedIsRefusedByName) {
  const std::string db = (dir_ / "head.sqlite").string();
  for (const bool marked : {false, true}) {
    SCOPED_TRACE(marked ? "damaged" : "another format");
    std::filesystem::remove(db);
    {
      troupe::head::HeadStore store(db);
      if (marked) store.check_format(troupe::head::HeadState::kRowFormat);
      store.write({{"a/1", std::string("\x01\x02\x03")}});
    }
    auto r = run(cli() + " start --head --no-node --port 0 --dashboard-port -1");
    EXPECT_NE(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("head state file " + db), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(marked ? "has a row this head cannot read" : "in format 0 (unmarked)"), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("--no-state-db"), std::string::npos) << r.output;
    EXPECT_EQ(troupe::head::HeadStore(db).load().size(), 1u);
  }
}

// Job documents come from the KV store, where any client writes: a
// diverged job's loss (null in JSON) shows as nan, and a malformed
// document shows as "?" instead of failing the whole status (it stopped
// the output at the first job, exit 1).
TEST_F(LauncherTest, StatusShowsADivergedJobsLossAsNanAndSurvivesAMalformedJob) {
  auto head = run(cli() + " start --head --no-node --port 0 --dashboard-port -1");
  ASSERT_EQ(head.status, 0) << head.output;
  const troupe::InitOptions o = session_cluster();
  troupe::Runtime rt = troupe::Runtime::connect(o);
  rt.kv().put("troupe.jobs/diverged", R"({"name":"diverged","state":"running","step":120,"loss":null})");
  rt.kv().put("troupe.jobs/evil", R"({"name":5,"state":7,"step":"x","loss":"low"})");
  // One the head leaves unread (over 1 MiB): said, with no figures.
  rt.kv().put("troupe.jobs/huge", R"({"name":"huge","pad":")" + std::string(2 << 20, 'x') + R"("})");
  auto status = run(cli() + " status");
  EXPECT_EQ(status.status, 0) << status.output;
  EXPECT_NE(status.output.find("loss nan"), std::string::npos) << status.output;
  EXPECT_NE(status.output.find("job ?"), std::string::npos) << status.output;
  EXPECT_NE(status.output.find("job huge             unknown   its progress document is"), std::string::npos)
      << status.output;
}

// `troupe stop` in a session that only joined a cluster stops its own node
// agent, as `ray stop` does; it used to shut the whole cluster down.
TEST_F(LauncherTest, StopInASessionThatJoinedStopsItsNodeAlone) {
  auto head = run(cli() + " start --head --no-node --port 0 --dashboard-port -1");
  ASSERT_EQ(head.status, 0) << head.output;
  const std::string address = troupe::core::read_session_file(dir_.string(), "address");
  const std::filesystem::path joined = dir_ / "joined";
  std::filesystem::create_directories(joined);
  std::filesystem::permissions(joined, std::filesystem::perms::owner_all);
  std::string in_joined = "TROUPE_SESSION_DIR=" + joined.string();
  in_joined += " TROUPE_TOKEN=" + troupe::core::read_session_file(dir_.string(), "token");
  in_joined += ' ';
  // `--address auto` is this session's cluster, as the default is (it
  // stopped the whole cluster).
  for (const std::string how : {"", " --address auto"}) {
    SCOPED_TRACE("troupe stop" + how);
    auto node = run(in_joined + cli() + " start --address " + address + " --resources CPU=1,GPU=0");
    ASSERT_EQ(node.status, 0) << node.output;
    ASSERT_EQ(alive_nodes(), 1);
    auto stop = run(in_joined + cli() + " stop" + how);
    EXPECT_EQ(stop.status, 0) << stop.output;
    EXPECT_NE(stop.output.find("this session runs no head"), std::string::npos) << stop.output;
    // The head serves on; the node that left is seen gone.
    EXPECT_TRUE(troupe::test::eventually([&] { return alive_nodes() == 0; }));
    EXPECT_EQ(run(cli() + " status").status, 0);
  }
}

// A session that runs a head and joins another cluster has two node 1s:
// each keeps a pid file of its own (the second overwrote the first, and a
// stop then signalled the other cluster's agent, leaving this one's).
TEST_F(LauncherTest, NodeAgentsOfTwoClustersInOneSessionKeepTheirOwnPidFiles) {
  const std::filesystem::path other = dir_ / "other";
  std::filesystem::create_directories(other);
  std::filesystem::permissions(other, std::filesystem::perms::owner_all);
  const std::string in_other = "TROUPE_SESSION_DIR=" + other.string() + " ";
  auto b = run(in_other + cli() + " start --head --no-node --port 0 --dashboard-port -1");
  ASSERT_EQ(b.status, 0) << b.output;
  auto a = run(cli() + " start --head --port 0 --dashboard-port -1 --resources CPU=1,GPU=0");
  ASSERT_EQ(a.status, 0) << a.output;
  const std::string b_address = troupe::core::read_session_file(other.string(), "address");
  const std::string b_token = troupe::core::read_session_file(other.string(), "token");
  auto join =
      run("TROUPE_TOKEN=" + b_token + " " + cli() + " start --address " + b_address + " --resources CPU=1,GPU=0");
  ASSERT_EQ(join.status, 0) << join.output;
  std::vector<pid_t> agents;
  for (const auto& e : std::filesystem::directory_iterator(dir_))
    if (e.path().filename().string().rfind("node-1-", 0) == 0 && e.path().extension() == ".pid")
      agents.push_back(std::stoi(troupe::core::read_session_file(dir_.string(), e.path().filename().string())));
  ASSERT_EQ(agents.size(), 2u);
  EXPECT_NE(agents[0], agents[1]);
  auto stop = run(cli() + " stop");
  EXPECT_EQ(stop.status, 0) << stop.output;
  for (pid_t agent : agents) EXPECT_TRUE(troupe::test::eventually([&] { return troupe::test::process_gone(agent); }));
  run(in_other + cli() + " stop");
}

// TROUPE_HEAD_RECONNECT_MS, how long agents and workers wait for a durable
// head that went away, reaches the node agents `troupe start` runs as
// daemons (their cleaned environment dropped it: they waited 30 s); a bad
// value is refused by name.
TEST_F(LauncherTest, HeadReconnectFromTheEnvironmentReachesTheNodeAgents) {
  auto r = run("TROUPE_HEAD_RECONNECT_MS=120000 " + cli() + " start --head --port 0 --dashboard-port -1 " +
               "--resources CPU=1,GPU=0");
  ASSERT_EQ(r.status, 0) << r.output;
  pid_t agent = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir_))
    if (e.path().filename().string().rfind("node-", 0) == 0 && e.path().extension() == ".pid")
      agent = std::stoi(troupe::core::read_session_file(dir_.string(), e.path().filename().string()));
  ASSERT_GT(agent, 0);
  std::ifstream in("/proc/" + std::to_string(agent) + "/environ");
  std::string environ((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(environ.find(std::string("TROUPE_HEAD_RECONNECT_MS=120000") + '\0'), std::string::npos);
  run(cli() + " stop");
  auto bad = run("TROUPE_HEAD_RECONNECT_MS=soon " + cli() + " start --head --port 0 --dashboard-port -1");
  EXPECT_EQ(WEXITSTATUS(bad.status), 2) << bad.output;
  EXPECT_NE(bad.output.find("TROUPE_HEAD_RECONNECT_MS"), std::string::npos) << bad.output;
  EXPECT_NE(bad.output.find("soon"), std::string::npos) << bad.output;
}

// A token with a space or a control character inside is refused before
// anything starts, and a trailing newline or space (a Kubernetes Secret
// made with echo) is dropped, as the session's token file drops it: the
// daemons used the raw value, the session the trimmed one, and the
// cluster refused its own session.
TEST_F(LauncherTest, ATokensTrailingWhitespaceIsDroppedAndWhitespaceInsideRefused) {
  for (const std::string token : {"' '", "' tok'", "'to ken'", "\"$(printf 'to\\nken')\""}) {
    auto r = run("TROUPE_TOKEN=" + token + " " + cli() + " start --head --port 0 --dashboard-port -1");
    EXPECT_NE(r.status, 0) << token << ": " << r.output;
    EXPECT_NE(r.output.find("TROUPE_TOKEN "), std::string::npos) << token << ": " << r.output;
    EXPECT_FALSE(std::filesystem::exists(dir_ / "head.pid")) << token;
  }
  auto r = run("TROUPE_TOKEN=\"$(printf 'tok \\n')\" " + cli() + " start --head --port 0 --dashboard-port -1 " +
               "--resources CPU=1,GPU=0");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(troupe::core::read_session_file(dir_.string(), "token"), "tok");
  auto status = run("TROUPE_TOKEN=\"$(printf 'tok \\n')\" " + cli() + " status --json");
  ASSERT_EQ(status.status, 0) << status.output;
  EXPECT_EQ(nlohmann::json::parse(status.output)["nodes"].size(), 1u);  // its own node joined with it
  EXPECT_EQ(run(cli() + " status").status, 0);                          // and the session's file reads it
  troupe::InitOptions o;
  o.address = "127.0.0.1:1";
  o.token = "tok ";
  EXPECT_THROW(troupe::Runtime::connect(o), troupe::ConfigError);
}

// A head started again on its port after it died finds the session's node
// agent there (which rejoins it) and starts no second one (it counted the
// machine's CPUs twice); a second `troupe start --address` of the session to
// the same head is warned of (nodes of their own --resources on one
// machine are how several nodes are tried on one), and stopped with it.
TEST_F(LauncherTest, ASessionStartsOneNodeAgentPerHead) {
  auto r = run(cli() + " start --head --port 0 --dashboard-port -1 --resources CPU=1,GPU=0");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string address = troupe::core::read_session_file(dir_.string(), "address");
  auto again = run(cli() + " start --address " + address + " --resources CPU=1,GPU=0");
  EXPECT_EQ(again.status, 0) << again.output;
  EXPECT_NE(again.output.find("warning: node agent pid "), std::string::npos) << again.output;
  EXPECT_NE(again.output.find("of this session has joined " + address + " already"), std::string::npos) << again.output;
  ASSERT_EQ(run(cli() + " stop").status, 0);
  r = run(cli() + " start --head --port 0 --dashboard-port -1 --resources CPU=1,GPU=0");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string first = troupe::core::read_session_file(dir_.string(), "address");
  const pid_t head = std::stoi(troupe::core::read_session_file(dir_.string(), "head.pid"));
  ASSERT_EQ(::kill(head, SIGKILL), 0);
  ASSERT_TRUE(troupe::test::eventually([&] { return troupe::test::process_gone(head); }));
  auto restarted = run(cli() + " start --head --dashboard-port -1 --resources CPU=1,GPU=0 --port " +
                       first.substr(first.find(':') + 1));
  ASSERT_EQ(restarted.status, 0) << restarted.output;
  EXPECT_NE(restarted.output.find("still runs and rejoins this head: not starting another"), std::string::npos)
      << restarted.output;
  EXPECT_TRUE(troupe::test::eventually([&] { return alive_nodes() == 1; })) << run(cli() + " status").output;
  int pid_files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir_))
    pid_files += e.path().filename().string().rfind("node-", 0) == 0 && e.path().extension() == ".pid";
  EXPECT_EQ(pid_files, 1);
}

// The session directory removed while its cluster runs: `troupe stop`
// finds the head and its node agent by their logs there and stops them
// (it said there was nothing to stop, and they ran on).
TEST_F(LauncherTest, StopFindsAClusterWhoseSessionDirectoryWasRemoved) {
  auto r = run(cli() + " start --head --port 0 --dashboard-port -1 --resources CPU=1,GPU=0");
  ASSERT_EQ(r.status, 0) << r.output;
  const pid_t head = std::stoi(troupe::core::read_session_file(dir_.string(), "head.pid"));
  pid_t agent = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir_))
    if (e.path().filename().string().rfind("node-", 0) == 0 && e.path().extension() == ".pid")
      agent = std::stoi(troupe::core::read_session_file(dir_.string(), e.path().filename().string()));
  ASSERT_GT(agent, 0);
  // As `rm -rf` by hand: the head and its agent may write a file there
  // while it goes ("Directory not empty"); the user runs it again.
  ASSERT_TRUE(troupe::test::eventually([&] {
    std::error_code ec;
    troupe::core::remove_tree(dir_, ec);
    return !ec && !std::filesystem::exists(dir_);
  }));
  auto stop = run(cli() + " stop");
  EXPECT_EQ(stop.status, 0) << stop.output;
  EXPECT_NE(stop.output.find("found the head pid " + std::to_string(head)), std::string::npos) << stop.output;
  EXPECT_NE(stop.output.find("found node agent pid " + std::to_string(agent)), std::string::npos) << stop.output;
  EXPECT_TRUE(troupe::test::eventually([&] { return troupe::test::process_gone(head); }));
  EXPECT_TRUE(troupe::test::eventually([&] { return troupe::test::process_gone(agent); }));
}

// A token file that cannot be read is named, not taken for no token at all
// ("needs the cluster token").
TEST_F(LauncherTest, ATokenFileThatCannotBeReadIsNamed) {
  auto r = run(cli() + " start --head --no-node --port 0 --dashboard-port -1");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string token = troupe::core::read_session_file(dir_.string(), "token");
  std::filesystem::remove(dir_ / "token");
  std::filesystem::create_directory(dir_ / "token");
  auto status = run(cli() + " status");
  EXPECT_NE(status.status, 0) << status.output;
  EXPECT_NE(status.output.find((dir_ / "token").string() + " is not a regular file"), std::string::npos)
      << status.output;
  std::filesystem::remove(dir_ / "token");
  troupe::core::write_session_file(dir_.string(), "token", token);
}

// A port on loopback that nothing listens on (taken and given back).
uint16_t unused_port() {
  asio::io_context io;
  asio::ip::tcp::acceptor a{io, {asio::ip::make_address("127.0.0.1"), 0}};
  return a.local_endpoint().port();
}

// `troupe start --address A --wait-for-head S`: node agents started before
// their head (a Kubernetes deployment's pods) wait for it and join once it
// is up, saying what they wait for, instead of failing at the first refused
// connect. A wrong token still fails at once, and the wait is bounded.
TEST_F(LauncherTest, ANodeStartedBeforeItsHeadWaitsForItWhenAsked) {
  const std::string port = std::to_string(unused_port());
  const std::string address = "127.0.0.1:" + port;
  const std::string token = "wait-for-head-token";
  const std::filesystem::path joined = dir_ / "joined";
  std::filesystem::create_directories(joined);
  std::filesystem::permissions(joined, std::filesystem::perms::owner_all);
  const std::filesystem::path node_out = dir_ / "node.out";
  std::string node_cmd = "TROUPE_SESSION_DIR=" + joined.string() + " TROUPE_TOKEN=" + token + " " + cli() +
                         " start --address " + address + " --resources CPU=1,GPU=0 --wait-for-head 120";
  CommandResult node;
  std::thread joiner([&] { node = run(node_cmd + " > " + node_out.string()); });
  EXPECT_TRUE(troupe::test::eventually([&] {
    return troupe::core::read_session_file(dir_.string(), "node.out").find("waiting for the head at " + address) !=
           std::string::npos;
  }));
  auto head =
      run("TROUPE_TOKEN=" + token + " " + cli() + " start --head --no-node --port " + port + " --dashboard-port -1");
  joiner.join();
  ASSERT_EQ(head.status, 0) << head.output;
  const std::string said = troupe::core::read_session_file(dir_.string(), "node.out") + node.output;
  EXPECT_EQ(node.status, 0) << said;
  EXPECT_NE(said.find("Connection refused"), std::string::npos) << said;
  auto j = nlohmann::json::parse(run(cli() + " status --json").output);
  ASSERT_EQ(j["nodes"].size(), 1u) << j.dump();
  EXPECT_TRUE(j["nodes"][0]["alive"].get<bool>());
  run("TROUPE_SESSION_DIR=" + joined.string() + " " + cli() + " stop");

  auto wrong = run("TROUPE_SESSION_DIR=" + joined.string() + " TROUPE_TOKEN=not-the-token " + cli() +
                   " start --address " + address + " --wait-for-head 120");
  EXPECT_EQ(WEXITSTATUS(wrong.status), 1) << wrong.output;
  EXPECT_NE(wrong.output.find("token"), std::string::npos) << wrong.output;
  EXPECT_EQ(wrong.output.find("waiting for the head"), std::string::npos) << wrong.output;

  const std::string nobody = "127.0.0.1:" + std::to_string(unused_port());
  auto gave_up = run("TROUPE_SESSION_DIR=" + joined.string() + " TROUPE_TOKEN=" + token + " " + cli() +
                     " start --address " + nobody + " --wait-for-head 1");
  EXPECT_EQ(WEXITSTATUS(gave_up.status), 1) << gave_up.output;
  EXPECT_NE(gave_up.output.find("waited 1 s for the head"), std::string::npos) << gave_up.output;
  auto with_head = run(cli() + " start --head --port 0 --wait-for-head 5");
  EXPECT_EQ(WEXITSTATUS(with_head.status), 2) << with_head.output;
  EXPECT_NE(with_head.output.find("--wait-for-head"), std::string::npos) << with_head.output;
}

// A durable head started again on its port with another token: its node
// agent says at once that the head is back and refuses its token (it said
// "did not come back" when its wait ran out, the token in parentheses).
TEST_F(LauncherTest, AnAgentWhoseHeadCameBackWithAnotherTokenSaysSo) {
  auto r = run("TROUPE_HEAD_RECONNECT_MS=60000 " + cli() + " start --head --port 0 --dashboard-port -1 " +
               "--resources CPU=1,GPU=0");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string address = troupe::core::read_session_file(dir_.string(), "address");
  const pid_t head = std::stoi(troupe::core::read_session_file(dir_.string(), "head.pid"));
  ASSERT_EQ(::kill(head, SIGKILL), 0);
  ASSERT_TRUE(troupe::test::eventually([&] { return troupe::test::process_gone(head); }));
  auto again = run("TROUPE_TOKEN=another-token " + cli() + " start --head --no-node --dashboard-port -1 --port " +
                   address.substr(address.find(':') + 1));
  ASSERT_EQ(again.status, 0) << again.output;
  auto node_log = [&] {
    std::string all;
    for (const auto& e : std::filesystem::directory_iterator(dir_))
      if (e.path().filename().string().rfind("node-", 0) == 0 && e.path().extension() == ".log")
        all += troupe::core::read_session_file(dir_.string(), e.path().filename().string());
    return all;
  };
  EXPECT_TRUE(troupe::test::eventually([&] {
    return node_log().find("a head answers at " + address + " again but refused this node's token") !=
           std::string::npos;
  })) << node_log();
}

// A head that does not exit on SIGTERM (hung; here stopped) is killed
// after the grace period, and its pid file and state db go with it: a
// head starts again at once. Before, stop said it was still running, exited
// 0, and removed its pid file, so a second stop found "nothing to stop"
// and a new head found its port taken.
TEST_F(LauncherTest, StopKillsAHeadThatOutlivesTheGracePeriod) {
  auto r = run(cli() + " start --head --no-node --port 0 --dashboard-port -1");
  ASSERT_EQ(r.status, 0) << r.output;
  const pid_t head = started_head_pid(r.output);
  ASSERT_GT(head, 0) << r.output;
  ASSERT_EQ(::kill(head, SIGSTOP), 0);
  auto stop = run(cli() + " stop --grace-period 1");
  EXPECT_EQ(stop.status, 0) << stop.output;
  EXPECT_NE(stop.output.find("pid " + std::to_string(head) +
                             " (head.pid) did not exit within 1 s of SIGTERM: " + "killing it (SIGKILL)"),
            std::string::npos)
      << stop.output;
  EXPECT_TRUE(troupe::test::process_gone(head));
  EXPECT_FALSE(std::filesystem::exists(dir_ / "head.pid"));
  EXPECT_FALSE(std::filesystem::exists(dir_ / "head.sqlite")) << stop.output;
  auto again = run(cli() + " start --head --no-node --port 0 --dashboard-port -1");
  ASSERT_EQ(again.status, 0) << again.output;
  // --force kills at once, without asking the head.
  const pid_t second = started_head_pid(again.output);
  auto force = run(cli() + " stop --force");
  EXPECT_EQ(force.status, 0) << force.output;
  EXPECT_TRUE(troupe::test::process_gone(second));
  EXPECT_NE(run(cli() + " stop --force --grace-period 3").status, 0);  // one or the other
}

// A durable head whose state db refuses a write (a full disk; here a file
// size limit) goes on without it, says so in status and /metrics, and
// removes the file: a head started after it starts empty instead of
// reloading tables older than the cluster the drivers saw.
TEST_F(LauncherTest, AHeadWhoseStateDbFailsAWriteSaysSoAndLeavesNoStaleTables) {
  // 4096 blocks: 2 MB (dash's 512-byte blocks) or 4 MB; SIGXFSZ ignored,
  // so the write fails with EFBIG instead of killing the head.
  auto r = run("ulimit -f 4096 && trap '' XFSZ && " + cli() + " start --head --no-node --port 0 --dashboard-port -1");
  ASSERT_EQ(r.status, 0) << r.output;
  const pid_t head = started_head_pid(r.output);
  ASSERT_GT(head, 0) << r.output;
  {
    troupe::Runtime rt = troupe::Runtime::connect(session_cluster());
    rt.kv().put("before", "1");
    rt.kv().put("big", std::string(8 << 20, 'x'));
    ASSERT_TRUE(troupe::test::eventually([&] { return !std::filesystem::exists(dir_ / "head.sqlite"); }));
    auto status = run(cli() + " status");
    EXPECT_NE(
        status.output.find("warning: the head's state db " + (dir_ / "head.sqlite").string() + " failed a write ("),
        std::string::npos)
        << status.output;
    auto j = nlohmann::json::parse(run(cli() + " status --json").output);
    EXPECT_EQ(j["state_db"]["written"], false) << j["state_db"].dump();
    rt.kv().put("after", "1");  // the head serves on
    EXPECT_EQ(rt.kv().get("after"), std::optional<std::string>("1"));
  }
  ASSERT_EQ(::kill(head, SIGKILL), 0);
  // Gone, and its state file's lock free: a killed process's threads may
  // still be leaving (the leader a zombie) while they hold its files.
  ASSERT_TRUE(troupe::test::eventually([&] { return troupe::test::process_gone(head) && state_lock_free(dir_); }));
  auto again = run(cli() + " start --head --no-node --port 0 --dashboard-port -1");
  ASSERT_EQ(again.status, 0) << again.output;
  troupe::Runtime rt = troupe::Runtime::connect(session_cluster());
  EXPECT_EQ(rt.kv().get("before"), std::nullopt);  // empty, not the tables of before the failure
}

// The sbatch script troupe slurm writes runs the driver with its arguments
// as given (a ' inside one used to split it into words) and with every
// option given (--dashboard-port and --start-timeout were left out).
TEST_F(LauncherTest, SbatchScriptKeepsQuotedArgumentsAndEveryOption) {
  auto printed = run(cli() + " slurm --print-sbatch --dashboard-port 8266 --start-timeout 30 -- python3 -c " +
                     "\"print('hi from troupe')\" 'two words'");
  ASSERT_EQ(printed.status, 0) << printed.output;
  const auto script = dir_ / "job.sbatch";
  { std::ofstream(script) << printed.output; }
  // The exec line's words, one per line, as bash reads them.
  auto words = run("bash -c 'show() { for a in \"$@\"; do echo \"[$a]\"; done; }; source <(sed \"s/^exec /show /\" " +
                   script.string() + ")'");
  ASSERT_EQ(words.status, 0) << words.output;
  EXPECT_NE(words.output.find("[--]\n[python3]\n[-c]\n[print('hi from troupe')]\n[two words]\n"), std::string::npos)
      << words.output;
  EXPECT_NE(words.output.find("[--dashboard-port]\n[8266]\n"), std::string::npos) << words.output;
  EXPECT_NE(words.output.find("[--start-timeout]\n[30]\n"), std::string::npos) << words.output;
}

// One head holds a state file at a time: a second is refused naming the
// first's pid (two used to take each other's nodes for dead and overwrite
// each other's rows). A --state-db that is a directory, a link or a file
// that is not SQLite is refused before anything touches it (its mode used
// to become 0600).
TEST_F(LauncherTest, AStateDbIsHeldByOneHeadAndOtherFilesAreLeftAlone) {
  auto first = run(cli() + " start --head --no-node --port 0 --dashboard-port -1");
  ASSERT_EQ(first.status, 0) << first.output;
  const std::filesystem::path other = dir_ / "other-session";
  std::filesystem::create_directories(other);
  std::filesystem::permissions(other, std::filesystem::perms::owner_all);
  const std::string second = "TROUPE_SESSION_DIR=" + other.string() + " " + cli() +
                             " start --head --no-node --port 0 --dashboard-port -1 --state-db ";
  auto taken = run(second + (dir_ / "head.sqlite").string());
  EXPECT_NE(taken.status, 0) << taken.output;
  EXPECT_NE(taken.output.find("is in use by another head (pid " +
                              std::to_string(troupe::core::check_pid_file(dir_.string(), "head.pid").pid) + ")"),
            std::string::npos)
      << taken.output;

  const std::filesystem::path folder = dir_ / "folder", script = dir_ / "train.py", link = dir_ / "link.sqlite";
  std::filesystem::create_directories(folder);
  { std::ofstream(script) << "print('hi')\n"; }
  std::filesystem::create_symlink(script, link);
  for (const auto& p : {folder, script}) ::chmod(p.c_str(), 0755);
  const std::pair<std::filesystem::path, std::string> cases[] = {
      {folder, "is a directory"}, {script, "is not a SQLite file"}, {link, "is a symbolic link"}};
  for (const auto& [path, says] : cases) {
    auto r = run(second + path.string());
    EXPECT_NE(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("head state file " + path.string() + " " + says), std::string::npos) << r.output;
  }
  struct stat st {};
  for (const auto& p : {folder, script}) {
    ASSERT_EQ(::stat(p.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0755) << p;
  }
  EXPECT_FALSE(std::filesystem::exists(script.string() + ".lock"));
  run("TROUPE_SESSION_DIR=" + other.string() + " " + cli() + " stop");
}

// troupe stop, and SIGTERM, reach a head that serves its dashboard (whose
// HTTP thread once took the signal and ended the head before it emptied
// its state db): the next head of the session starts a new cluster.
TEST_F(LauncherTest, StopEmptiesTheStateDbOfAHeadServingItsDashboard) {
  for (const bool by_signal : {false, true}) {
    SCOPED_TRACE(by_signal ? "SIGTERM" : "troupe stop");
    auto r = run(cli() + " start --head --port 0 --dashboard-port 0");
    ASSERT_EQ(r.status, 0) << r.output;
    const pid_t head = started_head_pid(r.output);
    ASSERT_GT(head, 0) << r.output;
    if (by_signal) {
      ASSERT_EQ(::kill(head, SIGTERM), 0);
      ASSERT_TRUE(troupe::test::eventually([&] { return troupe::test::process_gone(head); }));
      // Emptied by the head itself (troupe stop would remove the file).
      EXPECT_TRUE(troupe::head::HeadStore((dir_ / "head.sqlite").string()).load().empty());
    }
    if (!by_signal) {
      EXPECT_TRUE(std::filesystem::exists(dir_ / "dashboard"));
    }
    auto stop = run(cli() + " stop");
    EXPECT_EQ(stop.status, 0) << stop.output;
    // Nothing names the stopped head's dashboard any more.
    EXPECT_FALSE(std::filesystem::exists(dir_ / "dashboard"));
    ASSERT_TRUE(troupe::test::eventually([&] { return troupe::test::process_gone(head); }));
    auto again = run(cli() + " start --head --no-node --port 0 --dashboard-port 0");
    ASSERT_EQ(again.status, 0) << again.output;
    const std::string log = troupe::core::read_session_file(dir_.string(), "head.log");
    EXPECT_EQ(log.find("reloading"), std::string::npos) << log;
    EXPECT_EQ(log.find("restored"), std::string::npos) << log;
    auto last = run(cli() + " stop");
    EXPECT_EQ(last.status, 0) << last.output;
  }
}

}  // namespace
