// TROUPE_LOG_LEVEL: every spelling users write is read, in any case, and a
// value that is none of them logs at info with a warning naming it. spdlog's
// own parser turned an unknown name into "off", so TROUPE_LOG_LEVEL=verbose
// silenced errors too.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <spdlog/sinks/ostream_sink.h>

#include <chrono>
#include <sstream>
#include <thread>

#include "tests/support/temp_dir.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/core/rate_limited_log.h"
#include "troupe/runtime/core/utf8.h"

namespace troupe::core {
namespace {

TEST(LogLevel, EverySpellingIsReadInAnyCase) {
  using L = spdlog::level::level_enum;
  const std::vector<std::pair<std::string, L>> known = {
      {"trace", L::trace}, {"debug", L::debug},       {"info", L::info}, {"INFO", L::info},
      {"warn", L::warn},   {"Warning", L::warn},      {"error", L::err}, {"err", L::err},
      {"ERROR", L::err},   {"critical", L::critical}, {"off", L::off},   {"OFF", L::off}};
  for (const auto& [name, level] : known) {
    auto got = parse_log_level(name);
    ASSERT_TRUE(got.has_value()) << name;
    EXPECT_EQ(*got, level) << name;
  }
  for (const std::string bad : {"verbose", "", "warnings", "1", "inf o"})
    EXPECT_FALSE(parse_log_level(bad).has_value()) << "'" << bad << "'";
}

// A line a peer can cause at will (a bad frame, a failing event) is logged
// `burst` times per window; the rest are counted, and the count is said
// with the first line of a later window.
TEST(RateLimitedLog, LogsABurstThenCountsWhatItLeftOut) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  auto* log = logger();
  log->sinks().push_back(sink);
  const auto level = log->level();
  log->set_level(spdlog::level::warn);
  RateLimitedLog limited("test lines", 3, std::chrono::milliseconds(1500));
  for (int i = 0; i < 7; ++i) limited.warn("line {}", i);
  std::string first = out.str();
  // The window is a clock's: wait it out.
  std::this_thread::sleep_for(std::chrono::milliseconds(1600));
  limited.warn("line {}", 7);
  log->sinks().pop_back();
  log->set_level(level);
  std::string all = out.str();
  for (int i = 0; i < 3; ++i) EXPECT_NE(first.find("line " + std::to_string(i)), std::string::npos) << first;
  for (int i = 3; i < 7; ++i) EXPECT_EQ(all.find("line " + std::to_string(i)), std::string::npos) << all;
  EXPECT_NE(all.find("4 more test lines were not logged"), std::string::npos) << all;
  EXPECT_NE(all.find("line 7"), std::string::npos) << all;
}

// What a process started with TROUPE_LOG_LEVEL=`value` writes to stderr
// when it logs an error after init_logging.
std::string stderr_of_a_process_logging_at(const std::string& value) {
  int fds[2];
  EXPECT_EQ(::pipe(fds), 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], 2);
    ::close(fds[0]);
    ::setenv("TROUPE_LOG_LEVEL", value.c_str(), 1);
    init_logging("probe");
    TROUPE_LOG_ERROR("an error is still heard");
    spdlog::default_logger()->flush();
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string out;
  std::array<char, 1024> buf;
  ssize_t n;
  while ((n = ::read(fds[0], buf.data(), buf.size())) > 0) out.append(buf.data(), static_cast<size_t>(n));
  ::close(fds[0]);
  int st = 0;
  ::waitpid(pid, &st, 0);
  return out;
}

TEST(LogLevel, AnUnknownValueLogsAtInfoAndNamesItself) {
  const std::string out = stderr_of_a_process_logging_at("verbose");
  EXPECT_NE(out.find("TROUPE_LOG_LEVEL='verbose' is not one of"), std::string::npos) << out;
  EXPECT_NE(out.find("an error is still heard"), std::string::npos) << out;
  const std::string quiet = stderr_of_a_process_logging_at("off");
  EXPECT_EQ(quiet.find("an error is still heard"), std::string::npos) << quiet;
}

}  // namespace
}  // namespace troupe::core

// Text that leaves a process as text: well-formed UTF-8 passes, each byte
// that does not begin a well-formed sequence becomes U+FFFD.
TEST(Utf8, WellFormedTextPassesAndEachBadByteBecomesOneReplacement) {
  using troupe::core::to_valid_utf8;
  using troupe::core::valid_utf8;
  EXPECT_TRUE(valid_utf8("plain"));
  EXPECT_TRUE(valid_utf8("caf\xc3\xa9 \xe2\x9c\x93 \xf0\x9f\x98\x80"));
  EXPECT_FALSE(valid_utf8("\xff"));
  EXPECT_FALSE(valid_utf8("\xc0\xaf"));          // overlong '/'
  EXPECT_FALSE(valid_utf8("\xed\xa0\x80"));      // a surrogate
  EXPECT_FALSE(valid_utf8("\xf4\x90\x80\x80"));  // past U+10FFFF
  EXPECT_FALSE(valid_utf8("\xe2\x9c"));          // cut short
  EXPECT_EQ(to_valid_utf8("a\xff\xfe"
                          "b"),
            "a\xEF\xBF\xBD\xEF\xBF\xBD"
            "b");
  EXPECT_EQ(to_valid_utf8("\xe2\x9c"), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(to_valid_utf8("ok \xc3\xa9"), "ok \xc3\xa9");
}

namespace troupe::core {
namespace {

// A worker's own log is rotated under the name its file has now: a cold
// worker may read its log's temporary name before its node agent renames
// it after the worker's pid, and every rename of the old name then failed
// (the log grew without end).
TEST(OwnLogRotation, FollowsItsFileRenamedAfterItStarted) {
  const auto dir = troupe::test::fresh_dir("own-log");
  const std::string first = (dir / "worker-starting-1.log").string(), named = (dir / "worker-42.log").string();
  int ready[2], go[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(go), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(first.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
    ::dup2(fd, 1);
    ::close(fd);
    ::setenv("TROUPE_OWN_LOG", "1", 1);
    ::setenv("TROUPE_LOG_MAX_BYTES", "4096", 1);
    rotate_own_log_in_background(std::chrono::milliseconds(10));
    char c = 'r';
    if (::write(ready[1], &c, 1) != 1 || ::read(go[0], &c, 1) != 1) ::_exit(2);
    const std::string line(999, 'x');
    for (int i = 0; i < 20; ++i) {
      if (::write(1, line.data(), line.size()) < 0 || ::write(1, "\n", 1) < 0) ::_exit(3);
    }
    const std::string older = named + ".1";
    for (int i = 0; i < 2000 && ::access(older.c_str(), F_OK) != 0; ++i) ::usleep(10000);  // at most 20 s
    ::_exit(::access(older.c_str(), F_OK) == 0 ? 0 : 1);
  }
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ASSERT_EQ(std::rename(first.c_str(), named.c_str()), 0);  // the agent names it after the worker's pid
  ASSERT_EQ(::write(go[1], &c, 1), 1);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  EXPECT_TRUE(std::filesystem::exists(named + ".1"));
  for (int fd : {ready[0], ready[1], go[0], go[1]}) ::close(fd);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace troupe::core
