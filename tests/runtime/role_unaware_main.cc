// A program whose main() forgets to serve troupe's roles first (it never
// calls troupe::run_role_if_requested), as a test binary linked with
// gtest_main's main would. ROLE_UNAWARE_MODE (inherited by the processes it
// starts, as argv is not) says what it does: `local-cluster` builds a
// testing::LocalCluster, `embedded` connects an embedded runtime and spawns
// an actor. Every head,
// node agent or worker troupe starts from this binary runs main() again;
// driver_log_test.cc checks that such a process ends at once, saying why,
// instead of starting another cluster (which started another, without end).
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/testing/local_cluster.h"

namespace {

class Echo {
 public:
  int echo(int x) { return x; }
};

}  // namespace
TROUPE_ACTOR(Echo, &Echo::echo)

int main() {
  const char* env = std::getenv("ROLE_UNAWARE_MODE");
  const std::string mode = env ? env : "";
  try {
    if (mode == "local-cluster") {
      troupe::testing::LocalCluster cluster({.nodes = {{{"CPU", 1}}}, .start_timeout = std::chrono::seconds(10)});
    } else if (mode == "embedded") {
      troupe::Runtime rt = troupe::Runtime::connect({});
      auto echo = rt.spawn<Echo>({.resources = {{"CPU", 1}}});
      std::printf("echo: %d\n", echo.call(&Echo::echo, 7).get(std::chrono::seconds(10)));
    } else {
      std::fprintf(stderr, "role_unaware_main: set ROLE_UNAWARE_MODE to local-cluster or embedded\n");
      return 2;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "role_unaware_main: %s\n", e.what());
    return 1;
  }
  return 0;
}
