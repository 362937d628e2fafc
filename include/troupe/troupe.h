// The header a troupe user includes: the runtime's client API (init,
// Runtime, actors, placement groups, futures, streams, errors) and the
// testing helpers for whole clusters in one process tree. Collective groups
// inside actors are in <troupe/runtime/collective/actor_group.h>, training in
// <troupe/trainer.h>.
#pragma once

#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/client/stream.h"
#include "troupe/runtime/testing/fault_injector.h"
#include "troupe/runtime/testing/local_cluster.h"
