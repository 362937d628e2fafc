// Control messages between a submitter and its task executors that only
// the two of them know (not in task.h, which every file includes).
#pragma once

#include <cstdint>

#include "troupe/runtime/wire/codec.h"

namespace troupe::client {

// From a submitter to an idle task executor it keeps for the objects in
// its store (a result kept there by submit_ref, an object a Python task
// put): replies how many objects that store holds now. None left (the
// refs fetched and let go), the executor is released like any idle one;
// it held its resources (a GPU) until the driver exited.
struct ObjectsHeld {
  static constexpr const char* kControlTag = "troupe.task.objects_held";
  using Reply = int64_t;
  TROUPE_FIELDS()
};

}  // namespace troupe::client
