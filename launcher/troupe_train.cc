// troupe-train: `troupe train`, the driver and the worker in one binary.
// The `troupe` CLI stays free of LibTorch and execs this program, installed
// next to it, with the arguments after `train`. As the driver it reads the
// flags (or a job file), checks the files and runs the step once on the
// first samples (train_preflight.h), starts an embedded cluster (or connects
// to --address), runs a TrainJob with progress on the console and exits 0,
// or non-zero with one line `troupe train: <reason>`: 2 for bad input, 1 for
// a run that failed. The trainers it spawns run this same executable.
//
// SIGINT or SIGTERM (Ctrl-C, a batch system's time limit) stops the job at
// the next step boundary (within --log-every steps or about 5 s,
// TrainJobConfig::stop_within) with a checkpoint of the
// step reached, and exits 128 + the signal; the same command with --resume
// goes on from there. A second signal ends the driver at once.
//
//   troupe train --model step.pt --data train.npz --workers 2 --epochs 3
//                --batch-size 64 --optimizer adamw --lr 1e-3 --checkpoint-dir ckpt
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "stop_signals.h"
#include "train_options.h"
#include "train_preflight.h"
#include "troupe/actors/distributed_sampler.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/core/exception_text.h"
#include "troupe/trainer/checkpoint.h"
#include "troupe/trainer/train_job.h"

namespace {

using troupe::launcher::TrainOptions;

// The C++ TrainJob names its settings as TrainJobConfig's fields; here
// they are flags ("failure.max_failures is 2": "--max-failures 2").
std::string in_flag_terms(std::string text) {
  static const std::pair<std::string, std::string> kFields[] = {
      {"failure.max_failures is ", "--max-failures "},
      {"scaling.min_workers is ", "--min-workers "},
      {"(scaling.min_workers, else num_workers)", "(--min-workers, else --workers)"},
      {"failure.replacement_timeout", "--replacement-timeout"},
      {"a lower trainer.optimizer.lr or a trainer.grad_clip", "a lower --lr or --grad-clip"}};
  for (const auto& [field, flag] : kFields)
    for (size_t at = text.find(field); at != std::string::npos; at = text.find(field, at + flag.size()))
      text.replace(at, field.size(), flag);
  return text;
}

int fail(int code, const std::string& reason) {
  std::fflush(stdout);
  std::string line = troupe::core::first_line(reason);
  // A job's errors start with its name ("[train] training failed ..."),
  // which tells jobs of one driver apart: here there is one.
  if (line.size() > 2 && line[0] == '[') {
    const size_t end = line.find("] ");
    if (end != std::string::npos && line.find(' ') > end) line.erase(0, end + 2);
  }
  std::fprintf(stderr, "troupe train: %s\n", in_flag_terms(line).c_str());
  return code;
}

// An embedded cluster, or the one at --address with the token the C++
// client finds (TROUPE_TOKEN, else the session directory's).
troupe::Runtime connect(const TrainOptions& o) {
  std::vector<std::string> args = {"troupe-train"};
  if (!o.address.empty()) args.insert(args.end(), {"--address", o.address});
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return troupe::init(static_cast<int>(argv.size()), argv.data());
}

// A loss as the epoch lines show it (4 decimals), or in 3 significant
// digits when that would show a loss that is not 0 as 0.0000.
std::string loss_text(double v) {
  char out[32];
  std::snprintf(out, sizeof out, v != 0 && std::fabs(v) < 5e-5 ? "%.3g" : "%.4f", v);
  return out;
}

// A loss only when steps were taken: an epoch of no steps reports 0, which
// is no loss at all. It is the last epoch's mean over its samples (a step
// line's loss is that step's).
void print_summary(const troupe::trainer::Result& r, int64_t max_steps) {
  std::printf("troupe train: done, %lld steps", static_cast<long long>(r.steps));
  if (max_steps > 0 && r.steps >= max_steps) std::printf(" (--max-steps)");
  if (r.steps > 0 && !r.history.empty()) {
    const auto& last = r.history.back();
    std::printf(", last epoch's mean loss %s", loss_text(last.train_loss).c_str());
    if (last.val_count > 0) std::printf(", val_loss %s", loss_text(last.val_loss).c_str());
  }
  std::printf(", %zu failure(s) healed\n", r.recoveries.size());
  if (r.last_checkpoint)
    std::printf("troupe train: final checkpoint %s (model.pt loads with torch.load)\n",
                r.last_checkpoint->path.c_str());
  std::fflush(stdout);
}

int run(const TrainOptions& o, troupe::trainer::TrainJobConfig cfg, const troupe::launcher::StopSignals& stop) {
  troupe::Runtime rt = connect(o);
  const bool resumed = !cfg.resume_from.empty();
  cfg.stop_requested = [&stop] { return stop.requested(); };
  troupe::trainer::Result r = troupe::trainer::TrainJob(rt, std::move(cfg)).fit();
  if (!r.interrupted) {
    print_summary(r, o.max_steps);
    return 0;
  }
  // "at step 12", or "while waiting for the trainers' setup, at step 0,
  // epoch 1 of 3" when the stop came while the job started or healed: the
  // job's interrupted event says so, and whether the state could be saved.
  std::string where = "at step " + std::to_string(r.steps);
  for (const auto& e : r.events) {
    if (e.kind != troupe::trainer::JobEventKind::kInterrupted || e.detail.rfind("while waiting", 0) != 0) continue;
    const size_t clause = e.detail.find("; ");
    where = e.detail.substr(0, clause);
    if (clause != std::string::npos && e.detail.find("could not be saved", clause) != std::string::npos)
      std::printf("troupe train: %s\n", e.detail.substr(clause + 2).c_str());
  }
  std::printf("troupe train: interrupted %s", where.c_str());
  if (r.last_checkpoint)
    std::printf(", checkpoint %s; the same command with --resume goes on from it\n", r.last_checkpoint->path.c_str());
  else if (resumed)
    std::printf(" (no checkpoint written since the one it resumed from: the same command goes on from that)\n");
  else
    std::printf(" (no checkpoint written)\n");
  std::fflush(stdout);
  return 128 + stop.signal();
}

// The epochs a checkpoint has finished. Its cursor stands in the epoch of
// its last step (0-based, as the manifest's `epoch`), at the end of it
// when that step finished the epoch, as the data order's sampler tells.
int64_t epochs_done(const troupe::trainer::CheckpointInfo& c) {
  const auto size = c.data_order.find("dataset_size");
  if (size == c.data_order.end()) return c.cursor.epoch;
  troupe::actors::SamplerOptions o;
  o.dataset_size = size->second;
  o.world_size = c.cursor.world_size;
  try {
    return c.cursor.epoch + (troupe::actors::DistributedSampler(o).epoch_done(c.cursor) ? 1 : 0);
  } catch (const std::exception&) {
    return c.cursor.epoch;  // a cursor that does not fit its data order: the resume names it
  }
}

// `dir` absolute, without "." or ".." or a trailing /.
std::filesystem::path normal(const std::string& dir) {
  std::error_code ec;
  auto p = std::filesystem::absolute(dir, ec).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return p;
}

// The highest folder of `dir` that does not exist (what making it makes
// first); empty when `dir` exists.
std::filesystem::path first_missing(const std::string& dir) {
  std::error_code ec;
  std::filesystem::path top;
  for (auto p = normal(dir); !std::filesystem::exists(p, ec) && p != p.parent_path(); p = p.parent_path()) top = p;
  return top;
}

}  // namespace

int main(int argc, char** argv) {
  troupe::run_role_if_requested(argc, argv);
  // The console is the job's progress: the runtime's own info and warning
  // lines (actors placed, stopped at the end) only when asked for. The
  // cluster's processes inherit this.
  setenv("TROUPE_LOG_LEVEL", "error", /*overwrite=*/0);
  // Progress lines reach a log file (a batch job's output) as they are
  // printed, not when a buffer fills or the job ends.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  troupe::launcher::StopSignals stop(
      "troupe train", "stopping at the next step boundary with a checkpoint (at once, before the first step)");
  TrainOptions o;
  troupe::trainer::TrainJobConfig cfg;
  std::filesystem::path made_dir;  // the highest folder of --checkpoint-dir this run makes
  // A run that ends before its first checkpoint (refused, by the cluster
  // or when the folder is made, or interrupted while it started) leaves
  // no empty folder of its own behind.
  auto tidy = [&] {
    if (made_dir.empty()) return;
    std::error_code ec;
    for (auto dir = normal(o.checkpoint_dir); std::filesystem::is_empty(dir, ec); dir = dir.parent_path()) {
      std::filesystem::remove(dir, ec);
      if (ec || dir == made_dir || dir == dir.parent_path()) break;
    }
  };
  try {
    if (!troupe::launcher::parse_train_args(argc, argv, o)) return 0;
    troupe::launcher::check(o);
    std::vector<std::string> notes;
    cfg = troupe::launcher::to_job_config(o, &notes);
    for (const auto& n : notes) std::printf("troupe train: %s\n", n.c_str());
    troupe::launcher::preflight(cfg.trainer);
    // Last: a run refused above leaves no empty directory behind.
    made_dir = first_missing(o.checkpoint_dir);
    troupe::launcher::make_checkpoint_dir(o);
  } catch (const std::exception& e) {
    tidy();
    return fail(2, e.what());
  }
  if (!cfg.resume_from.empty()) {
    std::printf("troupe train: resuming from %s\n", cfg.resume_from.c_str());
    // A checkpoint with the epochs asked for done trains nothing: said so.
    // The job still runs (and ends at once), so that its metrics file and
    // result hold the resume and the end, as a Python TrainJob reads them.
    if (auto latest = troupe::trainer::latest_checkpoint(o.checkpoint_dir); latest) {
      const int64_t done = epochs_done(*latest);
      if (o.max_steps > 0 && latest->step >= o.max_steps) {
        std::printf(
            "troupe train: the checkpoint is at step %lld, and --max-steps is %lld: nothing to train (raise "
            "--max-steps to go on)\n",
            static_cast<long long>(latest->step), static_cast<long long>(o.max_steps));
      } else if (done >= o.epochs) {
        std::printf(
            "troupe train: the checkpoint at step %lld has %lld epoch(s) done, and --epochs is %lld: nothing to "
            "train (raise --epochs to go on)\n",
            static_cast<long long>(latest->step), static_cast<long long>(done), static_cast<long long>(o.epochs));
      }
    }
  } else if (o.resume)
    std::printf("troupe train: --resume: no checkpoint in %s yet, starting at step 0\n", o.checkpoint_dir.c_str());
  if (stop.requested()) {
    // Taken while the files were checked (troupe-train starts with the
    // signals blocked: troupe and Python's TrainJob start it so).
    tidy();
    std::printf("troupe train: interrupted before the job started (no checkpoint written)\n");
    return 128 + stop.signal();
  }
  try {
    const int code = run(o, std::move(cfg), stop);
    tidy();
    return code;
  } catch (const troupe::ConfigError& e) {
    tidy();
    return fail(2, e.what());
  } catch (const std::exception& e) {
    tidy();
    return fail(1, e.what());
  }
}
