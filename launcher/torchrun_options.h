// What `troupe torchrun` is asked to run, parsed from its command line with
// torchrun's spellings (--nproc-per-node and --nproc_per_node, --flag=value
// and --flag value), and the environment each rank's script gets: exactly
// the variables torchrun's elastic agent sets (docs/torchrun.md lists them).
// Pure functions, so the launcher's tests check them without a cluster.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "troupe/runtime/core/errors.h"

namespace troupe::launcher {

// A command line `troupe torchrun` refuses; the message names the value.
class TorchrunUsageError : public ConfigError {
 public:
  using ConfigError::ConfigError;
};

struct TorchrunOptions {
  int nproc_per_node = 1;
  std::string nproc_word;  // --nproc-per-node cpu, gpu or auto: resolve_nproc() counts them
  int min_nodes = 1;       // --nnodes MIN:MAX (or N = N:N)
  int max_nodes = 1;
  int max_restarts = 0;
  std::string address;             // "" = an embedded local cluster
  std::string python = "python3";  // looked up on each node's PATH unless a path
  std::string run_id;              // TORCHELASTIC_RUN_ID; "" = a random one
  bool module = false;             // -m: the script is a module name
  bool no_python = false;          // --no-python: the script is a program, run as it is
  std::string script;
  std::vector<std::string> script_args;
  // Restarts in a spare interpreter that has imported `preload` already;
  // --cold-restarts starts every attempt in a fresh one, as torchrun does.
  bool cold_restarts = false;
  std::vector<std::string> preload = {"torch", "torch.distributed", "torch.nn.parallel"};
  // --local-ranks-filter: the local ranks whose output is printed (empty:
  // all).
  std::vector<int> local_ranks_filter;
  // --ship-working-dir: the driver's working directory, packed, is each
  // rank's working directory (its node's copy), for nodes that do not
  // share the driver's files; --ship-exclude patterns leave files out.
  bool ship_working_dir = false;
  std::vector<std::string> ship_excludes;
  bool help = false;
  // torchrun's options that troupe has no use for (its rendezvous, ports
  // and log redirection: troupe places, connects and prefixes the ranks
  // itself), as given: what the note at the start names.
  std::vector<std::string> ignored;
};

// Parses the arguments after `torchrun`; throws TorchrunUsageError.
// `env` looks up torchrun's PET_* variables (PET_NPROC_PER_NODE, PET_NNODES,
// PET_MAX_RESTARTS, PET_RDZV_ID, PET_NODE_RANK, PET_LOCAL_RANKS_FILTER),
// each the default of its option, which the command line overrides, as
// torchrun's argparse has them; null: none.
TorchrunOptions parse_torchrun_args(const std::vector<std::string>& args,
                                    const std::function<const char*(const char*)>& env = nullptr);
// --nproc-per-node cpu, gpu or auto: this machine's `cpus` or `gpus` (auto:
// its GPUs if any, else its CPUs) when the ranks run here, on an embedded
// cluster; with --address a TorchrunUsageError (the nodes may differ).
void resolve_nproc(TorchrunOptions& o, int cpus, int gpus);
// "N" or "MIN:MAX" with 1 <= MIN <= MAX.
// `flag` names where the value came from in an error (PET_NNODES).
std::pair<int, int> parse_nnodes(const std::string& value, const std::string& flag = "--nnodes");
std::string torchrun_usage();

// Where one rank sits in the group of one attempt.
struct RankPlace {
  int rank = 0;
  int local_rank = 0;
  int group_rank = 0;  // the node's index in the group
  int local_world_size = 1;
  int group_world_size = 1;  // nodes in the group
  int world_size() const { return local_world_size * group_world_size; }
};

// What every rank of one attempt shares.
struct AttemptEnv {
  int restart_count = 0;
  int max_restarts = 0;
  std::string run_id;
  std::string master_addr;
  int master_port = 0;
  std::string omp_num_threads;  // "" = not set (torchrun: 1 when nproc > 1 and unset)
  // torchrun sets the one its torch reads: 1.x NCCL_ASYNC_ERROR_HANDLING,
  // 2.x TORCH_NCCL_ASYNC_ERROR_HANDLING; the script's torch may be either.
  std::string nccl_async_error_handling = "1";
  std::string torch_nccl_async_error_handling = "1";
};

// The torchrun variables for one rank, KEY=VALUE (TORCHELASTIC_ERROR_FILE
// and CUDA_VISIBLE_DEVICES are added where the script runs).
std::vector<std::string> torchrun_env(const RankPlace& place, const AttemptEnv& attempt);

// Whether the driver's variable `name` stays out of the ranks' environment:
// the variables of its host, shell, terminal and login (PATH, HOME,
// HOSTNAME, SSH_*, ...), of batch systems and MPI launchers, which set
// them for each process (SLURM_*, PMI_*, OMPI_*), troupe's own (TROUPE_*)
// and those torchrun sets for each rank (RANK, MASTER_PORT, TORCHELASTIC_*,
// CUDA_VISIBLE_DEVICES, ...). A rank has its node's values of these.
bool kept_from_node(const std::string& name);

// The ranks' environment: the driver's variables (`driver`, KEY=VALUE) but
// those kept from the node, then `vars` (torchrun's for the rank), which
// win over the driver's. torchrun's workers inherit their launcher's
// environment; on a cluster (--address) the ranks' processes are the node
// agents' children, so the driver's `NCCL_DEBUG=INFO troupe torchrun ...`
// or PYTHONPATH reaches them only this way.
std::vector<std::string> rank_environment(const std::vector<std::string>& driver, std::vector<std::string> vars);

// The default run id: a random UUID, as torchrun --standalone makes.
std::string random_run_id();

}  // namespace troupe::launcher
