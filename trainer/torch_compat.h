// What differs between the LibTorch versions troupe builds against
// (Debian's 1.13 and the 2.x of current PyTorch wheels), in one place, so
// the trainer itself has no version checks. Add a shim here rather than an
// #if at the point of use.
#pragma once

#include <memory>

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/version.h>

namespace troupe::trainer::compat {

// Keeps a gradient-accumulator node alive behind a type-erased pointer
// whose get() is the Node*: 1.13 hands the node out as a
// std::shared_ptr<Node>, 2.x as a c10::intrusive_ptr<Node>.
template <class NodePtr>
std::shared_ptr<void> keep_alive(NodePtr node) {
  torch::autograd::Node* raw = node.get();
  return std::shared_ptr<void>(raw, [owner = std::move(node)](void*) mutable { owner.reset(); });
}

// Turns CUDA autocast on or off for this thread, computing in `dtype`
// (kHalf or kBFloat16) while on: 1.13 has only the device-less
// set_enabled(bool) and set_autocast_gpu_dtype, which 2.4+ deprecates in
// favour of set_autocast_enabled / set_autocast_dtype(device type, ...).
inline void set_cuda_autocast(bool on, at::ScalarType dtype = at::kHalf) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  if (on) at::autocast::set_autocast_dtype(at::kCUDA, dtype);
  at::autocast::set_autocast_enabled(at::kCUDA, on);
#else
  if (on) at::autocast::set_autocast_gpu_dtype(dtype);
  at::autocast::set_enabled(on);
#endif
}

// Turns CPU autocast on or off for this thread, computing in `dtype`
// (kBFloat16) while on: 1.13 spells it set_cpu_enabled and
// set_autocast_cpu_dtype, 2.4+ as for CUDA above.
inline void set_cpu_autocast(bool on, at::ScalarType dtype = at::kBFloat16) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  if (on) at::autocast::set_autocast_dtype(at::kCPU, dtype);
  at::autocast::set_autocast_enabled(at::kCPU, on);
#else
  if (on) at::autocast::set_autocast_cpu_dtype(dtype);
  at::autocast::set_cpu_enabled(on);
#endif
}

// Whether CPU autocast is on for this thread: 1.13's is_cpu_enabled, 2.4+'s
// is_autocast_enabled(device type).
inline bool cpu_autocast_enabled() {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  return at::autocast::is_autocast_enabled(at::kCPU);
#else
  return at::autocast::is_cpu_enabled();
#endif
}

}  // namespace troupe::trainer::compat
