// CPU priority of background work: a node agent refilling its warm worker
// pool starts the new workers under SCHED_IDLE, so their exec, library
// loading and static initialisation use only CPU time nothing else wants
// (on a small machine they would otherwise compete with the recovery or
// spawn that took a worker from the pool). A worker handed an actor must
// run at normal priority again, and leaving SCHED_IDLE needs CAP_SYS_NICE
// or an RLIMIT_NICE of 20: the pool uses idle priority only where this
// process can undo it.
#pragma once

#include <sys/types.h>

namespace troupe::core {

// Whether this process may move a thread from SCHED_IDLE back to
// SCHED_OTHER (probed once, on a short-lived thread of its own).
bool can_restore_normal_priority();

// Moves every thread of `pid` to SCHED_IDLE (always permitted for one's
// own processes). False when some thread could not be moved.
bool enter_idle_priority(pid_t pid);

// Moves every thread of `pid` (0: this process) that is under SCHED_IDLE to
// SCHED_OTHER, keeping its nice value; other threads are left alone. False
// when some thread could not be moved (it may have exited meanwhile).
bool leave_idle_priority(pid_t pid);

}  // namespace troupe::core
