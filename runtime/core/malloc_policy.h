// How a worker's heap treats memory that was freed. A training step frees
// and allocates the same tens of megabytes of activations and gradients
// every time; with glibc's defaults the large blocks are unmapped or trimmed
// on free and their pages faulted in and zeroed again on the next step
// (thousands of page faults a step for a small transformer on one core).
// Workers keep freed memory in their heap for reuse instead: the knob is
// TROUPE_WORKER_MALLOC, "reuse" (the default) or "system" (glibc's
// defaults, for an actor that should hand memory back after a peak).
#pragma once

#include <string>
#include <vector>

#include "troupe/runtime/core/worker_env.h"

namespace troupe::core {

enum class MallocPolicy { kReuse, kSystem };

// The policy TROUPE_WORKER_MALLOC names (unset or empty: kReuse); throws
// ConfigError naming the variable and its value otherwise.
MallocPolicy malloc_policy_from_env();

// Applies `policy` to this process's heap. kReuse: blocks up to 32 MiB come
// from the heap rather than from mmap, the heap is never trimmed, and a
// thread's arena keeps 64 MiB of slack, so that a heap a thread emptied is
// not unmapped (glibc deletes such heaps whatever the trim threshold). It
// changes only where memory comes from, never what a program computes.
// kSystem changes nothing. Returns "" when applied, else what libc refused.
std::string apply_malloc_policy(MallocPolicy policy);

// The part of kReuse that glibc reads only at exec: a worker's environment
// `env` (KEY=VALUE, the last setting of a name wins, as in spawn_process)
// gets glibc.malloc.hugetlb=1 added to its GLIBC_TUNABLES, so the heap asks
// for transparent huge pages (where the kernel leaves them to madvise),
// unless `env` asks for "system" or its GLIBC_TUNABLES already sets that
// tunable.
void add_exec_time_malloc_settings(std::vector<std::string>& env);

}  // namespace troupe::core
