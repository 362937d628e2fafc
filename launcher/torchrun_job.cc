#include "torchrun_job.h"

#include <unistd.h>
#include <algorithm>

#include <condition_variable>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "torchrun_slot.h"
#include "troupe/runtime/core/exception_text.h"
#include "troupe/runtime/core/process.h"
#include "troupe/runtime/wire/address.h"

namespace troupe::launcher {

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// How long an attempt waits for MIN nodes (torchrun's join timeout is 600 s).
constexpr auto kRendezvousTimeout = 300s;
// How long a first attempt waits for a node that could ever hold a node's
// ranks before it gives up (nodes may be joining as the command starts).
constexpr auto kNoNodeGrace = 10s;
// How long one placement try waits before the nodes are counted again.
constexpr auto kPlaceTimeout = 10s;
// SIGTERM to SIGKILL when an attempt is stopped (torchrun: 30 s; scripts
// rarely need long, and a fast restart is the point).
constexpr uint32_t kStopGraceMs = 5000;

std::mutex print_mu;

void say(const std::string& line) {
  std::lock_guard lock(print_mu);
  std::fprintf(stderr, "troupe torchrun: %s\n", line.c_str());
  std::fflush(stderr);
}

// How many nodes an attempt spans and what a rank reserves there.
struct Shape {
  std::string resource;  // "GPU" or "CPU"
  int nodes = 0;
};

// One attempt's group: its placement, its slots (by rank), and a thread per
// rank printing what the slot forwards.
struct Attempt {
  Shape shape;
  PlacementGroup pg;
  bool has_pg = false;
  int restart = 0;         // the attempt now running in the slots
  bool slot_lost = false;  // a slot died or did not answer: form anew
  std::vector<ActorHandle<TorchrunSlot>> slots;
  std::vector<std::unique_ptr<StreamReader<OutputLine>>> readers;
  std::vector<std::thread> printers;
  std::vector<Future<ScriptExit>> exits;
};

// How an attempt ended.
struct Outcome {
  bool ok = true;
  int rank = -1;
  int exit_code = 0;
  std::string cause;
};

int exit_code_of(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return 1;
}

// The first line of the message torch.distributed.elastic's @record wrote.
std::string error_file_message(const std::string& text) {
  if (text.empty()) return "";
  try {
    auto j = nlohmann::json::parse(text);
    auto m = j.at("message");
    std::string s = m.is_object() ? m.at("message").get<std::string>() : m.get<std::string>();
    return s.substr(0, s.find('\n'));
  } catch (const std::exception&) {
    return "";
  }
}

// How long after a script starts its slot starts the spare for the next
// attempt: TROUPE_TORCHRUN_SPARE_DELAY_MS (0 to 600000), default 2000, so
// that the spare's imports do not compete with the script's own start.
uint32_t spare_delay_from_env() {
  const char* v = std::getenv("TROUPE_TORCHRUN_SPARE_DELAY_MS");
  if (!v || !*v) return 2000;
  char* end = nullptr;
  long ms = std::strtol(v, &end, 10);
  if (*end != '\0' || ms < 0 || ms > 600000)
    throw ConfigError(std::string("TROUPE_TORCHRUN_SPARE_DELAY_MS=") + v + ": expected milliseconds in [0, 600000]");
  return static_cast<uint32_t>(ms);
}

// A line joined from its pieces is printed once it is whole, or once it
// holds this much (a script that never ends its line).
constexpr size_t kMaxJoinedLine = 16u << 20;

// Prints a rank's lines as they come, each whole (a long line arrives in
// pieces); with `shown` false reads and drops them (--local-ranks-filter),
// so that the rank never waits on its output.
void print_lines(StreamReader<OutputLine>& reader, bool shown) {
  std::string pending[2];  // a line's pieces so far, stdout's and stderr's
  int rank = 0;
  auto print = [&](bool is_stderr) {
    std::string& line = pending[is_stderr];
    std::lock_guard lock(print_mu);
    FILE* f = is_stderr ? stderr : stdout;
    // torchrun's --tee prefix, "[<role><rank>]:".
    std::fprintf(f, "[default%d]:", rank);
    std::fwrite(line.data(), 1, line.size(), f);
    std::fputc('\n', f);
    std::fflush(f);
    line.clear();
  };
  try {
    while (auto l = reader.read()) {
      if (!shown) continue;
      rank = l->rank;
      pending[l->is_stderr] += l->text;
      if (l->continues && pending[l->is_stderr].size() < kMaxJoinedLine) continue;
      print(l->is_stderr);
    }
  } catch (const std::exception&) {
    // The slot is gone or the stream was cancelled: its lines end here.
  }
  // What a rank left unfinished at its end: its last pieces, a whole 64 KiB
  // each, had nothing after them to say the line was done.
  for (bool is_stderr : {false, true})
    if (!pending[is_stderr].empty()) print(is_stderr);
}

// The command was told to stop (StopSignals): no restart follows.
struct Stopped {
  int signal = 0;
};

class TorchrunJob {
 public:
  TorchrunJob(Runtime& rt, const TorchrunOptions& o, const StopSignals* stop) : rt_(rt), o_(o), stop_(stop) {
    run_id_ = o.run_id.empty() ? random_run_id() : o.run_id;
    std::error_code ec;
    cwd_ = std::filesystem::current_path(ec).string();
    if (const char* v = std::getenv("OMP_NUM_THREADS")) {
      omp_ = v;
    } else if (o.nproc_per_node > 1) {
      omp_ = "1";  // as torchrun does, and says so
      say("setting OMP_NUM_THREADS=1 for each process (torchrun's default with several per node); set it to tune");
    }
    if (const char* v = std::getenv("NCCL_ASYNC_ERROR_HANDLING")) nccl_async_ = v;
    // torch 2.x reads the new name first: a driver that set only the old
    // one (to 0, say) keeps its value there too.
    torch_nccl_async_ = nccl_async_;
    if (const char* v = std::getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")) torch_nccl_async_ = v;
    for (char** e = environ; *e; ++e) driver_env_.emplace_back(*e);
  }

  // Each attempt runs in the slots of the one before while the group keeps
  // its shape (every slot alive, no node to grow into): their spare
  // interpreters have imported torch already. Otherwise the group is placed
  // anew.
  int run() {
    if (o_.ship_working_dir) {
      try {
        ship_working_dir();
      } catch (const ConfigError& e) {
        say(e.what());
        return 1;
      }
    }
    Attempt a;
    for (int restart = 0;; ++restart) {
      Outcome out;
      try {
        if (!reusable(a)) {
          release(a);
          a = Attempt{};
          form(a, Clock::now() + kRendezvousTimeout);
        }
        check_stop();
        launch(a, restart);
        out = watch(a);
      } catch (const ConfigError& e) {
        stop(a);
        release(a);
        say(e.what());
        return 1;
      } catch (const Error& e) {
        // A slot lost while the attempt starts (its node died, a start
        // not answered in time): a failed attempt, restarted as a rank's
        // failure is; it left the driver without stopping the others.
        out = {false, 0, 1, std::string("the attempt could not start its ranks: ") + e.what()};
      } catch (const Stopped& s) {
        // As torchrun: the signal to every script (a preemption-aware one
        // checkpoints then), SIGKILL after the grace. Ctrl-C's SIGINT stays
        // SIGINT (KeyboardInterrupt: `except`, `finally` and atexit run);
        // SIGHUP and SIGQUIT go as SIGTERM, which such scripts handle.
        stop(a, kFinalGraceMs, s.signal == SIGINT ? SIGINT : SIGTERM);
        release(a);
        say(std::string("stopped every rank on ") + StopSignals::name(s.signal));
        return 128 + s.signal;
      }
      stop(a);
      if (out.ok || restart >= o_.max_restarts) release(a);
      if (out.ok) return 0;
      if (restart >= o_.max_restarts) {
        say(out.cause + "; no restarts left (--max-restarts " + std::to_string(o_.max_restarts) + ")");
        return out.exit_code == 0 ? 1 : out.exit_code;
      }
      say(out.cause + "; restarting the group (restart " + std::to_string(restart + 1) + "/" +
          std::to_string(o_.max_restarts) + ")");
    }
  }

 private:
  // The shape of the next attempt: the live nodes with room for a node's
  // ranks, at most MAX of them; waits (bounded) for MIN.
  Shape choose_shape(Clock::time_point deadline) {
    bool waiting_said = false;
    const auto started = Clock::now();
    for (;;) {
      auto nodes = rt_.nodes();
      // GPU slots when any node the cluster knows, alive or not, has a
      // node's worth of GPUs, and ever after a GPU attempt: a restart after
      // the GPU node died ran at once on the head's CPUs (the script's
      // torch.cuda.set_device failing, or training on CPU unsaid); it waits
      // for a GPU node instead.
      Shape s{used_gpus_ ? "GPU" : "CPU", 0};
      for (auto& n : nodes)
        if (n.total.count("GPU") && n.total.at("GPU") >= o_.nproc_per_node) s.resource = "GPU";
      for (auto& n : nodes) {
        auto it = n.available.find(s.resource);
        if (n.alive && it != n.available.end() && it->second >= o_.nproc_per_node) ++s.nodes;
      }
      s.nodes = std::min(s.nodes, o_.max_nodes);
      if (s.nodes >= o_.min_nodes) {
        used_gpus_ = used_gpus_ || s.resource == "GPU";
        return s;
      }
      if (!launched_once_ && Clock::now() - started >= kNoNodeGrace) refuse_if_no_node_can_hold(nodes);
      if (Clock::now() >= deadline)
        throw ConfigError("waited " + std::to_string(kRendezvousTimeout.count()) + " s for " +
                          std::to_string(o_.min_nodes) + " node(s) with " + std::to_string(o_.nproc_per_node) +
                          " free " + s.resource + "; " + std::to_string(s.nodes) + " have them");
      if (!waiting_said) say("waiting for " + std::to_string(o_.min_nodes) + " node(s) with room for the group");
      waiting_said = true;
      check_stop();
      std::this_thread::sleep_for(200ms);
    }
  }

  // A node's ranks need nproc_per_node CPUs or GPUs on one node. When no
  // node the cluster has known (alive or not: an agent may come back) has
  // that many of either in all, after kNoNodeGrace, waiting out the
  // rendezvous cannot help (TorchTrainer refuses such a group too).
  void refuse_if_no_node_can_hold(const std::vector<wire::NodeInfo>& nodes) const {
    auto total = [](const wire::NodeInfo& n, const char* r) {
      auto it = n.total.find(r);
      return it == n.total.end() ? 0.0 : it->second;
    };
    std::string have;
    for (auto& n : nodes) {
      if (total(n, "CPU") >= o_.nproc_per_node || total(n, "GPU") >= o_.nproc_per_node) return;
      char entry[96];
      std::snprintf(entry, sizeof(entry), "node %llu: CPU %g, GPU %g", static_cast<unsigned long long>(n.id),
                    total(n, "CPU"), total(n, "GPU"));
      have += (have.empty() ? "" : "; ") + std::string(entry);
    }
    if (have.empty()) return;  // no node yet: one may be joining
    const std::string n = std::to_string(o_.nproc_per_node);
    throw ConfigError("--nproc-per-node " + n + " needs " + n + " CPUs or " + n + " GPUs on one node, and no node " +
                      "of the cluster has that many (" + have + "): give a smaller --nproc-per-node, or start a " +
                      "node agent with more (troupe start --resources)");
  }

  // Whether the next attempt can run in `a`'s slots: warm restarts are on,
  // every slot answered the last stop, and no live node outside the group
  // has room that the group could grow into.
  bool reusable(const Attempt& a) {
    if (o_.cold_restarts || a.slots.empty() || a.slot_lost) return false;
    if (a.shape.nodes >= o_.max_nodes) return true;
    std::set<uint64_t> ours;
    for (const auto& s : a.slots) ours.insert(s.info().node_id);
    for (const auto& n : rt_.nodes()) {
      auto it = n.available.find(a.shape.resource);
      if (n.alive && !ours.count(n.id) && it != n.available.end() && it->second >= o_.nproc_per_node) return false;
    }
    return true;
  }

  // Places one attempt: retries with a fresh count of the nodes when a
  // placement does not complete (a node died before the head noticed).
  void form(Attempt& a, Clock::time_point deadline) {
    for (;;) {
      a.shape = choose_shape(deadline);
      try {
        if (place(a)) return;
      } catch (const ConfigError&) {
        throw;
      } catch (const std::exception& e) {
        if (Clock::now() >= deadline) throw ConfigError(std::string("cannot place the group: ") + e.what());
      }
      release(a);
      if (Clock::now() >= deadline) throw ConfigError("cannot place the group within the rendezvous timeout");
    }
  }

  bool place(Attempt& a) {
    int n = o_.nproc_per_node;
    std::vector<Resources> bundles(static_cast<size_t>(a.shape.nodes), Resources{{a.shape.resource, double(n)}});
    a.pg = rt_.create_placement_group(bundles, PlacementStrategy::kStrictSpread, "torchrun-" + run_id_);
    a.has_pg = true;
    if (!a.pg.wait(kPlaceTimeout)) return false;
    for (int node = 0; node < a.shape.nodes; ++node)
      for (int local = 0; local < n; ++local) {
        ActorOptions ao;
        ao.resources = {{a.shape.resource, 1.0}};
        ao.placement_group = &a.pg;
        ao.bundle_index = node;
        a.slots.push_back(rt_.spawn<TorchrunSlot>(ao));
      }
    for (auto& s : a.slots)
      if (!s.wait_ready(kPlaceTimeout)) return false;
    return true;
  }

  // Every rank's CUDA_VISIBLE_DEVICES on GPU slots: its node's slot GPUs in
  // local-rank order, so cuda:LOCAL_RANK is the rank's own GPU.
  // Each node's GPUs of the job in local-rank order, as the slots' own
  // CUDA_VISIBLE_DEVICES name them (the agent's devices: its GPU k is not
  // the host's GPU k when it was started with a CUDA_VISIBLE_DEVICES).
  std::vector<std::string> gpu_lists(Attempt& a) {
    std::vector<std::string> lists(static_cast<size_t>(a.shape.nodes));
    if (a.shape.resource != "GPU") return lists;
    std::vector<Future<std::string>> named;
    for (auto& s : a.slots) named.push_back(s.call(&TorchrunSlot::devices));
    for (size_t r = 0; r < a.slots.size(); ++r) {
      auto& l = lists[r / static_cast<size_t>(o_.nproc_per_node)];
      const std::string devices = named[r].get();
      if (!devices.empty()) l += (l.empty() ? "" : ",") + devices;
    }
    return lists;
  }

  void launch(Attempt& a, int restart) {
    a.restart = restart;
    launched_once_ = true;
    AttemptEnv env{restart, o_.max_restarts, run_id_, "", 0, omp_, nccl_async_, torch_nccl_async_};
    env.master_addr = wire::strip_brackets(wire::parse_address(a.slots[0].info().address).first);
    env.master_port = a.slots[0].call(&TorchrunSlot::free_port).get();
    auto gpus = gpu_lists(a);
    if (!shipped_.path.empty()) prepare_copies(a);
    std::vector<Future<int64_t>> started;
    for (size_t r = 0; r < a.slots.size(); ++r) {
      RankPlace p{int(r), int(r) % o_.nproc_per_node, int(r) / o_.nproc_per_node, o_.nproc_per_node, a.shape.nodes};
      ScriptLaunch l;
      l.rank = p.rank;
      l.python = o_.python;
      l.module = o_.module;
      l.no_python = o_.no_python;
      l.script = shipped_script_.empty() ? script_path() : shipped_script_;
      l.args = o_.script_args;
      auto vars = torchrun_env(p, env);
      if (a.shape.resource == "GPU") vars.push_back("CUDA_VISIBLE_DEVICES=" + gpus[size_t(p.group_rank)]);
      l.env = rank_environment(driver_env_, std::move(vars));
      l.working_dir = cwd_;
      l.run_id = run_id_;
      l.restart_count = restart;
      // A spare interpreter can only stand in for an interpreter.
      l.warm = !o_.cold_restarts && !o_.no_python;
      l.preload = o_.preload;
      l.spare_delay_ms = spare_delay_ms_;
      l.shipped = shipped_;
      a.readers.push_back(std::make_unique<StreamReader<OutputLine>>(rt_, 64));
      l.output = a.readers.back()->ref();
      StreamReader<OutputLine>* reader = a.readers.back().get();
      const auto& filter = o_.local_ranks_filter;
      const bool shown = filter.empty() || std::find(filter.begin(), filter.end(), p.local_rank) != filter.end();
      a.printers.emplace_back([reader, shown] { print_lines(*reader, shown); });
      started.push_back(a.slots[r].call(&TorchrunSlot::start, std::move(l)));
    }
    for (auto& f : started) f.get(60s);
    for (auto& s : a.slots) a.exits.push_back(s.call(&TorchrunSlot::wait_exit));
  }

  // Waits for the first rank that fails, or for all to exit 0.
  Outcome watch(Attempt& a) {
    // Shared with the callbacks, which may fire after this returns.
    struct Done {
      std::mutex mu;
      std::condition_variable cv;
      std::deque<size_t> ranks;
    };
    auto done = std::make_shared<Done>();
    for (size_t r = 0; r < a.exits.size(); ++r)
      a.exits[r].on_ready([done, r] {
        std::lock_guard lock(done->mu);
        done->ranks.push_back(r);
        done->cv.notify_all();
      });
    Outcome out;
    for (size_t finished = 0; finished < a.exits.size() && out.ok; ++finished) {
      size_t r;
      {
        std::unique_lock lock(done->mu);
        // Looks at the stop request between exits (the signal thread does
        // not know this wait).
        while (!done->cv.wait_for(lock, 100ms, [&] { return !done->ranks.empty(); })) {
          lock.unlock();
          check_stop();
          lock.lock();
        }
        r = done->ranks.front();
        done->ranks.pop_front();
      }
      out = outcome_of(a, r);
    }
    return out;
  }

  void check_stop() const {
    if (stop_ && stop_->requested()) throw Stopped{stop_->signal()};
  }

  Outcome outcome_of(Attempt& a, size_t r) {
    std::string who = "rank " + std::to_string(r);
    try {
      ScriptExit e = a.exits[r].get();
      if (e.started && e.wait_status == 0) return {};
      std::string cause = who + " " + core::describe_exit_status(e.wait_status);
      if (auto m = error_file_message(e.error_file_text); !m.empty()) cause += " (" + m + ")";
      return {false, int(r), e.started ? exit_code_of(e.wait_status) : 1, cause};
    } catch (const std::exception& ex) {
      return {false, int(r), 1, who + " lost its slot: " + core::exception_text(std::current_exception())};
    }
  }

  // Stops every rank (SIGTERM, SIGKILL after the grace) and waits for the
  // scripts to exit; joins the printers. A slot that does not answer, or
  // whose script's end cannot be learnt, marks the group as lost.
  void stop(Attempt& a, uint32_t grace_ms = kStopGraceMs, int signal = SIGTERM) {
    std::vector<Future<int32_t>> stops;
    for (auto& s : a.slots) {
      try {
        stops.push_back(s.control(StopScript{grace_ms, a.restart, signal}));
      } catch (const std::exception&) {
        a.slot_lost = true;
      }
    }
    auto deadline = Clock::now() + std::chrono::milliseconds(grace_ms) + 5s;
    auto left = [&] {
      return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()), 0ms);
    };
    for (auto& f : stops) a.slot_lost |= !settled_ok(f, left());
    if (a.exits.size() != a.slots.size()) a.slot_lost = true;
    for (auto& f : a.exits) a.slot_lost |= !settled_ok(f, left());
    for (auto& reader : a.readers) reader->cancel("the attempt ended");
    for (auto& t : a.printers) t.join();
    a.readers.clear();
    a.printers.clear();
    a.exits.clear();
  }

  // Whether `f` holds a value within `bound` (not an error, not pending).
  template <typename T>
  static bool settled_ok(Future<T>& f, std::chrono::milliseconds bound) {
    if (!f.wait_for(bound)) return false;
    try {
      f.get();
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }

  void release(Attempt& a) {
    for (auto& s : a.slots) {
      try {
        rt_.kill_actor(s.id(), true);
      } catch (const std::exception&) {
      }
    }
    a.slots.clear();
    if (a.has_pg) {
      try {
        rt_.remove_placement_group(a.pg);
      } catch (const std::exception&) {
      }
      a.has_pg = false;
    }
  }

  // --ship-working-dir: the driver's working directory goes to the nodes
  // once per run, and each rank runs in its node's copy, with the script at
  // the same place inside it. Refused before anything runs: a script
  // outside the directory, or one its packing leaves out.
  void ship_working_dir() {
    if (o_.address.empty()) {
      say("--ship-working-dir: the ranks run on this machine (no --address), in " + cwd_ + " itself: nothing to ship");
      return;
    }
    // A module is looked up in the copy; a program without a / on the
    // node's PATH; a --no-python program outside the directory runs at its
    // own path on the node.
    const bool a_file = !o_.module && !(o_.no_python && o_.script.find('/') == std::string::npos);
    const std::string inside = a_file ? path_inside_cwd(o_.script) : "";
    if (a_file && inside.empty() && !o_.no_python)
      throw ConfigError("--ship-working-dir ships the working directory " + cwd_ + ", which does not hold the script " +
                        shown_path(script_path()) + ": run troupe torchrun from a folder that holds it");
    std::vector<std::string> names;
    shipped_ = ship_dir(
        rt_, cwd_,
        {.excludes = o_.ship_excludes, .leave_out = "--ship-exclude PATTERNS (.gitignore and .rayignore count too)"},
        &names);
    if (!inside.empty() && !std::binary_search(names.begin(), names.end(), inside)) {
      shipped_ = {};
      throw ConfigError("--ship-working-dir leaves the script " + inside + " out of what it ships from " + cwd_ +
                        ": a .gitignore or .rayignore pattern, or --ship-exclude, names it");
    }
    if (!inside.empty()) shipped_script_ = cwd_ + "/" + inside;
    char size[32];
    if (shipped_.bytes >= (1u << 20))
      std::snprintf(size, sizeof size, "%.1f MiB", double(shipped_.bytes) / double(1 << 20));
    else
      std::snprintf(size, sizeof size, "%.1f KiB", double(shipped_.bytes) / 1024.0);
    say("shipping " + cwd_ + " (" + std::to_string(shipped_.files) + " files, " + size +
        ") to the nodes; each rank runs in its node's copy, made for this run: what it writes to relative paths "
        "stays on that node");
  }

  // `path` relative to the working directory when it lies inside it (its
  // folder's links resolved, as the working directory's are: a symlinked
  // /home names the same place), else "".
  std::string path_inside_cwd(const std::string& path) const {
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::path p = fs::absolute(path, ec);
    if (ec) return "";
    const fs::path folder = fs::weakly_canonical(p.parent_path(), ec);
    if (ec) return "";
    const fs::path rel = (folder / p.filename()).lexically_relative(fs::path(cwd_));
    if (rel.empty() || *rel.begin() == "..") return "";
    return rel.generic_string();
  }

  // Each node's copy of the shipped directory, made before the starts
  // (which are waited for 60 s): the node's first slot fetches it, the
  // others wait for its copy. A stop is looked at meanwhile.
  void prepare_copies(Attempt& a) {
    std::vector<Future<std::string>> made;
    for (auto& s : a.slots) made.push_back(s.call(&TorchrunSlot::prepare, shipped_));
    for (auto& f : made) {
      while (!f.wait_for(100ms)) check_stop();
      f.get();
    }
  }

  // The script as the nodes should find it: absolute when it is a file
  // here, so it runs from any working directory.
  // `path` as a message names it: without "." and ".." (which a path
  // given as ../x/train.py keeps), its links resolved.
  static std::string shown_path(const std::string& path) {
    std::error_code ec;
    const auto real = std::filesystem::weakly_canonical(path, ec);
    return ec ? path : real.string();
  }

  std::string script_path() const {
    // A module's name, or a program looked up on the node's PATH.
    if (o_.module || (o_.no_python && o_.script.find('/') == std::string::npos)) return o_.script;
    std::error_code ec;
    auto p = std::filesystem::absolute(o_.script, ec);
    return ec ? o_.script : p.string();
  }

  Runtime& rt_;
  TorchrunOptions o_;
  bool used_gpus_ = false;  // an attempt ran on GPU slots: every later one does
  std::string run_id_;
  std::string cwd_;
  ShippedDir shipped_;          // --ship-working-dir
  std::string shipped_script_;  // the script's path inside it, "" = none
  std::string omp_;
  std::vector<std::string> driver_env_;  // this process's environment (rank_environment)
  std::string nccl_async_ = "1";
  std::string torch_nccl_async_ = "1";
  bool launched_once_ = false;  // an attempt started: later ones wait for room, whatever the nodes
  uint32_t spare_delay_ms_ = spare_delay_from_env();
  const StopSignals* stop_ = nullptr;
};

}  // namespace

int run_torchrun(Runtime& rt, const TorchrunOptions& options, const StopSignals* stop) {
  return TorchrunJob(rt, options, stop).run();
}

Resources torchrun_local_resources(const TorchrunOptions& options) {
  // The CPUs this process may use, as --nproc-per-node cpu counts them and
  // every other embedded node offers (it offered the machine's).
  const double cores = core::cpu_limit();
  return {{"CPU", std::max(cores, double(options.nproc_per_node))}};
}

}  // namespace troupe::launcher
