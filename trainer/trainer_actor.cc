#include "troupe/trainer/trainer_actor.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <sstream>

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include "troupe/actors/tensor_codec.h"
#include "troupe/runtime/collective/actor_group.h"
#include "troupe/runtime/core/check.h"
#include "troupe/runtime/core/error_registry.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/exception_text.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/trainer/cpu_gemm.h"
#include "troupe/trainer/gradient_reducer.h"
#include "troupe/trainer/shm_group.h"
#include "troupe/trainer/sync_batch_norm.h"
#include "troupe/trainer/torch_compat.h"

TROUPE_REGISTER_CTOR(troupe::trainer::TrainerActor)

namespace troupe::trainer {

namespace {
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Autocast (mixed precision, CUDA or CPU) for the forward pass of one
// step, off again however the pass ends.
class Autocast {
 public:
  Autocast(bool on, bool cuda, at::ScalarType dtype) : on_(on), cuda_(cuda) {
    if (!on_) return;
    if (cuda_)
      compat::set_cuda_autocast(true, dtype);
    else
      compat::set_cpu_autocast(true, dtype);
  }
  ~Autocast() {
    if (!on_) return;
    if (cuda_)
      compat::set_cuda_autocast(false);
    else
      compat::set_cpu_autocast(false);
    at::autocast::clear_cache();
  }
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  bool on_;
  bool cuda_;
};

// Samples classified right, from the summed `accuracy` metric (each batch's
// accuracy times its samples is a whole number, up to rounding).
int64_t correct_of(const std::map<std::string, double>& metric_sums) {
  auto it = metric_sums.find("accuracy");
  return it == metric_sums.end() ? 0 : std::llround(it->second);
}
}  // namespace

void validate(const TrainerConfig& c) {
  validate(c.model);
  validate(c.step);
  validate(c.optimizer);
  validate(c.schedule);
  if (c.batch_size <= 0) throw ConfigError("batch_size must be positive, got " + std::to_string(c.batch_size));
  if (c.accumulation <= 0) throw ConfigError("accumulation must be positive, got " + std::to_string(c.accumulation));
  if (c.bucket_mb <= 0) throw ConfigError("bucket_mb must be positive");
  parse_compression(c.compression);
  if (c.validation_fraction < 0 || c.validation_fraction >= 1)
    throw ConfigError("validation_fraction must be in [0, 1)");
  if (c.device != "auto" && c.device != "cpu" && c.device != "cuda")
    throw ConfigError("device must be 'auto', 'cpu' or 'cuda', got '" + c.device + "'");
  if (c.collective != "auto" && c.collective != "nccl" && c.collective != "gloo")
    throw ConfigError("collective must be 'auto', 'nccl' or 'gloo', got '" + c.collective + "'");
  if (c.collective == "nccl" && c.device == "cpu")
    throw ConfigError("collective 'nccl' moves GPU memory, and device is 'cpu'");
  if (c.amp_dtype != "fp16" && c.amp_dtype != "bf16")
    throw ConfigError("amp_dtype must be 'fp16' or 'bf16', got '" + c.amp_dtype + "'");
  if (!(c.initial_loss_scale >= 1 && c.initial_loss_scale <= 3e38))
    throw ConfigError("initial_loss_scale must be in [1, 3e38], got " + std::to_string(c.initial_loss_scale));
  if (c.data.name.empty()) throw ConfigError("no data set given (TrainerConfig::data)");
  if (c.ema_decay < 0 || c.ema_decay >= 1)
    throw ConfigError("ema_decay must be in [0, 1), got " + std::to_string(c.ema_decay));
  if (!c.validation_data.name.empty() && c.validation_fraction > 0)
    throw ConfigError("give validation_data (" + c.validation_data.name + ") or validation_fraction (" +
                      std::to_string(c.validation_fraction) + "), not both");
  // A TorchScript module runs its own BatchNorm code: there is nothing to
  // hook (torch.nn.SyncBatchNorm does not script for CPU either).
  if (c.sync_batchnorm && c.model.name == "torchscript")
    throw ConfigError("sync_batchnorm: the TorchScript module " + c.model.path +
                      " normalises with its own code; SyncBatchNorm applies to C++ models (built-in cnn, "
                      "trainer::batch_norm)");
  if (!(c.grad_clip >= 0) || !std::isfinite(c.grad_clip))
    throw ConfigError("grad_clip must be a finite number >= 0 (0 = off), got " + std::to_string(c.grad_clip));
  if (c.cpu_gemm != "auto" && c.cpu_gemm != "onednn" && c.cpu_gemm != "aten")
    throw ConfigError("cpu_gemm must be 'auto', 'onednn' or 'aten', got '" + c.cpu_gemm + "'");
}

int apply_cpu_gemm(const TrainerConfig& c, Model& model) {
  if (c.cpu_gemm == "aten") return 0;
  std::string why_not;
  if (onednn_available(&why_not)) return model.route_cpu_gemm();
  if (c.cpu_gemm == "onednn") throw ConfigError("cpu_gemm 'onednn': " + why_not);
  return 0;
}

int64_t train_size(const TrainerConfig& c, int64_t n) {
  return n - static_cast<int64_t>(static_cast<double>(n) * c.validation_fraction);
}

std::vector<int64_t> split_order(const TrainerConfig& c, int64_t n) {
  if (c.validation_fraction <= 0) return {};
  // Fisher-Yates with SplitMix64: the same split on every machine.
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  uint64_t state = static_cast<uint64_t>(c.split_seed) * 0x9E3779B97F4A7C15ULL + 1;
  for (int64_t i = n - 1; i > 0; --i) {
    state += 0x9E3779B97F4A7C15ULL;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    std::swap(order[i], order[static_cast<int64_t>(z % static_cast<uint64_t>(i + 1))]);
  }
  return order;
}

actors::SamplerOptions sampler_options(const TrainerConfig& c, int64_t n, int64_t world_size) {
  actors::SamplerOptions o;
  o.dataset_size = train_size(c, n);
  o.world_size = world_size;
  o.shuffle = c.shuffle;
  o.seed = c.seed;
  o.drop_last = false;
  return o;
}

namespace {
// True when every member of `g` runs on this host and may share memory:
// same hostname and boot, and the same network and IPC namespaces (two
// containers on one machine are two hosts to us: their /dev/shm differ).
bool all_on_one_host(collective::Group& g) {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::string id = host;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char buf[64] = {};
    if (std::fgets(buf, sizeof buf, f)) id += buf;
    std::fclose(f);
  }
  for (const char* ns : {"/proc/self/ns/net", "/proc/self/ns/ipc"}) {
    char link[64] = {};
    if (::readlink(ns, link, sizeof link - 1) > 0) id += link;  // "net:[4026531992]"
  }
  int64_t mine = static_cast<int64_t>(std::hash<std::string>{}(id)&0x7fffffffffffffffULL);
  std::vector<int64_t> all(static_cast<size_t>(g.world_size()));
  g.allgather(&mine, all.data(), 1, collective::DType::kInt64)->wait(std::chrono::minutes(2));
  for (auto v : all)
    if (v != mine) return false;
  return true;
}

// The one line of a user's model or step error to report: a c10::Error's
// what() ends with LibTorch's C++ backtrace (tens of frames), never the
// user's to read; TorchScript's message begins with its traceback and
// ends with the error raised, the line to report (the whole text goes to
// this worker's log).
std::string user_error_text(const std::exception& e) {
  const auto* c10 = dynamic_cast<const c10::Error*>(&e);
  std::string text = c10 ? c10->what_without_backtrace() : e.what();
  if (text.find("TorchScript interpreter") != std::string::npos) {
    TROUPE_LOG_WARN("the step raised: {}", text);
    text = core::last_line(text);
  }
  return text;
}
}  // namespace

TrainerActor::TrainerActor() {
  if (!this_actor::in_worker()) return;
  this_actor::on_control<InterruptBatches>([slot = stream_](const InterruptBatches& m) {
    std::shared_ptr<StreamReader<actors::Batch>> r;
    {
      std::lock_guard lock(slot->mu);
      if (slot->generation <= m.generation) r = slot->reader;
    }
    if (r) r->cancel(m.reason);
    return r != nullptr;
  });
}
// The reducer holds hooks on the model's parameters and memory the group
// writes into: it goes first, then the group.
TrainerActor::~TrainerActor() {
  reducer_.reset();
  group_.reset();
}

std::vector<ConfigFile> files_read(TrainerConfig& c) {
  std::vector<ConfigFile> files;
  if (c.model.name == "torchscript" && !c.model.path.empty()) files.push_back({"the model", &c.model.path});
  auto add = [&](const char* what, actors::DatasetSpec& d) {
    for (const auto& key : actors::file_keys(d)) files.push_back({what, &d.strings[key]});
  };
  add("the data", c.data);
  add("the validation data", c.validation_data);
  return files;
}

namespace {
// The files a trainer reads at the driver's paths (a TorchScript model, a
// data set's `path`) are there, or shipped: on a cluster whose hosts do
// not share them a trainer met "does not exist" about a file the driver
// had just checked, without being told where it ran.
void use_files_here(TrainerConfig& c, DriverPaths& paths) {
  for (auto& [what, path] : files_read(c)) {
    *path = paths.use(c.shipped_files, *path);
    std::error_code ec;
    // A relative path, or one this host cannot stat, is the reader's to
    // name: the host's absence is what is told here.
    if (!std::filesystem::path(*path).is_absolute() || std::filesystem::exists(*path, ec) || ec) continue;
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    throw ConfigError(what + " " + *path + " is not on " + host + ", where a trainer runs: trainers read it at " +
                      "that path on every node, so put it on storage every node shares, or have the driver " +
                      "send it (troupe train --ship-files)");
  }
}
}  // namespace

TrainerInfo TrainerActor::setup(TrainerConfig config) {
  use_files_here(config, driver_paths_);
  // What opening a shipped copy says (a TorchScript or .npz reader's
  // error) names the driver's file.
  try {
    return set_up(std::move(config));
  } catch (const std::exception& e) {
    driver_paths_.rethrow(e);
  }
}

TrainerInfo TrainerActor::set_up(TrainerConfig config) {
  validate(config);
  config_ = std::move(config);
  if (config_.threads > 0) {
    torch::set_num_threads(static_cast<int>(config_.threads));
    // A pthreads OpenBLAS (Debian's default BLAS) keeps its own thread
    // pool, sized to the machine, whatever torch is told: bound it too, so
    // "one thread per worker" holds for the matrix products as well.
    using SetThreads = void (*)(int);
    if (auto f = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads")))
      f(static_cast<int>(config_.threads));
  }
  device_ = torch::Device(torch::kCPU);
  if (config_.device == "cuda" ||
      (config_.device == "auto" && this_actor::in_worker() && !this_actor::gpu_ids().empty())) {
    if (!torch::cuda::is_available())
      throw ConfigError(config_.device == "cuda" ? "device 'cuda' was asked for but LibTorch sees no CUDA device"
                                                 : "this trainer was given a GPU but LibTorch sees no CUDA device");
    device_ = torch::Device(torch::kCUDA, 0);
  }
  if (config_.mixed_precision && !device_.is_cuda() && config_.amp_dtype != "bf16")
    throw ConfigError("mixed precision with amp_dtype '" + config_.amp_dtype +
                      "' needs a CUDA device; on the CPU autocast computes in 'bf16'");
  torch::manual_seed(static_cast<uint64_t>(config_.seed));
  model_ = make_model(config_.model);
  if (device_.is_cpu()) {
    if (const int n = apply_cpu_gemm(config_, *model_); n > 0)
      TROUPE_LOG_INFO("trainer: {} linear call site(s) of {} computed by oneDNN", n, model_->describe());
  }
  model_->to(device_);
  step_fn_ = make_step(config_.step, *model_);
  optimizer_ = std::make_unique<Optimizer>(config_.optimizer, model_->named_parameters());
  dataset_ = actors::make_dataset(config_.data);
  if (train_size(config_, dataset_->size()) <= 0) throw ConfigError("the training split is empty");
  split_ = split_order(config_, dataset_->size());
  val_dataset_.reset();
  if (!config_.validation_data.name.empty()) val_dataset_ = actors::make_dataset(config_.validation_data);
  reducer_ = std::make_unique<GradientReducer>(model_->parameters(), nullptr);
  // A trainer set up again (a restart from the initial weights) forgets
  // everything of its earlier run.
  step_ = 0;
  epoch_ = 0;
  cursor_ = actors::SamplerCursor{};
  ema_.clear();
  loss_scale_ = config_.initial_loss_scale;
  good_steps_ = 0;
  ready_ = true;
  return TrainerInfo{device_.str(), driver_paths_.named(model_->describe()), model_->parameter_count(),
                     dataset_->size(), static_cast<int64_t>(::getpid())};
}

void TrainerActor::join(JoinSpec spec) {
  TROUPE_CHECK(ready_) << "setup() first";
  // Gradients may be views of the old group's shared-memory buckets, which
  // go away with it: give every parameter its own zeroed gradient first
  // (zeros, not undefined, so a rejoined rank accumulates exactly as one
  // that never left).
  {
    torch::NoGradGuard ng;
    for (auto& p : model_->parameters()) p.mutable_grad() = torch::zeros_like(p);
  }
  reducer_.reset();
  group_.reset();
  collective::GroupSpec g;
  g.name = spec.name;
  g.generation = spec.generation;
  g.rank = static_cast<int>(spec.rank);
  g.world_size = static_cast<int>(spec.world_size);
  g.members = spec.members;
  // CUDA trainers reduce device memory with NCCL, unless told to use Gloo
  // (ranks sharing a GPU); CPU ones use Gloo.
  if (config_.collective == "nccl" && !device_.is_cuda())
    throw ConfigError("collective 'nccl' needs a CUDA trainer, and this one runs on " + device_.str());
  group_on_device_ = device_.is_cuda() && config_.collective != "gloo";
  g.backend = group_on_device_ ? collective::Backend::kNccl : collective::Backend::kGloo;
  if (group_on_device_) g.device = device_.index();
  // Every rank builds the same buckets from the same model and reduces them
  // in the same order: the calls agree by construction, so no per-call
  // check (it would cost a small exchange per bucket and step).
  g.check_agreement = false;
  group_ = collective::join_group(g);
  shm_ = nullptr;
  ReducerOptions ro;
  ro.bucket_bytes = config_.bucket_mb * 1024 * 1024;
  ro.compression = parse_compression(config_.compression);
  ro.group_takes_device_memory = group_on_device_;
  if (config_.shared_memory && spec.world_size > 1 && device_.is_cpu() && ro.compression == Compression::kNone &&
      all_on_one_host(*group_)) {
    size_t arena = 0;
    for (auto& p : model_->parameters()) arena += static_cast<size_t>(p.numel() * p.element_size()) + 64;
    try {
      auto shm = ShmGroup::create(group_, arena, std::chrono::minutes(5));  // takes group_ over
      shm_ = shm.get();
      group_ = std::move(shm);
      ro.allocate = [s = shm_](size_t bytes) { return s->allocate(bytes); };
    } catch (const Aborted&) {
      throw;
    } catch (const Timeout&) {
      throw;
    } catch (const Error& e) {
      // Every rank saw the same failure (create() agrees collectively):
      // all stay on the TCP path.
      std::fprintf(stderr, "trainer rank %d: no shared-memory reduction (%s); using %s\n", group_->rank(), e.what(),
                   collective::to_string(g.backend));
    }
  }
  TROUPE_LOG_INFO("trainer rank {} of {}: gradients reduced over {}", group_->rank(), spec.world_size,
                  shm_ ? "shared memory" : collective::to_string(g.backend));
  reducer_ = std::make_unique<GradientReducer>(model_->parameters(), group_.get(), ro);
  if (!spec.sync_params) return;
  std::vector<torch::Tensor> all = model_->parameters();
  for (auto& [name, b] : model_->named_buffers()) all.push_back(b);
  reducer_->broadcast_from_rank0(all);
}

void TrainerActor::set_reader(std::shared_ptr<StreamReader<actors::Batch>> r) {
  std::lock_guard lock(stream_->mu);
  stream_->reader = std::move(r);
  stream_->generation = group_ ? group_->generation() : 0;
}

StreamRef TrainerActor::open_stream(int64_t credits) {
  set_reader(std::make_shared<StreamReader<actors::Batch>>(this_actor::runtime(), static_cast<size_t>(credits)));
  return stream_->reader->ref();
}

void TrainerActor::StepSums::add(const StepSums& o) {
  loss_sum += o.loss_sum;
  for (const auto& [k, v] : o.metric_sums) metric_sums[k] += v;
}

TrainerActor::PendingSums TrainerActor::pending_of(const StepOutput& out, int64_t samples) {
  // Kept until the call ends: a value that views a larger tensor (a metric
  // such as `losses[0]`) is copied, so the step's other memory can go.
  const auto keep = [](const torch::Tensor& t) {
    auto d = t.detach();
    return d.has_storage() && d.storage().nbytes() > d.nbytes() ? d.clone() : d;
  };
  PendingSums p;
  p.loss = keep(out.loss);
  for (const auto& [k, v] : out.metrics) p.metrics[k] = keep(v);
  p.samples = samples;
  return p;
}

std::vector<TrainerActor::StepSums> TrainerActor::resolve(const std::vector<PendingSums>& pending) const {
  // Every value as one double on the loss's device (exact for the float,
  // half and integer types a step returns, as item<double>() is), then one
  // copy to the host.
  std::vector<torch::Tensor> flat;
  for (const auto& p : pending) {
    const auto to = torch::TensorOptions().dtype(torch::kDouble).device(p.loss.device());
    flat.push_back(p.loss.reshape({1}).to(to));
    for (const auto& [k, v] : p.metrics) flat.push_back(v.reshape({1}).to(to));
  }
  std::vector<StepSums> out;
  if (flat.empty()) return out;
  const auto host = torch::cat(flat).to(torch::kCPU).contiguous();
  const double* x = host.data_ptr<double>();
  const auto summed = step_fn_->summed_metrics();
  out.reserve(pending.size());
  for (const auto& p : pending) {
    StepSums s;
    const auto n = static_cast<double>(p.samples);
    s.loss_sum = *x++ * n;
    for (const auto& [k, v] : p.metrics) {
      const double value = *x++;
      s.metric_sums[k] = summed.count(k) ? value : value * n;
    }
    out.push_back(std::move(s));
  }
  return out;
}

StepOutput TrainerActor::run_step(const actors::TensorDict& tensors) {
  StepOutput out;
  try {
    Autocast autocast(config_.mixed_precision, device_.is_cuda(),
                      config_.amp_dtype == "bf16" ? torch::kBFloat16 : torch::kHalf);
    SyncBatchNormScope sync_bn(config_.sync_batchnorm ? group_.get() : nullptr);
    out = step_fn_->train(*model_, tensors);
  } catch (const Error& e) {
    driver_paths_.rethrow(e);  // troupe's own (a SyncBatchNorm collective aborted, a TorchScript model's refusal)
  } catch (const std::exception& e) {
    // The user's model or step refusing this batch (a missing key, a
    // shape that does not fit, a `raise` in a TorchScript step) refuses it
    // on every rank and every retry: not a failure a replacement could
    // fix. Unless a peer's failure aborted the group under it.
    // Either way the message is one line.
    const std::string text = driver_paths_.named(user_error_text(e));
    // The step being trained (1-based, as the progress lines count them).
    const std::string where = "step " + step_fn_->describe() + " with " + driver_paths_.named(model_->describe()) +
                              " failed on a batch " + tensors.describe() + " at rank " +
                              std::to_string(group_ ? group_->rank() : 0) + ", step " + std::to_string(step_ + 1);
    // Not the user's error to end the job with (the root cause, a peer's,
    // is): a failure of this round, as any other under an aborted group.
    if (group_ && group_->is_aborted()) throw Aborted(where + " (the group was aborted under it): " + text);
    throw ConfigError(where + ": " + text);
  }
  check_output(out, *step_fn_);
  if (!out.loss.requires_grad())
    throw ConfigError("step " + step_fn_->describe() + " returned a 'loss' that does not depend on the parameters");
  return out;
}

TrainerActor::PendingSums TrainerActor::micro_step(const actors::Batch& batch, bool sync, StepContext context,
                                                   const std::function<void(const PendingSums&)>* before_backward) {
  bool amp = scales_loss();
  context.step = step_;
  step_fn_->set_context(context);
  model_->set_context(context);
  StepOutput out = run_step(dataset_->finish(batch.tensors.to(device_, /*non_blocking=*/true)));
  auto pending = pending_of(out, batch.size());
  if (before_backward) (*before_backward)(pending);
  auto loss = out.loss;
  reducer_->prepare(sync);
  auto scaled = loss / static_cast<double>(config_.accumulation);
  if (amp) scaled = scaled * loss_scale_;
  scaled.backward();
  reducer_->finish();
  // As DDP's broadcast_buffers: every forward runs with rank 0's buffers
  // (BatchNorm statistics). Sent after the forward rather than before the
  // next one (the same values reach the same forwards), so that between
  // steps every rank holds identical buffers: any survivor can then heal a
  // replacement, and evaluation agrees across ranks.
  if (group_ && group_->world_size() > 1) {
    auto buffers = model_->named_buffers();
    if (!buffers.empty()) {
      std::vector<torch::Tensor> bs;
      for (auto& [name, b] : buffers) bs.push_back(b);
      reducer_->broadcast_from_rank0(bs);
    }
  }
  return pending;
}

void TrainerActor::optimizer_step() {
  double lr = learning_rate(config_.optimizer, config_.schedule, step_, reducer_->world_size());
  bool amp = scales_loss();
  if (amp) {
    // Dynamic loss scaling (as torch.cuda.amp.GradScaler): unscale, skip
    // the step and halve the scale on inf/nan, double it after 2000 good
    // steps. Every rank sees the same reduced gradients, so all decide alike.
    torch::NoGradGuard ng;
    // One device-to-host read for all gradients, not one per parameter.
    std::vector<torch::Tensor> finite_each;
    for (auto& p : model_->parameters()) {
      if (!p.grad().defined()) continue;
      p.mutable_grad().mul_(1.0 / loss_scale_);
      finite_each.push_back(torch::isfinite(p.grad()).all());
    }
    bool finite = finite_each.empty() || torch::stack(finite_each).all().item<bool>();
    if (!finite) {
      loss_scale_ /= 2;
      good_steps_ = 0;
      optimizer_->zero_grad();
      ++step_;
      return;
    }
    if (++good_steps_ % 2000 == 0) loss_scale_ *= 2;
  }
  // After the reduction (and the unscaling): the gradients clipped are the
  // ones every rank holds alike.
  if (config_.grad_clip > 0) torch::nn::utils::clip_grad_norm_(model_->parameters(), config_.grad_clip);
  optimizer_->step(lr);
  optimizer_->zero_grad();
  ++step_;
  update_ema();
}

bool TrainerActor::scales_loss() const {
  return config_.mixed_precision && device_.is_cuda() && config_.amp_dtype == "fp16";
}

void TrainerActor::update_ema() {
  if (config_.ema_decay <= 0) return;
  torch::NoGradGuard ng;
  auto params = model_->named_parameters();
  if (ema_.empty()) {
    for (auto& [name, p] : params) ema_.push_back(p.detach().clone());
    return;
  }
  const double d = config_.ema_decay;
  for (size_t i = 0; i < params.size(); ++i) ema_[i].mul_(d).add_(params[i].second.detach(), 1.0 - d);
}

actors::Batch TrainerActor::next_batch(bool from_stream, const std::vector<int64_t>& indices, size_t& pos,
                                       int64_t epoch) {
  if (from_stream) {
    // Only this thread replaces the reader: reading it needs no lock.
    auto& reader = stream_->reader;
    TROUPE_CHECK(reader) << "open_stream() first";
    auto b = reader->read(std::chrono::minutes(5));
    if (!b) throw Error("the batch stream ended before step " + std::to_string(step_ + 1));
    pos += static_cast<size_t>(b->size());
    return std::move(*b);
  }
  std::vector<int64_t> idx(indices.begin() + pos, indices.begin() + pos + config_.batch_size);
  if (!split_.empty())
    for (auto& i : idx) i = split_[static_cast<size_t>(i)];
  pos += idx.size();
  return actors::load_and_collate(*dataset_, std::move(idx), epoch);
}

// The loss and metric sums of each step of `rep` (its micro-steps' pending
// sums, in order), per step and in all.
void TrainerActor::sum_steps(TrainReport& rep, const std::vector<StepSums>& micro) {
  for (size_t i = 0; i < rep.step_samples.size(); ++i) {
    StepSums sums;
    for (int64_t k = 0; k < config_.accumulation; ++k)
      sums.add(micro[i * static_cast<size_t>(config_.accumulation) + static_cast<size_t>(k)]);
    const int64_t correct = correct_of(sums.metric_sums);
    rep.step_loss_sum.push_back(sums.loss_sum);
    rep.step_correct.push_back(correct);
    rep.step_metric_sums.push_back(sums.metric_sums);
    rep.loss_sum += sums.loss_sum;
    rep.correct += correct;
    for (const auto& [k, v] : sums.metric_sums) rep.metric_sums[k] += v;
  }
}

// After a failed train(): the `done` steps it completed, for take_partial
// (the step cut short was rolled back; its micro-steps are left out).
void TrainerActor::keep_partial(TrainReport rep, std::vector<PendingSums>& pending, int64_t done,
                                std::chrono::steady_clock::time_point t0) {
  partial_ = TrainReport{};
  if (done <= 0) return;
  try {
    pending.resize(static_cast<size_t>(done * config_.accumulation));
    rep.step_samples.resize(static_cast<size_t>(done));
    rep.samples = 0;
    for (int64_t n : rep.step_samples) rep.samples += n;
    rep.steps = done;
    rep.consumed.clear();  // the driver counts these steps' samples from the sampler
    sum_steps(rep, resolve(pending));
    for (const auto& k : step_fn_->summed_metrics()) rep.summed_metrics.push_back(k);
    rep.cursor = cursor_;
    rep.global_step = step_;
    rep.seconds = seconds_since(t0);
    partial_ = std::move(rep);
  } catch (const std::exception&) {
    partial_ = TrainReport{};  // sums that cannot be read: the steps go unrecorded
  }
}

// A shared-memory group is marked aborted even when its inner group
// already is (the driver's AbortGroup reaches only that): a peer stopped
// now and woken later must see it in the segment.
void TrainerActor::abort_round(const std::string& why) {
  if (shm_)
    shm_->abort(why);
  else if (group_ && !group_->is_aborted())
    group_->abort(why);
}

TrainReport TrainerActor::take_partial() { return std::exchange(partial_, TrainReport{}); }

TrainReport TrainerActor::train(TrainRequest req) {
  TROUPE_CHECK(ready_) << "setup() first";
  TROUPE_CHECK(req.max_steps > 0) << "max_steps must be positive";
  auto t0 = Clock::now();
  int64_t world = reducer_->world_size();
  int64_t rank = group_ ? group_->rank() : 0;
  actors::DistributedSampler sampler(sampler_options(config_, dataset_->size(), world));
  auto cursor = sampler.resize(req.cursor, world);
  TROUPE_CHECK(cursor.world_size == world) << "cursor for " << cursor.world_size << " ranks, group has " << world;
  std::vector<int64_t> indices = sampler.remaining(cursor, rank);
  const int64_t per_step = config_.batch_size * config_.accumulation;
  int64_t steps = std::min<int64_t>(req.max_steps, static_cast<int64_t>(indices.size()) / per_step);
  model_->train(true);
  partial_ = TrainReport{};
  TrainReport rep;
  size_t pos = 0;
  int64_t s = 0;
  StepSnapshot snap;
  // Each micro-step's loss and metrics stay on the device until the last
  // forward has been launched; they are read back before its backward
  // (see resolve()).
  std::vector<PendingSums> pending;
  std::vector<StepSums> resolved;
  const std::function<void(const PendingSums&)> read_back = [&](const PendingSums& last) {
    pending.push_back(last);
    resolved = resolve(pending);
    pending.pop_back();
  };
  StepContext context = step_context(cursor.epoch, rank, world, true);
  try {
    for (; s < steps; ++s) {
      snap = snapshot();
      int64_t samples = 0;
      for (int64_t k = 0; k < config_.accumulation; ++k) {
        const auto asked = Clock::now();
        actors::Batch batch = next_batch(req.from_stream, indices, pos, cursor.epoch);
        rep.wait_seconds += seconds_since(asked);
        const bool last = s == steps - 1 && k == config_.accumulation - 1;
        context.micro_step = k;
        pending.push_back(micro_step(batch, k == config_.accumulation - 1, context, last ? &read_back : nullptr));
        samples += batch.size();
        if (req.record_indices) rep.consumed.insert(rep.consumed.end(), batch.indices.begin(), batch.indices.end());
      }
      optimizer_step();
      rep.step_samples.push_back(samples);
      rep.samples += samples;
      ++rep.steps;
    }
    sum_steps(rep, resolved);
  } catch (const std::exception& e) {
    // A step cut short (a peer died, the group was aborted, the batch
    // stream broke): undo its partial effects so the state is that of the
    // last completed step, and abort the group so no peer waits on this
    // rank in a collective.
    abort_round(std::string("rank ") + std::to_string(rank) + ": " + e.what());
    roll_back(snap);
    cursor_ = sampler.advance(cursor, s * per_step);
    epoch_ = cursor_.epoch;
    set_reader(nullptr);
    keep_partial(std::move(rep), pending, s, t0);
    throw;
  }
  cursor = sampler.advance(cursor, steps * per_step);
  // Fewer samples left than one step: the epoch ends here (as drop_last
  // on the last incomplete global batch).
  int64_t left = sampler.remaining_per_rank(cursor);
  if (left > 0 && left < per_step) cursor = sampler.advance(cursor, left);
  cursor_ = cursor;
  epoch_ = cursor.epoch;
  rep.cursor = cursor;
  rep.global_step = step_;
  for (const auto& k : step_fn_->summed_metrics()) rep.summed_metrics.push_back(k);
  rep.lr = learning_rate(config_.optimizer, config_.schedule, std::max<int64_t>(0, step_ - 1), world);
  rep.seconds = seconds_since(t0);
  // A round that ended here but failed at a peer is healed past too: its
  // steps are the driver's to take as well.
  partial_ = rep;
  partial_.consumed.clear();
  return rep;
}

EvalReport TrainerActor::evaluate(int64_t rank, int64_t world_size) {
  TROUPE_CHECK(ready_) << "setup() first";
  torch::NoGradGuard ng;
  // With EMA on, score the averaged weights: swap them in for the pass,
  // and back (and to training mode) however the pass ends. A step whose
  // eval raised left the EMA weights in place as the live ones, which a
  // heal then sent to every rank.
  struct LiveWeights {
    Model& model;
    std::vector<std::pair<std::string, torch::Tensor>> params;
    std::vector<torch::Tensor> saved;
    ~LiveWeights() {
      // A destructor must not throw (a device in a sticky error state may
      // refuse the copy): the trainer then holds the average, said here,
      // and the job's next step or heal meets the device's error itself.
      try {
        torch::NoGradGuard no_grad;
        for (size_t i = 0; i < saved.size(); ++i) params[i].second.copy_(saved[i]);
        model.train(true);
      } catch (const std::exception& e) {
        TROUPE_LOG_ERROR("trainer: the live weights could not be put back after evaluation: {}", e.what());
      }
    }
  } live{*model_, model_->named_parameters(), {}};
  model_->train(false);
  if (!ema_.empty()) {
    for (size_t i = 0; i < live.params.size(); ++i) {
      live.saved.push_back(live.params[i].second.detach().clone());
      live.params[i].second.copy_(ema_[i]);
    }
  }
  const StepContext context = step_context(epoch_, rank, world_size, false);
  step_fn_->set_context(context);
  model_->set_context(context);
  const actors::Dataset& data = val_dataset_ ? *val_dataset_ : *dataset_;
  int64_t n = data.size();
  int64_t begin = !val_dataset_ && config_.validation_fraction > 0 ? train_size(config_, n) : 0;
  EvalReport rep;
  std::vector<int64_t> idx;
  for (int64_t i = begin + rank; i < n; i += world_size)
    idx.push_back(split_.empty() || val_dataset_ ? i : split_[static_cast<size_t>(i)]);
  std::vector<PendingSums> pending;
  for (size_t s = 0; s < idx.size(); s += 256) {
    std::vector<int64_t> chunk(idx.begin() + s, idx.begin() + std::min(idx.size(), s + 256));
    auto b = actors::load_and_collate(data, std::move(chunk), 0);
    auto tensors = data.finish(b.tensors.to(device_));
    StepOutput out;
    try {
      out = step_fn_->eval(*model_, tensors);
    } catch (const Error& e) {
      driver_paths_.rethrow(e);
    } catch (const std::exception& e) {
      // As in training: the user's step refuses this batch on every rank
      // and every retry (it was retried as a crash, for ever with no limit
      // on failures). Said as evaluation, not as training.
      throw ConfigError("step " + step_fn_->describe() + " with " + driver_paths_.named(model_->describe()) +
                        " failed evaluating a batch " + tensors.describe() + " at rank " + std::to_string(rank) +
                        " (the validation after step " + std::to_string(step_) +
                        "): " + driver_paths_.named(user_error_text(e)));
    }
    check_output(out, *step_fn_);
    pending.push_back(pending_of(out, b.size()));
    rep.count += b.size();
  }
  for (const auto& sums : resolve(pending)) {
    rep.loss_sum += sums.loss_sum;
    for (const auto& [k, v] : sums.metric_sums) rep.metric_sums[k] += v;
  }
  rep.correct = correct_of(rep.metric_sums);
  return rep;
}

TrainState TrainerActor::state() {
  TROUPE_CHECK(ready_) << "setup() first";
  TrainState s;
  s.step = step_;
  s.epoch = epoch_;
  s.world_size = reducer_ ? reducer_->world_size() : 0;  // none after a join that failed: the driver's says
  for (auto& [name, p] : model_->named_parameters()) s.model[name] = p.detach().to(torch::kCPU).clone();
  for (auto& [name, b] : model_->named_buffers()) s.model[name] = b.detach().to(torch::kCPU).clone();
  s.optimizer = optimizer_->state();
  s.optimizer["loss_scale"] = torch::tensor(loss_scale_, torch::kFloat64);
  s.optimizer["good_steps"] = torch::tensor(good_steps_, torch::kInt64);
  {
    auto params = model_->named_parameters();
    for (size_t i = 0; i < ema_.size(); ++i) s.optimizer["ema/" + params[i].first] = ema_[i].to(torch::kCPU).clone();
  }
  s.rng = at::detail::getDefaultCPUGenerator().get_state();
  s.cursor = cursor_;
  s.step_state = step_state_copy(torch::Device(torch::kCPU));
  return s;
}

StepContext TrainerActor::step_context(int64_t epoch, int64_t rank, int64_t world, bool training) const {
  StepContext c;
  c.step = step_;
  c.epoch = epoch;
  c.accumulation = config_.accumulation;
  c.rank = rank;
  c.world_size = world;
  c.training = training;
  return c;
}

std::map<std::string, torch::Tensor> TrainerActor::step_state_copy(std::optional<torch::Device> to) const {
  std::map<std::string, torch::Tensor> out;
  std::map<std::string, torch::Tensor> given;
  try {
    given = step_fn_->state();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw ConfigError("step " + step_fn_->describe() + "'s state() failed: " + user_error_text(e));
  }
  for (const auto& [name, t] : given) {
    if (!t.defined())
      throw ConfigError("step " + step_fn_->describe() + "'s state() returned '" + name + "' undefined");
    // The step's own tensor that cannot be copied (a meta tensor, say):
    // its error, and the user's to fix, not a failure to retry.
    try {
      out[name] = to ? t.detach().to(*to).clone() : t.detach().clone();
    } catch (const std::exception& e) {
      throw ConfigError("step " + step_fn_->describe() + "'s state() returned '" + name + "', which cannot be copied" +
                        (to ? " to " + to->str() : std::string()) + ": " + user_error_text(e));
    }
  }
  return out;
}

void TrainerActor::load_state(TrainState s) {
  TROUPE_CHECK(ready_) << "setup() first";
  torch::NoGradGuard ng;
  auto take = [&](const std::string& name, torch::Tensor& t) {
    auto it = s.model.find(name);
    // A resume from another model's checkpoint: the user's input, so a
    // ConfigError (`troupe train` exits 2), naming the tensor.
    if (it == s.model.end())
      throw ConfigError("the checkpoint has no tensor '" + name + "', which this model has: it is another model's");
    if (!it->second.sizes().equals(t.sizes())) {
      std::ostringstream shapes;
      shapes << "the checkpoint's '" << name << "' is " << it->second.sizes() << ", this model's is " << t.sizes()
             << ": it is another model's";
      throw ConfigError(shapes.str());
    }
    t.copy_(it->second);
  };
  for (auto& [name, p] : model_->named_parameters()) take(name, p);
  for (auto& [name, b] : model_->named_buffers()) take(name, b);
  auto ls = s.optimizer.find("loss_scale");
  if (ls != s.optimizer.end()) {
    loss_scale_ = ls->second.item<double>();
    s.optimizer.erase(ls);
  }
  auto gs = s.optimizer.find("good_steps");
  if (gs != s.optimizer.end()) {
    good_steps_ = gs->second.item<int64_t>();
    s.optimizer.erase(gs);
  }
  ema_.clear();
  for (auto& [name, p] : model_->named_parameters()) {
    auto e = s.optimizer.find("ema/" + name);
    if (e == s.optimizer.end()) continue;
    if (!e->second.sizes().equals(p.sizes())) throw Error("the checkpoint's EMA of '" + name + "' has the wrong shape");
    ema_.push_back(e->second.to(p.device(), p.scalar_type()).clone());
    s.optimizer.erase(e);
  }
  if (!ema_.empty() && ema_.size() != model_->named_parameters().size())
    throw Error("the checkpoint's EMA covers only some parameters");
  optimizer_->load_state(s.optimizer);
  optimizer_->zero_grad();
  // Copies: a heal's tensors are views into the whole state block
  // received, which a step keeping one would hold alive.
  std::map<std::string, torch::Tensor> step_state;
  for (const auto& [name, t] : s.step_state) step_state[name] = t.clone();
  step_fn_->load_state(step_state);
  if (s.rng.defined()) {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(s.rng);
  }
  step_ = s.step;
  epoch_ = s.epoch;
  cursor_ = s.cursor;
}

TrainerActor::StepSnapshot TrainerActor::snapshot() {
  StepSnapshot s;
  for (auto& [name, b] : model_->named_buffers()) s.buffers.push_back(b.detach().clone());
  s.rng = at::detail::getDefaultCPUGenerator().get_state();
  // Where the step keeps it: a copy to the host every step would wait for
  // the device each step.
  s.step_state = step_state_copy(std::nullopt);
  s.taken = true;
  return s;
}

void TrainerActor::roll_back(const StepSnapshot& s) {
  torch::NoGradGuard ng;
  auto buffers = model_->named_buffers();
  if (s.buffers.size() == buffers.size())
    for (size_t i = 0; i < buffers.size(); ++i) buffers[i].second.copy_(s.buffers[i]);
  if (s.rng.defined()) {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(s.rng);
  }
  optimizer_->zero_grad();
  // The step's state as before the step cut short (a step that keeps none
  // takes the empty map).
  if (s.taken) step_fn_->load_state(s.step_state);
}

Progress TrainerActor::progress() {
  TROUPE_CHECK(ready_) << "setup() first";
  return Progress{step_, epoch_, cursor_};
}

namespace {
// A TrainState as one byte block, so a broadcast can carry it: [attachment
// count, body size, attachment sizes..., body, attachments...]. (Not a wire
// frame: a model's state may exceed a frame's attachment-count limit.)
torch::Tensor pack_state(const TrainState& state) {
  auto e = wire::encode_value(state);
  const auto& body = e.bytes();
  const auto& att = e.attachments();
  std::vector<uint64_t> header{att.size(), body.size()};
  for (const auto& a : att) header.push_back(a.size());
  int64_t length = static_cast<int64_t>(header.size() * sizeof(uint64_t) + body.size());
  for (const auto& a : att) length += static_cast<int64_t>(a.size());
  auto block = torch::empty({length}, torch::kUInt8);
  auto* out = static_cast<std::byte*>(block.data_ptr());
  std::memcpy(out, header.data(), header.size() * sizeof(uint64_t));
  out += header.size() * sizeof(uint64_t);
  std::memcpy(out, body.data(), body.size());
  out += body.size();
  for (const auto& a : att) {
    if (a.size()) std::memcpy(out, a.data(), a.size());
    out += a.size();
  }
  return block;
}

// The inverse of pack_state for a contiguous CPU block; the decoded tensors
// view the block. Throws DecodeError for a malformed one.
TrainState unpack_state(const torch::Tensor& block) {
  const auto* p = static_cast<const std::byte*>(block.data_ptr());
  const std::byte* end = p + block.numel();
  auto read_u64 = [&] {
    if (end - p < 8) throw DecodeError("heal: truncated state block");
    uint64_t v;
    std::memcpy(&v, p, 8);
    p += 8;
    return v;
  };
  const uint64_t n_att = read_u64();
  const uint64_t body_size = read_u64();
  if (n_att > (1u << 20)) throw DecodeError("heal: bad attachment count " + std::to_string(n_att));
  std::vector<uint64_t> sizes(n_att);
  for (auto& sz : sizes) sz = read_u64();
  auto owner = std::make_shared<torch::Tensor>(block);
  auto view = [&](uint64_t n) {
    if (static_cast<uint64_t>(end - p) < n) throw DecodeError("heal: truncated state block");
    Buffer b(std::shared_ptr<const void>(owner, owner->data_ptr()), p, n);
    p += n;
    return b;
  };
  Buffer body = view(body_size);
  std::vector<Buffer> att;
  for (auto sz : sizes) att.push_back(view(sz));
  return wire::decode_value<TrainState>(body.data(), body.size(), &att);
}
}  // namespace

Progress TrainerActor::heal(int64_t src) {
  TROUPE_CHECK(ready_) << "setup() first";
  TROUPE_CHECK(group_) << "join() first";
  TROUPE_CHECK(src >= 0 && src < group_->world_size()) << "heal source rank " << src << " out of range";
  const auto timeout = std::chrono::minutes(5);
  // The block's length goes first so every rank can allocate it, where the
  // group moves memory (NCCL broadcasts device memory, Gloo host memory).
  const torch::Device comm = group_on_device_ ? device_ : torch::Device(torch::kCPU);
  const bool mine = group_->rank() == src;
  // A source that cannot give its state (a step's state() that throws)
  // still sends a length, -1, so that no rank waits for a block that never
  // comes (they waited out the timeout, the driver behind them).
  torch::Tensor block;
  std::exception_ptr failed;
  if (mine) try {
      block = pack_state(state());
    } catch (...) {
      failed = std::current_exception();
    }
  auto len = torch::tensor({mine && !failed ? block.numel() : int64_t{mine ? -1 : 0}}, torch::kInt64).to(comm);
  group_->broadcast(len.data_ptr(), 1, collective::DType::kInt64, static_cast<int>(src))->wait(timeout);
  if (failed) std::rethrow_exception(failed);
  const int64_t length = len.to(torch::kCPU).item<int64_t>();
  // Not this rank's error: the source's (Gang::form shows it) decides
  // whether the job retries.
  if (length < 0)
    throw Aborted("the heal's source, rank " + std::to_string(src) +
                  ", could not give its state (its own error says why)");
  auto on_device = mine ? block.to(comm) : torch::empty({length}, torch::TensorOptions(torch::kUInt8).device(comm));
  group_->broadcast(on_device.data_ptr(), static_cast<size_t>(length), collective::DType::kUInt8, static_cast<int>(src))
      ->wait(timeout);
  if (!mine) {
    TrainState state = unpack_state(on_device.to(torch::kCPU).contiguous());
    // A survivor at the source's step keeps its own random stream: ranks
    // draw differently (ragged batches, per-rank noise), and the source's
    // stream changed what a survivor drew from here on, so the weights
    // differed from a run without the failure (even after a heal where no
    // process died). A replacement, or a survivor at another step, takes
    // the source's: its own is gone.
    if (step_ == state.step) state.rng = torch::Tensor();
    load_state(std::move(state));
  }
  return progress();
}

BenchReport TrainerActor::benchmark(int64_t steps, int64_t batch, int64_t warmup) {
  TROUPE_CHECK(ready_) << "setup() first";
  torch::manual_seed(static_cast<uint64_t>(config_.seed) + 1000 + (group_ ? group_->rank() : 0));
  // One batch of the data set's own samples (index i mod its size, this
  // rank's offset first), collated as training collates them, then reused.
  std::vector<actors::Sample> samples;
  const int64_t size = dataset_->size();
  const int64_t offset = (group_ ? group_->rank() : 0) * batch;
  for (int64_t i = 0; i < batch; ++i) samples.push_back(dataset_->get((offset + i) % size, 0));
  actors::Batch b;
  // micro_step() finishes it (Dataset::finish) on every step, as training does.
  b.tensors = dataset_->collate(std::move(samples)).to(device_);
  b.samples = batch;
  model_->train(true);
  const StepContext bench_context =
      step_context(0, group_ ? group_->rank() : 0, reducer_ ? reducer_->world_size() : 1, true);
  double loss = 0;
  for (int64_t s = 0; s < warmup; ++s) {
    // Read back too, so the device has finished the warm-up (its copy
    // queues behind the optimizer's kernels) before the clock starts.
    const auto pending = micro_step(b, true, bench_context);
    optimizer_step();
    resolve({pending});
  }
  if (group_) group_->barrier()->wait(std::chrono::minutes(2));
  auto t0 = Clock::now();
  for (int64_t s = 0; s < steps; ++s) {
    // Every step's loss read back before the next (as a training loop that
    // logs each step does, and as the benchmarks' peers do).
    const auto pending = micro_step(b, true, bench_context);
    optimizer_step();
    loss = resolve({pending}).at(0).loss_sum / static_cast<double>(batch);
  }
  if (group_) group_->barrier()->wait(std::chrono::minutes(2));
  BenchReport r;
  r.steps = steps;
  r.samples = steps * batch;
  r.seconds = seconds_since(t0);
  r.final_loss = loss;
  return r;
}

int64_t TrainerActor::pid() { return static_cast<int64_t>(::getpid()); }

int64_t TrainerActor::shm_allreduces() { return shm_ ? shm_->shm_allreduces() : 0; }

}  // namespace troupe::trainer
