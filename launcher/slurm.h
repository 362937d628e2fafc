// `troupe slurm`: a troupe cluster inside a Slurm allocation, for the life
// of one driver. On the allocation's first node (an sbatch script, or an
// srun step inside salloc; elsewhere it is refused) it starts the head
// there (`troupe start --head --block`, its child), a node agent
// on every node of the allocation with one `srun` (`troupe start --address
// HEAD --block` per node, each offering its own node's CPUs in the job and
// its own GPUs, or --gpus-per-node), waits for all of them, runs the driver
// with TROUPE_ADDRESS/TROUPE_TOKEN/TROUPE_SESSION_DIR set, and tears the
// cluster down when the driver exits or the job is cancelled (SIGTERM, as
// scancel sends; SIGINT, SIGHUP: exit 128 + the signal): nothing is left
// running.
#pragma once

#include <string>
#include <vector>

namespace troupe::launcher {

struct SlurmOptions {
  // 0: any free port (two jobs sharing a node must not both want 6380;
  // troupe slurm hands the address to the agents and the driver itself).
  int port = 0;
  int dashboard_port = -1;  // -1 = off
  int gpus_per_node = -1;   // -1 = what the allocation has; N = require N
  double start_timeout_s = 120;
  std::vector<std::string> command;  // the driver and its arguments
  bool print_sbatch = false;         // write an sbatch script instead
};

// Runs it; returns the driver's exit code (2 for bad input, with a message
// naming the variable or value).
int run_slurm(const SlurmOptions& o, const std::string& self);
// "" when the options can run, else why not (no driver command, a bad
// --start-timeout): checked before a script is printed too.
std::string bad_slurm_value(const SlurmOptions& o);

// An sbatch script that runs `troupe slurm -- COMMAND` (--print-sbatch).
std::string sbatch_script(const SlurmOptions& o, const std::string& self);

// SLURM_JOB_CPUS_PER_NODE ("72(x2),36": 72 CPUs on each of the first two
// nodes, 36 on the third, in SLURM_JOB_NODELIST's order) as one count per
// node; a ConfigError naming the value when it is not of that form.
std::vector<int> cpus_per_node(const std::string& value);

// The GPUs a node has: SLURM_GPUS_ON_NODE when set (a plain count, else a
// ConfigError naming it), else the devices CUDA sees in
// CUDA_VISIBLE_DEVICES (entries up to the first that names no device: an
// empty one, or a negative index such as the "-1" that hides all).
int gpus_on_node(const std::string& slurm_gpus_on_node, const std::string& cuda_visible_devices);

// The sh script srun runs on each node (its node agent): arguments TROUPE
// ADDRESS GPUS CPUS-OF-NODE-0 CPUS-OF-NODE-1 ...; GPUS "auto" or a count.
std::string slurm_agent_script();

}  // namespace troupe::launcher
