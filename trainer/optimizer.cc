#include "troupe/trainer/optimizer.h"

#include <cmath>

#include <torch/torch.h>

#include "troupe/runtime/core/errors.h"

namespace troupe::trainer {

void validate(const OptimizerConfig& c) {
  if (c.name != "sgd" && c.name != "adamw") throw ConfigError("unknown optimizer '" + c.name + "' (known: sgd, adamw)");
  if (!(c.lr > 0)) throw ConfigError("optimizer lr must be positive, got " + std::to_string(c.lr));
  if (c.momentum < 0 || c.momentum >= 1) throw ConfigError("optimizer momentum must be in [0, 1)");
  if (c.beta1 < 0 || c.beta1 >= 1 || c.beta2 < 0 || c.beta2 >= 1)
    throw ConfigError("optimizer betas must be in [0, 1)");
  if (c.weight_decay < 0) throw ConfigError("optimizer weight_decay must not be negative");
}

void validate(const ScheduleConfig& s) {
  if (s.warmup_steps < 0) throw ConfigError("schedule warmup_steps must not be negative");
  if (s.decay != "constant" && s.decay != "cosine")
    throw ConfigError("unknown schedule decay '" + s.decay + "' (known: constant, cosine)");
  if (s.decay == "cosine" && s.total_steps <= 0) throw ConfigError("cosine decay needs total_steps > 0");
}

double learning_rate(const OptimizerConfig& opt, const ScheduleConfig& s, int64_t step, int64_t world_size) {
  double lr = opt.lr * (s.scale_with_world ? static_cast<double>(world_size) : 1.0);
  if (s.warmup_steps > 0 && step < s.warmup_steps) lr *= static_cast<double>(step + 1) / s.warmup_steps;
  if (s.decay == "cosine") {
    double t = std::min(1.0, static_cast<double>(std::max<int64_t>(0, step - s.warmup_steps)) /
                                 std::max<int64_t>(1, s.total_steps - s.warmup_steps));
    lr *= s.min_factor + (1 - s.min_factor) * 0.5 * (1 + std::cos(M_PI * t));
  }
  return lr;
}

Optimizer::Optimizer(OptimizerConfig config, std::vector<std::pair<std::string, torch::Tensor>> params)
    : config_(std::move(config)) {
  validate(config_);
  for (auto& [name, p] : params) slots_.push_back(Slot{name, p, {}, {}});
}

void Optimizer::zero_grad() {
  std::vector<torch::Tensor> cuda;
  for (auto& s : slots_) {
    auto& g = s.param.mutable_grad();
    if (!g.defined()) continue;
    if (g.is_cuda()) {
      cuda.push_back(g);
    } else {
      g.zero_();
    }
  }
  if (!cuda.empty()) at::_foreach_zero_(cuda);
}

bool Optimizer::on_cuda() const {
  if (slots_.empty()) return false;
  for (const auto& s : slots_)
    if (!s.param.is_cuda() || s.param.device() != slots_.front().param.device()) return false;
  return true;
}

// The same arithmetic as the per-parameter loop below, as torch.optim's
// foreach implementations do it on a GPU: a handful of multi-tensor kernels
// per step instead of several kernels per parameter, whose launches would
// otherwise bound a step of a model with many small parameters.
void Optimizer::step_foreach(double lr) {
  const auto& c = config_;
  std::vector<Slot*> live;
  for (auto& s : slots_)
    if (s.param.grad().defined()) live.push_back(&s);
  if (live.empty()) return;
  std::vector<torch::Tensor> params, grads;
  for (auto* s : live) {
    params.push_back(s->param);
    grads.push_back(s->param.grad());
  }
  if (c.name == "sgd") {
    std::vector<torch::Tensor> d = c.weight_decay != 0 ? at::_foreach_add(grads, params, c.weight_decay) : grads;
    if (c.momentum != 0) {
      // buf = d on a parameter's first step, else buf = μ·buf + d.
      std::vector<torch::Tensor> bufs, older, older_d;
      for (size_t i = 0; i < live.size(); ++i) {
        if (!live[i]->buf.defined()) {
          live[i]->buf = d[i].clone();
        } else {
          older.push_back(live[i]->buf);
          older_d.push_back(d[i]);
        }
        bufs.push_back(live[i]->buf);
      }
      if (!older.empty()) {
        at::_foreach_mul_(older, c.momentum);
        at::_foreach_add_(older, older_d);
      }
      d = c.nesterov ? at::_foreach_add(d, bufs, c.momentum) : bufs;
    }
    at::_foreach_add_(params, d, -lr);
    return;
  }
  std::vector<torch::Tensor> m, v;
  for (auto* s : live) {
    if (!s->buf.defined()) {
      s->buf = torch::zeros_like(s->param);
      s->sq = torch::zeros_like(s->param);
    }
    m.push_back(s->buf);
    v.push_back(s->sq);
  }
  at::_foreach_mul_(params, 1 - lr * c.weight_decay);
  at::_foreach_mul_(m, c.beta1);
  at::_foreach_add_(m, grads, 1 - c.beta1);
  at::_foreach_mul_(v, c.beta2);
  at::_foreach_addcmul_(v, grads, grads, 1 - c.beta2);
  double bc1 = 1 - std::pow(c.beta1, static_cast<double>(steps_));
  double bc2 = 1 - std::pow(c.beta2, static_cast<double>(steps_));
  auto denom = at::_foreach_sqrt(v);
  at::_foreach_div_(denom, std::sqrt(bc2));
  at::_foreach_add_(denom, c.eps);
  at::_foreach_addcdiv_(params, m, denom, -lr / bc1);
}

void Optimizer::step(double lr) {
  torch::NoGradGuard no_grad;
  ++steps_;
  if (on_cuda()) {
    step_foreach(lr);
    return;
  }
  const auto& c = config_;
  for (auto& s : slots_) {
    const auto& g0 = s.param.grad();
    if (!g0.defined()) continue;
    if (c.name == "sgd") {
      // torch.optim.SGD: d = g + wd·p; buf = μ·buf + d (buf = d at first);
      // d = nesterov ? d + μ·buf : buf; p -= lr·d.
      torch::Tensor d = c.weight_decay != 0 ? g0.add(s.param, c.weight_decay) : g0;
      if (c.momentum != 0) {
        if (!s.buf.defined()) {
          s.buf = d.clone();
        } else {
          s.buf.mul_(c.momentum).add_(d);
        }
        d = c.nesterov ? d.add(s.buf, c.momentum) : s.buf;
      }
      s.param.add_(d, -lr);
    } else {
      // torch.optim.AdamW (single-tensor path).
      if (!s.buf.defined()) {
        s.buf = torch::zeros_like(s.param);
        s.sq = torch::zeros_like(s.param);
      }
      s.param.mul_(1 - lr * c.weight_decay);
      s.buf.mul_(c.beta1).add_(g0, 1 - c.beta1);
      s.sq.mul_(c.beta2).addcmul_(g0, g0, 1 - c.beta2);
      double bc1 = 1 - std::pow(c.beta1, static_cast<double>(steps_));
      double bc2 = 1 - std::pow(c.beta2, static_cast<double>(steps_));
      double step_size = lr / bc1;
      auto denom = (s.sq.sqrt() / std::sqrt(bc2)).add_(c.eps);
      s.param.addcdiv_(s.buf, denom, -step_size);
    }
  }
}

std::map<std::string, torch::Tensor> Optimizer::state() const {
  std::map<std::string, torch::Tensor> out;
  out["step"] = torch::tensor(steps_, torch::kInt64);
  for (const auto& s : slots_) {
    if (!s.buf.defined()) continue;
    if (config_.name == "sgd") {
      out[s.name + ".momentum_buffer"] = s.buf.detach().to(torch::kCPU).clone();
    } else {
      out[s.name + ".exp_avg"] = s.buf.detach().to(torch::kCPU).clone();
      out[s.name + ".exp_avg_sq"] = s.sq.detach().to(torch::kCPU).clone();
    }
  }
  return out;
}

void Optimizer::load_state(const std::map<std::string, torch::Tensor>& state) {
  torch::NoGradGuard no_grad;
  auto it = state.find("step");
  if (it == state.end()) throw Error("optimizer state has no 'step'");
  // A checkpoint of the other optimizer: said so, not as a missing entry.
  const char* theirs = nullptr;
  for (const auto& [key, tensor] : state) {
    if (key.ends_with(".momentum_buffer")) theirs = "sgd";
    if (key.ends_with(".exp_avg")) theirs = "adamw";
  }
  // (An SGD without momentum keeps no state: any checkpoint will do.)
  const bool keeps_state = config_.name == "adamw" || config_.momentum != 0;
  if (theirs && config_.name != theirs && keeps_state)
    throw ConfigError(std::string("the checkpoint's optimizer state is ") + theirs +
                      "'s, and this job's optimizer is " + config_.name +
                      ": resume with the optimizer it was written with (--optimizer " + theirs + ", or optimizer=\"" +
                      theirs + "\"), or start from a checkpoint directory of its own");
  steps_ = it->second.item<int64_t>();
  auto take = [&](const Slot& s, const std::string& key) -> torch::Tensor {
    auto f = state.find(s.name + "." + key);
    if (f == state.end()) return {};
    if (!f->second.sizes().equals(s.param.sizes()))
      throw Error("optimizer state '" + f->first + "' has the wrong shape");
    return f->second.to(s.param.device(), s.param.scalar_type()).clone();
  };
  for (auto& s : slots_) {
    if (config_.name == "sgd") {
      s.buf = take(s, "momentum_buffer");
    } else {
      s.buf = take(s, "exp_avg");
      s.sq = take(s, "exp_avg_sq");
      if (s.buf.defined() != s.sq.defined()) throw Error("optimizer state of '" + s.name + "' is incomplete");
    }
    if (steps_ > 0 && !s.buf.defined() && (config_.name == "adamw" || config_.momentum != 0))
      throw Error("optimizer state has no entry for parameter '" + s.name +
                  "' (a checkpoint written by another optimizer, or by SGD without momentum? resume with the "
                  "optimizer that wrote it)");
  }
}

}  // namespace troupe::trainer
