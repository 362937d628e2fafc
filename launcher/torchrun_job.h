// The driver side of `troupe torchrun`: how many nodes an attempt gets and
// where its ranks go (a STRICT_SPREAD placement group, one bundle per node,
// one TorchrunSlot actor per rank), running the attempt until a rank fails
// or every rank finishes, stopping it, and restarting it under torchrun's
// rules (TORCHELASTIC_RESTART_COUNT + 1, at most --max-restarts times;
// with --nnodes MIN:MAX the next attempt takes the nodes alive then).
#pragma once

#include "stop_signals.h"
#include "torchrun_options.h"
#include "troupe/runtime/client/runtime.h"

namespace troupe::launcher {

// Runs the job on `rt`'s cluster; returns the exit code of `troupe
// torchrun`: 0 when every rank of an attempt exited 0, else the failed
// rank's code (128 + signal when killed, 1 when its slot was lost). With
// `stop` requested (SIGINT/SIGTERM to the command) every rank gets SIGTERM,
// as torchrun sends its workers, and SIGKILL after kFinalGraceMs; no
// restart follows and the code is 128 + that signal.
int run_torchrun(Runtime& rt, const TorchrunOptions& options, const StopSignals* stop = nullptr);
// torchrun's grace between SIGTERM and SIGKILL when the command is stopped.
inline constexpr uint32_t kFinalGraceMs = 30000;

// The embedded cluster's node resources for `options`: at least one CPU
// per rank (torchrun starts nproc processes whatever the core count).
Resources torchrun_local_resources(const TorchrunOptions& options);

}  // namespace troupe::launcher
