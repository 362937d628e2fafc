// `troupe slurm`: a troupe cluster inside a Slurm allocation, for the life
// of one driver. From the batch step (sbatch or salloc) it starts the head
// on the first node (`troupe start --head --block`, its child), a node agent
// on every node of the allocation with one `srun` (`troupe start --address
// HEAD --block` per node, resources from the allocation), waits for all of
// them, runs the driver with TROUPE_ADDRESS/TROUPE_TOKEN/TROUPE_SESSION_DIR
// set, and tears the cluster down when the driver exits or the job is
// cancelled (SIGTERM, as scancel sends): nothing is left running.
#pragma once

#include <string>
#include <vector>

namespace troupe::launcher {

struct SlurmOptions {
  int port = 6380;
  int dashboard_port = -1;  // -1 = off
  int gpus_per_node = -1;   // -1 = what the allocation has; N = require N
  double start_timeout_s = 120;
  std::vector<std::string> command;  // the driver and its arguments
  bool print_sbatch = false;         // write an sbatch script instead
};

// Runs it; returns the driver's exit code (2 for bad input, with a message
// naming the variable or value).
int run_slurm(const SlurmOptions& o, const std::string& self);

// An sbatch script that runs `troupe slurm -- COMMAND` (--print-sbatch).
std::string sbatch_script(const SlurmOptions& o, const std::string& self);

}  // namespace troupe::launcher
