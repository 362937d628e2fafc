// The soak's actor and task, in the soak and in its worker binary
// (troupe_bench_soak_worker: the runtime alone, so that the 10,000 actor
// cycles measure the cluster, not LibTorch's start-up in every process the
// warm pool starts).
#pragma once

#include "troupe/runtime/client/runtime.h"

inline int twice(int x) { return 2 * x; }
TROUPE_TASK(twice)

class Echo {
 public:
  int echo(int x) { return x; }
};
TROUPE_ACTOR(Echo, &Echo::echo)
