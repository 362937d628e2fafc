// The worker side of the Python shim: a Python worker is the C++ worker loop
// (run_role_if_requested) inside the interpreter. This file registers the
// Python actor factory (kPyActorKey) and the Python task (kPyTaskName) with
// the runtime's tables, so that the worker serves Python actors and the
// runtime's task executor runs Python tasks; both hand the call to hooks of
// troupe/_worker_hooks.py under the GIL, after resolving the top-level refs
// with the GIL released.
#pragma once

#include <pybind11/pybind11.h>

namespace troupe::py {

// Installs the hooks object (make_actor, call_method, run_task) and serves
// the role TROUPE_ROLE names; never returns in a worker. Returns (to raise)
// when this process was not started as a troupe worker.
void serve_worker(pybind11::object hooks);

}  // namespace troupe::py
