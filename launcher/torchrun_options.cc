#include "torchrun_options.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <map>
#include <random>
#include <set>

#include "troupe/runtime/wire/address.h"

namespace troupe::launcher {

namespace {

constexpr int kMaxNodes = 4096;
constexpr int kMaxProcPerNode = 1024;
constexpr int kMaxRestarts = 1000000;

// A whole decimal number in [lo, hi]; otherwise an error naming the flag
// and the value.
int parse_int(const std::string& flag, const std::string& value, int lo, int hi) {
  int v = 0;
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (value.empty() || ec != std::errc() || end != value.data() + value.size() || v < lo || v > hi)
    throw TorchrunUsageError(flag + " " + (value.empty() ? "\"\"" : value) + ": expected a whole number in [" +
                             std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return v;
}

// A dotted Python module name: ASCII identifiers joined by '.', none empty,
// none that begins with a digit.
bool is_module_name(const std::string& m) {
  for (size_t start = 0;;) {
    const size_t dot = std::min(m.find('.', start), m.size());
    if (dot == start || std::isdigit(static_cast<unsigned char>(m[start]))) return false;
    for (size_t i = start; i < dot; ++i)
      if (!std::isalnum(static_cast<unsigned char>(m[i])) && m[i] != '_') return false;
    if (dot == m.size()) return true;
    start = dot + 1;
  }
}

// A comma-separated list of Python module names ("" = none).
std::vector<std::string> parse_module_list(const std::string& flag, const std::string& v) {
  std::vector<std::string> mods;
  size_t start = 0;
  while (start <= v.size() && !v.empty()) {
    size_t comma = std::min(v.find(',', start), v.size());
    std::string m = v.substr(start, comma - start);
    if (!is_module_name(m))
      throw TorchrunUsageError(flag + " " + v + ": '" + m + "' is not a module name (give a,b.c or \"\")");
    mods.push_back(m);
    start = comma + 1;
  }
  return mods;
}

// torchrun's flags that take a value, under every spelling it accepts.
enum class Flag {
  kNproc,
  kNnodes,
  kMaxRestarts,
  kAddress,
  kPython,
  kRunId,
  kPreload,
  kShipExclude,
  kNodeRank,
  kLocalRanksFilter,
  kIgnored
};

const std::map<std::string, Flag>& value_flags() {
  static const std::map<std::string, Flag> flags = {
      {"--nproc-per-node", Flag::kNproc},
      {"--nproc_per_node", Flag::kNproc},
      {"--nnodes", Flag::kNnodes},
      {"--max-restarts", Flag::kMaxRestarts},
      {"--max_restarts", Flag::kMaxRestarts},
      {"--address", Flag::kAddress},
      {"--python", Flag::kPython},
      {"--run-id", Flag::kRunId},
      {"--run_id", Flag::kRunId},
      {"--rdzv-id", Flag::kRunId},
      {"--rdzv_id", Flag::kRunId},
      {"--preload", Flag::kPreload},
      {"--ship-exclude", Flag::kShipExclude},
      {"--node-rank", Flag::kNodeRank},
      {"--node_rank", Flag::kNodeRank},
      {"--local-ranks-filter", Flag::kLocalRanksFilter},
      {"--local_ranks_filter", Flag::kLocalRanksFilter},
      // What troupe does its own way: accepted, so that a torchrun command
      // line from a guide or a Slurm script runs as it is.
      {"--rdzv-backend", Flag::kIgnored},
      {"--rdzv_backend", Flag::kIgnored},
      {"--rdzv-endpoint", Flag::kIgnored},
      {"--rdzv_endpoint", Flag::kIgnored},
      {"--rdzv-conf", Flag::kIgnored},
      {"--rdzv_conf", Flag::kIgnored},
      {"--master-addr", Flag::kIgnored},
      {"--master_addr", Flag::kIgnored},
      {"--master-port", Flag::kIgnored},
      {"--master_port", Flag::kIgnored},
      {"--local-addr", Flag::kIgnored},
      {"--local_addr", Flag::kIgnored},
      {"--monitor-interval", Flag::kIgnored},
      {"--monitor_interval", Flag::kIgnored},
      {"--role", Flag::kIgnored},
      {"--tee", Flag::kIgnored},
      {"-t", Flag::kIgnored},
      {"--redirects", Flag::kIgnored},
      {"-r", Flag::kIgnored},
      {"--log-dir", Flag::kIgnored},
      {"--log_dir", Flag::kIgnored},
      {"--logs-specs", Flag::kIgnored},
      {"--logs_specs", Flag::kIgnored},
      {"--log-line-prefix-template", Flag::kIgnored},
      {"--log_line_prefix_template", Flag::kIgnored},
      // Each rank is a process of its own, started fresh or from a spare.
      {"--start-method", Flag::kIgnored},
      {"--start_method", Flag::kIgnored},
  };
  return flags;
}

// torchrun's --nproc-per-node: a count, or cpu, gpu or auto, which
// resolve_nproc() turns into one where the ranks run.
void parse_nproc(TorchrunOptions& o, const std::string& flag, const std::string& v) {
  o.nproc_word.clear();
  if (v == "cpu" || v == "gpu" || v == "auto")
    o.nproc_word = v;
  else
    o.nproc_per_node = parse_int(flag, v, 1, kMaxProcPerNode);
}

// torchrun's --local-ranks-filter: comma-separated local ranks ("0,1").
std::vector<int> parse_local_ranks(const std::string& flag, const std::string& v) {
  std::vector<int> ranks;
  size_t start = 0;
  while (start <= v.size()) {
    size_t comma = std::min(v.find(',', start), v.size());
    int r = 0;
    try {
      r = parse_int(flag, v.substr(start, comma - start), 0, kMaxProcPerNode - 1);
    } catch (const TorchrunUsageError&) {
      throw TorchrunUsageError(flag + " " + (v.empty() ? "\"\"" : v) +
                               ": expected local ranks separated by commas, e.g. 0 or 0,1");
    }
    if (std::find(ranks.begin(), ranks.end(), r) == ranks.end()) ranks.push_back(r);
    start = comma + 1;
  }
  return ranks;
}

void set_value(TorchrunOptions& o, Flag f, const std::string& flag, const std::string& v) {
  switch (f) {
    case Flag::kLocalRanksFilter:
      o.local_ranks_filter = parse_local_ranks(flag, v);
      break;
    case Flag::kNproc:
      parse_nproc(o, flag, v);
      break;
    case Flag::kNodeRank:
      // torchrun runs once per node; troupe runs once for all of them.
      if (parse_int(flag, v, 0, kMaxNodes) != 0)
        throw TorchrunUsageError(flag + " " + v +
                                 ": troupe torchrun starts every node's ranks from one command; run it once, on "
                                 "one machine, with --address of the cluster (docs/torchrun.md)");
      break;
    case Flag::kIgnored:
      o.ignored.push_back(flag + " " + v);
      break;
    case Flag::kNnodes:
      std::tie(o.min_nodes, o.max_nodes) = parse_nnodes(v, flag);
      break;
    case Flag::kMaxRestarts:
      o.max_restarts = parse_int(flag, v, 0, kMaxRestarts);
      break;
    case Flag::kAddress:
      // Checked here, as every other flag is: a malformed one is usage
      // (exit 2, nothing started), where it failed later with exit 1.
      if (v != "auto") {
        try {
          wire::parse_address(v);
        } catch (const ConfigError& e) {
          throw TorchrunUsageError(flag + " " + v + ": " + e.what());
        }
      }
      o.address = v;
      break;
    case Flag::kPython:
      if (v.empty()) throw TorchrunUsageError(flag + " \"\": give an interpreter");
      o.python = v;
      break;
    case Flag::kRunId:
      if (v.empty()) throw TorchrunUsageError(flag + " \"\": give a run id");
      o.run_id = v;
      break;
    case Flag::kPreload:
      o.preload = parse_module_list(flag, v);
      break;
    case Flag::kShipExclude:
      for (size_t start = 0; start <= v.size();) {
        const size_t comma = std::min(v.find(',', start), v.size());
        if (comma > start) o.ship_excludes.push_back(v.substr(start, comma - start));
        start = comma + 1;
      }
      if (o.ship_excludes.empty()) throw TorchrunUsageError(flag + " \"\": give fnmatch patterns, a,b");
      break;
  }
}

// One option at args[i] (a value may follow it); returns the next index.
size_t parse_option(TorchrunOptions& o, const std::vector<std::string>& args, size_t i) {
  const std::string& arg = args[i];
  if (arg == "-h" || arg == "--help") {
    o.help = true;
    return i + 1;
  }
  if (arg == "-m" || arg == "--module") {
    o.module = true;
    return i + 1;
  }
  if (arg == "--cold-restarts") {
    o.cold_restarts = true;
    return i + 1;
  }
  if (arg == "--ship-working-dir") {
    o.ship_working_dir = true;
    return i + 1;
  }
  if (arg == "--no-python" || arg == "--no_python") {
    o.no_python = true;
    return i + 1;
  }
  // torchrun runs the script in its agent's interpreter with runpy; troupe
  // runs each rank in an interpreter of its own, which the script sees the
  // same way.
  if (arg == "--run-path" || arg == "--run_path") {
    o.ignored.push_back(arg);
    return i + 1;
  }
  // torchrun's single-node rendezvous is what troupe always does.
  if (arg == "--standalone") return i + 1;
  // A one-letter option's value may be attached, as argparse allows: -r3.
  if (arg.size() > 2 && arg[0] == '-' && arg[1] != '-' && arg[2] != '=') {
    if (auto short_flag = value_flags().find(arg.substr(0, 2)); short_flag != value_flags().end()) {
      set_value(o, short_flag->second, short_flag->first, arg.substr(2));
      return i + 1;
    }
  }
  auto eq = arg.find('=');
  std::string flag = arg.substr(0, eq);
  auto it = value_flags().find(flag);
  if (it == value_flags().end()) throw TorchrunUsageError("unknown option " + flag + " (see troupe torchrun --help)");
  if (eq != std::string::npos) {
    set_value(o, it->second, flag, arg.substr(eq + 1));
    return i + 1;
  }
  if (i + 1 >= args.size()) throw TorchrunUsageError(flag + " needs a value");
  set_value(o, it->second, flag, args[i + 1]);
  return i + 2;
}

}  // namespace

std::pair<int, int> parse_nnodes(const std::string& value, const std::string& flag) {
  auto colon = value.find(':');
  if (colon == std::string::npos) {
    int n = parse_int(flag, value, 1, kMaxNodes);
    return {n, n};
  }
  auto bad = [&](const std::string& why) {
    return TorchrunUsageError(flag + " " + value + ": " + why + " (give N or MIN:MAX with 1 <= MIN <= MAX)");
  };
  int lo = 0, hi = 0;
  try {
    lo = parse_int(flag, value.substr(0, colon), 1, kMaxNodes);
    hi = parse_int(flag, value.substr(colon + 1), 1, kMaxNodes);
  } catch (const TorchrunUsageError&) {
    throw bad("MIN and MAX must be whole numbers in [1, " + std::to_string(kMaxNodes) + "]");
  }
  if (lo > hi) throw bad("MIN is above MAX");
  return {lo, hi};
}

TorchrunOptions parse_torchrun_args(const std::vector<std::string>& args,
                                    const std::function<const char*(const char*)>& env) {
  TorchrunOptions o;
  size_t i = 0;
  // Options come before the script; everything after it is the script's.
  while (i < args.size() && args[i].size() > 1 && args[i][0] == '-' && args[i] != "--") {
    i = parse_option(o, args, i);
    if (o.help) return o;
  }
  // torchrun's environment defaults, for the options the command line
  // did not give (a bad value is named by its variable).
  // Given in any spelling of the option (--run-id is --rdzv_id's: a
  // PET_RDZV_ID overrode it), a short one with its value attached too.
  std::set<Flag> given_flags;
  for (size_t k = 0; k < i; ++k) {
    const std::string& arg = args[k];
    if (arg.size() < 2 || arg[0] != '-') continue;
    auto it = value_flags().find(arg.substr(0, arg.find('=')));
    if (it == value_flags().end() && arg[1] != '-') it = value_flags().find(arg.substr(0, 2));
    if (it != value_flags().end()) given_flags.insert(it->second);
  }
  for (const std::string flag :
       {"--nproc_per_node", "--nnodes", "--max_restarts", "--rdzv_id", "--node_rank", "--local_ranks_filter"}) {
    const bool given = given_flags.count(value_flags().at(flag)) != 0;
    std::string name = "PET_" + flag.substr(2);
    for (auto& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    const char* value = env && !given ? env(name.c_str()) : nullptr;
    if (value && *value) set_value(o, value_flags().at(flag), name, value);
  }
  if (i < args.size() && args[i] == "--") ++i;
  if (i >= args.size())
    throw TorchrunUsageError("give the training script (troupe torchrun [options] script.py args...)");
  o.script = args[i];
  o.script_args.assign(args.begin() + static_cast<std::ptrdiff_t>(i) + 1, args.end());
  if (o.no_python && o.module)
    throw TorchrunUsageError("--no-python and -m cannot be combined: -m names a Python module for the interpreter");
  if (!o.ship_excludes.empty() && !o.ship_working_dir)
    throw TorchrunUsageError("--ship-exclude leaves files out of what --ship-working-dir ships: give both");
  return o;
}

std::string torchrun_usage() {
  return "usage: troupe torchrun [--nproc-per-node N] [--nnodes N|MIN:MAX] [--max-restarts K]\n"
         "                       [--address HOST:PORT] [--python PATH] [--run-id ID] [-m]\n"
         "                       [--preload MODULES] [--cold-restarts] [--no-python]\n"
         "                       [--local-ranks-filter R,...] [--ship-working-dir [--ship-exclude P,...]]\n"
         "                       script.py [args...]\n"
         "\n"
         "Runs an unmodified torchrun script on a troupe cluster (an embedded local one without\n"
         "--address): N worker processes per node, each with torchrun's environment (RANK,\n"
         "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, ...).\n"
         "When a worker dies every worker is stopped and the group restarts, up to K times;\n"
         "with MIN:MAX nodes the group shrinks to the live nodes (not below MIN) and grows\n"
         "into new ones at a restart. Output lines carry torchrun's [default<rank>]: prefix.\n"
         "Options also take torchrun's underscore spellings (--nproc_per_node, --max_restarts)\n"
         "and --flag=value; --nproc-per-node takes cpu, gpu or auto (this machine's) without\n"
         "--address. torchrun's rendezvous,\n"
         "port and log options (--rdzv-backend, --rdzv-endpoint, --master-port, --tee, ...) are\n"
         "accepted and ignored, with a note: troupe places and connects the ranks itself;\n"
         "so are --standalone and --node-rank 0 (one troupe torchrun starts every node's ranks).\n"
         "--rdzv-id is --run-id; --module is -m.\n"
         "--python: the interpreter (default python3 on each node's PATH). --no-python runs the\n"
         "script as a program of its own (a shell script, a binary; looked up on PATH without a /).\n"
         "--local-ranks-filter 0,1: print only those local ranks' output (the others' is read and\n"
         "dropped).\n"
         "A restart runs each rank in a spare interpreter that has imported --preload MODULES\n"
         "already (default torch,torch.distributed,torch.nn.parallel; \"\" = none);\n"
         "--cold-restarts starts every attempt in a fresh interpreter, as torchrun does.\n"
         "--ship-working-dir: for nodes that do not share this machine's files, pack the current\n"
         "directory (the script must be in it; .gitignore, .rayignore and --ship-exclude patterns\n"
         "leave files out) and run each rank in its node's copy of it, made for this run: what\n"
         "ranks write there stays on their node; write checkpoints to shared storage.\n"
         "See docs/torchrun.md.\n";
}

void resolve_nproc(TorchrunOptions& o, int cpus, int gpus) {
  if (o.nproc_word.empty()) return;
  if (!o.address.empty())
    throw TorchrunUsageError("--nproc-per-node " + o.nproc_word +
                             " counts this machine's CPUs or GPUs, and the ranks run on the cluster's nodes: give a "
                             "number with --address");
  if (o.nproc_word == "gpu" && gpus == 0)
    throw TorchrunUsageError("--nproc-per-node gpu: this machine has no GPU (give a number)");
  o.nproc_per_node = std::clamp(o.nproc_word == "cpu" || gpus == 0 ? cpus : gpus, 1, kMaxProcPerNode);
}

std::vector<std::string> torchrun_env(const RankPlace& p, const AttemptEnv& a) {
  std::vector<std::string> env = {
      "LOCAL_RANK=" + std::to_string(p.local_rank),
      "RANK=" + std::to_string(p.rank),
      "GROUP_RANK=" + std::to_string(p.group_rank),
      "ROLE_RANK=" + std::to_string(p.rank),
      "ROLE_NAME=default",
      "LOCAL_WORLD_SIZE=" + std::to_string(p.local_world_size),
      "WORLD_SIZE=" + std::to_string(p.world_size()),
      "GROUP_WORLD_SIZE=" + std::to_string(p.group_world_size),
      "ROLE_WORLD_SIZE=" + std::to_string(p.world_size()),
      "MASTER_ADDR=" + a.master_addr,
      "MASTER_PORT=" + std::to_string(a.master_port),
      "TORCHELASTIC_RESTART_COUNT=" + std::to_string(a.restart_count),
      "TORCHELASTIC_MAX_RESTARTS=" + std::to_string(a.max_restarts),
      "TORCHELASTIC_RUN_ID=" + a.run_id,
      // torchrun's c10d rendezvous: rank 0's process hosts the TCP store.
      "TORCHELASTIC_USE_AGENT_STORE=False",
      "NCCL_ASYNC_ERROR_HANDLING=" + a.nccl_async_error_handling,
      "TORCH_NCCL_ASYNC_ERROR_HANDLING=" + a.torch_nccl_async_error_handling,
  };
  if (!a.omp_num_threads.empty()) env.push_back("OMP_NUM_THREADS=" + a.omp_num_threads);
  return env;
}

bool kept_from_node(const std::string& name) {
  static const std::set<std::string> exact = {
      // host, login, shell and terminal
      "PATH", "LD_LIBRARY_PATH", "LD_PRELOAD", "HOME", "USER", "LOGNAME", "SHELL", "MAIL", "HOSTNAME", "HOST", "PWD",
      "OLDPWD", "SHLVL", "_", "TERM", "TERMCAP", "COLORTERM", "COLUMNS", "LINES", "DISPLAY", "TMPDIR", "TMUX",
      "TMUX_PANE", "STY", "WINDOW", "LS_COLORS", "PYTHONHOME", "VIRTUAL_ENV", "CONDA_PREFIX",
      // the node's worker adds its malloc settings to the node's value
      "GLIBC_TUNABLES",
      // devices: a rank's are its slot's
      "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
      // torchrun's, set for each rank
      "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
      "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"};
  static const char* const prefixes[] = {"SSH_",  "XDG_",    "DBUS_",         "SLURM_", "SLURMD_",
                                         "SRUN_", "SBATCH_", "SALLOC_",       "PMI_",   "PMIX_",
                                         "OMPI_", "TROUPE_", "TORCHELASTIC_", "PET_",   "CONDA_"};
  if (exact.count(name)) return true;
  for (const char* p : prefixes)
    if (name.rfind(p, 0) == 0) return true;
  return false;
}

std::vector<std::string> rank_environment(const std::vector<std::string>& driver, std::vector<std::string> vars) {
  auto key = [](const std::string& kv) { return kv.substr(0, kv.find('=')); };
  std::set<std::string> set_by_torchrun;
  for (const auto& v : vars) set_by_torchrun.insert(key(v));
  std::vector<std::string> env;
  for (const auto& kv : driver) {
    const std::string k = key(kv);
    if (k.empty() || k.size() == kv.size() || kept_from_node(k) || set_by_torchrun.count(k)) continue;
    env.push_back(kv);
  }
  env.insert(env.end(), std::make_move_iterator(vars.begin()), std::make_move_iterator(vars.end()));
  return env;
}

std::string random_run_id() {
  std::random_device rd;
  std::uniform_int_distribution<int> hex(0, 15);
  std::string id;
  for (int i = 0; i < 32; ++i) {
    if (i == 8 || i == 12 || i == 16 || i == 20) id += '-';
    int digit = hex(rd);
    if (i == 12) digit = 4;                // version 4: random
    if (i == 16) digit = 8 | (digit & 3);  // RFC 4122 variant: 8, 9, a or b
    id += "0123456789abcdef"[digit];
  }
  return id;
}

}  // namespace troupe::launcher
