// The `troupe` CLI end to end: start a head and a second node in the
// background, look at them, run a driver against them, stop them.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "tests/runtime/test_util.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/core/session.h"

using namespace std::chrono_literals;

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

class LauncherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("troupe-cli-test-" + std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
    setenv("TROUPE_SESSION_DIR", dir_.c_str(), 1);
    unsetenv("TROUPE_TOKEN");
  }
  void TearDown() override {
    run(std::string(TROUPE_CLI) + " stop");
    std::filesystem::remove_all(dir_);
    unsetenv("TROUPE_SESSION_DIR");
  }
  std::filesystem::path dir_;
};

TEST_F(LauncherTest, StartStatusSubmitStop) {
  auto head = run(std::string(TROUPE_CLI) + " start --head --port 0 --resources CPU=2,GPU=0");
  ASSERT_EQ(head.status, 0) << head.output;
  std::string dir = dir_.string();
  std::string address = troupe::core::read_session_file(dir, "address");
  ASSERT_FALSE(address.empty());
  struct stat st {};
  ASSERT_EQ(::stat((dir + "/token").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600);

  auto node = run(std::string(TROUPE_CLI) + " start --address " + address + " --resources CPU=3,GPU=0,disk=1");
  ASSERT_EQ(node.status, 0) << node.output;

  auto status = run(std::string(TROUPE_CLI) + " status --json");
  ASSERT_EQ(status.status, 0) << status.output;
  auto j = nlohmann::json::parse(status.output);
  ASSERT_EQ(j["nodes"].size(), 2u);
  EXPECT_EQ(j["nodes"][1]["total"]["disk"], 1.0);

  // A driver finds the cluster through the session directory.
  troupe::InitOptions o;
  o.address = address;
  o.token = troupe::core::read_session_file(dir, "token");
  troupe::Runtime rt = troupe::Runtime::connect(o);
  auto a = rt.spawn<Adder>({.resources = {{"disk", 1}}});
  EXPECT_EQ(a.call(&Adder::add, 2, 3).get(10s), 5);
  auto human = run(std::string(TROUPE_CLI) + " status");
  EXPECT_NE(human.output.find("Adder"), std::string::npos) << human.output;
  EXPECT_NE(human.output.find("ALIVE"), std::string::npos) << human.output;
  // Filtered and paged status (typed fields of the status request).
  auto b = rt.spawn<Adder>({});
  rt.kill(b);
  ASSERT_TRUE(troupe::test::eventually([&] { return b.info().state == troupe::ActorState::kDead; }));
  auto dead = run(std::string(TROUPE_CLI) + " status --json --state DEAD");
  ASSERT_EQ(dead.status, 0) << dead.output;
  auto dj = nlohmann::json::parse(dead.output);
  ASSERT_EQ(dj["actors"].size(), 1u);
  EXPECT_EQ(dj["actors"][0]["id"], b.id());
  auto one = run(std::string(TROUPE_CLI) + " status --json --limit 1");
  ASSERT_EQ(one.status, 0) << one.output;
  EXPECT_EQ(nlohmann::json::parse(one.output)["actors"].size(), 1u);
  auto bogus = run(std::string(TROUPE_CLI) + " status --state SLEEPY");
  EXPECT_NE(bogus.status, 0);
  EXPECT_NE(bogus.output.find("SLEEPY"), std::string::npos) << bogus.output;

  auto bad = run(std::string(TROUPE_CLI) + " start --address " + address + " --resources CPU=x");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("CPU=x"), std::string::npos) << bad.output;

  std::string head_pid = troupe::core::read_session_file(dir, "head.pid");
  auto stop = run(std::string(TROUPE_CLI) + " stop");
  EXPECT_EQ(stop.status, 0) << stop.output;
  EXPECT_TRUE(troupe::test::eventually([&] { return ::kill(std::stoi(head_pid), 0) != 0; }));
}

TEST_F(LauncherTest, ClearErrorsWithoutACluster) {
  auto status = run(std::string(TROUPE_CLI) + " status");
  EXPECT_NE(status.status, 0);
  EXPECT_NE(status.output.find("no running cluster"), std::string::npos) << status.output;
  auto join = run(std::string(TROUPE_CLI) + " start --address 127.0.0.1:1");
  EXPECT_NE(join.status, 0);
  EXPECT_NE(join.output.find("token"), std::string::npos) << join.output;
}

}  // namespace
