#include "train_options.h"

#include <fcntl.h>
#include <unistd.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <random>
#include <sstream>
#include <type_traits>

#include "cli_message.h"
#include "troupe/actors/dataset.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/worker_env.h"
#include "troupe/trainer/checkpoint.h"
#include "troupe/trainer/model.h"
#include "yaml_to_json.h"

namespace fs = std::filesystem;

namespace troupe::launcher {
namespace {

using Json = nlohmann::json;

// One job-file key: how to store its value into TrainOptions.
using Setter = std::function<void(const Json&, TrainOptions&)>;

// A job-file value of the wrong kind: what the key takes, and the value
// when it is not the key's whole value (a model_options entry).
struct WrongValue {
  std::string expected;
  std::string where;  // "" or ".hidden"
  std::string got;
};

// nlohmann's get<int64_t> truncates 1.5 to 1 and takes true as 1: an
// integer key takes an integer (2.0 too), nothing else.
int64_t json_int(const Json& v) {
  constexpr double kLimit = 9223372036854775808.0;  // 2^63
  if (v.is_number_unsigned() && v.get<uint64_t>() <= uint64_t{INT64_MAX}) return v.get<int64_t>();
  if (v.is_number_integer() && !v.is_number_unsigned()) return v.get<int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::trunc(d) == d && d >= -kLimit && d < kLimit) return static_cast<int64_t>(d);
  }
  throw WrongValue{"an integer", "", ""};
}

template <class T>
T json_value(const Json& v) {
  if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, std::string>) {
    return v.get<T>();
  } else if constexpr (std::is_integral_v<T>) {
    return json_int(v);
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!v.is_number()) throw WrongValue{"a number", "", ""};
    return v.get<T>();
  } else {  // model_options: {"hidden": 64, ...}
    if (!v.is_object()) throw WrongValue{"an object of integers", "", ""};
    T out;
    for (const auto& [k, x] : v.items()) {
      try {
        out[k] = json_int(x);
      } catch (const WrongValue&) {
        throw WrongValue{"an integer", "." + k, x.dump()};
      }
    }
    return out;
  }
}

template <class T>
Setter field(T TrainOptions::*member) {
  return [member](const Json& v, TrainOptions& o) { o.*member = json_value<T>(v); };
}

const std::map<std::string, Setter>& job_keys() {
  static const std::map<std::string, Setter> keys = {
      {"model", field(&TrainOptions::model)},
      {"model_options", field(&TrainOptions::model_options)},
      {"data", field(&TrainOptions::data)},
      {"val_data", field(&TrainOptions::val_data)},
      {"block_size", field(&TrainOptions::block_size)},
      {"token_dtype", field(&TrainOptions::token_dtype)},
      {"schedule", field(&TrainOptions::schedule)},
      {"min_lr_factor", field(&TrainOptions::min_lr_factor)},
      {"compression", field(&TrainOptions::compression)},
      {"workers", field(&TrainOptions::workers)},
      {"min_workers", field(&TrainOptions::min_workers)},
      {"max_workers", field(&TrainOptions::max_workers)},
      {"epochs", field(&TrainOptions::epochs)},
      {"max_steps", field(&TrainOptions::max_steps)},
      {"batch_size", field(&TrainOptions::batch_size)},
      {"accumulation", field(&TrainOptions::accumulation)},
      {"optimizer", field(&TrainOptions::optimizer)},
      {"lr", field(&TrainOptions::lr)},
      {"weight_decay", field(&TrainOptions::weight_decay)},
      {"momentum", field(&TrainOptions::momentum)},
      {"warmup_steps", field(&TrainOptions::warmup_steps)},
      {"grad_clip", field(&TrainOptions::grad_clip)},
      {"max_failures", field(&TrainOptions::max_failures)},
      {"checkpoint_dir", field(&TrainOptions::checkpoint_dir)},
      {"checkpoint_every", field(&TrainOptions::checkpoint_every)},
      {"keep_checkpoints", field(&TrainOptions::keep_checkpoints)},
      {"resume", field(&TrainOptions::resume)},
      {"metrics", field(&TrainOptions::metrics)},
      {"address", field(&TrainOptions::address)},
      {"ship_files", field(&TrainOptions::ship_files)},
      {"seed", field(&TrainOptions::seed)},
      {"sync_batchnorm", field(&TrainOptions::sync_batchnorm)},
      {"cpus_per_worker", field(&TrainOptions::cpus_per_worker)},
      {"gpus_per_worker", field(&TrainOptions::gpus_per_worker)},
      {"amp", field(&TrainOptions::amp)},
      {"cpu_gemm", field(&TrainOptions::cpu_gemm)},
      {"log_every", field(&TrainOptions::log_every)},
      {"loader_threads", field(&TrainOptions::loader_threads)},
      {"step_timeout", field(&TrainOptions::step_timeout_s)},
      {"replacement_timeout", field(&TrainOptions::replacement_timeout_s)},
      {"name", field(&TrainOptions::name)},
  };
  return keys;
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// nlohmann's "[json.exception.out_of_range.406] number overflow ...",
// without the bracket.
std::string json_problem(const Json::exception& e) {
  std::string what = e.what();
  const auto close = what.find("] ");
  return what.rfind("[json.exception.", 0) == 0 && close != std::string::npos ? what.substr(close + 2) : what;
}

// The job-file keys that hold a path: a relative one is relative to the
// job file's directory. (`model` only when it names a file, not a built-in
// model.)
const char* const kPathKeys[] = {"model", "data", "val_data", "checkpoint_dir", "metrics"};

// The flag that sets job-file key `key` (val_data: --val-data).
std::string flag_of(const std::string& key) {
  if (key == "model_options") return "--model-option";
  std::string f = key;
  for (auto& c : f)
    if (c == '_') c = '-';
  return "--" + f;
}

// Where `key` came from, for a message: its flag ("--workers"), or the
// job file and the key when the job file set it.
std::string source_of(const TrainOptions& o, const std::string& key) {
  if (o.from_job_file.count(key)) return "job file " + o.config + ": key '" + key + "'";
  return flag_of(key);
}

// What the user gave `key` as, for a message: the flag and its value
// ("--data train.npz"), or the job file, the key and the path it holds
// (relative ones resolved) when the value came from a job file.
std::string named(const TrainOptions& o, const std::string& key, const std::string& value) {
  return source_of(o, key) + (o.from_job_file.count(key) ? ": " : " ") + value;
}

Json parse_job_file(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw ConfigError("job file " + path + " is a directory");
  std::ifstream in(path);
  if (!in) throw ConfigError("cannot read job file " + path + ": " + std::strerror(errno));
  std::stringstream text;
  text << in.rdbuf();
  if (ends_with(path, ".yaml") || ends_with(path, ".yml")) return yaml_to_json(text.str(), path);
  try {
    return Json::parse(text.str());
  } catch (const Json::parse_error& e) {
    throw ConfigError("job file " + path + " is not JSON: " + e.what());
  } catch (const Json::exception& e) {  // a number too large for a double
    throw ConfigError("job file " + path + ": " + json_problem(e));
  }
}

// The value after --config, if any: the job file is read before the flags
// so that flags override it.
std::string config_arg(int argc, char** argv) {
  std::string path;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--config" && i + 1 < argc) path = argv[i + 1];
    if (a.rfind("--config=", 0) == 0) path = a.substr(9);
  }
  return path;
}

int64_t parse_int(const std::string& what, const std::string& text) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size()) throw ConfigError(what + ": '" + text + "' is not an integer");
  return v;
}

void add_flags(CLI::App& app, TrainOptions& o) {
  // A flag given twice: the last one counts (as a flag overrides the job file).
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--config", o.config, "a JSON (or YAML) job file with the same fields; flags override it");
  app.add_option("--model", o.model,
                 "TorchScript step module (forward(Dict[str, Tensor]) -> Dict[str, Tensor] with a 'loss'), or a "
                 "built-in model name (mlp, cnn)");
  app.add_option_function<std::vector<std::string>>(
         "--model-option",
         [&o](const std::vector<std::string>& pairs) {
           for (const auto& kv : pairs) {
             auto eq = kv.find('=');
             if (eq == std::string::npos) throw ConfigError("--model-option " + kv + ": expected KEY=VALUE");
             o.model_options[kv.substr(0, eq)] = parse_int("--model-option " + kv, kv.substr(eq + 1));
           }
         },
         "a built-in model's size, e.g. hidden=64 (repeatable)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--data", o.data,
                 ".npz of the training data (each array a batch key, first dimension the sample), or with "
                 "--block-size a token stream (.bin of raw token ids, or a 1-d integer .npy)");
  app.add_option("--val-data", o.val_data, "scored after each epoch (same kind as --data)");
  app.add_option("--block-size", o.block_size,
                 "language model: --data is a token stream cut into windows of this many tokens, batch keys "
                 "input and target (the next tokens); 0: --data is .npz")
      ->capture_default_str();
  app.add_option("--token-dtype", o.token_dtype, "token id type of a raw .bin stream: uint16, uint32, int32, int64")
      ->capture_default_str();
  app.add_option("--workers", o.workers, "data-parallel trainers")->capture_default_str();
  app.add_option("--min-workers", o.min_workers,
                 "elastic: start with as many as fit, at least this many, and shrink to it after failures "
                 "(default: --workers)");
  app.add_option("--max-workers", o.max_workers,
                 "elastic: grow back up to this many when nodes have room (default: --workers)");
  app.add_option("--epochs", o.epochs, "passes over --data")->capture_default_str();
  app.add_option("--max-steps", o.max_steps,
                 "stop after N optimizer steps in all (a resume goes on to N), or after --epochs, whichever "
                 "comes first; a stop mid-epoch writes a checkpoint; --schedule cosine ends at N (0: --epochs "
                 "alone)")
      ->capture_default_str();
  app.add_option("--batch-size", o.batch_size, "samples per worker per step (per micro-step with --accumulation)")
      ->capture_default_str();
  app.add_option("--accumulation", o.accumulation,
                 "batches each worker adds up before one optimizer step (gradient accumulation)")
      ->capture_default_str();
  app.add_option("--optimizer", o.optimizer, "sgd or adamw")->capture_default_str();
  app.add_option("--lr", o.lr, "learning rate")->capture_default_str();
  app.add_option("--weight-decay", o.weight_decay, "L2 (sgd) or decoupled (adamw) weight decay")->capture_default_str();
  app.add_option("--momentum", o.momentum, "sgd's momentum (0 is torch.optim.SGD's default)")->capture_default_str();
  app.add_option("--warmup-steps", o.warmup_steps, "linear learning-rate warmup over the first N steps")
      ->capture_default_str();
  app.add_option("--schedule", o.schedule, "learning rate after warmup: constant, or cosine down to the last step")
      ->capture_default_str();
  app.add_option("--min-lr-factor", o.min_lr_factor, "cosine: the last step's lr as a fraction of --lr")
      ->capture_default_str();
  app.add_option("--compression", o.compression, "gradient buckets between workers: none, bf16 or fp16")
      ->capture_default_str();
  app.add_option("--grad-clip", o.grad_clip, "clip the global gradient norm to X (0 = off)")->capture_default_str();
  app.add_option("--max-failures", o.max_failures,
                 "recoveries before giving up: trainers lost in one round count once (-1 = no limit)")
      ->capture_default_str();
  app.add_option("--checkpoint-dir", o.checkpoint_dir,
                 "where checkpoints go (needed, here or in the job file; model.pt loads with torch.load)");
  app.add_option("--checkpoint-every", o.checkpoint_every,
                 "also checkpoint every N optimizer steps inside an epoch (0 = at each epoch's end only): a failure "
                 "healed from a checkpoint, or a --resume, loses at most N steps")
      ->capture_default_str();
  app.add_option("--keep-checkpoints", o.keep_checkpoints,
                 "the newest checkpoints kept in --checkpoint-dir; older ones are removed as new ones are written "
                 "(0 = keep all)")
      ->capture_default_str();
  app.add_flag("--resume", o.resume,
               "go on from the latest checkpoint in --checkpoint-dir (from step 0 when there is none); without it a "
               "--checkpoint-dir that holds checkpoints is refused");
  app.add_option("--metrics", o.metrics, "JSON lines: one per step, epoch and event");
  app.add_option("--address", o.address, "HOST:PORT of a running cluster (default: an embedded one)");
  app.add_flag("--ship-files", o.ship_files,
               "send --model and the data files from here to the trainers' hosts, each fetched once per host, "
               "for hosts that do not share this one's files (default: trainers read them at these paths)");
  app.add_option("--seed", o.seed, "seeds the sampler's shuffle")->capture_default_str();
  app.add_option("--cpu-gemm", o.cpu_gemm,
                 "fp32 products of the model's linear layers on the CPU: auto (oneDNN where found), "
                 "onednn, or aten (torch's own BLAS)")
      ->capture_default_str();
  app.add_flag("--sync-batchnorm", o.sync_batchnorm,
               "BatchNorm statistics over the whole batch of all workers (C++ models: cnn)");
  app.add_option("--cpus-per-worker", o.cpus_per_worker, "CPU each trainer reserves")->capture_default_str();
  app.add_option("--gpus-per-worker", o.gpus_per_worker,
                 "GPUs each trainer reserves and trains on: 0 (CPU), a part of one (0.5: two trainers share a GPU), "
                 "or a whole number")
      ->capture_default_str();
  app.add_option("--amp", o.amp,
                 "mixed precision: none, bf16 (GPU, or CPU: pays on CPUs with AVX512-BF16 or AMX), or fp16 (GPU "
                 "only, with dynamic loss scaling)")
      ->capture_default_str();
  app.add_option("--loader-threads", o.loader_threads,
                 "pipeline threads of each trainer's data loader (decode and collate; a custom collate runs there)")
      ->capture_default_str();
  app.add_option("--step-timeout", o.step_timeout_s,
                 "seconds a trainer may take to answer (a round of --log-every steps, a checkpoint); one that does "
                 "not (hung, stopped) is killed and healed as a failure")
      ->capture_default_str();
  app.add_option("--replacement-timeout", o.replacement_timeout_s,
                 "seconds a failed trainer's replacement may wait for room (a node that stalled rejoins, a "
                 "placement frees up) before the job shrinks, or fails below --min-workers")
      ->capture_default_str();
  app.add_option("--log-every", o.log_every, "optimizer steps between progress updates")->capture_default_str();
  app.add_option("--name", o.name, "job name on the console and in the metrics file")->capture_default_str();
}

// A double as the user would write it (1, 0.001, 1e-08).
std::string num(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

void require(bool ok, const std::string& what) {
  if (!ok) throw ConfigError(what);
}

void check_file(const TrainOptions& o, const std::string& key, const std::string& path) {
  std::error_code ec;
  const std::string what = named(o, key, path);
  if (fs::is_directory(path, ec)) throw ConfigError(what + " is a directory, not a file");
  if (!fs::is_regular_file(path, ec)) throw ConfigError(what + ": no such file");
  std::ifstream in(path);
  if (!in) throw ConfigError(what + ": cannot read it: " + std::strerror(errno));
}

// A floating option: finite (CLI11 and YAML read "inf" and "nan", and
// 1e400 as inf) and `in_range`, which `must` states.
void require_number(const std::string& what, double v, bool in_range, const std::string& must) {
  require(std::isfinite(v) && in_range, what + " must be " + must + ", got " + num(v));
}

// Every floating option, each checked here and only here.
void check_numbers(const TrainOptions& o) {
  require_number(source_of(o, "lr"), o.lr, o.lr > 0, "a positive finite number");
  require_number(source_of(o, "weight_decay"), o.weight_decay, o.weight_decay >= 0, "a finite number >= 0");
  require_number(source_of(o, "momentum"), o.momentum, o.momentum >= 0 && o.momentum < 1, "a number in [0, 1)");
  require_number(source_of(o, "min_lr_factor"), o.min_lr_factor, o.min_lr_factor >= 0 && o.min_lr_factor <= 1,
                 "between 0 and 1");
  require_number(source_of(o, "grad_clip"), o.grad_clip, o.grad_clip >= 0, "a finite number >= 0 (0 = off)");
  require_number(source_of(o, "cpus_per_worker"), o.cpus_per_worker, o.cpus_per_worker > 0, "a positive finite number");
  require_number(source_of(o, "step_timeout"), o.step_timeout_s,
                 o.step_timeout_s >= 1 && o.step_timeout_s <= 7 * 24 * 3600, "a number of seconds from 1 to 604800");
  require_number(source_of(o, "replacement_timeout"), o.replacement_timeout_s,
                 o.replacement_timeout_s >= 0.1 && o.replacement_timeout_s <= 7 * 24 * 3600,
                 "a number of seconds from 0.1 to 604800");
  const double g = o.gpus_per_worker;
  require_number(source_of(o, "gpus_per_worker"), g,
                 g == 0 || (g >= 0.01 && g <= 1024 && (g <= 1 || g == std::floor(g))),
                 "0, a part of one GPU (at least 0.01), or a whole number up to 1024");
}

std::string plural(int64_t n, const std::string& noun) { return std::to_string(n) + " " + noun + (n == 1 ? "" : "s"); }

// Optimizer steps in an epoch of --data (`data`): the sampler gives each
// worker ceil(n / workers) samples and the trainers drop a last batch short
// of --batch-size. Data too small for one step is refused here, the one
// place that counts it, so that a job never "trains" 0 steps.
int64_t steps_per_epoch(const TrainOptions& o, const actors::DatasetSpec& data) {
  const int64_t n = actors::make_dataset(data)->size();
  // An elastic job may grow to --max-workers: each of them must get a step.
  const bool grows = o.max_workers > o.workers;
  const int64_t workers = grows ? o.max_workers : o.workers;
  const int64_t per_worker = n / workers + (n % workers != 0 ? 1 : 0);
  int64_t step = 0;  // samples of one worker's step (both are checked positive, and at most 2^20 accumulated)
  const bool step_fits = !__builtin_mul_overflow(o.batch_size, o.accumulation, &step);
  if (step_fits && per_worker >= step) return (n / o.workers + (n % o.workers != 0 ? 1 : 0)) / step;
  const std::string held = o.block_size > 0
                               ? plural(n, "window") + " of " + named(o, "block_size", std::to_string(o.block_size))
                               : plural(n, "sample");
  int64_t global = 0;
  const bool fits = step_fits && !__builtin_mul_overflow(workers, step, &global);
  // Each value named as the user gave it: a flag, or a job file's key.
  throw ConfigError(named(o, "data", o.data) + " has " + held + ", fewer than one step of " +
                    named(o, grows ? "max_workers" : "workers", std::to_string(workers)) + " × " +
                    named(o, "batch_size", std::to_string(o.batch_size)) +
                    (o.accumulation > 1 ? " × " + named(o, "accumulation", std::to_string(o.accumulation)) : "") +
                    (fits ? " = " + std::to_string(global) : ""));
}

bool is_model_name(const std::string& model) {
  for (const auto& n : trainer::model_names())
    if (n == model && n != "torchscript") return true;
  return false;
}

trainer::ModelSpec model_spec(const TrainOptions& o) {
  trainer::ModelSpec m;
  if (!is_model_name(o.model)) {
    m.name = "torchscript";
    m.path = fs::absolute(o.model).string();
    return m;
  }
  m.name = o.model;
  static const std::map<std::string, int64_t trainer::ModelSpec::*> sizes = {
      {"input_dim", &trainer::ModelSpec::input_dim},
      {"hidden", &trainer::ModelSpec::hidden},
      {"num_classes", &trainer::ModelSpec::num_classes},
      {"channels", &trainer::ModelSpec::channels},
      {"image_size", &trainer::ModelSpec::image_size}};
  for (const auto& [k, v] : o.model_options) {
    auto it = sizes.find(k);
    if (it == sizes.end())
      throw ConfigError("model option '" + k + "' is not one of input_dim, hidden, num_classes, channels, image_size");
    m.*(it->second) = v;
  }
  return m;
}

// A token stream when --block-size is given, else the npz arrays.
actors::DatasetSpec data_spec(const TrainOptions& o, const std::string& path) {
  const std::string abs = fs::absolute(path).string();
  if (o.block_size > 0) {
    // An .npz is a zip: its bytes read as token ids train on noise.
    require(!ends_with(path, ".npz"), named(o, "block_size", std::to_string(o.block_size)) +
                                          " reads a token stream, and " + path +
                                          " is an .npz of arrays: give a .bin of token ids or a 1-d integer " +
                                          ".npy, or leave out --block-size");
    auto spec = actors::DatasetSpec("token_stream").set("path", abs).set("block_size", o.block_size);
    if (!ends_with(path, ".npy")) spec.set("dtype", o.token_dtype);
    return spec;
  }
  require(!ends_with(path, ".bin"),
          path + " looks like a token stream: give --block-size to train a language model on it");
  return actors::DatasetSpec("npz").set("path", abs);
}

}  // namespace

void read_job_file(const std::string& path, TrainOptions& o) {
  Json j = parse_job_file(path);
  if (!j.is_object()) throw ConfigError("job file " + path + " must hold an object of fields, got " + j.type_name());
  for (const auto& [key, value] : j.items()) {
    auto it = job_keys().find(key);
    if (it == job_keys().end()) {
      std::string known;
      for (const auto& [k, s] : job_keys()) known += (known.empty() ? "" : ", ") + k;
      throw ConfigError("job file " + path + ": unknown key '" + key + "' (known: " + known + ")");
    }
    try {
      it->second(value, o);
      o.from_job_file.insert(key);
    } catch (const WrongValue& w) {
      throw ConfigError("job file " + path + ": key '" + key + w.where + "' must be " + w.expected + ", got " +
                        (w.got.empty() ? value.dump() : w.got));
    } catch (const Json::exception&) {
      throw ConfigError("job file " + path + ": key '" + key + "' has the wrong type (" + value.dump() + ")");
    }
  }
  o.config = path;
  // Relative paths: from the job file's directory, wherever it is run from.
  const fs::path base = fs::absolute(fs::path(path)).parent_path();
  for (const std::string key : kPathKeys) {
    if (!j.contains(key)) continue;
    std::string& value = key == "model"            ? o.model
                         : key == "data"           ? o.data
                         : key == "val_data"       ? o.val_data
                         : key == "checkpoint_dir" ? o.checkpoint_dir
                                                   : o.metrics;
    if (value.empty() || fs::path(value).is_absolute() || (key == "model" && is_model_name(value))) continue;
    value = (base / value).lexically_normal().string();
  }
}

bool parse_train_args(int argc, char** argv, TrainOptions& o) {
  if (std::string path = config_arg(argc, argv); !path.empty()) read_job_file(path, o);
  CLI::App app{
      "troupe train: trains a TorchScript step module on .npz arrays with data-parallel workers, heal, "
      "checkpoints and metrics; no C++ needed",
      "troupe train"};
  add_flags(app, o);
  for (CLI::Option* opt : app.get_options())
    if (opt->get_type_name() == "INT") opt->check(fits_int64());
  // Left over rather than refused by CLI11, whose message lists them
  // backwards: unknown_arguments() names them in order, with a suggestion.
  app.allow_extras();
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return false;
  } catch (const CLI::ParseError& e) {
    throw ConfigError(cli_message(e));
  }
  if (!app.remaining().empty()) throw ConfigError(unknown_arguments(app, app.remaining()));
  // A flag given overrides the job file's value: its problems name the flag.
  for (auto it = o.from_job_file.begin(); it != o.from_job_file.end();) {
    const CLI::Option* flag = app.get_option_no_throw(flag_of(*it));
    it = flag && flag->count() > 0 ? o.from_job_file.erase(it) : std::next(it);
  }
  return true;
}

void check(const TrainOptions& o) {
  require(!o.model.empty(), "no model: give --model step.pt (or \"model\" in the job file)");
  require(!o.data.empty(), "no data: give --data train.npz");
  if (!is_model_name(o.model)) {
    std::error_code ec;
    // A bare word that is no file was most likely meant as a built-in name.
    if (!fs::exists(o.model, ec) && fs::path(o.model).extension().empty() && !fs::path(o.model).has_parent_path()) {
      std::string names;
      for (const auto& n : trainer::model_names())
        if (n != "torchscript") names += (names.empty() ? "" : ", ") + n;
      throw ConfigError(named(o, "model", o.model) + ": no such file, and no built-in model of that name (" + names +
                        ")");
    }
    check_file(o, "model", o.model);
  }
  // Sizes for a built-in model: a TorchScript module has its own, and would
  // silently train without the option asked for.
  if (!is_model_name(o.model) && !o.model_options.empty()) {
    std::string given;
    for (const auto& [k, v] : o.model_options) given += (given.empty() ? "" : ", ") + k + "=" + std::to_string(v);
    throw ConfigError(source_of(o, "model_options") + " (" + given + ") sizes a built-in model (mlp, cnn); " +
                      named(o, "model", o.model) +
                      " is a TorchScript module, whose sizes are its own: remove the option");
  }
  check_file(o, "data", o.data);
  if (!o.val_data.empty()) check_file(o, "val_data", o.val_data);
  require(o.workers >= 1, source_of(o, "workers") + " must be at least 1, got " + std::to_string(o.workers));
  require(o.min_workers >= 0 && o.min_workers <= o.workers,
          source_of(o, "min_workers") + " must be 0 (as many as " + source_of(o, "workers") + ") or 1 to " +
              named(o, "workers", std::to_string(o.workers)) + ", got " + std::to_string(o.min_workers));
  require(o.max_workers == 0 || o.max_workers >= o.workers,
          source_of(o, "max_workers") + " must be 0 (as many as " + source_of(o, "workers") + ") or at least " +
              named(o, "workers", std::to_string(o.workers)) + ", got " + std::to_string(o.max_workers));
  require(o.epochs >= 1, source_of(o, "epochs") + " must be at least 1, got " + std::to_string(o.epochs));
  require(o.max_steps >= 0, source_of(o, "max_steps") + " must be 0 (" + source_of(o, "epochs") +
                                " alone) or positive, got " + std::to_string(o.max_steps));
  require(o.batch_size >= 1, source_of(o, "batch_size") + " must be at least 1, got " + std::to_string(o.batch_size));
  require(o.accumulation >= 1 && o.accumulation <= (int64_t{1} << 20),
          source_of(o, "accumulation") + " must be between 1 and 1048576, got " + std::to_string(o.accumulation));
  require(o.optimizer == "sgd" || o.optimizer == "adamw",
          source_of(o, "optimizer") + " must be sgd or adamw, got '" + o.optimizer + "'");
  check_numbers(o);
  require(o.block_size >= 0, source_of(o, "block_size") + " must not be negative, got " + std::to_string(o.block_size));
  require(
      o.token_dtype == "uint16" || o.token_dtype == "uint32" || o.token_dtype == "int32" || o.token_dtype == "int64",
      source_of(o, "token_dtype") + " must be uint16, uint32, int32 or int64, got '" + o.token_dtype + "'");
  require(o.schedule == "constant" || o.schedule == "cosine",
          source_of(o, "schedule") + " must be constant or cosine, got '" + o.schedule + "'");
  require(o.compression == "none" || o.compression == "bf16" || o.compression == "fp16",
          source_of(o, "compression") + " must be none, bf16 or fp16, got '" + o.compression + "'");
  require(o.warmup_steps >= 0,
          source_of(o, "warmup_steps") + " must not be negative, got " + std::to_string(o.warmup_steps));
  require(o.max_failures >= -1,
          source_of(o, "max_failures") + " must be -1 (no limit) or more, got " + std::to_string(o.max_failures));
  require(o.loader_threads >= 1 && o.loader_threads <= 256,
          source_of(o, "loader_threads") + " must be between 1 and 256, got " + std::to_string(o.loader_threads));
  require(o.log_every >= 1, source_of(o, "log_every") + " must be at least 1, got " + std::to_string(o.log_every));
  require(o.keep_checkpoints >= 0 && o.keep_checkpoints <= 1000000,
          named(o, "keep_checkpoints", std::to_string(o.keep_checkpoints)) +
              " must be 0 (keep all) or the number of newest checkpoints to keep");
  require(o.checkpoint_every >= 0,
          named(o, "checkpoint_every", std::to_string(o.checkpoint_every)) + " must be 0 (off) or a number of steps");
  require(o.cpu_gemm == "auto" || o.cpu_gemm == "onednn" || o.cpu_gemm == "aten",
          source_of(o, "cpu_gemm") + " must be auto, onednn or aten, got '" + o.cpu_gemm + "'");
  require(o.amp == "none" || o.amp == "bf16" || o.amp == "fp16",
          source_of(o, "amp") + " must be none, bf16 or fp16, got '" + o.amp + "'");
  require(o.amp != "fp16" || o.gpus_per_worker > 0, named(o, "amp", "fp16") + " is mixed precision on a GPU: give " +
                                                        source_of(o, "gpus_per_worker") + " too (on the CPU, bf16)");
  // Last: an error in what the job is given names that first.
  require(!o.checkpoint_dir.empty(), "no checkpoint directory: give --checkpoint-dir DIR");
  std::error_code ec;
  if (fs::exists(o.checkpoint_dir, ec) && !fs::is_directory(o.checkpoint_dir, ec))
    throw ConfigError(named(o, "checkpoint_dir", o.checkpoint_dir) + " is a file, not a directory");
}

void make_checkpoint_dir(const TrainOptions& o) {
  std::error_code ec;
  fs::create_directories(o.checkpoint_dir, ec);
  if (ec) throw ConfigError(named(o, "checkpoint_dir", o.checkpoint_dir) + ": cannot create it: " + ec.message());
  // One that exists but takes no file (read-only, another's) is said now,
  // not at the first checkpoint after training has run.
  std::random_device rd;
  const fs::path probe =
      fs::path(o.checkpoint_dir) / (".troupe-write-check-" + std::to_string(::getpid()) + "-" + std::to_string(rd()));
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0)
    throw ConfigError(named(o, "checkpoint_dir", o.checkpoint_dir) + " takes no checkpoint: " + std::strerror(errno));
  ::close(fd);
  fs::remove(probe, ec);
}

namespace {

// The step a step-N directory is named for (-1 when it is not one).
int64_t step_of(const std::string& path) {
  const std::string name = fs::path(path).filename().string();
  if (name.rfind("step-", 0) != 0) return -1;
  try {
    return std::stoll(name.substr(5));
  } catch (const std::exception&) {
    return -1;
  }
}

// --resume over damaged checkpoints: those newer than the one resumed are
// named (their steps are trained again); none readable is an error, not a
// run from step 0 that says there was no checkpoint.
void resume_notes(const TrainOptions& o, const std::optional<trainer::CheckpointInfo>& latest,
                  const std::vector<trainer::SkippedCheckpoint>& skipped, std::vector<std::string>* notes) {
  std::string all;
  for (const auto& s : skipped) {
    all += (all.empty() ? "" : "; ") + fs::path(s.path).filename().string() + ": " + s.why;
    const bool newer = latest && step_of(s.path) > latest->step;
    if (newer && notes) notes->push_back("skipping damaged checkpoint " + s.path + " (" + s.why + ")");
  }
  if (!latest && !skipped.empty())
    throw ConfigError("--resume: no checkpoint in " + o.checkpoint_dir + " can be read (" + all +
                      "); move them away to start at step 0");
}

}  // namespace

trainer::TrainJobConfig to_job_config(const TrainOptions& o, std::vector<std::string>* notes) {
  trainer::TrainJobConfig c;
  c.name = o.name;
  c.scaling.num_workers = o.workers;
  c.scaling.min_workers = o.min_workers;
  c.scaling.max_workers = o.max_workers;
  c.scaling.resources_per_worker = {{"CPU", o.cpus_per_worker}};
  if (o.gpus_per_worker > 0) c.scaling.resources_per_worker["GPU"] = o.gpus_per_worker;
  c.trainer.mixed_precision = o.amp != "none";
  if (c.trainer.mixed_precision) c.trainer.amp_dtype = o.amp;
  c.trainer.model = model_spec(o);
  c.trainer.data = data_spec(o, o.data);
  if (!o.val_data.empty()) c.trainer.validation_data = data_spec(o, o.val_data);
  c.trainer.batch_size = o.batch_size;
  c.trainer.accumulation = o.accumulation;
  c.trainer.seed = o.seed;
  c.trainer.optimizer.name = o.optimizer;
  c.trainer.optimizer.lr = o.lr;
  c.trainer.optimizer.weight_decay = o.weight_decay;
  c.trainer.optimizer.momentum = o.momentum;
  c.trainer.schedule.warmup_steps = o.warmup_steps;
  c.trainer.schedule.decay = o.schedule;
  c.trainer.schedule.min_factor = o.min_lr_factor;
  if (fs::is_directory(o.checkpoint_dir)) {
    std::vector<trainer::SkippedCheckpoint> skipped;
    auto latest = trainer::latest_checkpoint(o.checkpoint_dir, &skipped);
    if (o.resume) resume_notes(o, latest, skipped, notes);
    if (latest) {
      if (!o.resume)
        throw ConfigError(
            "--checkpoint-dir " + o.checkpoint_dir + " already holds a checkpoint (" +
            fs::path(latest->path).filename().string() + ", step " + std::to_string(latest->step) +
            "): add --resume (resume=True in Python's TrainJob, \"resume\": true in a job file) to go on from it, "
            "or name another directory");
      c.resume_from = latest->path;
    }
  }
  const int64_t per_epoch = steps_per_epoch(o, c.trainer.data);
  if (!o.val_data.empty() && actors::make_dataset(c.trainer.validation_data)->size() <= 0)
    throw ConfigError(named(o, "val_data", o.val_data) + " holds no samples");
  // The cosine decays to the job's last step: the epochs', or max_steps when
  // that comes first.
  if (o.schedule == "cosine")
    c.trainer.schedule.total_steps =
        o.max_steps > 0 ? std::min(o.max_steps, o.epochs * per_epoch) : o.epochs * per_epoch;
  c.trainer.compression = o.compression;
  c.trainer.sync_batchnorm = o.sync_batchnorm;
  c.trainer.grad_clip = o.grad_clip;
  c.trainer.cpu_gemm = o.cpu_gemm;
  c.epochs = o.epochs;
  c.max_steps = o.max_steps;
  // An embedded cluster's trainers run on this host: nothing to ship.
  // (troupe::init joins TROUPE_ADDRESS's cluster, as troupe submit and
  // troupe slurm set it, when no address is given.)
  c.ship_files = o.ship_files && (!o.address.empty() || !troupe::core::env_value("TROUPE_ADDRESS").empty());
  c.failure.max_failures = o.max_failures;
  c.checkpoint.dir = fs::absolute(o.checkpoint_dir).string();
  c.checkpoint.at_epoch_end = true;
  c.checkpoint.every_steps = o.checkpoint_every;
  c.checkpoint.keep = static_cast<int>(o.keep_checkpoints);
  c.metrics_path = o.metrics.empty() ? "" : fs::absolute(o.metrics).string();
  c.evaluate = !o.val_data.empty();
  c.progress_every_steps = o.log_every;
  c.loader_threads = o.loader_threads;
  c.call_timeout = std::chrono::milliseconds(static_cast<int64_t>(o.step_timeout_s * 1000.0));
  c.failure.replacement_timeout = std::chrono::milliseconds(static_cast<int64_t>(o.replacement_timeout_s * 1000.0));
  trainer::validate(c);
  return c;
}

}  // namespace troupe::launcher
