// troupe-worker: the stand-alone worker executable for troupe's built-in
// actors (DESIGN.md §1). The Python shim and YAML jobs spawn data loaders
// with ActorOptions::executable pointing here, since their driver is not a
// C++ program that could serve as the worker itself. A node agent starts it
// with TROUPE_ROLE=worker; run by hand, it only says what it is for.
#include <cstdio>

#include "troupe/actors/data_loader_actor.h"
#include "troupe/runtime/client/runtime.h"

// The constructors a driver may spawn built-in actors with.
TROUPE_REGISTER_CTOR(troupe::actors::DataLoaderActor, troupe::actors::LoaderConfig)

int main(int argc, char** argv) {
  troupe::run_role_if_requested(argc, argv);
  std::fprintf(stderr,
               "troupe-worker hosts troupe's built-in actors (DataLoaderActor) in worker processes that a node\n"
               "agent starts; it is not meant to be run by hand. Spawn with ActorOptions::executable = this path.\n");
  return 2;
}
