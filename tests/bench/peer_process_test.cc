// PeerProcess and run_peer_json (bench/peer_process.h) against a fake peer
// (fake_peer.py): a peer that hangs is an error within its deadline and its
// ranks die with it; a failing or silent peer is an error naming why; a
// rank stuck at exit after the result is in is killed, the result kept.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>

#include "bench/peer_process.h"
#include "tests/support/process.h"

namespace troupe::bench {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using troupe::test::process_gone;

constexpr const char* kPython = "/usr/bin/python3";

std::vector<std::string> fake_peer(const std::string& mode) { return {kPython, TROUPE_TEST_PEER_SCRIPT, mode}; }

// Bounded poll: the kernel tears a SIGKILLed process down asynchronously.
bool eventually_gone(pid_t pid) {
  const auto deadline = Clock::now() + 30s;
  while (Clock::now() < deadline) {
    if (process_gone(pid)) return true;
    std::this_thread::sleep_for(20ms);
  }
  return process_gone(pid);
}

class PeerProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::access(kPython, X_OK) != 0) GTEST_SKIP() << kPython << " not found";
  }
};

TEST_F(PeerProcessTest, HangingPeerIsAnErrorWithinItsDeadlineAndItsRanksDie) {
  PeerProcess peer(fake_peer("hang"), {.name = "hanging peer"});
  auto first = peer.read_line(60s);  // python's start-up on a loaded machine
  ASSERT_TRUE(first.has_value());
  const pid_t rank = std::stoi(*first);
  const auto start = Clock::now();
  try {
    peer.read_line(500ms);
    FAIL() << "read_line returned from a peer that prints nothing";
  } catch (const PeerFailed& e) {
    EXPECT_NE(std::string(e.what()).find("hanging peer: no output within 500 ms"), std::string::npos) << e.what();
  }
  // Bounded, not timed: the deadline, plus generous slack for a loaded machine.
  EXPECT_LT(Clock::now() - start, 30s);
  EXPECT_TRUE(eventually_gone(peer.pid())) << "peer " << peer.pid();
  EXPECT_TRUE(eventually_gone(rank)) << "rank " << rank;
}

TEST_F(PeerProcessTest, RunPeerJsonReportsAHangAsAnError) {
  const auto start = Clock::now();
  try {
    run_peer_json(fake_peer("hang"), {}, 3s);
    FAIL() << "a hanging peer returned a result";
  } catch (const PeerFailed& e) {
    EXPECT_NE(std::string(e.what()).find("ms; killed"), std::string::npos) << e.what();
  }
  EXPECT_LT(Clock::now() - start, 60s);
}

TEST_F(PeerProcessTest, RunPeerJsonReturnsTheResultRow) {
  auto row = run_peer_json(fake_peer("ok"), {}, 60s);
  EXPECT_EQ(row.at("case"), "peer");
  EXPECT_EQ(row.at("value").get<double>(), 42.5);
}

TEST_F(PeerProcessTest, ErrorRowAndSilentExitAreErrorsSayingWhy) {
  try {
    run_peer_json(fake_peer("fail"), {.name = "torch peer"}, 60s);
    FAIL() << "an error row was returned as a result";
  } catch (const PeerFailed& e) {
    EXPECT_NE(std::string(e.what()).find("torch peer: \"rank 1 exited with 1\""), std::string::npos) << e.what();
  }
  try {
    run_peer_json(fake_peer("silent"), {.name = "torch peer"}, 60s);
    FAIL() << "a silent peer returned a result";
  } catch (const PeerFailed& e) {
    EXPECT_NE(std::string(e.what()).find("torch peer exited with status 4 without printing a JSON object"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(PeerProcessTest, RankStuckAtExitIsKilledOnceTheResultIsIn) {
  PeerProcess peer(fake_peer("straggler"), {});
  auto first = peer.read_line(60s);
  ASSERT_TRUE(first.has_value());
  const pid_t rank = std::stoi(*first);
  auto row = peer.read_line(60s);
  ASSERT_TRUE(row.has_value());
  EXPECT_NE(row->find("\"value\": 7"), std::string::npos) << *row;
  // The leader exits; the rank still holds stdout and would never let EOF come.
  int status = peer.wait(60s);
  EXPECT_EQ(describe_exit(status), "exited with status 0");
  EXPECT_TRUE(eventually_gone(rank)) << "rank " << rank;
}

TEST_F(PeerProcessTest, ForkedPeerAnswersOnItsStdout) {
  PeerProcess peer(
      [] {
        std::string line;
        char c;
        while (::read(0, &c, 1) == 1 && c != '\n') line += c;
        std::printf("echo %s\n", line.c_str());
        return 0;
      },
      {.stdin_pipe = true, .name = "forked rank"});
  ASSERT_TRUE(peer.write("ping\n"));
  auto line = peer.read_line(60s);
  ASSERT_TRUE(line.has_value());
  EXPECT_EQ(*line, "echo ping");
  peer.close_stdin();
  EXPECT_EQ(describe_exit(peer.wait(60s)), "exited with status 0");
  EXPECT_FALSE(peer.read_line(60s).has_value());  // EOF
}

TEST(PeerProcessStartTest, MissingExecutableIsAnErrorNotAHang) {
  try {
    run_peer_json({"/nonexistent/peer"}, {}, 60s);
    FAIL() << "a missing executable returned a result";
  } catch (const PeerFailed& e) {
    EXPECT_NE(std::string(e.what()).find("exited with status 127"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace troupe::bench
