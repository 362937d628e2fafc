// A C++ driver's console is the program's own: troupe::init logs the
// runtime's warnings and errors there, not an [info] line per actor placed
// or stopped, unless TROUPE_LOG_LEVEL asks for them (as a Python driver's
// troupe.init() does). Runs examples/hello_actors, a real driver on an
// embedded cluster that spawns, calls and kills an actor.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/core/process.h"

extern char** environ;

namespace {

using namespace std::chrono_literals;

struct Output {
  int status = -1;
  std::string text;  // stdout and stderr
};

// A program's output with this environment minus every TROUPE_ variable
// (no TROUPE_ADDRESS: it embeds its own cluster), plus `extra`. Killed
// after 45 s, well inside ctest's limit, so a hang shows its output.
[[maybe_unused]] Output run_program(const std::string& executable, const std::vector<std::string>& args,
                                    const std::vector<std::string>& extra) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e)
    if (std::string(*e).rfind("TROUPE_", 0) != 0) env.emplace_back(*e);
  env.insert(env.end(), extra.begin(), extra.end());
  const auto log = std::filesystem::temp_directory_path() /
                   ("troupe-driver-log-" + std::to_string(::getpid()) + "-" + std::to_string(extra.size()) + ".log");
  std::filesystem::remove(log);
  troupe::core::SpawnOptions o;
  o.executable = executable;
  o.args = args;
  o.env = env;
  o.log_file = log.string();
  const pid_t pid = troupe::core::spawn_process(o);
  Output out;
  bool killed = false;
  const auto deadline = std::chrono::steady_clock::now() + 45s;
  while (::waitpid(pid, &out.status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      troupe::core::wait_child(pid, &out.status);
      killed = true;
      break;
    }
    std::this_thread::sleep_for(20ms);  // polling a child's exit, bounded above
  }
  std::ifstream in(log);
  out.text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  std::filesystem::remove(log);
  if (killed) out.text += "\n[killed after 45 s]";
  return out;
}

TEST(DriverLogTest, TroupeInitLogsWarningsOnlyUnlessTroupeLogLevelSaysMore) {
#ifndef TROUPE_HELLO_ACTORS
  GTEST_SKIP() << "built without the examples (TROUPE_BUILD_EXAMPLES=OFF): no hello_actors to run";
#else
  const auto quiet = run_program(TROUPE_HELLO_ACTORS, {}, {});
  ASSERT_TRUE(WIFEXITED(quiet.status) && WEXITSTATUS(quiet.status) == 0) << quiet.text;
  EXPECT_NE(quiet.text.find("spawned Counter(10)"), std::string::npos) << quiet.text;
  EXPECT_EQ(quiet.text.find("[info]"), std::string::npos) << quiet.text;

  const auto loud = run_program(TROUPE_HELLO_ACTORS, {}, {"TROUPE_LOG_LEVEL=info"});
  ASSERT_TRUE(WIFEXITED(loud.status) && WEXITSTATUS(loud.status) == 0) << loud.text;
  EXPECT_NE(loud.text.find("[info]"), std::string::npos) << loud.text;
#endif
}

// A log level by name in InitOptions, as Python's init(logging_level=...):
// a name that is none of the levels is refused before anything starts.
TEST(DriverLogTest, AnUnknownLogLevelInInitOptionsIsRefusedByName) {
  troupe::InitOptions o;
  o.log_level = "verbose";
  try {
    troupe::init(o);
    FAIL() << "init took log_level 'verbose'";
  } catch (const troupe::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("InitOptions::log_level 'verbose' is not one of"), std::string::npos)
        << e.what();
  }
}

// A program whose main() does not serve troupe's roles first (a test linked
// with gtest_main's main) ran itself again in every head, node agent or
// worker it started, each starting another cluster: a probe counted 133
// nested copies in half a second. Such a process now ends at once, and the
// program fails saying what its main() must call.
TEST(DriverLogTest, AProgramWhoseMainServesNoRoleFailsSayingSoInsteadOfStartingItselfAgain) {
  for (const char* mode : {"local-cluster", "embedded"}) {
    const auto out = run_program(TROUPE_ROLE_UNAWARE_MAIN, {}, {std::string("ROLE_UNAWARE_MODE=") + mode});
    EXPECT_TRUE(WIFEXITED(out.status) && WEXITSTATUS(out.status) == 1) << mode << ":\n" << out.text;
    EXPECT_NE(out.text.find("must call troupe::run_role_if_requested(argc, argv)"), std::string::npos) << mode << ":\n"
                                                                                                       << out.text;
  }
}

}  // namespace
