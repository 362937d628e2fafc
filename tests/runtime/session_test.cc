// The session directory's safety checks, its files, pid files, WorkerEnv and
// address parsing: plain functions, no cluster.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/files.h"
#include "troupe/runtime/core/malloc_policy.h"
#include "troupe/runtime/core/process.h"
#include "troupe/runtime/core/session.h"
#include "troupe/runtime/core/worker_env.h"
#include "troupe/runtime/wire/address.h"

namespace fs = std::filesystem;
using namespace troupe;

namespace {

class SessionDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("troupe-session-test-" + std::to_string(::getpid()));
    troupe::core::remove_tree(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { troupe::core::remove_tree(root_); }
  std::string path(const std::string& name) const { return (root_ / name).string(); }
  // The error ensure_session_dir throws for `dir` ("" when it accepts it).
  static std::string refusal(const std::string& dir) {
    try {
      core::ensure_session_dir(dir);
      return "";
    } catch (const Error& e) {
      return e.what();
    }
  }
  fs::path root_;
};

TEST_F(SessionDirTest, AbsentDirectoryIsCreatedWithMode0700) {
  mode_t old = ::umask(0);
  std::string dir = path("fresh");
  EXPECT_EQ(refusal(dir), "");
  ::umask(old);
  struct stat st {};
  ASSERT_EQ(::lstat(dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u);
  EXPECT_EQ(st.st_uid, ::geteuid());
}

TEST_F(SessionDirTest, WorldWritableDirectoryIsRefusedNamingPathOwnerAndMode) {
  std::string dir = path("open");
  ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(dir.c_str(), 0777), 0);
  std::string why = refusal(dir);
  EXPECT_NE(why.find(dir), std::string::npos) << why;
  EXPECT_NE(why.find("0777"), std::string::npos) << why;
  EXPECT_NE(why.find("uid " + std::to_string(::geteuid())), std::string::npos) << why;
  EXPECT_THROW(core::check_session_dir(dir), Error);
}

TEST_F(SessionDirTest, DirectoryOwnedByAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to chown a directory to another user (CI runs as root)";
  std::string dir = path("theirs");
  ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0);
  ASSERT_EQ(::chown(dir.c_str(), 65534, 65534), 0);  // nobody
  std::string why = refusal(dir);
  EXPECT_NE(why.find(dir), std::string::npos) << why;
  EXPECT_NE(why.find("uid 65534"), std::string::npos) << why;
}

TEST_F(SessionDirTest, SymlinkIsRefused) {
  std::string real = path("real");
  ASSERT_EQ(::mkdir(real.c_str(), 0700), 0);
  std::string link = path("link");
  ASSERT_EQ(::symlink(real.c_str(), link.c_str()), 0);
  EXPECT_NE(refusal(link).find("symbolic link"), std::string::npos) << refusal(link);
}

TEST_F(SessionDirTest, FilesAre0600AndAPlantedSymlinkIsReplacedNotFollowed) {
  std::string dir = path("s");
  core::ensure_session_dir(dir);
  // Someone plants token -> a file of theirs, hoping we write through it.
  std::string bait = path("bait");
  { std::ofstream(bait) << "untouched"; }
  ASSERT_EQ(::symlink(bait.c_str(), (dir + "/token").c_str()), 0);
  EXPECT_EQ(core::read_session_file(dir, "token"), "");  // reads do not follow it either
  core::write_session_file(dir, "token", "secret");
  struct stat st {};
  ASSERT_EQ(::lstat((dir + "/token").c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(core::read_session_file(dir, "token"), "secret");
  std::ifstream b(bait);
  std::string bait_text;
  b >> bait_text;
  EXPECT_EQ(bait_text, "untouched");
  // No temp file is left behind.
  size_t files = 0;
  for ([[maybe_unused]] auto& e : fs::directory_iterator(dir)) ++files;
  EXPECT_EQ(files, 1u);
}

TEST_F(SessionDirTest, PidFileProvesTheProcessByItsStartTime) {
  std::string dir = path("p");
  core::ensure_session_dir(dir);
  core::write_pid_file(dir, "me.pid", ::getpid());
  auto me = core::check_pid_file(dir, "me.pid");
  EXPECT_TRUE(me.alive) << me.problem;
  EXPECT_EQ(me.pid, ::getpid());
  // The same pid with another start time: a reused pid or a planted file.
  core::write_session_file(dir, "planted.pid", std::to_string(::getpid()) + " 1\n");
  auto planted = core::check_pid_file(dir, "planted.pid");
  EXPECT_FALSE(planted.alive);
  EXPECT_NE(planted.problem.find("another process"), std::string::npos) << planted.problem;
  // The old format (a bare pid) proves nothing.
  core::write_session_file(dir, "bare.pid", std::to_string(::getpid()) + "\n");
  EXPECT_FALSE(core::check_pid_file(dir, "bare.pid").alive);
  EXPECT_FALSE(core::check_pid_file(dir, "absent.pid").alive);
  // A process that exited and was not reaped yet (a killed head whose
  // parent has not waited for it) is not running: a restart may go on.
  int gate[2];
  ASSERT_EQ(::pipe(gate), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    char c;
    ::close(gate[1]);
    (void)!::read(gate[0], &c, 1);  // until the parent closes its end
    ::_exit(0);
  }
  ::close(gate[0]);
  core::write_pid_file(dir, "zombie.pid", child);
  ::close(gate[1]);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  std::string state;
  while (state != "Z" && std::chrono::steady_clock::now() < deadline) {
    std::ifstream stat("/proc/" + std::to_string(child) + "/stat");
    std::string line;
    std::getline(stat, line);
    std::istringstream rest(line.substr(line.rfind(')') + 1));
    rest >> state;
  }
  ASSERT_EQ(state, "Z");
  auto zombie = core::check_pid_file(dir, "zombie.pid");
  EXPECT_FALSE(zombie.alive);
  EXPECT_NE(zombie.problem.find("has exited"), std::string::npos) << zombie.problem;
  ::waitpid(child, nullptr, 0);
}

TEST(WorkerEnvTest, RoundTripsThroughTheEnvironment) {
  core::WorkerEnv w;
  w.role = "worker";
  w.head_address = "[::1]:6380";
  w.token = "t0k";
  w.actor_id = 42;
  w.incarnation = 3;
  w.node_id = 7;
  w.bind_host = "0.0.0.0";
  w.advertise_host = "10.1.2.3";
  w.gpu_ids = {0, 2};
  w.heartbeat_ms = 50;
  auto env = w.to_env();
  for (const auto& kv : env) {
    auto eq = kv.find('=');
    ::setenv(kv.substr(0, eq).c_str(), kv.substr(eq + 1).c_str(), 1);
  }
  auto back = core::WorkerEnv::from_env();
  for (const auto& kv : env) ::unsetenv(kv.substr(0, kv.find('=')).c_str());
  EXPECT_EQ(back.role, "worker");
  EXPECT_EQ(back.head_address, "[::1]:6380");
  EXPECT_EQ(back.token, "t0k");
  EXPECT_EQ(back.actor_id, 42u);
  EXPECT_EQ(back.incarnation, 3u);
  EXPECT_EQ(back.node_id, 7u);
  EXPECT_EQ(back.bind_host, "0.0.0.0");
  EXPECT_EQ(back.advertise_host, "10.1.2.3");
  EXPECT_EQ(back.gpu_ids, (std::vector<int>{0, 2}));
  EXPECT_EQ(back.heartbeat_ms, 50u);
}

TEST(WorkerEnvTest, BadNumberNamesTheVariableAndValue) {
  ::setenv(core::kEnvHeadPort, "70000", 1);
  try {
    core::WorkerEnv::from_env();
    ADD_FAILURE() << "70000 accepted as a port";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("TROUPE_HEAD_PORT='70000'"), std::string::npos) << e.what();
  }
  ::unsetenv(core::kEnvHeadPort);
}

// A child's environment drops troupe's wiring (role, address, token) and
// the variables asked for, but keeps the user's settings that workers read.
TEST(WorkerEnvTest, ChildEnvironmentKeepsUserSettingsAndDropsWiring) {
  ::setenv(core::kEnvToken, "secret", 1);
  ::setenv("TROUPE_DIGITS_PATH", "/data/digits.csv.gz", 1);
  ::setenv("CUDA_VISIBLE_DEVICES", "3", 1);
  // Read by workers that make and serve shipped copies: set where the
  // node agents start, they never reached them (probe 27a).
  for (const char* name : {"TROUPE_SHIPPED_COPY_GRACE_S", "TROUPE_SHIPPING_DIR", "TROUPE_OBJECT_SEND_TIMEOUT_S"})
    ::setenv(name, "7", 1);
  auto env = core::clean_environment({"CUDA_VISIBLE_DEVICES"});
  ::unsetenv(core::kEnvToken);
  ::unsetenv("TROUPE_DIGITS_PATH");
  ::unsetenv("CUDA_VISIBLE_DEVICES");
  for (const char* name : {"TROUPE_SHIPPED_COPY_GRACE_S", "TROUPE_SHIPPING_DIR", "TROUPE_OBJECT_SEND_TIMEOUT_S"})
    ::unsetenv(name);
  auto has = [&](const std::string& prefix) {
    return std::any_of(env.begin(), env.end(), [&](const std::string& kv) { return kv.rfind(prefix, 0) == 0; });
  };
  EXPECT_FALSE(has(std::string(core::kEnvToken) + "="));
  EXPECT_FALSE(has("CUDA_VISIBLE_DEVICES="));
  EXPECT_TRUE(has("TROUPE_DIGITS_PATH=/data/digits.csv.gz"));
  EXPECT_TRUE(has("TROUPE_SHIPPED_COPY_GRACE_S=7"));
  EXPECT_TRUE(has("TROUPE_SHIPPING_DIR=7"));
  EXPECT_TRUE(has("TROUPE_OBJECT_SEND_TIMEOUT_S=7"));
}

TEST(WorkerEnvTest, MallocPolicyIsReuseByDefaultAndABadValueIsNamed) {
  ::unsetenv(core::kEnvWorkerMalloc);
  EXPECT_EQ(core::malloc_policy_from_env(), core::MallocPolicy::kReuse);
  ::setenv(core::kEnvWorkerMalloc, "system", 1);
  EXPECT_EQ(core::malloc_policy_from_env(), core::MallocPolicy::kSystem);
  const auto env = core::clean_environment();
  EXPECT_NE(std::find(env.begin(), env.end(), "TROUPE_WORKER_MALLOC=system"), env.end());
  ::setenv(core::kEnvWorkerMalloc, "jemalloc", 1);
  try {
    core::malloc_policy_from_env();
    ADD_FAILURE() << "jemalloc accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("TROUPE_WORKER_MALLOC='jemalloc'"), std::string::npos) << e.what();
  }
  ::unsetenv(core::kEnvWorkerMalloc);
}

TEST(WorkerEnvTest, WorkersExecWithHugePagesForTheirHeapUnlessToldOtherwise) {
  using Env = std::vector<std::string>;
  auto with = [](Env env) {
    core::add_exec_time_malloc_settings(env);
    return core::last_setting_wins(env);
  };
  EXPECT_EQ(with({"A=1"}), (Env{"A=1", "GLIBC_TUNABLES=glibc.malloc.hugetlb=1"}));
  EXPECT_EQ(with({"GLIBC_TUNABLES=glibc.malloc.arena_max=2"}),
            (Env{"GLIBC_TUNABLES=glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}));
  EXPECT_EQ(with({"GLIBC_TUNABLES=glibc.malloc.hugetlb=0"}), (Env{"GLIBC_TUNABLES=glibc.malloc.hugetlb=0"}));
  EXPECT_EQ(with({"TROUPE_WORKER_MALLOC=system"}), (Env{"TROUPE_WORKER_MALLOC=system"}));
  // The actor's setting comes last and wins.
  EXPECT_EQ(with({"TROUPE_WORKER_MALLOC=system", "TROUPE_WORKER_MALLOC=reuse"}),
            (Env{"TROUPE_WORKER_MALLOC=reuse", "GLIBC_TUNABLES=glibc.malloc.hugetlb=1"}));
}

TEST(AddressTest, ParsesIPv6InBracketsAndFormatsThemBack) {
  auto [host, port] = wire::parse_address("[::1]:6380");
  EXPECT_EQ(host, "::1");
  EXPECT_EQ(port, 6380);
  EXPECT_EQ(wire::format_address("::1", 6380), "[::1]:6380");
  EXPECT_EQ(wire::format_address("10.0.0.1", 1), "10.0.0.1:1");
  EXPECT_THROW(wire::parse_address("::1:6380"), ConfigError);
  EXPECT_THROW(wire::parse_address("[::1:6380"), ConfigError);
  EXPECT_THROW(wire::parse_address("host:70000"), ConfigError);
  EXPECT_EQ(wire::resolve_host("localhost").to_string(), "127.0.0.1");
  // A URL is said as one (it read "write IPv6 addresses as [ADDR]:PORT").
  try {
    wire::parse_address("http://127.0.0.1:6380");
    ADD_FAILURE() << "a URL was taken for an address";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("leave out the 'http://'"), std::string::npos) << e.what();
  }
}

TEST(AddressTest, HostsOthersCannotConnectToAreRefusedNamingThem) {
  for (const char* ok : {"node-7.cluster.local", "10.0.0.1", "::1", "[fe80::1]", "host_1"})
    EXPECT_NO_THROW(wire::check_host("--advertise-address", ok)) << ok;
  for (const char* bad : {"", "bad addr", "a/b", "::zz::", "tab\there"}) {
    try {
      wire::check_host("--advertise-address", bad);
      ADD_FAILURE() << "'" << bad << "' accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("--advertise-address '"), std::string::npos) << e.what();
    }
  }
  try {
    wire::check_host("advertise address", "tab\there");
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'\\x09'"), std::string::npos) << e.what();
  }
}

TEST(AddressTest, WildcardIsNeverAdvertised) {
  EXPECT_NE(wire::default_advertise_host("0.0.0.0"), "0.0.0.0");
  EXPECT_NE(wire::default_advertise_host("::"), "::");
  EXPECT_EQ(wire::default_advertise_host("127.0.0.1"), "127.0.0.1");
  EXPECT_EQ(wire::local_address_towards("127.0.0.1", 6380), "127.0.0.1");
}

}  // namespace
