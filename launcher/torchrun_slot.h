// The slot actor of `troupe torchrun`: one per rank, placed by the driver in
// the attempt's placement group. It runs its rank's script as a child
// process (the interpreter, fork/exec'd in a process group of its own, which
// dies with the slot), forwards the script's stdout and stderr line by line
// to the driver over a stream, and reports how the script ended. It links
// no LibTorch: the script's interpreter does the training, so the `troupe`
// binary serves it as a worker.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/client/shipped_file.h"
#include "troupe/runtime/client/stream.h"

namespace troupe::launcher {

// One line of a script's output (without its newline).
struct OutputLine {
  int32_t rank = 0;
  bool is_stderr = false;
  std::string text;
  // A piece of a line longer than a message carries (OutputPump's
  // kMaxLine): the line goes on in the next one.
  bool continues = false;
  TROUPE_FIELDS(rank, is_stderr, text, continues)
};

// What a slot runs: `python [-m] script args...` (with `no_python`,
// `script args...`) with `env` added to the node's environment, in
// `working_dir` when that exists on the node. With `shipped` (the driver's
// working directory, --ship-working-dir), the script and the working
// directory are the node's copy of it.
struct ScriptLaunch {
  int32_t rank = 0;
  std::string python;
  bool module = false;
  bool no_python = false;
  std::string script;
  std::vector<std::string> args;
  std::vector<std::string> env;  // torchrun's variables, KEY=VALUE
  std::string working_dir;
  std::string run_id;  // names the TORCHELASTIC_ERROR_FILE folder
  int32_t restart_count = 0;
  StreamRef output;  // where the lines go
  // Warm restarts: the slot keeps a spare interpreter that has imported
  // `preload` (started `spare_delay_ms` after this script, so that it does
  // not compete with its start), and the next attempt's script runs in it.
  bool warm = true;
  std::vector<std::string> preload;
  uint32_t spare_delay_ms = 2000;
  ShippedDir shipped;
  TROUPE_FIELDS(rank, python, module, no_python, script, args, env, working_dir, run_id, restart_count, output, warm,
                preload, spare_delay_ms, shipped)
};

// How a script ended: its wait status (`describe_exit_status` spells it),
// and the error file it wrote (torch.distributed.elastic's @record), if any.
struct ScriptExit {
  bool started = false;
  int32_t wait_status = 0;
  std::string error_file_text;
  TROUPE_FIELDS(started, wait_status, error_file_text)
};

// Control message: stop the script of attempt `restart_count` (or an
// earlier one) — `signal` (SIGTERM, or the launcher's Ctrl-C SIGINT) to
// its process group, SIGKILL after `grace_ms` — as torchrun stops its
// workers; a start() of that attempt arriving later is refused. Served
// beside a running wait_exit(); the reply is 1 when a script was
// signalled.
struct StopScript {
  static constexpr const char* kControlTag = "torchrun.stop";
  using Reply = int32_t;
  uint32_t grace_ms = 5000;
  int32_t restart_count = 0;
  int32_t signal = 15;  // SIGTERM
  TROUPE_FIELDS(grace_ms, restart_count, signal)
};

// A resource: one per worker process. A slot serves the attempts of its
// group one after another while the group keeps its shape: start() is
// accepted again once the previous script has exited.
class TorchrunSlot {
 public:
  TorchrunSlot();
  ~TorchrunSlot();
  TorchrunSlot(const TorchrunSlot&) = delete;
  TorchrunSlot& operator=(const TorchrunSlot&) = delete;

  // A TCP port free on this node now, outside the ephemeral range when it
  // can (rank 0's slot gives MASTER_PORT).
  int32_t free_port();
  // The GPUs this slot was given as its CUDA_VISIBLE_DEVICES names them:
  // its node agent's own devices, not the node's numbers (which are the
  // agent's k-th devices); "" for a CPU slot.
  std::string devices();
  // This node's copy of the driver's shipped working directory (fetched
  // and unpacked by the node's first slot; the others wait for it), before
  // any start(): a large one may take longer than a start is waited for.
  // ConfigError naming the node when it cannot be made.
  std::string prepare(ShippedDir dir);
  // Starts the script (in the spare interpreter when there is one for the
  // same interpreter); returns its pid, -1 when its attempt was stopped
  // already. ConfigError when the interpreter is not found or cannot run.
  int64_t start(ScriptLaunch launch);
  // Waits until the script exits and its output is forwarded.
  ScriptExit wait_exit();

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// `name` when it holds a '/', else the first executable `name` in `path`
// (a PATH value); "" when there is none.
std::string find_executable(const std::string& name, const std::string& path);

}  // namespace troupe::launcher

TROUPE_ACTOR(troupe::launcher::TorchrunSlot, &troupe::launcher::TorchrunSlot::free_port,
             &troupe::launcher::TorchrunSlot::devices, &troupe::launcher::TorchrunSlot::prepare,
             &troupe::launcher::TorchrunSlot::start, &troupe::launcher::TorchrunSlot::wait_exit)
