// The main of every troupe test binary: serve a role first when the binary
// was re-executed as a head, node agent or worker; otherwise run the tests.
#include <gtest/gtest.h>

#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/core/logging.h"

int main(int argc, char** argv) {
  troupe::run_role_if_requested(argc, argv);
  troupe::core::init_logging("test");
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
