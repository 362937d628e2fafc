// spawn_process and what workers start with: only the descriptors meant for
// them, early exits reported with their status, and addresses others can
// connect to (never the wildcard a process binds to).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/files.h"
#include "troupe/runtime/core/process.h"
#include "troupe/runtime/node/node_agent.h"
#include "troupe/runtime/testing/local_cluster.h"

using namespace std::chrono_literals;
namespace fs = std::filesystem;

// Lists its own descriptors as "FD TARGET" (readlink of /proc/self/fd/FD).
class FdLister {
 public:
  std::vector<std::string> fds() const {
    std::vector<std::string> out;
    for (auto& e : fs::directory_iterator("/proc/self/fd")) {
      std::error_code ec;
      auto target = fs::read_symlink(e.path(), ec);
      out.push_back(e.path().filename().string() + " " + (ec ? "?" : target.string()));
    }
    return out;
  }
  int ping() const { return 1; }
};
TROUPE_ACTOR(FdLister, &FdLister::fds, &FdLister::ping)

namespace {

using troupe::testing::LocalCluster;

// "socket:[INODE]" targets of pid's descriptors.
std::set<std::string> socket_targets(pid_t pid) {
  std::set<std::string> out;
  std::error_code ec;
  for (auto& e : fs::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
    auto t = fs::read_symlink(e.path(), ec);
    if (!ec && t.string().rfind("socket:", 0) == 0) out.insert(t.string());
  }
  return out;
}

int wait_exit_code(pid_t pid) {
  int st = 0;
  ::waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

TEST(SpawnProcess, ChildKeepsOnlyTheDescriptorsPassedToIt) {
  int leak[2], keep[2];
  ASSERT_EQ(::pipe(leak), 0);  // no O_CLOEXEC: a careless exec would pass it on
  ASSERT_EQ(::pipe(keep), 0);
  std::string script = "[ -e /proc/self/fd/" + std::to_string(leak[1]) + " ] && exit 3; [ -e /proc/self/fd/" +
                       std::to_string(keep[1]) + " ] || exit 4; exit 0";
  std::string file = (fs::temp_directory_path() / ("troupe-fd-" + std::to_string(::getpid()) + ".sh")).string();
  { std::ofstream(file) << "#!/bin/sh\n" << script << "\n"; }
  fs::permissions(file, fs::perms::owner_all);
  troupe::core::SpawnOptions o;
  o.executable = file;
  o.env = {"PATH=/usr/bin:/bin"};
  o.keep_fds = {keep[1]};
  pid_t pid = troupe::core::spawn_process(o);
  EXPECT_EQ(wait_exit_code(pid), 0) << "3: the stray pipe reached the child; 4: the kept one did not";
  fs::remove(file);
  for (int fd : {leak[0], leak[1], keep[0], keep[1]}) ::close(fd);
}

TEST(SpawnProcess, ExecFailureIsAnErrorNamingTheExecutable) {
  troupe::core::SpawnOptions o;
  o.executable = "/nonexistent/troupe-binary";
  try {
    troupe::core::spawn_process(o);
    ADD_FAILURE() << "no error";
  } catch (const troupe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/troupe-binary"), std::string::npos) << e.what();
  }
}

// An actor's `env` comes after the inherited environment: its setting must
// be the one the child sees (getenv would return the first).
TEST(SpawnProcess, TheLastSettingOfAVariableIsTheOneTheChildSees) {
  troupe::core::SpawnOptions o;
  o.executable = "/bin/sh";
  o.args = {"-c", "test \"$SPAWN_TEST_X\" = second && test \"$SPAWN_TEST_Y\" = kept"};
  o.env = {"SPAWN_TEST_X=first", "SPAWN_TEST_Y=kept", "SPAWN_TEST_X=second"};
  int status = 0;
  const pid_t pid = troupe::core::spawn_process(o);
  ASSERT_EQ(troupe::core::wait_child(pid, &status), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_EQ(troupe::core::last_setting_wins({"A=1", "B=2", "A=3", "C"}), (std::vector<std::string>{"B=2", "A=3", "C"}));
}

TEST(SpawnProcess, RoleProcessThatExitsAtOnceIsReportedWithStatusAndLog) {
  std::string dir = (fs::temp_directory_path() / ("troupe-role-" + std::to_string(::getpid()))).string();
  fs::create_directories(dir);
  std::string exe = dir + "/fails.sh";
  { std::ofstream(exe) << "#!/bin/sh\necho 'bind: Address already in use' >&2\nexit 3\n"; }
  fs::permissions(exe, fs::perms::owner_all);
  troupe::core::RoleProcessOptions o;
  o.executable = exe;
  o.env.role = "head";
  o.log_file = dir + "/head.log";
  o.ready_timeout = 60s;  // an early exit must not wait for this
  try {
    troupe::core::start_role_process(o, "head");
    ADD_FAILURE() << "no error";
  } catch (const troupe::Error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("exited with code 3"), std::string::npos) << what;
    EXPECT_NE(what.find("Address already in use"), std::string::npos) << what;
    EXPECT_EQ(what.find("did not become ready"), std::string::npos) << what;
  }
  troupe::core::remove_tree(dir);
}

TEST(WorkerDescriptors, WorkerHoldsNoSocketOfItsNodeAgent) {
  LocalCluster cluster;
  troupe::Runtime rt = cluster.connect();
  auto a = rt.spawn<FdLister>({});
  auto fds = a.call(&FdLister::fds).get(10s);
  std::set<std::string> node_sockets;
  for (size_t i = 0; i < cluster.node_count(); ++i)
    for (auto& s : socket_targets(cluster.node_pid(i))) node_sockets.insert(s);
  ASSERT_FALSE(node_sockets.empty());
  std::set<int> numbers;
  for (const auto& line : fds) {
    auto space = line.find(' ');
    numbers.insert(std::stoi(line.substr(0, space)));
    EXPECT_EQ(node_sockets.count(line.substr(space + 1)), 0u)
        << "the worker holds its node agent's descriptor " << line;
  }
  for (int std_fd : {0, 1, 2}) EXPECT_EQ(numbers.count(std_fd), 1u) << std_fd;
}

// Every actor address in the head's status, which must all be connectable.
std::vector<std::string> actor_addresses(troupe::Runtime& rt) {
  std::vector<std::string> out;
  auto j = nlohmann::json::parse(rt.status_json());
  for (auto& x : j["actors"])
    if (x.contains("address")) out.push_back(x["address"].get<std::string>());
  return out;
}

TEST(Addresses, HeadBoundToWildcardAdvertisesAConnectableAddress) {
  troupe::testing::LocalClusterOptions o;
  o.host = "0.0.0.0";
  o.nodes = {{{"CPU", 1}}};
  LocalCluster cluster(o);
  EXPECT_EQ(cluster.address().rfind("0.0.0.0", 0), std::string::npos) << cluster.address();
  troupe::Runtime rt = cluster.connect();
  auto a = rt.spawn<FdLister>({});
  EXPECT_EQ(a.call(&FdLister::ping).get(10s), 1);
  for (const auto& addr : actor_addresses(rt)) EXPECT_EQ(addr.find("0.0.0.0"), std::string::npos) << addr;
  EXPECT_EQ(a.info().address.find("0.0.0.0"), std::string::npos) << a.info().address;
}

bool has_ipv6_loopback() {
  int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

TEST(Addresses, IPv6LoopbackWorks) {
  if (!has_ipv6_loopback()) GTEST_SKIP() << "this machine has no IPv6 loopback (cannot bind [::1])";
  troupe::testing::LocalClusterOptions o;
  o.host = "::1";
  o.nodes = {{{"CPU", 1}}};
  LocalCluster cluster(o);
  EXPECT_EQ(cluster.address().rfind("[::1]:", 0), 0u) << cluster.address();
  troupe::Runtime rt = cluster.connect();
  auto a = rt.spawn<FdLister>({});
  EXPECT_EQ(a.call(&FdLister::ping).get(10s), 1);
  EXPECT_EQ(a.info().address.rfind("[::1]:", 0), 0u) << a.info().address;
}

}  // namespace

// A node agent offers the CPUs it may use: its affinity mask (a
// container's CPU set, taskset), not the machine's online CPUs.
TEST(CpuLimit, IsWhatTheAffinityMaskAllows) {
  cpu_set_t was;
  CPU_ZERO(&was);
  ASSERT_EQ(::sched_getaffinity(0, sizeof was, &was), 0);
  int first = 0;
  while (!CPU_ISSET(first, &was)) ++first;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  ASSERT_EQ(::sched_setaffinity(0, sizeof one, &one), 0);
  const int limited = troupe::core::cpu_limit();
  const double offered = troupe::node::detect_resources({}).at("CPU");
  ::sched_setaffinity(0, sizeof was, &was);
  EXPECT_EQ(limited, 1);
  EXPECT_EQ(offered, 1.0);
  EXPECT_LE(troupe::core::cpu_limit(), CPU_COUNT(&was));
}

// And the lowest CPU quota of its cgroup and those above it, v2 or v1 (a
// pod's limit on a parent bound, and v1 hosts were not read at all).
TEST(CpuLimit, IsTheLowestQuotaOnTheWayUpInEitherCgroupVersion) {
  const auto root = std::filesystem::path(::testing::TempDir()) / ("cgroups-" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root / "pod" / "ctr");
  std::filesystem::create_directories(root / "cpu" / "kubepods" / "ctr");
  std::ofstream(root / "pod" / "cpu.max") << "100000 100000\n";  // 1 CPU on the pod
  std::ofstream(root / "pod" / "ctr" / "cpu.max") << "max 100000\n";
  std::ofstream(root / "cpu" / "kubepods" / "cpu.cfs_quota_us") << "50000\n";  // half a CPU: 1
  std::ofstream(root / "cpu" / "kubepods" / "cpu.cfs_period_us") << "100000\n";
  std::ofstream(root / "cpu" / "kubepods" / "ctr" / "cpu.cfs_quota_us") << "-1\n";
  std::ofstream(root / "cpu" / "kubepods" / "ctr" / "cpu.cfs_period_us") << "100000\n";
  std::ofstream(root / "v2") << "0::/pod/ctr\n";
  std::ofstream(root / "v1") << "5:cpuacct,cpu:/kubepods/ctr\n4:memory:/kubepods/ctr\n";
  std::ofstream(root / "none") << "0::/nowhere\n";
  EXPECT_EQ(troupe::core::cpu_limit(root.string(), (root / "v2").string()), 1);
  EXPECT_EQ(troupe::core::cpu_limit(root.string(), (root / "v1").string()), 1);
  EXPECT_EQ(troupe::core::cpu_limit(root.string(), (root / "none").string()), troupe::core::cpu_limit("/nonexistent"));
  std::filesystem::remove_all(root);
}
