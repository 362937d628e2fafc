// What `troupe train` is asked to do: the command line and the JSON (or
// YAML) job file it may name, read into one TrainOptions, checked, and made
// into the TrainJobConfig the driver runs. A job file holds the same fields
// as the flags, spelt with underscores ({"model": "step.pt", "batch_size":
// 64, ...}); a flag given on the command line overrides the file. A
// relative path in a job file (model, data, val_data, checkpoint_dir,
// metrics) is relative to the job file's directory; one on the command line
// to the working directory.
//
// Every problem is a troupe::ConfigError whose message is one line naming
// the flag, key, file or value at fault.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "troupe/trainer/train_job.h"

namespace troupe::launcher {

struct TrainOptions {
  // A TorchScript file (forward(Dict[str, Tensor]) -> Dict[str, Tensor]
  // returning `loss`), or the name of a built-in or registered model whose
  // sizes come from model_options (hidden, num_classes, input_dim, channels,
  // image_size).
  std::string model;
  std::map<std::string, int64_t> model_options;
  // .npz (each array a batch key), or a token stream for a language model
  // (.bin of raw token ids, or a 1-d integer .npy) cut into windows of
  // block_size: {"input": x[s:s+B], "target": x[s+1:s+B+1]}.
  std::string data;
  std::string val_data;                // the same kinds, "" = no evaluation
  int64_t block_size = 0;              // > 0: --data is a token stream; 0: .npz
  std::string token_dtype = "uint16";  // of a raw .bin token stream
  int64_t workers = 1;
  // Elastic range (0: --workers): the job starts with as many as can be
  // placed (at least min_workers), shrinks to no fewer after failures, and
  // grows back up to max_workers when room appears.
  int64_t min_workers = 0;
  int64_t max_workers = 0;
  int64_t epochs = 1;
  // Stop after this many optimizer steps in all, counted from the job's
  // first step (a resume goes on to it), or at the end of the epochs,
  // whichever comes first (0: the epochs alone). A stop mid-epoch writes a
  // checkpoint of the step reached.
  int64_t max_steps = 0;
  int64_t batch_size = 32;
  // Batches of batch_size each worker adds up before the optimizer steps
  // (gradient accumulation): a step is workers × batch_size × accumulation
  // samples, with the memory of one batch.
  int64_t accumulation = 1;
  std::string optimizer = "adamw";
  double lr = 1e-3;
  double weight_decay = 0.0;
  // SGD's momentum (troupe's SGD default; torch.optim.SGD's is 0).
  double momentum = 0.9;
  int64_t warmup_steps = 0;
  // "constant", or "cosine": decays to min_lr_factor · lr at the last step
  // (epochs × steps per epoch, from the data's size).
  std::string schedule = "constant";
  double min_lr_factor = 0.0;
  // How gradient buckets travel between workers: none, bf16 or fp16.
  std::string compression = "none";
  double grad_clip = 0.0;  // 0 = off
  // Trainer failures healed before the job gives up (-1: no limit), as
  // train_digits's default.
  int64_t max_failures = 3;
  std::string checkpoint_dir;
  // Optimizer steps between checkpoints inside an epoch (0: at the end of
  // each epoch only; an epoch's end always writes one).
  int64_t checkpoint_every = 0;
  // The newest checkpoints kept in checkpoint_dir; older ones are removed
  // as new ones are written (0: keep all).
  int64_t keep_checkpoints = 3;
  // Go on from the latest checkpoint in checkpoint_dir (from step 0 when it
  // holds none). Without it a checkpoint_dir that holds checkpoints is
  // refused: a second run writing there would mix its steps with the first
  // run's, and pruning could keep the wrong ones.
  bool resume = false;
  std::string metrics;  // JSON lines, "" = none
  std::string address;  // "" = an embedded cluster of this machine
  // Send the model and data files from this driver to the trainers'
  // hosts (TrainJobConfig::ship_files) rather than have them read at the
  // same paths there.
  bool ship_files = false;
  int64_t seed = 0;
  bool sync_batchnorm = false;
  double cpus_per_worker = 1.0;
  // GPUs each trainer reserves: 0 (train on the CPU), a part of one GPU
  // (trainers then share GPUs and reduce through host memory), or a whole
  // number. A trainer that holds a GPU trains on it.
  double gpus_per_worker = 0.0;
  // Mixed precision on the GPU: none, bf16 (autocast) or fp16 (autocast and
  // dynamic loss scaling).
  std::string amp = "none";
  std::string cpu_gemm = "auto";  // TrainerConfig::cpu_gemm
  // Pipeline threads of each trainer's data loader (decode and collate).
  int64_t loader_threads = 1;
  // Seconds a trainer may take to answer a call (a round of log_every
  // steps, a checkpoint): one that does not (hung, stopped) counts as
  // failed, is killed and the job heals.
  double step_timeout_s = 600;
  // Seconds a failed trainer's replacement may wait for resources before
  // the job shrinks (or fails below --min-workers): FailureConfig's
  // replacement_timeout. Longer than a node agent's stall that fences it,
  // so its node can rejoin and take the replacement.
  double replacement_timeout_s = 10;
  // Optimizer steps between progress updates (the driver's train() rounds).
  int64_t log_every = 10;
  std::string name = "train";
  std::string config;  // the job file read, for messages
  // The keys whose value the job file gave (and no flag overrode): their
  // problems name the key and the job file, not the flag.
  std::set<std::string> from_job_file;
};

// Reads a job file (.json, or .yaml/.yml) into `o`. Unknown keys and values
// of the wrong type (1.5 or true for an integer key) are errors naming the
// key and the file.
void read_job_file(const std::string& path, TrainOptions& o);

// The command line, after `troupe train` (argv[0] is the program). Returns
// false when it printed --help (nothing more to do).
bool parse_train_args(int argc, char** argv, TrainOptions& o);

// Bad values (a floating one must be finite) and files that are not there
// or are directories, naming them; reads nothing large and writes nothing.
void check(const TrainOptions& o);

// Creates --checkpoint-dir (ConfigError naming it and the reason): called
// once every check has passed, so a refused run leaves no directory.
void make_checkpoint_dir(const TrainOptions& o);

// The job: a token-stream or .npz data set, and for a cosine schedule its
// total steps, counted from the training data's size (opened here; nothing
// is read but its header). Data too small for one step of --workers ×
// --batch-size, or an empty --val-data, is refused; so is a --checkpoint-dir
// holding a checkpoint without --resume (with it, resume_from is set to
// the latest one).
// `notes`, when given, gets what to tell the user: damaged checkpoints a
// --resume passed over. A --resume whose directory holds checkpoints none
// of which can be read is a ConfigError naming each and why.
trainer::TrainJobConfig to_job_config(const TrainOptions& o, std::vector<std::string>* notes = nullptr);

}  // namespace troupe::launcher
