// The worker binary of bench/soak.cc's actor and task cycles: it hosts
// Echo and twice (soak_echo.h) and links the runtime only.
#include <cstdio>

#include "bench/soak_echo.h"

TROUPE_REGISTER_CTOR(Echo)

int main(int argc, char** argv) {
  troupe::run_role_if_requested(argc, argv);
  std::fprintf(stderr, "troupe_bench_soak_worker: started by troupe_bench_soak as its actors' worker, not by hand\n");
  return 2;
}
